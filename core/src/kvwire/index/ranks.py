"""Attention-TP rank mapping between a prefill instance (``Tp`` ranks) and a decode one (``Td``).

* ``Td == Tp``: decode rank r is fed by prefill rank r.
* ``Td > Tp``: decode rank r is fed by prefill rank ``r // (Td/Tp)``.
* ``Td < Tp``: decode rank r is fed by prefill ranks ``r*(Tp/Td) .. (r+1)*(Tp/Td)-1``.

Pipeline stages multiply the senders (each stage sends its own layers); that fan-in is the
control plane's business, keyed by :attr:`kvwire.layout.RankPosition.sender_id`.
"""

from __future__ import annotations

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
