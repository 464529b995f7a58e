"""Host stand-ins for ``cudaipc``'s CUDA calls, so its VRAM page-write path runs on a host
without a GPU: regions flagged VRAM over host memory, the exports, device UUIDs and events
played on the host, and a page mover given by the caller (:class:`HostPages` copies the bytes
on the host). With :func:`install_links` too, two managers of one process link over
``cudaipc`` as two ranks on one GPU host would. For the plugin's tests and CPU benches
(``scripts/cudaipc_submit_bench.py``, ``scripts/worker_cpu_bench.py --backend cudaipc``) only:
CUDA IPC itself cannot run without a GPU, so this is a fake of that alone, never imported by
the backend."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvwire.layout import KVLayout, MemKind, MemoryRegion
from kvwire.movers.pool_pages import pool_page_runs
from kvwire.page_form import PageChunk, PageGeometry


class HostEvent:
    """A CUDA event stand-in: the stand-in movers finish synchronously, so it is always done."""

    def __init__(self, **kwargs: object) -> None:
        pass

    def record(self, stream: object) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class GatedEvent:
    """A CUDA event stand-in whose kernels end when a test says: while the class's ``gate``
    is cleared every event is "in flight" (``query`` says False, ``synchronize`` blocks until
    the gate opens, 30 s at most). The gate is shared by every event: a test sets it back."""

    gate = threading.Event()

    def __init__(self, **kwargs: object) -> None:
        self.kwargs = kwargs

    def record(self, stream: object) -> None:
        pass

    def query(self) -> bool:
        return self.gate.is_set()

    def synchronize(self) -> None:
        assert self.gate.wait(30), "stand-in kernel never finished"


class HostStream:
    """The backend's private stream on the host: nothing to wait for."""

    cuda_stream = 0

    def synchronize(self) -> None:
        pass


def install(
    setattr_: Callable[[Any, str, Any], None],
    pages: Any,
    runs: HostPages | None = None,
    event: type = HostEvent,
) -> None:
    """Replace ``cudaipc``'s CUDA calls with host stand-ins through ``setattr_`` (a test's
    ``monkeypatch.setattr``, which undoes them; or ``setattr`` in a bench process): exports
    whose handle is the address, one stand-in device, torch's CUDA events by
    :class:`HostEvent`, and ``pages`` as every backend's page mover (its ``copy_pages`` and
    ``copy_batch`` are what a launch calls). With ``runs`` (a :class:`HostPages`), row
    writes too (layer-wise groups, rows that are not pages): ``runs`` is the run mover and
    the copy engines' stand-in, on a :class:`HostStream`. ``event``: the CUDA event class
    (a test's gated one; default :class:`HostEvent`, done at once). Imports torch."""
    import torch

    import kvwire_cudaipc.backend as backend_mod
    from kvwire_cudaipc import _cuda

    setattr_(_cuda, "export", lambda dev, addr: (addr.to_bytes(8, "little") * 8, 0, 1 << 46))
    setattr_(_cuda, "device_uuid", lambda i: "GPU-stand-in")
    setattr_(_cuda, "visible_uuids", lambda: {"GPU-stand-in": 0})

    def ensure(self: Any) -> None:
        self._pages = pages
        if runs is not None:
            self._copier, self._stream = runs, HostStream()

    setattr_(backend_mod.CudaIpcBackend, "_ensure_gpu", ensure)
    setattr_(torch.cuda, "Event", event)
    if runs is not None:
        setattr_(backend_mod, "copy_runs", lambda src, dst, n, stream: runs.move(src, dst, n))


