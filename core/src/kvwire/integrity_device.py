"""KV checksums of rows in GPU memory: the terms of :mod:`kvwire.integrity`, one launch per call.

:class:`DeviceRowHasher` is what :func:`kvwire.session.checksums.hasher_for` builds for a rank
whose KV buffers are in VRAM (once per link, at handshake). It sums the same terms per layer as
:class:`~kvwire.integrity.RowHasher`, bit for bit (a prefill GPU and a decode host pool, or
the reverse, agree), with the work on the device: one Triton program per row reads the row
from its raw address, multiplies its cells by the position weights, adds them (modulo 2**64),
mixes in the destination key and adds the term into its layer's sum with a 64-bit atomic add
(addition modulo 2**64 is associative, so the order the programs run in does not matter); it
also counts its layer's rows (which layers a call touched) and any row outside the rank's
buffers (refused, as the host hasher refuses it).

A call is made per chunk on each side, so its host work is a few small copies and launches:

- the descriptor table a call indexes (a link's table, built once per link and never changed)
  is described once, the first time it is seen: each row's address, cells, how cells are read
  and layer (or -1 outside the rank's buffers) go to the device (``int64 [4, rows]``), so a
  call uploads only its row indices and destination keys (16 bytes a row) with one copy;
- after the first launch the compiled kernel is launched directly (Triton's argument binding
  and cache lookup skipped), as :class:`kvwire.movers.triton_copy.RunCopier` does;
- the per-layer sums and row counts come back (16 bytes per layer of the rank), not a term per
  row; the call waits for its own stream only;
- each calling thread has a lane of its own (a stream, the call's buffers and the sums'
  buffers: :class:`Lane`), so calls from several threads at once (prefill's transfer workers,
  decode's checker threads) upload, launch and wait side by side; the hasher's lock guards only
  what they share (the tables' descriptions, the constants, the compiled kernels) and is
  never held while the device works;
- a layer range (a layer-wise group) is selected on the device: rows of other layers read
  nothing and add nothing.

A chunk in page form (:meth:`DeviceRowHasher.page_sums`, a link whose mapping has one) lists
no rows at all: one program per (buffer pair, page) finds the page's pieces from the two page
lists (uploaded per call, 16 bytes a page) and the sides' per-pair base addresses (on the
device once per link) and adds their terms, one atomic add per page (the kernels:
:mod:`kvwire.integrity_kernels`).

A table larger than :data:`_MAX_TABLE_ROWS` rows is not described on the device; its calls
send the ``[5, n]`` rows they hash instead (located on the host). Rows whose length divides by 8
are read as 64-bit words (aligned or assembled from bytes), other rows as bytes. The source
rows must be final when a call is made (prefill: the engine wrote them; decode: the chunk's
notification came after its data). Imported only where it runs (a CUDA device, or Triton's
interpreter on the CPU with ``TRITON_INTERPRET=1`` set before import, as the CPU tests do).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from kvwire.cuda_launch import CompiledKernels
from kvwire.descriptors import ADDR, LEN, DescTable, IndexArray, locate_rows
from kvwire.errors import DescriptorError
from kvwire.integrity import (
    GOLDEN,
    MIX1,
    MIX2,
    ODD,
    LayerSums,
    RowHasher,
    SummedBuffers,
    page_lists,
    weights,
)
from kvwire.integrity_kernels import hash_pages, hash_rows
from kvwire.integrity_lanes import Lane, PageSlot, layer_range
from kvwire.integrity_orders import FusedSums, SumsOrder
from kvwire.layout import MemKind
from kvwire.page_form import PageSide

__all__ = ["DeviceRowHasher"]

logger = logging.getLogger(__name__)

#: Cells a program handles per loop step.
_BLOCK = 1024
#: How a row's cells are read.
_WORDS, _WORDS_UNALIGNED, _BYTES = 0, 1, 2
#: Rows of a descriptor table described on the device at most (32 bytes a row: 32 MiB of
#: GPU memory per link and side at most); calls on a larger table send their rows instead.
_MAX_TABLE_ROWS = 1 << 20
#: Descriptor tables whose description a hasher keeps (a link has one per side).
_MAX_TABLES = 4
_Shared = tuple[Any, Any, int, int, int]  # what two page sides' launches share (_paired)


def _cells(
    addr: NDArray[np.uint64], lens: NDArray[np.uint64]
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Cells of each row and how they are read (_WORDS, _WORDS_UNALIGNED, _BYTES)."""
    lens64 = lens.astype(np.int64)
    if not (lens64 & 7).any() and not (addr & np.uint64(7)).any():
        return lens64 >> 3, np.zeros(lens64.shape, dtype=np.int64)  # the usual case
    words = lens64 % 8 == 0
    aligned = addr % np.uint64(8) == 0
    cells = np.where(words, lens64 // 8, lens64)
    mode = np.where(words, np.where(aligned, _WORDS, _WORDS_UNALIGNED), _BYTES).astype(np.int64)
    return cells, mode


class DeviceRowHasher(RowHasher):
    """Checksums of rows in one GPU's memory (see the module docstring).

    ``device``: where the kernel runs (default: the buffers' CUDA device; ``"cpu"`` runs
    Triton's interpreter over host memory, for tests). ``block``, ``num_warps`` and
    ``inline_weights`` (compute the position weights in the kernel instead of loading them)
    tune the kernel. :meth:`sums` and :meth:`page_sums` may be called from several threads at
    once (transfer workers, decode's checker threads): each thread uploads, launches and waits
    on a lane of its own (:class:`Lane`: its stream and call buffers), and the hasher's lock
    guards only what the lanes share (the tables' descriptions, the page sides' pairs, the
    constants and the compiled kernels), held while a call reads or grows them and never while
    the device works. In Triton's interpreter (tests) the lock is held for the whole call.
    Descriptor tables passed to it must not change once passed (a link's tables are built
    once).
    """

    KIND = MemKind.VRAM
    #: A chunk is summed in one call (a call's fixed cost is a few launches and one wait;
    #: posting in pieces is not measured on a GPU yet).
    PIECE_BYTES = 0
    #: Never summed after the rows: measured on 2 x H100 (docs/benchmarks.md, "Late sums on
    #: the GPU"), the sums' own part (a hop to a summing thread, then a note over the control
    #: channel that decode must wait for) cost 1.3 ms more in ``land`` than the 0.4 ms it
    #: took out of ``post``: a GPU sum is summed before the rows are posted.
    LATE_BYTES = 1 << 62
    #: Checked on the thread that saw the chunk complete: a launch and a wait of ~0.1 ms,
    #: where the hop to a checker thread and back cost more (docs/benchmarks.md, "Where a
    #: checked cudaipc request's time goes").
    INLINE_CHECK = True

    def __init__(
        self,
        layout: SummedBuffers,
        device: Any = None,
        block: int = _BLOCK,
        num_warps: int = 4,
        inline_weights: bool = False,
    ) -> None:
        super().__init__(layout)
        devices = {int(r.device_id) for r in self._regions}
        if device is None:
            if len(devices) != 1:
                raise DescriptorError(
                    f"KV checksums: this rank's KV buffers span GPUs {sorted(devices)}; one "
                    "GPU per rank is supported"
                )
            if not torch.cuda.is_available():
                raise DescriptorError(
                    "KV checksums: this rank's KV buffers are in GPU memory but torch sees "
                    "no CUDA device here"
                )
            device = f"cuda:{devices.pop()}"
        self.device = torch.device(device)
        self._index = self.device.index if self.device.index is not None else 0
        self.block = block
        self.num_warps = num_warps
        self.inline_weights = inline_weights
        self._lock = threading.Lock()
        self._num_layers = int(self._layers.max()) + 1 if self._layers.size else 1
        self._consts = self._constants(0)
        #: Constants replaced by larger ones, kept: a lane's launch in flight may read them.
        self._old_consts: list[Any] = []
        cuda = self.device.type == "cuda"
        self._cuda = cuda
        self._local = threading.local()
        #: Descriptions of tables seen: id -> (the table, held so its id stays its own,
        #: int64 [4, rows] on the device, or None for a table too large to describe).
        self._tables: dict[int, tuple[DescTable, Any]] = {}
        #: Page sides seen (:meth:`_paired`): (id, id) -> (read side, key side, what their
        #: launches share: pairs on the device, constants, cells, read mode, block).
        self._page_pairs: dict[tuple[int, int], tuple[PageSide, PageSide, _Shared]] = {}
        #: Compiled kernels by their constexprs, launched directly after the first launch.
        self._kernels = CompiledKernels("checksums", direct=cuda)

    def _open_views(self) -> list[NDArray[np.uint8]]:
        return []  # rows are read by the kernel from their addresses

    def _constants(self, cells: int) -> Any:
        """MIX1, MIX2, ODD, GOLDEN and the first ``cells`` weights as an int64 tensor on the
        device."""
        host = np.concatenate(
            [np.array([MIX1, MIX2, ODD, GOLDEN], dtype=np.uint64), weights(max(cells, 1))]
        ).view(np.int64)
        out = torch.from_numpy(host.copy()).to(self.device)
        if self.device.type == "cuda":  # lanes' streams read it: wait for the copy
            torch.cuda.current_stream(self.device).synchronize()
        return out

    def _need_weights(self, cells: NDArray[np.int64]) -> Any:
        """Grow the constants to the longest row's cells (the old ones are kept: a launch
        in flight may read them); returns the constants to launch with. Caller holds the
        lock."""
        if cells.size and not self.inline_weights:
            longest = int(cells.max())
            if self._consts.numel() < longest + 4:
                self._old_consts.append(self._consts)
                self._consts = self._constants(longest)
        return self._consts

    def _lane(self) -> Lane:
        """The calling thread's lane, made at its first call."""
        lane: Lane | None = getattr(self._local, "lane", None)
        if lane is None:
            lane = self._local.lane = Lane(self.device, 2 * self._num_layers + 1)
        return lane

    def _whole(self) -> Any:
        """Held for a whole call: the lock in Triton's interpreter (its kernels run in the
        calling thread and are not known to be thread-safe), nothing on a GPU."""
        return self._lock if not self._cuda else contextlib.nullcontext()

    def _part(self) -> Any:
        """Held while a call reads or grows the shared state: the lock on a GPU (in the
        interpreter :meth:`_whole` holds it already)."""
        return self._lock if self._cuda else contextlib.nullcontext()

    def _to_device(self, host: NDArray[Any]) -> Any:
        """``host`` copied to the device for every lane: the copy is waited for, since the
        lanes' streams do not follow the stream it was made on (once per table or link).
        Caller holds the lock."""
        out = torch.from_numpy(np.ascontiguousarray(host)).to(self.device)
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()
        return out

    # ------------------------------------------------------------------ the call
    def sums(
        self,
        table: DescTable,
        idx: IndexArray,
        dst_addr: NDArray[np.uint64],
        layers: Sequence[int] | None = None,
    ) -> LayerSums:
        """Per-layer checksum of rows ``table[idx]`` keyed by ``dst_addr`` (see
        :meth:`RowHasher.sums`), summed on the device. ``layers`` given as a ``range`` of
        step 1 (a layer-wise group) is selected on the device, any other sequence on the
        host (a term per row comes back). Called by transfer workers (prefill) and checker
        threads (decode), several at once (each on its lane)."""
        lo, hi = layer_range(layers, self._num_layers)
        if lo < 0:
            return super().sums(table, idx, dst_addr, layers)  # host filter, then _row_terms
        rows = np.asarray(idx, dtype=np.int64).reshape(-1)
        n = rows.size
        if not n or lo >= hi:
            return {}
        keys = np.asarray(dst_addr, dtype=np.uint64).reshape(-1)
        if int(rows.min()) < 0 or int(rows.max()) >= table.shape[0]:
            raise DescriptorError("a checksummed row is not a row of its table")
        lane = self._lane()
        with self._whole():
            with self._part():
                info = self._described(table)
                consts = self._consts
            lane.grow(n)
            call = lane.call_host.numpy()
            if info is not None:
                call[:n] = rows
                call[n : 2 * n] = keys.view(np.int64)
                self._launch(lane, info, table.shape[0], consts, 2 * n, n, lo, hi, indexed=True)
            else:  # a table too large to describe: locate this call's rows on the host
                addr, lens, pos = self._locate(table, rows)
                cells, mode = _cells(addr, lens)
                with self._part():
                    consts = self._need_weights(cells)
                part = call[: 5 * n].reshape(5, n)
                part[0], part[1], part[2], part[3] = (
                    addr.view(np.int64),
                    keys.view(np.int64),
                    cells,
                    mode,
                )
                part[4] = self._layers[pos]
                self._launch(lane, None, 0, consts, 5 * n, n, lo, hi, indexed=False)
            got = lane.wait()
        layers_n = self._num_layers
        if got[2 * layers_n]:
            raise DescriptorError("a checksummed row lies outside the rank's KV buffers")
        return self._layer_sums(got)

    def _layer_sums(self, got: NDArray[np.int64]) -> LayerSums:
        """The per-layer sums of a launch's output (layers it counted rows of)."""
        layers_n = self._num_layers
        present = np.flatnonzero(got[layers_n : 2 * layers_n])
        sums = got[:layers_n].view(np.uint64)[present]
        return dict(zip(present.tolist(), sums.tolist(), strict=True))

    def page_sums(
        self,
        read: PageSide,
        read_pages: IndexArray,
        key: PageSide,
        key_pages: IndexArray,
        layers: Sequence[int] | None = None,
    ) -> LayerSums:
        """Per-layer checksum of a chunk in page form (see :meth:`RowHasher.page_sums`) in
        one launch: the rows are never listed, one program per (buffer pair, page) finds its
        page's pieces from the page lists and the sides' per-pair base addresses and strides
        and adds their terms (one atomic add per page into its layer's sum). A call uploads
        its two page lists (16 bytes a page); the sides' pairs go to the device once per link.
        ``layers`` as in :meth:`sums`. Called by transfer workers (prefill) and checker
        threads (decode), several at once (each on its lane)."""
        lo, hi = layer_range(layers, self._num_layers)
        if lo < 0:  # host filter, then _row_terms
            return super().page_sums(read, read_pages, key, key_pages, layers)
        with self._whole():
            launched = self._page_launch(read, read_pages, key, key_pages, lo, hi)
            if launched is None:
                return {}
            lane, slot = launched
            return self._layer_sums(lane.page_wait(slot))

    def page_sums_later(
        self,
        read: PageSide,
        read_pages: IndexArray,
        key: PageSide,
        key_pages: IndexArray,
        layers: Sequence[int] | None = None,
    ) -> Callable[[], LayerSums] | None:
        """:meth:`page_sums` without the wait: the launch is enqueued on this thread's lane
        and an event recorded after it; the result, a call that waits for the event (once)
        and returns the sums, may be called on any thread, later (prefill's first note of a
        chunk, made by ``cudaipc``'s kernel watcher once the chunk's write ended, while the
        sum ran beside the write). The lane's next call waits for it first (it reuses the
        lane's buffers). None for ``layers`` the device does not select (then
        :meth:`page_sums`). Called by prefill's workers and decode's checks (a batch's)."""
        lo, hi = layer_range(layers, self._num_layers)
        if lo < 0:
            return None
        with self._whole():
            launched = self._page_launch(read, read_pages, key, key_pages, lo, hi)
            if launched is None:
                return lambda: {}
            lane, slot = launched
            if lane.stream is None:  # Triton's interpreter: already computed
                got = self._layer_sums(lane.page_wait(slot))
                return lambda: got
            return lane.later(slot, self._layer_sums)

    def sums_order(
        self,
        read: PageSide,
        read_pages: IndexArray,
        key: PageSide,
        key_pages: IndexArray,
        layers: Sequence[int] | None = None,
    ) -> SumsOrder | None:
        """:meth:`page_sums_later` as an order (:class:`~kvwire.integrity_orders.SumsOrder`):
        nothing launched yet; a writer that sums what it copies takes it into its own
        launch, any other starts it beside the write, and the chunk's note calls it. The
        page lists are checked now. None where :meth:`page_sums_later` gives None. Called
        by prefill's transfer workers."""
        lo, hi = layer_range(layers, self._num_layers)
        if lo < 0:
            return None
        rp, kp = page_lists(read, read_pages, key, key_pages)
        return SumsOrder(
            int(rp.size),
            self.device,
            lambda: self._plan_whole(read, rp, key, kp, lo, hi),
            lambda: self.page_sums_later(read, rp, key, kp, range(lo, hi)) or (lambda: {}),
            self._layer_sums,
        )

    def _plan_whole(
        self, read: PageSide, rp: IndexArray, key: PageSide, kp: IndexArray, lo: int, hi: int
    ) -> tuple[Lane, PageSlot, FusedSums] | None:
        """:meth:`_page_plan` under :meth:`_whole` (a writer's :meth:`SumsOrder.take`)."""
        with self._whole():
            return self._page_plan(read, rp, key, kp, lo, hi)

    def _page_plan(
        self,
        read: PageSide,
        read_pages: IndexArray,
        key: PageSide,
        key_pages: IndexArray,
        lo: int,
        hi: int,
    ) -> tuple[Lane, PageSlot, FusedSums] | None:
        """:meth:`page_sums`' launch for layers ``[lo, hi)`` planned on this thread's lane
        with the lane's next page slot (None when the chunk has no page or no layer): the
        lane, the slot and the launch's arguments. Any thread; takes :meth:`_part`."""
        rp, kp = page_lists(read, read_pages, key, key_pages)
        if not read.num_pairs * rp.size or lo >= hi:  # one program per (pair, page)
            return None
        lane = self._lane()
        pairs, consts, cells, mode, block = self._paired(read, key)
        slot = lane.page_slot(int(rp.size))
        args = FusedSums(
            pairs, consts, slot.out, slot.result, rp, kp, read.num_pairs, read.tokens, cells,
            read.slot, read.row, key.slot, key.row, self._num_layers, lo, hi, block,
            self.inline_weights, mode)  # fmt: skip
        return lane, slot, args

    def _page_launch(
        self,
        read: PageSide,
        read_pages: IndexArray,
        key: PageSide,
        key_pages: IndexArray,
        lo: int,
        hi: int,
    ) -> tuple[Lane, PageSlot] | None:
        """Enqueue :meth:`page_sums`' launch (:meth:`_page_plan`) on this thread's lane
        with the lane's next page slot (both returned; None when the chunk has no page or
        no layer). Caller holds :meth:`_whole`."""
        planned = self._page_plan(read, read_pages, key, key_pages, lo, hi)
        if planned is None:
            return None
        lane, slot, a = planned
        pages = a.pages
        call = slot.call.numpy()
        call[:pages] = a.read_pages
        call[pages : 2 * pages] = a.key_pages
        args = (
            a.pairs.data_ptr(),
            a.num_pairs,
            slot.call.data_ptr(),  # pinned: the kernel reads it over the bus
            a.consts.data_ptr(),
            a.out.data_ptr(),
            a.result.data_ptr(),
            pages,
            a.tokens,
            a.cells,
            a.read_slot,
            a.read_row,
            a.key_slot,
            a.key_row,
            a.num_layers,
            lo,
            hi,
        )
        meta = (a.block, a.inline_weights, a.mode)
        self._enqueue(lane, hash_pages, a.num_pairs * pages, args, meta, ("pages", *meta), 0, False)
        return lane, slot

    def _paired(self, read: PageSide, key: PageSide) -> _Shared:
        """What the page launches of two sides share, made once per pair of sides (a
        link's are built once): ``int64 [3, pairs]`` on the device (read and key base
        addresses, layers), the constants, a piece's cells, their read mode, the block.
        Refuses pairs outside the rank's buffers. Any thread."""
        ident = (id(read), id(key))
        seen = self._page_pairs.get(ident)
        if seen is not None and seen[0] is read and seen[1] is key:
            return seen[2]
        _, layer = self._pairs(read)  # refuses pairs outside the rank's buffers
        if read.n % 8:
            cells, mode = read.n, _BYTES
        else:
            aligned = not (read.base % np.uint64(8)).any() and not (read.slot % 8 or read.row % 8)
            cells, mode = read.n // 8, _WORDS if aligned else _WORDS_UNALIGNED
        block = min(self.block, max(16, 1 << (cells - 1).bit_length()))
        with self._part():
            pairs = self._to_device(
                np.stack([read.base.view(np.int64), key.base.view(np.int64), layer])
            )
            consts = self._need_weights(np.array([cells], dtype=np.int64))  # kept: see there
            facts = (pairs, consts, cells, mode, block)
            if len(self._page_pairs) >= _MAX_TABLES:
                self._page_pairs.pop(next(iter(self._page_pairs)))
            self._page_pairs[ident] = (read, key, facts)
        return facts

    def _described(self, table: DescTable) -> Any:
        """The device description of ``table`` (``int64 [4, rows]``: address, cells, read
        mode, layer or -1 outside the buffers), built the first time it is seen; None for a
        table larger than :data:`_MAX_TABLE_ROWS`. Caller holds the lock."""
        seen = self._tables.get(id(table))
        if seen is not None and seen[0] is table:
            return seen[1]
        info = None
        if table.shape[0] <= _MAX_TABLE_ROWS:
            addr, lens = table[:, ADDR], table[:, LEN]
            pos = locate_rows(self._starts, self._ends, addr, lens)
            cells, mode = _cells(addr, lens)
            self._need_weights(cells)
            layer = np.where(pos >= 0, self._layers[np.clip(pos, 0, None)], -1)
            info = self._to_device(
                np.stack([addr.view(np.int64), cells, mode, layer.astype(np.int64)])
            )
        if len(self._tables) >= _MAX_TABLES:
            self._tables.pop(next(iter(self._tables)))
        self._tables[id(table)] = (table, info)
        return info

    def _row_terms(
        self,
        addr: NDArray[np.uint64],
        lens: NDArray[np.uint64],
        pos: NDArray[np.int64],
        dst: NDArray[np.uint64],
    ) -> NDArray[np.uint64]:
        """One term per row (what :meth:`RowHasher.sums` adds on the host when ``layers`` is
        not a range)."""
        n = addr.size
        cells, mode = _cells(addr, lens)
        lane = self._lane()
        with self._whole():
            with self._part():
                consts = self._need_weights(cells)
            lane.grow(n)
            part = lane.call_host.numpy()[: 5 * n].reshape(5, n)
            part[0], part[1], part[2], part[3] = (
                addr.view(np.int64),
                dst.view(np.int64),
                cells,
                mode,
            )
            part[4] = self._layers[pos]
            terms = torch.empty(n, dtype=torch.int64, device=self.device)
            self._launch(
                lane, None, 0, consts, 5 * n, n, 0, self._num_layers, indexed=False, out=terms
            )
            if lane.stream is not None:
                lane.stream.synchronize()
            out: NDArray[np.uint64] = terms.cpu().numpy().view(np.uint64).copy()
        return out

    # ------------------------------------------------------------------ the device
    def _launch(
        self,
        lane: Lane,
        info: Any,
        num_info: int,
        consts: Any,
        elems: int,
        n: int,
        lo: int,
        hi: int,
        *,
        indexed: bool,
        out: Any = None,
    ) -> None:
        """Enqueue, on ``lane``'s stream, the upload of the call's first ``elems`` int64 and
        the kernel over its ``n`` rows (into the lane's per-layer sums, zeroed first, unless
        ``out`` takes a term per row), reading the constants ``consts``."""
        per_layer = out is None
        target = lane.out_dev if per_layer else out
        key = (self.block, self.inline_weights, per_layer, indexed)
        info_addr = info.data_ptr() if info is not None else 0
        args = (
            info_addr,
            num_info,
            lane.call_dev.data_ptr(),
            consts.data_ptr(),
            target.data_ptr(),
            n,
            self._num_layers,
            lo,
            hi,
        )
        self._enqueue(lane, hash_rows, n, args, key, key, elems, per_layer)

    def _enqueue(
        self,
        lane: Lane,
        jit: Any,
        n: int,
        args: tuple[Any, ...],
        meta: tuple[Any, ...],
        cache_key: tuple[Any, ...],
        elems: int,
        zero: bool,
    ) -> None:
        """Enqueue, on ``lane``'s stream, the upload of the call's first ``elems`` int64 (none:
        the kernel reads pinned memory), the zeroing of the lane's per-layer sums (``zero``)
        and ``jit`` over ``n`` programs with ``args`` and constexprs ``meta``: the compiled
        kernel (kept under ``cache_key``) launched directly after its first launch
        (:class:`kvwire.cuda_launch.CompiledKernels`), made under the lock (Triton's
        compilation and cache fill stay single-threaded)."""
        if lane.stream is None:  # Triton's interpreter: host memory, synchronous
            if zero:
                lane.out_dev.zero_()
            jit[(n,)](*args, *meta)
            return
        kernels, grid, stream = self._kernels, (n, 1, 1), lane.stream.cuda_stream
        # the launch names its stream: no stream context unless it uploads or zeroes, and the
        # device's only off the thread's current device (a third of a page-sums call's host
        # time; 0.15 ms a launch on decode's progress thread, whose GPU was not device 0)
        if not elems and not zero:
            here = torch.cuda.current_device() == self._index
            with contextlib.nullcontext() if here else torch.cuda.device(self._index):
                if kernels.launch(cache_key, grid, stream, (*args, *meta)):
                    return
        with torch.cuda.device(self.device), torch.cuda.stream(lane.stream):
            if elems:
                lane.call_dev[:elems].copy_(lane.call_host[:elems], non_blocking=True)
            if zero:
                lane.out_dev.zero_()
            if kernels.launch(cache_key, grid, stream, (*args, *meta)):
                return
            with self._lock:
                kernels.add(cache_key, jit[(n,)](*args, *meta, num_warps=self.num_warps))
