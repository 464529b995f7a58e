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
import logging
import threading
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from kvwire import cuda_events
from kvwire.cuda_launch import CompiledKernels
from kvwire.movers.plan import (
    BLOCK_BYTES,
    DEFAULT_TILE_BYTES,
    GroupPlan,
    TilePlan,
    plan_groups,
    plan_tiles,
)

logger = logging.getLogger(__name__)

#: Element type of each width (wider than 4 bytes: int32 vectors of width/4 lanes).
_ELEM = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int32, 16: tl.int32}
_ELEM_BYTES = {1: 1, 2: 2, 4: 4, 8: 4, 16: 4}


@triton.jit(do_not_specialize=["table_addr", "num_tiles"])  # type: ignore[untyped-decorator]
def _copy_tiles(  # type: ignore[no-untyped-def]  # Triton 3.6 rejects non-Triton annotations
    table_addr,
    num_tiles,
    block: tl.constexpr,
    elem: tl.constexpr,
    align: tl.constexpr,
    vec: tl.constexpr,
) -> None:
    # table (at address table_addr: device memory, or pinned host memory read over the bus):
    # int64 [3, num_tiles] = source address, destination address, length in elements.
    table_ptr = table_addr.to(tl.pointer_type(tl.int64))
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


@triton.jit(  # type: ignore[untyped-decorator]
    do_not_specialize=["table_addr", "num_groups", "n_elems", "src_stride", "dst_stride"]
)
def _copy_groups(  # type: ignore[no-untyped-def]  # Triton 3.6 rejects non-Triton annotations
    table_addr,
    num_groups,
    n_elems,
    src_stride,
    dst_stride,
    block: tl.constexpr,
    elem: tl.constexpr,
    align: tl.constexpr,
    vec: tl.constexpr,
) -> None:
    # table: int64 [3, num_groups] = first source, first destination, pieces. Every piece is
    # n_elems long; piece t of a group starts t * stride elements after the group's first.
    table_ptr = table_addr.to(tl.pointer_type(tl.int64))
    pid = tl.program_id(0).to(tl.int64)
    s = tl.load(table_ptr + pid)
    d = tl.load(table_ptr + num_groups + pid)
    count = tl.load(table_ptr + 2 * num_groups + pid)
    sp = s.to(tl.pointer_type(elem))
    dp = d.to(tl.pointer_type(elem))
    n = tl.multiple_of(n_elems, vec)
    offs = tl.arange(0, block)
    for t in range(0, count):
        a = tl.multiple_of(sp + t * src_stride, align)
        b = tl.multiple_of(dp + t * dst_stride, align)
        for start in range(0, n, block):
            o = start + offs
            mask = o < n
            tl.store(b + o, tl.load(a + o, mask=mask), mask=mask)


def plan_table(plan: TilePlan, out: np.ndarray | None = None) -> np.ndarray:
    """The plan as the kernel reads it: ``int64 [3, tiles]`` (src, dst, elements of
    ``_ELEM_BYTES[width]`` bytes), written into ``out`` when given."""
    scale = plan.width // _ELEM_BYTES[plan.width]
    table = np.stack([plan.src, plan.dst, plan.elems], out=out)
    if scale != 1:
        table[2] *= scale
    return table


def _meta(plan: TilePlan) -> dict[str, Any]:
    elem_bytes = _ELEM_BYTES[plan.width]
    return {
        "block": min(plan.tile_bytes, BLOCK_BYTES) // elem_bytes,
        "elem": _ELEM[plan.width],
        "align": plan.width,
        "vec": plan.width // elem_bytes,
    }


def launch_plan(plan: TilePlan, device: Any, stream: Any = None, num_warps: int = 4) -> Any:
    """Enqueue the copy of ``plan`` on ``stream`` (default: ``device``'s current stream),
    the simple way (:class:`RunCopier` is the fast one).

    The plan table travels through freshly pinned host memory with a non-blocking copy on
    that stream (torch's caching host allocator keeps the block until the copy ran), so the
    call never waits for the GPU. On a CPU device (Triton's interpreter) it runs
    synchronously. Returns what Triton's launch returns (the compiled kernel on a GPU: its
    ``asm`` holds the PTX), or None for an empty plan.
    """
    if plan.num_tiles == 0:
        return None
    dev = torch.device(device)
    table = plan_table(plan)
    meta = _meta(plan)
    grid = (plan.num_tiles,)
    if dev.type != "cuda":
        t = torch.from_numpy(table)
        return _copy_tiles[grid](t.data_ptr(), plan.num_tiles, **meta)
    host = torch.empty(table.shape, dtype=torch.int64, pin_memory=True)
    host.numpy()[...] = table
    stream = stream if stream is not None else torch.cuda.current_stream(dev)
    with _on(dev), torch.cuda.stream(stream):
        dtable = host.to(dev, non_blocking=True)
        return _copy_tiles[grid](dtable.data_ptr(), plan.num_tiles, num_warps=num_warps, **meta)


