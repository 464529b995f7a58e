"""End-to-end KV checksums: what prefill sent, checked against what landed on decode.

A checksum here is a sum, modulo 2**64, of one term per moved row:
``mix(dst_addr) ^ (Σ_j word_j * P_j)``, multiplied by an odd constant, where ``word_j`` are the
row's 64-bit little-endian words (bytes when a row is not 8-byte aligned), ``P`` a fixed
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

Host (DRAM) pools only: rows are read through NumPy views of the registered memory. Called by
prefill's transfer workers (:func:`layer_sums` before posting a chunk) and by decode's progress
thread once a chunk is complete. NumPy throughout; loops run over the few buffers a chunk
touches, never over rows or pages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache

import numpy as np
from numpy.typing import NDArray

from kvwire.backends.memcopy import region_array
from kvwire.descriptors import ADDR, LEN, DescTable, IndexArray, locate_rows
from kvwire.errors import DescriptorError
from kvwire.layout import KVLayout, MemKind

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_ODD = np.uint64(0xD6E8FEB86659FD93)

#: Per-layer sums: global layer index -> sum modulo 2**64.
LayerSums = dict[int, int]


def _mix(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """A 64-bit finaliser (splitmix64's): distinct inputs give well-spread outputs."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    out: NDArray[np.uint64] = x ^ (x >> np.uint64(31))
    return out


@lru_cache(maxsize=64)
def _weights(n: int) -> NDArray[np.uint64]:
    """``n`` odd position weights, the same on every host (a fixed sequence)."""
    w = _mix((np.arange(n, dtype=np.uint64) + np.uint64(1)) * _GOLDEN) | np.uint64(1)
    w.setflags(write=False)
    return w


class RowHasher:
    """Reads rows of one rank's KV buffers and sums their checksum terms per layer.

    ``layout``: the rank's KV layout (its buffers are the memory rows are read from, and
    each buffer's layer comes from :meth:`KVLayout.buffer_keys`). Built once per link;
    :meth:`sums` may be called from several threads at once (it only reads)."""

    def __init__(self, layout: KVLayout) -> None:
        buffers = list(layout.buffers)
        if any(b.kind is not MemKind.DRAM for b in buffers):
            raise DescriptorError(
                "KV checksums read the pool's bytes on the host: this rank's KV buffers are "
                "in GPU memory, which the checksum does not cover yet (turn kv_checksum off)"
            )
        order = np.argsort([b.addr for b in buffers], kind="stable")
        self._regions = [buffers[i] for i in order]
        self._starts = np.array([r.addr for r in self._regions], dtype=np.uint64)
        self._ends = np.array([r.end for r in self._regions], dtype=np.uint64)
        self._layers = layout.buffer_keys[order, 0]
        self._views = [region_array(r) for r in self._regions]

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
        rows = table[np.asarray(idx, dtype=np.int64)]
        addr, lens = rows[:, ADDR], rows[:, LEN]
        pos = locate_rows(self._starts, self._ends, addr, lens)
        if (pos < 0).any():
            raise DescriptorError("a checksummed row lies outside the rank's KV buffers")
        row_layer = self._layers[pos]
        keep = np.ones(pos.shape, dtype=bool)
        if layers is not None:
            keep = np.isin(row_layer, np.asarray(list(layers), dtype=np.int64))
        out: LayerSums = {}
        # One pass per (buffer, row length) present: a chunk touches each buffer once.
        combo = pos.astype(np.int64) * (1 << 32) + lens.astype(np.int64)
        for c in np.unique(combo[keep]).tolist():
            sel = keep & (combo == c)
            b, n = c >> 32, c & 0xFFFFFFFF
            off = (addr[sel] - self._starts[b]).astype(np.int64)
            term = self._terms(self._views[b], off, int(n), dst_addr[sel])
            layer = int(self._layers[b])
            total = (int(term.sum(dtype=np.uint64)) + out.get(layer, 0)) & 0xFFFFFFFFFFFFFFFF
            out[layer] = total
        return out

    @staticmethod
    def _terms(
        view: NDArray[np.uint8], off: NDArray[np.int64], n: int, dst: NDArray[np.uint64]
    ) -> NDArray[np.uint64]:
        """One checksum term per row of ``n`` bytes at ``off`` in ``view``."""
        if n % 8 == 0 and not (off % 8).any():
            words = view.view(np.uint64)
            k = n // 8
            data = words[(off // 8)[:, None] + np.arange(k, dtype=np.int64)]
        else:
            k = n
            data = view[off[:, None] + np.arange(n, dtype=np.int64)].astype(np.uint64)
        with np.errstate(over="ignore"):
            body = (data * _weights(k)).sum(axis=1, dtype=np.uint64)
            out: NDArray[np.uint64] = (body ^ _mix(dst.astype(np.uint64))) * _ODD
        return out


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
