"""Shared fixtures: kvwire settings for in-process managers on a loaded machine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # sgl_harness, also in spawned rank processes


@pytest.fixture
def kvwire_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVWIRE_TRANSFER_BACKEND", "tcp")
    monkeypatch.setenv("KVWIRE_CONTROL__HEARTBEAT_INTERVAL_S", "0.5")
    monkeypatch.setenv("KVWIRE_CONTROL__NUM_WORKERS", "1")
    monkeypatch.setenv("KVWIRE_CONTROL__BOOTSTRAP_TIMEOUT_S", "5")
    monkeypatch.setenv("KVWIRE_SGLANG_KV_MEMORY", "dram")
