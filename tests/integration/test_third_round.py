"""Third-round cases (K16's dropped messages, K43, K44, K46) on real daemon processes
over the real Mooncake TCP transport on loopback. The same cases run deterministically in
``tests/inproc/test_k_third_round.py``; here they show what only real processes can:
the pump's window in the real engine, a frozen destination (SIGSTOP) holding it, bytes
compared byte for byte. No wall-clock thresholds: "poll until, within a generous bound".
"""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np

from kvd.client import KVPoll, Receiver, Sender
from kvd.refengine.standin import transfer_room, wait_rooms
from tests.conftest import health
from tests.integration.test_second_round import (
    BOUND,
    Cleanup,
    daemon,
    engine,
    pair,
    snapshot,
    until,
)
from tests.integration.test_second_round import (
    stack as stack,  # the fixture
)

ROOMS, ROOM_PAGES, ITEM = 40, 16, 64 << 10
KEEP = (5, 15, 25, 35, 39)
PER_PEER = 8  # the pump's entries in flight per destination (``inflight_entries``)
ENTRY = ROOM_PAGES * ITEM  # contiguous pages: one 1 MiB entry per buffer and room


def test_k43_aborted_rooms_queued_to_a_frozen_decode_are_not_written(
        tmp_path: Path, stack: Cleanup) -> None:
    """40 rooms of 4 MiB (4 entries of 1 MiB each) queued P -> D while D is frozen; P's
    engine aborts 35 of them; D resumes. The 5 kept rooms are exact; no aborted room
    past the pump's first window (8 entries = 2 rooms) has a byte written; P's counters:
    what landed of cancelled writes is at most one window (8 MiB), far below the 140 MiB
    the aborted rooms queued, and every aborted write was cancelled."""
    opts = {"num_layers": 2, "num_pages": ROOMS * ROOM_PAGES + 16, "item_len": ITEM,
            "page_size": 16, "head_dim": 64}
    pd = pair(stack, tmp_path, p_opts={"inflight_entries": PER_PEER},
              d_opts={"waiting_timeout": 120.0}, engine_opts=opts)
    p, d = pd.p_engine, pd.d_engine
    per_room = 2 * 2 * ROOM_PAGES * ITEM  # K and V of 2 layers
    assert per_room == 4 << 20
    dst = {k: np.arange(k * ROOM_PAGES, (k + 1) * ROOM_PAGES) for k in range(ROOMS)}
    src = {k: np.arange(ROOM_PAGES) + (ROOMS - 1 - k) * ROOM_PAGES for k in range(ROOMS)}
    spare = ROOMS * ROOM_PAGES
    # P already wrote to D once (its transfer session is open), as in K24: the first
    # submission to a new peer waits for the transport's handshake with it
    _s, _r0 = transfer_room(p, d, pd.bootstrap, 4299, [spare], [spare], chunk=1)
    assert wait_rooms(d.client, [4299], timeout=BOUND) == [KVPoll.Success]
    base = health(pd.prefill)["counters"]["bytes_sent"]
    before = snapshot(d)
    recv, send = {}, {}
    for k in range(ROOMS):
        recv[k] = Receiver(d.client, 4300 + k, pd.bootstrap)
        recv[k].init(dst[k], int(dst[k][0]))
        send[k] = Sender(p.client, 4300 + k)
        send[k].init(ROOM_PAGES, 0)
    until(lambda: all(s.poll() == KVPoll.WaitingForInput for s in send.values()),
          "P bound every room to D's pages")
    window_rooms = PER_PEER * ENTRY // per_room  # rooms the first window holds
    pd.decode.kill(signal.SIGSTOP)
    try:
        for k in range(ROOMS):
            send[k].send(src[k], is_last=True)
        aborted = [k for k in range(ROOMS) if k not in KEEP]
        for k in aborted:
            send[k].abort("client gone")
        # the queued ones return at once; those holding the window wait for D
        until(lambda: health(pd.prefill)["counters"]["writes_cancelled"] >=
              len(aborted) - window_rooms - 1, "queued writes cancelled while D is frozen")
    finally:
        pd.decode.kill(signal.SIGCONT)
    rooms = [4300 + k for k in range(ROOMS)]
    states = wait_rooms(d.client, rooms, timeout=BOUND)
    assert [k for k, s in zip(range(ROOMS), states, strict=True) if s == KVPoll.Success] == \
        list(KEEP)
    for k in KEEP:
        assert d.pages_equal(p, src[k], dst[k]), f"kept room {k} not exact"
    for k in aborted:
        until(recv[k].releasable, f"aborted room {k} releasable")
    touched = [k for k in aborted if not all(np.array_equal(kv[dst[k]], b[dst[k]])
                                              for kv, b in zip(d.kv, before, strict=True))]
    assert set(touched) <= set(range(window_rooms + 1)), touched
    c = health(pd.prefill)["counters"]
    assert c["cancelled_bytes_landed"] <= PER_PEER * ENTRY, c
    # a write wholly submitted before its abort is not cancelled: at most the window's
    assert c["writes_cancelled"] >= len(aborted) - window_rooms - 1, c
    assert c["cancelled_bytes_dropped"] >= len(aborted) * per_room - PER_PEER * ENTRY, c
    assert c["bytes_sent"] - base >= len(KEEP) * per_room