def _on(dev: Any) -> Any:
    """``torch.cuda.device(dev)`` unless it is current already."""
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if torch.cuda.current_device() == index:
        return contextlib.nullcontext()
    return torch.cuda.device(dev)


class _TableSlots:
    """Pinned host memory for plan tables, cut into ``count`` slots of ``slot_elems`` int64.

    The kernel reads a table straight from its slot (pinned memory is mapped into the
    device's address space), so a launch needs no upload and no device allocation. A slot is
    reused once the event recorded after its launch completed (waited for only when every
    slot is in flight). Used under :class:`RunCopier`'s lock.
    """

    def __init__(self, count: int, slot_elems: int) -> None:
        self.slot_elems = slot_elems
        self.host = torch.empty((count, slot_elems), dtype=torch.int64, pin_memory=True)
        self.arr = self.host.numpy()
        self.base = int(self.host.data_ptr())
        self.events: list[Any] = [None] * count
        self.next = 0

    def take(self) -> int:
        """A free slot (waits for the oldest launch only when every slot is in flight)."""
        i = self.next
        self.next = (i + 1) % len(self.events)
        ev = self.events[i]
        if ev is not None and not ev.query():
            ev.synchronize()
        return i

    def addr(self, i: int) -> int:
        return self.base + i * self.slot_elems * 8

    def launched(self, i: int, stream: Any) -> None:
        ev = self.events[i]
        if ev is None:
            ev = self.events[i] = torch.cuda.Event()  # type: ignore[no-untyped-call]
        cuda_events.record(ev, stream)


