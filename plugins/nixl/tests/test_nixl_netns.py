"""Cross-host behaviour over NIXL (UCX over TCP, interfaces as UCX picks them): prefill and
decode in separate network namespaces (needs root; skipped with the reason elsewhere)."""

from typing import Any

from kvwire.testing.netns_suite import NetnsConformance


class TestNixlNetns(NetnsConformance):
    backend_name = "nixl"

    @classmethod
    def backend_options(cls, addr: str) -> dict[str, Any]:
        """NIXL binds no address of its own; UCX is kept to TCP on the namespace's interface
        (every node's is ``eth0``): left to itself it takes the nodes for one host (same
        machine id) and its shared-memory transports cannot connect across namespaces."""
        return {"ucx_env": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}}
