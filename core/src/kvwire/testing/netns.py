"""A multi-host test bed out of Linux network namespaces (needs root and iproute2).

:class:`NetnsBed` creates one namespace per node (``prefill``, ``decode``, optionally
``bootstrap``) and a hub namespace holding a bridge; each node is joined to the bridge by a veth
pair and gets its own address (``10.77.0.<n>/24``; the namespaces are private, so parallel beds
reuse the addresses without colliding). Nothing connects the nodes but the bridge: traffic
between them never touches a loopback interface, and :meth:`NetnsBed.partition`,
:meth:`NetnsBed.degrade` and :meth:`NetnsBed.link` act on one node's link (it leaves the
bridge; ``tc netem`` on both ends of its veth pair; the link's state).

``extra_subnets`` gives every node more interfaces, one per subnet (``eth1``, ``eth2``...),
each joined to a bridge of its own in the hub: two networks between the same hosts, so a
test can take one interface down (:meth:`NetnsBed.link` with ``iface``) while the other
carries on, and count what crossed each (:meth:`NetnsBed.iface_bytes`).

Processes join a node with :func:`enter_netns` (``setns(2)`` on ``/var/run/netns/NAME``):
called first thing in a freshly spawned process, before any socket or thread exists, every
socket it opens lives in that namespace. :class:`~kvwire.testing.cluster.Cluster` does this for
its rank processes when :attr:`ClusterSpec.netns` names a namespace per role.
:func:`in_netns` runs one function on a helper thread inside a namespace (setns changes only the
calling thread), e.g. to check that a port is free there.

Cleanup: :meth:`NetnsBed.close` (the context manager's exit, and an ``atexit`` hook) deletes the
namespaces, which deletes their links. Names carry the creating process id (``kvw<pid>x<hex>``),
so a bed whose process was killed is swept by the next bed created on the machine
(:func:`sweep_stale`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Namespace names of every bed start with this, then the creating pid.
PREFIX = "kvw"
_NAME = re.compile(rf"^{PREFIX}(\d+)x[0-9a-f]+-")
_CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"


class NetnsUnavailableError(RuntimeError):
    """Network namespaces cannot be created here (not root, no iproute2, no kernel support)."""


def unavailable_reason() -> str | None:
    """Why a bed cannot be built on this machine, or None when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (run the test bed as root, e.g. in CI)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) is not installed: apt-get install iproute2"
    name = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}-probe"
    try:
        _ip("netns", "add", name)
    except NetnsUnavailableError as exc:
        return f"cannot create a network namespace: {exc}"
    with contextlib.suppress(NetnsUnavailableError):
        _ip("netns", "del", name)
    return None


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)
    if check and proc.returncode != 0:
        why = proc.stderr.strip() or proc.stdout.strip()
        raise NetnsUnavailableError(f"{' '.join(argv)} failed: {why}")
    return proc


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["ip", *args], check=check)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete the namespaces of beds whose creating process is gone (a run that was killed);
    returns their names."""
    proc = _ip("netns", "list", check=False)
    gone = []
    for line in proc.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)
            gone.append(name)
    if gone:
        logger.info("removed %d stale test-bed namespaces: %s", len(gone), ", ".join(gone))
    return gone


_libc: ctypes.CDLL | None = None


def enter_netns(name: str) -> None:
    """Move the calling thread into namespace ``name`` (``setns(2)``). Call it first thing in a
    new process, before opening sockets or starting threads: sockets keep the namespace they
    were created in, and threads started later inherit the caller's."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    path = os.path.join(NETNS_DIR, name)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}) failed: {os.strerror(err)} (needs root)")
    finally:
        os.close(fd)


def in_netns(name: str, fn: Callable[[], T], timeout_s: float = 30.0) -> T:
    """Run ``fn`` on a helper thread inside namespace ``name`` and return its result (the
    calling thread stays where it is)."""
    box: dict[str, object] = {}

    def body() -> None:
        try:
            enter_netns(name)
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=body, name=f"netns-{name}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"function in namespace {name} did not return in {timeout_s}s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


