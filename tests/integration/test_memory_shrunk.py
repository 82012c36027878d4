"""An engine that truncates its /dev/shm pool below the aux slot after registering it
(case S16), with aux over the control plane: the daemon that reads or writes that aux
used to die with SIGBUS. Real daemons, real Mooncake, stand-in engines."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from kvd.client import KVPoll
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


def test_s16_decode_pool_shrunk_below_aux_leaves_the_daemon_alive(tmp_path: Path) -> None:
    """S16 (decode writes aux): the aux write is refused with an error line naming the
    shrunk pool, the file is not grown back, and the decode daemon lives and serves.
    The room's outcome is not checked: the receiver machine decided Success with the
    write (failing it needs the write's result as a machine event; not done)."""
    pair = start_pair(tmp_path, p_opts=CONTROL_AUX, d_opts=CONTROL_AUX)
    try:
        _room_ok(pair, 1)
        aux = pair.d_engine.registration.aux_buffers[0]
        _shrink_below_aux(pair.d_engine)
        transfer_room(pair.p_engine, pair.d_engine, pair.bootstrap, 2, [2], [2], chunk=1,
                      aux_src=1, aux_dst=2)
        wait_rooms(pair.d_engine.client, [2], timeout=60)
        log = _until_logged(pair.decode.log, "not written")
        assert "shrank under kvd" in log
        assert os.path.getsize(aux.path) == aux.offset  # type: ignore[union-attr]
        _alive(pair)
    finally:
        stop_pair(pair)
