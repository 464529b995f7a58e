"""``hisparse`` host staging: picks, per decode rank, how chunks reach its host pool.

Two paths, chosen at handshake (prefill side) for each decode rank:

``mapped``
    Decode allocated its host pool with :class:`~kvwire_hisparse.shm.SharedHostPool` and runs on
    the same host. Prefill maps the same file (pinned, when its KV is in VRAM) and copies each
    chunk's rows into it itself (:class:`~kvwire_hisparse.copier.RowCopier`, whose row tables
    are validated once here at handshake): one fused-mover launch per batch of VRAM rows
    writing straight into the pinned pages, a memory copy for DRAM rows. One segment per
    source memory kind, each completing on its own; decode hears of each through a
    control-channel note. No engine is involved, so this is as fast as a local device-to-host
    copy (docs/benchmarks.md).

``engine``
    Anything else (another host, a pool that is not shared, no CUDA where the KV is in VRAM):
    the selected backend writes the rows, split by core into one transfer per (source kind,
    destination kind) when the pool mixes kinds.

``KVWireConfig.pools["host"].staging_options={"path": "mapped" | "engine"}`` forces one; ``auto``
(default) takes ``mapped`` whenever it can work. A local device-to-host hop followed by an
engine DRAM -> DRAM write was measured too (5.4 GB/s against ~55 GB/s locally, limited by the
cross-process copy) and is not offered: on one host ``mapped`` beats it, and across hosts an
RDMA engine reads GPU memory directly.

Who calls what: core's decode manager calls :meth:`describe` when it says hello; the prefill
manager calls :meth:`link_tables` at handshake (control thread), :meth:`plan` and
:meth:`on_sent` on transfer workers, :meth:`peer_lost` on the control thread, and
:meth:`close` at shutdown.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict, Field

from kvwire.descriptors import ADDR, LEN
from kvwire.errors import ConfigError, KVWireError
from kvwire.index.base import IndexMapper, TablePair
from kvwire.layout import MemKind
from kvwire.session.segments import row_kinds, segment_label
from kvwire.staging.base import ChunkPlan, PlanRequest, Segment, StagingStrategy
from kvwire_hisparse.copier import CopyJob, RowCopier, RowTable
from kvwire_hisparse.cuda_rows import VramPath
from kvwire_hisparse.shm import SharedHostPool, host_identity

logger = logging.getLogger(__name__)

STRATEGY = "hisparse"


class HostPathOptions(BaseModel):
    """Options of the ``hisparse`` host staging strategy."""

    model_config = ConfigDict(extra="forbid")

    #: ``auto``: ``mapped`` when decode's pool is shared memory on this host, else ``engine``.
    path: Literal["auto", "mapped", "engine"] = "auto"
    #: How long a failed plan waits for copies it already started before giving up on them.
    abort_wait_s: float = 30.0
    #: ``mapped`` path: how VRAM rows move (:data:`~kvwire_hisparse.cuda_rows.VramPath`):
    #: ``mover`` (kvwire's fused run mover), ``index`` (the earlier copy-engine runs and
    #: index_select/index_copy_ kernels), ``auto`` (``mover`` when Triton imports): measured
    #: on an H100 (docs/benchmarks.md, "HiSparse's copier on a GPU"), the mover moved
    #: scattered token rows 1.05-1.10x faster than the index kernels and long rows equally.
    vram_path: VramPath = "auto"
    #: ``mapped`` path: rows planned and queued per batch (the GPU starts on the first batch
    #: while the next is planned); 0: a chunk's rows in one batch.
    batch_rows: int = Field(default=16384, ge=0)


@dataclass(eq=False)
class _Link:
    """One decode rank's host pool as this prefill rank reaches it."""

    session: str
    path: str
    reason: str
    tables: TablePair | None = None
    src_kind: NDArray[np.int8] | None = None
    #: the source memory kinds the table holds (one: no per-chunk split by kind)
    kinds: tuple[int, ...] = ()
    row_len: int = 0
    copier: RowCopier | None = None
    #: the link's row tables, validated once for the copier
    rows: RowTable | None = None
    pools: list[SharedHostPool] = field(default_factory=list)
    #: Chunks whose copies are running; the pools stay mapped until they are done.
    inflight: int = 0
    closing: bool = False

    def close(self) -> None:
        if self.copier is not None:
            self.copier.close()
        for p in self.pools:
            p.close()
        self.copier, self.pools = None, []


