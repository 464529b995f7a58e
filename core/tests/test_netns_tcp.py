"""Cross-host behaviour on the ``tcp`` backend: prefill and decode in separate network
namespaces (needs root; skipped with the reason elsewhere)."""

from kvwire.testing.netns_suite import NetnsConformance


class TestTcpNetns(NetnsConformance):
    backend_name = "tcp"
