"""The speculative-decoding rows of ``kvd demo`` (issue 22 item 2): the seeded target and
draft models (:mod:`kvd.refengine.specmodel`) prefilled, the target's KV, the draft's KV
(a paged cache group on the same pages: 2 heads of 3 where the target has 4 of 4) and the
typed aux slot (``ids``: the first token, ``hidden``: the target's last hidden state) moved
by real kvd daemons over real Mooncake from prefill TP ``p`` to decode TP ``d``; the decode
continues speculatively (the draft proposes, the target verifies, greedy). A row is equal
when its tokens equal the non-speculative run's and the colocated speculative run's, and
its trace (every round's proposals and how many were accepted) equals the colocated one:
a draft KV or a hidden state that did not arrive changes the trace.

Both engines run in this process over :class:`~kvd.refengine.grouppool.GroupShard` pools
(shared memory, registered with their daemons like any engine's); the daemons are separate
processes.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import numpy.typing as npt
from rich.console import Console
from rich.table import Table

from kvd.client import KVPoll, Receiver, Sender
from kvd.protocol.control import AuxField, Compat
from kvd.refengine import specmodel as sm
from kvd.refengine.grouppool import GroupDef, GroupShard
from kvd.refengine.rank import DaemonRank, start_ranks
from kvd.refengine.standin import ModelSpec

_Rank = DaemonRank[GroupShard]  # a rank of this demo beside its kvd

F32 = np.float32
HIDDEN = sm.DIM * 4
SPEC = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, page_size=4, num_pages=32,
                 aux_slots=4, aux_item_len=4 + HIDDEN)  # head_dim in 2-byte units: 4 floats
DRAFT = GroupDef("draft", layers=1, heads=2, head_bytes=12, dtype_size=4)
FIELDS = (AuxField("ids", "int32", 0, 4), AuxField("hidden", "float32", 4, HIDDEN))
COMPAT = Compat(model_id="tiny-spec-7", kv_dtype="float32", scale_layout="none",
                layer_types="AA", spec_config=f"draft=tiny-1l;steps={sm.K};greedy")


def paged(a: npt.NDArray[np.float32], pages: int, page_size: int) -> npt.NDArray[np.float32]:
    """A cache ``[L, 2, T, H, D]`` padded to ``pages`` pages: ``[L, 2, pages, page_size, H,
    D]``, tokens from page 0."""
    n, _, t, h, d = a.shape
    out = np.zeros((n, 2, pages * page_size, h, d), F32)
    out[:, :, :t] = a
    return out.reshape(n, 2, pages, page_size, h, d)


def read_kv(shards: list[GroupShard], pages: list[int], length: int,
            group: str | None = None) -> npt.NDArray[np.float32]:
    """The decode's main KV (``group`` None) or a group's, read back from its TP ranks'
    pages (heads concatenated in rank order): ``[L, 2, length, H, D]`` float32."""
    parts = []
    for s in shards:
        bufs = s.gbufs[group] if group else [b.view(np.uint8) for b in s.buffers]
        nh = s.g_heads[group][1] if group else s.nh
        n = len(bufs) // 2
        x = np.stack([np.stack([bufs[k * n + j].reshape(SPEC.num_pages, SPEC.page_size, nh, -1)
                                [pages] for k in (0, 1)]) for j in range(n)])
        parts.append(x.view(F32).reshape(n, 2, -1, nh, x.shape[-1] // 4)[:, :, :length])
    return np.ascontiguousarray(np.concatenate(parts, axis=3))


def run_spec_rows(console: Console, prefill_tp: int = 1, decode_tp: int = 2,
                  n_prompts: int = 3, max_new_tokens: int = 16) -> int:
    """Run ``n_prompts`` seeded prompts PD over real daemons; print a table; 0 if every row
    is equal (tokens and trace) and every daemon exited cleanly, else 1."""
    model = sm.SpecPair(7)
    work = Path(tempfile.mkdtemp(prefix="kvd-spec-"))
    ranks: list[_Rank] = []
    rows: list[tuple[int, int, int, bool, str]] = []
    codes: list[int] = []
    try:
        start_ranks(ranks, work, prefill_tp, decode_tp,
                    lambda role, tp, n: _shard(tp, n, tp + (1 if role == "prefill" else 10)))
        for i in range(n_prompts):
            rows.append(_one(model, ranks[:prefill_tp], ranks[prefill_tp:], i, max_new_tokens))
    finally:
        codes = [r.close() for r in ranks]
    _table(console, rows, f"speculative decoding (target + draft model KV + typed aux), "
                          f"prefill TP{prefill_tp} -> decode TP{decode_tp}, mooncake")
    ok = len(rows) == n_prompts and all(r[3] for r in rows) and all(c == 0 for c in codes)
    if ok:
        shutil.rmtree(work, ignore_errors=True)
    else:
        console.print(f"daemons exited with {codes}; logs kept in {work}")
    return 0 if ok else 1


def _shard(tp: int, tp_size: int, seed: int) -> GroupShard:
    return GroupShard(SPEC, (DRAFT,), tp, tp_size, seed=seed, compat=COMPAT, aux_fields=FIELDS)


def _one(model: sm.SpecPair, prefill: list[_Rank], decode: list[_Rank], i: int,
         n: int) -> tuple[int, int, int, bool, str]:
    prompt = [int(t) for t in np.random.default_rng(100 + i).integers(0, sm.VOCAB, 9 + 5 * i)]
    want = model.reference(prompt, n)
    first, st = model.prefill(prompt)
    hidden = st.hidden[-1].copy()
    colocated, trace = model.decode(st, first, n)
    first, st = model.prefill(prompt)
    kv = paged(st.target, SPEC.num_pages, SPEC.page_size)
    draft = paged(st.draft, SPEC.num_pages, SPEC.page_size)
    aux = np.concatenate([np.array([first], np.int32).view(np.uint8), hidden.view(np.uint8)])
    slot = i % SPEC.aux_slots
    for r in prefill:
        r.shard.fill(kv.view(np.uint16), {"draft": draft.view(np.uint8)})
        r.shard.aux[slot] = aux
    n_pages = -(-len(prompt) // SPEC.page_size)
    dst = [int(p) for p in np.random.default_rng(i).permutation(SPEC.num_pages)[:n_pages]]
    room, d_slot = 700 + i, (i + 1) % SPEC.aux_slots
    recvs = []
    for r in decode:
        rec = Receiver(r.client, room, prefill[0].daemon.http_addr)
        rec.init(dst, d_slot)
        recvs.append(rec)
    for r in prefill:
        s = Sender(r.client, room)
        s.init(n_pages, slot)
        s.send(list(range(n_pages)))
    states = [rec.wait(30) for rec in recvs]
    if states != [KVPoll.Success] * len(decode):
        return len(prompt), 0, 0, False, f"rooms ended {states}"
    got_aux = decode[0].shard.aux[d_slot]
    shards = [r.shard for r in decode]
    state = sm.SpecState(read_kv(shards, dst, len(prompt)),
                         read_kv(shards, dst, len(prompt), "draft"),
                         [got_aux[4:].view(F32).copy()])
    got, got_trace = model.decode(state, int(got_aux[:4].view(np.int32)[0]), n)
    ok = got == want == colocated and got_trace == trace
    accepted = sum(t[-1] for t in got_trace)
    why = "" if ok else f"tokens {got} vs {want}, trace {got_trace} vs {trace}"
    return len(prompt), len(got_trace), accepted, ok, why


def _table(console: Console, rows: list[tuple[int, int, int, bool, str]], title: str) -> None:
    table = Table(title=title)
    for col in ("#", "prompt tokens", "moved", "rounds", "accepted", "equal?"):
        table.add_column(col, justify="right")
    for i, (n, rounds, acc, ok, why) in enumerate(rows):
        table.add_row(str(i), str(n), "KV + draft KV + aux (ids, hidden)", str(rounds),
                      str(acc), "[green]yes[/green]" if ok else f"[red]NO[/red] {why}")
    console.print(table)
