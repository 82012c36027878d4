"""An engine stand-in: shared-memory KV and aux pools of random bytes, registered with kvd.

Used by integration tests and benchmarks where no model is needed. Layout:
MHA, ``num_layers`` K buffers then ``num_layers`` V buffers of
``num_pages * item_len`` bytes each; ``aux_slots`` slots of ``aux_item_len``
bytes in one aux buffer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvd.client import FdPool, KvdClient, KVPoll, Receiver, RegisterKV, Sender, ShmPool, poll_many
from kvd.protocol.control import Compat


class StandInPool:
    """KV/aux pools for one engine rank and their registration (no connection).

    ``kv[b]`` is a uint8 view ``[num_pages, item_len]`` of buffer ``b``;
    ``aux`` a uint8 view ``[aux_slots, aux_item_len]`` (``aux_slots`` None: ``num_pages``).
    ``pool``: ``"shm"`` (a /dev/shm file kvd opens by name) or ``"fd"`` (a sealed memfd
    passed with SCM_RIGHTS).
    """

    def __init__(self, num_layers: int = 4, num_pages: int = 256, item_len: int = 4096,
                 aux_slots: int | None = None, aux_item_len: int = 64, seed: int = 0,
                 page_size: int = 16, head_dim: int = 64, dtype_size: int = 2,
                 shm_dir: str = "/dev/shm", pool: str = "shm") -> None:
        self.num_layers, self.num_pages, self.item_len = num_layers, num_pages, item_len
        # as many aux slots as pages by default: a room may take the slot of its first page,
        # so rooms on distinct pages have distinct slots (two live rooms never share one, K42)
        # (aux_slots 0: no aux buffer at all, as vLLM's connector registers)
        aux_slots = num_pages if aux_slots is None else aux_slots
        n_bufs = 2 * num_layers
        aux_sizes = [aux_slots * aux_item_len] if aux_slots else []
        size = ShmPool.size_for([num_pages * item_len] * n_bufs + aux_sizes)
        self.pool: ShmPool | FdPool = (FdPool(size) if pool == "fd"
                                       else ShmPool(size, shm_dir=shm_dir))
        views = [self.pool.alloc(num_pages * item_len) for _ in range(n_bufs)]
        aux = [self.pool.alloc(n) for n in aux_sizes]
        rng = np.random.default_rng(seed)
        self.pool.bytes[:] = rng.integers(0, 256, self.pool.nbytes, dtype=np.uint8)
        self.kv = [v.reshape(num_pages, item_len) for v, _ in views]
        self.aux = (aux[0][0].reshape(aux_slots, aux_item_len) if aux
                    else np.zeros((0, aux_item_len), dtype=np.uint8))
        heads = max(1, item_len // (page_size * head_dim * dtype_size))
        self.registration = RegisterKV(
            kv_buffers=[h for _, h in views], kv_item_lens=[item_len] * n_bufs,
            aux_buffers=[h for _, h in aux], aux_item_lens=[aux_item_len] * len(aux),
            page_size=page_size,
            num_kv_heads=heads, head_dim=head_dim, dtype_size=dtype_size, num_layers=num_layers)

    def pages_equal(self, other: StandInPool, src_pages: npt.ArrayLike,
                    dst_pages: npt.ArrayLike) -> bool:
        """True if ``self``'s dst pages equal ``other``'s src pages in every buffer."""
        s, d = np.asarray(src_pages), np.asarray(dst_pages)
        return all(np.array_equal(mine[d], theirs[s]) for mine, theirs in zip(self.kv, other.kv,
                                                                               strict=True))

    def close(self) -> None:
        """Drop the views and unlink the pool."""
        self.kv, self.aux = [], np.zeros((0, 0), dtype=np.uint8)
        self.pool.close()


class EngineStandIn(StandInPool):
    """A :class:`StandInPool` registered with the kvd at ``socket`` (``use_ring``: its room
    calls go through a submission ring, :meth:`KvdClient.submit`)."""

    def __init__(self, socket: str, use_ring: bool = False, **pool: Any) -> None:
        super().__init__(**pool)
        self.client = KvdClient(socket, use_ring=use_ring)
        self.info = self.client.call(self.registration)

    def close(self) -> None:
        """Drop the connection and unlink the pool."""
        self.client.close()
        super().close()


def wait_rooms(client: KvdClient, rooms: list[int], timeout: float = 30.0,
               interval: float = 0.005) -> list[KVPoll | int]:
    """Poll ``rooms`` (one RPC per round) until all are Success/Failed or ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        states = poll_many(client, rooms)
        if all(s in (KVPoll.Success, KVPoll.Failed) for s in states):
            return states
        if time.monotonic() > deadline:
            return states
        time.sleep(interval)