class HostPathStrategy(StagingStrategy):
    """Chooses and runs the path into each decode rank's host pool (see the module doc)."""

    name = STRATEGY
    options_model = HostPathOptions

    def __init__(self, options: BaseModel | None = None) -> None:
        super().__init__(options)
        self._lock = threading.Lock()
        self._links: dict[str, _Link] = {}
        #: Links replaced or lost while copies still ran: unmapped after the last one.
        self._closing: set[_Link] = set()

    @property
    def opts(self) -> HostPathOptions:
        assert isinstance(self.options, HostPathOptions)
        return self.options

    # ------------------------------------------------------------------ decode side
    def describe(self) -> dict[str, Any] | None:
        """Decode, at hello: the shared-memory files behind the host pool, if all of it is in
        :class:`SharedHostPool` s created by this process; None otherwise (engine path)."""
        ctx = self.context
        if ctx is None or ctx.pool_layout is None:
            return None
        pools: dict[str, SharedHostPool] = {}
        for r in ctx.pool_layout.buffers:
            pool = SharedHostPool.find(r.addr, r.length)
            if pool is None:
                logger.info(
                    "host pool region %#x (+%d B) is not in a SharedHostPool: prefill ranks use "
                    "the engine path",
                    r.addr,
                    r.length,
                )
                return None
            pools[pool.path] = pool
        return {
            "strategy": STRATEGY,
            "identity": host_identity(),
            "pools": [p.describe() for p in pools.values()],
        }

    # ----------------------------------------------------------------- prefill side
    def path_of(self, session: str) -> str:
        """The path chosen for decode session ``session`` ("mapped", "engine"; "" if none)."""
        with self._lock:
            link = self._links.get(session)
            return link.path if link is not None else ""

    def paths(self) -> dict[str, str]:
        """Every linked decode session and its path (tests, diagnostics)."""
        with self._lock:
            return {k: v.path for k, v in self._links.items()}

    def link_tables(
        self,
        mapper: IndexMapper,
        remote: dict[str, Any] | None,
        *,
        session: str = "",
        tables: TablePair | None = None,
    ) -> dict[str, Any]:
        """Prefill, at handshake with a decode rank's host pool: choose its path. No extra
        descriptor tables either way (``mapped`` copies without the engine)."""
        if tables is None or self.context is None:
            return {}  # not a host-pool link: nothing to choose
        link = self._choose(session, remote, tables)
        logger.info("host pool of decode session %s: %s path (%s)", session, link.path, link.reason)
        with self._lock:
            old = self._links.get(session)
        if old is not None:
            self._retire(old)
        with self._lock:
            self._links[session] = link
        return {}

    def _choose(self, session: str, remote: dict[str, Any] | None, tables: TablePair) -> _Link:
        want = self.opts.path
        if want == "engine":
            return _Link(session, "engine", "forced by the host pool's staging_options")
        why = self._mapped_problem(remote, tables)
        if why is None:
            try:
                return self._mapped(session, remote or {}, tables)
            except (KVWireError, OSError) as exc:
                why = f"mapping decode's pool failed: {exc}"
        if want == "mapped":
            raise ConfigError(
                "host pool staging_options path='mapped' cannot work for decode session "
                f"{session}: "
                f"{why}; use path='auto' to fall back to the engine"
            )
        return _Link(session, "engine", why)

    def _mapped_problem(self, remote: dict[str, Any] | None, tables: TablePair) -> str | None:
        if not remote or remote.get("strategy") != STRATEGY or not remote.get("pools"):
            return "decode's host pool is not a SharedHostPool"
        if remote.get("identity") != host_identity():
            return "decode runs on another host (or as another user)"
        lens = tables.src[:, LEN]
        if lens.size and (lens != lens[0]).any():
            return "source rows differ in length"
        dlens = tables.dst[:, LEN]
        if lens.size and dlens.size and (dlens != lens[0]).any():
            return "host pool rows differ in length from source rows"
        return None

    def _mapped(self, session: str, remote: dict[str, Any], tables: TablePair) -> _Link:
        assert self.context is not None
        regions = list(self.context.layout.buffers)
        vram = any(r.kind is MemKind.VRAM for r in regions)
        pools: list[tuple[int, SharedHostPool]] = []
        try:
            for d in remote["pools"]:
                pool = SharedHostPool.attach(str(d["path"]), int(d["nbytes"]), pin=vram)
                pools.append((int(d["addr"]), pool))
            copier = RowCopier(
                regions, pools, vram_path=self.opts.vram_path, batch_rows=self.opts.batch_rows
            )
            row_len = int(tables.src[0, LEN]) if tables.src.size else 0
            try:
                rows = copier.prepare(tables.src[:, ADDR], tables.dst[:, ADDR], max(row_len, 1))
            except BaseException:
                copier.close()
                raise
        except BaseException:
            for _, p in pools:
                p.close()
            raise
        src_kind = row_kinds(tables.src, regions, "host pool source table")
        return _Link(
            session,
            "mapped",
            "same host, shared host pool"
            + (f", pinned for GPU copies ({copier.vram_path})" if vram else ""),
            tables=tables,
            src_kind=src_kind,
            kinds=tuple(np.unique(src_kind).tolist()),
            row_len=row_len,
            copier=copier,
            rows=rows,
            pools=[p for _, p in pools],
        )

    def plan(self, req: PlanRequest) -> ChunkPlan:
        """Transfer worker: map the chunk; on a ``mapped`` link start one copy per source
        memory kind now (the pipeline polls them), else leave the rows to the engine."""
        s_idx, d_idx = req.mapper.map_chunk(req.src_pages, req.dst_pages)
        with self._lock:
            link = self._links.get(req.dest)
            if link is None or link.path != "mapped" or link.closing or s_idx.size == 0:
                return ChunkPlan(table="kv", src_idx=s_idx, dst_idx=d_idx)
            link.inflight += 1
        assert link.src_kind is not None and link.copier is not None and link.rows is not None
        segments: list[Segment] = []
        jobs: list[CopyJob] = []
        try:
            if len(link.kinds) == 1:  # one source kind: no split (the usual case)
                parts = [(link.kinds[0], s_idx, d_idx)]
            else:
                kinds = link.src_kind[s_idx]
                parts = [
                    (k, s_idx[kinds == k], d_idx[kinds == k]) for k in np.unique(kinds).tolist()
                ]
            for k, si, di in parts:
                job = link.copier.start_rows(link.rows, si, di)
                jobs.append(job)
                segments.append(Segment(label=segment_label(k, MemKind.DRAM), copy=job))
        except BaseException:
            for j in jobs:  # never unmap (or let decode reuse) pages a copy still writes
                try:
                    j.wait(self.opts.abort_wait_s)
                except KVWireError as exc:
                    logger.warning("room %d: an aborted chunk's copy failed too: %s", req.room, exc)
            self._done(link)
            raise
        return ChunkPlan(table="kv", src_idx=s_idx, dst_idx=d_idx, token=link, segments=segments)

    def on_sent(self, room: int, plan: ChunkPlan, ok: bool) -> None:
        """Transfer worker: every segment of a ``mapped`` chunk is terminal."""
        if isinstance(plan.token, _Link):
            self._done(plan.token)

    def _done(self, link: _Link) -> None:
        with self._lock:
            link.inflight -= 1
            if not (link.closing and link.inflight <= 0):
                return
            self._closing.discard(link)
        link.close()

    def _retire(self, link: _Link) -> None:
        """Unmap a link's pools now, or once its running copies are done."""
        with self._lock:
            if self._links.get(link.session) is link:
                del self._links[link.session]
            if link.inflight > 0:
                link.closing = True
                self._closing.add(link)
                return
        link.close()

    def peer_lost(self, session: str) -> None:
        """Control thread: the decode rank is gone; unmap its pool once no copy writes it."""
        with self._lock:
            link = self._links.get(session)
        if link is not None:
            self._retire(link)

    def room_tables(self) -> dict[str, int]:
        """Leak check: links of departed decode ranks still waiting for running copies."""
        with self._lock:
            return {"host_links_closing": len(self._closing)}

    def close(self) -> None:
        """Manager shutdown: unmap every attached pool."""
        with self._lock:
            links = [*self._links.values(), *self._closing]
            self._links.clear()
            self._closing.clear()
        for link in links:
            link.close()
        super().close()
