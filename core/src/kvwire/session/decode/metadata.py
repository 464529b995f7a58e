"""What the decode engine says of a request (``send_metadata``), checked before the room takes
it: the destination pages in the chosen pool, the aux row, the buffer-group slots, and the
prompt tokens kept cached. Engine thread; no lock (nothing shared is read but the context)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import ConfigError, DescriptorError
from kvwire.index.base import check_pages
from kvwire.session.context import RankContext
from kvwire.session.groups import Indices, check_state_indices

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Metadata:
    """A request's destination on this decode rank, checked (see :func:`check_metadata`)."""

    pages: NDArray[np.int64]
    aux_index: int
    pool: str
    groups: Indices
    cached_tokens: int | None


def check_pool(ctx: RankContext, pool: str) -> None:
    """Raise ``ConfigError`` unless ``pool`` is one this rank has ("kv", or an extra pool it
    was built with): a mistake of the engine, not of the request."""
    if pool not in ctx.pool_layouts:
        raise ConfigError(
            f"no pool {pool!r} on this decode rank (it has {sorted(ctx.pool_layouts)}); "
            "declare extra pools with KVManager(..., pools={name: layout})"
        )


def check_metadata(
    ctx: RankContext,
    pages: Any,
    aux_index: int,
    pool: str,
    state_indices: Any,
    cached_tokens: Any,
) -> Metadata:
    """The engine's ``send_metadata`` arguments for a ``pool`` :func:`check_pool` accepted,
    checked; raises a ``KVWireError`` naming what is wrong (the request then fails)."""
    target = ctx.pool_layouts[pool]
    arr = check_pages(pages, target.num_slots, "destination page indices")
    ordered = np.sort(arr)  # repeats sit side by side (cheaper than np.unique's counts)
    if ordered.size > 1 and bool((ordered[1:] == ordered[:-1]).any()):
        raise DescriptorError(
            "destination page indices repeat a slot; each page needs its own slot"
        )
    if not 0 <= aux_index < ctx.aux_slots:
        raise DescriptorError(f"aux_index {aux_index} is outside [0, {ctx.aux_slots})")
    groups = check_state_indices(ctx.layout, state_indices, "send_metadata()")
    if cached_tokens is not None and (
        isinstance(cached_tokens, bool)
        or not isinstance(cached_tokens, int | np.integer)
        or cached_tokens < 0
    ):
        raise DescriptorError(f"cached_tokens must be a non-negative int, not {cached_tokens!r}")
    kept = None if cached_tokens is None else int(cached_tokens)
    return Metadata(arr, aux_index, pool, groups, kept)


def offer_ahead(
    ctx: RankContext, room: int, pool: str, npages: int, sources: Sequence[Any]
) -> None:
    """Decode side, under the room lock, right before a request goes to its source ranks
    (``sources``: their links): the pool's staging strategy may consent ahead
    (:meth:`~kvwire.staging.base.StagingStrategy.on_requested`). Its failure is logged, never
    the request's: the sender then asks as it would without an offer."""
    strategy = ctx.staging_of(pool)
    if strategy is None:
        return
    try:
        strategy.on_requested(room, int(npages), [s.info.session for s in sources])
    except Exception as exc:
        logger.warning("room %d: the %s strategy's offer failed: %s", room, strategy.name, exc)
