"""kvwire's records come out through vLLM's logging (issue 24, item 6).

Each case runs in a fresh interpreter (vLLM's logging setup is process-global; the two run
at once): vLLM's own ``configure_logging`` sets up the ``vllm`` logger from the environment (a
``VLLM_LOGGING_PREFIX`` marks its formatter's output), then ``vllm_pd_harness.Engine`` builds
a decode instance's connector halves through ``KVConnectorFactory`` and registers the KV
caches (a real kvwire manager over tcp, on loopback). The startup line and kvwire core's own
records must carry vLLM's prefix, level and format; ``VLLM_LOGGING_LEVEL`` must apply.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(240)

HERE = Path(__file__).parent
SCRIPT = f"""
import logging, sys
sys.path.insert(0, {str(HERE)!r})
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())
from vllm_pd_harness import Engine
eng = Engine("decode", "LBNHC", {{"transfer_backend": "tcp", "control": {{"host": "127.0.0.1"}}}})
logging.getLogger("kvwire_nixl.backend").warning("a plugin warning")
logging.getLogger("kvwire.session.decode.side").debug("a debug line")
for w in eng.workers:
    w.shutdown()
"""
#: vLLM's text format: PREFIX(process pid=N) LEVEL MM-DD HH:MM:SS [file:line] message
LINE = re.compile(
    r"^\[vllm-test\] \(\S+ pid=\d+\) (?P<level>[A-Z]+) \d\d-\d\d \d\d:\d\d:\d\d "
    r"\[(?P<file>[^\]:]+):\d+\] (?P<msg>.*)$"
)


LEVELS = ("INFO", "WARNING")


@pytest.fixture(scope="module")
def lines_at(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[re.Match[str]]]:
    """The vLLM-formatted lines of one fresh interpreter per ``VLLM_LOGGING_LEVEL`` of
    :data:`LEVELS`; the interpreters run at once (each spends ~25 s importing vLLM)."""
    folder = tmp_path_factory.mktemp("vllm-logs")
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for level in LEVELS:
            env = dict(
                os.environ,
                VLLM_TARGET_DEVICE="cpu",
                VLLM_LOGGING_PREFIX="[vllm-test] ",
                VLLM_LOGGING_LEVEL=level,
                VLLM_LOGGING_COLOR="0",
            )
            with open(folder / f"{level}.log", "w") as out:  # the child keeps its own copy
                procs[level] = subprocess.Popen(
                    [sys.executable, "-c", SCRIPT], env=env, stdout=out, stderr=subprocess.STDOUT
                )
        rcs = {level: proc.wait(200) for level, proc in procs.items()}
    finally:
        for proc in procs.values():  # one timed out: kill every one still running
            if proc.poll() is None:
                proc.kill()
    got = {}
    for level, rc in rcs.items():
        text = (folder / f"{level}.log").read_text(errors="replace")
        assert rc == 0, text[-3000:]
        got[level] = [m for m in map(LINE.match, text.splitlines()) if m is not None]
    return got


def test_kvwire_records_use_vllms_format_and_level(lines_at: dict[str, Any]) -> None:
    lines = lines_at["INFO"]
    startup = [m for m in lines if m["msg"].startswith("kvwire-vllm decode rank tp0/1:")]
    assert len(startup) == 1, [m.string for m in lines]
    msg = startup[0]["msg"]
    assert startup[0]["level"] == "INFO" and startup[0]["file"].endswith("worker.py")
    for part in ("backend tcp", "layout ", "kv_pool=heads", "mapper auto", "staging direct"):
        assert part in msg, msg
    # kvwire core's own INFO line (the manager coming up), and a plugin logger's warning
    assert any("decode manager up" in m["msg"] and m["level"] == "INFO" for m in lines)
    assert any(m["msg"] == "a plugin warning" and m["level"] == "WARNING" for m in lines)
    assert not any(m["msg"] == "a debug line" for m in lines)


def test_vllm_logging_level_applies_to_kvwire(lines_at: dict[str, Any]) -> None:
    lines = lines_at["WARNING"]
    assert any(m["msg"] == "a plugin warning" for m in lines)
    assert not any(m["level"] == "INFO" for m in lines), [m.string for m in lines]
