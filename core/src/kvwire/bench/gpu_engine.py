"""The engine-API phase of the GPU benchmarks (``scripts/gpu_cudaipc_bench.py``,
``scripts/gpu_staged_bench.py``): prefill and decode rank processes of
:class:`kvwire.testing.cluster.Cluster` on two GPUs moving the model of issue 27 through any
backend and staging strategy, every element of the verified batches checked on decode.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvwire.bench.gpu_mover import MiB, log

#: A request's stages, each from one rank's mark to the next one's (``RankReport.marks`` of
#: the first prefill and the first decode rank; ``time.perf_counter()`` on one host).
STAGES = (
    ("ask", "decode", "created", "decode", "requested"),
    ("reach", "decode", "requested", "prefill", "asked"),
    ("take", "prefill", "asked", "prefill", "taken"),
    ("plan", "prefill", "taken", "prefill", "planned"),
    ("post", "prefill", "planned", "prefill", "posted"),
    ("land", "prefill", "posted", "decode", "noted"),
    ("finish", "decode", "noted", "decode", "success"),
    ("report", "decode", "success", "decode", "seen"),
    ("total", "decode", "created", "decode", "seen"),
    ("prefill_complete", "prefill", "posted", "prefill", "done"),
    # parts of ``take``: the engine's step until its last send, the job's wait for a worker;
    # the first part of ``land``: the rest of the worker's turn after the last chunk's post
    # (the turn's other jobs, its polls, then the launch of what it held)
    ("take_engine", "prefill", "asked", "prefill", "sent"),
    ("take_queue", "prefill", "sent", "prefill", "taken"),
    ("land_turn", "prefill", "posted", "prefill", "turn_end"),
)


def _ints(v: str) -> list[int]:
    return [int(x) for x in v.split(",") if x]


def add_engine_args(
    p: argparse.ArgumentParser, *, requests: int, verify: int, timeout: float, backend: str
) -> None:
    """The engine phase's command-line options, shared by the GPU benches (each passes its
    own defaults): the machine, the sizes and concurrencies, the shape of the request, and
    where results go."""
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument(
        "--gpus",
        type=_ints,
        default=None,
        help="GPUs the ranks take round robin, prefill first (default: every visible GPU, so "
        "each rank has its own where there are enough; the mover and peer copy use the first two)",
    )
    p.add_argument("--sizes", type=_ints, default=[2, 16, 128, 512], help="MiB per request")
    p.add_argument("--concurrency", type=_ints, default=[1, 8])
    p.add_argument("--requests", type=int, default=requests, help="timed requests per cell")
    p.add_argument(
        "--empty-last",
        action="store_true",
        help="timed requests (unchunked) as all pages then an empty last send, as before "
        "session 13 (default: one last send with every page)",
    )
    p.add_argument("--verify-requests", type=int, default=verify)
    p.add_argument("--engine-step", type=float, default=0.0002)
    p.add_argument(
        "--send-first",
        action="store_true",
        help="prefill sends each request's chunks without waiting for decode's asks (an "
        "engine that computes first, as vLLM's prefill): default, it waits (as SGLang's)",
    )
    p.add_argument(
        "--pin-cpus",
        action="store_true",
        help="pin each rank process to its own equal share of the CPUs (steadier timings)",
    )
    p.add_argument(
        "--engine-busy",
        action="store_true",
        help="the rank processes' engine loops run Python between polls instead of sleeping "
        "(a scheduler that never sleeps: kvwire's threads get the GIL at switch intervals)",
    )
    p.add_argument(
        "--switch-interval-us",
        type=float,
        default=None,
        help="sys.setswitchinterval in the rank processes, in microseconds, as their engine "
        "sets it (default: the interpreter's 5000)",
    )
    add_gil_args(p)
    p.add_argument(
        "--settle-s",
        type=float,
        default=0.0,
        help="seconds the ranks' engine loops run (busy or sleeping) after the warm-up and "
        "before the timed cells: a GIL watch that lowered the interval for the start's burst "
        "of Python has probed it back by 10 s (kvwire.gil)",
    )
    p.add_argument("--timeout", type=float, default=timeout)
    p.add_argument("--backend", default=backend, help="transfer backend of the engine phase")
    p.add_argument(
        "--backend-options",
        default="{}",
        help="the engine phase's transfer_backend_options, as JSON",
    )
    p.add_argument(
        "--control-options",
        default="{}",
        help='the engine phase\'s control options, as JSON (e.g. {"num_workers": 2})',
    )
    p.add_argument("--prefill-tp", type=int, default=1, help="engine phase: prefill ranks")
    p.add_argument("--decode-tp", type=int, default=1, help="engine phase: decode ranks")
    p.add_argument("--mla", action="store_true", help="an MLA model (one latent row)")
    p.add_argument("--decode-page-size", type=int, default=None, help="decode's page size")
    p.add_argument(
        "--head-major",
        type=lambda v: tuple(x for x in v.split(",") if x),
        default=(),
        help="roles whose pages are head-major, e.g. decode or prefill,decode",
    )
    p.add_argument(
        "--no-kv-tensors",
        action="store_true",
        help="the rank processes pass no kv_tensors to KVManager, as engine adapters do (bulk "
        "staging views the layout's buffers by address)",
    )
    p.add_argument(
        "--sample-dir",
        default="",
        help="a file 'on' exists here while the timed requests run (for a sampler or tracer "
        "in the rank processes: scripts/rank_sampler.py, scripts/gpu_call_tracer.py)",
    )
    p.add_argument(
        "--log-level",
        default="WARNING",
        help="the rank processes' log level (INFO: handshakes, warm-ups; on stderr)",
    )
    p.add_argument("--json", default="")


def _median_ms(seconds: list[float]) -> float:
    """The median of ``seconds`` (the upper one of an even count), in ms to the µs."""
    return round(1e3 * sorted(seconds)[len(seconds) // 2], 3)


def stage_medians(results: list[Any]) -> dict[str, float]:
    """Median ms of each of :data:`STAGES` over the requests that have both marks (a stage
    a path does not mark, e.g. ``planned`` off the staged path, is left out)."""
    out: dict[str, float] = {}
    for name, r0, m0, r1, m1 in STAGES:
        vals = []
        for r in results:
            first: dict[str, dict[str, float]] = {}
            for x in r.reports:
                first.setdefault(x.role, x.marks)
            a, b = first.get(r0, {}).get(m0), first.get(r1, {}).get(m1)
            if a is not None and b is not None:
                vals.append(b - a)
        if vals:
            out[name] = _median_ms(vals)
    return out


#: Marks whose spread over a request's ranks of one role :func:`spread_medians` reports: how
#: far apart the decode ranks of TP 1 -> 2 asked, landed and saw their request, and the prefill
#: ranks of TP 2 -> 1 were asked and done.
SPREADS = (
    ("decode", "created"),
    ("decode", "requested"),
    ("decode", "noted"),
    ("decode", "seen"),
    ("prefill", "asked"),
    ("prefill", "done"),
)


def spread_medians(results: list[Any]) -> dict[str, float]:
    """Median ms between the first and the last rank of one role to reach each of
    :data:`SPREADS` (keys ``role.mark``), over the requests where two or more ranks of that
    role have the mark; empty when every role has one rank."""
    out: dict[str, float] = {}
    for role, mark in SPREADS:
        vals = []
        for r in results:
            ts = [x.marks[mark] for x in r.reports if x.role == role and mark in x.marks]
            if len(ts) > 1:
                vals.append(max(ts) - min(ts))
        if vals:
            out[f"{role}.{mark}"] = _median_ms(vals)
    return out


def add_gil_args(p: argparse.ArgumentParser) -> None:
    """``--gil-switch`` and ``--gil-switch-us``, kvwire's GIL watch in the rank processes (a
    GPU bench's parser; :func:`gil_option` turns them into control options)."""
    p.add_argument(
        "--gil-switch",
        default="",
        choices=("", "auto", "always", "never"),
        help="kvwire's control.gil_switch (default: kvwire's default)",
    )
    p.add_argument(
        "--gil-switch-us",
        default="",
        help="kvwire's control.gil_switch_interval_us, or 'off' (gil_switch='never')",
    )


