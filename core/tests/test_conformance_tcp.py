"""Run kvwire's backend and mapper conformance suites against the ``tcp`` reference backend,
with the target agent in a separate process."""

from kvwire.testing.conformance import BackendConformance, MapperConformance


class TestTcpConformance(BackendConformance):
    backend_name = "tcp"
    backend_options = {}
    fast_failure_options = {"transfer_timeout_s": 2.0}
    peer_failure_timeout_s = 10.0


class TestTcpMapperConformance(MapperConformance):
    backend_name = "tcp"
    backend_options = {}
