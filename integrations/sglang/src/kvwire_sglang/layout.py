"""SGLang's ``KVArgs`` -> a kvwire :class:`~kvwire.layout.KVLayout`.

Both roles build their kvwire layout from the ``KVArgs`` SGLang fills at scheduler start
(``PrefillBootstrapQueue._init_kv_manager`` / ``DecodePreallocQueue._init_kv_manager``), in
:class:`~kvwire_sglang.conn.KvwireKVManager`'s constructor. ``KVArgs`` carries raw pointers and
byte sizes only; the model facts kvwire also needs (total KV heads, layers, TP/PP/DP shape) come
from :class:`~kvwire_sglang.facts.EngineFacts`, which the plugin's hooks read from SGLang's
scheduler while it builds the manager (:func:`~kvwire_sglang.facts.engine_facts` sets them
explicitly, e.g. in tests).

What maps, and how:

* ``kv_data_ptrs/lens/item_lens`` (``[K_0..K_{L-1}, V_0..V_{L-1}]``; MLA: one per layer) ->
  ``KVLayout.buffers``; ``kv_cache_dtype_str`` -> ``ModelSpec.dtype`` (bytes when unknown);
  ``prefill_start_layer``/``prefill_end_layer`` -> the PP stage's layer range.
* the draft model's KV appended to them (``num_draft_entries``) -> a ``paged`` group "draft":
  heads-sharded when :class:`EngineFacts` give the draft's heads, replicated for MLA, else
  opaque pages (equal TP).
* ``aux_data_*`` -> aux regions (one per metadata buffer, same rows).
* ``state_types`` components (component ``i`` is addressed by ``state_indices`` entry
  ``"state{i}"``):

  - ``"mamba"``: a ``state`` group per state tensor; from ``state_dim_per_tensor`` a tensor
    TP splits in one contiguous run per rank is ``dim x tp`` heads (kvwire moves head slices
    between TP sizes), dim 0 is replicated, GDN's conv state with ``state_conv_shard_groups``
    (its q, k and v channel blocks) becomes a group with one kvwire section per block (each
    sliced across TP on its own), and a tensor with ``state_slice_outer_counts`` > 1, blocks
    that do not split evenly, or no dims moves as opaque slots (equal TP).
  - ``"request_row"``: opaque slots, one per slot size (equal TP).
  - ``"swa"``: a ``window`` group (``window`` from :class:`EngineFacts`, heads as the KV's).
  - ``"dsa"``: a ``paged`` group addressed by the KV pages (replicated; 0-row placeholder
    layers left out); SGLang's payload for it is not passed on (kvwire uses the KV pages).

A group described as opaque bytes has ``tp`` "heads" of its slot bytes, so it equals the peer's
only when both have the same attention TP: a mismatch is refused at handshake, naming the
group. Everything else in ``KVArgs`` that would change what must move (other state types, host
destinations, KV layouts other than SGLang's default) raises :class:`UnsupportedKVArgsError`
naming the field.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvwire.layout import (
    DTYPE_SIZES,
    BufferGroup,
    GroupSection,
    KVLayout,
    MemKind,
    MemoryRegion,
    ModelSpec,
    RankPosition,
)
from kvwire_sglang.facts import EngineFacts

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

#: SGLang ``state_types`` kvwire-sglang moves (see :func:`_state_groups`).
SUPPORTED_STATES = ("mamba", "request_row", "swa", "dsa")


class UnsupportedKVArgsError(ValueError):
    """A ``KVArgs`` field describes something kvwire-sglang cannot move; names the field."""


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
    window: int | None = None,
) -> BufferGroup:
    """A group moved as whole opaque slots: ``tp`` heads of the slot's bytes, one per rank, so
    its description equals the peer's only when both have the same TP."""
    item = _one_item_len(name, regions)
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
        window=window,
        buffers=tuple(regions),
    )


def _sharded_group(
    name: str,
    index: str,
    kind: str,
    regions: Sequence[MemoryRegion],
    tp: int,
    local_heads: int,
    total_heads: int | None,
    per_layer: int = 1,
    page_size: int = 1,
    window: int | None = None,
) -> BufferGroup:
    """A group whose slot rows are ``local_heads`` equal runs of bytes, one per head
    (``total_heads=None``: every rank holds all of them, ``sharding="replicated"``). kvwire
    then moves head slices between different TP sizes."""
    item = _one_item_len(name, regions)
    return BufferGroup(
        name=name,
        kind=kind,  # type: ignore[arg-type]
        index=index,
        num_layers=len(regions) // per_layer,
        per_layer=per_layer,
        total_heads=local_heads if total_heads is None else total_heads,
        sharding="replicated" if total_heads is None else "heads",
        head_elems=item // (page_size * local_heads),
        dtype="uint8",
        page_size=page_size,
        window=window,
        buffers=tuple(regions),
    )


