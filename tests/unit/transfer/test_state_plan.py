"""State slots and window pages (issue 22 item 1): plans, TP resharding, PP, the proof.

Byte-level: every rank's memory is a numpy array; a model-level "truth" gives every
(layer, state kind, head) of a request its bytes; prefill ranks hold their heads of it in
their state slot, every plan routing names is applied to the decode's memory, and the
decode's slot must then equal the truth for its heads while every other byte keeps its
sentinel. Window pages alike, through the window pool's ``PairPlan``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.errors import LayoutError, RegistrationError
from kvd.transfer.layout import RankLayout, prefill_targets, rank_heads
from kvd.transfer.plan import U64, Descriptors, PlanRefused
from kvd.transfer.state import (
    StateBuffer,
    StateLayout,
    StatePairPlan,
    check_state_pair,
    check_window_pages,
    plan_room_state,
    prove_state_sources_tile,
)

TP_PAIRS = [(1, 1), (1, 2), (2, 1), (4, 2), (2, 4), (1, 4)]  # (prefill, decode)
SLOTS, POOL, HEAD_DIM, DTYPE = 4, 8, 2, 2
KINDS = {"conv": (4, 6), "ssm": (4, 16)}  # kind -> (total heads, bytes per head)


@dataclass(frozen=True)
class World:
    types: tuple[str, ...]
    prefill_tp: int
    decode_tp: int
    stages: tuple[int, ...]
    page_size: int
    window: int
    heads: dict[str, int]

    def rank(self, tp_rank: int, tp: int, l0: int, l1: int) -> tuple[StateLayout, int]:
        """A rank's layout over one flat memory of its own (offset 0 upward), and its size."""
        bufs, at = [], 64
        for layer in range(l0, l1):
            if self.types[layer] != "state":
                continue
            for kind, (_, hb) in KINDS.items():
                total = self.heads[kind]
                n = rank_heads(tp_rank, tp, total)[1]
                bufs.append(StateBuffer(layer, kind, at, SLOTS * n * hb, n * hb, "bf16", n,
                                        total))
                at += SLOTS * n * hb + 8  # a gap: nothing may land there
        window = None
        nw = self.types[l0:l1].count("window")
        if nw:
            n = rank_heads(tp_rank, tp, 4)[1]
            item = self.page_size * n * HEAD_DIM * DTYPE
            ptrs = [at + b * (item * POOL + 8) for b in range(2 * nw)]
            at = ptrs[-1] + item * POOL + 8
            window = RankLayout(kv_ptrs=np.array(ptrs, np.uint64),
                                item_lens=np.full(2 * nw, item, np.uint64),
                                page_size=self.page_size, num_kv_heads=n, total_kv_heads=4,
                                head_dim=HEAD_DIM, dtype_size=DTYPE, num_layers=nw,
                                layer_start=self.types[:l0].count("window"), is_mla=False,
                                layout="NHD", tp_rank=tp_rank, tp_size=tp)
        return StateLayout(tuple(bufs), self.types, l0, l1, tp_rank, tp, window,
                           self.window if "window" in self.types else 0), at

    def decode(self, d: int) -> tuple[StateLayout, int]:
        return self.rank(d, self.decode_tp, 0, len(self.types))

    def prefill(self, tp: int, pp: int) -> tuple[StateLayout, int]:
        return self.rank(tp, self.prefill_tp, self.stages[pp], self.stages[pp + 1])


@st.composite
def worlds(draw: st.DrawFn) -> World:
    types = tuple(draw(st.lists(st.sampled_from(["full", "window", "state"]), min_size=1,
                                max_size=5)))
    ptp, dtp = draw(st.sampled_from(TP_PAIRS))
    pp = draw(st.integers(1, min(3, len(types))))
    cuts = sorted(draw(st.lists(st.integers(1, len(types) - 1), min_size=pp - 1,
                                max_size=pp - 1, unique=True))) if pp > 1 else []
    heads = {"conv": draw(st.sampled_from([1, 2, 4])), "ssm": draw(st.sampled_from([2, 4, 8]))}
    return World(types, ptp, dtp, (0, *cuts, len(types)), draw(st.sampled_from([1, 4, 16])),
                 draw(st.integers(1, 40)), heads)


def apply(desc: Descriptors, src: np.ndarray, dst: np.ndarray) -> None:
    for s, d, n in zip(desc.src.tolist(), desc.dst.tolist(), desc.length.tolist(), strict=True):
        dst[d:d + n] = src[s:s + n]


def truth(layer: int, kind: str, head: int, hb: int) -> np.ndarray:
    return ((np.arange(hb) + 7 * layer + 31 * head + (3 if kind == "ssm" else 0)) % 251 + 1
            ).astype(np.uint8)