class HostPages:
    """A page mover (and run mover) that copies on the host, synchronously (``memmove`` of
    every piece :func:`~kvwire.movers.pool_pages.pool_page_runs` names, or of every run; the
    addresses are this process's own): ``copy_pages``, ``copy_batch`` and ``move`` as the
    backend calls them, counting launches. ``copies=False``: counts only, no byte moves (a
    CPU bench of the Python around a launch, whose bytes nothing reads)."""

    def __init__(self, copies: bool = True) -> None:
        self.launches = 0
        self.copies = copies
        #: What :meth:`warm` was asked for: each geometry with its pairs' two addresses.
        self.warmed: list[tuple[PageGeometry, np.ndarray, np.ndarray]] = []

    def warm(self, g: PageGeometry, src_addrs: np.ndarray, dst_addrs: np.ndarray) -> int:
        """The mover's warm-up (nothing to compile here): recorded; 0 variants."""
        self.warmed.append((g, src_addrs, dst_addrs))
        return 0

    def copy_pages(
        self,
        chunk: PageChunk,
        src_addrs: np.ndarray,
        dst_addrs: np.ndarray,
        *,
        stream: object = None,
        sums: object = None,
    ) -> None:
        if sums is not None:
            raise NotImplementedError("the host stand-in mover does not sum")
        self.launches += 1
        self._copy(chunk, src_addrs, dst_addrs)

    def copy_batch(
        self, items: Sequence[tuple[PageChunk, np.ndarray, np.ndarray]], *, stream: object = None
    ) -> int:
        self.launches += 1
        for chunk, src, dst in items if self.copies else ():
            self._copy(chunk, src, dst)
        return 1

    def move(self, src: Any, dst: Any, nbytes: Any, stream: object = None) -> None:
        """The run mover's call (and the copy engines'): ``nbytes[i]`` bytes from address
        ``src[i]`` to ``dst[i]``."""
        self.launches += 1
        self._runs(np.asarray(src), np.asarray(dst), np.asarray(nbytes))

    @classmethod
    def _copy(cls, chunk: PageChunk, src_addrs: np.ndarray, dst_addrs: np.ndarray) -> None:
        cls._runs(*pool_page_runs(chunk, np.asarray(src_addrs), np.asarray(dst_addrs)))

    @staticmethod
    def _runs(src: np.ndarray, dst: np.ndarray, n: np.ndarray) -> None:
        for a, b, k in zip(src.tolist(), dst.tolist(), n.tolist(), strict=True):
            ctypes.memmove(b, a, k)


def install_for_managers(
    setattr_: Callable[[Any, str, Any], None], copies: bool = True, event: type = HostEvent
) -> HostPages:
    """Every stand-in two managers of this process need to link and move over ``cudaipc``
    (:func:`install` with one :class:`HostPages` for pages and rows, :func:`install_links`);
    returns that mover (its ``launches`` count the writes' launches; ``copies=False``: the
    batched page writes move no byte; ``event``: as :func:`install` takes it)."""
    movers = HostPages(copies)
    install(setattr_, movers, runs=movers, event=event)
    install_links(setattr_)
    return movers


def install_links(setattr_: Callable[[Any, str, Any], None]) -> None:
    """With :func:`install`: the link checks a handshake makes (a CUDA device, P2P between
    the two GPUs, peer access granted) pass, so two managers of this process link over
    ``cudaipc`` (same process: addresses are used as they are, no handle is opened)."""
    from kvwire_cudaipc import _cuda

    setattr_(_cuda, "cuda_problem", lambda: None)
    setattr_(_cuda, "p2p_problem", lambda writer, owner: None)
    setattr_(_cuda, "enable_peer_access", lambda writer, owner: None)


def vram_layout(layout: KVLayout, arrays: Sequence[np.ndarray]) -> KVLayout:
    """``layout`` (a verification pool's, :func:`~kvwire.testing.kvfill.make_pool`) with its
    buffers ``arrays`` registered as VRAM of device 0."""
    return layout.model_copy(update={"buffers": tuple(vram_regions(arrays))})


def vram_regions(arrays: Sequence[np.ndarray]) -> list[MemoryRegion]:
    """Host arrays registered as VRAM regions of device 0 (rows of ``array[0].nbytes``)."""
    return [
        MemoryRegion.from_pointer(a.ctypes.data, a.nbytes, a[0].nbytes, MemKind.VRAM, 0)
        for a in arrays
    ]
