"""The hybrid rows of ``kvd demo``: the seeded hybrid model (:mod:`kvd.refengine.hybridmodel`)
prefilled, its caches -- paged KV, state slot, window pages -- moved by real kvd daemons
over real Mooncake from prefill TP ``p`` to decode TP ``d``, decoded, and compared token
for token with the colocated run.

Both engines run in this process over :class:`~kvd.refengine.statepool.HybridShard` pools
(shared memory, registered with their daemons like any engine's); the daemons are
separate processes. :func:`as_truth` and :func:`gather` translate between the model's
caches and the pools' bytes.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from rich.console import Console
from rich.table import Table

from kvd.client import KVPoll, Receiver, Sender
from kvd.refengine import hybridmodel as hm
from kvd.refengine.rank import DaemonRank, start_ranks
from kvd.refengine.statepool import HybridShard, HybridSpec

_Rank = DaemonRank[HybridShard]  # a rank of this demo beside its kvd

U8 = npt.NDArray[np.uint8]


def model_spec(num_pages: int = 16) -> HybridSpec:
    """The pools' shape for :class:`~kvd.refengine.hybridmodel.HybridModel` (float32
    elements: the stand-in counts 2-byte units, so ``head_dim`` is doubled)."""
    return HybridSpec(layer_types=hm.LAYER_TYPES, total_kv_heads=hm.HEADS,
                      head_dim=hm.HEAD_DIM * 2, page_size=4, num_pages=num_pages,
                      window_pages=num_pages, window_tokens=hm.WINDOW, state_slots=4,
                      state_kinds={"conv": (hm.HEADS, (hm.CONV - 1) * hm.HEAD_DIM * 4),
                                   "ssm": (hm.HEADS, hm.HEAD_DIM * hm.HEAD_DIM * 4)})


def as_truth(spec: HybridSpec, caches: hm.HybridCaches, slot: int) -> dict[str, U8]:
    """A prefill pool's contents (:meth:`HybridSpec.truth` form) holding ``caches``: prompt
    tokens in pages ``0..`` of the KV and window pools, the state in slot ``slot``."""
    def paged(a: npt.NDArray[np.float32], pages: int) -> U8:
        n, _, t, h, d = a.shape
        out = np.zeros((n, 2, pages * spec.page_size, h, d), np.float32)
        out[:, :, :t] = a
        return out.reshape(n, 2, pages, spec.page_size, h, d).view(np.uint8)

    truth = {"kv": paged(caches.kv, spec.num_pages),
             "window": paged(caches.window, spec.window_pages)}
    for (layer, kind), a in caches.state.items():
        heads, hb = spec.state_kinds[kind]
        arr = np.zeros((spec.state_slots, heads, hb), np.uint8)
        arr[slot] = np.ascontiguousarray(a).view(np.uint8).reshape(heads, hb)
        truth[f"state:{layer}:{kind}"] = arr
    return truth


def gather(spec: HybridSpec, shards: list[HybridShard], pages: list[int], wpages: list[int],
           w_first: int, slot: int, length: int) -> hm.HybridCaches:
    """The decode's caches read back from its TP ranks' pools (heads concatenated in rank
    order): ``pages`` of KV, window pages ``wpages`` (their first token is ``w_first``),
    state slot ``slot``; ``length`` prompt tokens."""
    c = hm.HybridModel(0).empty()

    def read(bufs: list[U8], sel: list[int], nh: int, tokens: slice) -> npt.NDArray[Any]:
        n = len(bufs) // 2
        out = np.stack([np.stack([bufs[k * n + j].reshape(-1, spec.page_size, nh,
                                                          spec.head_dim * 2)[sel]
                                  for k in (0, 1)]) for j in range(n)])
        return out.view(np.float32).reshape(n, 2, -1, nh, hm.HEAD_DIM)[:, :, tokens]

    c.kv = np.concatenate([read(s.kv, pages, s.nh, slice(0, length)) for s in shards], axis=3)
    c.window = np.concatenate([read(s.window, wpages, s.nh, slice(0, length - w_first))
                               for s in shards], axis=3)
    for key, a in c.state.items():
        parts = [s.state[key][slot].view(np.float32).reshape(s.state_shape[key][1],
                                                              *a.shape[1:]) for s in shards]
        c.state[key] = np.ascontiguousarray(np.concatenate(parts, axis=0))
    c.length = length
    return c


def room_pages(spec: HybridSpec, n_tokens: int, seed: int
               ) -> tuple[list[int], list[int], list[int], list[int], int]:
    """``(src, dst, src window, dst window, first window page)`` for a prompt of
    ``n_tokens``: the prefill's prompt pages from 0, the window pages covering its last
    ``window_tokens`` tokens, decode pages drawn from ``seed``."""
    n = -(-n_tokens // spec.page_size)
    w0 = max(n_tokens - spec.window_tokens, 0) // spec.page_size
    rng = np.random.default_rng(seed)
    dst = [int(p) for p in rng.permutation(spec.num_pages)[:n]]
    d_win = [int(p) for p in rng.permutation(spec.window_pages)[:n - w0]]
    return list(range(n)), dst, list(range(w0, n)), d_win, w0


def run_hybrid_rows(console: Console, prefill_tp: int = 1, decode_tp: int = 2,
                    n_prompts: int = 3, max_new_tokens: int = 16) -> int:
    """Run ``n_prompts`` seeded prompts PD over real daemons; print a table; 0 if every
    completion equals the colocated one and every daemon exited cleanly, else 1."""
    model, spec = hm.HybridModel(5), model_spec()
    work = Path(tempfile.mkdtemp(prefix="kvd-hybrid-"))
    ranks: list[_Rank] = []
    rows: list[tuple[int, bool, str]] = []
    codes: list[int] = []
    try:
        start_ranks(ranks, work, prefill_tp, decode_tp, lambda role, tp, n: HybridShard(
            spec, tp, n, seed=tp + (1 if role == "prefill" else 10)))
        for i in range(n_prompts):
            rows.append(_one(model, spec, ranks[:prefill_tp], ranks[prefill_tp:], i,
                             max_new_tokens))
    finally:
        codes = [r.close() for r in ranks]
    _table(console, rows, f"hybrid model (full + linear-attention state + sliding window), "
                          f"prefill TP{prefill_tp} -> decode TP{decode_tp}, mooncake")
    ok = len(rows) == n_prompts and all(r[1] for r in rows) and all(c == 0 for c in codes)
    if ok:
        shutil.rmtree(work, ignore_errors=True)
    else:
        console.print(f"daemons exited with {codes}; logs kept in {work}")
    return 0 if ok else 1


def _one(model: hm.HybridModel, spec: HybridSpec, prefill: list[_Rank], decode: list[_Rank],
         i: int, max_new_tokens: int) -> tuple[int, bool, str]:
    prompt = [int(t) for t in np.random.default_rng(100 + i).integers(0, hm.VOCAB, 9 + 5 * i)]
    want = model.generate_reference(prompt, max_new_tokens)
    first, caches = model.prefill(prompt)
    truth = as_truth(spec, caches, slot=i % spec.state_slots)
    for r in prefill:
        r.shard.fill(truth)
    src, dst, s_win, d_win, w0 = room_pages(spec, len(prompt), i)
    room, p_slot, d_slot = 500 + i, i % spec.state_slots, (i + 1) % spec.state_slots
    recvs = []
    for r in decode:
        rec = Receiver(r.client, room, prefill[0].daemon.http_addr)
        rec.init(dst, 0, state_index=d_slot, window_pages=d_win)
        recvs.append(rec)
    for r in prefill:
        s = Sender(r.client, room)
        s.init(len(src), 0, state_index=p_slot, window_pages=s_win)
        s.send(src)
    states = [rec.wait(30) for rec in recvs]
    if states != [KVPoll.Success] * len(decode):
        return len(prompt), False, f"rooms ended {states}"
    got = model.decode(gather(spec, [r.shard for r in decode], dst, d_win,
                              w0 * spec.page_size, d_slot, len(prompt)), first, max_new_tokens)
    return len(prompt), got == want, "" if got == want else f"{got} vs {want}"


def _table(console: Console, rows: list[tuple[int, bool, str]], title: str) -> None:
    table = Table(title=title)
    for col in ("#", "prompt tokens", "moved", "equal?"):
        table.add_column(col, justify="right")
    for i, (n, ok, why) in enumerate(rows):
        table.add_row(str(i), str(n), "KV + state slot + window pages",
                      "[green]yes[/green]" if ok else f"[red]NO[/red] {why}")
    console.print(table)
