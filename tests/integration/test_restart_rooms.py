"""K27 from the room's side: kvd stopped and started again before the engine's next call,
so the client reconnects and registers again without ever seeing kvd unreachable (as under
systemd's socket activation, which holds the socket across the restart). The new kvd never
knew the engine's rooms: each reads Failed through its room object, with a reason naming
the restart -- not UNKNOWN_ROOM ("cleared") and "room is not failed" -- while a room created
after the restart is the new kvd's and reads as usual. Over the socket and over the ring."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from kvd.client import KVPoll, Receiver
from kvd.launch import start_daemon
from tests.conftest import start_pair, stop_pair

pytestmark = [pytest.mark.integration]


@pytest.mark.parametrize("use_ring", [False, True])
def test_k27_a_room_of_a_kvd_that_restarted_reads_failed_naming_the_restart(
        tmp_path: Path, use_ring: bool) -> None:
    pair = start_pair(tmp_path, engine_opts={"use_ring": use_ring})
    try:
        de = pair.d_engine
        old = Receiver(de.client, 4242, pair.bootstrap)
        old.init([1, 2], aux_index=0)
        assert old.poll() == KVPoll.Bootstrapping
        pair.decode.kill(signal.SIGTERM)
        pair.decode.proc.wait(20)
        pair.decode = start_daemon("decode", tmp_path, engine_socket=pair.decode.socket,
                                   http_port=pair.decode.ready["http_port"])
        assert old.poll() == KVPoll.Failed  # the client reconnected inside this poll
        assert de.client.reconnects == 1
        kind, reason = old.failure()
        assert kind == "unreachable" and "restarted" in reason, reason
        assert old.wait(5.0) == KVPoll.Failed
        new = Receiver(de.client, 4243, pair.bootstrap)  # the new kvd's own room
        new.init([3, 4], aux_index=1)
        assert new.poll() == KVPoll.Bootstrapping and new.failure()[0] == ""
        new.clear()
    finally:
        stop_pair(pair)