def fill_state(layout: StateLayout, mem: np.ndarray, index: int) -> None:
    for b in layout.buffers:
        first = rank_heads(layout.tp_rank, layout.tp_size, b.total_heads)[0]
        lo = b.ptr + index * b.slot_bytes
        mem[lo:lo + b.slot_bytes] = np.concatenate(
            [truth(b.layer, b.kind, first + h, b.head_bytes) for h in range(b.heads)])


@settings(max_examples=120, deadline=None)
@given(worlds(), st.integers(0, SLOTS - 1), st.integers(0, SLOTS - 1))
def test_i22_state_slots_reshard_over_tp_and_pp_every_byte_once(
        w: World, s_index: int, d_index: int) -> None:
    for d in range(w.decode_tp):
        dst, size = w.decode(d)
        mem = np.zeros(size, np.uint8)
        sources = []
        for pp in range(len(w.stages) - 1):
            for tp in prefill_targets(d, w.decode_tp, w.prefill_tp):
                src, s_size = w.prefill(tp, pp)
                sources.append(src)
                s_mem = np.zeros(s_size, np.uint8)
                fill_state(src, s_mem, s_index)
                pair = StatePairPlan.of(src, dst)
                desc = pair.plan(s_index, d_index)
                pair.prove(desc, d_index, "room 1")
                apply(desc, s_mem, mem)
        prove_state_sources_tile(dst, sources)
        want = np.zeros(size, np.uint8)
        fill_state(dst, want, d_index)
        assert np.array_equal(mem, want)  # the slot exact, every other byte untouched


