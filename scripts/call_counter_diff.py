"""Python calls per request and thread from two runs' counts (``scripts/call_counter.py``).

    python3 scripts/call_counter_diff.py DIR_A DIR_B N [THREAD]

DIR_A and DIR_B hold the per-process counts of two runs that differ only in their number of
timed requests, N apart: the difference divided by N is what one request costs. Rank processes
are told apart by their threads' names (prefill or decode; of several, the busiest); worker
threads (``...-w<k>``) count as one ``worker``. With THREAD, the functions of the threads whose
name contains it, most calls first (``*``: every thread).
"""

from __future__ import annotations

import collections
import glob
import json
import re
import sys

Counts = tuple[collections.Counter[str], collections.Counter[tuple[str, str]]]


def _norm(thread: str) -> str:
    if re.search(r"-w\d+$", thread):
        return "worker"
    return re.sub(r"(kvwire-[a-z]+).*", r"\1", thread)


def load(folder: str) -> dict[str, Counts]:
    """Per role, the busiest process's calls per thread and per (thread, function)."""
    procs: dict[str, Counts] = {}
    for path in glob.glob(folder + "/cc_*.json"):
        try:
            with open(path) as f:
                j = json.load(f)
        except (OSError, ValueError):
            continue
        names = " ".join(j["threads"])
        role = "prefill" if "prefill" in names else "decode" if "decode" in names else "other"
        per_thread: collections.Counter[str] = collections.Counter()
        per_func: collections.Counter[tuple[str, str]] = collections.Counter()
        for t, n in j["threads"].items():
            per_thread[_norm(t)] += n
        for t, fn, n in j["funcs"]:
            per_func[(_norm(t), fn)] += n
        if role in procs and sum(per_thread.values()) < sum(procs[role][0].values()):
            continue
        procs[role] = (per_thread, per_func)
    return procs


def main() -> int:
    a, b, k = load(sys.argv[1]), load(sys.argv[2]), float(sys.argv[3])
    want = sys.argv[4] if len(sys.argv) > 4 else None
    for role in ("prefill", "decode"):
        if role not in a or role not in b:
            print(f"== {role}: no counts")
            continue
        (ta, fa), (tb, fb) = a[role], b[role]
        total = (sum(tb.values()) - sum(ta.values())) / k
        print(f"== {role}: {total:.1f} calls per request; by thread")
        for t in sorted(set(ta) | set(tb), key=lambda t: -(tb[t] - ta[t])):
            d = (tb[t] - ta[t]) / k
            if abs(d) >= 1:
                print(f"  {d:8.1f}  {t}")
        if want:
            print(f"  -- functions of threads matching {want!r}")
            diffs: collections.Counter[str] = collections.Counter()
            for key in set(fa) | set(fb):
                if want == "*" or want in key[0]:
                    diffs[f"{key[0][:12]:<12} {key[1]}"] += (fb[key] - fa[key]) / k
            for fn, d in diffs.most_common(60):
                if d >= 0.5:
                    print(f"    {d:7.1f} {fn}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
