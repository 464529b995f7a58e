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

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from pydantic import BaseModel

from kvwire.backend import (
    BackendCapabilities,
    Notification,
    PreparedPair,
    TransferBackend,
    TransferHandle,
    XferOp,
    XferState,
)
from kvwire.descriptors import DescTable
from kvwire.errors import HandleError, KVWireError, PeerError
from kvwire.layout import MemoryRegion
from kvwire_nixl.agent import (
    ENGINE,
    MEM_TYPES,
    convert_error,
    create_agent,
    describe,
    fork_generation,
    table_mem,
    track,
    untrack,
)
from kvwire_nixl.inbox import NOTIF_TAG, Inbox
from kvwire_nixl.metadata import pack_agent_metadata, peer_regions, unpack_peer_metadata
from kvwire_nixl.options import RW_UCX_ENV_DEFAULTS, NixlOptions, apply_env
from kvwire_nixl.records import PairRecord, PeerRecord, XferRecord

logger = logging.getLogger(__name__)

#: Prefix of every notification kvwire sends through NIXL.
_OPS = {XferOp.WRITE: "WRITE", XferOp.READ: "READ"}


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
        self._generation = fork_generation()
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
        self._peers: dict[str, PeerRecord] = {}
        self._reg: dict[MemoryRegion, Any] = {}
        self._inbox = Inbox(agent_name, self._state)
        self._deferred: list[Any] = []  # NIXL xfer handles whose release failed; retried
        #: Environment variables this agent set from ``ucx_env``.
        self.applied_env = apply_env(opts.ucx_env)
        #: Environment variables this agent set from :data:`RW_UCX_ENV_DEFAULTS`.
        self.applied_defaults = apply_env(RW_UCX_ENV_DEFAULTS) if opts.sync_mode == "rw" else {}
        self._agent = create_agent(agent_name, opts)
        track(self)
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
        if self._generation != fork_generation():
            raise PeerError(
                f"nixl agent {self.agent_name!r} was created in a parent process: NIXL is not "
                "fork-safe, create the backend in the child (use the spawn start method)"
            )
        agent = self._agent
        if agent is None:
            raise PeerError(f"backend 'nixl' agent {self.agent_name!r} is closed")
        return agent

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
        exceptions raised inside into kvwire errors (see
        :func:`~kvwire_nixl.agent.convert_error`)."""
        try:
            with self._serial:
                yield
        except KVWireError:
            raise
        except Exception as exc:
            raise convert_error(exc, what, descriptor, peer, op) from exc

    def _free(self, x: XferRecord) -> None:
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

    # ---------------------------------------------------------------------- memory
    def _register(self, regions: list[MemoryRegion]) -> None:
        agent = self._require_agent()
        done: list[tuple[MemoryRegion, Any]] = []
        for r in regions:
            row = np.array([[r.addr, r.length, r.device_id]], dtype=np.uint64)
            try:
                with self._nixl(f"register_memory of {r.kind.name} {r.addr:#x} (+{r.length} B)"):
                    descs = agent.register_memory(row, MEM_TYPES[r.kind])
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
            if descs is None or agent is None or self._generation != fork_generation():
                continue
            try:
                with self._serial:
                    agent.deregister_memory(descs)
            except Exception as exc:  # the region is forgotten either way
                logger.warning(
                    "%s: NIXL deregister_memory of %#x failed: %s",
                    self.agent_name,
                    r.addr,
                    describe(exc),
                )

    # ----------------------------------------------------------------------- peers
    def local_metadata(self) -> bytes:
        """This agent's NIXL metadata and registered regions, msgpack-encoded. Control path:
        takes the control lock (consistent with ``register``)."""
        with self._lock:
            agent = self._require_agent()
            with self._nixl("get_agent_metadata"):
                md = bytes(agent.get_agent_metadata())
            return pack_agent_metadata(
                self.agent_name, f"{ENGINE.distribution} {ENGINE.version}", self._reg, md
            )

    def _peer_name(self, metadata: bytes) -> str:
        return str(unpack_peer_metadata(metadata)["name"])

    def peers(self) -> list[str]:
        with self._state:
            return list(self._peers)

    def _add_peer(self, name: str, metadata: bytes) -> None:
        meta = unpack_peer_metadata(metadata)
        regions = peer_regions(meta, name)
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
            self._peers[name] = PeerRecord(name, regions)

    def _retire(self, peers: list[PeerRecord], why: str) -> None:
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
                "%s: NIXL remove_remote_agent(%r) failed: %s", self.agent_name, peer, describe(exc)
            )

    def _peer_regions(self, peer: str) -> list[MemoryRegion] | None:
        with self._state:
            p = self._peers.get(peer)
        return None if p is None else p.regions

    # --------------------------------------------------------------------- prepare
    def _prepare(self, pair: PreparedPair, local: DescTable, remote: DescTable) -> Any:
        agent = self._require_agent()
        with self._state:
            p = self._peers.get(pair.peer)
        if p is None:
            raise PeerError(f"peer {pair.peer!r} is not known", peer=pair.peer)
        local_mem = table_mem(local, self._regions, "local table")
        remote_mem = table_mem(remote, p.regions, f"remote table for {pair.peer!r}")
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
        return PairRecord(p, lh, rh, local_mem, remote_mem)

    def _release_prepared(self, pair: PreparedPair) -> None:
        st: PairRecord | None = pair.state
        if st is None:
            return
        with self._state:
            st.released = True  # no new users from here on
            while st.users:  # submits inside make_prepped_xfer with these lists
                self._quiet.wait()
            handles = (st.local, st.remote)
            st.local = st.remote = None
        if self._agent is None or self._generation != fork_generation():
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
                    describe(exc),
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
        st: PairRecord = pair.state
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
        st: PairRecord,
        local_idx: np.ndarray,
        remote_idx: np.ndarray,
        msg: bytes,
        timeout: float | None,
    ) -> XferRecord:
        """make_prepped_xfer + transfer with no lock but the new transfer's own (the pair's
        user count and the peer's busy count keep lists and peer alive meanwhile)."""
        try:
            # Hot path: plain try/except, messages built only on failure.
            with self._serial:
                h = agent.make_prepped_xfer(
                    _OPS[op], st.local, local_idx, st.remote, remote_idx, msg
                )
        except Exception as exc:
            raise convert_error(
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
        x = XferRecord(p, h, None if timeout is None else time.monotonic() + timeout)
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
                raise convert_error(
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
        x: XferRecord = handle.state
        if x.state is XferState.PENDING:
            with x.lock:
                self._check(x)
        if x.state is XferState.FAILED and handle.error is None:
            handle.error = x.error
        return x.state

    def _check(self, x: XferRecord) -> None:
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
            x.finish(XferState.FAILED, f"NIXL check_xfer_state raised {describe(exc)}")
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
        x: XferRecord = handle.state
        with x.lock:
            if x.nixl is not None:
                x.finish(XferState.FAILED, "released while pending")
                self._free(x)

    # --------------------------------------------------------------- notifications
    def progress(self) -> None:
        """Drive NIXL (UCX) progress and buffer notifications; call from the owner loop.
        Takes no kvwire lock across NIXL calls (owner loop: concurrent with workers)."""
        agent = self._agent
        if agent is None or self._generation != fork_generation():
            return
        self._inbox.drain(agent, self._serial)
        self._inbox.just_drained = True
        if self._deferred:
            self._retry_deferred()

    def get_notifications(self) -> list[Notification]:
        """Notifications buffered so far. Right after :meth:`progress` (the owner loop's
        turn calls both) the buffer is what NIXL had a moment ago, so NIXL is not asked
        again: one ``get_new_notifs`` per turn (a notification that came in between is
        drained on the next turn or call, never lost)."""
        agent, inbox = self._agent, self._inbox
        if inbox.just_drained:
            inbox.just_drained = False
        elif agent is not None and self._generation == fork_generation():
            inbox.drain(agent, self._serial)
        return inbox.take()

    @property
    def foreign_notifications(self) -> int:
        """Notifications dropped because they did not come from kvwire (no tag)."""
        return self._inbox.foreign

    # ----------------------------------------------------------------------- close
    def _close(self) -> None:
        agent = self._agent
        if agent is None:
            return
        untrack(self)
        if self._generation != fork_generation():
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
