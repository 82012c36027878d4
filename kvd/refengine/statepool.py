"""A hybrid-model engine stand-in: paged KV of full-attention layers, per-request state
slots of state (SSM / linear-attention) layers and a window pool of sliding-window layers,
one TP/PP shard of a seeded "truth", registered with kvd (no model: bytes only).

Layouts (elements are bytes; every head-split axis is outermost in a slot, as
:mod:`kvd.transfer.state` requires): paged KV and the window pool as
:class:`~kvd.refengine.standin.ShardPool` (NHD, K buffers then V, 2-byte elements);
state buffer ``(layer, kind)``: ``[slots][heads][head_bytes]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvd.client import RegisterKV, ShmPool
from kvd.protocol.control import LayerType, StateBufSpec, StateSpec, WindowSpec
from kvd.transfer.layout import rank_heads


def _layer_type(name: str) -> LayerType:
    if name not in ("full", "window", "state"):
        raise ValueError(f"unknown layer type {name!r}")
    return name  # type: ignore[return-value]


def _kinds() -> dict[str, tuple[int, int]]:
    return {"conv": (4, 12), "ssm": (4, 32)}


@dataclass(frozen=True)
class HybridSpec:
    """Shape of a stand-in hybrid model. ``state_kinds``: kind -> (total heads, bytes per
    head) of each state layer's buffers; ``window_tokens`` tokens a window layer keeps."""

    layer_types: tuple[str, ...] = ("full", "state", "window", "full")
    total_kv_heads: int = 4
    head_dim: int = 8
    page_size: int = 4
    num_pages: int = 32
    window_pages: int = 16
    window_tokens: int = 8
    state_slots: int = 4
    state_kinds: dict[str, tuple[int, int]] = field(default_factory=_kinds)
    aux_slots: int = 8
    aux_item_len: int = 16

    def layers(self, kind: str) -> list[int]:
        """Absolute layers of type ``kind``."""
        return [i for i, t in enumerate(self.layer_types) if t == kind]

    def truth(self, seed: int) -> dict[str, npt.NDArray[np.uint8]]:
        """The whole model's caches, as uint8: ``kv`` ``[full, 2, pages, page_size, heads,
        2 * head_dim]``, ``window`` alike over window layers and window pages, and
        ``state:L:kind`` ``[slots, total heads, head bytes]``."""
        rng = np.random.default_rng(seed)
        tok = (self.page_size, self.total_kv_heads, 2 * self.head_dim)
        out = {"kv": rng.integers(0, 256, (len(self.layers("full")), 2, self.num_pages, *tok),
                                  dtype=np.uint8),
               "window": rng.integers(0, 256, (len(self.layers("window")), 2,
                                               self.window_pages, *tok), dtype=np.uint8)}
        for layer in self.layers("state"):
            for kind, (heads, hb) in self.state_kinds.items():
                out[f"state:{layer}:{kind}"] = rng.integers(
                    0, 256, (self.state_slots, heads, hb), dtype=np.uint8)
        return out


