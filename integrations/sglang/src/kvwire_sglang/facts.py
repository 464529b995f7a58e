"""The model and parallel facts SGLang's ``KVArgs`` does not carry (total KV heads, layers,
TP/PP/DP shape, the SWA window, the draft model's heads), as :class:`EngineFacts`.

The plugin's scheduler hooks read them from SGLang's scheduler and set them with
:func:`engine_facts` around ``_init_kv_manager``; :func:`~kvwire_sglang.layout.build_layout`
reads them with :func:`current_facts` (tests set them directly).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict, Field


class EngineFacts(BaseModel):
    """Model and parallel facts ``KVArgs`` does not carry (both roles, built at manager
    construction). ``None``: unknown (taken from ``KVArgs`` where it has them)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    attn_tp_size: int = Field(default=1, ge=1)
    pp_size: int = Field(default=1, ge=1)
    dp_size: int = Field(default=1, ge=1)
    num_layers: int | None = Field(default=None, ge=1, description="Layers of the whole model.")
    total_kv_heads: int | None = Field(default=None, ge=1)
    local_kv_heads: int | None = Field(default=None, ge=1, description="KV heads per rank.")
    sliding_window: int | None = Field(
        default=None, ge=1, description="SWA window in tokens (scheduler.sliding_window_size)."
    )
    draft_total_kv_heads: int | None = Field(
        default=None, ge=1, description="KV heads of the whole draft model (heads-sharded draft)."
    )
    draft_local_kv_heads: int | None = Field(
        default=None, ge=1, description="Draft KV heads per rank (the draft pool's head_num)."
    )


_FACTS: contextvars.ContextVar[EngineFacts | None] = contextvars.ContextVar(
    "kvwire_sglang_facts", default=None
)


@contextlib.contextmanager
def engine_facts(facts: EngineFacts) -> Iterator[EngineFacts]:
    """Make ``facts`` what managers built inside the block use (the plugin's scheduler hooks
    do this around SGLang's ``_init_kv_manager``; tests call it directly)."""
    token = _FACTS.set(facts)
    try:
        yield facts
    finally:
        _FACTS.reset(token)


def current_facts() -> EngineFacts:
    """The facts set by :func:`engine_facts`, or defaults (TP 1, no PP, no DP)."""
    return _FACTS.get() or EngineFacts()
