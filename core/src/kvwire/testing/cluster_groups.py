"""Buffer groups in the multi-process cluster harness: a rank's group pools, filled with a
verifiable encoding on prefill and checked element by element on decode.

:attr:`ClusterSpec.groups <kvwire.testing.cluster_spec.ClusterSpec.groups>` names groups from
:data:`GROUP_KINDS`; every rank process (:mod:`kvwire.testing.cluster_rank`) builds them with
:class:`RankGroups` beside its KV pool, the way an engine registers a hybrid model's caches:

* ``state_heads``: a per-request state split by heads (Mamba SSM state; 4 heads);
* ``state_replicated``: a state every TP rank holds whole (conv state of one SSM group);
* ``state_sections``: a multi-section state (a gated-delta-net conv state: q, k and v blocks
  of 2, 2 and 4 heads, each split across TP on its own, two rows per slot);
* ``window``: sliding-window KV in its own paged pool (K and V, the model's KV heads); only
  the pages of the request's last ``window`` tokens move;
* ``draft``: a draft model's KV, an extra paged layer addressed by the KV page indices.

Every group has one layer per model layer, split across pipeline stages like the KV layers.
An element's value encodes (group, layer, part, request, logical unit, logical element):
the unit is the request's page number for window and paged groups and 0 for a state, the
logical element its index in the unsharded slot (row, section, global head, element), so a
decode rank can check every element it got without knowing who sent it; the request id
makes a slot of another request show as wrong. Decode poisons its slots first, so an element
nobody wrote shows too.

Called on a rank process's engine loop only (single-threaded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.layout import BufferGroup, GroupSection, MemoryRegion, ModelSpec, RankPosition

__all__ = ["GROUP_KINDS", "GroupAlloc", "RankGroups", "logical_elements"]

#: Window of the ``window`` group, in the model's pages.
WINDOW_PAGES = 2


def _state_heads(m: ModelSpec) -> dict[str, Any]:
    return {"kind": "state", "total_heads": 4, "head_elems": 5}


def _state_replicated(m: ModelSpec) -> dict[str, Any]:
    return {"kind": "state", "total_heads": 2, "head_elems": 3, "sharding": "replicated"}


def _state_sections(m: ModelSpec) -> dict[str, Any]:
    secs = (GroupSection(total_heads=2, head_elems=2),) * 2
    return {
        "kind": "state",
        "page_size": 2,
        "sections": (*secs, GroupSection(total_heads=4, head_elems=3)),
    }


def _window(m: ModelSpec) -> dict[str, Any]:
    return {
        "kind": "window",
        "per_layer": 2,
        "total_heads": m.total_kv_heads,
        "head_elems": m.head_dim,
        "page_size": m.page_size,
        "window": WINDOW_PAGES * m.page_size,
    }


def _draft(m: ModelSpec) -> dict[str, Any]:
    return {**_window(m), "kind": "paged", "window": None}


#: Groups the harness can build, by name: group fields for a model (int32 elements).
GROUP_KINDS: dict[str, Callable[[ModelSpec], dict[str, Any]]] = {
    "state_heads": _state_heads,
    "state_replicated": _state_replicated,
    "state_sections": _state_sections,
    "window": _window,
    "draft": _draft,
}


def logical_elements(g: BufferGroup, rank: RankPosition) -> NDArray[np.int64]:
    """Index in the unsharded slot (TP 1: rows x sections x heads x elements) of each element
    of a slot of ``g`` on ``rank``, in memory order (the reference layout: row outermost, then
    each section's local heads, replicated heads as :func:`kvfill.global_heads
    <kvwire.testing.kvfill.global_heads>` assigns them)."""
    tp = rank.tp_size
    full_row = g.row_elems(1)
    per_row: list[NDArray[np.int64]] = []
    off = 0
    for sec in g.head_sections:
        h = sec.total_heads
        if g.sharding == "replicated":
            heads = np.arange(h, dtype=np.int64)
        else:
            local = max(1, h // tp)
            first = (rank.tp_rank // max(1, tp // h)) * local
            heads = np.arange(first, first + local, dtype=np.int64)
        per_row.append(off + (heads[:, None] * sec.head_elems + np.arange(sec.head_elems)).ravel())
        off += h * sec.head_elems
    row = np.concatenate(per_row)
    out: NDArray[np.int64] = (
        np.arange(g.page_size, dtype=np.int64)[:, None] * full_row + row[None, :]
    ).ravel()
    return out


def _code(group: int, key: NDArray[np.int64], room: int, unit: Any, elem: Any) -> Any:
    """31-bit code of an element (broadcasting over ``unit`` and ``elem``); never -1."""
    v = (
        np.int64(group) * 1_000_003
        + key * 7_919
        + np.int64(room % 999_983) * 104_729
        + np.asarray(unit, dtype=np.int64) * 131_071
        + np.asarray(elem, dtype=np.int64)
    )
    return (v & 0x7FFFFFFF).astype(np.int32)


@dataclass
class GroupAlloc:
    """One request's group slots on one rank."""

    #: The state slot (every state group shares the index set "state"), or -1.
    state: int = -1
    #: Window-pool pages of the request's window, in order, and the page number of the first.
    window: NDArray[np.int64] = field(default_factory=lambda: np.empty(0, np.int64))
    first_window_page: int = 0


class RankGroups:
    """A rank's buffer groups: arrays, :class:`BufferGroup` s for its layout, free slots.
    Built by a rank process at startup; used by its engine loop (not thread-safe)."""

    def __init__(
        self,
        names: tuple[str, ...],
        model: ModelSpec,
        rank: RankPosition,
        layers: tuple[int, int],
        kv_slots: int,
        state_slots: int,
        seed: int,
        device: str = "cpu",
    ) -> None:
        unknown = set(names) - set(GROUP_KINDS)
        if unknown:
            raise ValueError(f"unknown groups {sorted(unknown)}; known: {sorted(GROUP_KINDS)}")
        self.model, self.rank = model, rank
        self.device = device
        self.groups: list[BufferGroup] = []
        #: NumPy arrays (device ``cpu``), else torch tensors on ``device``.
        self.arrays: list[list[Any]] = []
        #: Logical element of each memory element of a slot, per group.
        self.elems: list[NDArray[np.int64]] = []
        #: Code of each group in the encoding (its position in :data:`GROUP_KINDS`).
        self.ids: list[int] = []
        start, end = layers
        for name in names:
            fields = GROUP_KINDS[name](model)
            per_layer = int(fields.get("per_layer", 1))
            slots = {"state": state_slots, "window": kv_slots, "paged": kv_slots}[fields["kind"]]
            one = MemoryRegion(addr=8, length=8, item_len=8)
            probe = BufferGroup(  # sizes only
                name=name, num_layers=model.num_layers, dtype="int32", **fields,
                buffers=(one,) * (per_layer * model.num_layers),
            )  # fmt: skip
            row = probe.item_len(rank.tp_size) // 4
            arrs = [_zeros((slots, row), device) for _ in range((end - start) * per_layer)]
            regions = tuple(MemoryRegion.from_tensor(a) for a in arrs)
            self.groups.append(
                BufferGroup(
                    name=name,
                    num_layers=model.num_layers,
                    start_layer=start,
                    end_layer=end,
                    dtype="int32",
                    buffers=regions,
                    **fields,
                )
            )
            self.arrays.append(arrs)
            self.elems.append(logical_elements(self.groups[-1], rank))
            self.ids.append(list(GROUP_KINDS).index(name))
        rng = np.random.default_rng(seed)
        self.free_state = [int(s) for s in rng.permutation(state_slots)]
        self.free_window = [int(s) for s in rng.permutation(kv_slots)]
        self.has_state = any(g.kind == "state" for g in self.groups)
        self.has_window = any(g.kind == "window" for g in self.groups)

    @property
    def tensors(self) -> list[Any]:
        """Every group array (kept alive with the layout)."""
        return [a for arrs in self.arrays for a in arrs]

    # ------------------------------------------------------------------ per request
    def alloc(self, num_pages: int) -> GroupAlloc:
        """Slots for a request of ``num_pages`` model pages: a state slot, and window pages
        for its last :data:`WINDOW_PAGES` pages (fewer for a shorter request)."""
        out = GroupAlloc()
        if self.has_state:
            out.state = self.free_state.pop()
        if self.has_window:
            first = max(0, num_pages - WINDOW_PAGES)
            n = num_pages - first
            out.window = np.array([self.free_window.pop() for _ in range(n)], dtype=np.int64)
            out.first_window_page = first
        return out

    def release(self, a: GroupAlloc) -> None:
        """Return a request's slots (after it ended and its writers are quiet)."""
        if a.state >= 0:
            self.free_state.append(a.state)
        self.free_window.extend(a.window.tolist())

    def state_indices(self, a: GroupAlloc) -> dict[str, Any] | None:
        """The engine's ``state_indices`` for the request (None without state/window groups)."""
        out: dict[str, Any] = {}
        if self.has_state:
            out["state"] = a.state
        if self.has_window:
            out["window"] = a.window
        return out or None

    def _targets(
        self, g: BufferGroup, a: GroupAlloc, kv_pages: NDArray[np.int64], first_page: int
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """(slots, logical unit of each) a request uses in group ``g``."""
        if g.kind == "state":
            return np.array([a.state], dtype=np.int64), np.zeros(1, dtype=np.int64)
        if g.kind == "window":
            return a.window, a.first_window_page + np.arange(a.window.size, dtype=np.int64)
        return kv_pages, first_page + np.arange(kv_pages.size, dtype=np.int64)

    def _expected(self, i: int, b: int, room: int, units: NDArray[np.int64]) -> NDArray[np.int32]:
        g = self.groups[i]
        key = g.buffer_keys[b]
        out: NDArray[np.int32] = _code(
            self.ids[i], key[0] * 8 + key[1], room, units[:, None], self.elems[i][None, :]
        )
        return out

    def fill(self, room: int, a: GroupAlloc, kv_pages: NDArray[np.int64]) -> None:
        """Prefill: write the request's encoding into its slots (KV pages from page 0)."""
        for i, g in enumerate(self.groups):
            slots, units = self._targets(g, a, kv_pages, 0)
            for b, arr in enumerate(self.arrays[i]):
                _put(arr, slots, self._expected(i, b, room, units))

    def poison(self, a: GroupAlloc, kv_pages: NDArray[np.int64]) -> None:
        """Decode: mark the request's slots unwritten before the transfer."""
        for i, g in enumerate(self.groups):
            slots, _ = self._targets(g, a, kv_pages, 0)
            for arr in self.arrays[i]:
                _put(arr, slots, np.full((slots.size, arr.shape[1]), -1, np.int32))

    def mismatches(
        self, room: int, a: GroupAlloc, kv_pages: NDArray[np.int64], first_page: int
    ) -> int:
        """Decode, after Success: elements of the request's slots that differ from the
        encoding (``kv_pages``: the received KV pages, page numbers from ``first_page``)."""
        bad = 0
        for i, g in enumerate(self.groups):
            slots, units = self._targets(g, a, kv_pages, first_page)
            for b, arr in enumerate(self.arrays[i]):
                bad += int((_get(arr, slots) != self._expected(i, b, room, units)).sum())
        return bad


def _zeros(shape: tuple[int, int], device: str) -> Any:
    """A zeroed int32 array: NumPy on ``cpu``, else a torch tensor on that CUDA device."""
    if device == "cpu":
        return np.zeros(shape, np.int32)
    import torch

    return torch.zeros(shape, dtype=torch.int32, device=device)


def _put(arr: Any, slots: NDArray[np.int64], values: NDArray[np.int32]) -> None:
    """``arr[slots] = values`` for a NumPy array or a torch tensor (copied to its device)."""
    if isinstance(arr, np.ndarray):
        arr[slots] = values
        return
    import torch

    idx = torch.as_tensor(slots, device=arr.device)
    arr[idx] = torch.as_tensor(np.ascontiguousarray(values), device=arr.device)


def _get(arr: Any, slots: NDArray[np.int64]) -> NDArray[np.int32]:
    """``arr[slots]`` as a NumPy array (from a torch tensor: copied to the host)."""
    if isinstance(arr, np.ndarray):
        out: NDArray[np.int32] = arr[slots]
        return out
    import torch

    got: NDArray[np.int32] = arr[torch.as_tensor(slots, device=arr.device)].cpu().numpy()
    return got
