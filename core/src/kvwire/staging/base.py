"""The :class:`StagingStrategy` seam between the KV pool and the wire.

A strategy decides which rows a chunk's transfer moves. ``direct`` moves rows of the KV pool
itself (through the mapper's tables). A staging strategy (``bulk``, :mod:`kvwire.staging.bulk`)
gathers a chunk into memory it allocated, moves that with one row per (source rank,
destination rank, chunk), and scatters it on arrival. Memory a strategy allocates reaches the
engine only through the :class:`StagingContext` callbacks (``register_fn``), so a backend
plugin contributes no staging code.

Call order (who calls, from which side):

1. both sides, at manager start: :meth:`StagingStrategy.setup` with a context whose
   ``register_fn`` registers memory with the selected backend;
2. sending side, transfer worker, per chunk: :meth:`StagingStrategy.plan` (maps pages, and
   gathers into staging memory if the strategy stages; None means "wait") before the submit;
3. sending side, after the transfer is terminal: :meth:`StagingStrategy.on_sent`;
4. receiving side, on each chunk notification: :meth:`StagingStrategy.on_arrival` (scatter);
5. both sides, on every terminal path of a request: :meth:`StagingStrategy.release`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
from pydantic import BaseModel

from kvwire.backend import NoOptions
from kvwire.descriptors import IndexArray
from kvwire.index.base import IndexMapper, TablePair
from kvwire.layout import KVLayout, MemoryRegion

#: Registers (or deregisters) memory a strategy allocated with the selected backend.
RegisterFn = Callable[[Sequence[MemoryRegion]], None]


@dataclass
class StagingContext:
    """What core hands a strategy at setup: the local layout, the memory callbacks, and what a
    staging strategy needs to size itself."""

    layout: KVLayout
    register_fn: RegisterFn
    deregister_fn: RegisterFn
    #: Republishes local metadata after registration (peers must see new regions).
    publish_fn: Callable[[], None] = lambda: None
    #: "prefill" or "decode".
    role: str = "prefill"
    #: Transfer workers of a prefill manager (one private staging buffer set each).
    num_workers: int = 1
    #: The engine's KV tensors (layout order, or one stacked tensor) for gather/scatter.
    kv_tensors: Any = None
    #: Sends a control message to a peer endpoint (the staging lifecycle's messages).
    send_fn: Callable[[str, Any], bool] = lambda endpoint, msg: False
    #: Decode only: the host KV pool (HiSparse path) when the engine registered one.
    host_layout: KVLayout | None = None


class LocalCopy(Protocol):
    """A copy a strategy started itself (e.g. into a peer's shared host pool on the same
    machine) instead of submitting rows to the backend. The pipeline polls :meth:`done` from
    the transfer worker and tells decode with a control-channel note once it is True."""

    #: Bytes and rows moved (metrics).
    nbytes: int
    num_rows: int

    def done(self) -> bool:
        """Non-blocking: True once every byte is visible to the peer. Raises
        :class:`~kvwire.errors.TransferError` if the copy failed."""
        ...


_NO_ROWS: IndexArray = np.empty(0, dtype=np.int64)


@dataclass
class Segment:
    """One part of a chunk with its own completion: rows of one (source kind, destination
    kind), submitted through the prepared pair ``table``, or a :class:`LocalCopy` the strategy
    already started (``copy``)."""

    label: str
    table: str = ""
    src_idx: IndexArray = field(default_factory=lambda: _NO_ROWS)
    dst_idx: IndexArray = field(default_factory=lambda: _NO_ROWS)
    copy: LocalCopy | None = None


@dataclass
class ChunkPlan:
    """What the transfer worker submits for one chunk.

    ``table`` names the prepared pair to use: ``"kv"`` for the mapper's KV tables, or a name
    the strategy registered. ``src_idx``/``dst_idx`` index into that pair. ``token`` is opaque
    strategy state handed back to :meth:`StagingStrategy.on_sent`.
    """

    table: str
    src_idx: IndexArray
    dst_idx: IndexArray
    token: Any = field(default=None)
    #: Notification kind decode sees: "kv" (rows landed in the pool) or "staged" (a block
    #: landed in the staging ring and must be scattered).
    what: str = "kv"
    #: Set when the strategy splits the chunk itself: each segment completes on its own and
    #: decode counts the chunk once every segment's note arrived (``table``/``src_idx``/
    #: ``dst_idx`` are then unused).
    segments: list[Segment] | None = None

    @property
    def empty(self) -> bool:
        """No rows to move (dummy sender, or a chunk of zero pages)."""
        if self.segments is not None:
            return not self.segments
        return self.src_idx.size == 0


@dataclass(frozen=True)
class QueuedChunk:
    """A chunk with data just queued for one destination (see
    :meth:`StagingStrategy.on_queued`)."""

    room: int
    chunk_id: int
    mapper: IndexMapper
    #: Source pages of the chunk, and where they start among the destination's units.
    npages: int
    dst_start: int
    #: The destination (decode session) and its control endpoint.
    dest: str
    endpoint: str
    #: This sender's id and session (for messages the strategy sends).
    sender_id: int
    session: str
    timeout_s: float


class StagingStrategy(ABC):
    """How a chunk's bytes reach the wire. One instance per :class:`~kvwire.KVManager`."""

    name: ClassVar[str] = "abstract"
    options_model: ClassVar[type[BaseModel]] = NoOptions

    def __init__(self, options: BaseModel | None = None) -> None:
        self.options = options if options is not None else self.options_model()
        self.context: StagingContext | None = None

    def setup(self, context: StagingContext) -> None:
        """Allocate and register staging memory through ``context.register_fn``. Called once
        on both sides when the manager starts."""
        self.context = context

    @abstractmethod
    def plan(
        self,
        room: int,
        chunk_id: int,
        mapper: IndexMapper,
        src_pages: Any,
        dst_pages: Any,
        *,
        dest: str = "",
        worker: int = 0,
    ) -> ChunkPlan | None:
        """Sending side, transfer worker ``worker`` thread, per chunk for destination ``dest``
        (the decode session), before submit: decide the rows to move (and gather them into
        staging memory when the strategy stages). None means "not yet" (waiting for staging
        space): the worker asks again later, keeping the destination's chunks in order."""

    def on_sent(self, room: int, plan: ChunkPlan, ok: bool) -> None:  # noqa: B027 - optional
        """Sending side, after the chunk's transfer is terminal (its buffer may be reused)."""

    def on_arrival(self, room: int, chunk_id: int, payload: Any) -> None:  # noqa: B027
        """Receiving side, when every writer of a chunk has arrived: scatter into the pool."""

    def release(self, room: int) -> None:  # noqa: B027 - optional hook
        """Both sides, on every terminal path of a request: free what the room holds."""

    # ----------------------------------------------------------- staging lifecycle hooks
    # Strategies that stage (``bulk``) implement these; ``direct`` keeps the defaults.
    def describe(self) -> dict[str, Any] | None:
        """Decode side, at handshake: what prefill must know about this rank's staging memory
        (sent in ``Hello.staging``); None when this rank does not stage."""
        return None

    def link_tables(
        self,
        mapper: IndexMapper,
        remote: dict[str, Any] | None,
        *,
        session: str = "",
        tables: TablePair | None = None,
    ) -> dict[str, Any]:
        """Prefill side, at handshake with one decode rank (decode session ``session``): extra
        descriptor table pairs to prepare for that link (name -> ``TablePair``); empty when the
        link does not stage. ``remote`` is what that rank's strategy :meth:`describe` d;
        ``tables`` the mapper's tables when core already built them (host-pool links)."""
        return {}

    def room_tables(self) -> dict[str, int]:
        """Sizes of per-request staging state (leak check)."""
        return {}

    def on_queued(self, chunk: QueuedChunk) -> None:  # noqa: B027 - optional hook
        """Sending side, engine thread inside ``send()`` (under the session lock: quick, never
        blocking), for links where :meth:`link_tables` returned tables: a chunk was queued for
        a worker. A strategy that needs the receiver's consent (ring space) asks for it here,
        so the answer is likely back when the worker reaches the chunk. Raising a
        ``KVWireError`` fails the request."""

    def on_abandoned(  # noqa: B027 - optional hook
        self, room: int, dest: str, endpoint: str, sender_id: int, session: str
    ) -> None:
        """Sending side, worker thread, for links where :meth:`link_tables` returned tables:
        nothing more will be written for ``room`` to ``dest`` (the request failed; its posted
        writes all ended). Free what was asked for it; tell the receiver if it holds space."""

    def on_control(self, msg: Any) -> None:  # noqa: B027 - optional hook
        """Sending side, control thread: a staging control message from a receiving peer."""

    def peer_lost(self, session: str) -> None:  # noqa: B027 - optional hook
        """Either side, control thread: a peer was evicted; drop what belongs to it."""

    def close(self) -> None:
        """Deregister and free staging memory (manager shutdown)."""
        self.context = None
