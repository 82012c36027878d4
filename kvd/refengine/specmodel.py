"""A tiny seeded target model and its draft model, in numpy, for speculative decoding
(issue 22 item 2): the draft proposes ``K`` tokens, the target verifies them, greedy.

It exists to prove that kvd moves a draft model's KV and the typed aux exactly: the
decode continues from the prefill's target KV, the draft KV (a paged cache group of its
own: fewer heads, another item length) and the target's last hidden state (an aux field,
EAGLE's feature); its tokens must equal the non-speculative greedy run (the target checks
every token), and its *trace* -- how many proposals each round accepted -- must equal the
colocated speculative run's, which a draft KV or hidden state taken from elsewhere
changes (``tests/unit/test_specmodel.py``).

Caches, float32, C-contiguous: ``[layers, 2, tokens, heads, head_dim]`` (K then V, NHD).
A draft step feeds ``embed[token] + feature``, the feature being the target's hidden state
at the previous position when known, else the draft's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

F32 = np.float32
Arr = npt.NDArray[np.float32]
VOCAB, DIM, K = 61, 16, 3


class TinyLM:
    """Causal attention layers over an embedding, greedy; ``heads x head_dim`` per layer."""

    def __init__(self, seed: int, layers: int, heads: int, head_dim: int,
                 embed: Arr | None = None, head: Arr | None = None, mix: float = 1.0) -> None:
        rng = np.random.default_rng(seed)

        def w(*shape: int) -> Arr:
            return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(F32)

        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        inner = heads * head_dim
        self.embed = w(VOCAB, DIM) if embed is None else embed
        self.head = w(DIM, VOCAB) if head is None else head
        self.w = [{n: w(DIM, inner) for n in "qkv"} | {"o": w(inner, DIM) * F32(mix)}
                  for _ in range(layers)]

    def empty(self) -> Arr:
        """A cache of no tokens."""
        return np.zeros((self.layers, 2, 0, self.heads, self.head_dim), F32)

    def step(self, cache: Arr, token: int, feature: Arr | None = None) -> tuple[int, Arr, Arr]:
        """Feed ``token`` (plus ``feature``, ``[DIM]``); ``(greedy next token, hidden state
        [DIM], the cache grown by one token)``."""
        x = self.embed[token] + (0 if feature is None else feature)
        new = np.zeros((*cache.shape[:2], cache.shape[2] + 1, *cache.shape[3:]), F32)
        new[:, :, :-1] = cache
        for i, p in enumerate(self.w):
            h = _norm(x)
            q, k, v = ((h @ p[n]).reshape(self.heads, self.head_dim) for n in "qkv")
            new[i, 0, -1], new[i, 1, -1] = k, v
            x = (x + _attend(q, new[i, 0], new[i, 1]) @ p["o"]).astype(F32)
        hidden = _norm(x)
        return int(np.argmax(hidden @ self.head)), hidden, new


@dataclass
class SpecState:
    """One request's caches: the target's and the draft's KV, the target's hidden state
    per position (``hidden[t]`` after token ``t``; the last one is what the aux carries)."""

    target: Arr
    draft: Arr
    hidden: list[Arr] = field(default_factory=list)


class SpecPair:
    """The target (2 layers, 4 heads x 4) and its draft (1 layer, 2 heads x 3; shares the
    embedding and the output head, as EAGLE's draft does; its attention weighs 1.5x, so what
    its KV holds shows in its proposals), seeded."""

    def __init__(self, seed: int = 0) -> None:
        self.target = TinyLM(seed, 2, 4, 4)
        self.draft = TinyLM(seed + 1, 1, 2, 3, self.target.embed, self.target.head, mix=1.5)

    def prefill(self, prompt: list[int]) -> tuple[int, SpecState]:
        """Both models over the prompt (the draft fed the target's features);
        ``(first generated token, state)``."""
        st = SpecState(self.target.empty(), self.draft.empty())
        nxt = 0
        for t, tok in enumerate(prompt):
            nxt, h, st.target = self.target.step(st.target, tok)
            _, _, st.draft = self.draft.step(st.draft, tok, st.hidden[t - 1] if t else None)
            st.hidden.append(h)
        return nxt, st

    def reference(self, prompt: list[int], n: int) -> list[int]:
        """Greedy target alone: ``n`` tokens."""
        tok, st = self.prefill(prompt)
        out = [tok]
        while len(out) < n:
            tok, _, st.target = self.target.step(st.target, tok)
            out.append(tok)
        return out

    def decode(self, st: SpecState, first: int, n: int
               ) -> tuple[list[int], list[tuple[int, ...]]]:
        """Speculative greedy decode of ``n`` tokens from ``st`` (whose ``hidden`` need hold
        only the last position's); ``(tokens, trace)``, the trace one entry per round: the
        draft's proposals, then how many the target accepted."""
        ctx = st.target.shape[2]  # tokens the target cache holds
        hid = {ctx - 1: st.hidden[-1]}
        out, trace = [first], []
        while len(out) < n:
            tcache, dcache = st.target, st.draft
            props, feat, tok = [], hid[ctx - 1], out[-1]
            for _ in range(K):  # the draft proposes K tokens
                tok, feat, dcache = self.draft.step(dcache, tok, feat)
                props.append(tok)
            accepted, t = 0, out[-1]
            for p in props:  # the target verifies: its own choice after each fed token
                g, h, tcache = self.target.step(tcache, t)
                hid[tcache.shape[2] - 1] = h
                if g != p:
                    t = g
                    break
                accepted, t = accepted + 1, p
            else:
                g, h, tcache = self.target.step(tcache, t)
                hid[tcache.shape[2] - 1], t = h, g
            keep = ctx + accepted + 1  # tokens both caches keep: the accepted ones fed
            st.target = tcache[:, :, :keep]
            # the draft keeps its entry of out[-1] (fed the target's feature) and is fed the
            # accepted proposals again with the target's features, as EAGLE re-runs it
            st.draft = self._catch_up(dcache[:, :, :ctx + 1], out[-1:] + props[:accepted],
                                      keep, hid)
            out += [*props[:accepted], t]
            trace.append((*props, accepted))
            ctx = keep
        return out[:n], trace

    def _catch_up(self, dcache: Arr, fed: list[int], keep: int, hid: dict[int, Arr]) -> Arr:
        """The draft cache fed the accepted tokens ``fed`` (the target's features) until it
        holds ``keep`` tokens."""
        start = keep - len(fed)
        while dcache.shape[2] < keep:
            pos = dcache.shape[2]
            _, _, dcache = self.draft.step(dcache, fed[pos - start], hid[pos - 1])
        return dcache


def _norm(x: Arr) -> Arr:
    return (x / np.sqrt(np.mean(x * x) + F32(1e-6))).astype(F32)


def _attend(q: Arr, keys: Arr, vals: Arr) -> Arr:
    """Softmax attention of one query ``[heads, dim]`` over ``[tokens, heads, dim]``."""
    scores = np.einsum("hd,thd->ht", q, keys) / np.sqrt(F32(q.shape[1]))
    scores = np.exp(scores - scores.max(axis=1, keepdims=True))
    weights = scores / scores.sum(axis=1, keepdims=True)
    return np.einsum("ht,thd->hd", weights, vals).reshape(-1).astype(F32)