class NetnsBed:
    """Nodes in their own network namespaces, joined by a bridge. Use as a context manager.

    ``nodes``: node names (e.g. ``("prefill", "decode")``); node ``i`` gets address
    ``{subnet}.{i + 1}``. :attr:`ns` maps each node to its namespace name (for
    :attr:`ClusterSpec.netns`), :attr:`addr` to its address. With ``extra_subnets``, node
    ``i`` also gets ``eth{k}`` with address ``{extra_subnets[k - 1]}.{i + 1}`` on a bridge of
    its own (:attr:`addrs` and :attr:`devs` list every interface's, ``eth0``'s first).
    """

    def __init__(
        self,
        nodes: Sequence[str] = ("prefill", "decode"),
        subnet: str = "10.77.0",
        extra_subnets: Sequence[str] = (),
    ):
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsUnavailableError(reason)
        sweep_stale()
        self.tag = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
        self.hub = f"{self.tag}-hub"
        self.ns = {node: f"{self.tag}-{node}" for node in nodes}
        self.addr = {node: f"{subnet}.{i + 1}" for i, node in enumerate(nodes)}
        #: The veth end inside each node's namespace, and its peer on the hub's bridge.
        self.dev = dict.fromkeys(nodes, "eth0")  # every namespace has its own eth0
        self.hub_dev = {node: f"h{i}" for i, node in enumerate(nodes)}
        self.subnets = [subnet, *extra_subnets]
        #: Every interface of each node (index k: ``eth{k}`` on subnet ``subnets[k]``).
        self.addrs = {
            node: [f"{net}.{i + 1}" for net in self.subnets] for i, node in enumerate(nodes)
        }
        self.devs = {node: [f"eth{k}" for k in range(len(self.subnets))] for node in nodes}
        self._closed = False
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for node, ns in self.ns.items():
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            hub_dev, dev = self.hub_dev[node], self.dev[node]
            _ip("-n", self.hub, "link", "add", hub_dev, "type", "veth", "peer", "name", dev,
                "netns", ns)  # fmt: skip
            _ip("-n", self.hub, "link", "set", hub_dev, "master", "br0")
            _ip("-n", self.hub, "link", "set", hub_dev, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr[node]}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        for k in range(1, len(self.subnets)):
            _ip("-n", self.hub, "link", "add", f"br{k}", "type", "bridge")
            _ip("-n", self.hub, "link", "set", f"br{k}", "up")
            for node, ns in self.ns.items():
                hub_dev, dev = f"{self.hub_dev[node]}n{k}", self.devs[node][k]
                _ip("-n", self.hub, "link", "add", hub_dev, "type", "veth", "peer", "name",
                    dev, "netns", ns)  # fmt: skip
                _ip("-n", self.hub, "link", "set", hub_dev, "master", f"br{k}")
                _ip("-n", self.hub, "link", "set", hub_dev, "up")
                _ip("-n", ns, "addr", "add", f"{self.addrs[node][k]}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
        logger.info("test bed %s: %s", self.tag, self.addrs)

    # ------------------------------------------------------------ faults
    def _qdisc(self, node: str, netem: Sequence[str] | None, kind: str = "netem") -> None:
        """Put a ``kind`` qdisc with arguments ``netem`` (or none) on both ends of ``node``'s
        link: a qdisc shapes egress only, so each direction needs its own."""
        for ns, dev in ((self.ns[node], self.dev[node]), (self.hub, self.hub_dev[node])):
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
            if netem:
                _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", kind, *netem])

    def throttle(self, node: str, rate_mbit: float, queue_kb: int = 64) -> None:
        """Limit ``node``'s link to ``rate_mbit`` each way with a token bucket (``tbf``, in
        every kernel, unlike netem) whose queue holds ``queue_kb``: packets beyond it are
        dropped, so a burst larger than the queue loses packets and TCP retransmits (the loss
        of a congested link, not netem's random loss)."""
        burst = max(16, int(rate_mbit * 1000 / 8 / 250))  # KB: about 4 ms at the rate
        args = ["rate", f"{rate_mbit}mbit", "burst", f"{burst}kb", "limit", f"{queue_kb}kb"]
        self._qdisc(node, args, kind="tbf")

    def partition(self, node: str) -> None:
        """Cut ``node`` off silently: its veth's hub end leaves the bridge, so every packet to
        and from it is dropped while both links stay up (peers see silence, as across a failed
        switch; no reset, no unreachable error). Works without netem."""
        _ip("-n", self.hub, "link", "set", self.hub_dev[node], "nomaster")

    def netem_reason(self) -> str | None:
        """Why ``tc netem`` cannot be used here (kernel without ``sch_netem``), or None."""
        node = next(iter(self.ns))
        argv = ["tc", "-n", self.ns[node], "qdisc", "add", "dev", self.dev[node], "root"]
        proc = _run([*argv, "netem", "delay", "1ms"], check=False)
        if proc.returncode != 0:
            return f"tc netem is unavailable here ({proc.stderr.strip()}): kernel lacks sch_netem"
        self._qdisc(node, None)
        return None

    def degrade(
        self, node: str, delay_ms: float = 20.0, loss_pct: float = 1.0, reorder_pct: float = 0.0
    ) -> None:
        """Delay, lose and reorder packets to and from ``node`` (each direction; needs netem,
        see :meth:`netem_reason`)."""
        args = ["delay", f"{delay_ms}ms", "loss", f"{loss_pct}%"]
        if reorder_pct:
            args += ["reorder", f"{reorder_pct}%", "50%"]
        self._qdisc(node, args)

    def heal(self, node: str) -> None:
        """Undo :meth:`partition`, :meth:`degrade`, :meth:`throttle` and :meth:`link` on
        ``node``'s link."""
        _ip("-n", self.hub, "link", "set", self.hub_dev[node], "master", "br0")
        _run(["tc", "-n", self.ns[node], "qdisc", "del", "dev", self.dev[node], "root"], False)
        _run(["tc", "-n", self.hub, "qdisc", "del", "dev", self.hub_dev[node], "root"], False)
        self.link(node, up=True)

    def link(self, node: str, up: bool, iface: int = 0) -> None:
        """Set ``node``'s link (its veth end ``eth{iface}`` in the namespace) up or down."""
        dev = self.devs[node][iface]
        _ip("-n", self.ns[node], "link", "set", dev, "up" if up else "down")

    def iface_bytes(self, node: str, iface: int = 0) -> int:
        """Bytes sent plus received so far by ``node``'s interface ``eth{iface}`` (the
        kernel's counters: what actually crossed that network)."""
        out = _ip("-n", self.ns[node], "-j", "-s", "link", "show", "dev", self.devs[node][iface])
        stats = json.loads(out.stdout)[0]["stats64"]
        return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])

    def exec(self, node: str, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        """Run a command inside ``node``'s namespace (``ip netns exec``)."""
        return _run(["ip", "netns", "exec", self.ns[node], *argv], check=False)

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Delete every namespace of the bed (their links go with them); idempotent."""
        if self._closed:
            return
        self._closed = True
        for ns in [*self.ns.values(), self.hub]:
            _ip("netns", "del", ns, check=False)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)

    def __enter__(self) -> NetnsBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def netns_bed(nodes: Sequence[str] = ("prefill", "decode")) -> Iterator[NetnsBed]:
    """``with netns_bed() as bed: ...``; the namespaces are gone afterwards."""
    bed = NetnsBed(nodes)
    try:
        yield bed
    finally:
        bed.close()
