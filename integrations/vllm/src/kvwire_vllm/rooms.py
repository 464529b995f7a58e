"""Room ids of one prefill instance, and which of them its workers will still create.

vLLM's push flow hands decode a room only after prefill's scheduler picked it (in
``request_finished``), and the workers create the room's sender from the next step's
metadata, in the order the scheduler picked them. So a prefill worker can tell, for a decode
request naming a room it holds no sender for, whether that sender may still come (an early
request: decode was faster than prefill's next step) or never will (another instance's
room, or one already served): see :class:`kvwire.session.RoomIssuer`.

A room id is ``prefix << SEQ_BITS | seq``: ``prefix`` is a hash of the instance's vLLM
``engine_id`` (the same in the scheduler process and every worker, which receive one
``VllmConfig``), ``seq`` counts the rooms the scheduler issued, from a random start
(modulo ``2**SEQ_BITS``; "behind" and "ahead" are judged in a half-space window).
"""

from __future__ import annotations

import hashlib
import secrets

#: Bits of a room id that count rooms; the 27 above them identify the instance.
SEQ_BITS = 36
_SEQ_SPACE = 1 << SEQ_BITS
_PREFIX_MASK = (1 << (63 - SEQ_BITS)) - 1


def instance_prefix(engine_id: str) -> int:
    """The room prefix of the instance whose vLLM ``engine_id`` this is."""
    digest = hashlib.blake2b(engine_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & _PREFIX_MASK


def _ahead(seq: int, of: int) -> bool:
    """Whether ``seq`` comes after ``of`` (within half the sequence space)."""
    return 0 < (seq - of) % _SEQ_SPACE < _SEQ_SPACE // 2


class RoomCounter:
    """Scheduler half (prefill): issues the instance's room ids, in order."""

    def __init__(self, prefix: int) -> None:
        self.prefix = prefix
        self._seq = secrets.randbelow(_SEQ_SPACE)

    def next(self) -> int:
        """A new room id (scheduler thread, in ``request_finished``)."""
        self._seq = (self._seq + 1) % _SEQ_SPACE
        return self.prefix << SEQ_BITS | self._seq


class IssuedRooms:
    """Worker half (prefill): the :class:`kvwire.session.RoomIssuer` of a worker's manager.

    Called under the manager's lock (``created`` from the model runner's thread, ``never``
    from kvwire's liveness thread); plain attribute updates only.
    """

    def __init__(self, prefix: int) -> None:
        self.prefix = prefix
        #: Sequence number of the latest room created here (None: none yet).
        self.latest: int | None = None

    def created(self, room: int) -> None:
        """The worker created the sender of ``room`` (in the scheduler's order)."""
        seq = room % _SEQ_SPACE
        if room >> SEQ_BITS == self.prefix and (self.latest is None or _ahead(seq, self.latest)):
            self.latest = seq

    def never(self, room: int) -> str | None:
        """Why ``room`` (no sender here now) will never get one, or None if it may."""
        prefix = room >> SEQ_BITS
        if prefix != self.prefix:
            return (
                f"this prefill instance never issued it (its rooms carry prefix {self.prefix:#x}, "
                f"this one {prefix:#x}: params of another instance, or a wrong bootstrap address?)"
            )
        if self.latest is not None and not _ahead(room % _SEQ_SPACE, self.latest):
            return "its request was served or released here already"
        return None
