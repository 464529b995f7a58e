"""``kvwire bench --latency``: two real rank processes, one request at a time, every element
checked; the stages come from both processes' stamps on one clock."""

from __future__ import annotations

import json
from pathlib import Path

from kvwire.bench.latency import STAGES, TOTALS, stage_samples, summarise
from kvwire.cli import main


def test_latency_bench_on_tcp_times_every_stage_of_verified_requests(tmp_path: Path) -> None:
    out = tmp_path / "lat.json"
    argv = ["bench", "--latency", "--transfer-backend", "tcp", "--requests", "6", "--warmup", "2"]
    assert main([*argv, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ok"] and data["verified"] == data["requests"] == 6 and not data["failures"]
    for name, _, _ in (*STAGES, *TOTALS):
        values = data["samples"][name]
        assert len(values) == 6, name  # every stage stamped on every request
        assert all(v >= 0 for v in values), name
    # the stages of one request lie inside its total, in order
    s = data["samples"]
    for i in range(6):
        inner = s["queue"][i] + s["post"][i] + s["land"][i] + s["finish"][i] + s["report"][i]
        assert inner <= s["send->decode"][i] + 1e-9
    assert data["cpu_ms"]["prefill.process"] > 0 and data["cpu_ms"]["decode.process"] > 0
    assert data["cpu_ms"]["prefill.worker"] > 0  # the transfer workers were found by name


def test_stage_samples_pair_the_stamps_of_both_processes() -> None:
    rec = {"d.init": 1.0, "d.requested": 1.25, "p.asked": 1.5, "p.seen": 1.5, "p.send": 2.0}
    rec |= {"p.taken": 2.5, "p.posted": 3.0, "d.noted": 4.0, "d.success": 4.0, "d.polled": 5.0}
    rec |= {"p.polled": 4.5}
    got = stage_samples([rec, {"d.init": 0.0}])  # a record without stamps adds nothing
    assert got["ask"] == [0.25] and got["land"] == [1.0] and got["send->decode"] == [3.0]
    assert got["init->decode"] == [4.0] and got["send->prefill"] == [2.5]
    assert summarise(got)["land"] == {"p50": 1000.0, "p99": 1000.0, "mean": 1000.0}


def test_latency_bench_staged_takes_decodes_offers_and_verifies(tmp_path: Path) -> None:
    """Bulk staging on tcp: every request is one chunk, so every first chunk takes decode's
    offer of ring space (no ask); every element checked, the plan stage stamped."""
    out = tmp_path / "lat.json"
    argv = ["bench", "--latency", "--transfer-backend", "tcp", "--requests", "6", "--warmup", "2"]
    argv += ["--staging", "bulk", "--staging-option", "equal_tp=always"]
    assert main([*argv, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ok"] and data["verified"] == 6 and not data["failures"]
    assert data["offers"] == {"taken": 8}  # warm-up included; none asked
    assert len(data["samples"]["plan"]) == 6
    for i in range(6):
        assert data["samples"]["plan"][i] <= data["samples"]["post"][i] + 1e-9