def transfer_room(prefill: EngineStandIn, decode: EngineStandIn, bootstrap_addr: str,
                  room: int, src: npt.ArrayLike, dst: npt.ArrayLike, chunk: int,
                  aux_src: int = 0, aux_dst: int | None = None) -> tuple[Sender, Receiver]:
    """Start room ``room``: receiver init, then the sender's chunks of ``chunk`` pages.
    ``aux_dst`` None: the decode's slot of the room's first destination page (modulo its
    slots), so live rooms on distinct pages have distinct aux slots (K42)."""
    src_a, dst_a = np.asarray(src), np.asarray(dst)
    if aux_dst is None:
        aux_dst = int(dst_a.flat[0]) % len(decode.aux) if dst_a.size else 0
    recv = Receiver(decode.client, room, bootstrap_addr)
    recv.init(dst, aux_dst)
    send = Sender(prefill.client, room)
    send.init(int(src_a.size), aux_src)
    for i in range(0, max(int(src_a.size), 1), max(chunk, 1)):
        send.send(src_a[i:i + chunk])
    return send, recv


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a stand-in model's KV cache (elements are 2-byte ``uint16``)."""

    num_layers: int = 4
    total_kv_heads: int = 4
    head_dim: int = 8
    page_size: int = 4
    num_pages: int = 64
    is_mla: bool = False
    layout: str = "NHD"
    aux_slots: int = 8
    aux_item_len: int = 16

    @property
    def kinds(self) -> int:
        """Buffers per layer: 2 (K, V) for MHA, 1 for MLA."""
        return 1 if self.is_mla else 2

    def global_kv(self, seed: int) -> npt.NDArray[np.uint16]:
        """A whole model's KV: ``[layers, kinds, pages, page_size, heads, head_dim]``."""
        heads = 1 if self.is_mla else self.total_kv_heads
        shape = (self.num_layers, self.kinds, self.num_pages, self.page_size, heads,
                 self.head_dim)
        return np.random.default_rng(seed).integers(0, 2**16, shape, dtype=np.uint16)


