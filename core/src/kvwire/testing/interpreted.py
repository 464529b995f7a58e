"""Run a Triton kernel check under Triton's CPU interpreter, for the CPU tests of GPU kernels.

``TRITON_INTERPRET=1`` must be set before Triton is imported, so the check runs as a script in
a fresh interpreter. Called by the test that owns the check; nothing here is shared state.
"""

from __future__ import annotations

import os
import subprocess
import sys

__all__ = ["run_interpreted"]


def run_interpreted(script: str, marker: str, timeout_s: float = 600) -> None:
    """Run ``script`` with Triton's interpreter on; raise AssertionError (with the end of its
    stderr) unless it exits 0 and prints ``marker``."""
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert marker in out.stdout, out.stdout[-3000:]
