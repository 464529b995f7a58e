"""The verification pool of a cluster harness rank (:mod:`kvwire.testing.cluster_rank`).

:class:`RankPool` is a paged ``int32`` KV pool whose elements encode where they belong
(:mod:`kvwire.testing.kvfill`): prefill fills the pages of a request, decode checks every
element that landed; with the buffer groups :attr:`ClusterSpec.groups
<kvwire.testing.cluster_spec.ClusterSpec.groups>` names (:mod:`kvwire.testing.cluster_groups`),
the aux rows, and for HiSparse a host pool beside the device one. Built once per rank process
by :func:`~kvwire.testing.cluster_rank.rank_main`, used only by its thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.layout import KVLayout, MemoryRegion, ModelSpec, RankPosition
from kvwire.testing.cluster_groups import RankGroups
from kvwire.testing.cluster_spec import AUX_WORDS, ClusterSpec
from kvwire.testing.kvfill import (
    from_pool_order,
    global_heads,
    make_pool,
    page_values,
    pool_shape,
    to_pool_order,
)

__all__ = ["RankPool"]


class RankPool:
    """A rank's verification pool: NumPy arrays, or torch tensors on a device."""

    def __init__(
        self,
        spec: ClusterSpec,
        rank: RankPosition,
        start: int,
        end: int,
        model: ModelSpec,
        head_major: bool = False,
        kv_fused: bool = False,
        kv_in_slot: bool = False,
        device: str | None = None,
    ) -> None:
        m = model
        device = device or spec.device
        self.head_major = head_major
        heads = len(global_heads(m, rank))
        nbuf = (end - start) * (1 if m.is_mla or kv_fused or kv_in_slot else 2)
        #: Page slots per buffer: ``spec.slots`` prefill pages' worth of tokens, in this
        #: pool's pages (at least ``spec.slots``).
        self.slots = spec.slots * max(1, -(-spec.model.page_size // m.page_size))
        shape = pool_shape(m, self.slots, heads, head_major, kv_fused, kv_in_slot)
        self.torch = spec.device != "cpu"
        if self.torch:
            import torch

            def _alloc(b: int) -> Any:
                if spec.mixed_kinds and b % 2:
                    return torch.zeros(shape, dtype=torch.int32, pin_memory=True)
                return torch.zeros(shape, dtype=torch.int32, device=device)

            self.arrays: list[Any] = [_alloc(b) for b in range(nbuf)]
        else:
            self.arrays = [np.zeros(shape, dtype=np.int32) for _ in range(nbuf)]
        #: The rank's buffer groups (:attr:`ClusterSpec.groups`), or None.
        self.groups: RankGroups | None = None
        if spec.groups:
            seed = spec.seed * 7919 + rank.sender_id * 8 + 4_000_000
            self.groups = RankGroups(
                spec.groups, m, rank, (start, end), self.slots, spec.aux_slots, seed, device
            )
        self.layout = KVLayout.from_tensors(
            m,
            self.arrays,
            rank,
            start,
            end,
            head_major=head_major,
            kv_fused=kv_fused,
            kv_in_slot=kv_in_slot,
            groups=self.groups.groups if self.groups else (),
            group_tensors=self.groups.tensors if self.groups else (),
        )
        self.aux = np.zeros((spec.aux_slots, AUX_WORDS), dtype=np.int32)
        self.aux_region = MemoryRegion.from_tensor(self.aux)
        self.host_layout: KVLayout | None = None
        self.host_arrays: list[NDArray[np.int32]] = []
        self.host_units = 1
        self.shared: Any = None

    def add_host_pool(self, spec: ClusterSpec, page_size: int) -> None:
        """A host-memory pool with its own page size (decode, HiSparse path)."""
        m = spec.model.model_copy(update={"page_size": page_size})
        self.host_units = spec.model.page_size // page_size
        slots = spec.slots * self.host_units
        if not spec.host_shared:
            self.host_layout, self.host_arrays = make_pool(m, self.layout.rank, slots)
            return
        from kvwire_hisparse.shm import SharedHostPool

        heads = len(global_heads(m, self.layout.rank))
        nbuf = len(self.layout.buffers)
        shape = (slots, page_size, heads, m.head_dim)
        per = int(np.prod(shape)) * 4
        self.shared = SharedHostPool.create(per * nbuf)
        raw = self.shared.array()
        self.host_arrays = [
            raw[b * per : (b + 1) * per].view(np.int32).reshape(shape) for b in range(nbuf)
        ]
        r = self.layout.rank
        self.host_layout = KVLayout.from_tensors(m, self.host_arrays, r, 0, m.num_layers)

    def _index(self, pages: NDArray[np.int64], arr: Any = None) -> Any:
        if self.torch:
            import torch

            dev = (arr if arr is not None else self.arrays[0]).device
            return torch.from_numpy(pages).to(dev)
        return pages

    def fill(self, pages: NDArray[np.int64], first_pos: int) -> None:
        for b, arr in enumerate(self.arrays):
            idx = self._index(pages, arr)
            vals = np.ascontiguousarray(
                to_pool_order(self.layout, page_values(self.layout, b, first_pos, len(pages)))
            )
            if self.torch:
                import torch

                arr[idx] = torch.from_numpy(vals).to(arr.device)
            else:
                arr[idx] = vals
        if self.torch:
            import torch

            torch.cuda.synchronize()

    def poison(self, pages: NDArray[np.int64]) -> None:
        for arr in self.arrays:
            arr[self._index(pages, arr)] = -1
        if self.torch:  # before a peer's kernel may write these pages (another stream)
            import torch

            torch.cuda.synchronize()

    def mismatches(
        self, pages: NDArray[np.int64], first_pos: int, num_tokens: int | None = None
    ) -> int:
        """Elements of ``pages`` (tokens ``first_pos``...) that differ from their encoding;
        only the first ``num_tokens`` token rows count when given (a partial last page)."""
        bad = 0
        for b, arr in enumerate(self.arrays):
            got = arr[self._index(pages, arr)]
            got = from_pool_order(self.layout, got.cpu().numpy() if self.torch else got)
            want = page_values(self.layout, b, first_pos, len(pages))
            if num_tokens is not None:
                rows = (-1, *want.shape[2:])
                got, want = got.reshape(rows)[:num_tokens], want.reshape(rows)[:num_tokens]
            bad += int((got != want).sum())
        return bad
