"""``scripts/phase_probe.py``, the instrument of docs/benchmarks.md's per-method and per-thread
budgets (session 35): installed as ``sitecustomize`` in a fresh interpreter that runs verified
requests through an in-process tcp pair, it counts each wrapped method's calls, wall and CPU
only while the flag file exists, and reads every thread's CPU over that time. A probe that
silently stopped counting would cost device time to find out."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import sitecustomize as probe  # the probe, installed so
    from kvwire.testing.pair import pair, config

    def until(cond):  # bounded by the probe's progress, not by a guess of its timing
        deadline = time.monotonic() + 60
        while not cond():
            assert time.monotonic() < deadline, "the probe's thread did not run"
            time.sleep(0.005)

    flag = Path(sys.argv[1]) / "on"
    with pair(config(num_workers=1), slots=64) as p:
        p.transfer(1)  # before the flag: not counted
        flag.touch()
        until(lambda: probe._state["on"])
        for room in range(2, 2 + int(sys.argv[2])):
            p.transfer(room, pages=4, chunks=(2, 2))
        end = time.monotonic()
        until(lambda: probe._state["t1"] > end)  # the threads' CPU read after the requests
        flag.unlink()
        until(lambda: not probe._state["on"])
        probe._dump()  # as its thread does once it saw the flag gone (maybe not yet)
    print("DONE")
    """
)


@pytest.mark.timeout(120)
def test_the_probe_counts_methods_and_threads_only_while_on(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(ROOT / "scripts" / "phase_probe.py", site / "sitecustomize.py")
    out = tmp_path / "phases"
    requests = 60
    env = {
        **os.environ,
        "KVWIRE_PHASE_DIR": str(out),
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out), str(requests)],
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert run.returncode == 0 and "DONE" in run.stdout, run.stderr[-3000:]
    (dump,) = [json.loads(f.read_text()) for f in out.glob("*.json")]
    calls: dict[str, int] = {}
    for thread, target, n, wall, cpu in dump["rows"]:
        calls[target] = calls.get(target, 0) + n
        assert wall >= 0 and cpu >= 0, (thread, target, wall, cpu)
    # two chunks a request, each a job the worker accepts; one last send's mark a request;
    # the warm-up request before the flag is not counted
    assert calls["KVSender.send"] == 2 * requests
    assert calls["Pipeline.accept"] == 2 * requests
    assert calls["DecodeSide.on_notification"] >= 2 * requests
    # every thread's CPU over the flagged span: the transfer worker did its share
    assert dump["span"] > 0
    assert any(name.endswith("-w0") for name in dump["threads"]), dump["threads"]
    probe = str(ROOT / "scripts" / "phase_probe.py")
    report = subprocess.run(
        [sys.executable, probe, "report", str(out), "--per", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert report.returncode == 0, report.stderr
    assert f"{2 * requests} requests" in report.stdout and "per request" in report.stdout
    assert "cores; by thread:" in report.stdout
