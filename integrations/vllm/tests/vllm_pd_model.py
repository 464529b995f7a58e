"""A tiny GQA language model with random weights (NumPy, float32, fixed seed).

Two attention layers (4 query heads over 2 KV heads) with residual connections; greedy
decoding. The model reads and writes K/V only through a :class:`Cache`, so the same weights
run against a dense single-process reference (:class:`DenseCache`) or against vLLM-layout KV
tensors addressed by a block table (``vllm_pd_harness.BlockCache``). Imports nothing from
vLLM or kvwire: the test process computes the reference without paying vLLM's import.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

F32 = NDArray[np.float32]


@dataclass(frozen=True)
class GQASpec:
    vocab: int = 48
    d: int = 16
    layers: int = 2
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 4
    seed: int = 4321


class Cache(ABC):
    """One request's K/V per layer (``[kv_heads, head_dim]`` per token)."""

    @abstractmethod
    def write(self, layer: int, pos: int, k: F32, v: F32) -> None: ...

    @abstractmethod
    def read(self, layer: int, hi: int) -> tuple[F32, F32]:
        """K and V of tokens ``[0, hi)``: ``[hi, kv_heads, head_dim]`` each."""


class DenseCache(Cache):
    def __init__(self, spec: GQASpec, max_tokens: int = 256) -> None:
        shape = (spec.layers, max_tokens, spec.kv_heads, spec.head_dim)
        self.k = np.zeros(shape, np.float32)
        self.v = np.zeros(shape, np.float32)

    def write(self, layer: int, pos: int, k: F32, v: F32) -> None:
        self.k[layer, pos], self.v[layer, pos] = k, v

    def read(self, layer: int, hi: int) -> tuple[F32, F32]:
        return self.k[layer, :hi], self.v[layer, :hi]


class GQAModel:
    def __init__(self, spec: GQASpec) -> None:
        self.spec = s = spec
        rng = np.random.default_rng(spec.seed)

        def w(*shape: int, scale: float | None = None) -> F32:
            sc = scale if scale is not None else 1.0 / np.sqrt(shape[0])
            return (rng.standard_normal(shape) * sc).astype(np.float32)

        qd, kvd = s.q_heads * s.head_dim, s.kv_heads * s.head_dim
        self.embed = w(s.vocab, s.d, scale=1.0)
        self.attn = [(w(s.d, qd), w(s.d, kvd), w(s.d, kvd), w(qd, s.d)) for _ in range(s.layers)]
        self.out = w(s.d, s.vocab)

    def step(self, cache: Cache, token: int, pos: int) -> F32:
        """Run ``token`` at ``pos`` (writing its K/V); returns the logits."""
        s = self.spec
        x = self.embed[token].copy()
        group = s.q_heads // s.kv_heads
        for layer, (wq, wk, wv, wo) in enumerate(self.attn):
            q = (x @ wq).reshape(s.q_heads, s.head_dim)
            cache.write(
                layer, pos, (x @ wk).reshape(s.kv_heads, -1), (x @ wv).reshape(s.kv_heads, -1)
            )
            k, v = cache.read(layer, pos + 1)
            kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
            sc = np.einsum("hd,nhd->hn", q, kk) / np.float32(np.sqrt(s.head_dim))
            p = np.exp(sc - sc.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            x = x + (np.einsum("hn,nhd->hd", p, vv).reshape(-1) @ wo)
        logits: F32 = (x @ self.out).astype(np.float32)
        return logits

    def prefill(self, cache: Cache, tokens: list[int], start: int = 0) -> int:
        """Tokens from ``start`` (earlier positions already in ``cache``); greedy next token."""
        logits = np.zeros(self.spec.vocab, np.float32)
        for i in range(start, len(tokens)):
            logits = self.step(cache, tokens[i], i)
        return int(np.argmax(logits))

    def decode(self, cache: Cache, first: int, pos: int, n: int) -> list[int]:
        out = [first]
        for i in range(n):
            out.append(int(np.argmax(self.step(cache, out[-1], pos + i))))
        return out


def reference(prompt: list[int], n: int, spec: GQASpec = GQASpec()) -> list[int]:
    """What one process generates: prefill the prompt, then ``n`` greedy tokens."""
    model, cache = GQAModel(spec), DenseCache(spec)
    first = model.prefill(cache, prompt)
    return model.decode(cache, first, len(prompt), n)
