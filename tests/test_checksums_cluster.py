"""KV checksums across processes on every backend (issue 26 item 1), through ``kvwire demo``:
prefill and decode ranks in their own processes, heterogeneous TP, layer-wise chunks, every
element verified by the demo on decode.

* With ``kv_checksum`` on, checked requests succeed.
* A bit flipped in each chunk's landed rows before decode checks them (fault
  ``flip_on_landing``, in the decode ranks' processes: what a transport corrupting a byte
  looks like) fails every request, naming the mismatch, and none is reported corrupt: the
  check fails them before decode could report success with wrong KV.
* A prefill mapper writing the wrong head slice (fault ``head_slice_offset``) is caught by the
  checksum too, before the demo's element check.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from kvwire.testing.cluster import FAULT_ENV

SMALL = ("--layers", "3", "--kv-heads", "2", "--head-dim", "16", "--page-size", "4")
ROW = re.compile(r"│\s*(\S+)\s*│\s*(\d+)\s*│.*│\s*(\d+)\s*│\s*(\d+)\s*│\s*$")


def demo(backend: str, *args: str, fault: str | None = None) -> tuple[int, str, list[tuple]]:
    """Run a checked demo; returns (exit code, all output, [(phase, reqs, failed, corrupt)])."""
    env = {**os.environ, "COLUMNS": "200"}
    if fault:
        env[FAULT_ENV] = fault
    out = subprocess.run(
        [sys.executable, "-m", "kvwire.cli", "demo", "--transfer-backend", backend, *SMALL,
         "--tokens", "33", "--concurrency", "4", "--control-option", "kv_checksum=true", *args],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    text = out.stdout + out.stderr
    rows = [
        (m[1], int(m[2]), int(m[3]), int(m[4]))
        for line in out.stdout.splitlines()
        if (m := ROW.match(line))
    ]
    return out.returncode, text, rows


@pytest.mark.parametrize(
    ("backend", "extra"),
    [
        ("nixl", ("--layerwise", "0.5")),
        # staged layer groups whose bytes later groups' blocks carry still add up on decode
        ("mooncake", ("--staging", "bulk", "--layerwise", "1")),
    ],
)
def test_checked_requests_succeed(backend: str, extra: tuple[str, ...]) -> None:
    rc, text, rows = demo(backend, "--requests", "8", "--phases", "2:1,1:2", *extra)
    assert rc == 0, text
    assert [r[0] for r in rows] == ["2->1", "1->2"] and all(r[2:] == (0, 0) for r in rows), text


@pytest.mark.parametrize("backend", ["tcp", "nixl", "mooncake"])
def test_a_bit_flipped_on_landing_fails_every_request(backend: str) -> None:
    rc, text, rows = demo(
        backend, "--requests", "6", "--phases", "2:1", "--layerwise", "0.5",
        fault="flip_on_landing",
    )  # fmt: skip
    assert rc == 1, text
    assert rows == [("2->1", 6, 6, 0)], text  # all failed, none decoded as corrupt
    assert re.search(r"KV checksum mismatch in chunk \d+ .* layers \d.* differ", text), text


def test_a_wrong_head_slice_is_caught_by_the_checksum() -> None:
    rc, text, rows = demo(
        "tcp", "--requests", "6", "--kv-heads", "4", "--phases", "2:1", fault="head_slice_offset"
    )
    assert rc == 1, text
    assert rows == [("2->1", 6, 6, 0)], text
    assert "KV checksum mismatch" in text
