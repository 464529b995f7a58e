"""The decode engine's per-request handle, :class:`KVReceiver`, and the hooks a decode engine
with extra pools is told about (:class:`DecodeHooks`)."""

from __future__ import annotations

from typing import Any, Protocol

from kvwire.session.common import RequestHandle
from kvwire.session.decode.rooms import RecvRoom
from kvwire.session.decode.side import DecodeSide
from kvwire.session.poll import KVPoll
from kvwire.session.report import FailureReport


class DecodeHooks(Protocol):
    """What a decode engine is told about its requests into extra pools (e.g. a
    sparse-attention engine that keeps the KV in a host pool; engine thread; keep them
    quick). Exactly one of ``on_admit``/``on_abandon`` follows ``on_prealloc`` for every
    request, on every path (success, failure, abort, clear)."""

    def on_prealloc(self, room: int, num_units: int) -> None:
        """``send_metadata(..., pool=name)`` was called for an extra pool: only logical
        indices are held."""

    def on_admit(self, room: int, num_tokens: int) -> None:
        """The KV is in the extra pool: e.g. allocate the hot device buffer, preload if
        short."""

    def on_abandon(self, room: int) -> None:
        """The request failed or was aborted: drop what ``on_prealloc`` set up."""


class KVReceiver(RequestHandle[RecvRoom]):
    """Decode side of one request. Created by the engine with
    ``mgr.receiver(room, bootstrap_addr)``.

    Engine thread calls, in order: :meth:`init` (starts bootstrapping in the background),
    :meth:`send_metadata` once the destination pages are allocated, :meth:`poll` each scheduler
    step, and :meth:`clear` once the request is terminal (on every path).
    """

    def __init__(
        self, side: DecodeSide, room: int, bootstrap_addr: str, prefill_dp_rank: int | None
    ) -> None:
        super().__init__(side, room, side.create_room(room, bootstrap_addr))
        self._dp = prefill_dp_rank
        self._started = False

    def init(self, prefill_dp_rank: int | None = None) -> None:
        """Start bootstrapping: look up the prefill ranks and handshake (in the background).
        ``prefill_dp_rank`` picks the prefill DP rank (default: ``room % dp_size``)."""
        if self._started:
            return
        self._started = True
        self._side.start(self._state, prefill_dp_rank if prefill_dp_rank is not None else self._dp)

    def writes_quiesced(self) -> bool:
        """Whether the destination pages may be reused: the request succeeded, or it failed
        and every source rank confirmed that none of its writes is still in flight (or is
        gone). Poll it after a failure or abort before freeing the pages; ``clear()`` may come
        before or after."""
        if self._final is KVPoll.Success:
            return True
        quiet: bool = self._side.writes_quiesced(self._state)
        return quiet

    def send_metadata(
        self,
        dst_page_indices: Any,
        aux_index: int,
        pool: str = "kv",
        state_indices: Any | None = None,
        cached_tokens: int | None = None,
    ) -> None:
        """Tell the source ranks where to write: this rank's page slots for the request's
        pages that are not cached here (the last ``len(dst_page_indices)`` of the request;
        empty when the whole prefix is cached), and the aux row.

        ``pool=name`` sends this request into an extra pool the manager declared instead: the
        indices are that pool's pages (of its page size; page size 1 means token indices) for the
        request's tokens from the first, trimmed to the tokens that exist. The manager's
        ``hooks`` then get ``on_prealloc`` now and exactly one of ``on_admit`` (after the
        transfer, with the token count) or ``on_abandon`` (failure or abort).

        ``state_indices``: this rank's slots of the layout's buffer groups for the request,
        ``{index name: slots}`` (a state group's one slot; a window group's pages of the
        request's last window, in order); required when the layout has such groups. Checked
        here like the pages (a bad value raises and fails the request on both sides); the
        groups move after the last KV chunk, before the aux row.

        ``cached_tokens``: how many of the prompt's tokens this rank keeps cached (the pages
        sent hold the tokens after them; 0 when none). Needed when prefill and decode page
        sizes differ (the page counts alone cannot place the tokens then: a request without
        it fails on both sides, saying so); checked against the page counts otherwise."""
        self.init()
        self._side.send_metadata(
            self._state, dst_page_indices, aux_index, pool, state_indices, cached_tokens
        )

    def failure_report(self) -> FailureReport | None:
        """Engine thread, once :meth:`poll` returned ``Failed`` (before or after
        :meth:`clear`): which of this rank's pages landed whole (every source's share, and
        verified when checksums are on) and which must be recomputed, with the failure's cause
        (:class:`~kvwire.session.report.FailureReport`). None while the request has not failed.
        Read it once ``writes_quiesced()`` is True: no late write can then change a page."""
        report: FailureReport | None = self._side.failure_report(self._state)
        return report

    def poll(self) -> KVPoll:
        status = super().poll()
        if status in (KVPoll.Success, KVPoll.Failed):
            self._side.run_hooks(self._state, status)
        return status

    def clear(self) -> None:
        if self._final is None:
            self._side.run_hooks(self._state, self.poll())
        super().clear()
