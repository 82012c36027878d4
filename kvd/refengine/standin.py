"""An engine stand-in: shared-memory KV and aux pools of random bytes, registered with kvd.

Used by integration tests and benchmarks where no model is needed. Layout:
MHA, ``num_layers`` K buffers then ``num_layers`` V buffers of
``num_pages * item_len`` bytes each; ``aux_slots`` slots of ``aux_item_len``
bytes in one aux buffer.
"""

from __future__ import annotations

import time

import numpy as np
import numpy.typing as npt

from kvd.client import KvdClient, KVPoll, Receiver, RegisterKV, Sender, ShmPool, poll_many


class EngineStandIn:
    """KV/aux pools for one engine rank plus its kvd client.

    ``kv[b]`` is a uint8 view ``[num_pages, item_len]`` of buffer ``b``;
    ``aux`` a uint8 view ``[aux_slots, aux_item_len]``.
    """

    def __init__(self, socket: str, num_layers: int = 4, num_pages: int = 256,
                 item_len: int = 4096, aux_slots: int = 16, aux_item_len: int = 64,
                 seed: int = 0, page_size: int = 16, head_dim: int = 64,
                 dtype_size: int = 2) -> None:
        self.client = KvdClient(socket)
        self.num_layers, self.num_pages, self.item_len = num_layers, num_pages, item_len
        n_bufs = 2 * num_layers
        self.pool = ShmPool(ShmPool.size_for([num_pages * item_len] * n_bufs
                                             + [aux_slots * aux_item_len]))
        views = [self.pool.alloc(num_pages * item_len) for _ in range(n_bufs)]
        aux_view, aux_handle = self.pool.alloc(aux_slots * aux_item_len)
        rng = np.random.default_rng(seed)
        self.pool.bytes[:] = rng.integers(0, 256, self.pool.nbytes, dtype=np.uint8)
        self.kv = [v.reshape(num_pages, item_len) for v, _ in views]
        self.aux = aux_view.reshape(aux_slots, aux_item_len)
        heads = max(1, item_len // (page_size * head_dim * dtype_size))
        self.registration = RegisterKV(
            kv_buffers=[h for _, h in views], kv_item_lens=[item_len] * n_bufs,
            aux_buffers=[aux_handle], aux_item_lens=[aux_item_len], page_size=page_size,
            num_kv_heads=heads, head_dim=head_dim, dtype_size=dtype_size, num_layers=num_layers)
        self.info = self.client.call(self.registration)

    def pages_equal(self, other: EngineStandIn, src_pages: npt.ArrayLike,
                    dst_pages: npt.ArrayLike) -> bool:
        """True if ``self``'s dst pages equal ``other``'s src pages in every buffer."""
        s, d = np.asarray(src_pages), np.asarray(dst_pages)
        return all(np.array_equal(mine[d], theirs[s]) for mine, theirs in zip(self.kv, other.kv,
                                                                               strict=True))

    def close(self) -> None:
        """Drop the connection and unlink the pool."""
        self.client.close()
        self.kv, self.aux = [], np.zeros((0, 0), dtype=np.uint8)
        self.pool.close()


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
                  aux_src: int = 0, aux_dst: int = 0) -> tuple[Sender, Receiver]:
    """Start room ``room``: receiver init, then the sender's chunks of ``chunk`` pages."""
    src_a = np.asarray(src)
    recv = Receiver(decode.client, room, bootstrap_addr)
    recv.init(dst, aux_dst)
    send = Sender(prefill.client, room)
    send.init(int(src_a.size), aux_src)
    for i in range(0, max(int(src_a.size), 1), max(chunk, 1)):
        send.send(src_a[i:i + chunk])
    return send, recv
