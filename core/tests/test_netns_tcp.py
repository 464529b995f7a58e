"""Cross-host behaviour on the ``tcp`` backend: prefill and decode in separate network
namespaces (needs root; skipped with the reason elsewhere)."""

from kvwire.testing.netns_suite import DataPlaneLoopback


class TestTcpNetns(DataPlaneLoopback):
    backend_name = "tcp"
