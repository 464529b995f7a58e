"""Decode's check of one request's buffer groups from one prefill rank (protocol 1.14).

Built under the room lock when that rank's state note arrives (``RecvRoom.group_check``) on
a link with :class:`~kvwire.session.group_sums.LandedGroupSums`, and run by the decode side's
:class:`~kvwire.session.decode.checker.ChunkChecker` like a KV chunk's check: off the lock,
reading only what it copied out of the room (the note, the room's group slots and
destination pages, never changed once set) and the rank's group rows. A pass counts the
sender's groups as landed (``RecvRoom.groups_from``); a mismatch fails the request naming
the groups and layers that differ and the peer. Rows the request writes with a note that
carries no sums fail it too: a 1.14 prefill that said it sums groups must send them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from kvwire.control.wire import ChunkNote
from kvwire.errors import TransferError
from kvwire.integrity import LayerSums, mismatched_layers
from kvwire.session.decode.links import PrefillLink
from kvwire.session.group_sums import LandedGroupSums, describe_keys
from kvwire.session.report import ChunkFault


class _Groups(Protocol):
    """What a passed check updates: the room's senders whose groups landed."""

    groups_from: set[int]


@dataclass(frozen=True)
class GroupCheck:
    """The check of the group rows one state note says landed (see the module)."""

    room: int
    msg: ChunkNote
    #: The sums the note's parts carried.
    sent: dict[int, int]
    link: PrefillLink
    checksums: LandedGroupSums
    group_dst: Mapping[str, NDArray[np.int64]]
    #: The room's destination pages (a paged group's rows follow them).
    dst_pages: NDArray[np.int64]

    def start(self) -> Callable[[], LayerSums] | None:
        """The checker's launch-first step: group rows are summed in :meth:`run`."""
        return None

    def run(
        self, later: Callable[[], LayerSums] | None = None
    ) -> tuple[TransferError, ChunkFault | None] | None:
        """A checker thread (or the noting thread, for GPU groups), no lock held: sum the
        landed rows and compare with the note's sums. None when they match, else the error
        failing the request."""
        msg, agent = self.msg, self.link.info.agent
        try:
            rows = self.checksums.rows(self.group_dst, self.dst_pages)
            if not np.asarray(rows).size:  # nothing lands here: any sum sent is a mismatch
                landed: LayerSums = {}
            elif not self.sent:
                raise ValueError("its state note carries no checksums, which this rank asked for")
            else:
                landed = self.checksums.sums(rows)
        except Exception as exc:
            err = TransferError(
                f"cannot check the buffer groups from {agent} (sender {msg.sender_id}): {exc}",
                room=self.room,
            )
            return err, None
        bad = mismatched_layers(self.sent, landed)
        if not bad:
            return None
        err = TransferError(
            f"buffer-group checksum mismatch from {agent} (sender {msg.sender_id}): "
            f"{describe_keys(self.checksums.layout, bad)} differ from what it sent",
            room=self.room,
        )
        return err, None

    def landed(self, room: _Groups) -> None:
        """Under the room lock, the check passed: the sender's groups count as landed."""
        room.groups_from.add(self.msg.sender_id)
