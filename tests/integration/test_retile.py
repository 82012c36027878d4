"""Real daemons, real Mooncake TCP on loopback: a prefill of 16-token pages writes a decode
of 64-token pages (issue 22 item 3), chunked, with a decode prefix hit. Every decode byte
is compared with a token-by-token copy of the room; bytes the room does not name stay."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvd.client import KVPoll, Receiver, Sender
from kvd.refengine.standin import wait_rooms
from tests.conftest import PdPair, start_pair, stop_pair

pytestmark = pytest.mark.integration

TOKEN = 2 * 64 * 2  # bytes of one token in one buffer: 2 KV heads x head_dim 64 x 2 B
PS, PD = 16, 64


@pytest.fixture(scope="module")
def retiled_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdPair]:
    pair = start_pair(Path(tmp_path_factory.mktemp("pd-retile")),
                      engine_opts={"page_size": PS, "item_len": PS * TOKEN, "num_pages": 64},
                      d_engine_opts={"page_size": PD, "item_len": PD * TOKEN, "num_pages": 16})
    yield pair
    stop_pair(pair)


def test_i22_a_16_to_64_room_lands_token_for_token_over_mooncake(
        retiled_pair: PdPair) -> None:
    p, d = retiled_pair.p_engine, retiled_pair.d_engine
    rng = np.random.default_rng(22)
    tokens, first = 300, 1  # 19 prefill pages, 5 decode pages; the decode holds page 0
    ns, nd = -(-tokens // PS), -(-tokens // PD)
    src = rng.choice(p.num_pages, ns, replace=False)
    dst = rng.choice(d.num_pages, nd, replace=False)
    p.aux[2] = rng.integers(0, 256, p.aux.shape[1], dtype=np.uint8)
    before = [b.copy() for b in d.kv]
    Receiver(d.client, 501, retiled_pair.bootstrap).init(dst[first:], 4, first_page=first)
    send = Sender(p.client, 501)
    send.init(ns, 2)
    for a, b in ((0, 5), (5, 6), (6, 13), (13, ns)):  # chunks that end mid decode page
        send.send(src[a:b])
    assert wait_rooms(d.client, [501]) == [KVPoll.Success]
    assert wait_rooms(p.client, [501]) == [KVPoll.Success]
    end = min(ns * PS, nd * PD)
    for got, old, s in zip(d.kv, before, p.kv, strict=True):
        want = old.copy()
        for t in range(first * PD, end):
            a, b = (t % PS) * TOKEN, (t % PD) * TOKEN
            want[dst[t // PD], b:b + TOKEN] = s[src[t // PS], a:a + TOKEN]
        assert np.array_equal(got, want)
    assert np.array_equal(d.aux[4], p.aux[2])


def _layers_hold(d: PdPair, dst: np.ndarray, src: np.ndarray, before: list[np.ndarray],
                 layers: set[int], tokens: int) -> bool:
    """Do the decode's buffers hold exactly room tokens ``[0, tokens)`` of ``layers`` (a
    token-by-token copy), every other byte as it was?"""
    p, dd = d.p_engine, d.d_engine
    nl = p.num_layers
    for b, (got, old, s) in enumerate(zip(dd.kv, before, p.kv, strict=True)):
        want = old.copy()
        if b % nl in layers:
            for t in range(tokens):
                a, c = (t % PS) * TOKEN, (t % PD) * TOKEN
                want[dst[t // PD], c:c + TOKEN] = s[src[t // PS], a:a + TOKEN]
        if not np.array_equal(got, want):
            return False
    return True


def test_i22_a_16_to_64_room_streams_layer_by_layer_over_mooncake(
        retiled_pair: PdPair) -> None:
    """Layer streaming to another page size: layer 0 of re-tiled pages lands before any
    other layer is sent; a last send of no layers ends the room with aux."""
    p, d = retiled_pair.p_engine, retiled_pair.d_engine
    nl, rng = p.num_layers, np.random.default_rng(23)
    tokens = 256  # 16 prefill pages, 4 decode pages
    src = rng.choice(p.num_pages, tokens // PS, replace=False)
    dst = rng.choice(d.num_pages, tokens // PD, replace=False)
    p.aux[2] = rng.integers(0, 256, p.aux.shape[1], dtype=np.uint8)
    before = [b.copy() for b in d.kv]
    Receiver(d.client, 502, retiled_pair.bootstrap).init(dst, 4)
    send = Sender(p.client, 502)
    send.init(src.size, 2)
    send.send_layers(src, (0, 1))
    bound = time.monotonic() + 60.0  # poll until it landed, within a generous bound
    while not _layers_hold(retiled_pair, dst, src, before, {0}, tokens) and \
            time.monotonic() < bound:
        time.sleep(0.05)
    assert _layers_hold(retiled_pair, dst, src, before, {0}, tokens)
    for layer in range(1, nl):
        send.send_layers([], (layer, layer + 1))
    send.send_layers([], (nl, nl), is_last=True)  # every layer was sent: aux only
    assert wait_rooms(d.client, [502]) == [KVPoll.Success]
    assert wait_rooms(p.client, [502]) == [KVPoll.Success]
    assert _layers_hold(retiled_pair, dst, src, before, set(range(nl)), tokens)
    assert np.array_equal(d.aux[4], p.aux[2])
    send.clear()