class HybridShard:
    """One engine rank's pools for a TP shard of a :class:`HybridSpec`, PP stage ``stage``
    (model layers ``[l0, l1)``, default all; it must hold a full-attention layer), and their
    registration. Prefill ranks are filled from ``source`` (:meth:`HybridSpec.truth`),
    decode ranks with noise (``seed``)."""

    def __init__(self, spec: HybridSpec, tp_rank: int = 0, tp_size: int = 1,
                 source: dict[str, npt.NDArray[np.uint8]] | None = None, seed: int = 0,
                 shm_dir: str = "/dev/shm", stage: tuple[int, int] | None = None) -> None:
        self.spec, self.tp_rank, self.tp_size = spec, tp_rank, tp_size
        l0, l1 = stage or (0, len(spec.layer_types))
        types = spec.layer_types
        self.full0, self.win0 = types[:l0].count("full"), types[:l0].count("window")
        self.h0, self.nh = rank_heads(tp_rank, tp_size, spec.total_kv_heads)
        item = spec.page_size * self.nh * spec.head_dim * 2
        n_full, n_win = types[l0:l1].count("full"), types[l0:l1].count("window")
        if not n_full:
            raise ValueError(f"stage [{l0}, {l1}) holds no full-attention layer")
        self.state_keys = [(layer, kind) for layer in spec.layers("state") if l0 <= layer < l1
                           for kind in spec.state_kinds]
        self.state_shape = {k: rank_heads(tp_rank, tp_size, spec.state_kinds[k[1]][0])
                            for k in self.state_keys}
        slot = {k: self.state_shape[k][1] * spec.state_kinds[k[1]][1] for k in self.state_keys}
        sizes = ([spec.num_pages * item] * 2 * n_full + [spec.aux_slots * spec.aux_item_len]
                 + [spec.state_slots * slot[k] for k in self.state_keys]
                 + [spec.window_pages * item] * 2 * n_win)
        self.pool = ShmPool(ShmPool.size_for(sizes), shm_dir=shm_dir)
        self.pool.bytes[:] = np.random.default_rng(seed).integers(0, 256, self.pool.nbytes,
                                                                  dtype=np.uint8)
        kv = [self.pool.alloc(spec.num_pages * item) for _ in range(2 * n_full)]
        aux_view, aux_handle = self.pool.alloc(spec.aux_slots * spec.aux_item_len)
        st = [self.pool.alloc(spec.state_slots * slot[k]) for k in self.state_keys]
        win = [self.pool.alloc(spec.window_pages * item) for _ in range(2 * n_win)]
        self.aux = aux_view.reshape(spec.aux_slots, spec.aux_item_len)
        self.kv = [v for v, _ in kv]
        self.window = [v for v, _ in win]
        self.state = {k: v.reshape(spec.state_slots, -1) for k, (v, _) in
                      zip(self.state_keys, st, strict=True)}
        if source is not None:
            self.fill(source)
        total = spec.total_kv_heads
        self.registration = RegisterKV(
            kv_buffers=[h for _, h in kv], kv_item_lens=[item] * 2 * n_full,
            aux_buffers=[aux_handle], aux_item_lens=[spec.aux_item_len],
            page_size=spec.page_size, num_kv_heads=self.nh, head_dim=spec.head_dim,
            dtype_size=2, num_layers=n_full, layer_start=self.full0, total_kv_heads=total,
            state=StateSpec(
                layer_types=[_layer_type(t) for t in spec.layer_types],
                buffers=[StateBufSpec(layer, kind, slot[(layer, kind)], "uint8",
                                      self.state_shape[(layer, kind)][1],
                                      spec.state_kinds[kind][0])
                         for layer, kind in self.state_keys],
                window=WindowSpec([item] * 2 * n_win, n_win, self.nh, spec.head_dim, 2,
                                  layer_start=self.win0, total_kv_heads=total)
                if n_win else None,
                window_tokens=spec.window_tokens if "window" in types else 0,
                stage_start=l0, stage_end=l1),
            state_buffers=[*(h for _, h in st), *(h for _, h in win)])

    def _paged(self, g: npt.NDArray[np.uint8], b: int, n: int,
               pages: npt.ArrayLike | None = None, first: int = 0) -> npt.NDArray[np.uint8]:
        """Buffer ``b`` (K of ``n`` layers from layer ``first`` of the truth, then V) of a
        paged truth, sharded to this rank's heads: ``[pages, page bytes]``."""
        x = g[first + b % n, b // n]
        if pages is not None:
            x = x[np.asarray(pages)]
        x = x[:, :, self.h0:self.h0 + self.nh, :]
        return np.ascontiguousarray(x).reshape(x.shape[0], -1)

    def _slot(self, g: dict[str, npt.NDArray[np.uint8]], key: tuple[int, str],
              index: int) -> npt.NDArray[np.uint8]:
        first, n = self.state_shape[key]
        return np.ascontiguousarray(g[f"state:{key[0]}:{key[1]}"][index, first:first + n]
                                    ).ravel()

    def fill(self, g: dict[str, npt.NDArray[np.uint8]]) -> None:
        """Write this rank's shard of truth ``g`` (:meth:`HybridSpec.truth` form) into
        every page and slot of its pools."""
        for b, v in enumerate(self.kv):
            v[:] = self._paged(g["kv"], b, len(self.kv) // 2, first=self.full0).ravel()
        for b, v in enumerate(self.window):
            v[:] = self._paged(g["window"], b, len(self.window) // 2, first=self.win0).ravel()
        for k, v in self.state.items():
            for i in range(self.spec.state_slots):
                v[i] = self._slot(g, k, i)

    def holds(self, g: dict[str, npt.NDArray[np.uint8]], src_pages: npt.ArrayLike,
              dst_pages: npt.ArrayLike, src_state: int, dst_state: int,
              src_window: npt.ArrayLike, dst_window: npt.ArrayLike) -> dict[str, bool]:
        """Do this rank's destination pages, state slot and window pages equal the truth's
        source ones, re-sharded to this rank? One answer per part (byte for byte)."""
        n, nw = len(self.kv) // 2, len(self.window) // 2
        page = self.spec.page_size * self.nh * self.spec.head_dim * 2
        d, dw = np.asarray(dst_pages), np.asarray(dst_window)
        return {
            "kv": all(np.array_equal(v.reshape(-1, page)[d],
                                     self._paged(g["kv"], b, n, src_pages, self.full0))
                      for b, v in enumerate(self.kv)),
            "window": all(np.array_equal(v.reshape(-1, page)[dw],
                                         self._paged(g["window"], b, nw, src_window,
                                                     self.win0))
                          for b, v in enumerate(self.window)),
            "state": all(np.array_equal(v[dst_state], self._slot(g, k, src_state))
                         for k, v in self.state.items())}

    def snapshot(self) -> npt.NDArray[np.uint8]:
        """A copy of every pool byte (to show what a room must not touch)."""
        return self.pool.bytes.copy()

    def close(self) -> None:
        """Drop the views and unlink the pool."""
        self.kv, self.window, self.state = [], [], {}
        self.pool.close()
