"""An engine that truncates its /dev/shm pool after registering it (case S16): below the
aux slot with aux over the control plane (the daemon that read or wrote that aux used to
die with SIGBUS), and below every page under a room's transfer, with Mooncake over TCP
(pages and aux written by the transfer engine) and with the ``local`` backend (which
used to die with SIGBUS copying from or into the mapping). Each time the room fails
with kind ``layout`` naming the buffer, the daemon drops the registration with one log
line, refuses the engine's next room naming why, and serves a good pool registered
afterwards byte for byte. Real daemons, real Mooncake, stand-in engines."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import numpy as np
import pytest

from kvd.client import KVPoll, Receiver, Sender
from kvd.errors import KvdError
from kvd.launch import DaemonProcess
from kvd.refengine.standin import EngineStandIn, transfer_room, wait_rooms
from tests.conftest import PdPair, health, start_pair, stop_pair

pytestmark = [pytest.mark.integration]

CONTROL_AUX = {"aux_transport": "control"}


def _shrink_below_aux(engine: EngineStandIn) -> None:
    """Truncate the engine's pool file to the start of its aux buffer. The test process
    must not touch ``engine.aux`` after this (its own mapping would fault)."""
    aux = engine.registration.aux_buffers[0]
    os.truncate(aux.path, aux.offset)  # type: ignore[union-attr]
    engine.aux = np.zeros((0, 0), dtype=np.uint8)


def _room_ok(pair: PdPair, room: int) -> None:
    send, recv = transfer_room(pair.p_engine, pair.d_engine, pair.bootstrap, room, [room],
                               [room], chunk=1, aux_src=1, aux_dst=2)
    assert wait_rooms(pair.d_engine.client, [room]) == [KVPoll.Success]
    assert pair.d_engine.pages_equal(pair.p_engine, [room], [room])
    for r in (send, recv):
        r.clear()


def _alive(pair: PdPair) -> None:
    """Both daemons still run and answer /health."""
    assert pair.prefill.proc.poll() is None and pair.decode.proc.poll() is None
    assert health(pair.prefill)["status"] and health(pair.decode)["status"]


def _until_logged(path: Path, text: str) -> str:
    for _ in range(300):  # generous bound: 30 s
        log = path.read_text(errors="replace")
        if text in log:
            return log
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {path}")


def test_s16_prefill_pool_shrunk_below_aux_fails_the_room_and_the_daemon_lives(
        tmp_path: Path) -> None:
    """S16 (prefill reads aux): the room's decode side fails with kind ``layout`` naming
    the shrunk pool; the prefill daemon lives and serves; rooms before were byte-exact."""
    pair = start_pair(tmp_path, p_opts=CONTROL_AUX, d_opts=CONTROL_AUX)
    try:
        _room_ok(pair, 1)
        _shrink_below_aux(pair.p_engine)
        _send, recv = transfer_room(pair.p_engine, pair.d_engine, pair.bootstrap, 2, [2], [2],
                                    chunk=1, aux_src=1, aux_dst=2)
        assert wait_rooms(pair.d_engine.client, [2], timeout=60) == [KVPoll.Failed]
        kind, reason = recv.failure()
        assert kind == "layout" and "shrank under kvd" in reason, (kind, reason)
        _until_logged(pair.prefill.log, "cannot be read")
        _alive(pair)
    finally:
        stop_pair(pair)


def test_s16_decode_pool_shrunk_below_aux_fails_the_room_and_the_daemon_lives(
        tmp_path: Path) -> None:
    """S16 (decode writes aux): the aux write is refused with an error line naming the
    shrunk pool, the file is not grown back, the room is Failed (never Success: the
    machine counts the prefill's Success only once the slot is written), kind
    ``layout``, and the decode daemon lives and serves."""
    pair = start_pair(tmp_path, p_opts=CONTROL_AUX, d_opts=CONTROL_AUX)
    try:
        _room_ok(pair, 1)
        aux = pair.d_engine.registration.aux_buffers[0]
        _shrink_below_aux(pair.d_engine)
        _send, recv = transfer_room(pair.p_engine, pair.d_engine, pair.bootstrap, 2, [2],
                                    [2], chunk=1, aux_src=1, aux_dst=2)
        assert wait_rooms(pair.d_engine.client, [2], timeout=60) == [KVPoll.Failed]
        kind, reason = recv.failure()
        assert kind == "layout" and "shrank under kvd" in reason, (kind, reason)
        log = _until_logged(pair.decode.log, "not written")
        assert "shrank under kvd" in log
        assert os.path.getsize(aux.path) == aux.offset  # type: ignore[union-attr]
        _alive(pair)
    finally:
        stop_pair(pair)


DROPPED = "dropping its registration"


def _truncate_pool(engine: EngineStandIn) -> str:
    """Truncate the engine's pool file to the start of its first KV buffer (every page
    and the aux slots gone); returns the file. The test must not touch the engine's
    views after this (its own mapping would fault)."""
    first = engine.registration.kv_buffers[0]
    os.truncate(first.path, first.offset)  # type: ignore[union-attr]
    engine.kv, engine.aux = [], np.zeros((0, 0), dtype=np.uint8)
    return str(first.path)  # type: ignore[union-attr]


@pytest.mark.parametrize("side", ["prefill", "decode"])
@pytest.mark.parametrize("backend", ["mooncake", "local"])
def test_s16_pool_truncated_under_a_transfer_fails_the_room_and_drops_the_registration(
        tmp_path: Path, backend: str, side: str) -> None:
    """S16 under the transfer engine's copies (pages, and aux with the default
    ``aux_transport = "mooncake"``): the ``side`` engine truncates its pool between the
    room's init and its pages. Mooncake's TCP transport reads and writes the mapping with
    socket calls (EFAULT, not SIGBUS); the local backend copies through the kernel. The
    room fails with kind ``layout`` naming the buffer (whichever comes first: the
    transfer's failure, or the sweep's check), that daemon logs the drop once, refuses the
    engine's next room naming why, lives, and a good pool registered again moves a fresh
    room byte for byte."""
    opts = {"transfer_backend": backend}
    pair = start_pair(tmp_path, p_opts=opts, d_opts=opts)
    try:
        _room_ok(pair, 1)
        engine, daemon = ((pair.p_engine, pair.prefill) if side == "prefill"
                          else (pair.d_engine, pair.decode))
        recv = Receiver(pair.d_engine.client, 2, pair.bootstrap)
        recv.init(np.array([2]), 2)
        send = Sender(pair.p_engine.client, 2)
        send.init(1, 1)
        _truncate_pool(engine)
        with contextlib.suppress(KvdError):  # the room may have failed already (sweep)
            send.send(np.array([2]))
        assert wait_rooms(pair.d_engine.client, [2], timeout=60) == [KVPoll.Failed]
        kind, reason = recv.failure()
        assert kind == "layout" and "now ends at byte 0" in reason, (kind, reason)
        if side == "prefill":  # its engine reads why too (the rooms stay until it registers)
            assert send.failure()[0] == "layout"
        log = _until_logged(daemon.log, DROPPED)
        assert log.count(DROPPED) == 1 and "KV buffer 0" in log
        _alive(pair)
        _next_call_refused(engine, side, pair.bootstrap)
        _serves_a_fresh_pool(pair, side, daemon)
    finally:
        stop_pair(pair)


def _next_call_refused(engine: EngineStandIn, side: str, bootstrap: str) -> None:
    with pytest.raises(KvdError, match="registration was dropped"):
        if side == "prefill":
            Sender(engine.client, 3).init(1, 0)
        else:
            Receiver(engine.client, 3, bootstrap).init(np.array([3]), 3)


def _serves_a_fresh_pool(pair: PdPair, side: str, daemon: DaemonProcess) -> None:
    """The truncated engine goes; a good pool registers with the same daemon and a fresh
    room moves byte for byte."""
    old = pair.p_engine if side == "prefill" else pair.d_engine
    old.close()
    fresh = EngineStandIn(daemon.socket, seed=5)
    if side == "prefill":
        pair.p_engine = fresh
    else:
        pair.d_engine = fresh
    assert health(daemon)["engine_registered"]
    _room_ok(pair, 4)