def _conv_sections(
    full: Sequence[Any], local: int, row_bytes: int, tp: int
) -> tuple[GroupSection, ...] | None:
    """GDN conv sub-blocks (``state_conv_shard_groups``: each block's channels in the whole
    model, e.g. q, k, v) as kvwire sections of one channel row (``row_bytes``: ``K-1``
    elements) per "head", or None when the blocks do not split evenly into the ``local``
    channels this rank holds (a block with fewer heads than ranks is replicated by SGLang)."""
    dims = [int(x) for x in full]
    if len(dims) < 2 or any(d % tp for d in dims) or sum(d // tp for d in dims) != local:
        return None
    return tuple(GroupSection(total_heads=d, head_elems=row_bytes) for d in dims)


def _sectioned_group(
    name: str, index: str, regions: Sequence[MemoryRegion], sections: tuple[GroupSection, ...]
) -> BufferGroup:
    """A state group whose slot row is several separately TP-sharded blocks (GDN's conv
    state: q, k and v channels, each a run of channel rows): kvwire slices each block across
    TP sizes (:attr:`BufferGroup.sections <kvwire.layout.BufferGroup.sections>`)."""
    _one_item_len(name, regions)
    return BufferGroup(
        name=name,
        kind="state",
        index=index,
        num_layers=len(regions),
        dtype="uint8",
        sections=sections,
        buffers=tuple(regions),
    )


def _one_item_len(name: str, regions: Sequence[MemoryRegion]) -> int:
    item = regions[0].item_len
    if any(r.item_len != item for r in regions):
        raise UnsupportedKVArgsError(
            f"group {name!r}: buffers of different slot sizes "
            f"{sorted({r.item_len for r in regions})}"
        )
    return item


def _component_field(args: Any, name: str, i: int, n: int) -> list[Any]:
    """``KVArgs.<name>[i]`` padded to ``n`` entries with None (SGLang leaves the per-tensor
    lists empty when a pool does not report them)."""
    rows = _get(args, name) or []
    row = list(rows[i]) if i < len(rows) and rows[i] is not None else []
    return row + [None] * (n - len(row)) if len(row) < n else row[:n]


def _tensor_runs(
    layer_ids: Sequence[Any], item_lens: Sequence[int], dims: Sequence[Any]
) -> list[tuple[int, int]]:
    """Split a Mamba component's entries (SGLang orders them tensor-major, then by layer) into
    ``(start, end)`` runs of one state tensor each: ``len(set(layer_ids))`` layers per tensor
    when SGLang reports layer ids, else maximal runs of equal slot size and slice dim."""
    n = len(item_lens)
    ids = [x for x in layer_ids if x is not None]
    layers = len(set(ids)) if len(ids) == n and n else 0
    if layers and n % layers == 0:
        return [(s, s + layers) for s in range(0, n, layers)]
    runs: list[tuple[int, int]] = []
    for j in range(n):
        if runs and (item_lens[j], dims[j]) == (item_lens[runs[-1][0]], dims[runs[-1][0]]):
            runs[-1] = (runs[-1][0], j + 1)
        else:
            runs.append((j, j + 1))
    return runs


def _mamba_groups(
    args: Any, i: int, regs: Sequence[MemoryRegion], tp: int, index: str
) -> list[BufferGroup]:
    """A ``"mamba"`` component: one ``state`` group per state tensor (conv, temporal, ...).

    SGLang 0.5.23 reports per tensor (``MambaPool.get_state_dim_per_tensor``) the size of the
    axis TP splits on this rank (0: replicated on every rank), the rows before that axis
    (``state_slice_outer_counts``) and GDN's conv sub-blocks (``state_conv_shard_groups``).
    A tensor split along its first per-slot axis into one contiguous run per rank is described
    as ``dim * tp`` heads of ``item_len / dim`` bytes (kvwire moves head slices between TP
    sizes); a replicated one as ``sharding="replicated"``; a conv state with sub-blocks as
    one section per block (:func:`_conv_sections`); anything else (outer rows, sub-blocks that
    do not split evenly, no dims reported) as opaque slots, which need equal TP on both
    sides.
    """
    n = len(regs)
    dims = _component_field(args, "state_dim_per_tensor", i, n)
    outer = _component_field(args, "state_slice_outer_counts", i, n)
    shards = _component_field(args, "state_conv_shard_groups", i, n)
    layer_ids = _component_field(args, "state_layer_ids", i, n)
    groups = []
    for t, (a, b) in enumerate(_tensor_runs(layer_ids, [r.item_len for r in regs], dims)):
        name = f"mamba{i}_{t}"
        part, item = regs[a:b], regs[a].item_len
        dim = dims[a]
        if any(
            (dims[j], outer[j] or 1, bool(shards[j])) != (dim, outer[a] or 1, bool(shards[a]))
            for j in range(a, b)
        ):
            raise UnsupportedKVArgsError(
                f"KVArgs.state_dim_per_tensor[{i}]/state_slice_outer_counts[{i}]: the entries "
                f"{a}..{b - 1} of state tensor {t} differ between layers"
            )
        why = None
        if dim is None:
            why = "no state_dim_per_tensor"
        elif (outer[a] or 1) != 1:
            why = f"state_slice_outer_counts {outer[a]} (several runs per rank)"
        elif int(dim) and item % int(dim):
            why = f"item_len {item} is not {dim} equal rows"
        elif shards[a] and int(dim):
            sections = _conv_sections(shards[a], int(dim), item // int(dim), tp)
            if sections is None:
                why = (
                    f"state_conv_shard_groups {shards[a]} do not split into {dim} channels "
                    f"per rank at TP {tp} (sub-blocks with fewer heads than ranks)"
                )
            else:
                groups.append(_sectioned_group(name, index, part, sections))
                continue
        if why is None and int(dim) == 0:
            groups.append(_sharded_group(name, index, "state", part, tp, 1, None))
        elif why is None:
            groups.append(_sharded_group(name, index, "state", part, tp, int(dim), int(dim) * tp))
        else:
            logger.info(
                "kvwire: state tensor %s moves as opaque slots (equal TP only): %s", name, why
            )
            groups.append(_bytes_group(name, index, "state", part, tp))
    return groups


def _state_groups(
    args: Any,
    kind: MemKind,
    dev: int,
    tp: int,
    facts: EngineFacts,
    kv_heads: tuple[int, int] | None,
    page: int,
) -> tuple[list[BufferGroup], list[str | None]]:
    """State components -> groups; returns the groups and, per component, its index name
    (None: the component needs no ``state_indices`` on kvwire's side). ``kv_heads``:
    (local, total) KV heads (None for MLA)."""
    types = [str(getattr(t, "value", t)) for t in (_get(args, "state_types") or [])]
    groups: list[BufferGroup] = []
    names: list[str | None] = []
    for i, st in enumerate(types):
        if st not in SUPPORTED_STATES:
            raise UnsupportedKVArgsError(
                f"KVArgs.state_types[{i}] = {st!r} is not supported by kvwire-sglang (supported: "
                f"{', '.join(SUPPORTED_STATES)}); use another --disaggregation-transfer-backend"
            )
        ptrs, lens, items = (
            args.state_data_ptrs[i],
            args.state_data_lens[i],
            args.state_item_lens[i],
        )
        if st == "dsa":  # layers holding no index keys register 0-row placeholders
            keep = [j for j in range(len(ptrs)) if int(lens[j]) > 0 and int(items[j]) > 0]
            ptrs, lens, items = (
                [ptrs[j] for j in keep],
                [lens[j] for j in keep],
                [items[j] for j in keep],
            )
        regs = _regions(ptrs, lens, items, kind, dev, f"state[{i}]")
        index = f"state{i}"
        if not regs:
            names.append(None)
            continue
        if st == "mamba":
            groups += _mamba_groups(args, i, regs, tp, index)
        elif st == "request_row":
            by_size: dict[int, list[MemoryRegion]] = {}
            for r in regs:
                by_size.setdefault(r.item_len, []).append(r)
            for j, same in enumerate(by_size.values()):
                groups.append(_bytes_group(f"{st}{i}_{j}", index, "state", same, tp))
        elif st == "swa":
            groups.append(_swa_group(args, i, regs, tp, facts, kv_heads, page, index))
        else:  # dsa: the indexer's pages, addressed like the KV
            groups.append(_dsa_group(i, regs, tp, page))
            names.append(None)
            continue
        names.append(index)
    return groups, names


def _swa_group(
    args: Any,
    i: int,
    regs: Sequence[MemoryRegion],
    tp: int,
    facts: EngineFacts,
    kv_heads: tuple[int, int] | None,
    page: int,
    index: str,
) -> BufferGroup:
    """A ``"swa"`` component (``SWAKVPool``: the window layers' own paged pool, ``[K..., V...]``
    like the KV, addressed by that pool's pages of the request's window) -> a ``window`` group.
    Heads as the full-attention KV's (``kv_head_num``; SGLang's own head-slice transfer of this
    pool assumes the same), so heterogeneous TP works; MLA windows move whole (replicated)."""
    layout = _get(args, "swa_kv_cache_layout")
    if layout not in (None, "nhd", "NHD"):
        raise UnsupportedKVArgsError(
            f"KVArgs.swa_kv_cache_layout = {layout!r}; kvwire moves [slots, page, heads, dim] "
            "pages only"
        )
    if facts.sliding_window is None:
        raise UnsupportedKVArgsError(
            f"KVArgs.state_types[{i}] = 'swa' needs the sliding window size, which KVArgs lacks "
            "(the plugin's scheduler hook reads scheduler.sliding_window_size; in tests pass "
            "EngineFacts(sliding_window=...))"
        )
    if len(regs) % 2:
        raise UnsupportedKVArgsError(
            f"KVArgs.state_data_ptrs[{i}]: {len(regs)} SWA buffers, not K and V pairs"
        )
    name, item, w = f"swa{i}", regs[0].item_len, facts.sliding_window
    if kv_heads is None:
        return _sharded_group(name, index, "window", regs, tp, 1, None, 2, page, w)
    local, total = kv_heads
    if item % (page * local):
        raise UnsupportedKVArgsError(
            f"KVArgs.state_item_lens[{i}]: an SWA page of {item} bytes is not {page} rows of "
            f"{local} heads (kv_head_num)"
        )
    return _sharded_group(name, index, "window", regs, tp, local, total, 2, page, w)


def _dsa_group(i: int, regs: Sequence[MemoryRegion], tp: int, page: int) -> BufferGroup:
    """A ``"dsa"`` component (DeepSeek V3.2's indexer keys, one buffer per layer, addressed by
    the KV's own pages on decode's page size) -> a ``paged`` group, whole pages, every rank
    holding all of it (sent once). Layers holding no index keys (0-row placeholders) are left
    out on both sides alike."""
    item = _one_item_len(f"dsa{i}", regs)
    if item % page:
        raise UnsupportedKVArgsError(
            f"KVArgs.state_item_lens[{i}]: a DSA indexer page of {item} bytes is not "
            f"page_size {page} rows"
        )
    return _sharded_group(f"dsa{i}", "pages", "paged", regs, tp, 1, None, 1, page)


def _draft_group(
    regs: Sequence[MemoryRegion], tp: int, is_mla: bool, facts: EngineFacts, page: int
) -> BufferGroup:
    """The draft model's KV (``num_draft_entries`` appended to ``kv_data_ptrs``, same page
    indices) -> a ``paged`` group "draft". MLA: one latent per layer every rank holds whole
    (replicated). MHA/GQA: heads-sharded when the engine facts give the draft's heads (the
    plugin reads them from the draft pool and draft model config), else opaque pages (equal TP
    on both sides)."""
    if is_mla:
        return _sharded_group("draft", "pages", "paged", regs, tp, 1, None, 1, page)
    if len(regs) % 2:
        raise UnsupportedKVArgsError(
            f"KVArgs.num_draft_entries = {len(regs)}: draft KV buffers are not K and V pairs"
        )
    local, total = facts.draft_local_kv_heads, facts.draft_total_kv_heads
    if (
        local is not None
        and total is not None
        and local == max(1, total // tp)
        and not regs[0].item_len % (page * local)
    ):
        return _sharded_group("draft", "pages", "paged", regs, tp, local, total, 2, page)
    logger.info("kvwire: draft KV moves as opaque pages (equal TP only): no draft head facts")
    return _bytes_group("draft", "pages", "paged", regs, tp, 2, page)


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
    groups, state_names = _state_groups(
        args, kind, dev, tp, facts, None if is_mla else (local, heads), page
    )
    if n_draft:
        draft = _regions(ptrs[cut:], lens[cut:], items[cut:], kind, dev, "draft kv")
        groups.insert(0, _draft_group(draft, tp, is_mla, facts, page))
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
