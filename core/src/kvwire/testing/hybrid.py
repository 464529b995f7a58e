"""Prefill -> decode of the tiny hybrid model (:mod:`kvwire.testing.hybrid_model`) through
kvwire: sharded paged pools with buffer groups, real managers, real backends.

Every TP rank of each instance holds its share of the model's caches the way an engine would
register them: the attention layers' paged K/V (``KVLayout.buffers``), and as
:class:`~kvwire.layout.BufferGroup` s the sliding-window KV (``window``), the Mamba conv and
SSM states (``state``; ``conv_bc`` replicated), the GDN conv state (``state`` with three
:class:`~kvwire.layout.GroupSection` s, q, k and v, of different head counts) and delta-rule
state, and the draft layer's KV (``paged``). All
managers live in this process (threads) and talk over the selected backend and real sockets.
The instance's TP group is simulated by :class:`ShardedCache`: the model computes with every
head and each rank's arrays keep the heads that rank owns (reads gather them back), so the
tokens a decode instance generates depend on exactly the bytes kvwire moved into its pools.

:func:`run_pd` plays both engines for one request with chunked prefill and returns decode's
greedy tokens; :func:`~kvwire.testing.hybrid_model.reference_tokens` is the single-process
answer they must equal. ``corrupt`` damages decode's pools after the transfer (a negative
control: the tokens must then differ).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray
from pydantic import SecretStr

from kvwire.config import ControlOptions, KVWireConfig
from kvwire.layout import (
    BufferGroup,
    GroupSection,
    KVLayout,
    MemoryRegion,
    ModelSpec,
    RankPosition,
)
from kvwire.session import KVManager, KVPoll, KVReceiver, KVSender, Role
from kvwire.testing.hybrid_model import F32, STATES, Cache, HybridModel, HybridSpec

#: Model layer of each full-attention cache in the paged KV pool.
KV_LAYERS = {"attn0": 0, "attn1": 1}
AUX_WORDS = 16


def owned_heads(total: int, tp: int, rank: int, replicated: bool = False) -> NDArray[np.int64]:
    """Global heads a TP rank holds (GQA-style replication when ``total < tp``)."""
    if replicated:
        return np.arange(total, dtype=np.int64)
    local = max(1, total // tp)
    first = (rank // max(1, tp // total)) * local
    return np.arange(first, first + local, dtype=np.int64)


def state_elems(spec: HybridSpec, name: str, tp: int, rank: int) -> NDArray[np.int64]:
    """The elements of a state's logical array (:meth:`HybridSpec.state_shape`, flattened) a
    TP rank holds, in the order of its slot in memory."""
    heads, per = spec.state_shape(name)
    if name == "conv_bc":  # replicated
        return np.arange(heads * per, dtype=np.int64)
    if name != "conv_qkv":
        h = owned_heads(heads, tp, rank)
        return (h[:, None] * per + np.arange(per)).ravel()
    k1, off, chans = per, 0, []
    for total, dim in conv_sections(spec):  # q, k, v: each split across TP on its own
        h = owned_heads(total, tp, rank)
        chans.append(off + (h[:, None] * dim + np.arange(dim)).ravel())
        off += total * dim
    c = np.concatenate(chans)
    if spec.conv_rows:  # [k-1, local channels]
        return (c[None, :] * k1 + np.arange(k1)[:, None]).ravel()
    return (c[:, None] * k1 + np.arange(k1)[None, :]).ravel()  # [local channels, k-1]


def conv_sections(spec: HybridSpec) -> list[tuple[int, int]]:
    """(heads, channels per head) of the GDN conv state's q, k and v blocks."""
    return [
        (spec.gdn_k_heads, spec.gdn_k_dim),
        (spec.gdn_k_heads, spec.gdn_k_dim),
        (spec.gdn_v_heads, spec.gdn_v_dim),
    ]


