"""Faults a test can inject into the rank processes of :mod:`kvwire.testing.cluster`, to prove
that verification catches them. Selected with the ``KVWIRE_TESTING_FAULT`` environment variable
(inherited by spawned ranks); never used outside tests.
"""

from __future__ import annotations

from typing import Any

from kvwire.index.head_slice import HeadSliceMapper


def _head_slice_offset(role: str) -> None:
    """Prefill's head-slice mapper writes every slice at destination head 0 (in bounds, so only
    the decode side's element check can notice)."""
    if role != "prefill":
        return
    original = HeadSliceMapper.__init__

    def broken(self: HeadSliceMapper, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.dst_start = 0

    HeadSliceMapper.__init__ = broken  # type: ignore[method-assign]


def _lossy_staging(role: str) -> None:
    """Every staging control message is lost with probability 1/4 and sent twice with
    probability 1/4 (both sides): the lifecycle must retry, ignore duplicates and never hang."""
    import random

    from kvwire.control import wire
    from kvwire.control.channel import ControlChannel

    kinds = (
        wire.StagingRequest,
        wire.StagingGrant,
        wire.StagingDeny,
        wire.StagingWatermark,
        wire.WritesDone,
        wire.WritesQuery,
    )
    rng = random.Random(f"lossy-{role}")
    original = ControlChannel.send

    def lossy(self: ControlChannel, endpoint: str, msg: wire.Message) -> bool:
        if isinstance(msg, kinds):
            r = rng.random()
            if r < 0.25:
                return True  # lost on the way
            if r < 0.5:
                original(self, endpoint, msg)  # delivered twice
        return original(self, endpoint, msg)

    ControlChannel.send = lossy  # type: ignore[method-assign]


FAULTS = {"head_slice_offset": _head_slice_offset, "lossy_staging": _lossy_staging}


def apply(name: str, role: str) -> None:
    """Install fault ``name`` in this process (a rank of ``role``)."""
    try:
        FAULTS[name](role)
    except KeyError:
        raise ValueError(f"unknown fault {name!r}; known: {sorted(FAULTS)}") from None
