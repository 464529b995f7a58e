"""A tiny hybrid language model with random weights, for proving buffer groups by computation.

Per token (NumPy, ``float32``, fixed seed), the residual stream goes through:

1. ``attn0``: full attention, GQA (``q_heads`` query heads over ``kv_heads`` KV heads), its KV
   in the paged pool (model layer 0);
2. ``mamba``: a Mamba-style recurrent layer with per-request state: a causal depthwise conv
   over the last ``conv_k`` inputs (conv state ``conv_x`` split by heads, ``conv_bc`` for the
   B/C projections, replicated on every TP rank as with one SSM group) and a selective state
   ``S_h = a_h S_h + x_h B^T`` per head (``ssm``, split by heads), output ``S_h C``;
3. ``gdn``: a gated-delta-net layer (Qwen3-Next style linear attention) with ``gdn_k_heads``
   query/key heads and ``gdn_v_heads`` value heads: a causal depthwise conv over the q, k and v
   channels (conv state ``conv_qkv``, ``[channels, conv_k-1]``: three blocks that TP splits
   separately, a multi-section state) and a per-value-head delta-rule state ``delta``
   (``S_h = a_h S_h + beta_h (v_h - S_h k) k^T``, output ``S_h q``, split by value heads);
4. ``swa``: sliding-window attention over the last ``window`` tokens (its own paged pool);
5. ``attn1``: full attention (paged pool, model layer 1);
6. ``draft``: a draft-model attention layer over the final hidden state (its KV is an extra
   paged layer); its logits are added to the target's, so decode's tokens depend on it.

The model reads and writes its caches through :class:`Cache` only; :class:`DenseCache` is the
single-process reference, :mod:`kvwire.testing.hybrid` the sharded paged pools kvwire moves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

F32 = NDArray[np.float32]

#: Attention caches (K and V per token) and the state buffers of the model.
ATTN = ("attn0", "swa", "attn1", "draft")
STATES = ("conv_x", "conv_bc", "ssm", "conv_qkv", "delta")


@dataclass(frozen=True)
class HybridSpec:
    """Sizes of the model (small enough for a unit test, every head count > 1)."""

    vocab: int = 48
    d: int = 16
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 4
    mamba_heads: int = 4
    mamba_p: int = 4
    mamba_n: int = 4
    conv_k: int = 3
    gdn_k_heads: int = 2
    gdn_v_heads: int = 4
    gdn_k_dim: int = 2
    gdn_v_dim: int = 3
    #: The GDN conv state is stored ``[conv_k-1, channels]`` (row by row, registered with
    #: ``page_size=conv_k-1``) instead of channel-major ``[channels, conv_k-1]``.
    conv_rows: bool = False
    window: int = 6
    page_size: int = 4
    seed: int = 1234

    @property
    def gdn_channels(self) -> tuple[int, int, int]:
        """Channels of the GDN conv's q, k and v blocks."""
        qk = self.gdn_k_heads * self.gdn_k_dim
        return qk, qk, self.gdn_v_heads * self.gdn_v_dim

    def state_shape(self, name: str) -> tuple[int, int]:
        """Logical shape of a state buffer: (heads, elements per head) as split across TP
        ranks, or ``(channels, conv_k-1)`` for the GDN conv state (three sections)."""
        k1 = self.conv_k - 1
        return {
            "conv_x": (self.mamba_heads, k1 * self.mamba_p),
            "conv_bc": (1, k1 * 2 * self.mamba_n),
            "ssm": (self.mamba_heads, self.mamba_p * self.mamba_n),
            "conv_qkv": (sum(self.gdn_channels), k1),
            "delta": (self.gdn_v_heads, self.gdn_v_dim * self.gdn_k_dim),
        }[name]


class Cache(ABC):
    """Where the model keeps one request's KV and state (read and written per token)."""

    @abstractmethod
    def write_kv(self, layer: str, pos: int, k: F32, v: F32) -> None:
        """Store K and V (``[kv_heads, head_dim]``) of token ``pos``."""

    @abstractmethod
    def read_kv(self, layer: str, lo: int, hi: int) -> tuple[F32, F32]:
        """K and V of tokens ``[lo, hi)``, ``[n, kv_heads, head_dim]``."""

    @abstractmethod
    def read_state(self, name: str) -> F32:
        """A state buffer, ``[heads, elems]`` (zeros for a new request)."""

    @abstractmethod
    def write_state(self, name: str, value: F32) -> None:
        """Replace a state buffer."""


