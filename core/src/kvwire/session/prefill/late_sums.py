"""A whole chunk's checksums after its rows (issue 26 item 1).

A checksummed chunk of the KV pool posted whole (not cut in pieces, not a layer-wise group)
used to be summed before any of its rows was posted: the sum was serial with the transfer. Now,
from its hasher's ``LATE_BYTES`` on (host chunks of 8 MiB and more: below that a host sum costs
less than the hand-off and the extra note; never for a GPU pool, whose sum of ~0.2 ms costs
less than the sums' own part: :func:`sums_after`), its sum starts on a piece-sum thread just
before its rows are posted (:func:`start`: it only reads the source rows, as the transfer
does), the rows are posted at once with notes that carry no sums, and the sums go to decode as
the chunk's last part, a :class:`~kvwire.control.wire.ChunkNote` that moves no bytes, over the
control channel once they are computed (:class:`SumsPart`). Decode adds the sums of a chunk's
parts and checks it once every part arrived, in any order (protocol 1.7): no decode change and
no protocol change.

The sums part is tracked by the transfer worker like a copy a strategy runs (a
:class:`~kvwire.staging.base.LocalCopy` of no bytes): the destination is not done (prefill's
request cannot report ``Success``, and the engine cannot reuse its pages) before the sums were
computed and handed to the control channel; a sum that raises, a control channel that refuses
the note, or a sum that outlives ``transfer_timeout_s`` fails the request, and decode hears of
it. Layer-wise groups and pieces keep their sums in their own notes, summed before they are
posted (each group or piece after the first is already summed while earlier ones fly).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvwire.control.wire import ChunkNote
from kvwire.errors import TransferError
from kvwire.integrity import LayerSums
from kvwire.session.prefill.posting import summer
from kvwire.session.prefill.rooms import Job
from kvwire.staging.base import Segment

#: Parts a chunk's notes may name at most (``ChunkNote.parts``).
MAX_PARTS = next(m.le for m in ChunkNote.model_fields["parts"].metadata if hasattr(m, "le"))


def sums_after(job: Job, segs: list[Segment], pieces: list[tuple[int, int]] | None) -> bool:
    """Prefill worker, before posting a whole chunk: whether its checksums go after its rows
    (a last part of its own) rather than in its first note, summed before any row is posted.
    So for a checked chunk of the KV pool not cut in pieces, with room for one more part, and
    large enough for its hasher (:meth:`~kvwire.session.checksums.SentSums.late`)."""
    check = job.link.checksums if job.pool == "kv" else None
    return (
        check is not None
        and pieces is None
        and 0 < len(segs) < MAX_PARTS
        and check.late(int(job.src.size))
    )


def start(job: Job) -> Future[LayerSums]:
    """Prefill worker, just before posting the rows of a chunk that :func:`sums_after`
    chose: start its per-layer sums on a piece-sum thread (they run while the rows are
    posted and fly)."""
    check = job.link.checksums
    assert check is not None
    return summer().submit(check.chunk, job.src, job.dst)


class SumsPart:
    """The sums part of one chunk, tracked by the transfer worker as a copy of no bytes.

    Built on the worker once the chunk's rows were posted, with the running sum, the note's
    fields (every field but the sums), how to tell decode (``tell``: the control channel,
    False when its queue is full) and whether the request is still live. :meth:`done` is
    called by the same worker only (no lock)."""

    nbytes = 0
    num_rows = 0

    def __init__(
        self,
        sums: Future[LayerSums],
        fields: dict[str, Any],
        tell: Callable[[ChunkNote], bool],
        live: Callable[[], bool],
    ) -> None:
        self._sums = sums
        self._fields = fields
        self._tell = tell
        self._live = live
        self._sent = False

    def done(self) -> bool:
        """Worker thread, polled: True once the sums were computed and told to decode (or
        the request is no longer live: nothing is sent). Raises :class:`TransferError` when
        the sum raised or the control channel refused the note."""
        if self._sent:
            return True
        if not self._sums.done():
            return False
        f = self._fields
        chunk = "its buffer groups" if f["what"] == "state" else f"chunk {f['chunk_id']}"
        try:
            sums = self._sums.result()
        except Exception as exc:
            raise TransferError(
                f"the checksums of {chunk} could not be computed after its rows were "
                f"posted: {type(exc).__name__}: {exc}",
                room=self._fields["room"],
            ) from exc
        if self._live():
            note = ChunkNote(**self._fields, sum_layers=list(sums), sums=list(sums.values()))
            if not self._tell(note):
                raise TransferError(
                    f"the checksums of {chunk} could not be sent: the control channel "
                    "to decode is full",
                    room=self._fields["room"],
                )
        self._sent = True
        return True
