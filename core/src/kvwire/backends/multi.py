"""Several transfer backends behind one: a per-link choice, and failover between them.

A rank configured with a list (``--transfer-backend nixl,tcp``, or ``auto`` where a
link-only backend such as ``cudaipc`` is usable here) holds one :class:`MultiBackend` whose
*members* are the backends in preference order; the rest of kvwire sees one
:class:`~kvwire.backend.TransferBackend` (docs/failover.md tells the whole story):

* **Memory** is registered with every member that takes it.
* **Handshake.** Decode announces every member's metadata (:meth:`MultiBackend.offers`);
  prefill's :meth:`MultiBackend.add_link` adds the peer to each member both sides have and
  whose ``link_problem`` accepts the link, in its own order: the first is the link's
  backend, the others its fallbacks. ``prepare`` prepares the tables on every member.
* **Failover.** A transfer goes to the link's first *healthy* member; when that member
  reports it FAILED (or refuses it with a peer or handle error), the member is marked
  unhealthy for the link, the switch logged and reported (``on_failover``), and the same rows
  and notification go to the next healthy member (the handle stays PENDING; writes are
  idempotent, a failed member delivered no notification: decode counts a chunk once).
* **Recovery.** A probe thread reconnects an unhealthy member after a back-off doubling on
  each failed probe (``probe_s`` .. ``probe_max_s``): ``link_problem``, then the peer added
  again from its metadata, the tables prepared again (``on_recovery``).
* **Lane.** Each link's current member's lean lane (:mod:`kvwire.backends.multi_lane`).

Lock contract (on top of the template's): routes and their health live under
``_routes_lock``, held only for dictionary and flag updates, never across a member call.
``_lock`` serialises ``add_link``, ``prepare``, ``remove_peer`` and the probe's reconnection.
Data-path methods (``submit``/``poll``/``release``) take no lock but a transfer's own
(try-acquired by ``poll``: two threads polling one handle do not both fail it over).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvwire.backend import (
    BackendCapabilities,
    LinkChoice,
    Note,
    Notification,
    PeerFacts,
    PreparedPair,
    TransferBackend,
    TransferHandle,
    XferOp,
    XferState,
)
from kvwire.backends.multi_lane import MultiLane
from kvwire.backends.multi_routes import Pair as _Pair
from kvwire.backends.multi_routes import Route as _Route
from kvwire.backends.multi_routes import Xfer as _Xfer
from kvwire.backends.multi_routes import members_batch
from kvwire.descriptors import DescTable
from kvwire.errors import HandleError, KVWireError, PeerError
from kvwire.layout import MemKind, MemoryRegion
from kvwire.link_choice import LinkFacts, choose_link_path, host_identity
from kvwire.page_form import PageChunk

logger = logging.getLogger(__name__)

#: Failures that mean "this member cannot reach the peer now" (a fallback may): anything
#: else a member raises on submit (bad indices, a capability) is the caller's error.
LINK_ERRORS = (PeerError, HandleError)
_DRAM = frozenset({MemKind.DRAM})


class MultiBackend(TransferBackend):
    """An ordered list of backends behind the :class:`TransferBackend` seam, choosing per
    link and failing over between them (see the module docstring)."""

    name = "multi"
    #: Either memory kind passes the template's check (each member takes or refuses it); a
    #: chunk in page form goes so to a member that takes pages, else as its rows.
    #: Takes pages, later notes and their sums: members get them so, or as rows and bytes.
    capabilities = BackendCapabilities(
        dram=True, vram=True, page_writes=True, later_notes=True, summed_writes=True
    )

    def __init__(
        self,
        agent_name: str,
        members: Sequence[TransferBackend],
        *,
        probe_s: float = 0.5,
        probe_max_s: float = 30.0,
        on_failover: Callable[[str, str, str, str], None] | None = None,
        on_recovery: Callable[[str, str], None] | None = None,
        auto: bool = False,
        link_only: Iterable[str] = (),
    ) -> None:
        super().__init__(agent_name)
        if not members:
            raise ValueError("MultiBackend needs at least one member backend")
        names = [m.name for m in members]
        if len(set(names)) != len(names):
            raise ValueError(f"member backends must differ, got {names}")
        self.members = list(members)
        #: Its links' current members' lanes, where a member offers one (multi_lane).
        self.page_lane = MultiLane(self) if any(m.page_lane for m in members) else None
        #: ``--transfer-backend auto`` (the per-link rule picks) or a list (its order does).
        self.auto = auto
        #: Members serving only some links (``cudaipc``), writing pages (never staged).
        self.link_only = frozenset(link_only)
        self.page_writers = frozenset(m.name for m in members if m.capabilities.page_writes)
        self.probe_s = probe_s
        self.probe_max_s = probe_max_s
        self._on_failover = on_failover
        self._on_recovery = on_recovery
        self._routes: dict[str, _Route] = {}
        self._routes_lock = threading.Lock()
        self._wake = threading.Event()
        self._prober: threading.Thread | None = None
        #: Members that refused this rank's memory at startup, with why (never used).
        self.disabled: dict[int, str] = {}
        self.failovers = 0  # switches away from a failed member (all links)
        self.recoveries = 0  # moves back after a probe

    @property
    def member_names(self) -> list[str]:  # the enabled members', in preference order
        return [m.name for i, m in enumerate(self.members) if i not in self.disabled]

    # ---------------------------------------------------------------- memory
    def _register(self, regions: list[MemoryRegion]) -> None:
        """Register with every enabled member. Before any link exists, a member refusing the
        memory (``cudaipc``: VRAM on two GPUs) is disabled, its reason logged, while another
        is left; afterwards a refusal is raised (links count on every member)."""
        done: list[TransferBackend] = []
        try:
            for i, m in enumerate(self.members):
                if i in self.disabled:
                    continue
                try:
                    m.register(regions)
                except KVWireError as exc:
                    left = len(self.members) - len(self.disabled) - 1
                    if self._routes or left < 1:
                        raise
                    self.disabled[i] = f"refused this rank's memory: {exc}"
                    why = self.disabled[i]
                    logger.warning("%s: backend %s disabled: it %s", self.agent_name, m.name, why)
                    continue
                done.append(m)
        except BaseException:
            for m in done:
                m.deregister(regions)
            raise

    def _deregister(self, regions: list[MemoryRegion]) -> None:
        for i, m in enumerate(self.members):
            if i not in self.disabled:
                m.deregister(regions)

    # ----------------------------------------------------------------- peers
    def local_metadata(self) -> bytes:
        """The first enabled member's metadata (what a peer that knows one backend reads)."""
        return self.offers()[0][1]

    def offers(self) -> list[tuple[str, bytes]]:
        """Every enabled member's name and metadata, in preference order (decode's hello)."""
        return [(m.name, m.local_metadata()) for i, m in enumerate(self.members)
                if i not in self.disabled]  # fmt: skip

    def advertised_hosts(self, metadata: bytes) -> list[str]:
        """The hosts in ``metadata`` as the member whose metadata it is reads them (each
        member's metadata names its backend; the others refuse it)."""
        for m in self.members:
            try:
                return m.advertised_hosts(metadata)
            except Exception:  # not this member's metadata
                continue
        return []

    def add_link(
        self,
        offers: Sequence[tuple[str, bytes]],
        host: dict[str, str],
        peer_kinds: frozenset[MemKind] | None = None,
    ) -> LinkChoice:
        """Prefill, at handshake: add the peer to every member both sides have and whose
        ``link_problem`` accepts it, in this rank's order; the first is the link's backend.
        :class:`PeerError` naming each backend's reason when none fits. Re-adding a peer (a
        restart) replaces its link. ``peer_kinds``: the peer's pools' memory (None: like
        this rank's). Control path (handshake threads)."""
        theirs = dict(offers)
        skipped: dict[str, str] = {
            n: "not configured on this rank" for n in theirs if n not in self.member_names
        }
        candidates: list[tuple[str, str | None]] = []
        for i, m in enumerate(self.members):
            if i in self.disabled:
                skipped[m.name] = self.disabled[i]
                continue
            meta = theirs.get(m.name)
            if meta is None:
                skipped[m.name] = "the peer does not announce it"
                continue
            candidates.append((m.name, m.link_problem(PeerFacts(host, meta, peer_kinds))))
        path = choose_link_path(
            LinkFacts(
                candidates,
                link_only=self.link_only,
                local_kinds=frozenset(r.kind for r in self.registered_regions) or _DRAM,
                peer_kinds=peer_kinds,
                same_host=(host == host_identity()) if host else None,
                auto=self.auto,
                page_writers=self.page_writers,
            )
        )
        skipped.update(path.skipped)
        index = {m.name: i for i, m in enumerate(self.members)}
        usable = [index[n] for n in ([path.backend, *path.fallbacks] if path.backend else [])]
        with self._lock:
            self._check_open()
            names: dict[int, str] = {}
            for i in usable:
                m = self.members[i]
                try:
                    names[i] = m.add_peer(theirs[m.name])
                except KVWireError as exc:
                    skipped[m.name] = f"refused the peer: {exc}"
            if not names:
                raise PeerError(
                    "no transfer backend serves this link: "
                    + "; ".join(f"{k}: {v}" for k, v in skipped.items())
                )
            order = [i for i in usable if i in names]
            peer = names[order[0]]
            self._forget_old(peer, names)
            route = _Route(
                peer=peer,
                order=order,
                names=names,
                metadata={i: theirs[self.members[i].name] for i in order},
                healthy={i: True for i in order},
                host=dict(host),
            )
            with self._routes_lock:
                self._routes[peer] = route
        first = self.members[order[0]].name
        return LinkChoice(
            peer,
            first,
            tuple(self.members[i].name for i in order[1:]),
            skipped,
            why=path.why if first == path.backend else f"{path.why}; {path.backend} refused",
            staging=path.staging if first == path.backend else "configured",
        )

    def _forget_old(self, peer: str, kept: dict[int, str]) -> None:
        """Control lock held: a peer added again (a restart) — release the old link's pairs
        (the members that re-added it dropped theirs already) and remove it from members the
        new link does not use."""
        with self._routes_lock:
            old = self._routes.pop(peer, None)
        if old is None:
            return
        for pair in [p for p in self._pairs.values() if p.peer == peer]:
            self._release_pair_locked(pair)
        for i, n in old.names.items():
            if i not in kept and n in self.members[i].peers():
                self.members[i].remove_peer(n)

    def link_backend(self, peer: str) -> str | None:
        """The member a new transfer to ``peer`` goes over now (None: unknown peer, or no
        healthy member). Any thread."""
        with self._routes_lock:
            route = self._routes.get(peer)
            if route is None:
                return None
            first = next((i for i in route.order if route.healthy[i]), None)
        return None if first is None else self.members[first].name

    def peers(self) -> list[str]:
        with self._routes_lock:
            return list(self._routes)

    def _peer_name(self, metadata: bytes) -> str:
        raise ValueError("a MultiBackend adds peers with add_link(offers, host), not add_peer")

    def _add_peer(self, name: str, metadata: bytes) -> None:
        raise ValueError("a MultiBackend adds peers with add_link(offers, host), not add_peer")

    def _remove_peer(self, peer: str) -> None:
        with self._routes_lock:
            route = self._routes.pop(peer, None)
        if route is None:
            return
        for i, n in route.names.items():
            m = self.members[i]
            if n in m.peers():
                m.remove_peer(n)

    # -------------------------------------------------------------- prepared
    def _prepare(self, pair: PreparedPair, local: DescTable, remote: DescTable) -> Any:
        with self._routes_lock:
            route = self._routes[pair.peer]
        inner: dict[int, PreparedPair] = {}
        problems: list[str] = []
        for i in route.order:
            m = self.members[i]
            try:
                inner[i] = m.prepare(route.names[i], local, remote)
            except KVWireError as exc:
                problems.append(f"{m.name}: {exc}")
                logger.warning(
                    "%s: %s cannot prepare tables for %s (it will not serve them): %s",
                    self.agent_name,
                    m.name,
                    pair.peer,
                    exc,
                )
        if not inner:
            raise PeerError(f"no backend could prepare tables for {pair.peer}: {problems}")
        state = _Pair(route, inner, local.copy(), remote.copy())
        with self._routes_lock:
            route.pairs.append(pair)
        return state

    def _release_prepared(self, pair: PreparedPair) -> None:
        st: _Pair = pair.state
        with self._routes_lock:
            if pair in st.route.pairs:
                st.route.pairs.remove(pair)
        for i, p in list(st.inner.items()):
            if not p.released:  # else released by the member's own peer removal
                with contextlib.suppress(HandleError):
                    self.members[i].release_prepared(p)

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
        """Post on the link's first healthy member (which validates the arguments), failing
        over at once when it refuses the post for its link. Data path, no lock across a
        member call; ``wake`` goes to the member (called if it pushes events)."""
        x = _Xfer(op, pair.state, local_idx, remote_idx, notification, wake=wake)
        return self._start(pair, x)

    def submit_pages(
        self,
        op: XferOp,
        pair: PreparedPair,
        chunk: PageChunk,
        notification: Note | None = None,
        wake: Callable[[], None] | None = None,
    ) -> TransferHandle:
        """:meth:`submit` of a page-form chunk: so to a member that takes pages, else rows."""
        x = _Xfer(op, pair.state, None, None, notification, chunk=chunk, wake=wake)
        return self._start(pair, x)

    def _start(self, pair: PreparedPair, x: _Xfer) -> TransferHandle:
        self._check_open()
        if pair.released:
            why = "peer removed or tables rebuilt"
            raise HandleError(f"prepared pair {pair.id} for {pair.peer!r} was released ({why})")
        if not self._post(x, first=True):
            why = "; ".join(x.errors) or "every backend of the link failed (reconnecting)"
            raise PeerError(f"no transfer backend could post to {pair.peer}: {why}")
        assert x.inner is not None
        inner = x.inner
        handle = TransferHandle(next(self._ids), pair.peer, x.op, inner.num_descs, inner.num_bytes)
        handle.state, handle.pushes = x, inner.pushes
        with self._handles_lock:
            self._handles[handle.id] = handle
        return handle

    def _post(self, x: _Xfer, first: bool = False) -> bool:
        """Post ``x`` on the next healthy member of its link it has not tried; False when
        none is left. A member refusing for its link is marked failed and skipped."""
        route = x.pair.route
        while True:
            with self._routes_lock:
                nxt = next(
                    (
                        i
                        for i in route.order
                        if route.healthy[i] and i not in x.tried and i in x.pair.inner
                    ),
                    None,
                )
            if nxt is None:
                return False
            x.tried.append(nxt)
            m = self.members[nxt]
            try:
                inner = x.post_on(m, x.pair.inner[nxt])
            except LINK_ERRORS as exc:
                x.errors.append(f"{m.name}: {exc}")
                self._member_failed(route, nxt, str(exc))
                continue
            except KVWireError:
                if first:
                    raise  # the caller's arguments: no other member would take them either
                x.errors.append(f"{m.name}: refused the retry")
                continue
            x.member, x.inner = nxt, inner
            return True

    def poll(self, handle: TransferHandle) -> XferState:
        """The member's state of the transfer; on FAILED, post it again on the next healthy
        member and answer PENDING (FAILED only when none is left). Data path."""
        if handle.released:
            raise HandleError(f"transfer handle {handle.id} was already released")
        if self._closed:
            handle.error = handle.error or f"agent {self.agent_name!r} was closed"
            return XferState.FAILED
        x: _Xfer = handle.state
        if not x.lock.acquire(blocking=False):
            return XferState.PENDING  # another thread is polling (or failing over) it
        try:
            if x.inner is None:
                return XferState.FAILED
            m = self.members[x.member]
            state = m.poll(x.inner)
            if state is not XferState.FAILED:
                return state
            why = x.inner.error or "failed"
            x.errors.append(f"{m.name}: {why}")
            self._release_inner(x)
            self._member_failed(x.pair.route, x.member, why)
            if self._post(x):
                assert x.inner is not None
                handle.pushes = x.inner.pushes  # the fallback's way of saying it ended
                return XferState.PENDING
            handle.error = "; ".join(x.errors) + (
                "" if len(x.tried) > 1 else " (no healthy fallback on this link)"
            )
            return XferState.FAILED
        finally:
            x.lock.release()

    def _release_inner(self, x: _Xfer) -> None:
        inner, x.inner = x.inner, None
        if inner is not None and not inner.released:
            with contextlib.suppress(HandleError):
                self.members[x.member].release(inner)

    def release(self, handle: TransferHandle) -> None:
        """Release the handle and the member's handle under it, exactly once. Data path."""
        with self._handles_lock:
            if handle.released:
                raise HandleError(f"transfer handle {handle.id} released twice")
            handle.released = True
            self._handles.pop(handle.id, None)
        x: _Xfer = handle.state
        with x.lock:
            self._release_inner(x)

    def _submit(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - submit overrides
        raise NotImplementedError

    def _poll(self, handle: TransferHandle) -> XferState:  # pragma: no cover - poll overrides
        raise NotImplementedError

    # --------------------------------------------------------------- health
    def _member_failed(self, route: _Route, i: int, why: str) -> None:
        """A member failed a transfer of ``route``'s link: mark it unhealthy (once), log and
        report the switch, and schedule its probe. Any thread."""
        now = time.monotonic()
        with self._routes_lock:
            if not route.healthy.get(i, False):
                return
            route.healthy[i] = False
            last = route.backoff.get(i)
            flapping = now - route.recovered_at.get(i, -self.probe_max_s) < self.probe_max_s
            back = min(last * 2, self.probe_max_s) if last and flapping else self.probe_s
            route.backoff[i] = back
            route.next_probe[i] = now + back
            to = next((j for j in route.order if route.healthy[j]), None)
            if route.peer not in self._routes:
                return  # the peer went away: nothing to switch
        src, dst = self.members[i].name, (self.members[to].name if to is not None else "none")
        self.failovers += 1
        logger.warning(
            "%s: link to %s: backend %s failed (%s); switching to %s, probing %s in the background",
            self.agent_name,
            route.peer,
            src,
            why,
            dst,
            src,
        )
        if self._on_failover is not None:
            self._on_failover(route.peer, src, dst, why)
        self._start_prober()

    def _start_prober(self) -> None:
        with self._routes_lock:
            if self._prober is not None or self._closed:
                self._wake.set()
                return
            self._prober = threading.Thread(
                target=self._probe_loop, name=f"kvwire-probe-{self.agent_name}", daemon=True
            )
        self._prober.start()

    def _probe_loop(self) -> None:
        """Probe thread: reconnect unhealthy members when their back-off expired."""
        while not self._closed:
            now = time.monotonic()
            due: list[tuple[_Route, int]] = []
            wait = self.probe_max_s
            with self._routes_lock:
                for route in self._routes.values():
                    for i in route.order:
                        if route.healthy[i]:
                            continue
                        left = route.next_probe[i] - now
                        if left <= 0:
                            due.append((route, i))
                        else:
                            wait = min(wait, left)
            for route, i in due:
                self._probe(route, i)
            if due:
                continue
            self._wake.wait(wait)
            self._wake.clear()

    def _probe(self, route: _Route, i: int) -> None:
        """Probe thread: reconnect member ``i`` of ``route`` (remove the peer, add it again,
        prepare the link's tables again); healthy again on success, a doubled back-off on
        failure. Holds the control lock across the member's control-path calls."""
        m = self.members[i]
        try:
            why = m.link_problem(PeerFacts(route.host, route.metadata[i]))
            if why is not None:
                raise PeerError(why)
            with self._lock:
                if self._closed or route.peer not in self.peers():
                    return
                name = route.names[i]
                if name in m.peers():
                    m.remove_peer(name)  # also releases its pairs (in-flight ones fail over)
                route.names[i] = m.add_peer(route.metadata[i])
                with self._routes_lock:
                    pairs = list(route.pairs)
                for pair in pairs:
                    st: _Pair = pair.state
                    if i in st.inner:
                        st.inner[i] = m.prepare(route.names[i], st.local, st.remote)
        except Exception as exc:
            with self._routes_lock:
                back = min(route.backoff.get(i, self.probe_s) * 2, self.probe_max_s)
                route.backoff[i] = back
                route.next_probe[i] = time.monotonic() + back
            logger.info(
                "%s: link to %s: %s still unusable (%s); next probe in %.1fs",
                self.agent_name,
                route.peer,
                m.name,
                exc,
                back,
            )
            return
        with self._routes_lock:
            route.healthy[i] = True
            route.recovered_at[i] = time.monotonic()
        self.recoveries += 1
        who = f"{self.agent_name}: link to {route.peer}: backend {m.name}"
        logger.warning("%s reconnected; moving back to it", who)
        if self._on_recovery is not None:
            self._on_recovery(route.peer, m.name)

    # ------------------------------------------------------------- owner loop
    def workers_wanted(self, peer: str | None = None) -> int | None:
        """``peer``'s link's member's number; else the members' when they all agree."""
        name = self.link_backend(peer) if peer is not None else None
        wanted = {m.workers_wanted(peer) for m in self.members if name in (None, m.name)}
        return wanted.pop() if len(wanted) == 1 else None

    def set_notification_waker(self, wake: Callable[[], None] | None) -> None:
        super().set_notification_waker(wake)
        for m in self.members:  # one that pushes events wakes the owner loop for its notes
            m.set_notification_waker(wake)

    def get_notifications(self) -> list[Notification]:
        return [n for m in self.members for n in m.get_notifications()]

    def post_batch(self) -> contextlib.AbstractContextManager[None]:
        return members_batch(self.members)  # every member holds its own writes

    def progress(self) -> None:
        for m in self.members:
            m.progress()

    def _close(self) -> None:
        self._wake.set()
        for m in self.members:
            m.close()
        # the probe thread sees ``_closed`` (after this lock is released) and ends
