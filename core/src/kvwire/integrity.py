"""End-to-end KV checksums: what prefill sent, checked against what landed on decode.

A checksum here is a sum, modulo 2**64, of one term per moved row:
``mix(dst_addr) ^ (Σ_j word_j * P_j)``, multiplied by an odd constant, where ``word_j`` are the
row's 64-bit little-endian words (bytes when the row's length does not divide by 8; the
choice depends on the length only, which both sides share), ``P`` a fixed
sequence of odd weights and ``dst_addr`` the row's address *on decode*. Because the terms are
keyed by the destination address and added, the sum does not depend on how a chunk was cut
into transfers: segments by memory kind, layer-wise groups, staging blocks or chunk
boundaries all add up to the same value. Prefill computes it over its source rows before it
posts them (the bytes it is about to send, keyed where they will land); decode computes it over
its destination rows once they landed (and, for staged chunks, were scattered). A flipped bit
changes its row's term by an odd multiple of a power of two and so the sum; a row written to
the wrong place changes the key of its term. Sums are kept per layer, so a mismatch names the
layers whose bytes differ.

This is an integrity check against faults (a transport or a copy kernel delivering wrong
bytes), not a cryptographic MAC: a peer that wants to forge KV is the business of the
handshake's secret (docs/security.md).

Host (DRAM) pools are read through NumPy views of the registered memory (:class:`RowHasher`);
GPU pools with one Triton launch per call (:mod:`kvwire.integrity_device`), the same terms.
A chunk is given as table rows (:meth:`RowHasher.sums`) or in page form
(:meth:`RowHasher.page_sums`: its page lists and the link's byte geometry, the rows' addresses
computed, never mapped); both add the same terms.
Called by prefill's transfer workers (before posting a chunk) and by decode's checker threads
once a chunk is complete. Loops run over the few buffers a chunk touches, never over rows or
pages.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import Any, Protocol

import numpy as np
from numpy.lib.stride_tricks import as_strided
from numpy.typing import NDArray

from kvwire.backends.memcopy import region_array
from kvwire.descriptors import ADDR, LEN, DescTable, IndexArray, check_indices, locate_rows
from kvwire.errors import DescriptorError
from kvwire.layout import MemKind, MemoryRegion
from kvwire.page_form import PageSide
from kvwire.transfers import WriteSums

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MIX1 = np.uint64(0xBF58476D1CE4E5B9)
MIX2 = np.uint64(0x94D049BB133111EB)
ODD = np.uint64(0xD6E8FEB86659FD93)

#: Per-layer sums: global layer index -> sum modulo 2**64.
LayerSums = dict[int, int]

#: A host sum over at least this many bytes is cut in two halves, one summed on a helper
#: thread while the caller sums the other (NumPy's ``dot`` releases the GIL): a request's
#: check, the last thing before ``Success`` on decode, takes about half as long when a core
#: is free.
PARALLEL_MIN_BYTES = 4 << 20

_helper_lock = threading.Lock()
_helper_pool: ThreadPoolExecutor | None = None


def _helper() -> ThreadPoolExecutor:
    """The process's one helper thread for :data:`PARALLEL_MIN_BYTES` halves (made on first
    use; its work is only NumPy on memory the caller keeps alive until the result is read)."""
    global _helper_pool
    with _helper_lock:
        if _helper_pool is None:
            _helper_pool = ThreadPoolExecutor(1, thread_name_prefix="kvwire-sum")
        return _helper_pool


def mix(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """A 64-bit finaliser (splitmix64's): distinct inputs give well-spread outputs."""
    x = (x ^ (x >> np.uint64(30))) * MIX1
    x = (x ^ (x >> np.uint64(27))) * MIX2
    out: NDArray[np.uint64] = x ^ (x >> np.uint64(31))
    return out


@lru_cache(maxsize=64)
def weights(n: int) -> NDArray[np.uint64]:
    """``n`` odd position weights, the same on every host (a fixed sequence)."""
    w = mix((np.arange(n, dtype=np.uint64) + np.uint64(1)) * GOLDEN) | np.uint64(1)
    w.setflags(write=False)
    return w


def page_lists(
    read: PageSide, read_pages: IndexArray, key: PageSide, key_pages: IndexArray
) -> tuple[IndexArray, IndexArray]:
    """A page-form sum's page lists, checked (inside their sides' pools, equally many) against
    two sides of one geometry (equal pairs, pieces and piece bytes)."""
    if (read.num_pairs, read.tokens, read.n) != (key.num_pairs, key.tokens, key.n):
        raise DescriptorError(
            f"page sides of {read.num_pairs} pairs x {read.tokens} pieces of {read.n} bytes "
            f"and {key.num_pairs} x {key.tokens} of {key.n} are not one geometry's"
        )
    rp = check_indices(read_pages, read.slots, "checksummed page indices", unit="page slots")
    kp = check_indices(key_pages, key.slots, "destination page indices", unit="page slots")
    if rp.size != kp.size:
        raise DescriptorError(f"{rp.size} checksummed pages but {kp.size} destination pages")
    return rp, kp


class SummedBuffers(Protocol):
    """The buffers a :class:`RowHasher` reads and the key each one's rows are summed under
    (``buffer_keys[i, 0]``): a rank's :class:`~kvwire.layout.KVLayout` (the key is the
    layer), or its buffer groups (:class:`kvwire.session.group_sums.GroupBuffers`)."""

    @property
    def buffers(self) -> Sequence[MemoryRegion]:
        """The buffers."""
        ...

    @property
    def buffer_keys(self) -> NDArray[np.int64]:
        """Shape ``[len(buffers), k]``; column 0 is the key of each buffer's rows."""
        ...


class OrderedSums(WriteSums, Protocol):
    """A chunk's sums ordered before its write (:meth:`RowHasher.sums_order`): a writer may
    sum them in its launch (:class:`~kvwire.transfers.WriteSums`); calling it gives them,
    waited for (:class:`kvwire.integrity_orders.SumsOrder`)."""

    def __call__(self) -> LayerSums:
        """The chunk's per-layer sums, once the write ended."""


class RowHasher:
    """Reads rows of one rank's KV buffers and sums their checksum terms per layer.

    ``layout``: the rank's KV layout (its buffers are the memory rows are read from, and
    each buffer's layer comes from :meth:`KVLayout.buffer_keys`). Built once per link;
    :meth:`sums` may be called from several threads at once (it only reads). This class reads
    host (DRAM) buffers with NumPy; :class:`kvwire.integrity_device.DeviceRowHasher` computes
    the same terms for buffers in GPU memory with one kernel launch.
    """

    #: Memory kind of the buffers this hasher reads.
    KIND = MemKind.DRAM
    #: Prefill posts a chunk in pieces, the first of about this many bytes, each summed while
    #: the ones before it are in flight (:meth:`kvwire.session.checksums.SentSums.pieces`;
    #: 0: one piece).
    PIECE_BYTES = 2 << 20
    #: Prefill sums a whole chunk of at least about this many bytes while its rows fly and
    #: sends its sums after them (:mod:`kvwire.session.prefill.late_sums`); a smaller one is
    #: summed before it is posted. On host memory the hand-off to a summing thread and the
    #: sums' own note cost more than a small sum (measured: docs/benchmarks.md, late sums).
    LATE_BYTES = 8 << 20
    #: Decode checks a chunk on the thread that saw it complete (after that thread let go
    #: of the room lock) rather than on a checker thread: for a sum that is a launch and a
    #: short wait, the hop to another thread costs more than the sum. Host sums read every
    #: byte on the CPU and go to the checker threads.
    INLINE_CHECK = False

    def __init__(self, layout: SummedBuffers) -> None:
        buffers = list(layout.buffers)
        if any(MemKind(b.kind) is not self.KIND for b in buffers):
            raise DescriptorError(
                f"KV checksums: {type(self).__name__} reads {self.KIND.name} buffers, but "
                f"this rank's KV buffers are in {sorted({MemKind(b.kind).name for b in buffers})} "
                "(a pool split across host and GPU memory is not checksummed; turn "
                "kv_checksum off)"
            )
        order = np.argsort([b.addr for b in buffers], kind="stable")
        self._regions = [buffers[i] for i in order]
        self._starts = np.array([r.addr for r in self._regions], dtype=np.uint64)
        self._ends = np.array([r.end for r in self._regions], dtype=np.uint64)
        self._layers = layout.buffer_keys[order, 0]
        self._views = self._open_views()
        self._word_views: dict[tuple[int, int], NDArray[np.uint64]] = {}
        #: Page-form sides seen (:meth:`_pairs`): id -> (the side, held so its id stays its
        #: own, each pair's buffer, each pair's layer).
        self._sides: dict[int, tuple[PageSide, NDArray[np.int64], NDArray[np.int64]]] = {}

    def _open_views(self) -> list[NDArray[np.uint8]]:
        """Views of the buffers (sorted by address) the rows are read through; called once at
        construction."""
        return [region_array(r) for r in self._regions]

    def sums(
        self,
        table: DescTable,
        idx: IndexArray,
        dst_addr: NDArray[np.uint64],
        layers: Sequence[int] | None = None,
    ) -> LayerSums:
        """Per-layer checksum of rows ``table[idx]`` (rows of this rank's buffers), each keyed
        by its destination address ``dst_addr[i]``. ``layers``: only rows of these layers
        count (a layer-wise group); None: every row."""
        addr, lens, pos = self._locate(table, idx)
        row_layer = self._layers[pos]
        if layers is not None:
            keep = np.isin(row_layer, np.asarray(list(layers), dtype=np.int64))
            addr, lens, pos, row_layer = addr[keep], lens[keep], pos[keep], row_layer[keep]
            dst_addr = np.asarray(dst_addr)[keep]
        return self._summed(addr, lens, pos, row_layer, dst_addr)

    def page_sums(
        self,
        read: PageSide,
        read_pages: IndexArray,
        key: PageSide,
        key_pages: IndexArray,
        layers: Sequence[int] | None = None,
    ) -> LayerSums:
        """Per-layer checksum of a chunk in page form (:mod:`kvwire.page_form`): the rows of
        side ``read`` (this rank's buffers) at pages ``read_pages``, each keyed by the address
        of the same piece of the same buffer pair at ``key_pages`` on side ``key`` (the
        destination) -- the terms :meth:`sums` adds for the chunk's table rows
        (:meth:`PageChunk.rows <kvwire.page_form.PageChunk.rows>`), bit for bit, without
        mapping them. Prefill reads its source side keyed by the destination side; decode
        reads the destination side keyed by itself. ``layers``: only pairs of these layers.
        Called by transfer workers (prefill) and checker threads (decode)."""
        rp, kp = page_lists(read, read_pages, key, key_pages)
        pos, layer = self._pairs(read)
        pairs: NDArray[np.int64] | None = None
        if layers is not None:
            pairs = np.flatnonzero(np.isin(layer, np.asarray(list(layers), dtype=np.int64)))
            pos, layer = pos[pairs], layer[pairs]
        if not rp.size or not pos.size:
            return {}
        per = rp.size * read.tokens  # rows of one pair
        addr = read.addresses(rp, pairs)
        lens = np.full(addr.shape, read.n, dtype=np.uint64)
        dst = key.addresses(kp, pairs)
        return self._summed(addr, lens, np.repeat(pos, per), np.repeat(layer, per), dst)

    def page_sums_later(
        self,
        read: PageSide,
        read_pages: IndexArray,
        key: PageSide,
        key_pages: IndexArray,
        layers: Sequence[int] | None = None,
    ) -> Callable[[], LayerSums] | None:
        """:meth:`page_sums` started now and waited for by whoever calls the result (any
        thread, later), where the hasher computes beside the caller (a GPU's); None where it
        would compute now anyway (here: host memory, summed on the calling thread). Called by
        prefill's transfer workers and by decode's inline checks (launched a batch at a time)."""
        return None

    def sums_order(
        self,
        read: PageSide,
        read_pages: IndexArray,
        key: PageSide,
        key_pages: IndexArray,
        layers: Sequence[int] | None = None,
    ) -> OrderedSums | None:
        """:meth:`page_sums_later` as an order that a page writer may sum in its own launch
        (:mod:`kvwire.integrity_orders`), where the hasher computes beside the caller; None
        here (host memory). Called by prefill's transfer workers."""
        return None

    def _pairs(self, side: PageSide) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """The buffer (in address order) and layer of each buffer pair of ``side`` (this
        rank's side of a page geometry), located the first time the side is seen (a link's
        sides are built once) and kept; refuses a pair whose rows leave one of this rank's
        buffers. Any thread (two threads locating the same side at once store equal
        values)."""
        seen = self._sides.get(id(side))
        if seen is not None and seen[0] is side:
            return seen[1], seen[2]
        corners = side.corners()
        pos = locate_rows(
            self._starts,
            self._ends,
            corners.ravel(),
            np.full(corners.size, side.n, dtype=np.uint64),
        ).reshape(corners.shape)
        if (pos < 0).any() or (pos != pos[0]).any():
            raise DescriptorError("a checksummed page lies outside the rank's KV buffers")
        located = pos[0].astype(np.int64)
        layer = np.asarray(self._layers[located], dtype=np.int64)
        if len(self._sides) >= 8:
            self._sides.pop(next(iter(self._sides)), None)
        self._sides[id(side)] = (side, located, layer)
        return located, layer

    def _summed(
        self,
        addr: NDArray[np.uint64],
        lens: NDArray[np.uint64],
        pos: NDArray[np.int64],
        row_layer: NDArray[np.int64],
        dst_addr: NDArray[np.uint64],
    ) -> LayerSums:
        """Per-layer sums of located rows (buffer ``pos[i]``, layer ``row_layer[i]``) keyed
        by ``dst_addr``; a large set in two halves, one on the helper thread."""
        if not pos.size:
            return {}
        dst = np.asarray(dst_addr, dtype=np.uint64)
        half: Future[NDArray[np.uint64]] | None = None
        h = pos.size // 2
        if h and int(lens.sum()) >= PARALLEL_MIN_BYTES:
            half = _helper().submit(self._row_terms, addr[h:], lens[h:], pos[h:], dst[h:])
            addr, lens, pos, dst = addr[:h], lens[:h], pos[:h], dst[:h]
        terms = self._row_terms(addr, lens, pos, dst)
        if half is not None:
            terms = np.concatenate((terms, half.result()))
        return per_layer(row_layer, terms)

    def row_layers(self, table: DescTable, idx: IndexArray) -> NDArray[np.int64]:
        """The layer of each row ``table[idx]`` (rows of this rank's buffers)."""
        return np.asarray(self._layers[self._locate(table, idx)[2]], dtype=np.int64)

    def _locate(
        self, table: DescTable, idx: IndexArray
    ) -> tuple[NDArray[np.uint64], NDArray[np.uint64], NDArray[np.int64]]:
        """Addresses, lengths and buffer (in address order) of rows ``table[idx]``; refuses a
        row outside this rank's buffers."""
        rows = table[np.asarray(idx, dtype=np.int64)]
        addr, lens = rows[:, ADDR], rows[:, LEN]
        pos = locate_rows(self._starts, self._ends, addr, lens)
        if (pos < 0).any():
            raise DescriptorError("a checksummed row lies outside the rank's KV buffers")
        return addr, lens, pos

    def _row_terms(
        self,
        addr: NDArray[np.uint64],
        lens: NDArray[np.uint64],
        pos: NDArray[np.int64],
        dst: NDArray[np.uint64],
    ) -> NDArray[np.uint64]:
        """One checksum term per row (rows of buffer ``pos[i]`` at ``addr[i]``, ``lens[i]``
        bytes, keyed by ``dst[i]``). One product per (buffer, row length, offset modulo 8)
        present (a chunk touches each buffer once), then one vectorised pass keys every row.
        Rows whose length divides by 8 are summed as 64-bit little-endian words (read through
        a view shifted to their offset modulo 8), others as bytes."""
        body = np.empty(pos.shape, dtype=np.uint64)
        off = (addr - self._starts[pos]).astype(np.int64)
        combo = (pos.astype(np.int64) << 35) | ((off & 7) << 32) | lens.astype(np.int64)
        order = np.argsort(combo, kind="stable")
        ordered = combo[order]
        cuts = np.flatnonzero(ordered[1:] != ordered[:-1]) + 1
        with np.errstate(over="ignore"):
            for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), order.size], strict=True):
                sel = order[a:b]
                c = int(ordered[a])
                buf, shift, n = c >> 35, (c >> 32) & 7, c & 0xFFFFFFFF
                if n % 8:
                    body[sel] = _weighted_rows(self._views[buf], off[sel], n)
                else:
                    body[sel] = _weighted_rows(self._words(buf, shift), off[sel] >> 3, n // 8)
            out: NDArray[np.uint64] = (body ^ mix(dst.astype(np.uint64))) * ODD
        return out

    def _words(self, buf: int, shift: int) -> NDArray[np.uint64]:
        """Buffer ``buf`` (in address order) read as 64-bit words from byte ``shift``
        (``0 <= shift < 8``) on; made once per (buffer, shift) and kept (views only; two
        threads making the same one at once store equal views, so no lock)."""
        key = (buf, shift)
        words = self._word_views.get(key)
        if words is None:
            shifted = self._views[buf][shift:]
            words = shifted[: shifted.size // 8 * 8].view(np.uint64)
            self._word_views[key] = words
        return words


def _weighted_rows(
    cells: NDArray[np.unsignedinteger[Any]], start: NDArray[np.int64], k: int
) -> NDArray[np.uint64]:
    """``Σ_j cell_j * P_j`` (modulo 2**64) of each row of ``k`` cells at ``start[i]``: one
    matrix-vector product (NumPy's integer ``dot``, which wraps modulo 2**64).

    Word rows that lie on one grid of ``k`` cells and cover at least half of the span from
    the first to the last (a chunk's pages in one buffer are mostly neighbours) are summed
    through a view of that span, with no copy, the rows between them summed for nothing and
    dropped; other rows are first gathered into a copy, from a strided view with one row per
    possible start. The view halves the memory traffic of a pass (2x the speed at 8 MiB)."""
    w = weights(k)
    if cells.dtype == np.uint64 and start.size:
        lo, hi = int(start.min()), int(start.max())
        span = (hi - lo) // k + 1
        if span <= 2 * start.size and not ((start - lo) % k).any():
            body: NDArray[np.uint64] = cells[lo : hi + k].reshape(span, k).dot(w)
            return body[(start - lo) // k]
    windows = as_strided(
        cells, shape=(cells.size - k + 1, k), strides=(cells.strides[0],) * 2, writeable=False
    )
    data = windows[start]
    if data.dtype != np.uint64:
        data = data.astype(np.uint64)
    gathered: NDArray[np.uint64] = data.dot(w)
    return gathered


def per_layer(row_layer: NDArray[np.int64], terms: NDArray[np.uint64]) -> LayerSums:
    """Sum (modulo 2**64) the rows' terms per layer, in O(rows): the terms are cut into four
    16-bit limbs, each summed per layer by ``bincount`` (exact in float64 up to 2**37 rows),
    and the limbs' sums are shifted back and added modulo 2**64."""
    if not terms.size:
        return {}
    bins = int(row_layer.max()) + 1
    total = np.zeros(bins, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(4):
            limb = ((terms >> np.uint64(16 * i)) & np.uint64(0xFFFF)).astype(np.float64)
            part = np.bincount(row_layer, weights=limb, minlength=bins).astype(np.uint64)
            total += part << np.uint64(16 * i)
    present = np.flatnonzero(np.bincount(row_layer, minlength=bins))
    return {int(layer): int(total[layer]) for layer in present}


def add_sums(into: dict[int, int], more: Mapping[int, int]) -> None:
    """Add per-layer sums (modulo 2**64) into ``into``."""
    for layer, s in more.items():
        into[layer] = (into.get(layer, 0) + int(s)) & 0xFFFFFFFFFFFFFFFF


def mismatched_layers(sent: Mapping[int, int], landed: Mapping[int, int]) -> list[int]:
    """Layers whose sums differ (a layer present on one side only counts as differing;
    a zero sum is the same as an absent one)."""
    layers = set(sent) | set(landed)
    return sorted(x for x in layers if sent.get(x, 0) != landed.get(x, 0))


def layer_ranges(layers: Sequence[int]) -> str:
    """``"3, 7-9"`` for layers 3, 7, 8, 9."""
    out: list[str] = []
    start = prev = None
    for x in sorted(layers):
        if start is None:
            start = prev = x
        elif prev is not None and x == prev + 1:
            prev = x
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = x
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(out)
