"""Cross-host behaviour over Mooncake Transfer Engine (TCP): prefill and decode in separate
network namespaces, the engine bound to the namespace addresses (needs root; skipped with the
reason elsewhere)."""

from kvwire.testing.netns_suite import DataPlaneLoopback


class TestMooncakeNetns(DataPlaneLoopback):
    backend_name = "mooncake"