class ShardPool:
    """One engine rank's pools holding a TP/PP shard of a :class:`ModelSpec` KV cache,
    and their registration (no connection).

    ``buffers[i]`` is buffer ``i`` as uint16 (K of every layer, then V); the pool bytes
    follow ``spec.layout``. Prefill ranks are filled from ``source`` (a
    :meth:`ModelSpec.global_kv`), decode ranks with noise.
    """

    def __init__(self, spec: ModelSpec, tp_rank: int = 0, tp_size: int = 1,
                 layer_start: int = 0, num_layers: int | None = None,
                 source: npt.NDArray[np.uint16] | None = None, seed: int = 0,
                 item_len_scale: float = 1.0, shm_dir: str = "/dev/shm",
                 compat: Compat | None = None) -> None:
        from kvd.transfer.layout import rank_heads

        self.spec, self.tp_rank, self.tp_size = spec, tp_rank, tp_size
        self.layer_start = layer_start
        self.num_layers = spec.num_layers - layer_start if num_layers is None else num_layers
        total = 1 if spec.is_mla else spec.total_kv_heads
        self.h0, self.nh = (0, 1) if spec.is_mla else rank_heads(tp_rank, tp_size, total)
        item = spec.page_size * self.nh * spec.head_dim * 2
        n_bufs = self.num_layers * spec.kinds
        self.pool = ShmPool(ShmPool.size_for([spec.num_pages * item] * n_bufs
                                             + [spec.aux_slots * spec.aux_item_len]),
                            shm_dir=shm_dir)
        self.pool.bytes[:] = np.random.default_rng(seed).integers(0, 256, self.pool.nbytes,
                                                                  dtype=np.uint8)
        bufs = [self.pool.alloc(spec.num_pages * item) for _ in range(n_bufs)]
        aux_view, aux_handle = self.pool.alloc(spec.aux_slots * spec.aux_item_len)
        self.aux = aux_view.reshape(spec.aux_slots, spec.aux_item_len)
        self.buffers = [v.view(np.uint16) for v, _ in bufs]
        if source is not None:
            for i in range(n_bufs):
                self.buffers[i][:] = self._shard(source, *self._layer_kind(i)).ravel()
        self.registration = RegisterKV(
            kv_buffers=[h for _, h in bufs], kv_item_lens=[int(item * item_len_scale)] * n_bufs,
            aux_buffers=[aux_handle], aux_item_lens=[spec.aux_item_len],
            page_size=spec.page_size, num_kv_heads=self.nh, head_dim=spec.head_dim,
            dtype_size=2, num_layers=self.num_layers, layer_start=layer_start,
            is_mla=spec.is_mla, layout=spec.layout, total_kv_heads=total, compat=compat)

    def _layer_kind(self, i: int) -> tuple[int, int]:
        """Buffer index -> (absolute layer, kind): K of every layer, then V (MHA)."""
        return self.layer_start + i % self.num_layers, i // self.num_layers

    def _shard(self, g: npt.NDArray[np.uint16], layer: int, kind: int,
               pages: npt.NDArray[np.int64] | None = None) -> npt.NDArray[np.uint16]:
        x = g[layer, kind] if pages is None else g[layer, kind][pages]
        x = x[:, :, self.h0:self.h0 + self.nh, :]  # [pages, token, heads, dim]
        if self.spec.layout == "HND":
            x = x.transpose(0, 2, 1, 3)
        return np.ascontiguousarray(x)

    def holds(self, source: npt.NDArray[np.uint16], src_pages: npt.ArrayLike,
              dst_pages: npt.ArrayLike, layers: range | None = None) -> bool:
        """True if this rank's ``dst_pages`` equal ``source``'s ``src_pages`` re-sharded
        to this rank's heads and layout, for ``layers`` (default: all it holds)."""
        s, d = np.asarray(src_pages), np.asarray(dst_pages)
        page_elems = self.spec.page_size * self.nh * self.spec.head_dim
        for i in range(len(self.buffers)):
            layer, kind = self._layer_kind(i)
            if layers is not None and layer not in layers:
                continue
            got = self.buffers[i].reshape(self.spec.num_pages, page_elems)[d]
            want = self._shard(source, layer, kind, s).reshape(len(s), page_elems)
            if not np.array_equal(got, want):
                return False
        return True

    def close(self) -> None:
        """Drop the views and unlink the pool."""
        self.buffers = []
        self.aux = np.zeros((0, 0), dtype=np.uint8)
        self.pool.close()


class ShardStandIn(ShardPool):
    """A :class:`ShardPool` registered with the kvd at ``socket``."""

    def __init__(self, socket: str, spec: ModelSpec, *args: Any, **shard: Any) -> None:
        super().__init__(spec, *args, **shard)
        self.client = KvdClient(socket)
        self.info = self.client.call(self.registration)

    def close(self) -> None:
        """Drop the connection and unlink the pool."""
        self.client.close()
        super().close()
