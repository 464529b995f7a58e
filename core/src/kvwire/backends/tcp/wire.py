"""Data-plane frames of the ``tcp`` backend (msgpack headers, raw payload frames).

Request, initiator -> target (DEALER -> ROUTER): ``[kind, header, payload?]`` where kind is
``W`` (write, payload = the bytes), ``R`` (read) or ``N`` (a note: the notification ``n``
alone, delivered at once and never answered; only to a peer that said it takes them, e.g.
``cudaipc``'s metadata ``notes``). Reply, target -> initiator: ``[A, header,
payload?]`` (payload = the bytes of a read part). Headers are msgpack maps with short keys:

=====  =================================================================
key    meaning
=====  =================================================================
``v``  data-plane version (:data:`VERSION`)
``x``  transfer id, unique per initiator
``f``  initiator's agent name (requests)
``d``  rows on the target: ``uint64`` ``(addr, len)`` pairs, little-endian bytes
``p``  part number; ``np``: number of parts
``n``  notification payload (bytes) or nil; delivered after the last part
``t``  write parts: the initiator's wall-clock time (``time.time()``) by which the part must
       land; the target drops a part that arrives later (optional: older initiators omit it)
``ok`` reply status; ``e``: error text when not ok
=====  =================================================================
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
from numpy.typing import NDArray

VERSION = 1
WRITE, READ, ACK, NOTE = b"W", b"R", b"A", b"N"


class MalformedMessageError(ValueError):
    """A data-plane message could not be parsed or fails validation."""


class RefusedRowsError(MalformedMessageError):
    """A request names rows outside the target's registered regions."""


class LateWriteError(MalformedMessageError):
    """A write part arrived after the time by which it had to land (held up by an outage):
    its initiator has failed, or is about to fail, the transfer, so its bytes must not land."""


def check_write_by(header: dict[str, Any], now: float, sender: str, xid: int) -> None:
    """Refuse a write part that arrives after its ``t`` (``now``: the target's wall clock).
    Called by the target for every write part, before any byte of it lands."""
    write_by = header.get("t")
    if write_by is None:
        return
    if not isinstance(write_by, (int, float)):
        raise MalformedMessageError("write-by time must be a number")
    if now > float(write_by):
        raise LateWriteError(
            f"write part of transfer {xid} from {sender!r} arrived {now - float(write_by):.3f}s "
            "after the time it had to land by: dropped, its bytes never land"
        )


def public_reason(exc: BaseException) -> str:
    """What a target tells the initiator about a refused request: the category only, never
    addresses, counts or region names (those go to the target's own log)."""
    if isinstance(exc, RefusedRowsError):
        return "refused: rows outside the target's registered regions (details in its log)"
    if isinstance(exc, LateWriteError):
        return "refused: the write arrived after the time it had to land by"
    return "refused: malformed request (details in the target's log)"


def pack(header: dict[str, Any]) -> bytes:
    """Encode a header."""
    return msgpack.packb(header, use_bin_type=True)  # type: ignore[no-any-return]


def unpack(data: bytes | memoryview) -> dict[str, Any]:
    """Decode a header, refusing anything that is not a map of the current version."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=1 << 31)
    except Exception as exc:
        raise MalformedMessageError(f"undecodable header: {exc}") from exc
    if not isinstance(obj, dict):
        raise MalformedMessageError(f"header is a {type(obj).__name__}, not a map")
    if obj.get("v") != VERSION:
        raise MalformedMessageError(f"data-plane version {obj.get('v')!r}, expected {VERSION}")
    return obj


def rows_to_bytes(addr: NDArray[np.uint64], lens: NDArray[np.uint64]) -> bytes:
    """Encode rows as interleaved little-endian ``uint64`` pairs."""
    return np.stack([addr, lens], axis=1).astype("<u8").tobytes()


def rows_from_bytes(data: object) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
    """Decode rows; raise MalformedMessageError on a bad length or zero-length rows."""
    if not isinstance(data, bytes) or len(data) % 16:
        raise MalformedMessageError("row list must be bytes holding (addr, len) uint64 pairs")
    pairs = np.frombuffer(data, dtype="<u8").reshape(-1, 2).astype(np.uint64)
    if pairs.shape[0] == 0 or not pairs[:, 1].all():
        raise MalformedMessageError("row list is empty or holds zero-length rows")
    return pairs[:, 0].copy(), pairs[:, 1].copy()
