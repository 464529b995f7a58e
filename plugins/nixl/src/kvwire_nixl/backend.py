"""The ``nixl`` transfer backend: kvwire's :class:`TransferBackend` over NVIDIA NIXL.

Design (one NIXL agent per kvwire agent, i.e. per rank):

* The agent is created with NIXL's progress thread **off** (its poll delay is hard-coded to 0,
  so it busy-spins a core). Progress is driven by the owner instead: kvwire's control thread
  calls :meth:`NixlBackend.progress` / :meth:`NixlBackend.get_notifications` about every
  millisecond, and transfer workers drive their own transfers through :meth:`poll`
  (``check_xfer_state`` progresses UCX). A passive target must do this too, or an initiator's
  first transfer (the UCX wire-up) never completes. ``progress="thread"`` restores NIXL's
  thread for machines with cores to spare.
* Engine calls run concurrently, under NIXL's own thread safety: the agent is created with
  ``NIXL_THREAD_SYNC_RW`` (``sync_mode="rw"``, the default), where posting and checking
  transfers take NIXL's lock shared (and UCX's worker runs in multi-thread mode) while
  adding/removing agents, preparing lists and (de)registering memory take it exclusively.
  NIXL releases the GIL inside its calls, so several workers copy at once (UCX ``cma``
  copies inside ``transfer``), handshake threads (``add_peer``, ``prepare``) wait for at most
  the transfers in flight, and the owner loop drains notifications meanwhile.
  ``sync_mode="strict"`` makes NIXL serialise every call on one mutex; ``sync_mode="none"``
  tells NIXL not to lock at all, so kvwire then serialises every NIXL call of the agent on
  one Python lock of its own (the former behaviour).
* kvwire's own bookkeeping (peers, each peer's pending transfers, pair users, deferred
  releases) sits under one small lock that is never held across a NIXL call. The template
  runs ``add_peer``/``prepare``/``remove_peer``/``close`` under its control lock and
  ``submit``/``poll``/``release`` with no lock at all.
* ``prepare`` builds one local and one remote prepared descriptor list per peer from the
  ``N x 3`` ``uint64`` tables (``prep_xfer_dlist``), and ``submit`` only passes two ``int64``
  index arrays to ``make_prepped_xfer``.
* kvwire owns every handle's lifetime (NIXL has no stale-handle guards): a transfer's NIXL
  handle is freed once, as soon as it is terminal or abandoned. Each transfer has a lock of
  its own, held while a thread posts, checks or frees that handle (and only then), so a
  handle polled in one thread while another removes its peer is freed after the poll, never
  under it. A prepared pair counts the submits using its lists, and a peer the submits in
  progress: releasing a pair waits for its users, and removing a peer (or closing) refuses
  new submits, waits for those in progress, then fails and frees its pending handles, all
  before ``remove_remote_agent``.
* Notifications carry a one-byte tag so that kvwire's own are told apart (an empty payload
  is legal in kvwire but means "no notification" to NIXL); foreign ones are dropped.
* Every NIXL exception is converted to a kvwire error naming the call that failed.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvwire.backend import (
    BackendCapabilities,
    Notification,
    PreparedPair,
    TransferBackend,
    TransferHandle,
    XferOp,
    XferState,
)
from kvwire.backends.envelope import (
    pack_metadata,
    region_rows,
    regions_from_rows,
    unpack_metadata,
)
from kvwire.descriptors import ADDR, LEN, DescTable, locate_rows
from kvwire.errors import (
    ConfigError,
    DescriptorError,
    HandleError,
    KVWireError,
    PeerError,
    TransferError,
)
from kvwire.layout import MemKind, MemoryRegion
from kvwire_nixl import _engine

logger = logging.getLogger(__name__)

#: The NIXL build, imported when this module is (so a missing NIXL makes ``nixl`` unusable
#: for ``--transfer-backend auto`` instead of failing later).
ENGINE = _engine.load()

METADATA_VERSION = 2
#: Prefix of every notification kvwire sends through NIXL.
NOTIF_TAG = b"\x6b"  # "k"
_OPS = {XferOp.WRITE: "WRITE", XferOp.READ: "READ"}
_MEM = {MemKind.DRAM: "DRAM", MemKind.VRAM: "VRAM"}
_SYNC = {
    "none": "NIXL_THREAD_SYNC_NONE",
    "strict": "NIXL_THREAD_SYNC_STRICT",
    "rw": "NIXL_THREAD_SYNC_RW",
}
_ENV_PREFIXES = ("UCX_", "NIXL_")


def _scalar_to_str(value: object, what: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value)
    raise ValueError(f"{what} must be a string, number or boolean, got {type(value).__name__}")


class NixlOptions(BaseModel):
    """Options of the ``nixl`` backend (``--transfer-backend-option key=value``, JSON values)."""

    model_config = ConfigDict(extra="forbid")

    backends: list[str] = Field(
        default_factory=lambda: ["UCX"],
        min_length=1,
        description="NIXL backend plugins to create, in order (e.g. UCX, LIBFABRIC).",
    )
    backend_params: dict[str, dict[str, str]] = Field(
        default_factory=dict,
        description='Init parameters per backend, e.g. {"UCX": {"ucx_error_handling_mode": '
        '"none"}}; values are passed to NIXL as strings.',
    )
    ucx_env: dict[str, str] = Field(
        default_factory=dict,
        description="UCX_*/NIXL_* environment variables set before the agent is created, only "
        "where not already set (the process environment wins).",
    )
    num_threads: int = Field(
        default=0, ge=0, le=1024, description="Worker threads of multi-threaded backends."
    )
    progress: Literal["owner", "thread"] = Field(
        default="owner",
        description="owner: kvwire's owner loop drives progress (NIXL's thread off); "
        "thread: NIXL's own progress thread (busy-spins one core).",
    )
    sync_mode: Literal["none", "strict", "rw"] = Field(
        default="rw",
        description="NIXL's internal thread sync. rw: transfers post and complete "
        "concurrently (shared lock; peers, lists and memory take it exclusively); strict: "
        "NIXL serialises every call on one mutex; none: NIXL does not lock, so kvwire "
        "serialises every NIXL call of the agent on one lock of its own.",
    )
    transfer_timeout_s: float | None = Field(
        default=120.0, gt=0, description="A transfer not finished by then fails (None: never)."
    )

    @field_validator("backends", mode="before")
    @classmethod
    def _split_backends(cls, value: object) -> object:
        if isinstance(value, str):
            return [b.strip() for b in value.split(",") if b.strip()]
        return value

    @field_validator("backends")
    @classmethod
    def _unique_backends(cls, value: list[str]) -> list[str]:
        if any(not b for b in value):
            raise ValueError("backend names must be non-empty")
        if len(set(value)) != len(value):
            raise ValueError(f"backends are listed twice: {value}")
        return value

    @field_validator("backend_params", mode="before")
    @classmethod
    def _stringify_params(cls, value: object) -> object:
        if not isinstance(value, Mapping):
            return value
        out: dict[object, object] = {}
        for backend, params in value.items():
            if isinstance(params, Mapping):
                out[backend] = {
                    k: _scalar_to_str(v, f"backend_params[{backend!r}][{k!r}]")
                    for k, v in params.items()
                }
            else:
                out[backend] = params
        return out

    @field_validator("ucx_env", mode="before")
    @classmethod
    def _stringify_env(cls, value: object) -> object:
        if not isinstance(value, Mapping):
            return value
        return {k: _scalar_to_str(v, f"ucx_env[{k!r}]") for k, v in value.items()}

    @field_validator("ucx_env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not key.startswith(_ENV_PREFIXES) or not key.replace("_", "").isalnum():
                raise ValueError(
                    f"ucx_env key {key!r} is not a UCX_* or NIXL_* environment variable name"
                )
        return value

    @model_validator(mode="after")
    def _params_for_known_backends(self) -> NixlOptions:
        unknown = sorted(set(self.backend_params) - set(self.backends))
        if unknown:
            raise ValueError(
                f"backend_params names backends {unknown} that are not in backends {self.backends}"
            )
        return self

    def init_params(self, backend: str) -> dict[str, str]:
        """Init parameters passed to ``create_backend`` for ``backend``."""
        params = dict(self.backend_params.get(backend, {}))
        if self.num_threads and backend in ("UCX", "OBJ", "LIBFABRIC"):
            params.setdefault("num_threads", str(self.num_threads))
        elif self.num_threads and backend == "GDS_MT":
            params.setdefault("thread_count", str(self.num_threads))
        return params


def apply_env(env: Mapping[str, str]) -> dict[str, str]:
    """Set each variable of ``env`` not already in the environment; return those set."""
    applied = {}
    for key, value in env.items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    return applied


#: UCX settings an agent with ``sync_mode="rw"`` applies before it is created, unless already
#: set (by the environment or ``ucx_env``). In that mode UCX runs its worker in multi-thread
#: mode, guarded by a spinlock by default; over ``cma`` the copy of a ``transfer`` runs inside
#: that lock, so other threads posting or checking transfers spin for milliseconds on cores
#: the copies need (measured on 2 vCPUs: 4 posting threads took ~40% longer). A mutex lets
#: them sleep. UCX reads it per context; it does not affect single-threaded workers.
RW_UCX_ENV_DEFAULTS = {"UCX_USE_MT_MUTEX": "y"}


# ----------------------------------------------------------------------------- state
# Locks, in the order they may be taken: a transfer's ``_Xfer.lock``, then the backend's
# bookkeeping lock (``NixlBackend._state``), then (with sync_mode="none" only) the engine
# lock around one NIXL call. The bookkeeping lock is never held across a NIXL call.
@dataclass(eq=False)
class _Peer:
    name: str
    regions: list[MemoryRegion]
    #: Transfers posted to this peer whose NIXL handle is not freed yet.
    xfers: set[_Xfer] = field(default_factory=set)
    #: Submits to this peer between their first check and publishing (or freeing) the handle.
    busy: int = 0
    #: Set (under the bookkeeping lock) when the peer is removed or the agent closes.
    removed: bool = False


@dataclass(eq=False)
class _Prepared:
    """Backend state of a :class:`PreparedPair`: the two prepared NIXL descriptor lists."""

    peer: _Peer
    local: Any  # None once freed
    remote: Any
    local_mem: str
    remote_mem: str
    #: Submits inside ``make_prepped_xfer`` with these lists right now.
    users: int = 0
    released: bool = False


@dataclass(eq=False)
class _Xfer:
    """Backend state of a :class:`TransferHandle`.

    ``lock`` is held by whichever thread posts, checks or frees ``nixl`` (and only then):
    state changes happen under it, so the handle is freed exactly once and never in use.
    """

    peer: _Peer
    nixl: Any  # nixl_xfer_handle; None once freed
    deadline: float | None
    state: XferState = XferState.PENDING
    error: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def finish(self, state: XferState, error: str | None = None) -> None:
        if self.state is XferState.PENDING:
            self.state = state
            self.error = error


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _is_nixl_error(exc: BaseException, *names: str) -> bool:
    return type(exc).__name__ in names and isinstance(exc, ENGINE.errors)


# Backends still open, closed at interpreter exit (a NIXL agent torn down by the garbage
# collector during finalisation can crash the process).
_live: weakref.WeakSet[NixlBackend] = weakref.WeakSet()
_fork_generation = 0


def _after_fork_in_child() -> None:
    global _fork_generation
    _fork_generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _close_all_at_exit() -> None:
    for backend in list(_live):
        if backend._generation == _fork_generation:
            try:
                backend.close()
            except Exception:  # exit must go on
                logger.debug("closing %s at exit failed", backend.agent_name, exc_info=True)


# ---------------------------------------------------------------------------- backend
class NixlBackend(TransferBackend):
    """NIXL agent behind kvwire's backend seam (WRITE, READ, notifications, DRAM, VRAM).

    Threads: see the module docstring. NIXL calls run with no kvwire lock held except a
    transfer's own lock (for the handle being posted, checked or freed) and, on the control
    path, the template's control lock; with ``sync_mode="none"`` every NIXL call also takes
    one engine lock.
    """

    name = "nixl"
    capabilities = BackendCapabilities(
        write=True, read=True, notifications=True, dram=True, vram=True, cross_host=True
    )
    options_model = NixlOptions
    options: NixlOptions

    def __init__(self, agent_name: str, options: BaseModel | None = None) -> None:
        super().__init__(agent_name, options)
        opts = self.options
        self._generation = _fork_generation
        self._agent: Any = None
        #: Bookkeeping lock: peers, their pending transfers and busy counts, pair users,
        #: deferred releases, ``_closing``. Never held across a NIXL call.
        self._state = threading.Lock()
        #: Notified when a pair's users or a peer's busy count drops to 0.
        self._quiet = threading.Condition(self._state)
        #: Around each NIXL call: one lock when NIXL itself does not lock (sync_mode="none").
        self._serial: contextlib.AbstractContextManager[Any] = (
            threading.RLock() if opts.sync_mode == "none" else contextlib.nullcontext()
        )
        self._closing = False
        self._peers: dict[str, _Peer] = {}
        self._reg: dict[MemoryRegion, Any] = {}
        self._notes: collections.deque[Notification] = collections.deque()
        self._deferred: list[Any] = []  # NIXL xfer handles whose release failed; retried
        #: Notifications dropped because they did not come from kvwire (no tag).
        self.foreign_notifications = 0
        #: Environment variables this agent set from ``ucx_env``.
        self.applied_env = apply_env(opts.ucx_env)
        #: Environment variables this agent set from :data:`RW_UCX_ENV_DEFAULTS`.
        self.applied_defaults = apply_env(RW_UCX_ENV_DEFAULTS) if opts.sync_mode == "rw" else {}
        api = ENGINE.api
        conf = api.nixl_agent_config(
            enable_prog_thread=opts.progress == "thread",
            enable_listen_thread=False,
            backends=[],
            sync_mode=api.nixl_thread_sync_t[_SYNC[opts.sync_mode]],
        )
        try:
            agent = api.nixl_agent(agent_name, conf)
        except Exception as exc:
            raise TransferError(
                f"NIXL agent {agent_name!r} could not be created ({ENGINE.distribution} "
                f"{ENGINE.version}): {_describe(exc)}"
            ) from exc
        available = list(agent.get_plugin_list())
        for b in opts.backends:
            if b not in available:
                raise ConfigError(
                    f"NIXL backend plugin {b!r} is not available in {ENGINE.distribution} "
                    f"{ENGINE.version}; available: {', '.join(sorted(available)) or 'none'}"
                )
            params = opts.init_params(b)
            try:
                agent.create_backend(b, params)
            except Exception as exc:
                raise ConfigError(
                    f"NIXL could not create backend {b!r} with parameters {params}: "
                    f"{_describe(exc)}. Accepted parameters and defaults: "
                    f"{agent.get_plugin_params(b)}"
                ) from exc
        self._agent = agent
        _live.add(self)
        logger.debug(
            "%s: NIXL agent created (%s %s, backends %s, progress %s, sync %s)",
            agent_name,
            ENGINE.distribution,
            ENGINE.version,
            opts.backends,
            opts.progress,
            opts.sync_mode,
        )

    # ----------------------------------------------------------------- engine glue
    def _require_agent(self) -> Any:
        """The NIXL agent (any thread; the caller keeps a reference while it uses it)."""
        if self._generation != _fork_generation:
            raise PeerError(
                f"nixl agent {self.agent_name!r} was created in a parent process: NIXL is not "
                "fork-safe, create the backend in the child (use the spawn start method)"
            )
        agent = self._agent
        if agent is None:
            raise PeerError(f"backend 'nixl' agent {self.agent_name!r} is closed")
        return agent

    @staticmethod
    def _convert(
        exc: Exception,
        what: str,
        descriptor: tuple[str, ...] = (),
        peer: str | None = None,
        op: XferOp | None = None,
    ) -> KVWireError:
        """The kvwire error for ``exc`` raised by NIXL call ``what``.

        NIXL errors named in ``descriptor`` become :class:`DescriptorError`; a remote
        disconnect becomes :class:`PeerError`; anything else :class:`TransferError`.
        """
        msg = f"NIXL {what} failed: {_describe(exc)}"
        if descriptor and _is_nixl_error(exc, *descriptor):
            return DescriptorError(msg)
        operation = None if op is None else op.value
        if _is_nixl_error(exc, "nixlRemoteDisconnectError"):
            return PeerError(msg, peer=peer, operation=operation)
        return TransferError(msg, peer=peer, operation=operation)

    @contextmanager
    def _nixl(
        self,
        what: str,
        *,
        descriptor: tuple[str, ...] = (),
        peer: str | None = None,
        op: XferOp | None = None,
    ) -> Iterator[None]:
        """One NIXL call: takes the engine lock (sync_mode="none" only) and converts
        exceptions raised inside into kvwire errors (see :meth:`_convert`)."""
        try:
            with self._serial:
                yield
        except KVWireError:
            raise
        except Exception as exc:
            raise self._convert(exc, what, descriptor, peer, op) from exc

    def _free(self, x: _Xfer) -> None:
        """Release the NIXL handle of ``x`` once; defer it if NIXL refuses.

        Call with ``x.lock`` held (or before ``x`` is published): nobody else can be using
        the handle then.
        """
        h, x.nixl = x.nixl, None
        with self._state:
            x.peer.xfers.discard(x)
        if h is None:
            return
        try:
            with self._serial:
                h.release()
        except Exception as exc:  # still active and not cancellable: retry later
            logger.debug("%s: deferring release of a NIXL handle: %s", self.agent_name, exc)
            with self._state:
                self._deferred.append(h)

    def _retry_deferred(self) -> None:
        with self._state:
            pending, self._deferred = self._deferred, []
        keep = []
        for h in pending:
            try:
                with self._serial:
                    h.release()
            except Exception:
                keep.append(h)
        if keep:
            with self._state:
                self._deferred.extend(keep)

    def _drain_notifs(self, agent: Any) -> None:
        try:
            with self._serial:
                got = agent.get_new_notifs()
        except Exception as exc:
            logger.warning("%s: NIXL get_new_notifs failed: %s", self.agent_name, _describe(exc))
            return
        foreign = 0
        for peer, msgs in got.items():
            name = peer.decode() if isinstance(peer, bytes) else str(peer)
            for m in msgs:
                payload = bytes(m)
                if payload[:1] == NOTIF_TAG:
                    self._notes.append(Notification(name, payload[1:]))
                else:
                    foreign += 1
                    logger.debug(
                        "%s: dropped a non-kvwire notification from %s", self.agent_name, name
                    )
        if foreign:
            with self._state:
                self.foreign_notifications += foreign

    # ---------------------------------------------------------------------- memory
    def _register(self, regions: list[MemoryRegion]) -> None:
        agent = self._require_agent()
        done: list[tuple[MemoryRegion, Any]] = []
        for r in regions:
            row = np.array([[r.addr, r.length, r.device_id]], dtype=np.uint64)
            try:
                with self._nixl(f"register_memory of {r.kind.name} {r.addr:#x} (+{r.length} B)"):
                    descs = agent.register_memory(row, _MEM[r.kind])
            except KVWireError:
                for _, d in done:
                    try:
                        with self._serial:
                            agent.deregister_memory(d)
                    except Exception as exc:
                        logger.warning("%s: rollback deregister failed: %s", self.agent_name, exc)
                raise
            done.append((r, descs))
        self._reg.update(done)

    def _deregister(self, regions: list[MemoryRegion]) -> None:
        agent = self._agent  # after close() there is nothing left to deregister
        for r in regions:
            descs = self._reg.pop(r, None)
            if descs is None or agent is None or self._generation != _fork_generation:
                continue
            try:
                with self._serial:
                    agent.deregister_memory(descs)
            except Exception as exc:  # the region is forgotten either way
                logger.warning(
                    "%s: NIXL deregister_memory of %#x failed: %s",
                    self.agent_name,
                    r.addr,
                    _describe(exc),
                )

    # ----------------------------------------------------------------------- peers
    def local_metadata(self) -> bytes:
        """This agent's NIXL metadata and registered regions, msgpack-encoded. Control path:
        takes the control lock (consistent with ``register``)."""
        with self._lock:
            agent = self._require_agent()
            with self._nixl("get_agent_metadata"):
                md = bytes(agent.get_agent_metadata())
            regions = region_rows(self._reg)
        return pack_metadata(
            self.name,
            METADATA_VERSION,
            name=self.agent_name,
            nixl=f"{ENGINE.distribution} {ENGINE.version}",
            regions=regions,
            md=md,
        )

    def _decode_metadata(self, metadata: bytes) -> dict[str, Any]:
        meta = unpack_metadata(metadata, self.name, METADATA_VERSION, "kvwire-nixl")
        name, md = meta.get("name"), meta.get("md")
        if not isinstance(name, str) or not name:
            raise ValueError(f"nixl metadata names no agent (name {name!r})")
        if not isinstance(md, bytes) or not md:
            raise ValueError("nixl metadata carries no NIXL agent metadata")
        return meta

    def _peer_name(self, metadata: bytes) -> str:
        return str(self._decode_metadata(metadata)["name"])

    def peers(self) -> list[str]:
        with self._state:
            return list(self._peers)

    def _add_peer(self, name: str, metadata: bytes) -> None:
        meta = self._decode_metadata(metadata)
        regions = regions_from_rows(meta.get("regions"), "nixl", name)
        agent = self._require_agent()
        with self._nixl(f"add_remote_agent({name!r})", peer=name):
            loaded = agent.add_remote_agent(meta["md"])
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            try:
                with self._serial:
                    agent.remove_remote_agent(loaded)
            except Exception as exc:
                logger.warning("%s: could not unload %r: %s", self.agent_name, loaded, exc)
            raise PeerError(
                f"nixl metadata names agent {name!r} but its NIXL metadata is agent {loaded!r}",
                peer=name,
            )
        with self._state:
            self._peers[name] = _Peer(name, regions)

    def _retire(self, peers: list[_Peer], why: str) -> None:
        """Refuse new submits to ``peers``, wait for those in progress, then fail and free
        every pending transfer (each under its own lock, after any poll of it returned)."""
        with self._state:
            for p in peers:
                p.removed = True
            while any(p.busy for p in peers):
                self._quiet.wait()
            pending = [x for p in peers for x in p.xfers]
        for x in pending:
            with x.lock:
                x.finish(XferState.FAILED, why)
                self._free(x)

    def _remove_peer(self, peer: str) -> None:
        with self._state:
            p = self._peers.pop(peer, None)
        if p is None:
            return
        self._retire([p], f"peer {peer!r} was removed")
        agent = self._agent
        if agent is None:
            return
        try:
            with self._serial:
                agent.remove_remote_agent(peer)
        except Exception as exc:
            logger.warning(
                "%s: NIXL remove_remote_agent(%r) failed: %s", self.agent_name, peer, _describe(exc)
            )

    def _peer_regions(self, peer: str) -> list[MemoryRegion] | None:
        with self._state:
            p = self._peers.get(peer)
        return None if p is None else p.regions

    # --------------------------------------------------------------------- prepare
    @staticmethod
    def _table_mem(table: DescTable, regions: Sequence[MemoryRegion], what: str) -> str:
        """NIXL memory type of a table's rows: all DRAM or all VRAM."""
        order = sorted(regions, key=lambda r: r.addr)
        starts = np.array([r.addr for r in order], dtype=np.uint64)
        ends = np.array([r.end for r in order], dtype=np.uint64)
        pos = locate_rows(starts, ends, table[:, ADDR], table[:, LEN])
        if (pos < 0).any():
            i = int(np.argmax(pos < 0))
            raise DescriptorError(
                f"{what}: row {i} (addr {int(table[i, ADDR]):#x}) is not in a registered region"
            )
        vram = np.array([r.kind is MemKind.VRAM for r in order], dtype=bool)[pos]
        if vram.all():
            return "VRAM"
        if not vram.any():
            return "DRAM"
        raise DescriptorError(
            f"{what} mixes DRAM and VRAM rows ({int(vram.sum())} of {vram.size} in VRAM); NIXL "
            "prepares one memory type per descriptor list: build one table per memory kind"
        )

    def _prepare(self, pair: PreparedPair, local: DescTable, remote: DescTable) -> Any:
        agent = self._require_agent()
        with self._state:
            p = self._peers.get(pair.peer)
        if p is None:
            raise PeerError(f"peer {pair.peer!r} is not known", peer=pair.peer)
        local_mem = self._table_mem(local, self._regions, "local table")
        remote_mem = self._table_mem(remote, p.regions, f"remote table for {pair.peer!r}")
        bad = ("nixlNotFoundError", "nixlInvalidParamError", "nixlMismatchError")
        with self._nixl(
            f"prep_xfer_dlist of the local table ({local.shape[0]} {local_mem} rows)",
            descriptor=bad,
        ):
            lh = agent.prep_xfer_dlist("", np.ascontiguousarray(local), local_mem)
        try:
            with self._nixl(
                f"prep_xfer_dlist of the remote table for {pair.peer!r} "
                f"({remote.shape[0]} {remote_mem} rows)",
                descriptor=bad,
                peer=pair.peer,
            ):
                rh = agent.prep_xfer_dlist(pair.peer, np.ascontiguousarray(remote), remote_mem)
        except KVWireError:
            with self._serial:
                lh.release()
            raise
        return _Prepared(p, lh, rh, local_mem, remote_mem)

    def _release_prepared(self, pair: PreparedPair) -> None:
        st: _Prepared | None = pair.state
        if st is None:
            return
        with self._state:
            st.released = True  # no new users from here on
            while st.users:  # submits inside make_prepped_xfer with these lists
                self._quiet.wait()
            handles = (st.local, st.remote)
            st.local = st.remote = None
        if self._agent is None or self._generation != _fork_generation:
            return  # the agent (and its lists) is gone
        for h in handles:
            if h is None:
                continue
            try:
                with self._serial:
                    h.release()
            except Exception as exc:
                logger.warning(
                    "%s: NIXL release of a prepared list for %r failed: %s",
                    self.agent_name,
                    pair.peer,
                    _describe(exc),
                )

    # -------------------------------------------------------------------- transfer
    def _submit(
        self,
        op: XferOp,
        pair: PreparedPair,
        local_idx: np.ndarray,
        remote_idx: np.ndarray,
        notification: bytes | None,
        handle: TransferHandle,
    ) -> Any:
        st: _Prepared = pair.state
        p = st.peer
        msg = b"" if notification is None else NOTIF_TAG + bytes(notification)
        timeout = self.options.transfer_timeout_s
        agent = self._require_agent()
        with self._state:
            if self._closing:
                raise PeerError(f"backend 'nixl' agent {self.agent_name!r} is closed")
            if st.released:
                raise HandleError(f"prepared pair {pair.id} for {pair.peer!r} was released")
            if p.removed or self._peers.get(pair.peer) is not p:
                raise PeerError(
                    f"peer {pair.peer!r} was removed; prepare again after add_peer()",
                    peer=pair.peer,
                    operation=op.value,
                )
            st.users += 1
            p.busy += 1
        try:
            x = self._post(agent, op, pair, st, local_idx, remote_idx, msg, timeout)
        finally:
            with self._state:
                p.busy -= 1
                if not p.busy:  # _retire may be waiting (cheap when nobody waits)
                    self._quiet.notify_all()
        return x

    def _post(
        self,
        agent: Any,
        op: XferOp,
        pair: PreparedPair,
        st: _Prepared,
        local_idx: np.ndarray,
        remote_idx: np.ndarray,
        msg: bytes,
        timeout: float | None,
    ) -> _Xfer:
        """make_prepped_xfer + transfer with no lock but the new transfer's own (the pair's
        user count and the peer's busy count keep lists and peer alive meanwhile)."""
        try:
            # Hot path: plain try/except, messages built only on failure.
            with self._serial:
                h = agent.make_prepped_xfer(
                    _OPS[op], st.local, local_idx, st.remote, remote_idx, msg
                )
        except Exception as exc:
            raise self._convert(
                exc,
                f"make_prepped_xfer ({op.name}, {local_idx.size} rows, peer {pair.peer!r})",
                ("nixlInvalidParamError", "nixlMismatchError"),
                pair.peer,
                op,
            ) from exc
        finally:
            with self._state:
                st.users -= 1
                if not st.users and st.released:
                    self._quiet.notify_all()
        p = st.peer
        x = _Xfer(p, h, None if timeout is None else time.monotonic() + timeout)
        with x.lock:
            with self._state:
                gone = p.removed or self._closing
                if not gone:
                    p.xfers.add(x)
            if gone:  # removed (or closed) while the request was built: never posted
                x.finish(XferState.FAILED, f"peer {pair.peer!r} was removed or agent closed")
                self._free(x)
                return x
            try:
                with self._serial:
                    status = agent.transfer(h)
            except Exception as exc:
                self._free(x)
                raise self._convert(
                    exc, f"transfer ({op.name} to {pair.peer!r})", (), pair.peer, op
                ) from exc
            if status == "DONE":
                x.finish(XferState.DONE)
                self._free(x)
            elif status == "ERR":
                x.finish(XferState.FAILED, f"NIXL transfer() returned ERR posting to {pair.peer!r}")
                self._free(x)
        return x

    def _poll(self, handle: TransferHandle) -> XferState:
        x: _Xfer = handle.state
        if x.state is XferState.PENDING:
            with x.lock:
                self._check(x)
        if x.state is XferState.FAILED and handle.error is None:
            handle.error = x.error
        return x.state

    def _check(self, x: _Xfer) -> None:
        """Update a pending transfer from NIXL (``x.lock`` held)."""
        if x.state is not XferState.PENDING or x.nixl is None:
            return
        agent = self._agent
        if agent is None:
            x.finish(XferState.FAILED, f"agent {self.agent_name!r} was closed")
            return
        try:
            with self._serial:
                status = agent.check_xfer_state(x.nixl)
        except Exception as exc:
            x.finish(XferState.FAILED, f"NIXL check_xfer_state raised {_describe(exc)}")
            self._free(x)
            return
        if status == "DONE":
            x.finish(XferState.DONE)
            self._free(x)
        elif status == "ERR":
            x.finish(XferState.FAILED, f"NIXL reported the transfer to {x.peer.name!r} as ERR")
            self._free(x)
        elif x.deadline is not None and time.monotonic() > x.deadline:
            x.finish(
                XferState.FAILED,
                f"transfer to {x.peer.name!r} timed out after "
                f"{self.options.transfer_timeout_s:g}s (transfer_timeout_s)",
            )

    def _release(self, handle: TransferHandle) -> None:
        x: _Xfer = handle.state
        with x.lock:
            if x.nixl is not None:
                x.finish(XferState.FAILED, "released while pending")
                self._free(x)

    # --------------------------------------------------------------- notifications
    def progress(self) -> None:
        """Drive NIXL (UCX) progress and buffer notifications; call from the owner loop.
        Takes no kvwire lock across NIXL calls (owner loop: concurrent with workers)."""
        agent = self._agent
        if agent is None or self._generation != _fork_generation:
            return
        self._drain_notifs(agent)
        if self._deferred:
            self._retry_deferred()

    def get_notifications(self) -> list[Notification]:
        agent = self._agent
        if agent is not None and self._generation == _fork_generation:
            self._drain_notifs(agent)
        out = []
        while True:
            try:
                out.append(self._notes.popleft())
            except IndexError:
                return out

    # ----------------------------------------------------------------------- close
    def _close(self) -> None:
        agent = self._agent
        if agent is None:
            return
        _live.discard(self)
        if self._generation != _fork_generation:
            # A forked child must not tear down its parent's agent: leave it alone.
            self._agent = None
            return
        with self._state:
            self._closing = True
            peers = list(self._peers.values())
        self._retire(peers, f"agent {self.agent_name!r} was closed")
        for pair in list(self._pairs.values()):
            self._release_prepared(pair)
        for p in peers:
            try:
                with self._serial:
                    agent.remove_remote_agent(p.name)
            except Exception as exc:
                logger.debug("%s: remove_remote_agent(%r): %s", self.agent_name, p.name, exc)
        for descs in self._reg.values():
            try:
                with self._serial:
                    agent.deregister_memory(descs)
            except Exception as exc:
                logger.debug("%s: deregister at close: %s", self.agent_name, exc)
        self._retry_deferred()
        with self._state:
            self._deferred.clear()
            self._peers.clear()
        self._reg.clear()
        self._agent = None
        # The last reference, unless a thread is still inside a NIXL call (progress, a
        # poll): NIXL destroys the agent when that call returns and drops its reference.
        del agent
        logger.debug("%s: NIXL agent closed", self.agent_name)
