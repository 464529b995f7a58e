"""kvwire's backend and mapper conformance suites against the ``nixl`` backend, with the
target agent in a spawned process (UCX over cma/tcp on a CPU machine)."""

from kvwire.testing.conformance import BackendConformance, MapperConformance


class TestNixlConformance(BackendConformance):
    backend_name = "nixl"
    backend_options = {}
    # cma (and RDMA) writes need no CPU on the target once connected.
    one_sided_writes = True
    fast_failure_options = {"transfer_timeout_s": 2.0}
    peer_failure_timeout_s = 10.0


class TestNixlMapperConformance(MapperConformance):
    backend_name = "nixl"
    backend_options = {}
