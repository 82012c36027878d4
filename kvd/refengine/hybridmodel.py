"""A tiny hybrid causal LM in numpy: full attention, linear attention with per-request
state, sliding-window attention -- deterministic seeded weights, no checkpoint.

It exists to prove that kvd moves a hybrid model's caches exactly: a decode fed with
byte-identical caches produces the same greedy tokens as the colocated run
(:meth:`HybridModel.generate_reference`), and any one cache kind taken from another
request changes them (tested in ``tests/unit/test_hybridmodel.py``).

Layers (``LAYER_TYPES``): ``full`` (causal softmax attention; its K/V are paged KV),
``state`` (linear attention with a short causal conv: per request a ``conv`` state, the
last ``CONV - 1`` inputs, and an ``ssm`` state, the running sum of ``k v^T``; both
head-major, ``[heads][...]`` float32, as :mod:`kvd.transfer.state` requires), ``window``
(softmax attention over the last ``WINDOW`` tokens; its K/V live in a window pool).

Caches (:class:`HybridCaches`), float32, C-contiguous:
``kv`` ``[full layers, 2, tokens, heads, head_dim]``, ``window`` ``[window layers, 2,
tokens, heads, head_dim]`` (all prompt tokens; only the last ``WINDOW`` are read),
``state[(layer, "conv")]`` ``[heads, CONV - 1, head_dim]``,
``state[(layer, "ssm")]`` ``[heads, head_dim, head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

F32 = np.float32
Arr = npt.NDArray[np.float32]

LAYER_TYPES = ("full", "state", "window", "full")
VOCAB, HEADS, HEAD_DIM, WINDOW, CONV = 97, 4, 8, 8, 3
DIM = HEADS * HEAD_DIM


@dataclass
class HybridCaches:
    """One request's caches after some tokens (see the module docstring for shapes)."""

    kv: Arr
    window: Arr
    state: dict[tuple[int, str], Arr] = field(default_factory=dict)
    length: int = 0


class HybridModel:
    """The model with weights drawn from ``seed`` (``numpy.random.default_rng``)."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)

        def w(*shape: int) -> Arr:
            return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(F32)

        self.embed = w(VOCAB, DIM)
        self.layers = [{"q": w(DIM, DIM), "k": w(DIM, DIM), "v": w(DIM, DIM), "o": w(DIM, DIM),
                        "conv": w(CONV, DIM)} for _ in LAYER_TYPES]
        self.head = w(DIM, VOCAB)
        self.full = [i for i, t in enumerate(LAYER_TYPES) if t == "full"]
        self.windowed = [i for i, t in enumerate(LAYER_TYPES) if t == "window"]

    def empty(self) -> HybridCaches:
        """Caches of no tokens."""
        kv = np.zeros((len(self.full), 2, 0, HEADS, HEAD_DIM), F32)
        win = np.zeros((len(self.windowed), 2, 0, HEADS, HEAD_DIM), F32)
        state = {}
        for i, t in enumerate(LAYER_TYPES):
            if t == "state":
                state[(i, "conv")] = np.zeros((HEADS, CONV - 1, HEAD_DIM), F32)
                state[(i, "ssm")] = np.zeros((HEADS, HEAD_DIM, HEAD_DIM), F32)
        return HybridCaches(kv, win, state)

    def step(self, c: HybridCaches, token: int) -> int:
        """Feed one token, update ``c`` in place, return the greedy next token."""
        x = self.embed[token].copy()
        c.kv, c.window = _grow(c.kv), _grow(c.window)  # one token slot, filled per layer
        for i, t in enumerate(LAYER_TYPES):
            x = x + self._layer(i, t, c, x)
        c.length += 1
        return int(np.argmax(_norm(x) @ self.head))

    def _layer(self, i: int, kind: str, c: HybridCaches, x: Arr) -> Arr:
        p = self.layers[i]
        h = _norm(x)
        if kind == "state":
            return self._linear(i, c, h, p)
        q, k, v = ((h @ p[n]).reshape(HEADS, HEAD_DIM) for n in "qkv")
        if kind == "full":
            j = self.full.index(i)
            c.kv[j, 0, -1], c.kv[j, 1, -1] = k, v
            keys, vals = c.kv[j, 0], c.kv[j, 1]
        else:
            j = self.windowed.index(i)
            c.window[j, 0, -1], c.window[j, 1, -1] = k, v
            keys, vals = c.window[j, 0, -WINDOW:], c.window[j, 1, -WINDOW:]
        return _attend(q, keys, vals) @ p["o"]

    def _linear(self, i: int, c: HybridCaches, h: Arr, p: dict[str, Arr]) -> Arr:
        conv = c.state[(i, "conv")]  # [heads, CONV - 1, head_dim]: the last inputs
        cur = h.reshape(HEADS, 1, HEAD_DIM)
        window = np.concatenate([conv, cur], axis=1)  # [heads, CONV, head_dim]
        taps = p["conv"].reshape(CONV, HEADS, HEAD_DIM).transpose(1, 0, 2)
        u = np.tanh((window * taps).sum(axis=1).reshape(DIM)).astype(F32)
        c.state[(i, "conv")] = np.ascontiguousarray(window[:, 1:])
        q, k, v = ((u @ p[n]).reshape(HEADS, HEAD_DIM) for n in "qkv")
        k = k / (1.0 + np.abs(k))
        s = c.state[(i, "ssm")] + k[:, :, None] * v[:, None, :]
        c.state[(i, "ssm")] = s.astype(F32)
        out = np.einsum("hd,hde->he", q, s).reshape(DIM)
        return (np.tanh(out) @ p["o"]).astype(F32)

    def prefill(self, tokens: list[int]) -> tuple[int, HybridCaches]:
        """Run the prompt; ``(first generated token, caches)``."""
        c = self.empty()
        nxt = 0
        for t in tokens:
            nxt = self.step(c, t)
        return nxt, c

    def decode(self, c: HybridCaches, first: int, n: int) -> list[int]:
        """Greedy-decode ``n`` tokens after ``first`` from caches ``c`` (updated)."""
        out, tok = [first], first
        for _ in range(n - 1):
            tok = self.step(c, tok)
            out.append(tok)
        return out

    def generate_reference(self, tokens: list[int], n: int) -> list[int]:
        """Colocated: prefill and decode in one go."""
        first, c = self.prefill(tokens)
        return self.decode(c, first, n)


def _norm(x: Arr) -> Arr:
    return (x / np.sqrt(np.mean(x * x) + F32(1e-6))).astype(F32)


def _grow(cache: Arr) -> Arr:
    new = np.zeros((cache.shape[0], 2, cache.shape[2] + 1, HEADS, HEAD_DIM), F32)
    new[:, :, :-1] = cache
    return new


def _attend(q: Arr, keys: Arr, vals: Arr) -> Arr:
    """Softmax attention of one query ``[heads, dim]`` over ``[tokens, heads, dim]``."""
    scores = np.einsum("hd,thd->ht", q, keys) / np.sqrt(F32(HEAD_DIM))
    scores = np.exp(scores - scores.max(axis=1, keepdims=True))
    weights = scores / scores.sum(axis=1, keepdims=True)
    return np.einsum("ht,thd->hd", weights, vals).reshape(DIM).astype(F32)
