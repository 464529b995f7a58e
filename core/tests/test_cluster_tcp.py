"""End-to-end cluster tests (real processes, every element verified) on the ``tcp`` backend."""

from kvwire.testing.cluster_suite import ClusterConformance, ClusterFailures


class TestTcpCluster(ClusterConformance):
    backend_name = "tcp"


class TestTcpClusterFailures(ClusterFailures):
    backend_name = "tcp"
