"""The engine side of kvd in one file: a prefill rank sends one room's KV pages, a decode
rank receives them (README "Using kvd from an engine" shows this file; a test runs it).

    python examples/engine_minimal.py PREFILL_SOCKET DECODE_SOCKET BOOTSTRAP_ADDR

with a prefill kvd (serve_bootstrap = true) and a decode kvd running, e.g.
``kvd serve -c config/prefill.toml`` and ``kvd serve -c config/decode.toml``.
"""

import sys

import numpy as np

from kvd.client import KvdClient, KVPoll, Receiver, RegisterKV, Sender, ShmPool

LAYERS, PAGES, PAGE_SIZE, HEADS, HEAD_DIM, DTYPE_SIZE = 2, 64, 16, 2, 64, 2
ITEM = PAGE_SIZE * HEADS * HEAD_DIM * DTYPE_SIZE  # bytes of one page of one layer's K (or V)
AUX_ITEM = 64  # bytes of one aux slot (first output token etc.)


def engine_rank(socket_path):
    """An engine rank's KV pool in /dev/shm (K per layer, V per layer, aux), registered."""
    client = KvdClient(socket_path)  # the daemon's engine_socket setting
    pool = ShmPool(ShmPool.size_for([PAGES * ITEM] * 2 * LAYERS + [8 * AUX_ITEM]))
    kv = [pool.alloc(PAGES * ITEM) for _ in range(2 * LAYERS)]  # (uint8 view, handle)
    aux = pool.alloc(8 * AUX_ITEM)
    client.call(RegisterKV(kv_buffers=[h for _, h in kv], kv_item_lens=[ITEM] * 2 * LAYERS,
                           aux_buffers=[aux[1]], aux_item_lens=[AUX_ITEM], page_size=PAGE_SIZE,
                           num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype_size=DTYPE_SIZE,
                           num_layers=LAYERS))
    return client, pool, [v.reshape(PAGES, ITEM) for v, _ in kv]


def main(prefill_socket, decode_socket, bootstrap_addr):
    prefill, p_pool, p_kv = engine_rank(prefill_socket)
    decode, d_pool, d_kv = engine_rank(decode_socket)
    for layer in p_kv:  # what a prefill forward pass would have written
        layer[:] = np.random.default_rng(0).integers(0, 256, layer.shape, dtype=np.uint8)
    room = 42  # bootstrap_room: chosen by the router, shared by both sides

    # decode rank: where the room's 4 pages go
    receiver = Receiver(decode, room, bootstrap_addr)
    receiver.init([10, 11, 12, 13], aux_index=0)

    # prefill rank: the room's pages, chunk by chunk (the last chunk carries aux)
    sender = Sender(prefill, room)
    sender.init(num_pages=4, aux_index=0)
    sender.send([0, 1])
    sender.send([2, 3])

    state = receiver.wait(timeout=30)  # or poll_many(decode, rooms): one RPC for many
    if state != KVPoll.Success:
        sys.exit(f"room {room}: {receiver.failure_reason()}")
    assert all(np.array_equal(d[10:14], p[0:4]) for d, p in zip(d_kv, p_kv, strict=True))
    print(f"room {room}: 4 pages x {2 * LAYERS} buffers moved, equal")
    receiver.clear()
    sender.clear()
    for client, pool in ((prefill, p_pool), (decode, d_pool)):
        client.close()
        pool.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
