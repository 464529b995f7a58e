"""A decode rank's transfer request, checked on prefill: what it asks for becomes one
destination (:class:`~kvwire.session.prefill.rooms.Dest`) of the request's room.

Called on the liveness thread, under the room lock, by the prefill side; raises a
``KVWireError`` naming what is wrong (the side refuses the request with it, so decode learns
of it at once).
"""

from __future__ import annotations

from kvwire.control.wire import TransferRequest, pages_from_bytes
from kvwire.errors import ConfigError, DescriptorError
from kvwire.index.base import check_pages
from kvwire.session.peers import Peer
from kvwire.session.prefill.groups import request_groups
from kvwire.session.prefill.links import DecodeLink
from kvwire.session.prefill.rooms import Dest


def dest_for(msg: TransferRequest, peer: Peer, aux_slots: int, tp_rank: int) -> Dest:
    """The destination ``msg`` from handshaken ``peer`` asks for: its pool on that decode
    rank, its pages (checked against the pool's slots), its aux row (checked against this
    rank's ``aux_slots``), its buffer-group slots, and the decode ranks one request of
    prefill TP rank ``tp_rank`` feeds (the link's topology)."""
    link: DecodeLink = peer.link
    target = link.pools.get(msg.pool)
    if target is None:
        why = link.pool_problems.get(msg.pool, "no such pool")
        raise ConfigError(f"cannot write into decode pool {msg.pool!r}: {why}")
    pages = check_pages(pages_from_bytes(msg.dst_pages), target.slots, "decode's page indices")
    if not 0 <= msg.aux_index < aux_slots:
        raise DescriptorError(f"decode's aux index {msg.aux_index} is outside [0, {aux_slots})")
    return Dest(
        msg.session,
        peer.endpoint,
        pages,
        msg.aux_index,
        link.topology.fan_out(tp_rank),
        pool=msg.pool,
        group_dst=request_groups(link.groups, msg),
        cached_tokens=msg.cached_tokens,
    )