def state_group(spec: HybridSpec, name: str, buffers: tuple[MemoryRegion, ...]) -> BufferGroup:
    """How an engine registers one state buffer of the model: heads, replicated, or (the GDN
    conv state) three sections, channel-major or row by row."""
    heads, per = spec.state_shape(name)
    common: dict[str, Any] = {"name": name, "kind": "state", "num_layers": 1, "dtype": "float32"}
    if name == "conv_qkv":
        k1 = spec.conv_k - 1
        rows = spec.conv_rows
        return BufferGroup(
            **common,
            page_size=k1 if rows else 1,
            sections=tuple(
                GroupSection(total_heads=h, head_elems=d if rows else d * k1)
                for h, d in conv_sections(spec)
            ),
            buffers=buffers,
        )
    return BufferGroup(
        **common,
        total_heads=heads,
        sharding="replicated" if name == "conv_bc" else "heads",
        head_elems=per,
        buffers=buffers,
    )


@dataclass
class RankPools:
    """One TP rank's memory: KV pool, groups, aux rows, and its :class:`KVLayout`."""

    spec: HybridSpec
    tp: int
    rank: int
    kv: dict[str, tuple[F32, F32]]
    states: dict[str, F32]
    aux: NDArray[np.int32]
    layout: KVLayout
    kv_heads: NDArray[np.int64]
    #: Per state: the logical elements this rank holds, in memory order (:func:`state_elems`).
    state_idx: dict[str, NDArray[np.int64]]

    @property
    def kv_tensors(self) -> list[F32]:
        """The paged KV buffers in layout order (``[K_0, K_1, V_0, V_1]``)."""
        return [self.kv["attn0"][0], self.kv["attn1"][0], self.kv["attn0"][1], self.kv["attn1"][1]]

    @classmethod
    def build(
        cls,
        spec: HybridSpec,
        tp: int,
        rank: int,
        slots: int,
        swa_slots: int,
        state_slots: int,
        draft: bool = True,
    ) -> RankPools:
        """Allocate zeroed pools and describe them (what an engine does at startup).
        ``draft=False`` leaves the draft layer's KV unregistered (a layout without the
        ``paged`` group, e.g. for host-pool requests, which refuse paged groups)."""
        ps, hd = spec.page_size, spec.head_dim
        kvh = owned_heads(spec.kv_heads, tp, rank)

        def pool(n: int) -> tuple[F32, F32]:
            shape = (n, ps, kvh.size, hd)
            return np.zeros(shape, np.float32), np.zeros(shape, np.float32)

        kv = {
            "attn0": pool(slots),
            "attn1": pool(slots),
            "swa": pool(swa_slots),
            "draft": pool(slots),
        }
        sidx = {n: state_elems(spec, n, tp, rank) for n in STATES}
        states = {n: np.zeros((state_slots, sidx[n].size), np.float32) for n in STATES}
        model = ModelSpec(
            num_layers=2, total_kv_heads=spec.kv_heads, head_dim=hd, dtype="float32", page_size=ps
        )
        pos = RankPosition(tp_size=tp, tp_rank=rank)

        def regions(arrs: tuple[F32, ...]) -> tuple[MemoryRegion, ...]:
            return tuple(MemoryRegion.from_tensor(a) for a in arrs)

        def kv_group(name: str, arrs: tuple[F32, F32], window: int | None) -> BufferGroup:
            return BufferGroup(
                name=name,
                kind="window" if window else "paged",
                window=window,
                num_layers=1,
                per_layer=2,
                total_heads=spec.kv_heads,
                head_elems=hd,
                dtype="float32",
                page_size=ps,
                buffers=regions(arrs),
            )

        groups = [
            kv_group("swa", kv["swa"], spec.window),
            *([kv_group("draft", kv["draft"], None)] if draft else []),
            *(state_group(spec, n, regions((states[n],))) for n in STATES),
        ]
        kv_bufs = [kv["attn0"][0], kv["attn1"][0], kv["attn0"][1], kv["attn1"][1]]  # K.., V..
        layout = KVLayout.from_tensors(
            model,
            kv_bufs,
            pos,
            groups=groups,
            group_tensors=[*kv["swa"], *(kv["draft"] if draft else ()), *states.values()],
        )
        aux = np.zeros((64, AUX_WORDS), np.int32)
        return cls(spec, tp, rank, kv, states, aux, layout, kvh, sidx)