class DenseCache(Cache):
    """The single-process reference: plain arrays, no pages, no ranks."""

    def __init__(self, spec: HybridSpec, max_tokens: int = 256) -> None:
        shape = (max_tokens, spec.kv_heads, spec.head_dim)
        self.kv = {n: (np.zeros(shape, np.float32), np.zeros(shape, np.float32)) for n in ATTN}
        self.states = {n: np.zeros(spec.state_shape(n), np.float32) for n in STATES}

    def write_kv(self, layer: str, pos: int, k: F32, v: F32) -> None:
        self.kv[layer][0][pos] = k
        self.kv[layer][1][pos] = v

    def read_kv(self, layer: str, lo: int, hi: int) -> tuple[F32, F32]:
        k, v = self.kv[layer]
        return k[lo:hi], v[lo:hi]

    def read_state(self, name: str) -> F32:
        return self.states[name].copy()

    def write_state(self, name: str, value: F32) -> None:
        self.states[name] = value.astype(np.float32)


def _silu(x: F32) -> F32:
    out: F32 = (x * (0.5 + 0.5 * np.tanh(0.5 * x))).astype(np.float32)  # no overflow
    return out


class HybridModel:
    """Random weights (fixed seed) and the per-token forward pass."""

    def __init__(self, spec: HybridSpec) -> None:
        self.spec = s = spec
        rng = np.random.default_rng(spec.seed)

        def w(*shape: int, scale: float | None = None) -> F32:
            sc = scale if scale is not None else 1.0 / np.sqrt(shape[0])
            return (rng.standard_normal(shape) * sc).astype(np.float32)

        qd, kvd = s.q_heads * s.head_dim, s.kv_heads * s.head_dim
        md = s.mamba_heads * s.mamba_p
        self.embed = w(s.vocab, s.d, scale=1.0)
        self.attn = {n: (w(s.d, qd), w(s.d, kvd), w(s.d, kvd), w(qd, s.d)) for n in ATTN}
        self.w_x, self.w_bc, self.w_a = w(s.d, md), w(s.d, 2 * s.mamba_n), w(s.d, s.mamba_heads)
        self.conv_x = w(s.conv_k, md, scale=0.7)
        self.conv_bc = w(s.conv_k, 2 * s.mamba_n, scale=0.7)
        self.w_my = w(md, s.d)
        conv_dim = sum(s.gdn_channels)
        self.w_qkv = w(s.d, conv_dim)
        self.conv_qkv = w(conv_dim, s.conv_k, scale=0.7)
        self.w_beta, self.w_g = w(s.d, s.gdn_v_heads), w(s.d, s.gdn_v_heads)
        self.w_go = w(s.gdn_v_heads * s.gdn_v_dim, s.d, scale=1.5)  # a strong path to the logits
        self.out, self.draft_out = w(s.d, s.vocab), w(s.d, s.vocab)

    def _attention(self, cache: Cache, name: str, x: F32, pos: int, lo: int) -> F32:
        s = self.spec
        wq, wk, wv, wo = self.attn[name]
        q = (x @ wq).reshape(s.q_heads, s.head_dim)
        cache.write_kv(
            name, pos, (x @ wk).reshape(s.kv_heads, s.head_dim), (x @ wv).reshape(s.kv_heads, -1)
        )
        k, v = cache.read_kv(name, lo, pos + 1)  # [n, kv_heads, hd]
        group = s.q_heads // s.kv_heads
        kk = np.repeat(k, group, axis=1)  # GQA: each KV head serves `group` query heads
        vv = np.repeat(v, group, axis=1)
        scores = np.einsum("hd,nhd->hn", q, kk) / np.float32(np.sqrt(s.head_dim))
        scores -= scores.max(axis=1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=1, keepdims=True)
        o = np.einsum("hn,nhd->hd", p, vv).reshape(-1)
        out: F32 = (o @ wo).astype(np.float32)
        return out

    def _conv(self, cache: Cache, name: str, w: F32, x: F32) -> F32:
        """Causal depthwise conv over the last ``conv_k`` inputs; the state keeps ``k-1``."""
        k1 = self.spec.conv_k - 1
        heads, _ = self.spec.state_shape(name)
        prev = cache.read_state(name).reshape(heads, k1, -1)  # [heads, k-1, per-head channels]
        cur = x.reshape(heads, 1, -1)
        win = np.concatenate([prev, cur], axis=1)  # [heads, k, ch]
        cache.write_state(name, win[:, 1:].reshape(heads, -1))
        ww = w.reshape(self.spec.conv_k, heads, -1).transpose(1, 0, 2)
        return _silu((win * ww).sum(axis=1).reshape(-1).astype(np.float32))

    def _mamba(self, cache: Cache, x: F32) -> F32:
        s = self.spec
        xc = self._conv(cache, "conv_x", self.conv_x, x @ self.w_x)
        bc = self._conv(cache, "conv_bc", self.conv_bc, x @ self.w_bc)
        b, c = bc[: s.mamba_n], bc[s.mamba_n :]
        a = np.exp(-np.logaddexp(0.0, x @ self.w_a)).astype(np.float32)  # decay in (0, 1)
        st = cache.read_state("ssm").reshape(s.mamba_heads, s.mamba_p, s.mamba_n)
        xh = xc.reshape(s.mamba_heads, s.mamba_p)
        st = a[:, None, None] * st + xh[:, :, None] * b[None, None, :]
        cache.write_state("ssm", st.reshape(s.mamba_heads, -1).astype(np.float32))
        y = (st @ c).reshape(-1)
        out: F32 = (y @ self.w_my).astype(np.float32)
        return out

    def _gdn(self, cache: Cache, x: F32) -> F32:
        """Gated delta net: conv over the q|k|v channels (channel-major state), then the
        delta rule per value head (value heads share key heads, GQA-style)."""
        s = self.spec
        k1 = s.conv_k - 1
        prev = cache.read_state("conv_qkv").reshape(-1, k1)  # [channels, k-1]
        win = np.concatenate([prev, (x @ self.w_qkv)[:, None]], axis=1)  # [channels, k]
        cache.write_state("conv_qkv", win[:, 1:])
        qkv = _silu((win * self.conv_qkv).sum(axis=1).astype(np.float32))
        nq, nk, _ = s.gdn_channels
        q = qkv[:nq].reshape(s.gdn_k_heads, s.gdn_k_dim)
        k = qkv[nq : nq + nk].reshape(s.gdn_k_heads, s.gdn_k_dim)
        v = qkv[nq + nk :].reshape(s.gdn_v_heads, s.gdn_v_dim)
        q = q / (np.linalg.norm(q, axis=1, keepdims=True) + 1e-6)
        k = k / (np.linalg.norm(k, axis=1, keepdims=True) + 1e-6)
        per = s.gdn_v_heads // s.gdn_k_heads
        qq, kk = np.repeat(q, per, axis=0), np.repeat(k, per, axis=0)  # [v_heads, k_dim]
        beta = (1.0 / (1.0 + np.exp(-(x @ self.w_beta)))).astype(np.float32)
        a = np.exp(-np.logaddexp(0.0, x @ self.w_g)).astype(np.float32)
        st = cache.read_state("delta").reshape(s.gdn_v_heads, s.gdn_v_dim, s.gdn_k_dim)
        st = a[:, None, None] * st
        err = v - np.einsum("hvk,hk->hv", st, kk)
        st = st + beta[:, None, None] * err[:, :, None] * kk[:, None, :]
        cache.write_state("delta", st.reshape(s.gdn_v_heads, -1).astype(np.float32))
        o = np.einsum("hvk,hk->hv", st, qq).reshape(-1)
        out: F32 = (o @ self.w_go).astype(np.float32)
        return out

    def step(self, cache: Cache, token: int, pos: int) -> F32:
        """Run token ``token`` at position ``pos`` (updating ``cache``); returns the logits."""
        s = self.spec
        x = self.embed[token].copy()
        x = x + self._attention(cache, "attn0", x, pos, 0)
        x = x + self._mamba(cache, x)
        x = x + self._gdn(cache, x)
        x = x + self._attention(cache, "swa", x, pos, max(0, pos - s.window + 1))
        x = x + self._attention(cache, "attn1", x, pos, 0)
        d = self._attention(cache, "draft", x, pos, 0)
        logits: F32 = (x @ self.out + (x + d) @ self.draft_out).astype(np.float32)
        return logits

    def prefill(self, cache: Cache, tokens: list[int], start: int = 0) -> int:
        """Run ``tokens`` from position ``start``; returns the greedy next token."""
        logits = np.zeros(self.spec.vocab, np.float32)
        for i, t in enumerate(tokens):
            logits = self.step(cache, t, start + i)
        return int(np.argmax(logits))

    def decode(self, cache: Cache, first: int, pos: int, n: int) -> list[int]:
        """Greedy decoding of ``n`` tokens after ``first`` (at position ``pos``)."""
        out = [first]
        for i in range(n):
            out.append(int(np.argmax(self.step(cache, out[-1], pos + i))))
        return out


def reference_tokens(spec: HybridSpec, prompt: list[int], n: int) -> list[int]:
    """What a single process generates: prefill the prompt, then ``n`` greedy tokens."""
    model = HybridModel(spec)
    cache = DenseCache(spec)
    first = model.prefill(cache, prompt)
    return model.decode(cache, first, len(prompt), n)