class RunCopier:
    """Copies run lists on one device with one launch per call.

    Built by a backend for the device that launches the copies (the writer). Any thread may
    call :meth:`copy`: planning runs unlocked, launches are serialised by a lock of its own
    (held for the launch only, never while the GPU works; it keeps Triton's first-launch
    compilation and cache fill single-threaded). Ordering between calls is the stream's.

    The host work of a launch on a GPU is kept small: the tile table is written into a
    pinned slot the kernel reads directly (no upload, no device allocation, no
    synchronisation), and after the first launch of a kernel variant the compiled kernel is
    launched directly (Triton's argument binding and cache lookup skipped). A table larger
    than a slot (``slot_tiles`` tiles) is uploaded as :func:`launch_plan` does.
    """

    def __init__(
        self,
        device: Any,
        tile_bytes: int = DEFAULT_TILE_BYTES,
        num_warps: int = 4,
        *,
        slots: int = 16,
        slot_tiles: int = 16384,
    ) -> None:
        self.device = torch.device(device)
        self.tile_bytes = tile_bytes
        self.num_warps = num_warps
        self._lock = threading.Lock()
        self._slots_count, self._slot_tiles = slots, slot_tiles
        self._slots: _TableSlots | None = None
        #: Compiled kernels by (block, elem, align, vec) (groups: prefixed by "groups"),
        #: launched directly after the first (off once this Triton refused it).
        self._kernels = CompiledKernels("mover")
        #: The kernel of the last launch (its ``asm`` holds the PTX), for checks.
        self.last_kernel: Any = None

    def copy(self, src: Any, dst: Any, nbytes: Any, stream: Any = None) -> TilePlan:
        """Plan and enqueue the copy of runs ``(src, dst, nbytes)``; returns the plan."""
        plan = plan_tiles(src, dst, nbytes, self.tile_bytes)
        self.launch(plan, stream)
        return plan

    def move(self, src: Any, dst: Any, nbytes: Any, stream: Any = None) -> TilePlan | GroupPlan:
        """Like :meth:`copy`, but a run list of one short length (at most
        :data:`~kvwire.movers.plan.BLOCK_BYTES`) in evenly spaced groups (a head slice of
        every token row of a page, heterogeneous TP) is copied with one
        program per group (:func:`~kvwire.movers.plan.plan_groups`: a few thousand programs
        instead of one per token, and a table that fits a slot); any other list as
        :meth:`copy` does. Returns the plan launched."""
        groups = plan_groups(src, dst, nbytes, max_piece=min(self.tile_bytes, BLOCK_BYTES))
        if groups is None:
            return self.copy(src, dst, nbytes, stream)
        self.launch_groups(groups, stream)
        return groups

    def launch_groups(self, plan: GroupPlan, stream: Any = None) -> None:
        """Enqueue the copy of a group plan: its table into a pinned slot (uploaded when it
        does not fit one), one launch; never waits for the GPU unless every slot is in
        flight."""
        g = plan.num_groups
        if g == 0:
            return
        eb = _ELEM_BYTES[plan.width]
        step = BLOCK_BYTES if plan.n >= BLOCK_BYTES else max(1 << (plan.n - 1).bit_length(), 16)
        step = min(step, BLOCK_BYTES)
        key = (max(step // eb, 1), _ELEM[plan.width], plan.width, plan.width // eb)
        scalars = (plan.n // eb, plan.src_stride // eb, plan.dst_stride // eb)
        table = np.stack([plan.src, plan.dst, plan.count])
        with self._lock:
            if self.device.type != "cuda":  # Triton's interpreter: host memory, synchronous
                self.last_kernel = _copy_groups[(g,)](table.ctypes.data, g, *scalars, *key)
                return
            stream = stream if stream is not None else torch.cuda.current_stream(self.device)
            with _on(self.device):
                if g > self._slot_tiles:  # too large for a slot: upload it (rare)
                    host = torch.empty(table.shape, dtype=torch.int64, pin_memory=True)
                    host.numpy()[...] = table
                    with torch.cuda.stream(stream):
                        dtable = host.to(self.device, non_blocking=True)
                        self.last_kernel = _copy_groups[(g,)](
                            dtable.data_ptr(), g, *scalars, *key, num_warps=self.num_warps
                        )
                    return
                if self._slots is None:
                    self._slots = _TableSlots(self._slots_count, 3 * self._slot_tiles)
                slots = self._slots
                i = slots.take()
                slots.arr[i, : 3 * g].reshape(3, g)[...] = table
                args = (slots.addr(i), g, *scalars)
                gkey = ("groups", *key)
                if not self._kernels.launch(gkey, (g, 1, 1), stream.cuda_stream, (*args, *key)):
                    with torch.cuda.stream(stream):
                        kernel = _copy_groups[(g,)](*args, *key, num_warps=self.num_warps)
                    self._kernels.add(gkey, kernel)
                slots.launched(i, stream)
            self.last_kernel = self._kernels.kernel(gkey)

    def launch(self, plan: TilePlan, stream: Any = None) -> None:
        """Enqueue the copy of a plan (see the class docstring); never waits for the GPU
        unless every table slot is still in flight."""
        if plan.num_tiles == 0:
            return
        with self._lock:
            if self.device.type != "cuda" or plan.num_tiles > self._slot_tiles:
                self.last_kernel = launch_plan(plan, self.device, stream, self.num_warps)
                return
            self._launch_slot(plan, stream)

    def _launch_slot(self, plan: TilePlan, stream: Any) -> None:
        """Under the lock: table into a pinned slot, then one launch reading it there."""
        if self._slots is None:
            with _on(self.device):
                self._slots = _TableSlots(self._slots_count, 3 * self._slot_tiles)
        slots = self._slots
        i = slots.take()
        n = plan.num_tiles
        plan_table(plan, slots.arr[i, : 3 * n].reshape(3, n))
        meta = _meta(plan)
        key = (meta["block"], meta["elem"], meta["align"], meta["vec"])
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        addr = slots.addr(i)
        with _on(self.device):
            if not self._kernels.launch(key, (n, 1, 1), stream.cuda_stream, (addr, n, *key)):
                # first launch of this variant (Triton compiles it), or the fallback
                with torch.cuda.stream(stream):
                    kernel = _copy_tiles[(n,)](addr, n, num_warps=self.num_warps, **meta)
                self._kernels.add(key, kernel)
            slots.launched(i, stream)
        self.last_kernel = self._kernels.kernel(key)
