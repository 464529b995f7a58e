"""kvwire's backend and mapper conformance suites against the ``cudaipc`` backend, target
agent in a spawned process.

On a machine without a GPU this covers the host-memory path and everything the VRAM path
shares with it: handshake metadata, lifecycles, notifications after data (posted over the
side channel only once the transfer's rows landed), refusals, peer removal and close. The
VRAM path itself (IPC handles, peer access, the fused mover) runs only on a GPU machine:
``scripts/gpu_cudaipc_bench.py`` checks it there, every element verified."""

from kvwire.testing.conformance import BackendConformance, MapperConformance


class TestCudaIpcConformance(BackendConformance):
    backend_name = "cudaipc"
    backend_options = {}
    fast_failure_options = {"transfer_timeout_s": 2.0}
    peer_failure_timeout_s = 10.0


class TestCudaIpcMapperConformance(MapperConformance):
    backend_name = "cudaipc"
    backend_options = {}
