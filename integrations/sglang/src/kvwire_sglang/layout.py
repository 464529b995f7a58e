"""SGLang's ``KVArgs`` -> a kvwire :class:`~kvwire.layout.KVLayout`.

Both roles build their kvwire layout from the ``KVArgs`` SGLang fills at scheduler start
(``PrefillBootstrapQueue._init_kv_manager`` / ``DecodePreallocQueue._init_kv_manager``), in
:class:`~kvwire_sglang.conn.KvwireKVManager`'s constructor. ``KVArgs`` carries raw pointers and
byte sizes only; the model facts kvwire also needs (total KV heads, layers, TP/PP/DP shape) come
from :class:`EngineFacts`, which the plugin's hooks read from SGLang's scheduler while it builds
the manager (:func:`engine_facts` sets them explicitly, e.g. in tests).

What maps, and how:

* ``kv_data_ptrs/lens/item_lens`` (``[K_0..K_{L-1}, V_0..V_{L-1}]``; MLA: one per layer) ->
  ``KVLayout.buffers``; ``kv_cache_dtype_str`` -> ``ModelSpec.dtype`` (bytes when unknown);
  ``prefill_start_layer``/``prefill_end_layer`` -> the PP stage's layer range.
* the draft model's KV appended to them (``num_draft_entries``) -> a ``paged`` group "draft".
* ``aux_data_*`` -> aux regions (one per metadata buffer, same rows).
* ``state_types`` ``"mamba"`` and ``"request_row"`` (one slot per request) -> ``state`` groups,
  one per slot size, addressed by ``state_indices`` entry ``"state{i}"`` (component ``i``).

Extra groups (draft, states) are described as opaque bytes: they move whole slots, so prefill and
decode need the same attention TP (a TP mismatch is refused at handshake, naming the group).
Everything else in ``KVArgs`` that would change what must move (other state types, host
destinations, KV layouts other than SGLang's default) raises :class:`UnsupportedKVArgsError` naming
the field.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvwire.layout import (
    DTYPE_SIZES,
    BufferGroup,
    KVLayout,
    MemKind,
    MemoryRegion,
    ModelSpec,
    RankPosition,
)

logger = logging.getLogger(__name__)

#: SGLang ``kv_cache_dtype_str`` values -> kvwire dtypes (others are described as bytes).
DTYPES: dict[str, str] = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e4m3fn": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "float8_e5m2": "float8_e5m2",
}

#: SGLang state types whose index payload is one slot per request (moved whole).
SLOT_STATES = ("mamba", "request_row")


class UnsupportedKVArgsError(ValueError):
    """A ``KVArgs`` field describes something kvwire-sglang cannot move; names the field."""


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


def _get(args: Any, name: str, default: Any = None) -> Any:
    """A ``KVArgs`` field (SGLang declares many without a default: unset reads as missing)."""
    return getattr(args, name, default)


def _regions(
    ptrs: Sequence[int],
    lens: Sequence[int],
    items: Sequence[int],
    kind: MemKind,
    dev: int,
    what: str,
) -> tuple[MemoryRegion, ...]:
    if not (len(ptrs) == len(lens) == len(items)):
        raise UnsupportedKVArgsError(
            f"KVArgs.{what}_data_ptrs/_lens/_item_lens have different lengths "
            f"({len(ptrs)}, {len(lens)}, {len(items)})"
        )
    out = []
    for p, n, it in zip(ptrs, lens, items, strict=True):
        whole = (int(n) // int(it)) * int(it)  # SGLang pads pools by a partial slot at times
        out.append(MemoryRegion.from_pointer(int(p), whole, int(it), kind, dev))
    return tuple(out)


def _bytes_group(
    name: str,
    index: str,
    kind: str,
    regions: Sequence[MemoryRegion],
    tp: int,
    per_layer: int = 1,
    page_size: int = 1,
) -> BufferGroup:
    """A group moved as whole opaque slots: ``tp`` heads of the slot's bytes, one per rank, so
    its description equals the peer's only when both have the same TP."""
    item = regions[0].item_len
    if any(r.item_len != item for r in regions):
        raise UnsupportedKVArgsError(f"group {name!r}: buffers of different slot sizes")
    return BufferGroup(
        name=name,
        kind=kind,  # type: ignore[arg-type]
        index=index,
        num_layers=len(regions) // per_layer,
        per_layer=per_layer,
        total_heads=tp,
        head_elems=item // page_size,
        dtype="uint8",
        page_size=page_size,
        buffers=tuple(regions),
    )


def _state_groups(
    args: Any, kind: MemKind, dev: int, tp: int
) -> tuple[list[BufferGroup], list[str | None]]:
    """State components -> groups; returns the groups and, per component, its index name."""
    types = [str(getattr(t, "value", t)) for t in (_get(args, "state_types") or [])]
    groups: list[BufferGroup] = []
    names: list[str | None] = []
    for i, st in enumerate(types):
        if st not in SLOT_STATES:
            raise UnsupportedKVArgsError(
                f"KVArgs.state_types[{i}] = {st!r} is not supported by kvwire-sglang (supported: "
                f"{', '.join(SLOT_STATES)}); use another --disaggregation-transfer-backend"
            )
        shard = (_get(args, "state_conv_shard_groups") or [[]] * len(types))[i]
        if any(g for g in (shard or [])):
            raise UnsupportedKVArgsError(
                f"KVArgs.state_conv_shard_groups[{i}] is set (sub-block sharded conv state); "
                "not supported by kvwire-sglang"
            )
        regs = _regions(
            args.state_data_ptrs[i],
            args.state_data_lens[i],
            args.state_item_lens[i],
            kind,
            dev,
            f"state[{i}]",
        )
        index = f"state{i}"
        by_size: dict[int, list[MemoryRegion]] = {}
        for r in regs:
            by_size.setdefault(r.item_len, []).append(r)
        for j, same in enumerate(by_size.values()):
            groups.append(_bytes_group(f"{st}{i}_{j}", index, "state", same, tp))
        names.append(index if regs else None)
    return groups, names


