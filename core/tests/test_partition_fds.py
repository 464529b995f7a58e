"""A connection whose far end closed during a network partition is closed here too.

The soak found ranks holding more fds after partitions: connections to peers that the other
side closed while the network was cut (its FIN lost) stay ESTABLISHED on the side that never
sends on them (a control PULL, an idle tcp ROUTER) once the far kernel stops retrying the FIN.
kvwire's ZeroMQ sockets turn TCP keepalive on (``kvwire.control.reach.keep_alive``), so such
a connection is probed and closed. Two network namespaces (needs root; skipped with the
reason elsewhere); the far side's FIN retries are cut to one (``tcp_orphan_retries``) and
the keepalive timers to a second, so that the test takes seconds, not minutes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from kvwire.control import reach
from kvwire.control.channel import ControlChannel
from kvwire.control.wire import Codec
from kvwire.testing.netns import NetnsBed, in_netns, unavailable_reason


@pytest.fixture
def bed() -> Iterator[NetnsBed]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with NetnsBed(("here", "far")) as b:
        yield b


def _established(bed: NetnsBed, node: str, port: int) -> int:
    """ESTABLISHED TCP connections on local port ``port`` in ``node``'s namespace."""
    out = bed.exec(node, ["cat", "/proc/net/tcp"]).stdout.splitlines()[1:]
    return sum(
        1
        for line in out
        if int(line.split()[1].split(":")[1], 16) == port and line.split()[3] == "01"
    )


def _wait(cond: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.2)
    return False


def test_a_peer_connection_closed_during_a_partition_is_closed_here(
    bed: NetnsBed, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reach, "KEEPALIVE_IDLE_S", 1)
    monkeypatch.setattr(reach, "KEEPALIVE_INTVL_S", 1)
    monkeypatch.setattr(reach, "KEEPALIVE_CNT", 2)
    bed.exec("far", ["sysctl", "-qw", "net.ipv4.tcp_orphan_retries=1"])
    chan = in_netns(bed.ns["here"], lambda: ControlChannel(Codec(), bed.addr["here"]))
    port = int(chan.endpoint.rsplit(":", 1)[1])
    ctx = in_netns(bed.ns["far"], zmq.Context)
    try:
        push = in_netns(bed.ns["far"], lambda: ctx.socket(zmq.PUSH))
        push.connect(chan.endpoint)
        push.send(b"hello")
        assert _wait(lambda: _established(bed, "here", port) == 1, 20), "never connected"
        bed.partition("far")
        push.close(linger=0)  # its FIN is lost; the far kernel gives up on it
        assert _wait(lambda: not _orphans(bed), 30), "the far side still retries its FIN"
        bed.heal("far")
        # the connection is gone on the far side only: here it is closed by the keepalive
        assert _wait(lambda: _established(bed, "here", port) == 0, 30), (
            "the connection from a peer that closed during the partition is still open"
        )
    finally:
        ctx.destroy(linger=0)
        chan.close()


def _orphans(bed: NetnsBed) -> bool:
    """Any TCP connection still known to the far namespace's kernel (a FIN being retried)."""
    lines = bed.exec("far", ["cat", "/proc/net/tcp"]).stdout.splitlines()[1:]
    return any(line.split()[3] != "0A" for line in lines)
