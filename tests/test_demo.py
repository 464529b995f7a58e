"""End-to-end: the README's main job runs across processes and verifies every element."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

#: A prefill-side mapper that writes every head slice at offset 0 (stays in bounds, so only
#: the decode side's element check can catch it).
BROKEN_MAPPER = """
import sys
import kvwire.index.head_slice as hs
orig = hs.HeadSliceMapper.__init__
def broken(self, *a, **k):
    orig(self, *a, **k)
    self.dst_start = 0
hs.HeadSliceMapper.__init__ = broken
from kvwire.cli import main
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
"""


def run_demo(
    *args: str, launcher: tuple[str, ...] = ("-m", "kvwire.cli")
) -> subprocess.CompletedProcess[str]:
    """Run ``kvwire demo`` on the tcp backend with small sizes; extra ``args`` override."""
    return subprocess.run(
        [sys.executable, *launcher, "demo", "--transfer-backend", "tcp", "--page-size", "4", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "COLUMNS": "200"},
    )


@pytest.mark.parametrize("phases", ["2:1,1:2", "4:2,2:2"])
def test_demo_moves_and_verifies(phases: str) -> None:
    out = run_demo(
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
        "--phases",
        phases,
        "--concurrency",
        "4",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every element verified" in out.stdout
    for ph in phases.split(","):
        p, d = ph.split(":")
        assert f"{p}->{d}" in out.stdout


def test_demo_detects_corruption(tmp_path: os.PathLike[str]) -> None:
    """If the mapper sent the wrong head slice, the demo must fail (non-zero, FAILED)."""
    script = os.path.join(tmp_path, "broken_demo.py")
    with open(script, "w") as fh:
        fh.write(BROKEN_MAPPER)
    # The decode side runs in spawned processes; the broken mapper runs on prefill (here).
    out = run_demo(
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
        launcher=(script,),
    )
    assert out.returncode == 1, out.stdout + out.stderr
    # The run completed (results table printed) and the element check flagged it.
    assert "kvwire demo results" in out.stdout and "FAILED" in out.stdout
    assert "every element verified" not in out.stdout
