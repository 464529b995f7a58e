"""The control channel: framed messages between managers over ZeroMQ.

Each manager binds one PULL socket (its *endpoint*, published through bootstrap and the
handshake) and keeps one PUSH socket per peer endpoint for what it tells them ("tell" is
kvwire's verb for a control message, as in :meth:`KVManager.tell
<kvwire.session.KVManager.tell>`; "send" is for KV). Every message is queued without blocking,
bounded by the socket's high-water mark: a dead or slow peer costs a dropped message
(counted), never a blocked thread. Sockets to an evicted peer are closed with linger 0.

Why ZeroMQ and not a socket layer of our own: PULL fair-queues between its connected peers (a
flooding connection cannot starve the others), sends never block with ``NOBLOCK`` + HWM, and a
socket monitor reports when the TCP connection to a peer closes, which is how a dead peer is
seen before its heartbeats run out.

Peers on this host's network namespace get the frames over a UNIX socket instead, once the
handshake has told each side the other's local name (:mod:`kvwire.control.local_way`: fewer
threads crossed, the same frames, order and bounds).

Threads and locks:

* :meth:`ControlChannel.receive`, :meth:`lost_endpoints` and :meth:`take_unsigned` are called
  only by the manager's liveness thread (it owns the PULL socket).
* :meth:`ControlChannel.tell`, :meth:`tell_once` and :meth:`disconnect` may be called from
  any thread. The PUSH
  sockets and their monitors are guarded by ``_lock`` (ZeroMQ sockets must not be used by two
  threads at once); the lock is held only for a non-blocking send or a socket operation, never
  across a wait.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections import Counter

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvwire.control.freshness import FreshnessError
from kvwire.control.local_way import LocalInbox, LocalOutbox, SendResult
from kvwire.control.reach import keep_alive, readable
from kvwire.control.wire import Codec, Message
from kvwire.errors import ConfigError, ProtocolError
from kvwire.security import warn_if_exposed

logger = logging.getLogger(__name__)

#: Frames taken from the PULL socket per :meth:`ControlChannel.receive` call: the liveness
#: thread beats and checks peers between batches however many frames wait.
MAX_FRAMES_PER_RECEIVE = 256
#: A connection to a peer that closed and did not come back within this is reported lost
#: (ZeroMQ retries every 100 ms; a live peer reconnects well within it).
LOST_GRACE_S = 0.3
#: Drop warnings are logged once per reason, then at most once per this many seconds.
DROP_LOG_PERIOD_S = 5.0
#: Unsigned answers kept for the handshake to explain a missing secret.
UNSIGNED_KEPT = 64
_UNSIGNED_KINDS = frozenset({"hello", "hello_ack", "hello_reject"})
_MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


def drop_reason(exc: ProtocolError) -> str:
    """The counter name of a refused frame."""
    if isinstance(exc, FreshnessError):
        return exc.reason
    text = str(exc)
    if "authentic" in text:
        return "unauthenticated"
    if "protocol" in text:
        return "version"
    return "malformed"


class ControlChannel:
    """One manager's control endpoint and its connections to peers."""

    def __init__(
        self,
        codec: Codec,
        host: str = "127.0.0.1",
        send_hwm: int = 1000,
        local: bool = True,
        agent: str = "",
    ) -> None:
        self.codec = codec
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, 16 << 20)
        keep_alive(self._pull)  # a peer's connection left open by a partition is closed
        try:
            port = self._pull.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise ConfigError(
                f"cannot bind the control endpoint on {host!r}: {exc}; set control_host to an "
                "address of this machine"
            ) from exc
        self.endpoint = f"tcp://{host}:{port}"
        warn_if_exposed("control endpoint", host, codec.authenticated)
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        #: The local way (``ControlOptions.local_control``): this channel's inbox, and its
        #: connections to peers' inboxes (under ``_lock``).
        self._inbox: LocalInbox | None = None
        self._outbox = LocalOutbox(agent or self.endpoint)
        if local:
            inbox = LocalInbox(agent or self.endpoint)
            if inbox.name is not None:
                self._inbox = inbox
                self._poller.register(inbox.fileno(), zmq.POLLIN)
        self._hwm = send_hwm
        self._push: dict[str, zmq.Socket[bytes]] = {}
        self._monitors: dict[str, zmq.Socket[bytes]] = {}
        self._down_since: dict[str, float] = {}
        self._lock = threading.Lock()
        self._closed = False
        #: Frames dropped, by reason ("unauthenticated", "malformed", "version", "send_full",
        #: and with a secret "replayed" and "stale").
        self.dropped: Counter[str] = Counter()
        self._last_log: dict[str, float] = {}
        self._unsigned: collections.deque[Message] = collections.deque(maxlen=UNSIGNED_KEPT)

    # ------------------------------------------------------------------ local way
    @property
    def local_name(self) -> str:
        """This channel's local control name, announced in the handshake ("" when the local
        way is off here)."""
        inbox = self._inbox
        return inbox.name or "" if inbox is not None else ""

    def set_local(self, endpoint: str, name: str) -> bool:
        """After the handshake with the peer at ``endpoint`` (which announced local name
        ``name``; "" for none): send later frames to it the local way if it is reachable so;
        True if they go that way. Called by a handshake's last step on each side, after the
        handshake's own frames were told (decode: on the prefill rank's ``hello_ack``;
        prefill: once it told its ``hello_ack``). Any thread."""
        with self._lock:
            if self._closed:
                return False
            if not name or self._inbox is None:  # off here: both ways stay ZeroMQ
                self._outbox.forget(endpoint)
                return False
            return self._outbox.connect(endpoint, name)

    @property
    def local_counts(self) -> dict[str, int]:
        """Frames told the local way, peers it was left for, and connections open to this
        channel's inbox (tests and benchmarks). Any thread; approximate while telling."""
        inbox = self._inbox
        return {
            "sent": self._outbox.sent,
            "left": self._outbox.left,
            "inbound": inbox.connections if inbox is not None else 0,
        }

    # ------------------------------------------------------------------ telling
    def tell(self, endpoint: str, msg: Message) -> bool:
        """Queue control message ``msg`` for ``endpoint`` without blocking; False if it had to
        be dropped. Any thread."""
        frame = self.codec.encode(msg, to=endpoint)
        with self._lock:
            if self._closed:
                return False
            way = self._outbox.send(endpoint, frame)
            if way == SendResult.SENT:
                return True
            if way == SendResult.FULL:  # the local way's queue is full: dropped, as at HWM
                self.dropped["send_full"] += 1
            else:  # ZeroMQ: no local way to this peer, or it was just left
                sock = self._push.get(endpoint)
                if sock is None:
                    sock = self._ctx.socket(zmq.PUSH)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.setsockopt(zmq.SNDHWM, self._hwm)
                    sock.setsockopt(zmq.IMMEDIATE, 0)
                    keep_alive(sock)
                    self._monitors[endpoint] = sock.get_monitor_socket(_MONITOR_EVENTS)
                    sock.connect(endpoint)
                    self._push[endpoint] = sock
                try:
                    sock.send(frame, zmq.NOBLOCK)
                    return True
                except zmq.Again:
                    self.dropped["send_full"] += 1
        self._log_drop("send_full", f"control send to {endpoint} dropped: its queue is full")
        return False

    def tell_once(self, endpoint: str, msg: Message, linger_s: float = 0.5) -> None:
        """Tell ``msg`` on a socket of its own that is closed right away (ZeroMQ still tries to
        deliver it for ``linger_s``): for answers to strangers (an unsigned hello), whose
        endpoint may not exist, so that no socket or monitor is kept for them. Any thread."""
        frame = self.codec.encode(msg, to=endpoint)
        with self._lock:
            if self._closed:
                return
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 1)
            try:
                sock.connect(endpoint)
                sock.send(frame, zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                logger.debug("one-shot send to %s failed: %s", endpoint, exc)
            finally:
                sock.close(linger=int(linger_s * 1000))

    # session/ still calls the old names (the redesign branch restructures it): these go once
    # its call sites say tell/tell_once (manager.py, prefill_links.py).
    def disconnect(self, endpoint: str) -> None:
        """Close the socket to an evicted peer (pending frames are discarded). Any thread."""
        with self._lock:
            self._outbox.forget(endpoint)
            sock = self._push.pop(endpoint, None)
            mon = self._monitors.pop(endpoint, None)
            self._down_since.pop(endpoint, None)
            if sock is not None:
                sock.disable_monitor()
                sock.close(linger=0)
            if mon is not None:
                mon.close(linger=0)

    # ---------------------------------------------------------------- receiving
    @staticmethod
    def _poll_ms(timeout_s: float) -> int:
        """The poller's timeout for ``timeout_s`` (it takes whole milliseconds)."""
        return max(0, int(timeout_s * 1000))

    @classmethod
    def timeout_granted(cls, timeout_s: float) -> float:
        """How long :meth:`receive` waits for ``timeout_s`` when no frame comes."""
        return cls._poll_ms(timeout_s) / 1000

    def receive(self, timeout_s: float, max_frames: int = MAX_FRAMES_PER_RECEIVE) -> list[Message]:
        """The messages that wait, waiting at most ``timeout_s`` for the first: up to
        ``max_frames`` from ZeroMQ, then every frame queued on the local way (handled first:
        :mod:`~kvwire.control.local_way`'s order rule). Malformed, unauthenticated and
        wrong-version frames are dropped and counted (logged at most once per
        :data:`DROP_LOG_PERIOD_S` per reason). Liveness thread only."""
        zmq_frames: list[bytes] = []
        if not self._poller.poll(self._poll_ms(timeout_s)):
            return []
        pull = self._pull
        for _ in range(max_frames):
            # ask whether a frame waits rather than let an empty recv raise (an exception
            # per turn costs more than the question)
            if not readable(pull):
                break
            try:
                zmq_frames.append(pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
        out: list[Message] = []
        inbox = self._inbox
        if inbox is not None:
            # after ZeroMQ's batch, and handled before it: a peer that left the local way
            # queued its local frames before its first ZeroMQ one (local_way's order rule)
            frames, oversized = inbox.drain()
            for frame in frames:
                self._decode_into(out, frame)
            if oversized:
                self.dropped["malformed"] += oversized
                self._log_drop("malformed", "dropped a local control frame above its size limit")
        for frame in zmq_frames:
            self._decode_into(out, frame)
        return out

    def _decode_into(self, out: list[Message], frame: bytes) -> None:
        """Decode one received frame into ``out``, or drop and count it. Liveness thread."""
        try:
            out.append(self.codec.decode(frame, to=self.endpoint))
        except ProtocolError as exc:
            reason = drop_reason(exc)
            self.dropped[reason] += 1
            if "sent no MAC" in str(exc):
                self._keep_unsigned(frame)
            self._log_drop(reason, f"dropped a control frame ({reason}): {exc}")

    def _keep_unsigned(self, frame: bytes) -> None:
        msg = self.codec.decode_unverified(frame, _UNSIGNED_KINDS)
        if msg is not None:
            self._unsigned.append(msg)

    def take_unsigned(self) -> list[Message]:
        """Handshake messages that arrived without the MAC this side requires (never acted on
        as if authentic: the session uses them only to explain a handshake failure, e.g. a
        secret set on one side only). Liveness thread only."""
        out = list(self._unsigned)
        self._unsigned.clear()
        return out

    def _log_drop(self, reason: str, text: str) -> None:
        now = time.monotonic()
        last = self._last_log.get(reason)
        if last is not None and now - last < DROP_LOG_PERIOD_S:
            return
        self._last_log[reason] = now
        logger.warning("%s (%d dropped so far for this reason)", text, self.dropped[reason])

    # -------------------------------------------------------------- connections
    def lost_endpoints(self, now: float | None = None) -> list[str]:
        """Peer endpoints whose TCP connection closed and did not come back within
        :data:`LOST_GRACE_S`: the peer process is gone (the OS closed its socket). Liveness
        thread; cheap (non-blocking reads of the socket monitors)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for ep, mon in self._monitors.items():
                while readable(mon):
                    try:
                        raw = mon.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    except zmq.ZMQError:
                        break
                    event = parse_monitor_message(raw)["event"]
                    if event == zmq.EVENT_DISCONNECTED:
                        self._down_since.setdefault(ep, now)
                    elif event == zmq.EVENT_CONNECTED:
                        self._down_since.pop(ep, None)
            return [ep for ep, t in self._down_since.items() if now - t > LOST_GRACE_S]

    def close(self, flush_s: float = 0.2) -> None:
        """Close every socket, giving queued frames (a goodbye) ``flush_s`` to leave; idempotent.
        Called by the manager after its threads stopped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._outbox.close()
            socks = list(self._push.values())
            mons = list(self._monitors.values())
            self._push.clear()
            self._monitors.clear()
        for s in socks:
            s.disable_monitor()
            s.close(linger=int(flush_s * 1000))
        for mon in mons:
            mon.close(linger=0)
        self._pull.close(linger=0)
        if self._inbox is not None:
            self._inbox.close()
        self._ctx.term()
