"""``kvwire_nixl.gpu_bench`` without a GPU: argument parsing, the figures and tables it derives
from raw times, the data check, and a tiny run of the whole benchmark on host memory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from kvwire_nixl import gpu_bench as gb
from kvwire_nixl import gpu_bench_args as gba
from kvwire_nixl import gpu_bench_report as gbr

torch = pytest.importorskip("torch")


# ----------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("16KiB", 16 << 10),
        ("16k", 16 << 10),
        ("256 MiB", 256 << 20),
        ("1g", 1 << 30),
    ],
)
def test_parse_size(text: str, value: int) -> None:
    assert gba.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "0", "KiB", "1.5GiB", "12 parsecs", "-4"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        gba.parse_size(text)


def test_format_size() -> None:
    assert [gba.format_size(n) for n in (1 << 30, 256 << 10, 3 << 20, 12)] == [
        "1 GiB",
        "256 KiB",
        "3 MiB",
        "12 B",
    ]


def test_parse_cases_default() -> None:
    cases = gba.parse_cases(gba.DEFAULT_CASES)
    assert [(c.count, c.size) for c in cases] == [
        (1, 1 << 30),
        (4096, 256 << 10),
        (65536, 16 << 10),
    ]
    assert {c.nbytes for c in cases} == {1 << 30}
    assert [c.label for c in cases] == ["1 x 1 GiB", "4096 x 256 KiB", "65536 x 16 KiB"]


@pytest.mark.parametrize("text", ["", "1", "x1GiB", "0x4KiB", "4x12", "2x", "ax4KiB"])
def test_parse_cases_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        gba.parse_cases(text)


def test_parse_chunks() -> None:
    assert gba.parse_chunks("1, 64,1024") == [1, 64, 1024]
    assert gba.parse_chunks("") == []
    with pytest.raises(ValueError):
        gba.parse_chunks("1,0")
    with pytest.raises(ValueError):
        gba.parse_chunks("many")


def test_parse_args_defaults() -> None:
    st = gba.parse_args([])
    assert (st.device, st.local_device, st.target_device) == ("cuda", "cuda:0", "cuda:1")
    assert st.chunk_row == 16 << 10 and st.chunks == [1, 64, 1024, 8192, 65536]
    # The largest case and the chunk table are both 1 GiB.
    assert st.source_bytes == 1 << 30
    assert st.options == {} and st.json_path is None and st.remote_layout == "shuffled"


def test_rotated() -> None:
    names = ["a", "b", "c"]
    assert [gb.rotated(names, r) for r in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]


def test_parse_args_cpu_and_options() -> None:
    st = gba.parse_args(
        [
            *("--device", "cpu", "--cases", "2x8KiB", "--chunks", "64", "--chunk-row", "1KiB"),
            *("--option", "progress=thread", "--option", 'ucx_env={"UCX_TLS": "cma,tcp"}'),
        ]
    )
    assert (st.local_device, st.target_device) == ("cpu", "cpu")
    assert st.source_bytes == 64 << 10  # the chunk table is larger than the case
    assert st.options == {"progress": "thread", "ucx_env": {"UCX_TLS": "cma,tcp"}}


@pytest.mark.parametrize(
    "argv",
    [
        ["--gpu", "1", "--target-gpu", "1"],
        ["--cases", "4x3"],
        ["--chunk-row", "12"],
        ["--repeat", "0"],
        ["--option", "novalue"],
        ["--device", "tpu"],
    ],
)
def test_parse_args_rejects(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        gba.parse_args(argv)
    assert info.value.code == 2


def test_chunk_reps() -> None:
    assert gba.chunk_reps(1, 50) == 50
    assert gba.chunk_reps(1024, 50) == 50
    assert gba.chunk_reps(8192, 50) == 10
    assert gba.chunk_reps(65536, 50) == 10
    assert gba.chunk_reps(2048, 100) == 50


# ------------------------------------------------------------------------------- figures
def _case_result(case: gba.Case, secs: dict[str, float], ok: bool = True) -> gbr.CaseResult:
    times = {}
    for name, t in secs.items():
        mt = gbr.MethodTimes()
        for k in (3.0, 1.0, 2.0):  # best is t, median is 2t
            mt.add(t * k, 1e-5 * k)
        times[name] = mt
    verified = {name: ok or name != "raw_oneshot" for name in secs}
    return gbr.summarize(case, times, verified)


def _meta() -> dict[str, object]:
    return {
        "memory": "VRAM->VRAM",
        "initiator": "cuda:0 (H200)",
        "target": "cuda:1 (H200)",
        "nixl": "nixl-cu13 1.5.1",
        "torch": "2.11",
        "repeat": 3,
        "chunk_row": 16 << 10,
    }


def test_summarize_and_ratios() -> None:
    case = gba.Case(1, 1 << 30)
    r = _case_result(
        case, {"kvwire": 0.004, "raw_prepped": 0.0036, "raw_oneshot": 0.0037, "torch_peer": 0.0027}
    )
    kv = r.methods["kvwire"]
    assert kv.best_gbps == pytest.approx((1 << 30) / 0.004 / 1e9)
    assert kv.median_gbps == pytest.approx(kv.best_gbps / 2)
    assert kv.submit_us_median == pytest.approx(20.0)
    assert r.ratio("kvwire", "torch_peer") == pytest.approx(0.0027 / 0.004)
    assert r.ratio("kvwire", "raw_prepped") == pytest.approx(0.9)
    assert r.ratio("kvwire", "raw_prepped", "median_gbps") == pytest.approx(0.9)
    assert r.verified


def test_large_case_is_the_largest_descriptor() -> None:
    secs = {"kvwire": 1.0, "raw_prepped": 1.0, "raw_oneshot": 1.0, "torch_peer": 1.0}
    rs = [_case_result(gba.Case(n, s), secs) for n, s in ((4096, 256 << 10), (1, 1 << 30))]
    big = gbr.large_case(rs)
    assert big is not None and big.case == "1 x 1 GiB"
    assert gbr.large_case([]) is None


def test_render_and_json() -> None:
    results = [
        _case_result(
            gba.Case(1, 1 << 30),
            {"kvwire": 0.0036, "raw_prepped": 0.0036, "raw_oneshot": 0.0037, "torch_peer": 0.0027},
        ),
        _case_result(
            gba.Case(65536, 16 << 10),
            {"kvwire": 0.005, "raw_prepped": 0.0048, "raw_oneshot": 0.009, "torch_peer": 0.0027},
            ok=False,
        ),
    ]
    chunk = gbr.ChunkResult(
        rows=64,
        bytes=64 << 14,
        reps=50,
        submit_us={"kvwire": 30.0, "raw_prepped": 20.0, "raw_oneshot": 60.0},
        e2e_us={"kvwire": 45.0, "raw_prepped": 35.0, "raw_oneshot": 80.0},
    )
    assert chunk.kvwire_overhead_us == pytest.approx(10.0)
    assert chunk.oneshot_over_prepped == pytest.approx(3.0)
    text = gbr.render(results, [chunk], _meta())
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("| 1 x 1 GiB"))
    assert "| 0.75 | 1.00 |" in row and row.endswith("| yes |")
    assert next(line for line in lines if line.startswith("| 65536 x 16 KiB")).endswith("| NO |")
    assert "(1 x 1 GiB): 0.75x, NOT met" in text
    assert "| 64 | 30.0 | 20.0 | 60.0 | 3.00 | 45.0 | 35.0 | 80.0 | +10.0 |" in text

    data = json.loads(json.dumps(gbr.to_json(results, [chunk], _meta())))
    assert data["target"]["case"] == "1 x 1 GiB" and data["target"]["met"] is False
    assert data["target"]["ratio"] == pytest.approx(0.75)
    first, second = data["cases"]
    assert first["kvwire_over_torch"] == pytest.approx(0.75)
    assert first["verified"] is True and second["verified"] is False
    assert set(first["methods"]) == set(gba.METHODS)
    assert data["chunks"][0]["kvwire_overhead_us"] == pytest.approx(10.0)


def test_render_met_without_chunks() -> None:
    r = _case_result(
        gba.Case(1, 1 << 30),
        {"kvwire": 0.003, "raw_prepped": 0.003, "raw_oneshot": 0.003, "torch_peer": 0.0027},
    )
    text = gbr.render([r], [], _meta())
    assert "0.90x, met" in text and "chunks of" not in text


# ------------------------------------------------------------------------------ the data
def test_rows_match_finds_misplaced_and_missing_rows() -> None:
    row, rows = 64, 8
    src = torch.empty(rows * row // 8, dtype=torch.int64)
    gb.fill_pattern(src)
    assert src.unique().numel() == src.numel()
    dst = torch.zeros(2 * rows * row // 8, dtype=torch.int64)
    remote = np.random.default_rng(0).permutation(2 * rows)[:rows]
    local = np.arange(rows)
    dst.view(-1, row // 8)[torch.as_tensor(remote)] = src.view(-1, row // 8)
    assert gb.rows_match(dst, remote, local, row)
    assert not gb.rows_match(dst, remote, local[::-1].copy(), row)
    dst.view(-1, row // 8)[int(remote[3])].zero_()
    assert not gb.rows_match(dst, remote, local, row)


# ------------------------------------------------------------------------- a tiny run
@pytest.mark.slow
def test_tiny_run_on_host_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    rc = gb.main(
        [
            *("--device", "cpu", "--cases", "1x256KiB,32x8KiB", "--chunks", "1,16"),
            *("--chunk-row", "4KiB", "--repeat", "2", "--chunk-repeat", "2", "--json", str(out)),
            *("--remote-layout", "contiguous"),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert (
        "DRAM->DRAM" in text
        and "contiguous target rows" in text
        and "| 32 x 8 KiB |" in text
        and "| 16 |" in text
    )
    data = json.loads(out.read_text())
    assert [c["case"] for c in data["cases"]] == ["1 x 256 KiB", "32 x 8 KiB"]
    assert all(c["verified"] for c in data["cases"])
    assert all(m["best_gbps"] > 0 for c in data["cases"] for m in c["methods"].values())
    assert [c["rows"] for c in data["chunks"]] == [1, 16]
    assert data["meta"]["target_exit_code"] == 0
