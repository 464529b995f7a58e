"""The NIXL backend's notification inbox: what ``get_new_notifs`` returned, kvwire's own
notifications kept (tagged with :data:`NOTIF_TAG`), others counted and dropped.

Owned by :class:`~kvwire_nixl.backend.NixlBackend`; filled by its owner loop's
``progress()`` and by ``get_notifications()``, from any thread (the deque is thread-safe;
the foreign count is guarded by the backend's bookkeeping lock, passed in).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from typing import Any

from kvwire.backend import Notification
from kvwire_nixl.agent import describe

logger = logging.getLogger(__name__)

#: First byte of every notification kvwire posts through NIXL ("k").
NOTIF_TAG = b"\x6b"


class Inbox:
    """Buffered notifications of one agent."""

    def __init__(self, agent_name: str, state: threading.Lock) -> None:
        self.agent_name = agent_name
        self._state = state
        self.notes: collections.deque[Notification] = collections.deque()
        #: progress() just drained NIXL: the get_notifications() after it does not again.
        self.just_drained = False
        #: Notifications dropped because they did not come from kvwire (no tag).
        self.foreign = 0

    def drain(self, agent: Any, serial: contextlib.AbstractContextManager[Any]) -> None:
        """Ask NIXL for new notifications (one call, under ``serial``) and buffer them."""
        try:
            with serial:
                got = agent.get_new_notifs()
        except Exception as exc:
            logger.warning("%s: NIXL get_new_notifs failed: %s", self.agent_name, describe(exc))
            return
        foreign = 0
        for peer, msgs in got.items():
            name = peer.decode() if isinstance(peer, bytes) else str(peer)
            for m in msgs:
                payload = bytes(m)
                if payload[:1] == NOTIF_TAG:
                    self.notes.append(Notification(name, payload[1:]))
                else:
                    foreign += 1
                    logger.debug(
                        "%s: dropped a non-kvwire notification from %s", self.agent_name, name
                    )
        if foreign:
            with self._state:
                self.foreign += foreign

    def take(self) -> list[Notification]:
        """Every buffered notification, oldest first."""
        out = []
        while True:
            try:
                out.append(self.notes.popleft())
            except IndexError:
                return out
