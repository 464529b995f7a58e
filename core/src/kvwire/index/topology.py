"""Who sends to whom: the one place that pairs prefill ranks with decode ranks.

A :class:`Topology` is built from the two instances' shapes (prefill TP x PP, decode TP x PP)
and answers, for both sides and for the handshake, every pairing question the session layer
asks:

* which prefill ranks feed a decode rank (:meth:`Topology.sources`; every pipeline stage of
  each TP source, since each stage holds its own layers),
* which decode TP ranks a prefill rank feeds (:meth:`Topology.targets`) and how many decode
  ranks it waits for before it transfers (:meth:`Topology.fan_out`: every decode stage of each),
* which prefill rank writes a decode rank's aux row (:meth:`Topology.aux_sender`),
* the unique id of every sender (:meth:`Topology.sender_id`, ``pp_rank * tp + tp_rank``: keying
  completions by the PP rank alone collapses all senders to 0 when PP=1, a hang that shipped),
* and why a pair of shapes cannot work (:meth:`Topology.problems`).

Decode pipeline parallelism: each decode stage holds a layer range and pairs with every
prefill stage of its TP sources, exactly as a decode rank without PP does. A prefill stage
that holds none of a decode stage's layers is a *dummy* sender for it (its mapper has no
buffer pair: :attr:`IndexMapper.is_dummy <kvwire.index.base.IndexMapper.is_dummy>`): it moves
no KV and still reports completion, so completion is per decode stage with unchanged counting,
and the engine's MIN-reduce of polls across stages gives the request's status. Every decode
rank (every stage) gets its aux row from the same prefill rank.

Index mappers choose their topology (:attr:`kvwire.index.base.IndexMapper.topology`), so a
mapper for a new parallelism brings its pairing rules with it and the session layer does not
change. The TP rules (see :mod:`kvwire.index.ranks`):

* ``Td == Tp``: decode rank r is fed by prefill rank r;
* ``Td > Tp``: by prefill rank ``r // (Td/Tp)``, which waits for ``Td/Tp`` decode ranks;
* ``Td < Tp``: by prefill ranks ``r*(Tp/Td) .. (r+1)*(Tp/Td)-1``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwire.errors import LayoutError
from kvwire.index.ranks import source_ranks, target_ranks


@dataclass(frozen=True)
class Topology:
    """Pairing of one prefill instance (``prefill_tp`` x ``prefill_pp``) with one decode
    instance (``decode_tp`` x ``decode_pp``). Immutable; cheap to build per request."""

    prefill_tp: int
    prefill_pp: int
    decode_tp: int
    decode_pp: int = 1

    def problems(self) -> list[str]:
        """Every reason these shapes cannot be paired (empty when they can)."""
        out = []
        tp, td = self.prefill_tp, self.decode_tp
        if tp < 1 or td < 1 or self.prefill_pp < 1 or self.decode_pp < 1:
            out.append(
                f"sizes must be >= 1 (prefill {tp}x{self.prefill_pp}, decode {td}x{self.decode_pp})"
            )
        elif tp % td and td % tp:
            out.append(f"TP sizes: prefill={tp} decode={td}; one must divide the other")
        return out

    def check(self) -> None:
        """Raise :class:`LayoutError` naming every problem."""
        problems = self.problems()
        if problems:
            raise LayoutError("; ".join(problems))

    def sender_id(self, tp_rank: int, pp_rank: int) -> int:
        """Unique id of a prefill rank among the senders of one decode rank."""
        return pp_rank * self.prefill_tp + tp_rank

    def sources(self, decode_tp_rank: int) -> list[tuple[int, int]]:
        """``(tp_rank, pp_rank)`` of every prefill rank that feeds ``decode_tp_rank``."""
        self.check()
        tps = source_ranks(decode_tp_rank, self.prefill_tp, self.decode_tp)
        return [(t, p) for p in range(self.prefill_pp) for t in tps]

    def source_tp_ranks(self, decode_tp_rank: int) -> set[int]:
        """Prefill TP ranks (in every stage) that feed ``decode_tp_rank``."""
        self.check()
        return set(source_ranks(decode_tp_rank, self.prefill_tp, self.decode_tp))

    def targets(self, prefill_tp_rank: int) -> list[int]:
        """Decode TP ranks a prefill TP rank feeds, i.e. waits for before transferring."""
        self.check()
        return target_ranks(prefill_tp_rank, self.prefill_tp, self.decode_tp)

    def fan_out(self, prefill_tp_rank: int) -> int:
        """Decode ranks (every stage of each :meth:`targets` rank) that ask a prefill rank for
        a request's KV; it waits for all of them before transferring."""
        return len(self.targets(prefill_tp_rank)) * self.decode_pp

    def aux_sender(self, decode_tp_rank: int) -> int:
        """Sender id of the prefill rank that writes ``decode_tp_rank``'s aux row: the first
        TP source in the last pipeline stage (where the output token is)."""
        self.check()
        first = source_ranks(decode_tp_rank, self.prefill_tp, self.decode_tp)[0]
        return self.sender_id(first, self.prefill_pp - 1)
