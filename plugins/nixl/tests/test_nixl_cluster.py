"""The control plane's end-to-end cluster tests over NIXL (UCX on CPU, real processes, every
element verified): equal TP, both heterogeneous directions, MLA, chunked prefill and cached
prefixes, dead peers and aborts."""

from kvwire.testing.cluster_suite import (
    BulkEqualTPConformance,
    BulkStagingConformance,
    ClusterConformance,
    ClusterFailures,
)


class TestNixlCluster(ClusterConformance):
    backend_name = "nixl"
    topologies = ("equal-2to2", "gather-2to1", "scatter-1to2", "mla-2to1")


class TestNixlClusterFailures(ClusterFailures):
    backend_name = "nixl"


class TestNixlBulkStaging(BulkStagingConformance):
    """Bulk staging over Nixl: both heterogeneous directions with GQA replication (total
    heads below TP), a ring that wraps many times."""

    backend_name = "nixl"
    topologies = ("gather-replicated-4to2-h2", "scatter-replicated-1to4-h2")


class TestNixlBulkEqualTP(BulkEqualTPConformance):
    """Equal-TP links staged over Nixl (whole pages gathered into ring blocks)."""

    backend_name = "nixl"