def build_layout(
    args: Any,
    is_mla: bool,
    facts: EngineFacts,
    kind: MemKind,
    aux_kind: MemKind,
) -> tuple[KVLayout, list[MemoryRegion], list[str | None]]:
    """The kvwire layout, aux regions and per-state-component index names of one rank.

    Called by :class:`~kvwire_sglang.conn.KvwireKVManager` (both roles, scheduler process,
    once). Raises :class:`UnsupportedKVArgsError` for what kvwire-sglang cannot move.
    """
    if _get(args, "host_kv_data_ptrs"):
        raise UnsupportedKVArgsError(
            "KVArgs.host_kv_data_ptrs is set (decode host receive); not supported"
        )
    if _get(args, "mla_compression_ratios"):
        raise UnsupportedKVArgsError(
            "KVArgs.mla_compression_ratios is set (DeepSeek V4 pools); not supported"
        )
    if _get(args, "kv_layout") not in (None, "nhd", "NHD"):
        raise UnsupportedKVArgsError(
            f"KVArgs.kv_layout = {_get(args, 'kv_layout')!r}; kvwire moves [slots, page, heads, "
            "dim] pages only"
        )
    dev = int(_get(args, "gpu_id", 0) or 0) if kind is MemKind.VRAM else 0
    page = int(args.page_size)
    n_draft = int(_get(args, "num_draft_entries", 0) or 0)
    ptrs, lens, items = list(args.kv_data_ptrs), list(args.kv_data_lens), list(args.kv_item_lens)
    cut = len(ptrs) - n_draft
    kv = _regions(ptrs[:cut], lens[:cut], items[:cut], kind, dev, "kv")
    if not kv:
        raise UnsupportedKVArgsError("KVArgs.kv_data_ptrs is empty")
    row = kv[0].item_len // page
    if kv[0].item_len % page or any(r.item_len != kv[0].item_len for r in kv):
        raise UnsupportedKVArgsError(
            f"KVArgs.kv_item_lens: target KV buffers must share one slot size divisible by "
            f"page_size {page}; got {sorted({r.item_len for r in kv})}"
        )
    dtype = DTYPES.get(str(_get(args, "kv_cache_dtype_str", "") or "").lower(), "uint8")
    size = DTYPE_SIZES[dtype]
    tp = facts.attn_tp_size
    if is_mla:
        n_layers_here = len(kv)
        heads, local = 1, 1
    else:
        got_local = _get(args, "kv_head_num") or facts.local_kv_heads
        got_total = _get(args, "total_kv_head_num") or facts.total_kv_heads
        if len(kv) % 2:
            raise UnsupportedKVArgsError(
                f"KVArgs.kv_data_ptrs: {len(kv)} target buffers, not K and V pairs"
            )
        n_layers_here = len(kv) // 2
        if got_local is None or got_total is None:
            raise UnsupportedKVArgsError(
                "KVArgs.kv_head_num/total_kv_head_num are unset and no engine facts were given "
                "(the plugin's scheduler hook provides them; see kvwire_sglang.layout.engine_facts)"
            )
        local, heads = int(got_local), int(got_total)
    if row % (local * size):
        raise UnsupportedKVArgsError(
            f"KVArgs.kv_item_lens: a token row of {row} bytes is not {local} heads of {dtype}"
        )
    start = int(_get(args, "prefill_start_layer", 0) or 0)
    end = _get(args, "prefill_end_layer")
    end = int(end) if end is not None else start + n_layers_here
    if end - start != n_layers_here:
        raise UnsupportedKVArgsError(
            f"KVArgs.prefill_start_layer/prefill_end_layer [{start}, {end}) do not match the "
            f"{n_layers_here} layers of kv_data_ptrs"
        )
    total_layers = facts.num_layers or end
    model = ModelSpec(
        num_layers=total_layers,
        total_kv_heads=heads,
        head_dim=row // (local * size),
        dtype=dtype,
        page_size=page,
        is_mla=is_mla,
    )
    rank = RankPosition(
        tp_size=tp,
        tp_rank=int(_get(args, "engine_rank", 0) or 0) % tp,
        pp_size=facts.pp_size,
        pp_rank=int(_get(args, "pp_rank", 0) or 0),
        dp_rank=int(_get(args, "system_dp_rank", 0) or 0),
    )
    groups, state_names = _state_groups(args, kind, dev, tp)
    if n_draft:
        draft = _regions(ptrs[cut:], lens[cut:], items[cut:], kind, dev, "draft kv")
        groups.insert(
            0, _bytes_group("draft", "pages", "paged", draft, tp, 1 if is_mla else 2, page)
        )
    layout = KVLayout(
        model=model, rank=rank, start_layer=start, end_layer=end, buffers=kv, groups=tuple(groups)
    )
    aux = list(
        _regions(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens, aux_kind, 0, "aux")
    )
    logger.info(
        "kvwire layout: %d layers [%d, %d) of %d, %s x %d heads (total %d) x %d, page %d, "
        "tp %d/%d, "
        "groups %s, %d aux buffers",
        n_layers_here,
        start,
        end,
        total_layers,
        dtype,
        local,
        heads,
        model.head_dim,
        page,
        rank.tp_rank,
        tp,
        [g.name for g in groups],
        len(aux),
    )
    return layout, aux, state_names
