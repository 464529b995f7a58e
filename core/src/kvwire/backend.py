"""The :class:`TransferBackend` seam: what a transfer engine must do for kvwire.

A backend knows bytes and addresses, never layers, heads or requests. kvwire's control plane
calls it from both roles:

* at startup, each rank registers its regions (:meth:`TransferBackend.register`) and publishes
  :meth:`TransferBackend.local_metadata` through the handshake;
* the initiating side (prefill for WRITE, decode for READ) adds the peer from its metadata
  (:meth:`TransferBackend.add_peer`) and prepares one pair of descriptor tables per peer
  (:meth:`TransferBackend.prepare`);
* a transfer worker submits each chunk as two index arrays into that pair
  (:meth:`TransferBackend.submit`), polls the handle until it is terminal and releases it;
* the target side drains :meth:`TransferBackend.get_notifications` to learn that data landed.

Public methods here are templates: they validate arguments (vectorised), enforce handle
lifetimes and then call the ``_``-prefixed hooks a plugin implements. A plugin never has to
re-check what the template checked.

Threads and locks (the contract every method's docstring repeats for its own case):

* **Data path** -- :meth:`~TransferBackend.submit`, :meth:`~TransferBackend.poll` and
  :meth:`~TransferBackend.release` are called by several transfer worker threads at once (each
  with its own handles, often on the same prepared pair). The template holds **no lock** while
  it calls ``_submit``, ``_poll`` or ``_release``; it only takes a short internal lock for its
  own handle table, never across a hook.
* **Control path** -- ``register``, ``deregister``, ``add_peer``, ``remove_peer``,
  ``prepare``, ``release_prepared``, ``local_metadata`` (where a plugin takes it) and ``close``
  run under the template's control lock (:attr:`TransferBackend._lock`, re-entrant): their
  hooks never run concurrently with one another, but they do run concurrently with the data
  path and with the owner loop.
* **Owner loop** -- :meth:`~TransferBackend.progress` and
  :meth:`~TransferBackend.get_notifications` are called by the session manager's control
  thread (one thread at a time), concurrently with everything above; the template takes no
  lock.

So a plugin must make its engine calls safe to run concurrently: data-path hooks with each
other (different handles), with the owner loop and with control-path hooks. In particular
``_remove_peer``, ``_release_prepared`` and ``_close`` may run while another thread is inside
``_submit``/``_poll``/``_release`` on a handle or pair they invalidate: the plugin must then
fail those transfers (FAILED, or ``PeerError``/``HandleError`` from ``_submit``) and free each
engine object exactly once, never while another thread still uses it. A plugin guards its
own state with locks of its own, never held across an engine call that can block or copy (or
workers, handshakes and the owner loop wait for one another); an engine that is not
thread-safe must be serialised by the plugin itself, with a lock of its own.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from abc import abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Self

import numpy as np
from pydantic import BaseModel, ConfigDict

from kvwire.backend_links import Kinds as Kinds
from kvwire.backend_links import LinkRules
from kvwire.descriptors import DescTable, check_table, require_inside
from kvwire.errors import CapabilityError, HandleError, KVWireError, PeerError
from kvwire.layout import MemoryRegion, check_no_overlap
from kvwire.link_choice import LinkChoice as LinkChoice  # re-exported: the backend seam
from kvwire.link_choice import PeerFacts as PeerFacts
from kvwire.page_form import PageChunk, check_page_chunk
from kvwire.page_lane import PageLane
from kvwire.plugin_api import PLUGIN_API

# Re-exported: a plugin declares and implements its hooks with these, and kvwire.backend is
# the plugin seam's public import path (docs/writing-a-backend-plugin.md); they live in
# kvwire.transfers.
from kvwire.transfers import BackendCapabilities as BackendCapabilities
from kvwire.transfers import LaterNote as LaterNote
from kvwire.transfers import Note as Note
from kvwire.transfers import Notification as Notification
from kvwire.transfers import PreparedPair as PreparedPair
from kvwire.transfers import TransferHandle as TransferHandle
from kvwire.transfers import XferOp as XferOp
from kvwire.transfers import XferState as XferState
from kvwire.transfers import check_rows, check_submit, note_bytes, start_sums

logger = logging.getLogger(__name__)


class NoOptions(BaseModel):
    """Options model of an implementation that takes none."""

    model_config = ConfigDict(extra="forbid")


class TransferBackend(LinkRules):
    """Abstract transfer engine. One instance per rank ("agent"), named ``agent_name``.

    Subclasses set :attr:`name`, :attr:`capabilities` and :attr:`options_model` and implement the
    ``_``-prefixed hooks. All public methods may be called from any thread. The lock contract
    (data path, control path under :attr:`_lock`, owner loop) is the module docstring's; each
    method's docstring repeats its own case. The template's handle table has a second,
    private lock, never held across a hook.
    """

    name: ClassVar[str] = "abstract"
    #: The version of this contract (hooks, lock contract) this kvwire defines; a plugin
    #: declares the one it was written for in its hook module (see :mod:`kvwire.plugin_api`).
    CONTRACT_VERSION: ClassVar[str] = PLUGIN_API
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities()
    options_model: ClassVar[type[BaseModel]] = NoOptions
    #: True when the backend itself says when something happened: it calls a handle's
    #: ``wake`` once the transfer is terminal and the notification waker (see
    #: :meth:`set_notification_waker`) after queueing a notification. Its owners then sleep
    #: until woken (with a long timeout) instead of polling on a short timer. False (the
    #: default): the backend must be polled (e.g. NIXL, whose polls drive UCX progress).
    pushes_events: ClassVar[bool] = False
    #: Transfer workers a prefill rank runs over this backend when the operator did not say
    #: (``ControlOptions.num_workers`` None); None: :data:`kvwire.session.context.DEFAULT_WORKERS`.
    #: One that only enqueues device work gains nothing from more (they take GIL turns).
    suggested_workers: ClassVar[int | None] = None
    #: Its lean lane for page writes, where it offers one (:mod:`kvwire.page_lane`).
    page_lane: PageLane | None = None

    def __init__(self, agent_name: str, options: BaseModel | None = None) -> None:
        if not agent_name:
            raise ValueError("agent_name must be a non-empty string")
        self.agent_name = agent_name
        self.options = options if options is not None else self.options_model()
        #: The control lock (re-entrant): held across every control-path hook, never across
        #: ``_submit``/``_poll``/``_release`` or the owner loop. Guards ``_regions``/``_pairs``.
        self._lock = threading.RLock()
        #: Guards ``_handles`` only; never held across a hook.
        self._handles_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._regions: list[MemoryRegion] = []
        self._pairs: dict[int, PreparedPair] = {}
        self._handles: dict[int, TransferHandle] = {}
        self._closed = False
        self._notification_waker: Callable[[], None] | None = None

    # ---------------------------------------------------------------- memory
    @property
    def registered_regions(self) -> list[MemoryRegion]:
        """Regions currently registered, in registration order. Any thread; takes the
        control lock (so it waits for a register/deregister in progress)."""
        with self._lock:
            return list(self._regions)

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """Register memory so it can be a transfer source or target. Called at startup by
        each rank, and by staging strategies (through ``register_fn``) for memory they own.

        Threads: any thread; control path. ``_register`` runs under the control lock
        (serialised with the other control-path hooks), concurrently with transfers on memory
        registered earlier and with the owner loop.
        """
        self._check_open()
        regions = list(regions)
        for r in regions:
            if not self.capabilities.supports_kind(r.kind):
                raise CapabilityError(
                    f"backend {self.name!r} cannot register {r.kind.name} memory "
                    f"(region at {r.addr:#x}); choose a backend that supports {r.kind.name}"
                )
        with self._lock:
            self._check_open()
            check_no_overlap(self._regions + regions, "registered regions")
            self._register(regions)
            self._regions.extend(regions)

    def deregister(self, regions: Sequence[MemoryRegion]) -> None:
        """Forget regions registered earlier. Called at shutdown or when a strategy frees memory.

        Threads: any thread; control path. ``_deregister`` runs under the control lock. The
        caller guarantees no transfer in flight touches these regions (the plugin need not
        wait for any).
        """
        with self._lock:
            for r in regions:
                if r not in self._regions:
                    raise ValueError(f"region at {r.addr:#x} (+{r.length}) is not registered")
            self._deregister(list(regions))
            for r in regions:
                self._regions.remove(r)

    # ----------------------------------------------------------------- peers
    @abstractmethod
    def local_metadata(self) -> bytes:
        """Opaque bytes a peer passes to :meth:`add_peer`; published at handshake. Must be
        called after every :meth:`register` whose regions peers should be able to reach.

        Threads: any thread (handshake threads), concurrently with the data path and the
        owner loop; no template lock is held. A plugin that reads state ``register`` changes
        may take the control lock :attr:`_lock` here (control path).
        """

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer from its :meth:`local_metadata`; return its name. Called by the
        initiating side at handshake. Adding a peer again (e.g. after it restarted) replaces it
        and invalidates everything prepared for the old incarnation.

        Threads: any thread (handshake threads); control path. ``_peer_name`` runs without a
        lock; ``_add_peer`` (and, on a re-add, ``_release_prepared``/``_remove_peer`` of the
        old incarnation) under the control lock, concurrently with transfers to *other* peers
        and with the owner loop.
        """
        self._check_open()
        try:
            name = self._peer_name(metadata)
            with self._lock:
                self._check_open()
                if name in self.peers():
                    self._drop_peer_state(name)
                self._add_peer(name, metadata)
        except KVWireError:
            raise
        except Exception as exc:  # a plugin's metadata checks raise what they like
            raise PeerError(f"{self.name} backend refused the peer's metadata: {exc}") from exc
        return name

    def remove_peer(self, peer: str) -> None:
        """Forget a peer (evicted, or gone). Its prepared pairs become invalid and its
        transfers still pending end as FAILED. Called by the control plane.

        Threads: any thread; control path. Under the control lock the template releases the
        peer's pairs (``_release_prepared``) and then calls ``_remove_peer``, possibly while
        worker threads are inside ``_submit``/``_poll``/``_release`` for this very peer: the
        plugin must fail those transfers and free their engine handles exactly once.
        """
        with self._lock:
            if peer not in self.peers():
                raise PeerError(f"peer {peer!r} is not known to agent {self.agent_name!r}")
            self._drop_peer_state(peer)

    def _drop_peer_state(self, peer: str) -> None:
        """Release the pairs of ``peer`` and remove it from the engine (control lock held)."""
        for pair in [p for p in self._pairs.values() if p.peer == peer]:
            self._release_pair_locked(pair)
        self._remove_peer(peer)

    @abstractmethod
    def peers(self) -> list[str]:
        """Names of the peers currently added.

        Threads: any thread, concurrently with everything else; the template calls it with
        the control lock held (from ``add_peer``, ``remove_peer``, ``prepare``). A plugin
        answers from its own state, under its own lock if it needs one, never blocking.
        """

    # -------------------------------------------------------------- prepared
    def prepare(self, peer: str, local_table: DescTable, remote_table: DescTable) -> PreparedPair:
        """Prepare a local and a remote descriptor table for ``peer``, once per peer.

        Rows of ``local_table`` must lie in this agent's registered regions; rows of
        ``remote_table`` are checked against the peer's published regions where the backend
        knows them (and always again by the target, where the engine allows it).

        Threads: any thread (handshake threads); control path. Tables are validated without
        a lock; ``_peer_regions`` and ``_prepare`` run under the control lock, concurrently
        with transfers on other pairs (including other pairs of the same peer) and with the
        owner loop.
        """
        self._check_open()
        check_table(local_table, "local table")
        check_table(remote_table, "remote table")
        with self._lock:
            self._check_open()
            if peer not in self.peers():
                raise PeerError(f"cannot prepare for unknown peer {peer!r}; add_peer() it first")
            require_inside(
                local_table,
                self._regions,
                f"local table of agent {self.agent_name!r} (register the memory first)",
            )
            remote_regions = self._peer_regions(peer)
            if remote_regions is not None:
                require_inside(remote_table, remote_regions, f"remote table for peer {peer!r}")
            pair = PreparedPair.of_tables(next(self._ids), peer, local_table, remote_table)
            pair.state = self._prepare(pair, local_table, remote_table)
            self._pairs[pair.id] = pair
            return pair

    def release_prepared(self, pair: PreparedPair) -> None:
        """Release a prepared pair (peer evicted, or tables rebuilt). Exactly once.

        Threads: any thread; control path. ``_release_prepared`` runs under the control lock,
        possibly while worker threads are inside ``_submit`` with this pair (they checked
        ``pair.released`` just before it was set): the plugin must not free engine tables a
        concurrent ``_submit`` still uses; such a submit may fail with ``HandleError``.
        """
        with self._lock:
            if pair.released:
                raise HandleError(f"prepared pair {pair.id} for {pair.peer!r} already released")
            self._release_pair_locked(pair)

    def _release_pair_locked(self, pair: PreparedPair) -> None:
        pair.released = True
        self._pairs.pop(pair.id, None)
        self._release_prepared(pair)

    # -------------------------------------------------------------- transfer
    def submit(
        self,
        op: XferOp,
        pair: PreparedPair,
        local_idx: Any,
        remote_idx: Any,
        notification: Note | None = None,
        wake: Callable[[], None] | None = None,
    ) -> TransferHandle:
        """Start a transfer of rows ``local_idx`` <-> rows ``remote_idx`` of a prepared pair.

        WRITE copies local rows to remote rows, READ the other way. ``notification`` (if any) is
        delivered to the peer's :meth:`get_notifications` after all the data has landed; a
        :class:`~kvwire.transfers.LaterNote` reaches ``_submit`` as it is on a backend that
        declares :attr:`BackendCapabilities.later_notes`, and as its bytes, made now, on
        any other (:meth:`_note`). Never
        blocks on the transfer itself: poll the returned handle. ``wake`` (optional, must not
        block) is called once the transfer is terminal by a backend that
        :attr:`pushes_events` (possibly before ``submit`` returns); poll the handle after it.

        Threads: called concurrently by several worker threads, on the same or different pairs
        and peers; data path. Arguments are validated without a lock and ``_submit`` runs with
        **no template lock held**, concurrently with other ``_submit``/``_poll``/``_release``
        calls, the owner loop and control-path hooks (including ``_remove_peer`` of this peer
        and ``_release_prepared`` of this pair). The handle is entered in the handle table
        only after ``_submit`` returns.
        """
        self._check_open()
        check_submit(self.name, self.capabilities, op, pair, notification)
        li, ri, nbytes = check_rows(pair, local_idx, remote_idx)
        handle = self._handle(pair, op, int(li.size), nbytes, wake)
        handle.state = self._submit(op, pair, li, ri, self._note(notification), handle)
        return self._enter(handle)

    def submit_pages(
        self,
        op: XferOp,
        pair: PreparedPair,
        chunk: PageChunk,
        notification: Note | None = None,
        wake: Callable[[], None] | None = None,
    ) -> TransferHandle:
        """:meth:`submit` for a chunk in page form (:mod:`kvwire.page_form`: page lists and
        the geometry of ``pair``'s tables), on a backend that declares
        :attr:`BackendCapabilities.page_writes`; the same semantics (notification after the
        data, failures, handle lifetime), checks that do not grow with the chunk's rows
        (:func:`~kvwire.page_form.check_page_chunk`: pages in both pools, the geometry
        inside both tables). Threads: as :meth:`submit`; ``_submit_pages`` runs with no
        template lock held."""
        self._check_open()
        if not self.capabilities.page_writes:
            raise CapabilityError(f"backend {self.name!r} takes rows, not pages (page_writes)")
        check_submit(self.name, self.capabilities, op, pair, notification)
        nbytes = check_page_chunk(chunk, pair.local_lens, pair.remote_lens)
        handle = self._handle(pair, op, chunk.num_rows, nbytes, wake)
        handle.state = self._submit_pages(op, pair, chunk, self._note(notification), handle)
        return self._enter(handle)

    def _note(self, notification: Note | None) -> bytes | None:
        """The notification as ``_submit`` takes it: as given to a backend that declares
        :attr:`BackendCapabilities.later_notes` (whose ``_submit`` and ``_submit_pages``
        take a :class:`~kvwire.transfers.LaterNote` and make its bytes when they post it),
        else its bytes; its sums started here unless the backend has ``summed_writes``."""
        if not self.capabilities.summed_writes:
            start_sums(notification)
        if self.capabilities.later_notes:
            return notification  # type: ignore[return-value]  # taken as it is, see above
        return note_bytes(notification)

    def post_batch(self) -> AbstractContextManager[None]:
        """Prefill's transfer worker, around one turn of its loop (the jobs it took, then one
        poll of its transfers): submits this thread makes inside the block may be held back
        and posted together when it ends (``cudaipc``: one launch and one event for several
        chunks). A held transfer polls PENDING until then; its failures surface as any
        other's. The default posts every submit at once."""
        return contextlib.nullcontext()

    def _handle(
        self, pair: PreparedPair, op: XferOp, rows: int, nbytes: int, wake: Any
    ) -> TransferHandle:
        h = TransferHandle(next(self._ids), pair.peer, op, rows, nbytes, wake=wake)
        h.pushes = self.pushes_events
        return h

    def _enter(self, handle: TransferHandle) -> TransferHandle:
        with self._handles_lock:
            self._handles[handle.id] = handle
        return handle

    def poll(self, handle: TransferHandle) -> XferState:
        """State of a transfer; cheap, never blocks for long.

        Threads: data path; called by the worker that owns the handle, concurrently with
        other workers' submits and polls, the owner loop and control-path hooks. ``_poll`` runs
        with **no template lock held**; ``_remove_peer`` or ``_close`` may fail the handle
        while it runs, and a plugin must tolerate two threads polling one handle.
        """
        if handle.released:
            raise HandleError(f"transfer handle {handle.id} was already released")
        if self._closed:
            handle.error = handle.error or f"agent {self.agent_name!r} was closed"
            return XferState.FAILED
        return self._poll(handle)

    def release(self, handle: TransferHandle) -> None:
        """Release a handle exactly once, after it is terminal (or to abandon it).

        Threads: data path; any thread, concurrently with everything else. The template
        marks the handle released under its private handle-table lock (so a second release
        raises), then calls ``_release`` with **no template lock held** (not after
        :meth:`close`), possibly while ``_remove_peer``/``_close`` fail the same handle.
        """
        with self._handles_lock:
            if handle.released:
                raise HandleError(f"transfer handle {handle.id} released twice")
            handle.released = True
            self._handles.pop(handle.id, None)
        if not self._closed:
            self._release(handle)

    @property
    def live_handles(self) -> int:
        """Handles submitted and not yet released (a leak check for tests and metrics).
        Any thread; takes only the private handle-table lock."""
        with self._handles_lock:
            return len(self._handles)

    @property
    def live_prepared(self) -> int:
        """Prepared pairs not yet released. Any thread; takes the control lock."""
        with self._lock:
            return len(self._pairs)

    @abstractmethod
    def get_notifications(self) -> list[Notification]:
        """Notifications that arrived since the last call, each delivered exactly once.
        Called by the target side's owner loop.

        Threads: owner loop (the session manager's control thread; one thread at a time,
        possibly alternating with :meth:`progress`), concurrently with the data path and
        control-path hooks; no template lock is held.
        """

    def workers_wanted(self, peer: str | None = None) -> int | None:
        """The transfer workers a prefill rank should run over this backend when the operator
        did not say (:attr:`suggested_workers`); with ``peer``, for the link to that peer (a
        backend list answers for the member the link uses now). Called by the rank context
        at setup, and by prefill's engine thread for a request's first chunk to a peer."""
        return self.suggested_workers

    def set_notification_waker(self, wake: Callable[[], None] | None) -> None:
        """Owner loop's setup (the session manager, once, before peers exist): ``wake`` is
        called after a notification is queued, by a backend that :attr:`pushes_events`
        (through :meth:`_notified`); others never call it. Any thread."""
        self._notification_waker = wake

    def _notified(self) -> None:
        """A pushing backend, after queueing a notification (any thread; never blocks)."""
        wake = self._notification_waker
        if wake is not None:
            wake()

    def progress(self) -> None:
        """Drive the engine if it needs an owner loop to make progress (default: nothing).

        Threads: owner loop, like :meth:`get_notifications` (one thread at a time),
        concurrently with the data path and control-path hooks; no template lock held. It must
        not wait for workers.
        """

    def close(self) -> None:
        """Release everything; pending transfers end as FAILED. Idempotent.

        Threads: any thread; control path. ``_close`` runs once, under the control lock (so
        never concurrently with another control-path hook), but possibly while workers are
        inside ``_submit``/``_poll``/``_release`` and the owner loop is inside ``progress``/
        ``get_notifications``: those must then fail or return quietly, never touch freed
        engine state. After ``close`` the template answers ``poll`` with FAILED itself and no
        longer calls ``_release``.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with self._handles_lock:
                pending = len(self._handles)
            if pending:
                logger.info(
                    "%s: closing with %d unreleased transfer handles", self.agent_name, pending
                )
            self._close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise PeerError(f"backend {self.name!r} agent {self.agent_name!r} is closed")

    # ------------------------------------------------------------------ hooks
    @abstractmethod
    def _register(self, regions: list[MemoryRegion]) -> None:
        """Register regions with the engine (already validated). Control lock held."""

    @abstractmethod
    def _deregister(self, regions: list[MemoryRegion]) -> None:
        """Deregister regions from the engine. Control lock held."""

    @abstractmethod
    def _peer_name(self, metadata: bytes) -> str:
        """Parse a peer's name from its metadata; raise ValueError if malformed. No lock
        held; may run concurrently with anything (must not touch mutable state)."""

    @abstractmethod
    def _add_peer(self, name: str, metadata: bytes) -> None:
        """Load a peer's metadata into the engine. Control lock held; runs concurrently with
        transfers to other peers and the owner loop."""

    @abstractmethod
    def _remove_peer(self, peer: str) -> None:
        """Remove a peer from the engine; its pending transfers must end as FAILED.

        Control lock held (the peer's pairs were released just before). Workers may be inside
        ``_submit``/``_poll``/``_release`` for this peer: fail and free each of its engine
        handles exactly once, never while another thread is still using it, and make a
        ``_submit`` that races with the removal fail rather than leak.
        """

    def _peer_regions(self, peer: str) -> Sequence[MemoryRegion] | None:
        """The regions a peer published, if the backend knows them (for early checks).
        Control lock held."""
        return None

    @abstractmethod
    def _prepare(self, pair: PreparedPair, local: DescTable, remote: DescTable) -> Any:
        """Build engine-side prepared tables; return backend state kept on the pair.
        Control lock held; runs concurrently with transfers on other pairs."""

    def _release_prepared(self, pair: PreparedPair) -> None:
        """Free engine-side prepared tables (default: nothing to free).

        Control lock held; ``_submit`` calls that checked ``pair.released`` just before it was
        set may still be running with this pair: do not free what they use under them.
        """

    @abstractmethod
    def _submit(
        self,
        op: XferOp,
        pair: PreparedPair,
        local_idx: np.ndarray,
        remote_idx: np.ndarray,
        notification: bytes | None,
        handle: TransferHandle,
    ) -> Any:
        """Post the transfer; return backend state kept on the handle.

        **No template lock held**: called concurrently from several worker threads (each
        with its own handle, often the same pair), with the owner loop and with control-path
        hooks, including ``_remove_peer`` of this peer and ``_release_prepared`` of this pair.
        Raise (``PeerError``, ``HandleError``, ...) or return state that polls FAILED if the
        pair or peer went away meanwhile; never block for the transfer to finish.
        """

    def _submit_pages(
        self,
        op: XferOp,
        pair: PreparedPair,
        chunk: PageChunk,
        notification: bytes | None,
        handle: TransferHandle,
    ) -> Any:
        """Post a chunk in page form (checked); as :meth:`_submit` otherwise. A backend
        that declares ``page_writes`` implements it; never called on the others."""
        raise CapabilityError(f"backend {self.name!r} takes rows, not pages")

    @abstractmethod
    def _poll(self, handle: TransferHandle) -> XferState:
        """Current state of a posted transfer. **No template lock held**; concurrently with
        other workers' ``_submit``/``_poll``/``_release`` and with ``_remove_peer``/``_close``
        failing this handle. Cheap; never blocks for long."""

    def _release(self, handle: TransferHandle) -> None:
        """Free engine-side resources of a handle (default: nothing). **No template lock
        held**; called once per handle, concurrently with other workers and possibly with
        ``_remove_peer`` failing the same handle (free its engine resources exactly once)."""

    @abstractmethod
    def _close(self) -> None:
        """Stop engine threads and free engine resources. Called once, control lock held;
        workers and the owner loop may still be inside data-path hooks or ``progress``/
        ``get_notifications``: make them fail or return quietly, never use freed state."""
