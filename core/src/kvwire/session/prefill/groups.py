"""Prefill's half of buffer groups (:mod:`kvwire.session.groups` has the checks both sides
share): decode's group slots from its transfer request (liveness thread) and the rows of one
request's group transfer (transfer workers)."""

from __future__ import annotations

import numpy as np

from kvwire.control.wire import TransferRequest
from kvwire.descriptors import IndexArray
from kvwire.errors import ConfigError
from kvwire.index.groups import GroupMapper
from kvwire.integrity import LayerSums
from kvwire.session.groups import Indices, check_state_indices, from_wire
from kvwire.session.prefill.links import GROUPS_TABLE, DecodeLink
from kvwire.session.prefill.rooms import Dest, SendRoom

__all__ = ["GROUPS_TABLE", "group_rows", "group_sums", "request_groups"]


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


def group_sums(link: DecodeLink, rows: tuple[IndexArray, IndexArray]) -> LayerSums | None:
    """Transfer worker, before a request's group transfer to ``link``'s decode rank is
    posted: the sums of its rows when decode checks them (``kv_checksum``, protocol 1.14:
    :mod:`kvwire.session.group_sums`), else None."""
    if link.group_sums is None:
        return None
    return link.group_sums.sums(*rows)
