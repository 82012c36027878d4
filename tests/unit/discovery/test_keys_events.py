"""Key layout and watch-event decoding of etcd discovery (pure)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvd.discovery.events import PeerDeleted, PeerPut, View, decode_kv
from kvd.discovery.keys import (
    RankKey,
    b64,
    check_prefix,
    instance_prefix,
    parse_rank_key,
    range_end,
    rank_key,
    unb64,
)

P = "/kvd/test"


def _reg(instance: str, dp: int = 0, tp: int = 0, pp: int = 0, port: int = 7000,
         tp_size: int = 2) -> dict:
    return {"role": "Prefill", "attn_tp_size": tp_size, "attn_tp_rank": tp, "attn_dp_size": 1,
            "attn_dp_rank": dp, "pp_size": 1, "pp_rank": pp, "rank_ip": "10.0.0.1",
            "rank_port": port, "instance_id": instance, "page_size": 16}


def _kv(key: str, value: dict | bytes, rev: int) -> dict:
    data = value if isinstance(value, bytes) else json.dumps(value).encode()
    return {"key": b64(key), "value": b64(data), "mod_revision": str(rev)}


def _put(addr: str, reg: dict, rev: int) -> dict:
    rank = RankKey(reg["attn_dp_rank"], reg["attn_tp_rank"], reg["pp_rank"])
    return {"kv": _kv(rank_key(P, addr, rank), reg, rev)}


def _delete(addr: str, rank: RankKey, rev: int) -> dict:
    return {"type": "DELETE", "kv": {"key": b64(rank_key(P, addr, rank)),
                                      "mod_revision": str(rev)}}


@given(st.text(st.characters(min_codepoint=33, max_codepoint=126, blacklist_characters="/"),
               min_size=1, max_size=40),
       st.integers(0, 64), st.integers(0, 64), st.integers(0, 64))
def test_rank_key_round_trips(name: str, dp: int, tp: int, pp: int) -> None:
    key = rank_key(P, name, RankKey(dp, tp, pp))
    assert key.startswith(instance_prefix(P, name))
    assert parse_rank_key(P, key) == (name, RankKey(dp, tp, pp))
    assert key < range_end(instance_prefix(P, name))  # inside the instance's range


@pytest.mark.parametrize("key", ["/kvd/other/prefill/a:1/0/0/0", f"{P}/prefill/a:1/0/0",
                                 f"{P}/prefill/a:1/0/x/0", f"{P}/prefill/a:1/0/-1/0",
                                 f"{P}/prefill//0/0/0", f"{P}/decode/a:1/0/0/0"])
def test_foreign_or_malformed_keys_are_not_ranks(key: str) -> None:
    assert parse_rank_key(P, key) is None


def test_prefix_and_names_are_checked() -> None:
    assert check_prefix("/kvd/prod/") == "/kvd/prod"
    for bad in ("kvd", "/", "/kvd prod", "/kvd//x"):
        with pytest.raises(ValueError):
            check_prefix(bad)
    with pytest.raises(ValueError):
        rank_key(P, "a/b:1", RankKey(0, 0, 0))
    assert unb64(b64("x:1")) == b"x:1"


def test_values_that_contradict_their_key_or_fail_validation_are_ignored() -> None:
    good = _reg("i1", tp=1)
    assert decode_kv(P, _kv(rank_key(P, "a:1", RankKey(0, 1, 0)), good, 3)) is not None
    assert decode_kv(P, _kv(rank_key(P, "a:1", RankKey(0, 0, 0)), good, 3)) is None
    assert decode_kv(P, _kv(rank_key(P, "a:1", RankKey(0, 0, 0)), b"not json", 3)) is None
    bad = _reg("i1") | {"rank_port": 0}
    assert decode_kv(P, _kv(rank_key(P, "a:1", RankKey(0, 0, 0)), bad, 3)) is None


def test_view_turns_watch_events_into_typed_peer_events() -> None:
    v = View(P)
    [put] = v.apply_event(_put("a:1", _reg("i1"), 5), 5)
    assert put == PeerPut("a:1", RankKey(0, 0, 0), "i1", "tcp://10.0.0.1:7000", 5)
    assert v.apply_event(_put("a:1", _reg("i1"), 5), 5) == []  # a replay changes nothing
    [same] = v.apply_event(_put("a:1", _reg("i1"), 6), 6)  # re-put by the same instance
    assert same.previous is None
    [restart] = v.apply_event(_put("a:1", _reg("i2", port=7001), 8), 8)
    assert (restart.instance, restart.previous, restart.previous_endpoint) == \
        ("i2", "i1", "tcp://10.0.0.1:7000")
    assert v.apply_event(_put("a:1", _reg("i1"), 7), 8) == []  # older than the view: dropped
    [gone] = v.apply_event(_delete("a:1", RankKey(0, 0, 0), 9), 9)
    assert gone == PeerDeleted("a:1", RankKey(0, 0, 0), "i2", "tcp://10.0.0.1:7001", 9)
    assert v.apply_event(_delete("a:1", RankKey(0, 0, 0), 10), 10) == []
    assert v.entries == {} and v.revision == 10


def test_resync_reports_what_changed_while_the_watch_was_down() -> None:
    v = View(P)
    v.apply_event(_put("a:1", _reg("i1", tp=0), 3), 3)
    v.apply_event(_put("a:1", _reg("i1", tp=1), 4), 4)
    v.apply_event(_put("b:1", _reg("j1"), 5), 5)
    # meanwhile: a:1 tp1 expired, b:1 restarted as j2; etcd lost its data (revision 2)
    kvs = [_put("a:1", _reg("i1", tp=0), 3)["kv"], _put("b:1", _reg("j2"), 2)["kv"]]
    events = v.resync(kvs, 2)
    assert PeerDeleted("a:1", RankKey(0, 1, 0), "i1", "tcp://10.0.0.1:7000", 4) in events
    [restart] = [e for e in events if isinstance(e, PeerPut)]
    assert (restart.addr, restart.instance, restart.previous) == ("b:1", "j2", "j1")
    assert len(events) == 2 and v.revision == 2
    assert v.resync(kvs, 2) == []  # nothing changed since


@given(st.lists(st.tuples(st.sampled_from(["a:1", "b:2"]), st.integers(0, 1),
                          st.sampled_from(["i1", "i2", None])), max_size=30))
def test_view_equals_the_store_after_any_event_sequence(ops: list) -> None:
    """The view after applying a store's watch events equals a fresh read of it."""
    v, store = View(P), {}
    for rev, (addr, tp, inst) in enumerate(ops, 1):
        rank = RankKey(0, tp, 0)
        if inst is None:
            if (addr, rank) in store:
                del store[(addr, rank)]
                v.apply_event(_delete(addr, rank, rev), rev)
        else:
            store[(addr, rank)] = (inst, rev)
            v.apply_event(_put(addr, _reg(inst, tp=tp), rev), rev)
    assert {k: (e.instance, e.revision) for k, e in v.entries.items()} == store