def gil_option(a: argparse.Namespace) -> dict[str, Any]:
    """``--gil-switch`` and ``--gil-switch-us`` as ControlOptions fields (none when not given,
    or when this tree's kvwire has no such option: an A/B against an older tree runs this
    harness)."""
    from kvwire.config import ControlOptions

    out: dict[str, Any] = {}
    if "gil_switch" not in ControlOptions.model_fields:
        return out
    mode, us = getattr(a, "gil_switch", ""), getattr(a, "gil_switch_us", "")
    if mode:
        out["gil_switch"] = mode
    if us == "off":  # the interval is left alone
        out["gil_switch"] = "never"
    elif us:
        out["gil_switch_interval_us"] = float(us)
    return out


def gil_figures(c: Any) -> dict[str, list[float]]:
    """Each rank's GIL switch interval now (µs) and how often its manager lowered it
    (``kvwire.gil``), from the harness's rank stats (outside any timed request)."""
    stats = c.rank_stats().values()
    return {
        "interval_us": [round(1e6 * s.get("switch_interval_s", 0.0), 1) for s in stats],
        "lowerings": [s.get("gil_lowerings", 0) for s in stats],
        "own_late": [s.get("gil_own_late", 0) for s in stats],
    }


def process_cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` used so far, every thread (the ones that ended too):
    utime + stime of ``/proc/PID/stat``, in clock ticks (10 ms on Linux). Not
    ``/proc/PID/schedstat``: that file is the main thread's alone (the rank's engine loop),
    which is what this bench reported before 2026-11-29. Raises ``OSError`` or
    ``ValueError`` when the file cannot be read (the process ended, or not Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    # the command name (field 2) may hold spaces and parentheses: fields after its last ")"
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(c: Any) -> dict[str, float]:
    """CPU seconds used so far by the driver (this process, every thread) and by each live
    rank process of cluster ``c`` (every thread, :func:`process_cpu_s`; ranks whose file
    cannot be read are left out, e.g. off Linux). Differences over a cell say how much of one
    core each process used: a process near 1.0 whose Python threads share one GIL is a cap
    on the cell's request rate."""
    out = {"driver": time.process_time()}
    for p in c.procs:
        try:
            out[p.name] = process_cpu_s(p.proc.pid)
        except (OSError, ValueError, IndexError):
            continue
    return out


def engine(
    a: Any,
    *,
    staging: str = "direct",
    staging_options: dict[str, Any] | None = None,
    max_chunk_pages: int = 0,
    log: Callable[[str], None] = log,
) -> dict[str, Any]:
    """The engine API between a prefill and a decode rank process on two GPUs (the harness's
    ``gpus`` round robin): verified requests of every size first (every element and aux row
    checked on decode), then timed requests at each concurrency. ``a`` carries the settings
    (``device``, ``gpus``, ``sizes`` MiB, ``concurrency``, ``requests``, ``verify_requests``,
    ``engine_step``, ``timeout``, ``backend``, ``prefill_tp``, ``decode_tp``; optional:
    ``backend_options`` the backend's options as JSON,
    ``checksum`` turns ``kv_checksum`` on, ``mla`` moves an MLA model (one latent row of 576
    bytes per token and layer), ``decode_page_size`` gives decode other pages, ``head_major``
    names the roles whose pages are head-major (e.g. ``("decode",)``), ``sample_dir``
    names a folder where a file ``on`` exists while the timed requests run, for a sampler or
    tracer in the rank processes such as ``scripts/gpu_call_tracer.py``); ``staging``
    and its options pick the strategy; ``max_chunk_pages`` > 0 cuts every request into
    chunks of at most that many pages (chunked prefill; a staged chunk must fit a staging
    buffer). ``log`` takes the progress lines (default: printed)."""
    from kvwire.config import ControlOptions, KVWireConfig
    from kvwire.layout import ModelSpec
    from kvwire.testing.cluster import Cluster, ClusterSpec, RoomPlan
    from kvwire.testing.cluster_suite import assert_all_ok, assert_tables_empty

    mla = bool(getattr(a, "mla", False))
    heads, dim = (1, 144) if mla else (8, 64)  # MLA: one latent row (576 bf16 bytes as int32)
    model = ModelSpec(
        num_layers=32, total_kv_heads=heads, head_dim=dim, dtype="int32", page_size=16, is_mla=mla
    )
    if a.device == "cpu":  # dry run: small pages on host memory
        model = ModelSpec(
            num_layers=4,
            total_kv_heads=1 if mla else 2,
            head_dim=16,
            dtype="int32",
            page_size=4,
            is_mla=mla,
        )
    m = model
    kv = 1 if mla else 2
    page_mib = m.num_layers * kv * m.page_size * m.total_kv_heads * m.head_dim * 4 / MiB
    sizes = a.sizes
    pages = {m: max(1, round(m / page_mib)) for m in sizes}
    slots = max(2, *a.concurrency) * max(pages.values()) + 64
    spec = ClusterSpec(
        model=model,
        slots=slots,
        aux_slots=256,
        device=a.device,
        gpus=tuple(a.gpus) if a.device == "cuda" else None,
        engine_step_s=a.engine_step,
        engine_busy=bool(getattr(a, "engine_busy", False)),
        pin_cpus=bool(getattr(a, "pin_cpus", False)),
        switch_interval_s=(
            a.switch_interval_us / 1e6 if getattr(a, "switch_interval_us", None) else None
        ),
        prefill_tp=a.prefill_tp,
        decode_tp=a.decode_tp,
        decode_page_size=getattr(a, "decode_page_size", None),
        head_major=tuple(getattr(a, "head_major", None) or ()),
        kv_tensors=not getattr(a, "no_kv_tensors", False),
        log_level=getattr(a, "log_level", "WARNING"),
        config=KVWireConfig(
            transfer_backend=a.backend,
            transfer_backend_options=json.loads(getattr(a, "backend_options", "") or "{}"),
            staging=staging,
            staging_options=dict(staging_options or {}),
            control=ControlOptions(
                **{
                    "kv_checksum": bool(getattr(a, "checksum", False)),
                    **gil_option(a),
                    **json.loads(getattr(a, "control_options", "") or "{}"),
                }
            ),
        ),
    )
    flag = Path(a.sample_dir) / "on" if getattr(a, "sample_dir", "") else None
    rng = np.random.default_rng(3)

    empty_last = bool(getattr(a, "empty_last", False))

    def chunks(p: int, verify: bool) -> list[int]:
        if max_chunk_pages <= 0:
            if verify:  # two chunks cut at random (either may be empty)
                cut = int(rng.integers(0, p + 1))
                return [cut, p - cut]
            return [p, 0] if empty_last else [p]
        k = max_chunk_pages
        return [min(k, p - i) for i in range(0, p, k)] or [0]

    def plans(n: int, p: int, verify: bool) -> list[RoomPlan]:
        return [
            RoomPlan(
                room=secrets.randbits(62),
                num_pages=p,
                chunks=chunks(p, verify),
                verify=verify,
                send_first=bool(getattr(a, "send_first", False)),
            )
            for _ in range(n)
        ]

    report: dict[str, Any] = {
        "verified": [],
        "cells": [],
        "slots": slots,
        "pages": pages,
        "tp": f"{a.prefill_tp}->{a.decode_tp}",
        "mla": mla,
        "decode_page_size": getattr(a, "decode_page_size", None),
        "head_major": list(getattr(a, "head_major", None) or ()),
        "backend": a.backend,
        "backend_options": json.loads(getattr(a, "backend_options", "") or "{}"),
        "staging": staging,
        "staging_options": dict(staging_options or {}),
        "max_chunk_pages": max_chunk_pages,
        "kv_checksum": bool(getattr(a, "checksum", False)),
        "send_first": bool(getattr(a, "send_first", False)),
    }
    t0 = time.perf_counter()
    with Cluster(spec) as c:
        log(f"cluster up in {time.perf_counter() - t0:.1f}s (slots {slots})")
        for mib in sizes:
            n = a.verify_requests if mib < 512 else max(2, a.verify_requests // 2)
            t1 = time.perf_counter()
            res = c.run(
                plans(n, pages[mib], True), concurrency=max(a.concurrency), timeout_s=a.timeout
            )
            assert_all_ok(res)
            cell = {
                "mib": mib,
                "requests": len(res),
                "mismatches": sum(r.mismatches for r in res),
                # the first size's include the links' handshakes and any kernel compile
                "seconds": round(time.perf_counter() - t1, 3),
            }
            report["verified"].append(cell)
            log(f"verified {cell}")
        c.run(plans(4, pages[sizes[0]], False), concurrency=2, timeout_s=a.timeout)  # warm-up
        settle = float(getattr(a, "settle_s", 0.0) or 0.0)
        if settle > 0:
            log(f"settling {settle:g}s; GIL before: {gil_figures(c)}")
            time.sleep(settle)
        if flag is not None:
            flag.parent.mkdir(parents=True, exist_ok=True)
            flag.touch()
        for mib in sizes:
            for conc in a.concurrency:
                n = a.requests if mib < 512 else max(conc * 2, a.requests // 4)
                n = max(n, conc * 2)
                cpu0 = cpu_seconds(c)
                res = c.run(plans(n, pages[mib], False), concurrency=conc, timeout_s=a.timeout)
                cpu1 = cpu_seconds(c)
                failed = [r for r in res if any(x.status != 4 for x in r.reports)]
                span = max(r.t_end for r in res) - min(r.t_start for r in res)
                nbytes = sum(r.bytes for r in res)
                kv_bytes = round(pages[mib] * page_mib * MiB)  # a request's KV, every layer
                lat = sorted(r.latency_s for r in res)
                cell = {
                    "mib": mib,
                    "concurrency": conc,
                    "requests": len(res),
                    "failed": len(failed),
                    # what the requests' writes moved (descriptor bytes, every rank: a
                    # staged chunk's rows cover whole blocks or a tail, at most twice the
                    # last block's bytes) against the KV they carried: GB/s is of the KV
                    "bytes_per_request": nbytes // len(res),
                    "kv_bytes_per_request": kv_bytes,
                    "descriptors_per_request": res[0].descriptors,
                    "gbps": kv_bytes * len(res) / span / 1e9,
                    "wire_gbps": nbytes / span / 1e9,
                    "p50_ms": 1e3 * lat[len(lat) // 2],
                    "p90_ms": 1e3 * lat[int(len(lat) * 0.9)],
                }
                pre = [x for r in res for x in r.reports if x.role == "prefill"]
                for k in ("queue_s", "post_s", "transfer_s", "latency_s"):
                    vals = sorted(getattr(x, k) for x in pre)
                    cell[f"prefill_{k[:-2]}_ms"] = 1e3 * vals[len(vals) // 2]
                cell["stages_ms"] = stage_medians(res)
                spread = spread_medians(res)
                if spread:
                    cell["spread_ms"] = spread
                cell["gil"] = gil_figures(c)
                # the share of one core each process used during the cell (see cpu_seconds)
                cell["cpu_share"] = {
                    k: round((cpu1[k] - cpu0[k]) / span, 3) for k in cpu1 if k in cpu0
                }
                report["cells"].append(cell)
                log(f"engine {cell}")
        if flag is not None:
            flag.unlink(missing_ok=True)
        assert_tables_empty(c)
    return report