@settings(max_examples=80, deadline=None)
@given(worlds(), st.data())
def test_i22_window_pages_move_sliced_over_tp_and_pp(w: World, data: st.DataObject) -> None:
    if "window" not in w.types:
        return
    ps = w.page_size
    n = min(data.draw(st.integers(1, 1 + -(-w.window // ps))), POOL)
    sp = np.array(data.draw(st.permutations(range(POOL)))[:n], np.int64)
    dp = np.array(data.draw(st.permutations(range(POOL)))[:n], np.int64)
    for d in range(w.decode_tp):
        dst, size = w.decode(d)
        assert dst.window is not None
        mem = np.zeros(size, np.uint8)
        for pp in range(len(w.stages) - 1):
            for tp in prefill_targets(d, w.decode_tp, w.prefill_tp):
                src, s_size = w.prefill(tp, pp)
                pair = StatePairPlan.of(src, dst)
                if pair.window is None:
                    continue
                check_window_pages(src, ps, sp, dp)
                s_mem = (np.arange(s_size) * 13 % 251 + 1).astype(np.uint8)
                desc = pair.window.plan(sp, dp)
                pair.window.prove(desc, sp, dp, None, "room 1")
                apply(desc, s_mem, mem)
        win = dst.window
        item = int(win.item_lens[0])
        read = np.zeros(size, bool)
        for p in (int(win.kv_ptrs[b]) + int(x) * item for b in range(win.kv_ptrs.size)
                  for x in dp):
            read[p:p + item] = True
        assert (mem[read] != 0).all() and (mem[~read] == 0).all()


def small(tp_rank: int = 0, tp: int = 1, **kw: object) -> StateLayout:
    args = {"layer": 1, "kind": "ssm", "ptr": 4096, "length": 4 * 64, "slot_bytes": 64,
            "dtype": "float32", "heads": 4 // tp, "total_heads": 4}
    args.update(kw)
    args["slot_bytes"] = int(args["heads"]) * 16 if "slot_bytes" not in kw else args[
        "slot_bytes"]
    args["length"] = 4 * int(args["slot_bytes"])
    return StateLayout((StateBuffer(**args),), ("full", "state"), 0, 2,  # type: ignore[arg-type]
                       tp_rank, tp)


@pytest.mark.parametrize(("change", "reason"), [
    ({"dtype": "bfloat16"}, "layer 1 state 'ssm' dtype float32 vs bfloat16"),
    ({"kind": "conv"}, "layer 1 state 'ssm' has no decode buffer"),
    ({"heads": 8, "total_heads": 8}, "total_heads 4 vs 8"),
    ({"slot_bytes": 128}, "head_bytes 16 vs 32"),
])
def test_i22_pairing_refuses_state_mismatches_with_one_reason(
        change: dict[str, object], reason: str) -> None:
    with pytest.raises(RegistrationError) as info:
        check_state_pair(small(), small(**change))
    assert reason in str(info.value) and str(info.value).count(";") == 0


def test_i22_pairing_refuses_layer_types_naming_the_layer() -> None:
    a = small()
    b = StateLayout((), ("full", "full"), 0, 2, 0, 1)
    with pytest.raises(RegistrationError, match="layer 1 is state vs full"):
        check_state_pair(a, b)


def test_i22_registration_refuses_a_state_layer_without_its_buffer_and_bad_splits() -> None:
    with pytest.raises(RegistrationError, match="state layer 1 has no state buffer"):
        StateLayout((), ("full", "state"), 0, 2, 0, 1)
    with pytest.raises(RegistrationError, match="2 heads vs 4 for TP rank 0 of 1"):
        small(heads=2)
    with pytest.raises(RegistrationError, match="a window pool of 0"):
        StateLayout((), ("window",), 0, 1, 0, 1, None, 8)


def test_i22_a_plan_writing_outside_the_slot_or_twice_is_refused() -> None:
    pair = StatePairPlan.of(small(), small())
    desc = pair.plan(1, 2)
    pair.prove(desc, 2)
    shifted = Descriptors(desc.src, desc.dst + U64(16), desc.length)
    with pytest.raises(PlanRefused, match="uncovered"):
        pair.prove(shifted, 2)
    twice = desc.concat(desc)
    with pytest.raises(PlanRefused, match="doubled"):
        pair.prove(twice, 2)
    with pytest.raises(PlanRefused, match="slot 2"):
        pair.prove(Descriptors(desc.src, desc.dst, desc.length + U64(1)), 2)
    with pytest.raises(LayoutError, match="destination state index 4 outside the 4 slots"):
        pair.plan(0, 4)


def test_i22_tp_two_to_one_each_prefill_rank_writes_its_half() -> None:
    dst = small()
    halves = [StatePairPlan.of(small(r, 2), dst).plan(0, 3) for r in (0, 1)]
    assert [int(h.dst[0]) - 4096 - 3 * 64 for h in halves] == [0, 32]
    assert all(int(h.length[0]) == 32 for h in halves)
    prove_state_sources_tile(dst, [small(0, 2), small(1, 2)])
    with pytest.raises(PlanRefused, match="head 2 is written by 0"):
        prove_state_sources_tile(dst, [small(0, 2)])


def test_i22_window_pages_beyond_the_window_are_refused() -> None:
    s = StateLayout((), ("full",), 0, 1, 0, 1, None, 0)
    w = StateLayout(s.buffers, s.layer_types, 0, 1, 0, 1, None, 33)
    assert w.max_window_pages(16) == 4
    check_window_pages(w, 16, np.arange(4), np.arange(4))
    with pytest.raises(PlanRefused, match="touches at most 4"):
        check_window_pages(w, 16, np.arange(5), np.arange(5))


@settings(max_examples=100, deadline=None)
@given(worlds(), st.integers(0, SLOTS - 1), st.data())
def test_i22_mutated_state_plans_are_refused(w: World, index: int, data: st.DataObject) -> None:
    """Any one descriptor dropped, repeated, moved by a byte, or made a byte longer: the
    proof refuses the plan (nothing a decode reads is left unwritten, written twice, or
    written outside the room's slot)."""
    dst, _ = w.decode(0)
    src, _ = w.prefill(0, 0)
    pair = StatePairPlan.of(src, dst)
    desc = pair.plan(index, index)
    if len(desc) == 0:
        return
    k = data.draw(st.integers(0, len(desc) - 1))
    how = data.draw(st.sampled_from(["drop", "repeat", "shift", "longer"]))
    keep = np.ones(len(desc), bool)
    d, n = desc.dst.copy(), desc.length.copy()
    if how == "drop":
        keep[k] = False
    elif how == "shift":
        d[k] += U64(1)
    elif how == "longer":
        n[k] += U64(1)
    bad = Descriptors(desc.src[keep], d[keep], n[keep])
    if how == "repeat":
        bad = desc.concat(Descriptors(desc.src[k:k + 1], d[k:k + 1], n[k:k + 1]))
    with pytest.raises(PlanRefused):
        pair.prove(bad, index)


def test_i22_state_coverage_refuses_a_stage_edge_nobody_writes() -> None:
    from kvd.transfer.state import check_state_coverage
    types = ("state", "full", "state")
    buf = [StateBuffer(layer, "ssm", 64 + 256 * layer, 4 * 16, 16, "f32", 1, 1)
           for layer in (0, 2)]
    dst = StateLayout(tuple(buf), types, 0, 3, 0, 1)
    late = StateLayout((buf[1],), types, 1, 3, 0, 1)
    with pytest.raises(RegistrationError, match=r"decode layers \[0, 1\) are written by no"):
        check_state_coverage(late, dst, 0, 2)
    check_state_coverage(late, dst, 1, 2)  # the last stage: its end matches


@settings(max_examples=120, deadline=None)
@given(worlds(), st.sampled_from([1, 4, 16]), st.integers(1, 60), st.data())
def test_i22_window_pages_retile_between_page_sizes_every_byte_once(
        w: World, pd: int, t_end: int, data: st.DataObject) -> None:
    """Window pools of another page size on the decode: each side names the tail of its
    room pages holding the request's last ``window`` tokens; the tokens both hold move
    token by token (TP slicing, PP stages), each decode byte of the window written once,
    from the right source token and head, and nothing else written."""
    if "window" not in w.types:
        return
    ps = w.page_size
    ns, nd = -(-t_end // ps), -(-t_end // pd)
    room_end = min(ns * ps, nd * pd)
    start = max(t_end - w.window, 0)
    s_first, d_first = start // ps, start // pd  # the first page holding a window token
    if ns - s_first > POOL or nd - d_first > POOL:
        return
    sp = np.array(data.draw(st.permutations(range(POOL)))[:ns - s_first], np.int64)
    dp = np.array(data.draw(st.permutations(range(POOL)))[:nd - d_first], np.int64)
    dw = World(w.types, w.prefill_tp, w.decode_tp, w.stages, pd, w.window, w.heads)
    token_bytes = HEAD_DIM * DTYPE
    lo = max(s_first * ps, d_first * pd)
    for d in range(w.decode_tp):
        dst, size = dw.decode(d)
        assert dst.window is not None
        mem = np.zeros(size, np.uint8)
        count = np.zeros(size, np.int64)
        for pp in range(len(w.stages) - 1):
            for tp in prefill_targets(d, w.decode_tp, w.prefill_tp):
                src, s_size = w.prefill(tp, pp)
                pair = StatePairPlan.of(src, dst)
                if pair.window is None:
                    continue
                s_mem = np.zeros(s_size, np.uint8)
                win = src.window
                assert win is not None
                h0, nh = rank_heads(tp, w.prefill_tp, 4)
                for b in range(win.kv_ptrs.size):  # token t, head h of window buffer b
                    layer = win.layer_start + b % win.num_layers
                    for i, page in enumerate(sp.tolist()):
                        for slot in range(ps):
                            t = (s_first + i) * ps + slot
                            at = int(win.kv_ptrs[b]) + int(win.item_lens[b]) * page + \
                                slot * nh * token_bytes
                            s_mem[at:at + nh * token_bytes] = np.concatenate(
                                [_token(layer, b // win.num_layers, t, h0 + h)
                                 for h in range(nh)])
                desc = plan_room_state(pair, -1, -1, sp, dp, "room 1", room_end) \
                    if not pair.src.buffers and not pair.dst.buffers else \
                    plan_room_state(pair, 0, 0, sp, dp, "room 1", room_end)
                for s, t, n in zip(desc.src.tolist(), desc.dst.tolist(),
                                   desc.length.tolist(), strict=True):
                    mem[t:t + n] = s_mem[s:s + n]
                    count[t:t + n] += 1
        want = np.zeros(size, np.uint8)
        wanted = np.zeros(size, bool)
        win = dst.window
        h0, nh = rank_heads(d, w.decode_tp, 4)
        for b in range(win.kv_ptrs.size):
            layer = win.layer_start + b % win.num_layers
            for t in range(lo, room_end):
                at = int(win.kv_ptrs[b]) + int(win.item_lens[b]) * int(dp[t // pd - d_first]) \
                    + (t % pd) * nh * token_bytes
                want[at:at + nh * token_bytes] = np.concatenate(
                    [_token(layer, b // win.num_layers, t, h0 + h) for h in range(nh)])
                wanted[at:at + nh * token_bytes] = True
        state = np.zeros(size, bool)
        for b in dst.buffers:  # state slot 0 of each buffer: the state plan's, not checked
            state[b.ptr:b.ptr + b.slot_bytes] = True
        assert (count[wanted] == 1).all() and (count[~wanted & ~state] == 0).all()
        assert np.array_equal(mem[wanted], want[wanted])


def _token(layer: int, kv: int, t: int, head: int) -> np.ndarray:
    """The bytes of one (window layer, K/V, token, head): distinct for every one of them."""
    return ((np.arange(HEAD_DIM * DTYPE) + 3 * layer + 5 * kv + 11 * t + 17 * head) % 251
            + 1).astype(np.uint8)


def test_i22_window_pages_longer_than_the_room_are_refused() -> None:
    w = World(("full", "window"), 1, 1, (0, 2), 4, 8, {"conv": 1, "ssm": 2})
    dst, _ = World(w.types, 1, 1, w.stages, 16, 8, w.heads).decode(0)
    src, _ = w.prefill(0, 0)
    pair = StatePairPlan.of(src, dst)
    with pytest.raises(PlanRefused, match="2 destination pages named, but the room's 12 "
                                          "tokens fill 1 pages of 16"):
        plan_room_state(pair, -1, -1, np.arange(2), np.arange(2), "room 1", 12)
