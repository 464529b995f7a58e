"""The CUDA run mover: one Triton launch copies every tile of a :class:`TilePlan`.

Imported only where it runs (a CUDA device, or Triton's interpreter on the CPU with
``TRITON_INTERPRET=1`` set before import, as the CPU tests do). One program per tile: it
loads the tile's source and destination addresses and its length (elements) from the plan
table, turns the addresses into pointers of the plan's element type and copies the tile
(at most ``tile_bytes``, 64 KiB by default) in steps of :data:`~kvwire.movers.plan.BLOCK_BYTES`
with masked loads and stores. A run of at most one tile (a KV page of one layer) is its own
tile, so the host plans such run lists without expanding them. Alignment hints (every
address and length divides by the plan's width, :func:`~kvwire.movers.plan.element_width`)
let Triton emit 16-byte vector accesses (``ld.global.v4.b32``/``st.global.v4.b32``, checked
in the compiled PTX) when the width is 16.

Destinations may be any memory the launching device can store to: its own, or a peer GPU's
opened through CUDA IPC once peer access from the launching device is enabled.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from kvwire.movers.plan import BLOCK_BYTES, DEFAULT_TILE_BYTES, TilePlan, plan_tiles

#: Element type of each width (wider than 4 bytes: int32 vectors of width/4 lanes).
_ELEM = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int32, 16: tl.int32}
_ELEM_BYTES = {1: 1, 2: 2, 4: 4, 8: 4, 16: 4}


@triton.jit  # type: ignore[untyped-decorator]
def _copy_tiles(  # type: ignore[no-untyped-def]  # Triton 3.6 rejects non-Triton annotations
    table_ptr,
    num_tiles,
    block: tl.constexpr,
    elem: tl.constexpr,
    align: tl.constexpr,
    vec: tl.constexpr,
) -> None:
    # table: int64 [3, num_tiles] = source address, destination address, length in elements.
    pid = tl.program_id(0).to(tl.int64)
    s = tl.load(table_ptr + pid)
    d = tl.load(table_ptr + num_tiles + pid)
    n = tl.multiple_of(tl.load(table_ptr + 2 * num_tiles + pid), vec)
    sp = tl.multiple_of(s.to(tl.pointer_type(elem)), align)
    dp = tl.multiple_of(d.to(tl.pointer_type(elem)), align)
    offs = tl.arange(0, block)
    for start in range(0, n, block):
        o = start + offs
        mask = o < n
        v = tl.load(sp + o, mask=mask)
        tl.store(dp + o, v, mask=mask)


def plan_table(plan: TilePlan) -> np.ndarray:
    """The plan as the kernel reads it: ``int64 [3, tiles]`` (src, dst, elements of
    ``_ELEM_BYTES[width]`` bytes)."""
    scale = plan.width // _ELEM_BYTES[plan.width]
    return np.stack([plan.src, plan.dst, plan.elems * scale])


def launch_plan(plan: TilePlan, device: Any, stream: Any = None, num_warps: int = 4) -> Any:
    """Enqueue the copy of ``plan`` on ``stream`` (default: ``device``'s current stream).

    The plan table travels through pinned host memory with a non-blocking copy on that
    stream (torch's caching host allocator keeps the block until the copy ran), so the call
    never waits for the GPU. On a CPU device (Triton's interpreter) it runs synchronously.
    Returns what Triton's launch returns (the compiled kernel on a GPU: its ``asm`` holds
    the PTX), or None for an empty plan.
    """
    if plan.num_tiles == 0:
        return None
    dev = torch.device(device)
    table = plan_table(plan)
    elem_bytes = _ELEM_BYTES[plan.width]
    meta = {
        "block": min(plan.tile_bytes, BLOCK_BYTES) // elem_bytes,
        "elem": _ELEM[plan.width],
        "align": plan.width,
        "vec": plan.width // elem_bytes,
    }
    grid = (plan.num_tiles,)
    if dev.type != "cuda":
        return _copy_tiles[grid](torch.from_numpy(table), plan.num_tiles, **meta)
    host = torch.empty(table.shape, dtype=torch.int64, pin_memory=True)
    host.numpy()[...] = table
    stream = stream if stream is not None else torch.cuda.current_stream(dev)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    same = torch.cuda.current_device() == index
    with contextlib.nullcontext() if same else torch.cuda.device(dev), torch.cuda.stream(stream):
        dtable = host.to(dev, non_blocking=True)
        return _copy_tiles[grid](dtable, plan.num_tiles, num_warps=num_warps, **meta)


class RunCopier:
    """Copies run lists on one device with one launch per call.

    Built by a backend for the device that launches the copies (the writer). Any thread may
    call :meth:`copy`: planning runs unlocked, launches are serialised by a lock of its own
    (held for the launch only, never while the GPU works; it keeps Triton's first-launch
    compilation and cache fill single-threaded). Ordering between calls is the stream's.
    """

    def __init__(
        self, device: Any, tile_bytes: int = DEFAULT_TILE_BYTES, num_warps: int = 4
    ) -> None:
        self.device = torch.device(device)
        self.tile_bytes = tile_bytes
        self.num_warps = num_warps
        self._lock = threading.Lock()
        #: The kernel of the last launch (its ``asm`` holds the PTX), for checks.
        self.last_kernel: Any = None

    def copy(self, src: Any, dst: Any, nbytes: Any, stream: Any = None) -> TilePlan:
        """Plan and enqueue the copy of runs ``(src, dst, nbytes)``; returns the plan."""
        plan = plan_tiles(src, dst, nbytes, self.tile_bytes)
        with self._lock:
            self.last_kernel = launch_plan(plan, self.device, stream, self.num_warps)
        return plan
