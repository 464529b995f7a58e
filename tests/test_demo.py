"""End-to-end: the README's main job runs across processes and verifies every element."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvwire.testing.cluster import FAULT_ENV


def run_demo(*args: str, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``kvwire demo`` on the tcp backend with small sizes; extra ``args`` override."""
    env = {**os.environ, "COLUMNS": "200"}
    if fault:
        env[FAULT_ENV] = fault
    return subprocess.run(
        [sys.executable, "-m", "kvwire.cli", "demo", "--transfer-backend", "tcp", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


SMALL = ("--layers", "3", "--kv-heads", "2", "--head-dim", "16", "--page-size", "4")


@pytest.mark.parametrize(("phases", "layerwise"), [("2:1,1:2", "0"), ("2x2:2", "1.0")])
def test_demo_moves_and_verifies(phases: str, layerwise: str) -> None:
    out = run_demo(
        *SMALL,
        *("--requests", "24", "--tokens", "33", "--phases", phases, "--concurrency", "8"),
        *("--layerwise", layerwise),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every element verified" in out.stdout
    for ph in phases.split(","):
        assert ph.replace(":", "->") in out.stdout


def test_demo_detects_corruption() -> None:
    """If the prefill ranks' mapper wrote the wrong head slice, the demo must fail."""
    out = run_demo(
        *SMALL,
        "--requests",
        "6",
        "--tokens",
        "8",
        "--kv-heads",
        "4",
        "--phases",
        "2:1",
        "--concurrency",
        "2",
        fault="head_slice_offset",
    )
    assert out.returncode == 1, out.stdout + out.stderr
    # The run completed (results table printed) and the element check flagged it.
    assert "kvwire demo results" in out.stdout and "FAILED" in out.stdout
    assert "every element verified" not in out.stdout


def test_demo_rejects_a_bad_phase() -> None:
    out = run_demo("--phases", "2-1")
    assert out.returncode == 1
    assert "bad phase '2-1'" in out.stdout


@pytest.mark.parametrize(
    ("page", "decode_page", "phases", "extra"),
    [
        ("4", "16", "2:1,1:2", ()),  # decode pages filled by several chunks
        ("8", "2", "2x2:1x2", ()),  # with pipeline stages on both sides
        ("4", "1", "2:1", ("--mla",)),  # token granularity, MLA with a dummy sender
    ],
)
def test_demo_with_another_decode_page_size(
    page: str, decode_page: str, phases: str, extra: tuple[str, ...]
) -> None:
    out = run_demo(
        *SMALL,
        "--page-size",
        page,
        "--decode-page-size",
        decode_page,
        "--requests",
        "12",
        "--tokens",
        "40",
        "--phases",
        phases,
        "--concurrency",
        "4",
        "--cached-fraction",
        "0.5",
        *extra,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"decode pages of {decode_page}" in out.stdout
    assert "every element verified" in out.stdout


def test_demo_with_decode_pipeline_stages() -> None:
    """Decode PP: each decode stage receives its layers from whichever prefill stages hold
    them (3 layers: stages [0, 2) and [2, 3) on decode, one layer each on a 3-stage prefill,
    whose third stage is a dummy sender for decode's first)."""
    out = run_demo(
        *SMALL,
        "--requests",
        "12",
        "--tokens",
        "24",
        "--phases",
        "2x2:1x2,1:2x2,2x3:2x2",
        "--concurrency",
        "4",
        "--cached-fraction",
        "0.3",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for phase in ("2x2->1x2", "1->2x2", "2x3->2x2"):
        assert phase in out.stdout
    assert "every element verified" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_demo_converts_page_sizes_and_decode_stages_on_engines(backend: str) -> None:
    """The page-size conversion (prefill pages of 8 tokens, decode pages of 2) and decode
    pipeline stages over the real engines, cached prefixes included; every element verified."""
    from kvwire.plugins import Kind, get_registry

    if get_registry().try_resolve(Kind.BACKEND, backend)[0] is None:
        pytest.skip(f"backend {backend!r} is not usable here")
    out = run_demo(
        *SMALL,
        *("--transfer-backend", backend, "--page-size", "8", "--decode-page-size", "2"),
        *("--requests", "12", "--tokens", "60", "--phases", "2:1,2x2:1x2"),
        *("--concurrency", "4", "--cached-fraction", "0.5"),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2x2->1x2" in out.stdout and "every element verified" in out.stdout
