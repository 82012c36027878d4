"""An engine stand-in with extra paged cache groups (issue 22 items 1 and 2): the main KV
of a :class:`~kvd.refengine.standin.ShardPool` plus, on the same page indices, a draft
model's KV or an indexer's K cache, each a TP shard of a seeded "truth" (no model: bytes
only), registered with kvd as ``RegisterKV.groups``.

Group layout (elements are bytes): per buffer ``[pages][page_size][heads][head_bytes]``
(NHD) or ``[pages][heads][page_size][head_bytes]`` (HND); K buffers of the group's layers
then V, or one buffer per layer when ``replicated`` (every TP rank holds the whole cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvd.client import ShmPool
from kvd.protocol.control import AuxField, Compat, GroupSpec
from kvd.refengine.standin import ModelSpec, ShardPool
from kvd.transfer.layout import rank_heads

U8 = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class GroupDef:
    """A group's model-wide shape: ``layers``, ``heads`` (replicated: 1), ``head_bytes``
    (bytes of one head of one token: ``head_dim * dtype_size``), ``layout``."""

    name: str = "draft"
    layers: int = 1
    heads: int = 2
    head_bytes: int = 16
    replicated: bool = False
    layout: str = "NHD"
    dtype_size: int = 4

    @property
    def kinds(self) -> int:
        """Buffers per layer: 1 (replicated), 2 (K, V)."""
        return 1 if self.replicated else 2

    def truth(self, spec: ModelSpec, seed: int) -> U8:
        """The whole group's cache: ``[layers, kinds, pages, page_size, heads, head_bytes]``."""
        shape = (self.layers, self.kinds, spec.num_pages, spec.page_size, self.heads,
                 self.head_bytes)
        return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


class GroupShard(ShardPool):
    """A :class:`ShardPool` (main KV) plus one shard of each of ``groups`` (in a second
    pool), filled from ``group_source`` (name -> :meth:`GroupDef.truth`) on prefill ranks,
    noise on decode ranks. ``spec_config``/``aux_fields`` go into the registration's
    fingerprint (:class:`~kvd.protocol.control.Compat`) and typed aux."""

    def __init__(self, spec: ModelSpec, groups: tuple[GroupDef, ...], tp_rank: int = 0,
                 tp_size: int = 1, group_source: dict[str, U8] | None = None,
                 spec_config: str = "", aux_fields: tuple[AuxField, ...] = (),
                 **shard: Any) -> None:
        super().__init__(spec, tp_rank, tp_size, **shard)
        self.groups = groups
        self.g_heads = {g.name: (0, 1) if g.replicated else rank_heads(tp_rank, tp_size,
                                                                        g.heads)
                        for g in groups}
        items = {g.name: spec.page_size * self.g_heads[g.name][1] * g.head_bytes
                 for g in groups}
        sizes = [spec.num_pages * items[g.name] for g in groups for _ in range(g.layers * g.kinds)]
        self.gpool = ShmPool(ShmPool.size_for(sizes), shm_dir=shard.get("shm_dir", "/dev/shm"))
        self.gpool.bytes[:] = np.random.default_rng(shard.get("seed", 0) + 99).integers(
            0, 256, self.gpool.nbytes, dtype=np.uint8)
        self.gbufs: dict[str, list[U8]] = {}
        handles, specs = [], []
        for g in groups:
            allocs = [self.gpool.alloc(spec.num_pages * items[g.name])
                      for _ in range(g.layers * g.kinds)]
            self.gbufs[g.name] = [v for v, _ in allocs]
            handles += [h for _, h in allocs]
            nh = self.g_heads[g.name][1]
            specs.append(GroupSpec(g.name, [items[g.name]] * len(allocs), g.layers, nh,
                                   g.head_bytes // g.dtype_size, g.dtype_size,
                                   total_kv_heads=g.heads, replicated=g.replicated,
                                   layout=g.layout))
        if group_source is not None:
            self.fill_groups(group_source)
        compat = self.registration.compat
        if spec_config:
            compat = msgspec.structs.replace(compat or Compat(), spec_config=spec_config)
        self.registration = msgspec.structs.replace(
            self.registration, groups=specs, group_buffers=handles, compat=compat,
            aux_fields=list(aux_fields))

    def _gshard(self, g: GroupDef, truth: U8, b: int, pages: npt.ArrayLike | None = None) -> U8:
        x = truth[b % g.layers, b // g.layers]
        if pages is not None:
            x = x[np.asarray(pages)]
        h0, nh = self.g_heads[g.name]
        x = x[:, :, h0:h0 + nh, :]
        if g.layout == "HND":
            x = x.transpose(0, 2, 1, 3)
        return np.ascontiguousarray(x).reshape(x.shape[0], -1)

    def fill(self, source: npt.NDArray[np.uint16], group_source: dict[str, U8]) -> None:
        """Write this rank's shard of the main KV ``source`` (a
        :meth:`~kvd.refengine.standin.ModelSpec.global_kv`) and of every group's truth into
        all its pages."""
        for i in range(len(self.buffers)):
            self.buffers[i][:] = self._shard(source, *self._layer_kind(i)).ravel()
        self.fill_groups(group_source)

    def fill_groups(self, source: dict[str, U8]) -> None:
        """Write this rank's shard of every group's truth into all its pages."""
        for g in self.groups:
            for b, v in enumerate(self.gbufs[g.name]):
                v[:] = self._gshard(g, source[g.name], b).ravel()

    def group_holds(self, source: dict[str, U8], src_pages: npt.ArrayLike,
                    dst_pages: npt.ArrayLike) -> dict[str, bool]:
        """Per group: do this rank's ``dst_pages`` equal the truth's ``src_pages``,
        re-sharded to this rank (byte for byte)?"""
        d = np.asarray(dst_pages)
        out = {}
        for g in self.groups:
            page = self.spec.page_size * self.g_heads[g.name][1] * g.head_bytes
            out[g.name] = all(np.array_equal(v.reshape(-1, page)[d],
                                             self._gshard(g, source[g.name], b, src_pages))
                              for b, v in enumerate(self.gbufs[g.name]))
        return out

    def close(self) -> None:
        """Drop the views and unlink both pools."""
        self.gbufs = {}
        self.gpool.close()
        super().close()

