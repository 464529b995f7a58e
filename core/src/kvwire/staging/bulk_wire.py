"""The messages of bulk staging (carried by core in :class:`~kvwire.control.wire.StagingMessage`
envelopes with ``strategy="bulk"``; the envelope names the sending session).

Sender (prefill) -> receiver (decode): ``ask``. Receiver -> sender: ``grant``, ``deny``,
``watermark``. Core never reads them: they are validated here, by the strategy, on arrival.

A ``grant`` that carries ``npages`` is an *offer*: decode sends it unasked, right before its
transfer request (same channel, so it arrives first), for chunk 0 covering every destination
page; a writer whose chunk 0 is exactly that uses it without asking (no ask/grant round trip
on the request's path; one that asked already takes it as the answer), any other writer asks
as before and decode replaces the offer. The fields are optional and
ignored by a writer that does not know them (it drops the unasked grant and asks, getting
the same space), so the message version stays 2.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: Version of these messages; sent in ``describe()`` and checked at handshake, so two ranks
#: that would not understand each other's staging messages refuse to stage rather than hang.
WIRE_VERSION = 2


class BulkMessage(BaseModel):
    """Base of the bulk staging messages (unknown fields from a newer peer are ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    type: ClassVar[str] = ""


class Ask(BulkMessage):
    """Ring space for one staged chunk (retried until granted; duplicates get the same
    answer)."""

    type: ClassVar[str] = "ask"
    room: int = Field(ge=0)
    sender_id: int
    chunk_id: int = Field(ge=0)
    nbytes: int = Field(gt=0)
    #: Where the chunk's pages start among the receiver's destination pages, and how many.
    dst_start: int = Field(ge=0)
    npages: int = Field(gt=0)


class Grant(BulkMessage):
    """The ring space of a staged chunk, and the ring's watermark."""

    type: ClassVar[str] = "grant"
    room: int = Field(ge=0)
    chunk_id: int = Field(ge=0)
    alloc_id: int
    round: int = Field(ge=0)
    offset: int = Field(ge=0)
    end: int = Field(gt=0)
    wm_round: int = Field(ge=0)
    wm_tail: int = Field(ge=0)
    #: Set on an offer only (see the module): the chunk the space is for, in pages of the
    #: destination, and its block's bytes.
    dst_start: int | None = Field(default=None, ge=0)
    npages: int | None = Field(default=None, gt=0)
    nbytes: int | None = Field(default=None, gt=0)


class Deny(BulkMessage):
    """No ring space for that chunk (the request is gone or failed, or the ask is bad)."""

    type: ClassVar[str] = "deny"
    room: int = Field(ge=0)
    chunk_id: int = Field(ge=0)
    reason: str = Field(max_length=1024)


class Watermark(BulkMessage):
    """Everything in the ring before ``(round, tail)`` is free."""

    type: ClassVar[str] = "watermark"
    round: int = Field(ge=0)
    tail: int = Field(ge=0)


#: The most blocks a decode ring may announce: prefill builds its staging table from the
#: announced size (a row per block and span), so a malformed or hostile size must not make
#: it allocate without bound (the GPU sizes: 128 blocks; host defaults: 1,024).
MAX_RING_BLOCKS = 1 << 20


class RingInfo(BaseModel):
    """A decode rank's ring as its handshake announces it (``BulkStaging.describe``), read
    by prefill at handshake before it builds the link's staging tables. Extra keys (the
    strategy, wire version, memory kind, ``units``) are read by name elsewhere."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    ring_addr: int = Field(ge=0, lt=1 << 64)
    ring_bytes: int = Field(gt=0, lt=1 << 62)
    block_bytes: int = Field(gt=0, lt=1 << 40)
    device_id: int = Field(ge=0, lt=1 << 32)

    @model_validator(mode="after")
    def _fits(self) -> RingInfo:
        blocks, rest = divmod(self.ring_bytes, self.block_bytes)
        if rest or not 0 < blocks <= MAX_RING_BLOCKS:
            raise ValueError(
                f"a ring of {self.ring_bytes} B in blocks of {self.block_bytes} B is not a "
                f"whole number of 1..{MAX_RING_BLOCKS} blocks"
            )
        return self


#: type -> model, for decoding a received body.
MESSAGES: dict[str, type[BulkMessage]] = {m.type: m for m in (Ask, Grant, Deny, Watermark)}
