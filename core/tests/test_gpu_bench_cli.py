"""``kvwire bench --device cuda`` (:mod:`kvwire.bench.gpu_suite`) without a GPU: the suite's
wiring on host memory (each path a real cluster of rank processes, every verified element
checked, the staged path really staged), the table, and a clear refusal of ``--device cuda``
on a machine with no CUDA device. Its GPU figures come from the GPU machine
(docs/benchmarks.md)."""

from __future__ import annotations

import pytest
from rich.console import Console

from kvwire.bench.gpu_suite import PATHS, render, run_suite
from kvwire.cli import main


def test_every_path_runs_checked_and_tabled_on_host_memory() -> None:
    lines: list[str] = []
    details: list[str] = []
    report = run_suite(
        device="cpu", sizes=[1], concurrency=[1, 2], requests=4, log=lines.append,
        detail=details.append,
    )  # fmt: skip
    assert sum(d.startswith("verified") for d in details) == 3  # one size, three paths
    assert set(report["paths"]) == set(PATHS)
    # cudaipc serves GPU ranks only: skipped here, saying why
    assert "not usable" in report["paths"].pop("cudaipc")["skipped"]
    for name, rep in report["paths"].items():
        assert "skipped" not in rep, (name, rep)
        assert rep["verified"] and all(v["mismatches"] == 0 for v in rep["verified"]), name
        assert [c["concurrency"] for c in rep["cells"]] == [1, 2]
        assert all(c["failed"] == 0 and c["gbps"] > 0 for c in rep["cells"]), name
    # the staged path moves a chunk in a few blocks, the per-page path a row per page
    staged = report["paths"]["staged"]["cells"][0]["descriptors_per_request"]
    per_page = report["paths"]["per-page"]["cells"][0]["descriptors_per_request"]
    assert staged < per_page, (staged, per_page)
    # the default (auto) stages nothing on host pools: per page, like the per-page path
    default = report["paths"]["default"]["cells"][0]["descriptors_per_request"]
    assert default == per_page, (default, per_page)
    console = Console(record=True, width=160)
    console.print(render(report))
    text = console.export_text()
    for name in ("staged", "per-page"):
        assert name in text
    # each cell's row says the rank processes' GIL switch interval after it (µs, prefill's
    # first): the interpreter's 5 ms unless kvwire's GIL watch lowered it
    assert "GIL µs" in text
    for rep in report["paths"].values():
        for c in rep["cells"]:
            got = "/".join(f"{v:g}" for v in c["gil"]["interval_us"])
            assert len(c["gil"]["interval_us"]) == 2 and got in text, (got, c["gil"])
    assert any("staged: nixl, staging bulk" in line for line in lines)


def test_unknown_paths_are_refused() -> None:
    with pytest.raises(Exception, match="unknown GPU bench path"):
        run_suite(device="cpu", paths=("cudaipc", "warp-drive"))


def test_device_cuda_without_a_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the GPU bench would run")
    rc = main(["bench", "--device", "cuda", "--mib", "2"])
    out = capsys.readouterr()
    assert rc == 1
    assert "no CUDA device" in out.out + out.err
