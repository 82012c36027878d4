"""kvd.control.routing: which prefill ranks feed a decode rank (SGLang's target-rank rules)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvd.control.routing import Target, check_tp_pair, resolve_targets
from kvd.errors import RegistrationError


def test_equal_tp() -> None:
    for rank in range(4):
        ts = resolve_targets(room=10, decode_tp_rank=rank, decode_tp=4, prefill_tp=4,
                             prefill_dp=1, prefill_pp=1, is_mla=False)
        assert ts == [Target(tp_rank=rank, dp_group=0, pp_rank=0, is_dummy=False,
                             required_dst_info_num=1)]


@pytest.mark.parametrize("decode_tp, prefill_tp", [(2, 1), (4, 1), (4, 2), (8, 2)])
@pytest.mark.parametrize("is_mla", [False, True])
def test_decode_tp_larger(decode_tp: int, prefill_tp: int, is_mla: bool) -> None:
    ratio = decode_tp // prefill_tp
    fed_by: dict[int, list[int]] = {}
    for rank in range(decode_tp):
        (t,) = resolve_targets(0, rank, decode_tp, prefill_tp, 1, 1, is_mla)
        assert t.tp_rank == rank // ratio
        assert t.required_dst_info_num == ratio
        assert not t.is_dummy
        fed_by.setdefault(t.tp_rank, []).append(rank)
    # every prefill rank feeds exactly `ratio` consecutive decode ranks
    assert sorted(fed_by) == list(range(prefill_tp))
    assert all(len(v) == ratio for v in fed_by.values())


def test_decode_tp_larger_example() -> None:
    ts = resolve_targets(5, decode_tp_rank=3, decode_tp=4, prefill_tp=2, prefill_dp=1,
                         prefill_pp=1, is_mla=False)
    assert ts == [Target(1, 0, 0, False, 2)]


def test_decode_tp_smaller_mha_all_real() -> None:
    ts = resolve_targets(0, decode_tp_rank=1, decode_tp=2, prefill_tp=8, prefill_dp=1,
                         prefill_pp=1, is_mla=False)
    assert [t.tp_rank for t in ts] == [4, 5, 6, 7]
    assert not any(t.is_dummy for t in ts)
    assert all(t.required_dst_info_num == 1 for t in ts)


def test_decode_tp_smaller_mla_first_real_others_dummy() -> None:
    ts = resolve_targets(0, decode_tp_rank=1, decode_tp=2, prefill_tp=8, prefill_dp=1,
                         prefill_pp=1, is_mla=True)
    assert [t.tp_rank for t in ts] == [4, 5, 6, 7]
    assert [t.is_dummy for t in ts] == [False, True, True, True]


@given(st.integers(0, 10**12), st.integers(1, 8))
def test_dp_group_is_room_modulo_dp(room: int, dp: int) -> None:
    ts = resolve_targets(room, 0, 1, 1, dp, 1, False)
    assert [t.dp_group for t in ts] == [room % dp]


def test_explicit_dp_rank_wins() -> None:
    ts = resolve_targets(room=7, decode_tp_rank=0, decode_tp=1, prefill_tp=1, prefill_dp=4,
                         prefill_pp=1, is_mla=False, dp_rank=1)
    assert [t.dp_group for t in ts] == [1]
    ts = resolve_targets(room=7, decode_tp_rank=0, decode_tp=1, prefill_tp=1, prefill_dp=4,
                         prefill_pp=1, is_mla=False, dp_rank=0)
    assert [t.dp_group for t in ts] == [0]


@pytest.mark.parametrize("dp_rank", [4, 5, -1])
def test_dp_rank_out_of_range_refused(dp_rank: int) -> None:
    with pytest.raises(RegistrationError, match=f"target_dp_group {dp_rank}"):
        resolve_targets(0, 0, 1, 1, 4, 1, False, dp_rank=dp_rank)


def test_every_pp_stage_listed() -> None:
    ts = resolve_targets(3, decode_tp_rank=0, decode_tp=1, prefill_tp=2, prefill_dp=2,
                         prefill_pp=3, is_mla=True)
    assert [(t.pp_rank, t.tp_rank, t.is_dummy) for t in ts] == [
        (0, 0, False), (0, 1, True), (1, 0, False), (1, 1, True), (2, 0, False), (2, 1, True)]
    assert {t.dp_group for t in ts} == {1}


@given(decode_exp=st.integers(0, 3), prefill_exp=st.integers(0, 3), pp=st.integers(1, 4),
       dp=st.integers(1, 4), room=st.integers(0, 1000), is_mla=st.booleans(), data=st.data())
def test_targets_cover_prefill_ranks(decode_exp: int, prefill_exp: int, pp: int, dp: int,
                                     room: int, is_mla: bool, data: st.DataObject) -> None:
    decode_tp, prefill_tp = 2**decode_exp, 2**prefill_exp
    per_decode = [resolve_targets(room, r, decode_tp, prefill_tp, dp, pp, is_mla)
                  for r in range(decode_tp)]
    rank = data.draw(st.integers(0, decode_tp - 1))
    ts = per_decode[rank]
    assert len(ts) == pp * max(1, prefill_tp // decode_tp)
    assert all(0 <= t.tp_rank < prefill_tp for t in ts)
    assert {t.pp_rank for t in ts} == set(range(pp))
    # across all decode ranks, every (prefill tp rank, pp stage) is covered by a real target
    real = {(t.tp_rank, t.pp_rank) for tl in per_decode for t in tl if not t.is_dummy}
    if is_mla and prefill_tp > decode_tp:
        assert {tp for tp, _ in real} == {r * (prefill_tp // decode_tp) for r in range(decode_tp)}
    else:
        assert real == {(tp, p) for tp in range(prefill_tp) for p in range(pp)}


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 1), (2, 4), (4, 2), (8, 1), (1, 8),
                                                   (3, 6), (6, 3)])
def test_tp_pair_accepted(prefill_tp: int, decode_tp: int) -> None:
    check_tp_pair(prefill_tp, decode_tp)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(3, 2), (2, 3), (4, 6), (0, 1), (1, 0),
                                                   (-2, 2)])
def test_tp_pair_refused(prefill_tp: int, decode_tp: int) -> None:
    with pytest.raises(RegistrationError):
        check_tp_pair(prefill_tp, decode_tp)


def test_tp_pair_3_2_refused_by_resolve_targets() -> None:
    with pytest.raises(RegistrationError, match="prefill attn_tp 3 and decode attn_tp 2"):
        resolve_targets(0, 0, decode_tp=2, prefill_tp=3, prefill_dp=1, prefill_pp=1,
                        is_mla=False)
