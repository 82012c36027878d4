"""Reference prefill and decode engines: a real LM whose KV lives in a paged shared-memory pool.

Each engine is a process (``python -m kvd.refengine.engines prefill|decode --socket S``)
that reads one JSON request per line on stdin and answers one JSON line on stdout.

Pool layout (what kvd is told in ``RegisterKV``): per layer a K and a V buffer of
``num_pages * item_len`` bytes, ``item_len = page_size * num_kv_heads * head_dim * 4``
(float32, NHD: ``[page][token][head][dim]``); one aux buffer of ``aux_slots`` slots of
16 bytes holding ``(room, first_token)`` as two int64.

Prefill requests: ``{"op": "prefill", "room", "tokens", "chunk_pages", "stream_layers"}``
-> runs the prompt, writes its KV into freshly allocated pages, sends them through kvd in
chunks of ``chunk_pages`` pages (the last chunk carries aux) or, with ``stream_layers``,
layer by layer while the forward pass runs (``Sender.send_layers``), waits for Success;
answers pages, KV bytes, kvd's transfer stats and times.
``{"op": "reference", "tokens", "max_new_tokens"}`` -> the non-disaggregated greedy run.
Decode requests: ``{"op": "receive", "room", "bootstrap", "num_tokens",
"max_new_tokens"}`` -> allocates other pages, waits for the KV and aux, decodes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvd.client import KvdClient, KVPoll, Receiver, RegisterKV, Sender, ShmPool
from kvd.protocol.control import Compat
from kvd.refengine.model import RefModel

AUX_ITEM_LEN = 16


class PagedKVPool:
    """Paged KV pool of ONE engine rank in shared memory, plus a page allocator.

    The rank holds KV heads ``[h0, h0 + nh)`` (attention TP shard, mirroring SGLang's
    head split and GQA replication) of layers ``[l0, l0 + nl)`` (PP stage).
    ``k[i]`` / ``v[i]`` are float32 views ``[num_pages, page_size, nh, head_dim]`` of
    local layer ``i``.
    """

    def __init__(self, model: RefModel, num_pages: int, page_size: int, aux_slots: int,
                 seed: int, tp: tuple[int, int] = (0, 1), pp: tuple[int, int] = (0, 1)) -> None:
        from kvd.transfer.layout import rank_heads

        self.page_size, self.num_pages = page_size, num_pages
        self.h0, self.nh = rank_heads(tp[0], tp[1], model.num_kv_heads)
        per_stage = -(-model.num_layers // pp[1])
        self.l0 = pp[0] * per_stage
        self.nl = min(per_stage, model.num_layers - self.l0)
        shape = (num_pages, page_size, self.nh, model.head_dim)
        self.item_len = page_size * self.nh * model.head_dim * 4
        n = 2 * self.nl
        self.shm = ShmPool(ShmPool.size_for([num_pages * self.item_len] * n
                                            + [aux_slots * AUX_ITEM_LEN]))
        bufs = [self.shm.alloc(num_pages * self.item_len) for _ in range(n)]
        aux_view, aux_handle = self.shm.alloc(aux_slots * AUX_ITEM_LEN)
        views = [v.view(np.float32).reshape(shape) for v, _ in bufs]
        self.k, self.v = views[:self.nl], views[self.nl:]
        self.aux = aux_view.view(np.int64).reshape(aux_slots, 2)
        self.registration = RegisterKV(
            kv_buffers=[h for _, h in bufs], kv_item_lens=[self.item_len] * n,
            aux_buffers=[aux_handle], aux_item_lens=[AUX_ITEM_LEN], page_size=page_size,
            num_kv_heads=self.nh, head_dim=model.head_dim, dtype_size=4, num_layers=self.nl,
            layer_start=self.l0, total_kv_heads=model.num_kv_heads,
            compat=Compat(model_id=Path(model.gguf_path).name, kv_dtype="float32",
                          scale_layout="none", layer_types="A" * model.num_layers))
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
        """Scatter this rank's shard of the full KV ``[L, 2, T, H, D]`` into ``pages``
        (``ceil(T / page_size)`` of them)."""
        shard = kv[self.l0:self.l0 + self.nl, :, :, self.h0:self.h0 + self.nh]
        padded = self._pad(shard, pages.size)
        for layer in range(len(self.k)):
            self.k[layer][pages] = padded[layer, 0]
            self.v[layer][pages] = padded[layer, 1]

    def write_layer(self, local: int, kv: npt.NDArray[np.float32],
                    pages: npt.NDArray[np.int64]) -> None:
        """Scatter this rank's heads of one layer's KV ``[2, T, H, D]`` into local layer
        ``local`` of ``pages``."""
        shard = kv[None, :, :, self.h0:self.h0 + self.nh]
        padded = self._pad(shard, pages.size)
        self.k[local][pages] = padded[0, 0]
        self.v[local][pages] = padded[0, 1]

    def read(self, pages: npt.NDArray[np.int64], num_tokens: int) -> npt.NDArray[np.float32]:
        """Gather this rank's shard ``[nl, 2, num_tokens, nh, D]`` from ``pages``."""
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


