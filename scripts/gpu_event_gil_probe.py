"""On a GPU: kvwire.cuda_events against torch's event calls.

1. Correctness: an event recorded by cuda_events behind a long kernel reads "not done" until
   the kernel completes, then "done"; the same from a thread whose current device is another
   GPU (cuda_events falls back to torch's call there).
2. The GIL: beside a thread that runs Python without pause (as an engine's scheduler), time
   N records through torch (which lets go of the GIL around the call) and through
   cuda_events (which keeps it), and N of torch's queries, and count how often the busy
   thread ran meanwhile.

    python3 scripts/gpu_event_gil_probe.py [--n 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from typing import Any

import torch
from busy_gil import BusyThread

from kvwire import cuda_events


def correctness() -> dict[str, Any]:
    s = torch.cuda.Stream()
    ev = torch.cuda.Event()
    ev.record(s)  # torch creates the CUDA event here
    ev.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
    cuda_events.record(ev, s)
    before = bool(ev.query())
    ev.synchronize()
    after = bool(ev.query())
    out: dict[str, Any] = {"before": before, "after": after}
    if torch.cuda.device_count() > 1:  # a thread whose current device is another GPU
        got: dict[str, Any] = {}

        def other() -> None:
            torch.cuda.set_device(1)
            with torch.cuda.stream(s):
                torch.cuda._sleep(200_000_000)
            cuda_events.record(ev, s)  # ev and s are GPU 0's: torch's call
            got["before"] = bool(ev.query())
            ev.synchronize()
            got["after"] = bool(ev.query())

        t = threading.Thread(target=other)
        t.start()
        t.join()
        out["other_device"] = (got["before"], got["after"])
    return out


def gil(n: int) -> dict[str, Any]:
    s = torch.cuda.Stream()
    ev = torch.cuda.Event()
    ev.record(s)
    ev.synchronize()
    res: dict[str, Any] = {}
    with BusyThread() as busy:
        for name, rec, qry in (
            ("torch", lambda: ev.record(s), lambda: ev.query()),
            ("cuda_events", lambda: cuda_events.record(ev, s), None),
        ):
            for what, fn in (("record", rec), ("query", qry)):
                if fn is None:
                    continue
                rounds, us = busy.measure(fn, n)
                res[f"{name}_{what}_us"] = round(us, 1)
                res[f"{name}_{what}_busy_rounds"] = rounds
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--json", default="")
    a = p.parse_args()
    out = {
        "switch_interval_s": sys.getswitchinterval(),
        "correctness": correctness(),
        "gil": gil(a.n),
    }
    print(json.dumps(out, indent=1))
    c = out["correctness"]
    ok = c["before"] is False and c["after"] is True
    ok = ok and c.get("other_device", (False, True)) == (False, True)
    print("event probe", "OK" if ok else "WRONG")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
