"""The real-server harness's own pieces that need no server: the ports it hands out and the
error lines it prints when a server fails to start (CI once showed only the API server's
traceback, its cause — the engine core's exception — cut off above the tail)."""

from __future__ import annotations

import socket
from pathlib import Path

from vllm_serve_harness import Server, error_lines, free_port

#: Linux's default ephemeral range (``net.ipv4.ip_local_port_range``).
EPHEMERAL = range(32768, 61000)


def test_ports_are_bindable_distinct_and_outside_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert not any(p in EPHEMERAL for p in ports)
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when handed out


ENGINE_CORE_FAILURE = [
    "INFO 11-28 13:20:01 [api_server.py:1] vLLM API server version 0.32.0",
    "(EngineCore pid=42) Process EngineCore:",
    "(EngineCore pid=42) Traceback (most recent call last):",
    '(EngineCore pid=42)   File "kvwire/bootstrap.py", line 9, in start',
    "(EngineCore pid=42) OSError: [Errno 98] Address already in use",
    *[f'  File "vllm/frame{i}.py", line {i}, in f' for i in range(80)],
    "RuntimeError: Engine core initialization failed. See root cause above.",
]


def test_error_lines_keep_the_cause_and_leave_frames_out() -> None:
    got = error_lines(ENGINE_CORE_FAILURE)
    assert got == [
        "(EngineCore pid=42) Traceback (most recent call last):",
        "(EngineCore pid=42) OSError: [Errno 98] Address already in use",
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ]
    assert len(error_lines(["ERROR x"] * 100, cap=5)) == 6  # capped, and says so


def test_a_failed_start_prints_the_cause_above_the_tail(tmp_path: Path) -> None:
    server = Server(tmp_path, "prefill-x", {}, 0, tmp_path)
    server.log_path.write_text("\n".join(ENGINE_CORE_FAILURE) + "\n")
    text = server.tail(lines=60)
    assert "Address already in use" in text  # 60 lines of frames would have hidden it
    assert text.index("Address already in use") < text.index("[tail]")
    assert text.rstrip().endswith("See root cause above.")