Rank = tuple[PagedKVPool, KvdClient]


def _take_aux(pool: PagedKVPool) -> int:
    slot = min(pool.free_aux)
    pool.free_aux.discard(slot)
    return slot


class PrefillEngine:
    """Runs prompts and hands their KV to kvd, one Sender per engine rank (TP x PP).

    Compute is not sharded: the full prefill runs once and every rank's pool receives
    exactly its heads and layers.
    """

    def __init__(self, model: RefModel, ranks: list[Rank]) -> None:
        self.model, self.ranks = model, ranks

    def prefill(self, room: int, tokens: list[int], chunk_pages: int,
                stream_layers: bool = False) -> dict[str, Any]:
        """Run the prompt and hand its KV to kvd: whole (after the forward pass, in chunks
        of ``chunk_pages`` pages) or, with ``stream_layers``, layer by layer as the forward
        pass computes it (``Sender.send_layers`` after each layer; each rank's last layer,
        with aux, once the first token is known). Answers the room's outcome, sizes, kvd's
        transfer stats and times (s): ``compute_s`` (the forward pass) and ``done_s``
        (prefill start to every rank's Success)."""
        started = time.perf_counter()
        senders = [Sender(client, room) for _, client in self.ranks]
        n_pages = -(-len(tokens) // self.ranks[0][0].page_size)
        held = []
        for (pool, _), sender in zip(self.ranks, senders, strict=True):
            pages, aux_slot = pool.alloc(n_pages), _take_aux(pool)
            sender.init(n_pages, aux_slot)
            held.append((pool, pages, aux_slot))
        streams = list(zip(held, senders, strict=True))
        first, kv = self.model.prefill(
            tokens, (lambda i, layer: _stream_layer(streams, i, layer)) if stream_layers
            else None)
        compute_s = time.perf_counter() - started
        for (pool, pages, aux_slot), sender in streams:
            pool.aux[aux_slot] = (room, first)
            if stream_layers:  # the last layer carries aux: sent once the token is known
                sender.send_layers(pages if pool.nl == 1 else [], (pool.nl - 1, pool.nl),
                                   is_last=True)
            else:
                pool.write(kv, pages)
        if not stream_layers:
            for i in range(0, n_pages, chunk_pages):  # one send per prefill chunk, every rank
                for (_, pages, _), sender in streams:
                    sender.send(pages[i:i + chunk_pages])
        states = [_wait(s, 600.0) for s in senders]
        done_s = time.perf_counter() - started
        stats = [client.call(_poll(room)).stats.get(room) or (0, 0.0)
                 for _, client in self.ranks]
        reasons = [s.failure_reason() for s, st in zip(senders, states, strict=True)
                   if st == KVPoll.Failed]
        for (pool, pages, aux_slot), sender in streams:
            sender.clear()
            pool.release(pages, aux_slot)
        ok = all(st == KVPoll.Success for st in states)
        return {"room": room, "state": int(KVPoll.Success if ok else KVPoll.Failed),
                "reason": "; ".join(reasons), "pages": int(n_pages), "kv_bytes": int(kv.nbytes),
                "xfer_bytes": int(sum(s[0] for s in stats)),
                "xfer_s": float(max(s[1] for s in stats)),
                "chunks": self.model.num_layers if stream_layers else -(-n_pages // chunk_pages),
                "compute_s": compute_s, "done_s": done_s}


def _stream_layer(streams: list[tuple[tuple[PagedKVPool, Any, int], Sender]], layer: int,
                  kv: npt.NDArray[np.float32]) -> None:
    """Absolute layer ``layer``'s KV ``[2, T, H, D]`` into every rank's pool that holds it,
    and handed to kvd at once (a rank's last layer waits for aux: see ``prefill``)."""
    for (pool, pages, _), sender in streams:
        local = layer - pool.l0
        if not 0 <= local < pool.nl:
            continue
        pool.write_layer(local, kv, pages)
        if local < pool.nl - 1:
            sender.send_layers(pages if local == 0 else [], (local, local + 1))


class DecodeEngine:
    """Receives KV through kvd into its own pages (one Receiver per TP rank), reassembles
    the heads and continues decoding."""

    def __init__(self, model: RefModel, ranks: list[Rank]) -> None:
        self.model, self.ranks = model, ranks

    def receive(self, room: int, bootstrap: str, num_tokens: int,
                max_new_tokens: int) -> dict[str, Any]:
        receivers = [Receiver(client, room, bootstrap) for _, client in self.ranks]
        held = []
        for (pool, _), receiver in zip(self.ranks, receivers, strict=True):
            pages, aux_slot = pool.alloc(-(-num_tokens // pool.page_size)), _take_aux(pool)
            pool.aux[aux_slot] = (-1, -1)
            receiver.init(pages, aux_slot)
            held.append((pool, pages, aux_slot))
        started = time.perf_counter()
        states = [_wait(r, 120.0) for r in receivers]
        out: dict[str, Any] = {"room": room, "wait_s": time.perf_counter() - started}
        if all(st == KVPoll.Success for st in states):
            pool0, _, slot0 = held[0]
            aux_room, first = (int(x) for x in pool0.aux[slot0])
            kv = self._assemble(held, num_tokens)
            out |= {"state": int(KVPoll.Success), "aux_room_ok": aux_room == room,
                    "tokens": self.model.decode(kv, first, max_new_tokens)}
        else:
            out |= {"state": int(KVPoll.Failed), "reason": "; ".join(
                r.failure_reason() for r, st in zip(receivers, states, strict=True)
                if st == KVPoll.Failed)}
        for (pool, pages, aux_slot), receiver in zip(held, receivers, strict=True):
            receiver.clear()
            pool.release(pages, aux_slot)
        return out

    def _assemble(self, held: list[tuple[PagedKVPool, Any, int]],
                  num_tokens: int) -> npt.NDArray[np.float32]:
        """Full KV ``[L, 2, T, H, D]`` from the ranks' head shards (replicas read once)."""
        parts: dict[int, npt.NDArray[np.float32]] = {}
        for pool, pages, _ in held:
            parts.setdefault(pool.h0, pool.read(pages, num_tokens))
        return np.ascontiguousarray(np.concatenate([parts[h] for h in sorted(parts)], axis=3))


def _poll(room: int) -> Any:
    from kvd.protocol.rpc import Poll

    return Poll(rooms=[room])


def main(argv: list[str] | None = None) -> int:
    """Engine process entry point: load the model, register the pool, serve stdin."""
    ap = argparse.ArgumentParser(prog="kvd-refengine")
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--socket", action="append", required=True,
                    help="one kvd socket per rank, ordered tp-major then pp (repeat)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--num-pages", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--aux-slots", type=int, default=8)
    args = ap.parse_args(argv)
    if len(args.socket) != args.tp * args.pp:
        ap.error(f"{args.tp * args.pp} sockets needed for tp={args.tp} pp={args.pp}")
    model = RefModel.load()
    ranks: list[Rank] = []
    for i, path in enumerate(args.socket):
        tp, pp = divmod(i, args.pp)
        pool = PagedKVPool(model, args.num_pages, args.page_size, args.aux_slots,
                           seed=i + (1 if args.role == "prefill" else 100),
                           tp=(tp, args.tp), pp=(pp, args.pp))
        client = KvdClient(path, timeout=60)
        client.call(pool.registration)
        ranks.append((pool, client))
    engine: Any = (PrefillEngine if args.role == "prefill" else DecodeEngine)(model, ranks)
    _reply({"event": "ready", "load_s": model.load_seconds})
    try:
        for line in sys.stdin:
            _reply(_handle(engine, model, json.loads(line)))
    finally:
        for pool, client in ranks:
            client.close()
            pool.shm.close()
    return 0


def _handle(engine: Any, model: RefModel, req: dict[str, Any]) -> dict[str, Any]:
    op = req.get("op")
    try:
        if op == "prefill":
            return dict(engine.prefill(req["room"], req["tokens"], req["chunk_pages"],
                                       bool(req.get("stream_layers", False))))
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
