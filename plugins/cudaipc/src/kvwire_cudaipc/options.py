"""Options of the ``cudaipc`` backend (the config's ``transfer_backend_options``): the side
channel's (``tcp``'s), the SM mover's, and the rule that sends a few large runs to the copy
engines (:mod:`kvwire_cudaipc.copies`)."""

from __future__ import annotations

from pydantic import Field

from kvwire.backends.tcp import TcpOptions
from kvwire.movers.plan import DEFAULT_TILE_BYTES


class CudaIpcOptions(TcpOptions):
    """Options of the ``cudaipc`` backend: the side channel's (``tcp``'s) and the mover's."""

    tile_bytes: int = Field(
        default=DEFAULT_TILE_BYTES, ge=16, description="Bytes per mover tile (power of two)."
    )
    num_warps: int = Field(default=4, ge=1, le=32, description="Warps per mover program.")
    copy_engine_min_bytes: int = Field(
        default=2 << 20,
        ge=0,
        description="A submit of at most copy_engine_max_runs VRAM runs (after merging runs that "
        "continue each other on both sides), each of at least this many bytes (bulk staging's "
        "blocks; a layer group of contiguous pages), goes to the GPU's copy engines, one "
        "cudaMemcpyAsync per run, leaving the SMs to the engine's kernels; 0: every run list "
        "to the SM mover.",
    )
    copy_engine_max_runs: int = Field(default=64, ge=1, description="See copy_engine_min_bytes.")
    batch_max_bytes: int = Field(
        default=32 << 20,
        ge=0,
        description="Page writes under this many bytes that a prefill worker submits in one "
        "turn of its loop go out together, up to this many bytes a launch: one mover launch "
        "per shape and one event for all (post_batch). A larger chunk launches alone at its "
        "submit (held, it would wait for the others and they for it: 4 x H100, 128 MiB "
        "chunks at C=8 held 8 at a time moved 0.67x). The lean lane takes only chunks under "
        "it, in launches that close once they reach it (kvwire_cudaipc.lane). 0: a launch "
        "and an event per chunk, and no lane.",
    )


__all__ = ["CudaIpcOptions"]
