"""The prefill role: :class:`~kvwire.session.prefill.side.PrefillSide` (rooms, decode ranks'
requests, dispatch, failures), its links to decode ranks (:mod:`.links`), its per-request
records (:mod:`.rooms`), the transfer workers (:mod:`.workers`, :mod:`.pipeline`,
:mod:`.layerwise`, :mod:`.posting`), early requests (:mod:`.early`) and the bootstrap
registration (:mod:`.registration`)."""

from kvwire.session.prefill.side import PrefillSide

__all__ = ["PrefillSide"]
