"""The engine-integration example in docs/ runs and verifies its data."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "engine_integration.py"


def test_engine_integration_example_runs() -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--transfer-backend", "tcp"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "data verified" in out.stdout
