"""Each thread's share of wall time holding the GIL, from py-spy's raw output.

    python3 scripts/spy_gil_share.py SPY_FILE... [--slots N]

SPY_FILE: ``py-spy record --gil --threads -f raw`` of one process (``scripts/gpu_gil_spy.sh``
with ``SPY_FLAGS="--gil --threads"``). With ``--gil`` py-spy keeps only the samples in which
some thread held the GIL, so a thread's samples over the sample slots (rate x duration:
400 Hz x 5 s = 2,000 in gpu_gil_spy.sh) is the share of wall time it held the GIL, and the
sum over threads is the process's GIL occupancy (a lower bound if py-spy fell behind).
"""

from __future__ import annotations

import argparse
import collections


def shares(path: str, slots: int) -> dict[str, float]:
    """Thread name -> share of the ``slots`` sample slots in which it held the GIL."""
    per: collections.Counter[str] = collections.Counter()
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if not stack:
                continue
            per[stack.split(";")[0].split(": ", 1)[-1]] += int(n)
    return {t: n / slots for t, n in per.most_common()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("files", nargs="+")
    p.add_argument("--slots", type=int, default=2000)
    a = p.parse_args()
    for path in a.files:
        s = shares(path, a.slots)
        print(f"{path}: GIL held {sum(s.values()):.0%} of the time")
        for t, v in s.items():
            print(f"  {v:6.1%}  {t}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
