"""What holds the fds a soak's ranks gain around network partitions (issue 26 item 4).

Runs :func:`kvwire.testing.soak.run_soak` (``--netns``, root) and, after every batch and then
every ``--settle-step`` seconds for ``--settle`` seconds once the last batch ended (before
the cluster is torn down), lists each rank's fds by kind: TCP sockets by state (from the
rank's own network namespace, ``/proc/<pid>/net/tcp``), unix sockets, pipes, eventfds,
epoll and other files. Prints, per role, the counts after the first batch, after the last
one and at the end of the settling time::

    python scripts/soak_fd_probe.py --requests 960 --batch 40 --fault-every 2 \\
        --faults partition --settle 40 --json /tmp/fd_probe.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from typing import Any

from kvwire.testing import soak
from kvwire.testing import soak_ledger as ledger

TCP_STATES = {
    "01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1",
    "05": "FIN_WAIT2", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT",
    "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING",
}  # fmt: skip


def fd_kinds(pid: int) -> dict[str, int] | None:
    """One process's fds by kind (None if it is gone)."""
    try:
        links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except (FileNotFoundError, ProcessLookupError):
        return None
    tcp: dict[str, str] = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as f:
                for line in f.readlines()[1:]:
                    cols = line.split()
                    tcp[cols[9]] = TCP_STATES.get(cols[3], cols[3])
        except FileNotFoundError:
            pass
    out: collections.Counter[str] = collections.Counter()
    for link in links:
        if link.startswith("socket:["):
            inode = link[8:-1]
            out["tcp:" + tcp[inode] if inode in tcp else "socket:other"] += 1
        elif link.startswith("pipe:"):
            out["pipe"] += 1
        elif link.startswith("anon_inode:"):
            out[link[len("anon_inode:") :].strip("[]")] += 1
        else:
            out["file"] += 1
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=960)
    ap.add_argument("--batch", type=int, default=40)
    ap.add_argument("--fault-every", type=int, default=2)
    ap.add_argument("--faults", default="partition")
    ap.add_argument("--silence", type=float, default=4.5, help="how long a partition lasts (s)")
    ap.add_argument("--settle", type=float, default=40.0)
    ap.add_argument("--settle-step", type=float, default=5.0)
    ap.add_argument("--json")
    a = ap.parse_args()
    records: list[dict[str, Any]] = []
    t0 = time.monotonic()

    def record(c: Any, label: str) -> None:
        for p in c.procs:
            if p.proc.is_alive():
                kinds = fd_kinds(p.proc.pid)
                if kinds is not None:
                    records.append(
                        {"t": round(time.monotonic() - t0, 1), "at": label, "rank": p.name,
                         "pid": p.proc.pid, "fds": sum(kinds.values()), "kinds": kinds}
                    )  # fmt: skip

    original_sample, original_leftover = soak.sample_all, soak._leftover

    def sample_all(c: Any, batch: int) -> list[ledger.Sample]:
        record(c, f"batch {batch}")
        return original_sample(c, batch)

    def leftover(c: Any, timeout_s: float = 15.0) -> Any:
        end = time.monotonic() + a.settle
        while time.monotonic() < end:
            time.sleep(a.settle_step)
            record(c, f"settle {a.settle - (end - time.monotonic()):.0f}s")
        return original_leftover(c, timeout_s)

    soak.sample_all, soak._leftover = sample_all, leftover  # type: ignore[assignment]
    spec = soak.SoakSpec(
        requests=a.requests, batch=a.batch, fault_every=a.fault_every,
        faults=tuple(a.faults.split(",")), netns=True, silence_s=a.silence,
    )  # fmt: skip
    report = soak.run_soak(spec)
    print(report.summary())
    labels = sorted({r["at"] for r in records}, key=lambda s: [r["at"] for r in records].index(s))
    first, last_batch = labels[0], [x for x in labels if x.startswith("batch")][-1]
    for label in (first, last_batch, labels[-1]):
        by_role: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for r in records:
            if r["at"] == label:
                role = r["rank"].rsplit("-tp", 1)[0]
                by_role[role].update(r["kinds"])
                by_role[role]["total"] += r["fds"]
        print(label, {k: dict(v) for k, v in by_role.items()})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"records": records, "faults": [vars(f) for f in report.faults]}, f, default=str
            )


if __name__ == "__main__":
    main()
