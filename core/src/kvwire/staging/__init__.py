"""Staging strategies: how bytes get from the KV pool onto the wire."""

from kvwire.staging.base import (
    ChunkPlan,
    PlanRequest,
    RegisterFn,
    StagingContext,
    StagingStrategy,
)
from kvwire.staging.direct import DirectStaging

__all__ = [
    "ChunkPlan",
    "DirectStaging",
    "PlanRequest",
    "RegisterFn",
    "StagingContext",
    "StagingStrategy",
]
