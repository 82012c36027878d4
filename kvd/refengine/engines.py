"""Reference prefill and decode engines: a real LM whose KV lives in a paged shared-memory pool.

Each engine is a process (``python -m kvd.refengine.engines prefill|decode --socket S``)
that reads one JSON request per line on stdin and answers one JSON line on stdout.

Pool layout (what kvd is told in ``RegisterKV``): per layer a K and a V buffer of
``num_pages * item_len`` bytes, ``item_len = page_size * num_kv_heads * head_dim * 4``
(float32, NHD: ``[page][token][head][dim]``); one aux buffer of ``aux_slots`` slots of
16 bytes holding ``(room, first_token)`` as two int64.

Prefill requests: ``{"op": "prefill", "room", "tokens", "chunk_pages"}`` -> runs the
prompt, writes its KV into freshly allocated pages, sends them through kvd in chunks of
``chunk_pages`` pages (the last chunk carries aux), waits for Success; answers pages,
KV bytes and kvd's transfer stats. ``{"op": "reference", "tokens", "max_new_tokens"}``
-> the non-disaggregated greedy run.
Decode requests: ``{"op": "receive", "room", "bootstrap", "num_tokens",
"max_new_tokens"}`` -> allocates other pages, waits for the KV and aux, decodes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from kvd.client import KvdClient, KVPoll, Receiver, RegisterKV, Sender, ShmPool
from kvd.refengine.model import RefModel

AUX_ITEM_LEN = 16


class PagedKVPool:
    """Paged KV pool in shared memory for ``model``'s shape, plus a page allocator.

    ``k[l]`` / ``v[l]`` are float32 views ``[num_pages, page_size, heads, head_dim]``.
    """

    def __init__(self, model: RefModel, num_pages: int, page_size: int, aux_slots: int,
                 seed: int) -> None:
        self.page_size, self.num_pages = page_size, num_pages
        shape = (num_pages, page_size, model.num_kv_heads, model.head_dim)
        self.item_len = page_size * model.num_kv_heads * model.head_dim * 4
        n = 2 * model.num_layers
        self.shm = ShmPool(ShmPool.size_for([num_pages * self.item_len] * n
                                            + [aux_slots * AUX_ITEM_LEN]))
        bufs = [self.shm.alloc(num_pages * self.item_len) for _ in range(n)]
        aux_view, aux_handle = self.shm.alloc(aux_slots * AUX_ITEM_LEN)
        views = [v.view(np.float32).reshape(shape) for v, _ in bufs]
        self.k, self.v = views[:model.num_layers], views[model.num_layers:]
        self.aux = aux_view.view(np.int64).reshape(aux_slots, 2)
        self.registration = RegisterKV(
            kv_buffers=[h for _, h in bufs], kv_item_lens=[self.item_len] * n,
            aux_buffers=[aux_handle], aux_item_lens=[AUX_ITEM_LEN], page_size=page_size,
            num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, dtype_size=4,
            num_layers=model.num_layers)
        self.rng = np.random.default_rng(seed)
        self.free = set(range(num_pages))
        self.free_aux = set(range(aux_slots))

    def alloc(self, n: int) -> npt.NDArray[np.int64]:
        """``n`` free pages in random order (so indices differ between engines)."""
        if n > len(self.free):
            raise MemoryError(f"KV pool exhausted: need {n} pages, {len(self.free)} free")
        pages = self.rng.choice(sorted(self.free), n, replace=False).astype(np.int64)
        self.free -= set(pages.tolist())
        return pages

    def release(self, pages: npt.ArrayLike, aux_slot: int) -> None:
        """Return pages and an aux slot to the allocator."""
        self.free |= set(np.asarray(pages).tolist())
        self.free_aux.add(aux_slot)

    def write(self, kv: npt.NDArray[np.float32], pages: npt.NDArray[np.int64]) -> None:
        """Scatter KV ``[L, 2, T, H, D]`` into ``pages`` (``ceil(T / page_size)`` of them)."""
        padded = self._pad(kv, pages.size)
        for layer in range(len(self.k)):
            self.k[layer][pages] = padded[layer, 0]
            self.v[layer][pages] = padded[layer, 1]

    def read(self, pages: npt.NDArray[np.int64], num_tokens: int) -> npt.NDArray[np.float32]:
        """Gather KV ``[L, 2, num_tokens, H, D]`` from ``pages``."""
        out = np.stack([np.stack([self.k[i][pages], self.v[i][pages]])
                        for i in range(len(self.k))])
        shape = out.shape
        flat = out.reshape(shape[0], 2, shape[2] * shape[3], *shape[4:])
        return np.ascontiguousarray(flat[:, :, :num_tokens])

    def _pad(self, kv: npt.NDArray[np.float32], n_pages: int) -> npt.NDArray[np.float32]:
        L, two, T, H, D = kv.shape
        padded = np.zeros((L, two, n_pages * self.page_size, H, D), dtype=np.float32)
        padded[:, :, :T] = kv
        return padded.reshape(L, two, n_pages, self.page_size, H, D)


def _wait(obj: Sender | Receiver, timeout: float) -> KVPoll | int:
    return obj.wait(timeout)


class PrefillEngine:
    """Runs prompts and hands their KV to kvd."""

    def __init__(self, model: RefModel, pool: PagedKVPool, client: KvdClient) -> None:
        self.model, self.pool, self.client = model, pool, client

    def prefill(self, room: int, tokens: list[int], chunk_pages: int) -> dict[str, Any]:
        sender = Sender(self.client, room)
        first, kv = self.model.prefill(tokens)
        n_pages = -(-len(tokens) // self.pool.page_size)
        pages = self.pool.alloc(n_pages)
        aux_slot = min(self.pool.free_aux)
        self.pool.free_aux.discard(aux_slot)
        self.pool.write(kv, pages)
        self.pool.aux[aux_slot] = (room, first)
        sender.init(n_pages, aux_slot)
        for i in range(0, n_pages, chunk_pages):  # one send per prefill chunk
            sender.send(pages[i:i + chunk_pages])
        state = _wait(sender, 60.0)
        stats = self.client.call(_poll(room))["stats"].get(room) or [0, 0.0]
        reason = sender.failure_exception().reason if state == KVPoll.Failed else ""
        sender.clear()
        self.pool.release(pages, aux_slot)
        return {"room": room, "state": int(state), "reason": reason, "pages": int(n_pages),
                "kv_bytes": int(kv.nbytes), "xfer_bytes": int(stats[0]),
                "xfer_s": float(stats[1]), "chunks": -(-n_pages // chunk_pages)}


class DecodeEngine:
    """Receives KV through kvd into its own pages and continues decoding."""

    def __init__(self, model: RefModel, pool: PagedKVPool, client: KvdClient) -> None:
        self.model, self.pool, self.client = model, pool, client

    def receive(self, room: int, bootstrap: str, num_tokens: int,
                max_new_tokens: int) -> dict[str, Any]:
        receiver = Receiver(self.client, room, bootstrap)
        pages = self.pool.alloc(-(-num_tokens // self.pool.page_size))
        aux_slot = min(self.pool.free_aux)
        self.pool.free_aux.discard(aux_slot)
        self.pool.aux[aux_slot] = (-1, -1)
        receiver.init(pages, aux_slot)
        started = time.perf_counter()
        state = _wait(receiver, 120.0)
        waited = time.perf_counter() - started
        out: dict[str, Any] = {"room": room, "state": int(state), "wait_s": waited}
        if state == KVPoll.Success:
            aux_room, first = (int(x) for x in self.pool.aux[aux_slot])
            kv = self.pool.read(pages, num_tokens)
            out["aux_room_ok"] = aux_room == room
            out["tokens"] = self.model.decode(kv, first, max_new_tokens)
        else:
            out["reason"] = receiver.failure_exception().reason
        receiver.clear()
        self.pool.release(pages, aux_slot)
        return out


def _poll(room: int) -> Any:
    from kvd.protocol.rpc import Poll

    return Poll(rooms=[room])


def main(argv: list[str] | None = None) -> int:
    """Engine process entry point: load the model, register the pool, serve stdin."""
    ap = argparse.ArgumentParser(prog="kvd-refengine")
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--num-pages", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--aux-slots", type=int, default=8)
    args = ap.parse_args(argv)
    model = RefModel.load()
    pool = PagedKVPool(model, args.num_pages, args.page_size, args.aux_slots,
                       seed=1 if args.role == "prefill" else 2)
    client = KvdClient(args.socket, timeout=60)
    client.call(pool.registration)
    engine: Any = (PrefillEngine if args.role == "prefill" else DecodeEngine)(model, pool,
                                                                              client)
    _reply({"event": "ready", "load_s": model.load_seconds})
    try:
        for line in sys.stdin:
            _reply(_handle(engine, model, json.loads(line)))
    finally:
        client.close()
        pool.shm.close()
    return 0


def _handle(engine: Any, model: RefModel, req: dict[str, Any]) -> dict[str, Any]:
    op = req.get("op")
    try:
        if op == "prefill":
            return dict(engine.prefill(req["room"], req["tokens"], req["chunk_pages"]))
        if op == "receive":
            return dict(engine.receive(req["room"], req["bootstrap"], req["num_tokens"],
                                       req["max_new_tokens"]))
        if op == "encode":
            return {"tokens": model.encode_chat(req["prompt"])}
        if op == "reference":
            return {"tokens": model.generate_reference(req["tokens"], req["max_new_tokens"])}
        return {"error": f"unknown op {op!r}"}
    except Exception as exc:  # report, keep serving
        return {"error": f"{type(exc).__name__}: {exc}"}


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