class ShardedCache(Cache):
    """One request's caches across the TP ranks of an instance, through its page tables."""

    def __init__(
        self, ranks: list[RankPools], pages: list[int], swa: dict[int, int], slot: int
    ) -> None:
        self.ranks, self.pages, self.swa, self.slot = ranks, pages, swa, slot
        self.ps = ranks[0].spec.page_size

    def _where(self, layer: str, pos: NDArray[np.int64]) -> tuple[NDArray[np.int64], ...]:
        pages = pos // self.ps
        if layer == "swa":  # only the window's pages exist here: a KeyError shows a gap
            slots = np.array([self.swa[int(p)] for p in pages], dtype=np.int64)
        else:
            slots = np.asarray(self.pages, dtype=np.int64)[pages]
        return slots, pos % self.ps

    def write_kv(self, layer: str, pos: int, k: F32, v: F32) -> None:
        slot, t = self._where(layer, np.array([pos]))
        for r in self.ranks:
            kk, vv = r.kv[layer]
            kk[slot[0], t[0]] = k[r.kv_heads]
            vv[slot[0], t[0]] = v[r.kv_heads]

    def read_kv(self, layer: str, lo: int, hi: int) -> tuple[F32, F32]:
        spec = self.ranks[0].spec
        slot, t = self._where(layer, np.arange(lo, hi))
        k = np.zeros((hi - lo, spec.kv_heads, spec.head_dim), np.float32)
        v = np.zeros_like(k)
        for r in self.ranks:  # later ranks holding a replicated head read the same bytes
            kk, vv = r.kv[layer]
            k[:, r.kv_heads] = kk[slot, t]
            v[:, r.kv_heads] = vv[slot, t]
        return k, v

    def read_state(self, name: str) -> F32:
        shape = self.ranks[0].spec.state_shape(name)
        out = np.zeros(shape[0] * shape[1], np.float32)
        for r in self.ranks:
            out[r.state_idx[name]] = r.states[name][self.slot]
        return out.reshape(shape)

    def write_state(self, name: str, value: F32) -> None:
        flat = value.ravel()
        for r in self.ranks:
            r.states[name][self.slot] = flat[r.state_idx[name]]


@dataclass
class DecodeView:
    """Where decode keeps the request (what a corruption hook may damage)."""

    ranks: list[RankPools]
    pages: list[int]
    swa: dict[int, int]
    slot: int
    num_tokens: int
    window_pages: list[int] = field(default_factory=list)


Corruption = Callable[[DecodeView], None]


def _noise(shape: tuple[int, ...]) -> F32:
    return (np.random.default_rng(99).standard_normal(shape) * 10).astype(np.float32)


def _corrupt_state(v: DecodeView) -> None:
    arr = v.ranks[0].states["ssm"]
    arr[v.slot] = _noise(arr[v.slot].shape)


def _corrupt_sections(v: DecodeView) -> None:
    """Damage the GDN conv state's value section (every value head on decode rank 0)."""
    spec = v.ranks[0].spec
    k1 = spec.conv_k - 1
    nq, nk, nv = spec.gdn_channels
    want = np.arange((nq + nk) * k1, (nq + nk + nv) * k1)  # its logical elements
    r = v.ranks[0]
    hit = np.isin(r.state_idx["conv_qkv"], want)
    r.states["conv_qkv"][v.slot, hit] = _noise((int(hit.sum()),))


def _corrupt_kv(layer: str) -> Corruption:
    def hit(v: DecodeView) -> None:
        page = (v.num_tokens - 1) // v.ranks[0].spec.page_size
        slot = v.swa[page] if layer == "swa" else v.pages[page]
        k = v.ranks[0].kv[layer][0]
        k[slot] = _noise(k[slot].shape)

    return hit


