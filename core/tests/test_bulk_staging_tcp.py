"""Bulk staging end to end on the ``tcp`` backend (real processes, every element verified)."""

from kvwire.testing.cluster_suite import (
    BulkEqualTPConformance,
    BulkStagingConformance,
    BulkStagingFaults,
)


class TestTcpBulkStaging(BulkStagingConformance):
    backend_name = "tcp"


class TestTcpBulkStagingFaults(BulkStagingFaults):
    backend_name = "tcp"


class TestTcpBulkEqualTP(BulkEqualTPConformance):
    backend_name = "tcp"
