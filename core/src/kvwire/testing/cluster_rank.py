"""The rank processes of the multi-process cluster harness (:mod:`kvwire.testing.cluster`).

:func:`rank_main` is the entry point :class:`~kvwire.testing.cluster.Cluster` spawns for each
prefill and decode rank: it builds the rank's verification pool
(:class:`~kvwire.testing.rank_pool.RankPool`), a :class:`~kvwire.session.KVManager` over it,
and then plays its engine: a scheduler loop over the requests the parent starts, calling
exactly the engine API, filling (prefill) and checking (decode) every element.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from numpy.typing import NDArray
from pydantic import SecretStr

from kvwire.layout import RankPosition
from kvwire.testing.busy_engine import EngineLoop
from kvwire.testing.cluster_groups import GroupAlloc
from kvwire.testing.cluster_spec import (
    AUX_WORDS,
    FAULT_ENV,
    QUARANTINE_S,
    ClusterSpec,
    RankReport,
    RoomPlan,
    pin_rank,
    rank_gpu,
)
from kvwire.testing.kvfill import (
    count_mismatches,
)
from kvwire.testing.rank_pool import RankPool


class _Hooks:
    """Records the decode engine hooks a rank receives, per request."""

    def __init__(self, events: dict[int, list[str]]) -> None:
        self.events = events

    def on_prealloc(self, room: int, num_units: int) -> None:
        self.events.setdefault(room, []).append(f"prealloc:{num_units}")

    def on_admit(self, room: int, num_tokens: int) -> None:
        self.events.setdefault(room, []).append(f"admit:{num_tokens}")

    def on_abandon(self, room: int) -> None:
        self.events.setdefault(room, []).append("abandon")


#: The fields of :class:`RankReport` that ``recovery_of`` fills, in its order.
RECOVERY_FIELDS = ("cause", "good_pages", "missing_pages", "good_mismatches")


def aux_row(room: int) -> NDArray[np.int32]:
    return (((room % 1_000_003) * 7_919 + np.arange(AUX_WORDS)) & 0x7FFFFFFF).astype(np.int32)


@dataclass
class _Active:
    plan: RoomPlan
    obj: Any
    pages: NDArray[np.int64]
    aux_index: int
    t0: float
    stage: int = 0
    next_chunk: int = 0
    stall_until: float = 0.0
    #: A layer-wise last chunk was sent before its stall; its layers are marked after it.
    marks_due: bool = False
    #: The request's buffer-group slots (:attr:`ClusterSpec.groups`), or None.
    groups: GroupAlloc | None = None

    def state_indices(self, pool: RankPool, last: bool = True) -> dict[str, Any] | None:
        """The ``state_indices`` the engine gives with the last chunk (and to decode)."""
        if not last or pool.groups is None or self.groups is None:
            return None
        return pool.groups.state_indices(self.groups)


def rank_main(
    conn: Connection,
    spec_json: str,
    role: str,
    tp_rank: int,
    pp_rank: int,
    inst: int,
    addr: str,
    secret: str,
    bootstrap_addrs: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """Entry point of a rank process (spawned). ``secret`` travels apart from the spec (a
    config serialised to JSON masks it). ``addr``: the bootstrap service a prefill rank
    registers with ("" for the rank that runs it); ``bootstrap_addrs``: every prefill
    instance's, for decode receivers (default ``[addr]``)."""
    if env is not None:  # first: the parent's environment as it was when it started us
        os.environ.clear()
        os.environ.update(env)
    from kvwire.session import KVManager, KVPoll, Role

    spec = ClusterSpec.model_validate_json(spec_json)
    pin_rank(spec, role, inst, tp_rank, pp_rank)  # first: threads started later inherit it
    if spec.switch_interval_s is not None:
        sys.setswitchinterval(spec.switch_interval_s)
    engine = EngineLoop(spec.engine_busy)
    if netns := spec.netns_for(role, inst):  # first: every socket this process opens lives there
        from kvwire.testing.netns import enter_netns

        enter_netns(netns)
    spec.config = spec.config_for(role, inst)
    if secret:
        spec.config = spec.config.model_copy(update={"secret": SecretStr(secret)})
    fault = os.environ.get(FAULT_ENV)
    if fault:
        from kvwire.testing import faults

        faults.apply(fault, role)
    logging.basicConfig(
        level=spec.log_level,
        format=f"[{role}{inst}.{pp_rank}.{tp_rank}] %(levelname)s %(name)s: %(message)s",
    )
    m = spec.model
    if role == "prefill":
        rank = RankPosition(
            tp_size=spec.prefill_tp,
            tp_rank=tp_rank,
            pp_size=spec.prefill_pp,
            pp_rank=pp_rank,
            dp_rank=inst if spec.prefill_dp > 1 else 0,
        )
        per = -(-m.num_layers // spec.prefill_pp)
        first_layer, end = pp_rank * per, min(m.num_layers, (pp_rank + 1) * per)
    else:
        rank = RankPosition(
            tp_size=spec.decode_tp, tp_rank=tp_rank, pp_size=spec.decode_pp, pp_rank=pp_rank
        )
        per = -(-m.num_layers // spec.decode_pp)
        first_layer, end = pp_rank * per, min(m.num_layers, (pp_rank + 1) * per)
    dm = spec.decode_model()
    device = spec.device
    if spec.device == "cuda":  # ranks spread over the GPUs (spec.gpus), this one first
        import torch

        gpu = rank_gpu(spec, role, inst, tp_rank, pp_rank, torch.cuda.device_count())
        assert gpu is not None
        torch.cuda.set_device(gpu)
        device = f"cuda:{gpu}"
    pool = RankPool(
        spec,
        rank,
        first_layer,
        end,
        m if role == "prefill" else dm,
        role in spec.head_major,
        role in spec.kv_fused,
        role in spec.kv_in_slot,
        device,
    )
    hook_events: dict[int, list[str]] = {}
    hooks = _Hooks(hook_events)
    if role == "decode" and spec.host_page_size:
        pool.add_host_pool(spec, spec.host_page_size)
    engine.measure_alone()  # a busy loop's rate before kvwire's threads exist
    mgr = KVManager(
        spec.config,
        Role(role),
        pool.layout,
        aux_buffers=[pool.aux_region],
        bootstrap_addr=addr or None,
        agent_name=None if spec.default_names else f"{role}{inst}-pp{pp_rank}-tp{tp_rank}",
        kv_tensors=pool.arrays if spec.kv_tensors else None,
        # the engine side of the test harness names HiSparse's pool, as an adapter does
        pools={"host": pool.host_layout} if pool.host_layout is not None else None,
        hooks=hooks if pool.host_layout is not None else None,
        dp_size=spec.prefill_dp if role == "prefill" else 1,
    )
    rng = np.random.default_rng(
        spec.seed * 7919 + (pp_rank * 64 + tp_rank) * 8 + inst + (0 if role == "prefill" else 4096)
    )
    free = list(rng.permutation(pool.slots))
    free_host = list(rng.permutation(spec.slots * pool.host_units))
    free_aux = list(range(spec.aux_slots))
    quarantine: list[tuple[float, NDArray[np.int64], int, Any, list[Any], _Active]] = []
    active: dict[int, _Active] = {}
    addrs = bootstrap_addrs or [addr]
    conn.send(("ready", mgr.bootstrap_addr or "", mgr.channel.endpoint, mgr.agent_name))
    rid = pp_rank * (spec.prefill_tp if role == "prefill" else spec.decode_tp) + tp_rank

    def evictions() -> int:
        from prometheus_client import REGISTRY

        value = REGISTRY.get_sample_value("kvwire_peer_evictions_total", mgr.labels)
        return int(value or 0)

    def transport_switches() -> dict[str, Any]:
        """This rank's failover metrics (summed over their labels) and each link's current
        backend (docs/failover.md)."""
        from prometheus_client import REGISTRY

        out: dict[str, Any] = {"failovers": 0, "recoveries": 0}
        for metric, key in (
            ("kvwire_transport_failovers", "failovers"),
            ("kvwire_transport_recoveries", "recoveries"),
        ):
            for fam in REGISTRY.collect():
                if fam.name != metric:
                    continue
                for sample in fam.samples:
                    own = all(sample.labels.get(k) == v for k, v in mgr.labels.items())
                    if sample.name.endswith("_total") and own:
                        out[key] += int(sample.value)
        link_backend = getattr(mgr.backend, "link_backend", None)
        if link_backend is not None:
            out["links"] = {p: link_backend(p) for p in mgr.backend.peers()}
        return out

    def report(a: _Active, status: Any, t_done: float, mism: int = 0, aux_ok: bool = True) -> None:
        err = None
        if status == KVPoll.Failed:
            try:
                a.obj.failure_exception()
                err = "failed (no exception recorded)"
            except Exception as exc:
                err = f"{type(exc).__name__}: {exc}"
        mt = a.obj.metrics
        recovery = recovery_of(a) if status == KVPoll.Failed and role == "decode" else ()
        conn.send(
            (
                "done",
                RankReport(
                    role,
                    rid,
                    int(status),
                    err,
                    mism,
                    aux_ok,
                    time.perf_counter() - a.t0,
                    mt.bytes,
                    mt.descriptors,
                    tuple(hook_events.pop(a.plan.room, [])),
                    inst,
                    t_done,
                    mt.queue_s,
                    mt.post_s,
                    mt.transfer_s,
                    **dict(zip(RECOVERY_FIELDS, recovery, strict=False)),
                    marks={**mt.marks, "created": a.t0, "seen": time.perf_counter()},
                ),
                a.plan.room,
            )
        )
        a.obj.clear()
        slots = free_host if a.plan.hisparse and role == "decode" else free
        if status == KVPoll.Success:
            slots.extend(a.pages.tolist())
            free_aux.append(a.aux_index)
            release_groups(a)
        else:  # a writer may still be busy with a failed room's slots: quarantine them
            quarantine.append(
                (time.monotonic() + QUARANTINE_S, a.pages, a.aux_index, a.obj, slots, a)
            )

    def recovery_of(a: _Active) -> tuple[Any, ...]:
        """A failed KV-pool request's failure report, and its good pages checked element
        by element: (cause, good positions, missing positions, mismatches in good pages)."""
        rep = a.obj.failure_report()
        if rep is None or a.plan.hisparse:
            return ()
        bad = 0
        first = a.plan.cached_pages * m.page_size
        left = (a.plan.num_pages - a.plan.cached_pages) * m.page_size
        for j in rep.good_pages.tolist() if a.plan.verified(spec) else ():
            rows = min(dm.page_size, left - j * dm.page_size)
            bad += pool.mismatches(a.pages[j : j + 1], first + j * dm.page_size, rows)
        return rep.cause, tuple(rep.good_pages.tolist()), tuple(rep.missing_pages.tolist()), bad

    def release_groups(a: _Active) -> None:
        if pool.groups is not None and a.groups is not None:
            pool.groups.release(a.groups)

    def start(plan: RoomPlan) -> None:
        t0 = time.perf_counter()
        galloc = None
        aux_index = free_aux.pop()
        if role == "prefill":
            n = plan.num_pages
            pages = np.array([free.pop() for _ in range(n)], dtype=np.int64)
            if plan.verified(spec):
                pool.fill(pages, 0)
            if pool.groups is not None:
                galloc = pool.groups.alloc(n)
                if plan.verified(spec):
                    pool.groups.fill(plan.room, galloc, pages)
            pool.aux[aux_index] = aux_row(plan.room)
            obj: Any = mgr.sender(plan.room)
        elif plan.hisparse:
            n = plan.num_pages * pool.host_units - plan.trim if plan.num_pages else 0
            pages = np.array([free_host.pop() for _ in range(n)], dtype=np.int64)
            if plan.verified(spec):
                for harr in pool.host_arrays:
                    harr[pages] = -1
            pool.aux[aux_index] = 0
            obj = mgr.receiver(plan.room, addrs[plan.prefill_instance])
            obj.init()
            obj.send_metadata(pages, aux_index, pool="host")
        else:
            # the prompt is num_pages whole prefill pages; decode keeps cached_pages of them
            left = (plan.num_pages - plan.cached_pages) * m.page_size
            n = -(-left // dm.page_size)
            pages = np.array([free.pop() for _ in range(n)], dtype=np.int64)
            if plan.verified(spec):
                pool.poison(pages)
            pool.aux[aux_index] = 0
            obj = mgr.receiver(plan.room, addrs[plan.prefill_instance])
            obj.init()
            if pool.groups is not None:
                galloc = pool.groups.alloc(plan.num_pages)
                if plan.verified(spec):
                    pool.groups.poison(galloc, pages)
            state = pool.groups.state_indices(galloc) if pool.groups and galloc else None
            obj.send_metadata(
                pages, aux_index, cached_tokens=plan.cached_pages * m.page_size, state_indices=state
            )
        active[plan.room] = _Active(plan, obj, pages, aux_index, t0, groups=galloc)

    def step(a: _Active) -> bool:
        """Advance one request; True when it is finished (reported)."""
        st = a.obj.poll()
        t_done = time.monotonic()
        if role == "decode":
            if a.plan.decode_abort and a.stage == 0 and st >= KVPoll.WaitingForInput:
                a.obj.abort()
                a.stage = 1
            if st == KVPoll.Success:
                first = a.plan.cached_pages * m.page_size
                if a.plan.hisparse:
                    assert pool.host_layout is not None
                    mism = (
                        count_mismatches(pool.host_layout, pool.host_arrays, a.pages, 0)
                        if a.plan.verified(spec)
                        else 0
                    )
                else:
                    left = (a.plan.num_pages - a.plan.cached_pages) * m.page_size
                    mism = pool.mismatches(a.pages, first, left) if a.plan.verified(spec) else 0
                    if pool.groups is not None and a.groups is not None and a.plan.verified(spec):
                        mism += pool.groups.mismatches(
                            a.plan.room, a.groups, a.pages, a.plan.cached_pages
                        )
                aux_ok = bool((pool.aux[a.aux_index] == aux_row(a.plan.room)).all())
                report(a, st, t_done, mism, aux_ok)
                return True
            if st == KVPoll.Failed:
                report(a, st, t_done)
                return True
            return False
        if st in (KVPoll.Failed, KVPoll.Success):
            report(a, st, t_done)
            return True
        if (st >= KVPoll.WaitingForInput or a.plan.send_first) and a.stage == 0:
            a.obj.init(a.plan.num_pages, a.aux_index)
            a.stage = 1
        if a.stage == 1:
            chunks = a.plan.chunks
            if a.plan.prefill_abort and a.next_chunk >= 1:
                a.obj.abort()
                a.stage = 2
                return False
            if a.next_chunk < len(chunks):
                last = a.next_chunk == len(chunks) - 1
                lw = a.plan.layerwise
                lo = sum(chunks[: a.next_chunk])
                pages = a.pages[lo : lo + chunks[a.next_chunk]]
                if last and a.plan.stall_s and a.stall_until == 0.0:
                    a.stall_until = time.monotonic() + a.plan.stall_s
                    # the driver learns the request is held here (a fault fired now finds it
                    # in flight however late the driver reads its pipes)
                    conn.send(("stalled", a.next_chunk, a.plan.room))
                    if lw:  # a slow layer-wise pass: sent now, its layers marked after the stall
                        a.obj.send(
                            pages, last=True, layerwise=True, state_indices=a.state_indices(pool)
                        )
                        a.marks_due = True
                if last and time.monotonic() < a.stall_until:
                    return False
                if not a.marks_due:
                    a.obj.send(
                        pages, last=last, layerwise=lw, state_indices=a.state_indices(pool, last)
                    )
                if lw:  # the "forward pass": every layer of this rank, one after the other
                    for layer in range(mgr.layout.start_layer, mgr.layout.layer_end):
                        a.obj.layer_ready(layer)
                conn.send(("sent", a.next_chunk, a.plan.room))
                a.next_chunk += 1
        return False

    # The driver's pipe is checked every engine step: with one poll object registered once
    # (~1 us) rather than Connection.poll, which builds a selector per call (~20-60 us, on
    # the rank's GIL beside kvwire's threads, thousands of times a second at C=8).
    pipe = select.poll()
    pipe.register(conn.fileno(), select.POLLIN)
    stop = False
    try:
        while True:
            # poll rounds a timeout up to whole milliseconds: with requests in flight, check
            # without waiting and sleep one engine step instead.
            if active or engine.busy:  # a busy engine runs Python with or without requests
                ready = bool(pipe.poll(0))
                if not ready:
                    engine.pause(spec.engine_step_s)
            else:
                ready = bool(pipe.poll(10))
            # every message waiting is taken in one step, as an engine's scheduler takes every
            # new request (one a step capped a cell at ~1,500 requests/s with 32 in flight:
            # each step also polls every active request)
            while ready:
                msg = conn.recv()
                ready = bool(pipe.poll(0))
                if msg[0] == "start":
                    start(RoomPlan.model_validate(msg[1]))
                elif msg[0] == "tables":
                    conn.send(("tables", mgr.room_tables(), mgr.dropped))
                elif msg[0] == "stats":
                    stats: dict[str, Any] = {"evictions": evictions(), "peers": len(mgr.peers)}
                    stats["switch_interval_s"] = sys.getswitchinterval()
                    stats["gil_lowerings"] = mgr.gil.lowerings
                    stats["gil_own_late"] = mgr.gil.own_late
                    stats["gil_windows"] = mgr.gil.windows
                    stats["gil_last_median_s"] = mgr.gil.last_median_s
                    stats.update(transport_switches())
                    stats.update({f"local_{k}": v for k, v in mgr.channel.local_counts.items()})
                    conn.send(("stats", stats, mgr.dropped))
                elif msg[0] == "peer_agents":
                    conn.send(("peer_agents", sorted(p.agent for p in mgr.peers.snapshot())))
                elif msg[0] == "host_paths":
                    paths: dict[str, str] = getattr(mgr.staging_of("host"), "paths", dict)()
                    conn.send(("host_paths", paths))
                elif msg[0] == "stop":
                    stop = True
                    break
            if stop:
                break
            for room in list(active):
                if step(active[room]):
                    del active[room]
            for entry in list(quarantine):
                deadline, pages, aux_index, obj, slots, ended = entry
                quiet = role == "prefill" or obj.writes_quiesced()
                if quiet or time.monotonic() > deadline:
                    quarantine.remove(entry)
                    slots.extend(pages.tolist())
                    free_aux.append(aux_index)
                    release_groups(ended)
    finally:
        engine.report(f"{role}{inst}.{pp_rank}.{tp_rank}")
        mgr.close()
        if pool.shared is not None:
            pool.host_arrays = []  # drop the views first, so the mapping can go too
            pool.shared.close()
        with contextlib.suppress(OSError):
            conn.send(("closed", mgr.room_tables()))
