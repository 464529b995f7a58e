"""Attention-TP rank mapping between a prefill instance (``Tp`` ranks) and a decode one (``Td``).

* ``Td == Tp``: decode rank r is fed by prefill rank r.
* ``Td > Tp``: decode rank r is fed by prefill rank ``r // (Td/Tp)``.
* ``Td < Tp``: decode rank r is fed by prefill ranks ``r*(Tp/Td) .. (r+1)*(Tp/Td)-1``.

Pipeline stages multiply the senders (each stage sends its own layers); that fan-in is the
control plane's business, keyed by :attr:`kvwire.layout.RankPosition.sender_id`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwire.errors import LayoutError


def _check(tp_src: int, tp_dst: int) -> None:
    if tp_src < 1 or tp_dst < 1:
        raise LayoutError(f"TP sizes must be >= 1 (prefill {tp_src}, decode {tp_dst})")
    if tp_src % tp_dst and tp_dst % tp_src:
        raise LayoutError(f"prefill TP {tp_src} and decode TP {tp_dst}: one must divide the other")


def source_ranks(dst_rank: int, tp_src: int, tp_dst: int) -> list[int]:
    """Prefill TP ranks whose data decode TP rank ``dst_rank`` needs."""
    _check(tp_src, tp_dst)
    if not 0 <= dst_rank < tp_dst:
        raise LayoutError(f"decode rank {dst_rank} not in [0, {tp_dst})")
    if tp_dst >= tp_src:
        return [dst_rank // (tp_dst // tp_src)]
    k = tp_src // tp_dst
    return list(range(dst_rank * k, (dst_rank + 1) * k))


def target_ranks(src_rank: int, tp_src: int, tp_dst: int) -> list[int]:
    """Decode TP ranks that prefill TP rank ``src_rank`` feeds (and waits for)."""
    _check(tp_src, tp_dst)
    if not 0 <= src_rank < tp_src:
        raise LayoutError(f"prefill rank {src_rank} not in [0, {tp_src})")
    if tp_dst >= tp_src:
        k = tp_dst // tp_src
        return list(range(src_rank * k, (src_rank + 1) * k))
    return [src_rank // (tp_src // tp_dst)]


@dataclass(frozen=True)
class HeadSlice:
    """Which of ``total`` heads split across TP one (prefill rank, decode rank) pair moves:
    ``count`` heads from local head ``src_start`` of the source rank into local head
    ``dst_start`` of the destination rank, or nothing when ``sends`` is false (another source
    rank holds the same replicated heads and sends them)."""

    src_heads: int
    dst_heads: int
    count: int
    src_start: int
    dst_start: int
    sends: bool


def head_slice(total: int, tp_src: int, tp_dst: int, src_rank: int, dst_rank: int) -> HeadSlice:
    """The head slice of a TP pair, with GQA replication (fewer heads than ranks) on either
    side: the one rule for KV heads (:class:`~kvwire.index.head_slice.HeadSliceMapper`) and
    for the heads of buffer groups and their sections (:mod:`kvwire.index.groups`).

    * gather (``tp_src > tp_dst``): the source sends all its heads into offset
      ``(unique * src_heads) % dst_heads``, ``unique = src_rank // max(1, tp_src // total)``;
      of the source ranks holding the same replicated heads only the first sends;
    * scatter (otherwise): the destination receives ``dst_heads`` heads from source head
      ``(unique * dst_heads) % src_heads``, ``unique = dst_rank // max(1, tp_dst // total)``.
    """
    src_heads, dst_heads = max(1, total // tp_src), max(1, total // tp_dst)
    if tp_src > tp_dst:
        rep = max(1, tp_src // total)
        dst_start = ((src_rank // rep) * src_heads) % dst_heads
        sends = src_rank % min(rep, tp_src // tp_dst) == 0
        return HeadSlice(src_heads, dst_heads, src_heads, 0, dst_start, sends)
    rep = max(1, tp_dst // total)
    src_start = ((dst_rank // rep) * dst_heads) % src_heads
    return HeadSlice(src_heads, dst_heads, dst_heads, src_start, 0, True)
