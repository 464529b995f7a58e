"""End-to-end: the README's main job runs across processes and verifies every element."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("phases", ["2:1,1:2", "4:2,2:2"])
def test_demo_moves_and_verifies(phases: str) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvwire.cli",
            "demo",
            "--transfer-backend",
            "tcp",
            "--requests",
            "12",
            "--tokens",
            "33",
            "--layers",
            "3",
            "--kv-heads",
            "2",
            "--head-dim",
            "16",
            "--page-size",
            "4",
            "--phases",
            phases,
            "--concurrency",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every element verified" in out.stdout
    for ph in phases.split(","):
        p, d = ph.split(":")
        assert f"{p}->{d}" in out.stdout


def test_demo_detects_corruption(monkeypatch: pytest.MonkeyPatch) -> None:
    """If the mapper sent the wrong head slice, the demo must fail (non-zero, corruptions)."""
    code = (
        "import sys\n"
        "import kvwire.index.head_slice as hs\n"
        "orig = hs.HeadSliceMapper.__init__\n"
        "def broken(self, *a, **k):\n"
        "    orig(self, *a, **k)\n"
        "    self.dst_start = 0\n"
        "hs.HeadSliceMapper.__init__ = broken\n"
        "from kvwire.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    # The decode side runs in spawned processes; the broken mapper runs on prefill (here).
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "demo",
            "--transfer-backend",
            "tcp",
            "--requests",
            "4",
            "--tokens",
            "8",
            "--layers",
            "1",
            "--kv-heads",
            "4",
            "--head-dim",
            "8",
            "--phases",
            "2:1",
            "--concurrency",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAILED" in out.stdout
