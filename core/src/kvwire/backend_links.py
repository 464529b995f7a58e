"""How a backend serves links: which ranks and peers it can serve, what it announces in the
handshake, and how prefill adds a peer over it (:class:`LinkRules`, the link part of the
:class:`~kvwire.backend.TransferBackend` seam, which inherits it; import it from
:mod:`kvwire.backend`). Split from :mod:`kvwire.backend` to keep modules small.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from kvwire.errors import PeerError
from kvwire.layout import MemKind, MemoryRegion
from kvwire.link_choice import LinkChoice, LinkFacts, PeerFacts, choose_link_path, host_identity
from kvwire.transfers import BackendCapabilities

_DRAM = frozenset({MemKind.DRAM})
Kinds = frozenset[MemKind] | None


class LinkRules(ABC):
    """The link rules of a transfer backend (see :class:`~kvwire.backend.TransferBackend`,
    which implements :meth:`local_metadata`, :meth:`add_peer` and
    :attr:`registered_regions`)."""

    name: ClassVar[str] = "abstract"
    #: Which links it serves, in words (``kvwire doctor``); :meth:`link_problem` decides.
    link_rule: ClassVar[str] = "any peer that announces it"
    #: Whether ``--transfer-backend auto`` picked this backend (set on the instance by
    #: :func:`kvwire.selection.create_backends`): the per-link rule then explains its links
    #: as auto's choice (:func:`kvwire.link_choice.choose_link_path`).
    auto: bool = False
    #: What the backend can do (declared by :class:`~kvwire.backend.TransferBackend`): the
    #: rule reads ``page_writes`` (a backend that writes decode's pages is never staged).
    capabilities: ClassVar[BackendCapabilities]

    @abstractmethod
    def local_metadata(self) -> bytes:
        """Opaque bytes a peer passes to ``add_peer`` (see the backend)."""

    @abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Load a peer from its metadata; return its name (see the backend)."""

    @property
    @abstractmethod
    def registered_regions(self) -> list[MemoryRegion]:
        """Regions currently registered (see the backend)."""

    def advertised_hosts(self, metadata: bytes) -> list[str]:
        """The hosts a peer's :meth:`local_metadata` asks this side to connect to (its data
        endpoints), for the handshake's reachability check: a peer on another host that
        advertises loopback is refused at once, naming the setting, instead of failing at
        the transfer deadline. The default (an engine that checks this itself, or metadata
        without addresses) returns none. Threads: any thread (handshake threads); no lock."""
        return []

    @classmethod
    def rank_problem(cls, kinds: frozenset[MemKind]) -> str | None:
        """Why this backend cannot serve any link of a rank whose pools are of memory
        ``kinds`` (e.g. no GPU, or no VRAM pool, for a GPU-only path), or None. Asked for
        ``auto`` and for each backend of a list before it is constructed (a backend named
        alone is constructed regardless and fails in its own words). Any thread; must not
        fail when the engine is missing: say so instead."""
        return None

    def link_problem(self, peer: PeerFacts) -> str | None:
        """Why this backend cannot serve the link to ``peer`` (another host, no P2P between
        the two GPUs, ...), or None when it can. Asked by the prefill side at handshake, for
        each backend both sides announced, before :meth:`add_peer`; the reason is logged and
        shown by ``kvwire doctor``. The default accepts every peer. Threads: handshake
        threads; no template lock held; must not change state."""
        return None

    def offers(self) -> list[tuple[str, bytes]]:
        """``(backend name, metadata)`` of every backend this rank announces in the
        handshake, in preference order (one here; several for
        :class:`~kvwire.backends.multi.MultiBackend`). Called by decode when it builds its
        hello. Threads: as :meth:`local_metadata`."""
        return [(self.name, self.local_metadata())]

    def add_link(
        self, offers: Sequence[tuple[str, bytes]], host: dict[str, str], peer_kinds: Kinds = None
    ) -> LinkChoice:
        """Prefill, at handshake: add the peer that announced ``offers`` (name, metadata) over
        the first backend both sides have and whose :meth:`link_problem` accepts it (the peer's
        pool ``peer_kinds`` from its handshake layout, or None); return the choice.
        :class:`PeerError` naming every reason when none fits. Threads: handshake
        threads; control path (as :meth:`add_peer`)."""
        mine = dict(offers).get(self.name)
        if mine is None:
            raise PeerError(
                f"no shared transfer backend: this rank has {self.name!r}, the peer offers "
                f"{', '.join(repr(n) for n, _ in offers) or 'none'}"
            )
        why = self.link_problem(PeerFacts(host, mine, peer_kinds))
        if why is not None:
            raise PeerError(f"backend {self.name!r} cannot serve this link: {why}")
        skipped = {n: "not configured on this rank" for n, _ in offers if n != self.name}
        path = choose_link_path(
            LinkFacts(
                [(self.name, None)],
                local_kinds=frozenset(r.kind for r in self.registered_regions) or _DRAM,
                peer_kinds=peer_kinds,
                same_host=(host == host_identity()) if host else None,
                auto=self.auto,
                page_writers=frozenset({self.name} if self.capabilities.page_writes else ()),
            )
        )
        return LinkChoice(self.add_peer(mine), self.name, (), skipped, path.why, path.staging)
