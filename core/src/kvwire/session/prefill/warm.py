"""Prefill's page writes prepared before they are needed (:meth:`PageLane.warm
<kvwire.page_lane.PageLane.warm>`, :meth:`PageLane.warm_ahead
<kvwire.page_lane.PageLane.warm_ahead>`): a backend that writes decode's pages with kernels
of its own (``cudaipc``) compiles them off the request path, so no request waits for
Triton's compile (about a second a variant on a host whose Triton cache lacks it).

* At the rank's start (:func:`warm_ahead`): the kernels of writes to a decode rank of this
  rank's own layout (the mapper of such a link, this rank's buffer addresses standing in for
  decode's), the common deployment; an engine's start leaves them seconds to compile.
* At each handshake (:func:`warm_link`): the link's own geometry and pair, which a decode rank
  of another shape needs (another TP, page size or page order).

Whatever goes wrong is logged; the writes compile what they need themselves, as without.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from kvwire.session.handshake import build_mapper

if TYPE_CHECKING:
    from kvwire.page_form import PageGeometry
    from kvwire.session.context import RankContext
    from kvwire.transfers import PreparedPair

logger = logging.getLogger(__name__)

__all__ = ["warm_ahead", "warm_link"]


def warm_ahead(ctx: RankContext) -> None:
    """The prefill side's construction, once its pools are registered: a backend with a lane
    compiles the writes to a decode rank of this rank's layout (returns at once). Only a
    geometry of whole buffer slots (row ``pair * slots``: the equal-TP mappers') is warmed,
    its buffers' base addresses standing in for the table rows (no table is built here, on
    the engine's thread); another is left to its links' handshakes."""
    lane = ctx.backend.page_lane
    if lane is None:
        return
    try:
        mapper = build_mapper(ctx.config, ctx.layout, ctx.layout)
        g = mapper.page_geometry
        if g is None:
            return
        pairs = np.arange(g.num_pairs, dtype=np.int64)
        whole = np.array_equal(g.src_rows, pairs * g.src_slots)
        if not whole or not np.array_equal(g.dst_rows, pairs * g.dst_slots):
            return
        bases = np.array([b.addr for b in ctx.layout.buffers], dtype=np.int64)
        lane.warm_ahead(g, bases[mapper.src_buf], bases[mapper.dst_buf])
    except Exception as exc:  # e.g. a configured mapper that does not pair a layout with itself
        logger.info("%s: page writes not warmed ahead: %s", ctx.agent_name, exc)


def warm_link(
    ctx: RankContext, pair: PreparedPair | None, geometry: PageGeometry | None, staged: bool
) -> None:
    """The handshake thread, once a link serves: a backend with a lane prepares its page
    writes over ``pair`` (its KV pair) of ``geometry`` (its mapper's; None: chunks move as
    rows), whether or not the lane carries its chunks (the general path launches the same
    kernels); a ``staged`` link's chunks move through its strategy's staging instead."""
    lane = ctx.backend.page_lane
    if lane is None or pair is None or geometry is None or staged:
        return
    try:
        lane.warm(pair, geometry)
    except Exception:
        logger.warning("%s: preparing page writes failed", ctx.agent_name, exc_info=True)
