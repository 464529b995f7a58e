"""Buffer groups in the session layer: the engine's ``state_indices``, checked on both sides,
and the rows of one request's group transfer.

Both engine calls take ``state_indices`` (SGLang's name): decode's ``send_metadata`` and
prefill's last ``send``. It names, per index set of the layout's groups
(:attr:`~kvwire.layout.BufferGroup.index`), the request's slots: one slot for a ``state``
group, the pages of the request's last window for a ``window`` group. ``paged`` groups use the
KV page indices and need nothing. A mapping ``{index name: slots}`` always works; a bare int
or sequence is accepted when the layout has exactly one index set.

Called on the engine thread (checking the engine's input), the liveness thread (checking
decode's request on prefill); prefill's request checks and the rows of a group transfer are
in :mod:`kvwire.session.prefill.groups`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.control.wire import pages_from_bytes, pages_to_bytes
from kvwire.errors import ConfigError, DescriptorError
from kvwire.index.base import check_pages
from kvwire.layout import KVLayout

Indices = dict[str, NDArray[np.int64]]


def index_sets(layout: KVLayout) -> dict[str, tuple[str, int]]:
    """Index names a request must give for ``layout`` -> (kind, slots they address)."""
    out: dict[str, tuple[str, int]] = {}
    for g in layout.groups:
        if g.index == "pages":
            continue
        kind, slots = out.get(g.index, (g.kind, g.num_slots))
        if kind != g.kind:
            raise ConfigError(
                f"index set {g.index!r} addresses groups of kinds {kind!r} and {g.kind!r}; "
                "give each kind its own index name"
            )
        out[g.index] = (kind, min(slots, g.num_slots))
    return out


def check_state_indices(layout: KVLayout, given: Any, side: str) -> Indices:
    """The engine's (or the peer's) ``state_indices`` as ``{index name: int64 slots}``,
    checked against ``layout``'s groups. Raises :class:`DescriptorError` or ``ConfigError``
    naming the index set and what is wrong (``side`` says whose input it is)."""
    sets = index_sets(layout)
    if not sets:
        if given is None or (isinstance(given, Mapping) and not given):
            return {}
        raise ConfigError(
            f"{side}: state_indices given, but this layout has no state or window buffer "
            "groups (register them in KVLayout.groups, or pass state_indices=None)"
        )
    if given is None:
        raise ConfigError(
            f"{side}: this layout has buffer groups addressed by {sorted(sets)}; pass "
            "state_indices={" + ", ".join(f"{n!r}: ..." for n in sorted(sets)) + "}"
        )
    if not isinstance(given, Mapping):
        if len(sets) != 1:
            raise ConfigError(
                f"{side}: state_indices must be a mapping with keys {sorted(sets)} (this "
                "layout has several index sets)"
            )
        given = {next(iter(sets)): given}
    unknown = set(given) - set(sets)
    missing = set(sets) - set(given)
    if unknown or missing:
        raise ConfigError(
            f"{side}: state_indices keys {sorted(map(str, given))} do not match this layout's "
            f"index sets {sorted(sets)} (unknown {sorted(map(str, unknown))}, missing "
            f"{sorted(missing)})"
        )
    out: Indices = {}
    for name, (kind, slots) in sets.items():
        raw = given[name]
        arr = check_pages(
            np.atleast_1d(np.asarray(raw)) if np.isscalar(raw) else raw,
            slots,
            f"{side} state_indices[{name!r}]",
        )
        if kind == "state" and arr.size != 1:
            raise DescriptorError(
                f"{side}: state_indices[{name!r}] names {arr.size} slots; a state group holds "
                "one slot per request"
            )
        if np.unique(arr).size != arr.size:
            raise DescriptorError(f"{side}: state_indices[{name!r}] repeats a slot")
        out[name] = arr
    return out


def to_wire(indices: Indices) -> dict[str, bytes] | None:
    """``TransferRequest.group_indices`` for checked indices (None when there are none)."""
    return {k: pages_to_bytes(v) for k, v in indices.items()} or None


def from_wire(raw: dict[str, bytes] | None) -> dict[str, Any] | None:
    """Inverse of :func:`to_wire` (unchecked; check with :func:`check_state_indices`)."""
    if raw is None:
        return None
    return {k: pages_from_bytes(v, f"group indices {k!r}") for k, v in raw.items()}


def send_groups(layout: KVLayout, state_indices: Any, last: bool) -> Indices:
    """Engine thread, prefill ``send()``: this rank's group slots, given with the last chunk
    (the state is final only then) and checked against ``layout``; empty before it."""
    if not last:
        if state_indices is not None:
            raise ConfigError(
                "state_indices come with the last chunk (the state is final only then)"
            )
        return {}
    return check_state_indices(layout, state_indices, "send()")
