"""What a rank knows of a peer when it picks a transfer backend for the link, and the pick.

Used by :meth:`kvwire.backend.TransferBackend.add_link` (prefill, at handshake), logged once
per link and shown by ``kvwire doctor`` (docs/failover.md).

The per-link rule is one function, :func:`choose_link_path`: from the facts of one link
(:class:`LinkFacts`: each candidate backend's own verdict, the pools' memory, one host or
two) it picks the backend, its fallbacks and the staging the link should use, and says why
in words. With ``auto``: same host with P2P -> ``cudaipc``; GPU pools across hosts (or
without P2P) -> staged bulk writes over the general backend (NIXL, Mooncake); host pools
-> the general backend with the configured staging. With a list: the list's order.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvwire.regions import MemKind


def host_identity() -> dict[str, str]:
    """This host's identity for the handshake: its boot id (differs between hosts and between
    boots) and its hostname. Two ranks are on one host when both match."""
    boot = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return {"boot_id": boot, "hostname": socket.gethostname()}


@dataclass(frozen=True)
class PeerFacts:
    """What a rank knows of a peer when it chooses a backend for the link to it (prefill,
    at handshake): the peer's host identity from the handshake (``{"boot_id", "hostname"}``,
    empty from peers older than protocol 1.8) and the metadata the peer published for the
    backend being asked."""

    host: dict[str, str]
    metadata: bytes
    #: Memory of the peer's registered pools, when the caller knows it (the handshake's
    #: layout); None at the backend layer, which sees only the metadata.
    kinds: frozenset[MemKind] | None = None


@dataclass(frozen=True)
class LinkChoice:
    """Which backend a link uses, the fallbacks both sides share (in order), and why every
    other offer was passed over (``{backend: reason}``). Returned by
    :meth:`TransferBackend.add_link`."""

    peer: str
    backend: str
    fallbacks: tuple[str, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)
    #: Why this backend, in words (:func:`choose_link_path`); empty from older callers.
    why: str = ""
    #: The staging the rule asks for on this link (:data:`StagingAdvice`).
    staging: StagingAdvice = "configured"

    def describe(self) -> str:
        """One line for the log and ``kvwire doctor``."""
        out = f"backend {self.backend}"
        if self.fallbacks:
            out += f" (fallbacks: {', '.join(self.fallbacks)})"
        if self.why:
            out += f": {self.why}"
        if self.skipped:
            out += "; skipped " + "; ".join(f"{k}: {v}" for k, v in self.skipped.items())
        return out


#: What the per-link rule asks of staging: ``direct`` (the backend writes decode's pages
#: itself, e.g. ``cudaipc``'s fused kernel), ``staged`` (gather into a few large
#: descriptors per destination, bulk writes, scatter on arrival: the path across hosts for
#: GPU pools), ``configured`` (whatever ``--staging`` says: host pools, and explicit lists).
StagingAdvice = Literal["direct", "staged", "configured"]


@dataclass(frozen=True)
class LinkFacts:
    """The facts of one link the rule looks at (prefill, at handshake).

    ``candidates``: every backend of this rank's plan that the peer also announced, in this
    rank's order, each with its :meth:`~kvwire.backend.TransferBackend.link_problem` verdict
    (None: it can serve the link). ``link_only``: the names among them that serve only some
    links (``cudaipc``). ``local_kinds``/``peer_kinds``: the memory of each side's pools
    (``peer_kinds`` None when unknown: the local ones are assumed). ``same_host``: from the
    host identities (None: the peer did not say). ``auto``: ``--transfer-backend auto``
    (else a list or one name: its order rules). ``page_writers``: the names among the
    candidates whose backend writes decode's pages itself (it declares
    :attr:`~kvwire.transfers.BackendCapabilities.page_writes`, e.g. ``cudaipc``): a link
    over one is never staged, whether ``auto`` or the operator picked it.
    """

    candidates: Sequence[tuple[str, str | None]]
    link_only: frozenset[str] = frozenset()
    local_kinds: frozenset[MemKind] = frozenset({MemKind.DRAM})
    peer_kinds: frozenset[MemKind] | None = None
    same_host: bool | None = None
    auto: bool = True
    page_writers: frozenset[str] = frozenset()


@dataclass(frozen=True)
class LinkPath:
    """The rule's answer for one link: the backend (None: no candidate can serve it), its
    fallbacks in order, the staging it asks for, why (one phrase), and why every candidate
    not taken was passed over."""

    backend: str | None
    fallbacks: tuple[str, ...]
    staging: StagingAdvice
    why: str
    skipped: dict[str, str]


def choose_link_path(facts: LinkFacts) -> LinkPath:
    """The per-link rule (docs/failover.md, "The choice, per link"). Pure: no I/O, no
    state; called by :meth:`~kvwire.backends.multi.MultiBackend.add_link` and
    :meth:`~kvwire.backend.TransferBackend.add_link` (prefill, handshake threads) and by
    ``kvwire doctor --peer``."""
    skipped = {n: why for n, why in facts.candidates if why is not None}
    usable = [n for n, why in facts.candidates if why is None]
    if not usable:
        return LinkPath(None, (), "configured", "no candidate backend serves this link", skipped)
    peer = facts.peer_kinds if facts.peer_kinds is not None else facts.local_kinds
    gpu = MemKind.VRAM in facts.local_kinds and MemKind.VRAM in peer
    guessed = " (the peer's pools taken to be like this rank's)" if facts.peer_kinds is None else ""
    if not facts.auto:
        why = (
            "the configured backend"
            if len(facts.candidates) == 1
            else "first of the configured list that both sides have and that serves this link"
        )
        if usable[0] in facts.page_writers | facts.link_only:
            # staging a backend that writes pages itself only adds a gather and a scatter
            # (a named cudaipc, staged: 99.8 GB/s at 128 MiB C=8 on two H200s, session 21)
            why += ", which writes decode's pages itself"
            return LinkPath(usable[0], tuple(usable[1:]), "direct", why, skipped)
        return LinkPath(usable[0], tuple(usable[1:]), "configured", why, skipped)
    special = [n for n in usable if n in facts.link_only]
    general = [n for n in usable if n not in facts.link_only]
    if gpu and special and facts.same_host is not False:
        why = f"auto: GPU pools on one host with P2P{guessed}: {special[0]} writes decode's pages"
        return LinkPath(special[0], (*special[1:], *general), "direct", why, skipped)
    if not general:  # only a link-only backend is left, and this is not its kind of link
        why = "auto: the only backend left"
        return LinkPath(special[0], tuple(special[1:]), "direct", why, skipped)
    passed = "; ".join(f"{n}: {why}" for n, why in facts.candidates if n in facts.link_only and why)
    if gpu:
        where = "across hosts" if facts.same_host is False else "without a same-host path"
        why = f"auto: GPU pools {where}{guessed}: staged bulk writes over {general[0]}"
        if passed:
            why += f" ({passed})"
        return LinkPath(general[0], (*general[1:], *special), "staged", why, skipped)
    kind = "host pools" if MemKind.VRAM not in facts.local_kinds else "a host pool on one side"
    why = f"auto: {kind}{guessed}: {general[0]} with the configured staging"
    return LinkPath(general[0], (*general[1:], *special), "configured", why, skipped)


def applied_staging(advice: StagingAdvice, staging: str) -> str:
    """What the per-link rule's staging ``advice`` becomes on a rank whose KV pool's strategy
    is ``staging`` (``--staging``), in words: ``kvwire doctor`` prints it beside the advice.
    The prefill rank applies it at handshake (:meth:`StagingStrategy.link_staging
    <kvwire.staging.base.StagingStrategy.link_staging>`) and logs what it did per link.
    ``auto`` (the default) is bulk staging on GPU pools, which is where the rule advises
    ``staged`` or ``direct``, and ``direct`` elsewhere."""
    if staging == "auto":
        staging = "bulk" if advice != "configured" else "direct"
        return "auto -> " + applied_staging(advice, staging)
    if advice == "direct":
        return "rows written into decode's pages by the backend itself (no staging)"
    if staging != "bulk":
        if advice == "staged":
            return (
                f"not applied: --staging {staging} has no staged path, rows move per "
                "descriptor (run --staging bulk on both sides)"
            )
        return f"--staging {staging}"
    if advice == "staged":
        return (
            "bulk: head slices staged; whole rows (equal TP, MLA, page-size conversion) "
            "staged where a descriptor is under equal_tp_below_bytes and a chunk at least "
            "equal_tp_min_chunk_bytes; dummies and K|V planes per descriptor"
        )
    return (
        "bulk by its own rule: head slices staged; whole rows staged only on GPU pools "
        "(equal_tp=auto)"
    )
