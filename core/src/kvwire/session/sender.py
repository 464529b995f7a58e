"""The prefill engine's per-request handle, :class:`KVSender`."""

from __future__ import annotations

from typing import Any

from kvwire.session.common import RequestHandle
from kvwire.session.poll import KVPoll
from kvwire.session.prefill.rooms import SendRoom
from kvwire.session.prefill.side import PrefillSide


class KVSender(RequestHandle[SendRoom]):
    """Prefill side of one request. Created by the engine with ``mgr.sender(room)``.

    Engine thread calls, in order: :meth:`init` once, :meth:`send` once per chunk (the last with
    ``last=True``), :meth:`poll` each scheduler step, and :meth:`clear` once the request is
    finished (on every path: success, failure, abort). None of them blocks on a transfer.
    Unknown rooms poll as ``WaitingForInput`` (the decode side may not have asked yet).
    """

    unknown_status = KVPoll.WaitingForInput

    def __init__(self, side: PrefillSide, room: int) -> None:
        super().__init__(side, room, side.create_room(room))

    def init(self, num_pages: int, aux_index: int) -> None:
        """Declare the request's number of KV pages and its aux row index on this rank."""
        self._side.init(self._state, num_pages, aux_index)

    def send(
        self,
        page_indices: Any,
        last: bool = False,
        state_indices: Any | None = None,
        layerwise: bool = False,
    ) -> None:
        """Queue one chunk of chunked prefill (page slots of this rank's pool, in request
        order). With the last chunk, a layout with buffer groups passes ``state_indices``:
        ``{index name: slots}`` (a state group's one slot, a window group's pages of the
        request's last window; see :mod:`kvwire.session.groups`). Raises
        :class:`~kvwire.errors.DescriptorError` or ``ConfigError`` on bad input (the room is
        failed and decode is told).

        ``layerwise=True``: call it *before* the chunk's forward pass; its KV moves layer
        group by layer group as :meth:`layer_ready` marks layers computed
        (:mod:`kvwire.session.layers`). Every layer must be marked before the next send()."""
        self._side.send(self._state, page_indices, last, state_indices, layerwise)

    def layer_ready(self, layer: int | None = None, event: Any | None = None) -> None:
        """Engine thread, during a layer-wise chunk's forward pass: model layers up to
        ``layer`` (inclusive; None: all of this rank's) are computed. For KV on a GPU pass
        ``event``, a ``torch.cuda.Event`` recorded on the compute stream after the layer's KV
        writes: the transfer worker waits for it (``query()``), the engine thread never
        synchronises. Never blocks."""
        self._side.layer_ready(self._state, layer, event)
