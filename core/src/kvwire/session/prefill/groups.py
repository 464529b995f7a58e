"""Prefill's half of buffer groups (:mod:`kvwire.session.groups` has the checks both sides
share): decode's group slots from its transfer request (liveness thread), and the rows and
the note of one request's group transfer (transfer workers)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np

from kvwire.control.wire import ChunkNote, Codec, TransferRequest
from kvwire.descriptors import IndexArray
from kvwire.errors import ConfigError
from kvwire.index.groups import GroupMapper
from kvwire.integrity import LayerSums
from kvwire.session.groups import Indices, check_state_indices, from_wire
from kvwire.session.prefill.links import GROUPS_TABLE, DecodeLink
from kvwire.session.prefill.posting import summer
from kvwire.session.prefill.rooms import Dest, SendRoom

__all__ = ["GROUPS_TABLE", "group_rows", "request_groups", "state_note"]


def request_groups(groups: GroupMapper | None, msg: TransferRequest) -> Indices:
    """Liveness thread, prefill: decode's group slots from its transfer request, checked
    against decode's layout (``groups.dst``). Raises ``ConfigError``/``DescriptorError``."""
    if msg.state_indices:
        raise ConfigError("state_indices is reserved; protocol 1.4 sends group_indices")
    if groups is None:
        if msg.group_indices:
            raise ConfigError("group indices sent, but the layouts have no buffer groups")
        return {}
    if msg.pool != "kv" and "pages" in groups.index_names:
        raise ConfigError(
            "paged buffer groups (e.g. draft layers) use the KV pool's pages; a request into "
            f"decode pool {msg.pool!r} cannot carry them"
        )
    return check_state_indices(groups.dst, from_wire(msg.group_indices), "decode")


def group_rows(
    room: SendRoom, dest: Dest, link: DecodeLink
) -> tuple[IndexArray, IndexArray] | None:
    """Transfer worker, after a request's last KV chunk to ``dest``: the rows of its group
    transfer (state slots, window pages, draft-layer pages; empty when there is nothing to
    move, e.g. a prefix fully cached on decode), or None when this rank moves no group bytes
    to that decode rank (decode then expects no group note from it)."""
    gm = link.groups
    if gm is None or not gm.sends:
        return None
    assert room.num_pages is not None
    src: Indices = dict(room.group_src)
    dst: Indices = dict(dest.group_dst)
    if "pages" in gm.index_names:
        pages = np.concatenate(room.sent_pages) if room.sent_pages else np.empty(0, np.int64)
        skip = room.num_pages - dest.dst_pages.size
        src["pages"] = pages[skip:]
        dst["pages"] = dest.dst_pages
    return gm.map_request(src, dst)


def state_note(
    codec: Codec, fields: dict[str, Any], link: DecodeLink, rows: tuple[IndexArray, IndexArray]
) -> tuple[bytes, Future[LayerSums] | None]:
    """Transfer worker, before a request's group transfer to ``link``'s decode rank is
    posted: its note (``fields``: every field but the sums) and, where its rows are summed
    while they fly, the running sum. Unchecked (no ``kv_checksum``, or a 1.13 decode): the
    note alone. Checked (:mod:`kvwire.session.group_sums`): the note with the rows' sums,
    summed now; or, from the hasher's ``LATE_BYTES`` on, part 0 of 2 without them and the sum
    started on a piece-sum thread (the worker tells its result as part 1)."""
    checked = link.group_sums
    if checked is not None and checked.late(rows[0]):
        return codec.encode(ChunkNote(**fields, parts=2)), summer().submit(checked.sums, *rows)
    note = ChunkNote(**fields)
    sums = checked.sums(*rows) if checked is not None else {}
    if sums:
        note = note.model_copy(update={"sum_layers": list(sums), "sums": list(sums.values())})
    return codec.encode(note), None
