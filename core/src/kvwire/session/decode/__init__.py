"""The decode role: :class:`~kvwire.session.decode.side.DecodeSide` (rooms, notes, completion,
deadlines), its per-request records (:mod:`.rooms`), its links to prefill ranks
(:mod:`.links`) and the write quarantine of failed requests (:mod:`.quiesce`)."""

from kvwire.session.decode.side import DecodeSide

__all__ = ["DecodeSide"]