#: Negative controls: damage one thing kvwire moved into decode's pools.
CORRUPTIONS: dict[str, Corruption] = {
    "state": _corrupt_state,
    "sections": _corrupt_sections,
    "page": _corrupt_kv("attn1"),
    "window": _corrupt_kv("swa"),
    "draft": _corrupt_kv("draft"),
}


def config(
    backend: str = "tcp",
    secret: str | None = None,
    staging: str = "direct",
    checksum: bool = False,
) -> KVWireConfig:
    """A config for in-process managers on a loaded machine (relaxed heartbeats);
    ``checksum``: decode checks KV and buffer-group checksums."""
    return KVWireConfig(
        transfer_backend=backend,
        staging=staging,
        control=ControlOptions(
            heartbeat_interval_s=0.5,
            handshake_timeout_s=10.0,
            num_workers=1,
            kv_checksum=checksum,
        ),
        secret=SecretStr(secret) if secret is not None else None,
    )


def _wait(pred: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s")
        time.sleep(0.002)


@contextlib.contextmanager
def instances(
    cfg: KVWireConfig, pre: list[RankPools], dec: list[RankPools]
) -> Iterator[tuple[list[KVManager], list[KVManager], str]]:
    """A prefill instance and a decode instance over these pools, as managers in this process
    (prefill rank 0 runs the bootstrap service): ``(prefill managers, decode managers,
    bootstrap address)``; every manager is closed on exit."""
    mgrs: list[KVManager] = []
    try:
        for r in pre:
            mgrs.append(
                KVManager(
                    cfg,
                    Role.PREFILL,
                    r.layout,
                    bootstrap_addr=mgrs[0].bootstrap_addr if mgrs else None,
                    aux_buffers=[MemoryRegion.from_tensor(r.aux)],
                    kv_tensors=r.kv_tensors,
                )
            )
        for r in dec:
            mgrs.append(
                KVManager(
                    cfg,
                    Role.DECODE,
                    r.layout,
                    aux_buffers=[MemoryRegion.from_tensor(r.aux)],
                    kv_tensors=r.kv_tensors,
                )
            )
        addr = mgrs[0].bootstrap_addr
        assert addr is not None
        yield mgrs[: len(pre)], mgrs[len(pre) :], addr
    finally:
        for m in reversed(mgrs):
            m.close()


@dataclass
class PDResult:
    """What one request through :func:`run_pd` produced."""

    #: Decode's greedy tokens (the first from prefill's aux row).
    tokens: list[int]
    #: Bytes and descriptors each prefill rank moved for the request (KV chunks, groups, aux).
    bytes_sent: list[int]
    descriptors: list[int]
    #: Transfers each prefill rank posted (chunk parts, groups, aux).
    transfers: list[int] = field(default_factory=list)


def run_pd(
    spec: HybridSpec,
    prompt: list[int],
    n_gen: int,
    prefill_tp: int,
    decode_tp: int,
    chunk_pages: int = 2,
    cfg: KVWireConfig | None = None,
    corrupt: Corruption | None = None,
    slots: int = 16,
    layerwise: bool = False,
) -> PDResult:
    """One request through kvwire: chunked prefill on ``prefill_tp`` ranks, transfer, then
    ``n_gen`` greedy tokens on ``decode_tp`` ranks. Returns decode's tokens (the first one
    comes from prefill through the aux row). ``layerwise``: each chunk is sent layer-wise
    *before* it is computed, and its layers are marked after (a gate that let KV move early
    would move pages not written yet, and the tokens would differ)."""
    cfg = cfg or config()
    model = HybridModel(spec)
    ps, n = spec.page_size, len(prompt)
    num_pages = math.ceil(n / ps)
    total_pages = math.ceil((n + n_gen) / ps)
    first_wp = max(0, (n - spec.window) // ps)  # the window's first page
    rng = np.random.default_rng(7)
    p_pages = rng.permutation(slots)[:num_pages].tolist()
    d_pages = rng.permutation(slots)[:total_pages].tolist()
    p_swa = dict(enumerate(rng.permutation(slots)[:num_pages].tolist()))
    d_swa = dict(zip(range(first_wp, total_pages), rng.permutation(slots).tolist(), strict=False))
    p_slot, d_slot, room = 2, 1, 4242
    pre = [RankPools.build(spec, prefill_tp, r, slots, slots, 4) for r in range(prefill_tp)]
    dec = [RankPools.build(spec, decode_tp, r, slots, slots, 4) for r in range(decode_tp)]
    with instances(cfg, pre, dec) as (pmgrs, dmgrs, addr):
        window = {"state": [d_slot], "window": [d_swa[p] for p in range(first_wp, num_pages)]}
        rxs = [m.receiver(room, addr) for m in dmgrs]
        for rx in rxs:
            rx.init()
            rx.send_metadata(d_pages[:num_pages], aux_index=3, state_indices=window)
        txs = [m.sender(room) for m in pmgrs]
        _wait(lambda: all(t.poll() >= KVPoll.WaitingForInput for t in txs), "prefill ready")
        for tx in txs:
            tx.init(num_pages, aux_index=5)
        cache = ShardedCache(pre, p_pages, p_swa, p_slot)
        step = chunk_pages * ps
        for start in range(0, n, step):
            end = min(n, start + step)
            last = end == n
            state: dict[str, Any] | None = None
            if last:
                state = {"state": p_slot, "window": [p_swa[p] for p in range(first_wp, num_pages)]}
            pages = p_pages[start // ps : math.ceil(end / ps)]
            if layerwise:
                for tx in txs:
                    tx.send(pages, last=last, state_indices=state, layerwise=True)
            first = model.prefill(cache, prompt[start:end], start)
            if last:
                for r in pre:
                    r.aux[5, 0] = first
            for tx in txs:
                if layerwise:  # the model's first KV layer, then the rest
                    tx.layer_ready(KV_LAYERS["attn0"])
                    tx.layer_ready(None)
                else:
                    tx.send(pages, last=last, state_indices=state)
        handles: list[KVReceiver | KVSender] = [*rxs, *txs]
        _wait(lambda: all(h.poll() in (KVPoll.Success, KVPoll.Failed) for h in handles), "done")
        for h in handles:
            if h.poll() is KVPoll.Failed:
                h.failure_exception()
        first_token = int(dec[0].aux[3, 0])
        sent = [t.metrics.bytes for t in txs]
        descs = [t.metrics.descriptors for t in txs]
        transfers = [t.metrics.chunks for t in txs]
        view = DecodeView(dec, d_pages, d_swa, d_slot, n)
        if corrupt is not None:
            corrupt(view)
        for h in handles:
            h.clear()
        tokens = model.decode(ShardedCache(dec, d_pages, d_swa, d_slot), first_token, n, n_gen)
        return PDResult(tokens, sent, descs, transfers)


def checked_groups(
    backend: str, spec: HybridSpec, prompt: list[int], n_gen: int
) -> tuple[bool, str]:
    """Decode checking KV and buffer-group checksums over ``backend``, TP 2 -> 1: whether the
    tokens equal a single process's, and the error of the same request run again with one
    bit of its first landed group row flipped (:func:`kvwire.testing.faults.
    landed_group_flipper`; "" when it did not fail). For each backend's test suite."""
    from kvwire.errors import KVWireError
    from kvwire.session.group_sums import LandedGroupSums
    from kvwire.testing.faults import landed_group_flipper
    from kvwire.testing.hybrid_model import reference_tokens

    cfg = config(backend, checksum=True)
    tokens = run_pd(spec, prompt, n_gen, 2, 1, cfg=cfg).tokens
    original = LandedGroupSums.sums
    LandedGroupSums.sums = landed_group_flipper()  # type: ignore[method-assign]
    try:
        run_pd(spec, prompt, n_gen, 2, 1, cfg=cfg)
        error = ""
    except KVWireError as exc:
        error = str(exc)
    finally:
        LandedGroupSums.sums = original  # type: ignore[method-assign]
    return tokens == reference_tokens(spec, prompt, n_gen), error