def test_k44_a_decode_pool_registered_again_gets_no_write_of_an_old_room(
        tmp_path: Path, stack: Cleanup) -> None:
    """P's batches wait 1 s (fault injection) before they go. While P holds a 4 MiB write
    of room R, D's engine drops its connection and registers the same pool again: R fails
    on both sides (``engine disconnected``), the registration returns once nothing of R
    can land, and from then on not one byte of D's pool changes; a room to the pool
    registered anew is then written exactly."""
    from kvd.client import KvdClient

    opts = {"num_layers": 2, "num_pages": 64, "item_len": ITEM, "page_size": 16,
            "head_dim": 64}
    pd = pair(stack, tmp_path, p_opts={"fault_injection": '{"delay_s": 1.0}'},
              engine_opts=opts)
    p, d = pd.p_engine, pd.d_engine
    dst, src = np.arange(16), np.arange(16, 32)
    r = Receiver(d.client, 4400, pd.bootstrap)
    r.init(dst, int(dst[0]))
    s = Sender(p.client, 4400)
    s.init(16, 0)
    until(lambda: s.poll() == KVPoll.WaitingForInput, "P bound to D's pages")
    s.send(src, is_last=True)  # its first batch waits 1 s in P's pump
    d.client.close()
    d.client = KvdClient(pd.decode.socket)
    d.client.call(d.registration)  # returns once nothing of room 4400 can land
    after = snapshot(d)
    until(lambda: s.poll() == KVPoll.Failed, "P's room failed")
    kind, reason = s.failure()
    assert kind == "aborted" and "engine disconnected" in reason, (kind, reason)
    _s, _r2 = transfer_room(p, d, pd.bootstrap, 4401, np.arange(40, 48), np.arange(20, 28),
                           chunk=8)  # after anything of room 4400 could have gone
    assert wait_rooms(d.client, [4401], timeout=BOUND) == [KVPoll.Success]
    assert d.pages_equal(p, np.arange(40, 48), np.arange(20, 28))
    for kv, b in zip(d.kv, after, strict=True):
        b[20:28] = kv[20:28]
    assert all(np.array_equal(kv, b) for kv, b in zip(d.kv, after, strict=True)), \
        "a write of the old room landed in the pool registered anew"


def test_k46_a_room_whose_decode_died_is_ended_by_its_opener_token(
        tmp_path: Path, stack: Cleanup) -> None:
    """Real daemons: P's room R (created with a release digest) was given pages by D, then
    D is SIGKILLed, so no decode will claim R. A wrong token is refused (R untouched);
    the opener's token ends R at once (Failed, aborted); a replay finds it ended."""
    import httpx

    from kvd.protocol.release import new_token, token_digest

    pd = pair(stack, tmp_path)
    token = new_token()
    s = Sender(pd.p_engine.client, 460, token_digest(token))
    s.init(1, 0)
    Receiver(pd.d_engine.client, 460, pd.bootstrap).init([3], 3)
    until(lambda: s.poll() == KVPoll.WaitingForInput, "R bound to D")
    pd.decode.proc.send_signal(signal.SIGKILL)
    url = f"http://{pd.bootstrap}/v1/rooms/release"

    def release(tok: str) -> str:
        r = httpx.post(url, json={"rooms": [460], "token": tok}, timeout=10)
        assert r.status_code == 200, r.text
        return str(r.json()["rooms"]["460"])

    assert release(new_token()) == "refused"
    assert s.poll() == KVPoll.WaitingForInput
    assert release(token) == "released"
    assert s.poll() == KVPoll.Failed and s.failure()[0] == "aborted"
    assert release(token) == "ended"
    s.clear()


def test_k16_a_decode_refused_at_max_peers_has_its_room_failed_not_left_waiting(
        tmp_path: Path, stack: Cleanup) -> None:
    """Real daemons: P holds one decode rank (``max_peers`` 1). D1's room succeeds
    byte-exact; D2's registration is dropped and answered ``full``, so D2's room fails
    with kind registration naming max_peers -- long before its 300 s waiting timeout --
    and P opened no control socket to D2 that it keeps (the refusal's own closes)."""
    p = daemon(stack, "prefill", tmp_path, serve_bootstrap=True, max_peers=1)
    d1 = daemon(stack, "decode", tmp_path)
    d2 = daemon(stack, "decode", tmp_path, waiting_timeout=300.0)
    pe, de1 = engine(stack, p, seed=1), engine(stack, d1, seed=2)
    de2 = engine(stack, d2, seed=3)
    transfer_room(pe, de1, p.http_addr, 1600, [1], [2], chunk=1)
    assert wait_rooms(de1.client, [1600], timeout=BOUND) == [KVPoll.Success]
    assert de1.pages_equal(pe, [1], [2])
    _s2, r2 = transfer_room(pe, de2, p.http_addr, 1601, [3], [4], chunk=1)
    until(lambda: r2.poll() == KVPoll.Failed, "D2's room failed on P's refusal")
    kind, reason = r2.failure()
    assert kind == "registration" and "max_peers" in reason, reason
    assert health(p)["tables"]["peers"] == 1
    until(lambda: health(p)["tables"]["control_sockets"] == 1, "P keeps D1's socket only")
