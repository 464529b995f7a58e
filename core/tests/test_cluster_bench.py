"""``kvwire bench``: the quick run on ``tcp`` through the CLI, and the bookkeeping around it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvwire.bench.cli import (
    QUICK_CONCURRENCY,
    QUICK_FANOUT_CONCURRENCY,
    QUICK_PAGE_KIB,
    QUICK_REPEAT,
    QUICK_REQUESTS,
    QUICK_SIZES,
)
from kvwire.bench.cluster import MODES
from kvwire.bench.common import (
    cell_of,
    model_for,
    page_bytes,
    problems_of,
    ratios_of,
    requests_for,
    run_of,
)
from kvwire.cli import main
from kvwire.testing.cluster import RankReport, RequestResult, RoomPlan

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_quick_bench_on_tcp(tmp_path: Path) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["bench", "--transfer-backend", "tcp", "--quick", "--json", str(out)]
    argv += ["--plot", str(png), "--fanout", "2"]
    assert main(argv) == 0
    pb = page_bytes(model_for(QUICK_PAGE_KIB))

    data = json.loads(out.read_text())
    assert data["ok"] is True
    assert data["failures"] == []
    assert data["backend"] == "tcp"
    assert data["command"].startswith("kvwire bench --transfer-backend tcp --quick")
    machine = data["machine"]
    assert machine["cpu_count"] >= 1
    assert machine["platform"] and machine["kvwire_version"]

    cells = {(c["mode"], c["pages"], c["concurrency"]): c for c in data["cells"]}
    want = {(m, s, c) for m in MODES for s in QUICK_SIZES for c in QUICK_CONCURRENCY}
    assert set(cells) == want
    for (mode, pages, conc), c in cells.items():
        n = requests_for(QUICK_REQUESTS, conc) * QUICK_REPEAT
        assert c["repeats"] == QUICK_REPEAT and len(c["gbps_runs"]) == QUICK_REPEAT
        assert c["requests"] == c["ok"] == n and c["failed"] == 0, (mode, pages, conc)
        assert c["gbps"] > 0 and c["best_wall_s"] > 0
        assert c["gbps"] == max(c["gbps_runs"])
        assert math.isclose(c["gbps"], c["best_bytes"] / c["best_wall_s"] / 1e9, rel_tol=1e-9)
        assert c["p99_ms"] >= c["p50_ms"] > 0
        # A batch moves at least its requests' KV (kvwire adds aux rows); raw exactly that.
        assert c["request_bytes"] == pages * pb
        per_batch = requests_for(QUICK_REQUESTS, conc) * pages * pb
        assert c["best_bytes"] >= per_batch
        if mode == "raw":
            assert c["best_bytes"] == per_batch
        # Same descriptors: one per (page, layer, K|V) row (kvwire adds its aux rows).
        assert c["descriptors"] >= pages * 2 * 8
        if mode == "raw":
            assert c["prefill_p50_ms"] is None and c["decode_p50_ms"] is None
        else:  # where the time went on prefill, and the engine API's latency on decode
            stages = c["prefill_p50_ms"]
            assert set(stages) == {"queue", "post", "transfer", "latency"}
            assert stages["latency"] >= stages["post"] > 0 and stages["transfer"] > 0
            assert c["p99_ms"] >= c["decode_p50_ms"] > 0

    # Every request checked: a verified pass per cluster mode and size, a digest per raw batch.
    checks = {(c["mode"], c["pages"], c["concurrency"]): c for c in data["checks"]}
    cmax = max(QUICK_CONCURRENCY)
    want_checks = {(m, s, cmax) for m in ("kvwire", "sync") for s in QUICK_SIZES}
    want_checks |= {("raw", s, c) for s in QUICK_SIZES for c in QUICK_CONCURRENCY}
    fan_c = QUICK_FANOUT_CONCURRENCY
    want_checks |= {(m, 1, fan_c) for m in ("fanout-kvwire", "fanout-sync")}
    assert set(checks) == want_checks
    for key, c in checks.items():
        assert c["requests"] > 0 and c["verified"] == c["requests"], key

    ratios = {(r["pages"], r["concurrency"]): r for r in data["ratios"]}
    assert set(ratios) == {(s, c) for s in QUICK_SIZES for c in QUICK_CONCURRENCY}
    for (pages, conc), r in ratios.items():
        kv, raw, sync = (cells[(m, pages, conc)]["gbps"] for m in ("kvwire", "raw", "sync"))
        assert math.isclose(r["kvwire_vs_raw"], kv / raw, rel_tol=1e-9)
        assert math.isclose(r["async_vs_sync"], kv / sync, rel_tol=1e-9)
        kv_p50 = cells[("kvwire", pages, conc)]["decode_p50_ms"]
        raw_p50 = cells[("raw", pages, conc)]["p50_ms"]
        assert math.isclose(r["added_p50_ms"], kv_p50 - raw_p50, rel_tol=1e-9)

    # --fanout 2: 1 prefill -> 2 decode instances, async and sync, every request completed
    fan = {(c["mode"], c["pages"]): c for c in data["fanout"]}
    assert set(fan) == {("fanout-kvwire", 1), ("fanout-sync", 1)}
    for c in fan.values():
        n = requests_for(QUICK_REQUESTS, fan_c) * QUICK_REPEAT
        assert c["concurrency"] == fan_c and c["requests"] == c["ok"] == n
        assert c["gbps"] > 0 and c["decode_mean_ms"] > 0
    assert data["setup"]["fanout"]["decode_instances"] == 2

    assert png.read_bytes()[:8] == PNG_MAGIC
    assert png.stat().st_size > 1000


def _result(room: int, mismatches: int, t0: float, t1: float) -> RequestResult:
    plan = RoomPlan(room=room, num_pages=2, chunks=[2])
    reports = [
        RankReport("prefill", 0, 4, None, bytes=2 * page_bytes(), descriptors=33),
        RankReport("decode", 0, 4, None, mismatches=mismatches, latency_s=t1 - t0),
    ]
    return RequestResult(plan, reports, t_start=t0, t_end=t1)


def test_a_request_with_wrong_elements_is_not_counted_and_is_reported() -> None:
    results = [_result(1, 0, 0.0, 0.5), _result(2, 7, 0.1, 0.6), _result(3, 0, 0.2, 1.0)]
    run = run_of("kvwire", 2, 2, results)
    assert (run.requests, run.ok) == (3, 2)
    assert run.bytes == 2 * 2 * page_bytes()
    assert run.wall_s == pytest.approx(1.0)
    (line,) = problems_of("kvwire", 2, 2, results)
    assert "room 2" in line and "mismatches=7" in line
    cell = cell_of([run])
    assert (cell.requests, cell.ok, cell.failed) == (3, 2, 1)


def test_a_cell_keeps_its_best_batch_and_ratios_come_from_the_cells() -> None:
    slow = run_of("kvwire", 2, 1, [_result(1, 0, 0.0, 2.0)])
    fast = run_of("kvwire", 2, 1, [_result(2, 0, 0.0, 1.0)])
    cell = cell_of([slow, fast])
    assert cell.gbps == fast.gbps == pytest.approx(2 * page_bytes() / 1e9)
    assert cell.gbps_runs == [slow.gbps, fast.gbps] and cell.requests == 2
    cells = [cell_of([fast]) for _ in MODES]
    for c, m in zip(cells, MODES, strict=True):
        c.mode = m
    cells[1].gbps, cells[2].gbps = fast.gbps / 2, fast.gbps * 4  # sync, raw
    (r,) = ratios_of(cells)
    assert r.async_vs_sync == pytest.approx(2.0)
    assert r.kvwire_vs_raw == pytest.approx(0.25)


def test_plot_without_matplotlib_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    argv = ["bench", "--transfer-backend", "tcp", "--quick", "--plot", str(tmp_path / "x.png")]
    assert main(argv) == 1
    assert "pip install kvwire[plot]" in capsys.readouterr().out


def test_engine_bench_of_a_backend_without_one_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--transfer-backend", "tcp", "--engine"]) == 1
    out = capsys.readouterr().out
    assert "registers no engine benchmark" in out and "bench-backend" in out


def test_engine_bench_runs_the_plugins_benchmark(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--engine` hands the remaining arguments to the plugin's registered main()."""
    from kvwire.plugins import PluginRegistry

    seen: list[list[str]] = []
    monkeypatch.setattr(
        PluginRegistry, "engine_benchmark", lambda self, name: lambda argv: seen.append(argv) or 0
    )
    assert main(["bench", "--transfer-backend", "tcp", "--engine", "--repeat", "2"]) == 0
    assert seen == [["--repeat", "2"]]


def test_compare_staging_runs_all_three_modes(tmp_path: Path) -> None:
    out = tmp_path / "staging.json"
    argv = ["bench", "--transfer-backend", "tcp", "--compare-staging", "--quick"]
    argv += ["--concurrency", "2", "--requests", "4", "--sizes", "2", "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    cells = {c["mode"]: c for c in data["cells"]}
    assert set(cells) == {"per-token", "bulk", "equal-tp"}
    assert all(c["ok"] and c["gbps"] > 0 and c["requests"] == 4 for c in cells.values())
    # staging really cut the descriptors: one block per chunk instead of one per token
    assert cells["bulk"]["descs_per_request"] * 10 < cells["per-token"]["descs_per_request"]
