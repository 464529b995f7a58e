"""Can decode arm its checksum check before the KV lands? A probe of CUDA stream memory
waits on one GPU (issue 26 item 1).

A check armed ahead would be enqueued on a stream of its own behind a
``cuStreamWaitValue32`` on a flag in pinned host memory, the sums' launch and an event after
it; the host releases it with one store once the chunk's note arrived. This probes, on
``cuda:1`` when there are two GPUs (a rank off device 0, as decode is in the benches):

1. an armed stream does not run before its release (its event stays pending for 20 ms);
2. eight armed streams released in reverse order each complete, in that order;
3. host time to arm (wait + a small reduction kernel + an event) and from the release store to
   the event seen complete, against launching the same kernel after the store and waiting;
4. the same with decode's real check (``DeviceRowHasher.page_sums``' kernel is not reachable
   from here, so a ``torch`` reduction of 16 MiB stands in for it).

    python3 scripts/gpu_armed_probe.py --json $OUT/armed_probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from cuda.bindings import driver


def _ok(res: Any, call: str) -> Any:
    err, *vals = res if isinstance(res, tuple) else (res,)
    if int(err) != 0:
        raise RuntimeError(f"{call}: {getattr(err, 'name', err)}")
    return vals[0] if len(vals) == 1 else vals


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="")
    ap.add_argument("--repeat", type=int, default=200)
    a = ap.parse_args()
    dev = torch.device("cuda", 1 if torch.cuda.device_count() > 1 else 0)
    report: dict[str, Any] = {"device": str(dev), "name": torch.cuda.get_device_name(dev)}
    flags = torch.zeros(64, dtype=torch.int32, pin_memory=True)
    fnp = flags.numpy()
    base = flags.data_ptr()
    dptr = int(_ok(driver.cuMemHostGetDevicePointer(base, 0), "cuMemHostGetDevicePointer"))
    report["device_pointer_is_host_pointer"] = dptr == base
    geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    data = torch.randint(0, 1 << 20, (4 << 20,), dtype=torch.int32, device=dev)  # 16 MiB
    out = torch.zeros(64, dtype=torch.int64, device=dev)
    streams = [torch.cuda.Stream(dev) for _ in range(8)]
    events = [torch.cuda.Event() for _ in range(8)]
    want = int(data.sum(dtype=torch.int64).item())

    def arm(i: int, epoch: int) -> None:
        s = streams[i]
        with torch.cuda.device(dev):
            _ok(
                driver.cuStreamWaitValue32(
                    driver.CUstream(s.cuda_stream), dptr + 4 * i, epoch, geq
                ),
                "cuStreamWaitValue32",
            )
            with torch.cuda.stream(s):
                out[i : i + 1].copy_(data.sum(dtype=torch.int64).view(1))
            events[i].record(s)

    # 1. held until released
    epoch = 1
    arm(0, epoch)
    time.sleep(0.02)
    report["held_20ms"] = not events[0].query()
    fnp[0] = epoch
    events[0].synchronize()
    report["right_after_release"] = int(out[0].item()) == want
    # 2. eight, released in reverse order
    epoch += 1
    for i in range(8):
        arm(i, epoch)
    done_order = []
    for i in reversed(range(8)):
        fnp[i] = epoch
        events[i].synchronize()
        done_order.append(i)
        pending = [j for j in range(i) if events[j].query()]
        if pending:
            report.setdefault("ran_early", []).extend(pending)
    report["eight_released_in_reverse"] = done_order == list(reversed(range(8)))
    report["eight_right"] = all(int(v) == want for v in out[:8].tolist())
    # 3. host times
    arm_t, release_t, launch_t = [], [], []
    for _ in range(a.repeat):
        epoch += 1
        t0 = time.perf_counter()
        arm(0, epoch)
        t1 = time.perf_counter()
        time.sleep(0.0005)
        t2 = time.perf_counter()
        fnp[0] = epoch
        events[0].synchronize()
        t3 = time.perf_counter()
        with torch.cuda.device(dev), torch.cuda.stream(streams[1]):
            out[1:2].copy_(data.sum(dtype=torch.int64).view(1))
        events[1].record(streams[1])
        events[1].synchronize()
        t4 = time.perf_counter()
        arm_t.append(t1 - t0)
        release_t.append(t3 - t2)
        launch_t.append(t4 - t3)
    report["host_ms"] = {
        "arm": round(1e3 * statistics.median(arm_t), 4),
        "release_to_done": round(1e3 * statistics.median(release_t), 4),
        "launch_then_wait": round(1e3 * statistics.median(launch_t), 4),
    }
    ok = report["held_20ms"] and report["right_after_release"] and report["eight_right"]
    report["ok"] = bool(ok and report["eight_released_in_reverse"] and not report.get("ran_early"))
    print(json.dumps(report, indent=1))
    print("ARMED-PROBE-OK" if report["ok"] else "ARMED-PROBE-BAD")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
