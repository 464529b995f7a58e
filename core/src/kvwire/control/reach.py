"""Whether an advertised endpoint can be reached by the peer it is given to.

A rank advertises ``tcp://{control.host}:{port}``. Across hosts, a loopback address names a
different machine on each side, so a rank that advertises one (the default ``control.host``)
is unreachable from a peer on another host: messages are queued for an address where nothing
listens and the other side waits until a timeout. :func:`loopback_problem` catches that at
handshake, on the decode rank, from what it already knows: the prefill rank's endpoint, the
address its bootstrap service answered on, and its own endpoint. "Another host" means an
address that is not one of this host's own (it cannot be bound here), so a single-host setup
that mixes loopback and interface addresses keeps working.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from typing import Any
from urllib.parse import urlsplit

import zmq

#: How to fix it, for error messages.
FIX = "--control-option host=ADDR, or KVWIRE_CONTROL__HOST=ADDR"


def endpoint_host(endpoint: str) -> str:
    """The host part of ``tcp://host:port`` or ``host:port`` (brackets of IPv6 removed)."""
    url = urlsplit(endpoint if "://" in endpoint else f"tcp://{endpoint}")
    return url.hostname or ""


def is_loopback(host: str) -> bool:
    """``127.0.0.0/8``, ``::1`` or ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_local(host: str) -> bool:
    """Whether ``host`` is an address of this host (this network namespace): it can be bound.
    Loopback and wildcard addresses count as local; a name that does not resolve does not."""
    if is_loopback(host) or host in ("0.0.0.0", "::", "*", ""):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((addr[0], 0))
            return True
    return False


def loopback_problem(own: str, peer: str, peer_name: str, bootstrap_addr: str) -> str | None:
    """Decode side, before a handshake: why prefill rank ``peer_name`` (control endpoint
    ``peer``, listed by the bootstrap service at ``bootstrap_addr``) and this rank (``own``)
    cannot reach each other because one of them advertises loopback to the other host; None
    when nothing is wrong that this can tell."""
    own_host, peer_host = endpoint_host(own), endpoint_host(peer)
    boot_host = endpoint_host(bootstrap_addr)
    if is_loopback(peer_host) and not is_local(boot_host):
        return (
            f"prefill rank {peer_name} advertises its control endpoint {peer} on loopback, but "
            f"its bootstrap service at {bootstrap_addr} is on another host, so this decode rank "
            f"cannot reach it: set control.host on prefill to an address decode can reach ({FIX})"
        )
    if is_loopback(own_host) and not is_local(peer_host):
        return (
            f"this decode rank advertises its control endpoint {own} on loopback to prefill "
            f"rank {peer_name} at {peer} on another host, which cannot answer it there: set "
            f"control.host on decode to an address of this host that prefill can reach ({FIX})"
        )
    return None


def connect_problem(endpoint: str, timeout_s: float = 2.0) -> str | None:
    """Why a TCP connection to ``endpoint`` (``tcp://host:port`` or ``host:port``) cannot be
    opened from here now (refused, no route, interface down, silence for ``timeout_s``), or
    None when one opens (it is closed at once; nothing is sent). Blocks up to ``timeout_s``.
    Used by backends whose data endpoint is a TCP listener to tell, at handshake and before a
    failover probe reconnects, whether the path to the peer works at all."""
    url = urlsplit(endpoint if "://" in endpoint else f"tcp://{endpoint}")
    if url.hostname is None or url.port is None:
        return f"endpoint {endpoint!r} is not host:port"
    try:
        with socket.create_connection((url.hostname, url.port), timeout=timeout_s):
            return None
    except OSError as exc:
        why = "no answer" if isinstance(exc, TimeoutError) else str(exc)
        return f"its data endpoint {endpoint} cannot be reached from here ({why})"


#: TCP keepalive of kvwire's ZeroMQ sockets: a connection silent this long is probed, every
#: ``KEEPALIVE_INTVL_S`` after, and closed after ``KEEPALIVE_CNT`` unanswered probes (or at
#: once when the far end answers that it no longer knows the connection).
KEEPALIVE_IDLE_S = 10
KEEPALIVE_INTVL_S = 5
KEEPALIVE_CNT = 3


def keep_alive(sock: zmq.Socket[Any]) -> None:
    """Turn TCP keepalive on for a ZeroMQ socket's connections (call before bind/connect;
    accepted connections take it too). Without it a connection whose far end closed during a
    network partition, its FIN lost and retried by the far kernel for less than the
    partition lasted, stays ESTABLISHED here for good (nothing is ever sent on a PULL's or an
    idle ROUTER's connection): one fd per closed link and partition (docs/integrity.md)."""
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTVL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_CNT)


#: ZeroMQ's poll flags and socket option as plain ints: pyzmq's flag enums make every ``|``
#: and ``&`` on them a Python-level call, several per turn of a polling loop.
POLLIN = int(zmq.POLLIN)
POLLOUT = int(zmq.POLLOUT)
_EVENTS = int(zmq.EVENTS)


def readable(sock: zmq.Socket[Any]) -> bool:
    """Whether a message can be received from ``sock`` now (``ZMQ_EVENTS``): ~2 us, where the
    ``zmq.Again`` an empty non-blocking receive raises costs ~10 us. Loops that receive until
    nothing is left ask this first. A socket in an error state (closed, its context ended)
    reads as not readable, as a receive's ``ZMQError`` did before: the caller skips it and
    goes on with its other sockets."""
    try:
        events = sock.getsockopt(_EVENTS)
    except zmq.ZMQError:
        return False
    return isinstance(events, int) and bool(events & POLLIN)
