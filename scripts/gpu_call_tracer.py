"""Traces named kvwire functions in the rank processes of a GPU benchmark: each call's start
and end, per process, to lay out where a chunk's time goes.

Installed as ``sitecustomize`` on the GPU machine (copied into a folder first on
``PYTHONPATH``) and switched on with ``KVWIRE_TRACE_DIR``: in every process started with
``--multiprocessing-fork`` (the cluster's rank processes) a thread waits until the modules of
:data:`TRACED` are imported, then wraps those functions (class attributes, so calls through
instances made earlier are traced too). While the file ``on`` exists in that folder (the
benchmark creates it around its timed requests: ``gpu_engine``'s ``sample_dir``), each call
appends ``(function, thread, start, end)`` (``time.perf_counter``: one clock for every process
of a host). The events are written to ``<pid>.json`` every 2 s and at exit.

    python3 scripts/gpu_call_tracer.py report DIR   # per function: calls, p50/mean ms, and
                                                    # the first requests' timelines at C=1
    python3 scripts/gpu_call_tracer.py window DIR START_MS LENGTH_MS
                                                    # every call in that window, all threads
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

#: ``module:Class.method`` (or ``module:function``) traced.
TRACED = (
    "kvwire.session.prefill.side:PrefillSide.send",
    "kvwire.session.prefill.pipeline:Pipeline.accept",
    "kvwire.session.prefill.pipeline:Pipeline.post_segments",
    "kvwire.session.prefill.pipeline:Pipeline._post",
    "kvwire.session.prefill.pipeline:Pipeline._complete",
    "kvwire.session.prefill.pipeline:Pipeline.idle",
    "kvwire.session.decode.side:DecodeSide.send_metadata",
    "kvwire.session.decode.side:DecodeSide._on_note",
    "kvwire.session.decode.side:DecodeSide._check_done",
    "kvwire.staging.bulk_writer:WriterSide.request",
    "kvwire.staging.bulk_writer:WriterSide.on_message",
    "kvwire.staging.bulk_writer:WriterSide.plan",
    "kvwire.staging.bulk_writer:WriterSide.on_sent",
    "kvwire.staging.bulk_writer:WriterSide._acquire",
    "kvwire.staging.kernels:KVTensors.sync",
    "kvwire.staging.bulk_ring:RingSide.release",
    "kvwire.session.prefill.pipeline:Pipeline.progress",
    "kvwire_nixl.backend:NixlBackend._submit",
    "kvwire_nixl.backend:NixlBackend._poll",
    "kvwire.staging.kernels:KVTensors.gather",
    "kvwire.staging.kernels:KVTensors.scatter",
    "kvwire.staging.bulk_ring:RingSide.on_message",
    "kvwire.staging.bulk_ring:RingSide.on_arrival",
    "kvwire.movers.triton_copy:RunCopier.copy",
    "kvwire.movers.triton_copy:RunCopier.move",
    "kvwire.staging.direct:DirectStaging.plan",
    "kvwire.index.base:IndexMapper.map_chunk",
    "kvwire.backend:TransferBackend.submit",
    "kvwire_cudaipc.backend:CudaIpcBackend._submit",
    "kvwire_cudaipc.backend:CudaIpcBackend._kernel_done",
    "kvwire_cudaipc.backend:CudaIpcBackend._post_follow",
    "kvwire_cudaipc.backend:CudaIpcBackend._submit_pages",
    "kvwire_cudaipc.backend:CudaIpcBackend._launch",
    "kvwire.backends.tcp.backend:TcpBackend._queue_note",
    "kvwire.backends.tcp.backend:TcpBackend._on_local_note",
    "kvwire.backends.tcp.local_notes:LocalNotes.send",
    "kvwire_cudaipc.watcher:KernelWatcher.watch",
    "kvwire.movers.triton_pool_pages:PoolPageCopier.copy_pages",
    "kvwire.movers.triton_pages:PageCopier._launch",
    "kvwire.movers.triton_copy:_TableSlots.take",
    "kvwire.movers.triton_copy:_TableSlots.launched",
    "kvwire.session.prefill.side:PrefillSide._on_request",
    "kvwire.control.channel:ControlChannel.tell",
    "kvwire.control.channel:ControlChannel.receive",
    "kvwire.control.wire:Codec.encode",
    "kvwire.control.wire:Codec.decode",
    "kvwire.session.manager:KVManager._dispatch",
    "kvwire.session.decode.side:DecodeSide._request",
    "kvwire.session.decode.side:DecodeSide.on_notification",
    "kvwire.session.decode.checker:ChunkChecker.on_part",
    "kvwire.session.decode.checker:ChunkChecker._run",
    "kvwire.session.checksums:SentSums.chunk",
    "kvwire.session.checksums:LandedSums.chunk",
    "kvwire.movers.staged_moves:TokenMajorMoves.pages",
    "kvwire.movers.staged_moves:TokenMajorMoves.units",
    "kvwire.movers.staged_moves:HeadMajorMoves.pages",
    "kvwire.movers.staged_moves:HeadMajorMoves.units",
    "kvwire.session.layers:LayerGate.mark",
    "kvwire.session.decode.rooms:ChunkCheck.run",
    "kvwire.session.decode.checker:ChunkChecker._apply",
    "kvwire.integrity_device:DeviceRowHasher.page_sums",
    "kvwire.integrity_device:DeviceRowHasher.sums",
    "kvwire.integrity_device:_Lane.wait",
    "kvwire.session.decode.side:DecodeSide._note_landed",
    "kvwire.session.decode.side:DecodeSide.notifications_drained",
    "kvwire.session.decode.side:DecodeSide._check_done",
    "kvwire.session.decode.checker:ChunkChecker.run_deferred",
    "kvwire.session.decode.checker:ChunkChecker._count",
    "kvwire.session.decode.rooms:ChunkCheck.start",
    "kvwire.session.checksums:LandedSums.chunk_later",
    "kvwire.integrity_device:DeviceRowHasher.page_sums_later",
    "kvwire.integrity_device:DeviceRowHasher._page_launch",
    "kvwire.integrity_device:DeviceRowHasher._enqueue",
    "kvwire.integrity_lanes:LaterSums.settle",
    "kvwire.integrity_lanes:Lane.later",
    "kvwire.index.base:IndexMapper.page_chunk",
    "kvwire.index.base:IndexMapper.chunk_slice",
    "kvwire.session.rooms:RoomTable.succeed",
    "kvwire_hisparse.paths:HostPathStrategy.plan",
    "kvwire_hisparse.copier:RowCopier.start_rows",
    "kvwire_hisparse.copier:RowCopier._move",
    "kvwire_hisparse.copier:RowCopier._long_runs",
    "kvwire_hisparse.copier:RowCopier._device_dst",
    "kvwire_hisparse.copier:_Checked.rows",
    "kvwire_hisparse.row_mover:RowMover.queue",
    "kvwire_hisparse.cuda_rows:CudaRows.run",
    "kvwire_hisparse.jobs:CopyJob.done",
    "kvwire.movers.triton_copy:RunCopier.launch",
    "kvwire_cudaipc.backend:CudaIpcBackend._flush_held",
    "kvwire_cudaipc.backend:launch_held",
    "kvwire_cudaipc.backend:CudaIpcBackend._kernel_watcher",
    "kvwire.movers.triton_pool_pages:PoolPageCopier.copy_batch",
    "kvwire_cudaipc.watcher:KernelWatcher.record",
    "kvwire.session.prefill.pipeline:Pipeline.turn",
)

_events: list[tuple[str, str, float, float]] = []
_on = False


def _wrap(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        if not _on:
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _events.append((name, threading.current_thread().name, t0, time.perf_counter()))

    return traced


def _patch_ready(pending: set[str]) -> None:
    """Wrap the functions of ``pending`` whose modules are imported (removed from it)."""
    for spec in list(pending):
        mod_name, attr = spec.split(":")
        if mod_name not in sys.modules:
            continue
        mod = importlib.import_module(mod_name)
        owner: Any = mod
        parts = attr.split(".")
        for p in parts[:-1]:
            owner = getattr(owner, p, None)
        fn = getattr(owner, parts[-1], None) if owner is not None else None
        pending.discard(spec)
        if fn is not None:
            setattr(owner, parts[-1], _wrap(attr, fn))


def _run(folder: Path) -> None:
    global _on
    pending = set(TRACED)
    out = folder / f"{os.getpid()}.json"
    flag = folder / "on"

    def dump() -> None:
        out.write_text(json.dumps({"pid": os.getpid(), "events": _events}))

    import atexit

    atexit.register(dump)
    last = time.monotonic()
    while True:
        if pending:
            _patch_ready(pending)
        _on = flag.exists()
        if time.monotonic() - last > 2.0:
            dump()
            last = time.monotonic()
        time.sleep(0.01)


def install() -> None:
    """Start the tracer thread when ``KVWIRE_TRACE_DIR`` is set in a spawned child."""
    folder = os.environ.get("KVWIRE_TRACE_DIR")
    if not folder or "--multiprocessing-fork" not in sys.argv:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    threading.Thread(target=_run, args=(Path(folder),), daemon=True).start()


def report(folder: str, timelines: int = 3) -> str:
    """Per function: calls, p50 and mean ms (per process); then the events of the first
    ``timelines`` requests (cut at each ``DecodeSide.send_metadata``) in start order."""
    lines: list[str] = []
    merged: list[tuple[float, float, str, int, str]] = []
    for path in sorted(Path(folder).glob("*.json")):
        data = json.loads(path.read_text())
        by: dict[str, list[float]] = {}
        for name, thread, t0, t1 in data["events"]:
            by.setdefault(name, []).append(1e3 * (t1 - t0))
            merged.append((t0, t1, name, data["pid"], thread))
        if not by:
            continue
        lines.append(f"== pid {data['pid']}")
        for name, d in sorted(by.items(), key=lambda kv: -sum(kv[1])):
            lines.append(
                f"  {name:<34} calls {len(d):>6}  p50 {statistics.median(d):7.3f} ms  "
                f"mean {statistics.mean(d):7.3f} ms  total {sum(d):9.1f} ms"
            )
    merged.sort()
    starts = [i for i, e in enumerate(merged) if e[2] == "DecodeSide.send_metadata"]
    for k in range(min(timelines, len(starts))):
        a = starts[k]
        b = starts[k + 1] if k + 1 < len(starts) else len(merged)
        t_ref = merged[a][0]
        lines.append(f"== timeline of request {k} (ms from decode's send_metadata)")
        for t0, t1, name, pid, thread in merged[a:b]:
            lines.append(
                f"  {1e3 * (t0 - t_ref):8.3f} .. {1e3 * (t1 - t_ref):8.3f}  {name:<34} "
                f"pid {pid} {thread}"
            )
    return "\n".join(lines)


def window(folder: str, start_ms: float, length_ms: float) -> str:
    """Every traced call of every process that overlaps ``[start, start + length)`` ms after
    the first traced call, in start order, one line each (a C=8 run's interleaving)."""
    merged: list[tuple[float, float, str, int, str]] = []
    for path in sorted(Path(folder).glob("*.json")):
        data = json.loads(path.read_text())
        merged.extend((t0, t1, n, data["pid"], th) for n, th, t0, t1 in data["events"])
    if not merged:
        return "no events"
    merged.sort()
    t_ref = merged[0][0] + start_ms / 1e3
    t_end = t_ref + length_ms / 1e3
    lines = [f"== calls overlapping [{start_ms}, {start_ms + length_ms}) ms"]
    for t0, t1, name, pid, thread in merged:
        if t1 >= t_ref and t0 < t_end:
            lines.append(
                f"  {1e3 * (t0 - t_ref):8.3f} .. {1e3 * (t1 - t_ref):8.3f}  {name:<34} "
                f"pid {pid} {thread}"
            )
    return "\n".join(lines)


if __name__ == "__main__" and len(sys.argv) > 4 and sys.argv[1] == "window":
    print(window(sys.argv[2], float(sys.argv[3]), float(sys.argv[4])))
elif __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "report":
    print(report(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 3))
else:
    install()
