"""kvwire.cuda_events: an event record that keeps the GIL, with torch's as fallback.

No GPU here: the driver is a stand-in recording its calls (what no machine here can run);
the real driver's path is checked on a GPU by scripts/gpu_event_gil_probe.py (an event
recorded this way completes as torch's does, and no GIL hand-off to a busy thread).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvwire import cuda_driver, cuda_events


class _Event:
    """A torch-like event: its own calls are counted (the fallback path)."""

    def __init__(self, handle: int, device: int = 0, done: bool = True) -> None:
        self.cuda_event = handle
        self.device = torch.device("cuda", device)
        self.done = done
        self.recorded: list[Any] = []

    def record(self, stream: Any) -> None:
        self.recorded.append(stream)

    def query(self) -> bool:
        return self.done


class _Stream:
    cuda_stream = 0x5000


class _Driver:
    def __init__(self, record_rc: int = 0) -> None:
        self.record_rc = record_rc
        self.calls: list[tuple[Any, ...]] = []

    def cuEventRecord(self, ev: int, stream: int) -> int:  # noqa: N802 - the driver's name
        self.calls.append(("record", ev, stream))
        return self.record_rc


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> _Driver:
    d = _Driver()
    monkeypatch.setattr(cuda_driver, "_lib", d)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return d


def test_without_libcuda_torch_calls_are_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_driver, "_lib", False)  # loading failed
    ev, s = _Event(0x10, done=False), _Stream()
    cuda_events.record(ev, s)
    assert ev.recorded == [s]


def test_this_machine_has_no_libcuda_and_falls_back() -> None:
    """The real loader on a machine without the driver: no handle, torch's calls."""
    cuda_driver._lib = None
    try:
        assert cuda_driver.held() is None
        ev = _Event(0x10)
        cuda_events.record(ev, _Stream())
        assert len(ev.recorded) == 1
    finally:
        cuda_driver._lib = None


def test_driver_calls_take_the_raw_handles(driver: _Driver) -> None:
    ev, s = _Event(0x10), _Stream()
    cuda_events.record(ev, s)
    assert driver.calls == [("record", 0x10, 0x5000)]
    assert ev.recorded == []  # torch's record (which lets go of the GIL) not called


def test_driver_errors_raise(driver: _Driver) -> None:
    ev = _Event(0x10)
    driver.record_rc = 400
    with pytest.raises(RuntimeError, match="cuEventRecord failed: CUDA driver error 400"):
        cuda_events.record(ev, _Stream())


def test_uncreated_or_other_device_events_use_torch(driver: _Driver) -> None:
    fresh = _Event(0)  # torch creates the CUDA event at its first record
    cuda_events.record(fresh, _Stream())
    assert len(fresh.recorded) == 1
    other = _Event(0x20, device=1, done=False)  # the current device is 0
    cuda_events.record(other, _Stream())
    assert len(other.recorded) == 1
    assert driver.calls == []
