"""Gather and scatter of head slices between a KV pool and a contiguous staging block (torch).

A staged block holds, for one chunk and one (prefill rank, decode rank) pair, the head slice of
every token of every page of every buffer pair, laid out ``[pair, page, token, slice bytes]``.
Prefill gathers it from its pool; decode scatters it into its pool. Both run on the pool's device
(CPU tensors, or CUDA on a private stream that is synchronised before the block is read by the
transfer or before its ring space is freed), with one indexed copy per buffer, vectorised over
pages and tokens — or a single one when the engine hands its pool over as one stacked tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import ConfigError
from kvwire.layout import KVLayout


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a dev dependency
        raise ConfigError(
            "bulk staging gathers and scatters with torch; install it (pip install kvwire[torch])"
        ) from exc
    return torch


class KVTensors:
    """Byte views ``[slots, page_size, row_bytes]`` of a rank's KV buffers.

    ``tensors``: the engine's KV buffers in layout order (torch tensors or NumPy arrays), or one
    stacked tensor ``[num_buffers, ...]``. Their addresses must be the layout's buffers.
    """

    def __init__(self, layout: KVLayout, tensors: Any) -> None:
        torch = _torch()
        self.torch = torch
        row = layout.token_row_bytes
        shape = (layout.num_slots, layout.model.page_size, row)
        items = [tensors] if _is_stacked(tensors, layout) else list(tensors)
        views = []
        for t in items:
            tt = torch.from_numpy(t) if isinstance(t, np.ndarray) else t
            if not tt.is_contiguous():
                raise ConfigError("KV tensors for bulk staging must be contiguous")
            views.append(tt.view(torch.uint8))
        self.stacked: Any = None
        if len(items) == 1 and len(layout.buffers) > 1:
            self.stacked = views[0].reshape(len(layout.buffers), *shape)
            addrs = [
                self.stacked.data_ptr() + i * self.stacked[0].numel()
                for i in range(len(layout.buffers))
            ]
            self.views = [self.stacked[i] for i in range(len(layout.buffers))]
        else:
            if len(views) != len(layout.buffers):
                raise ConfigError(
                    f"{len(views)} KV tensors given for {len(layout.buffers)} layout buffers"
                )
            self.views = [v.reshape(shape) for v in views]
            addrs = [v.data_ptr() for v in self.views]
        want = [b.addr for b in layout.buffers]
        if addrs != want:
            raise ConfigError(
                "the KV tensors given to the manager are not the layout's buffers (addresses "
                "differ); pass the same tensors the layout was built from"
            )
        self.device = self.views[0].device
        self.stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None

    def index(self, pages: NDArray[np.int64]) -> Any:
        """Page indices as a tensor on the pool's device."""
        return self.torch.from_numpy(np.ascontiguousarray(pages)).to(self.device)

    def _ctx(self) -> Any:
        if self.stream is None:
            import contextlib

            return contextlib.nullcontext()
        return self.torch.cuda.stream(self.stream)

    def sync(self) -> None:
        """Wait for this pool's staging stream (no-op on CPU)."""
        if self.stream is not None:
            self.stream.synchronize()

    def gather(
        self,
        bufs: NDArray[np.int64],
        pages: NDArray[np.int64],
        lo: int,
        hi: int,
        out: Any,
    ) -> None:
        """Copy bytes ``[lo, hi)`` of every token row of ``pages`` in buffers ``bufs`` into
        ``out`` (uint8, shaped ``[len(bufs), len(pages), page_size, hi - lo]``); synchronised."""
        idx = self.index(pages)
        with self._ctx():
            if self.stacked is not None:
                b = self.torch.from_numpy(np.ascontiguousarray(bufs)).to(self.device)
                out.copy_(self.stacked[:, :, :, lo:hi][b[:, None], idx[None, :]])
            else:
                for i, bi in enumerate(bufs.tolist()):
                    out[i].copy_(self.views[bi][:, :, lo:hi][idx])
        self.sync()

    def scatter(
        self,
        bufs: NDArray[np.int64],
        pages: NDArray[np.int64],
        lo: int,
        hi: int,
        block: Any,
    ) -> None:
        """The inverse of :meth:`gather`: write ``block`` into bytes ``[lo, hi)`` of the token
        rows of ``pages`` in buffers ``bufs``; synchronised before returning."""
        idx = self.index(pages)
        with self._ctx():
            if self.stacked is not None:
                b = self.torch.from_numpy(np.ascontiguousarray(bufs)).to(self.device)
                self.stacked[:, :, :, lo:hi][b[:, None], idx[None, :]] = block
            else:
                for i, bi in enumerate(bufs.tolist()):
                    self.views[bi][:, :, lo:hi][idx] = block[i]
        self.sync()


def _is_stacked(tensors: Any, layout: KVLayout) -> bool:
    return not isinstance(tensors, Sequence) and len(layout.buffers) > 1


def alloc_bytes(nbytes: int, device: Any) -> Any:
    """A zeroed uint8 tensor on ``device`` (pinned when on CPU and CUDA is around)."""
    torch = _torch()
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)
