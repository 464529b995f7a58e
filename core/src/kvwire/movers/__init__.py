"""Fused run movers: copy a list of byte runs ``(src, dst, nbytes)`` in one kernel launch.

:mod:`kvwire.movers.plan` cuts runs into fixed-size tiles with NumPy (no per-run Python loop)
and holds the CPU reference movers that are the oracle of the property tests;
:mod:`kvwire.movers.triton_copy` is the CUDA mover (one Triton launch per call, one program
per tile), imported only where torch sees a GPU. Bulk staging's page movers compute their
addresses on the device from page lists: :mod:`kvwire.movers.triton_pages` (token-major
pages), :mod:`kvwire.movers.triton_units` (units of pages), :mod:`kvwire.movers.triton_heads`
(head-major pages), chosen per pool by :mod:`kvwire.movers.staged_moves`.
"""

from kvwire.movers.plan import (
    BLOCK_BYTES,
    DEFAULT_TILE_BYTES,
    MAX_WIDTH,
    GroupPlan,
    TilePlan,
    as_runs,
    copy_runs_reference,
    copy_tiles_reference,
    element_width,
    expand_groups,
    head_runs,
    merge_adjacent,
    plan_groups,
    plan_tiles,
    unit_runs,
)

__all__ = [
    "BLOCK_BYTES",
    "DEFAULT_TILE_BYTES",
    "MAX_WIDTH",
    "GroupPlan",
    "TilePlan",
    "as_runs",
    "copy_runs_reference",
    "copy_tiles_reference",
    "element_width",
    "expand_groups",
    "head_runs",
    "merge_adjacent",
    "plan_groups",
    "plan_tiles",
    "unit_runs",
]
