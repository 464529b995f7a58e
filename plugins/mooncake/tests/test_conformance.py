"""kvwire's backend and mapper conformance suites against ``mooncake`` (TCP transport), with
the target agent in a separate process."""

from kvwire.testing.conformance import BackendConformance, MapperConformance


class TestMooncakeConformance(BackendConformance):
    backend_name = "mooncake"
    backend_options = {"protocol": "tcp"}
    fast_failure_options = {"transfer_timeout_s": 5.0}
    peer_failure_timeout_s = 10.0
    close_timeout_s = 5.0


class TestMooncakeMapperConformance(MapperConformance):
    backend_name = "mooncake"
    backend_options = {"protocol": "tcp"}
