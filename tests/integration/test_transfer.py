"""Two real daemons, real Mooncake TCP on loopback: bytes land exactly, states and aux."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.client import KVPoll, Receiver, Sender, poll_many
from kvd.refengine.standin import transfer_room, wait_rooms
from tests.conftest import PdPair

pytestmark = pytest.mark.integration


def _random_pages(rng: np.random.Generator, n: int, pool: int) -> tuple[np.ndarray, np.ndarray]:
    return rng.choice(pool, n, replace=False), rng.choice(pool, n, replace=False)


def test_room_with_random_pages_and_chunks_lands_byte_for_byte(room_pair: PdPair,
                                                               room_ids) -> None:
    p, d = room_pair.p_engine, room_pair.d_engine
    rng = np.random.default_rng(7)
    src, dst = _random_pages(rng, 37, p.num_pages)
    room = next(room_ids)
    p.aux[3] = rng.integers(0, 256, p.aux.shape[1], dtype=np.uint8)
    d.aux[5] = 0
    before = [b.copy() for b in d.kv]
    send, recv = transfer_room(p, d, room_pair.bootstrap, room, src, dst, chunk=8,
                               aux_src=3, aux_dst=5)
    assert wait_rooms(d.client, [room]) == [KVPoll.Success]
    assert wait_rooms(p.client, [room]) == [KVPoll.Success]
    assert d.pages_equal(p, src, dst)
    assert np.array_equal(d.aux[5], p.aux[3])
    untouched = np.setdiff1d(np.arange(d.num_pages), dst)
    assert all(np.array_equal(a[untouched], b[untouched]) for a, b in zip(d.kv, before,
                                                                          strict=True))
    send.clear()
    recv.clear()


def test_many_concurrent_rooms_polled_in_one_call(room_pair: PdPair, room_ids) -> None:
    p, d = room_pair.p_engine, room_pair.d_engine
    rng = np.random.default_rng(11)
    rooms, plans = [], []
    dst_all = rng.permutation(d.num_pages)
    for i in range(12):
        room = next(room_ids)
        src = rng.choice(p.num_pages, 10, replace=False)
        dst = dst_all[i * 10:(i + 1) * 10]
        Receiver(d.client, room, room_pair.bootstrap).init(dst, i % 16)
        rooms.append(room)
        plans.append((src, dst))
    for room, (src, _) in zip(rooms, plans, strict=True):
        s = Sender(p.client, room)
        s.init(len(src), 0)
        s.send(src[:4])
        s.send(src[4:])
    assert wait_rooms(d.client, rooms) == [KVPoll.Success] * len(rooms)
    for src, dst in plans:
        assert d.pages_equal(p, src, dst)


def test_large_room_is_split_into_accepted_sub_batches(room_pair: PdPair, room_ids) -> None:
    # 200 scattered pages x 8 buffers = 1600 descriptors: more than one batch call accepts.
    p, d = room_pair.p_engine, room_pair.d_engine
    rng = np.random.default_rng(3)
    src = rng.permutation(p.num_pages)[:200]
    dst = np.sort(rng.permutation(d.num_pages)[:200])[::-1].copy()
    room = next(room_ids)
    transfer_room(p, d, room_pair.bootstrap, room, src, dst, chunk=200)
    assert wait_rooms(d.client, [room]) == [KVPoll.Success]
    assert d.pages_equal(p, src, dst)


def test_sender_created_before_receiver_still_succeeds(room_pair: PdPair, room_ids) -> None:
    p, d = room_pair.p_engine, room_pair.d_engine
    room = next(room_ids)
    src, dst = np.arange(5, 15), np.arange(100, 110)
    s = Sender(p.client, room)
    s.init(10, 1)
    assert s.poll() == KVPoll.Bootstrapping
    s.send(src)
    r = Receiver(d.client, room, room_pair.bootstrap)
    r.init(dst, 1)
    assert wait_rooms(d.client, [room]) == [KVPoll.Success]
    assert wait_rooms(p.client, [room]) == [KVPoll.Success]
    assert d.pages_equal(p, src, dst)


def test_poll_of_unknown_and_cleared_room_returns_minus_one(room_pair: PdPair, room_ids) -> None:
    p, d = room_pair.p_engine, room_pair.d_engine
    room = next(room_ids)
    assert poll_many(d.client, [room, room + 10**9]) == [-1, -1]
    send, recv = transfer_room(p, d, room_pair.bootstrap, room, [1, 2], [3, 4], chunk=2)
    assert wait_rooms(d.client, [room]) == [KVPoll.Success]
    recv.clear()
    assert recv.poll() == -1
    wait_rooms(p.client, [room])
    send.clear()
    assert send.poll() == -1


def test_tens_of_thousands_of_descriptors_are_split_into_accepted_batches(tmp_path) -> None:
    from tests.conftest import start_pair, stop_pair

    pair = start_pair(tmp_path, engine_opts={"num_pages": 4096, "item_len": 64,
                                             "head_dim": 2, "page_size": 16})
    p, d = pair.p_engine, pair.d_engine
    try:
        rng = np.random.default_rng(17)
        src, dst = rng.permutation(4096)[:3000], rng.permutation(4096)[:3000]
        transfer_room(p, d, pair.bootstrap, 1, src, dst, chunk=3000)  # ~24 000 descriptors
        assert wait_rooms(d.client, [1], timeout=60) == [KVPoll.Success]
        assert d.pages_equal(p, src, dst)
    finally:
        stop_pair(pair)
