"""kvd.logs: text and JSON lines; room lines carry the room id and peer."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from kvd import logs


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    buf = io.StringIO()
    logs._room_peers.clear()
    yield buf
    root.handlers[:] = saved
    root.setLevel(level)


def lines(buf: io.StringIO) -> list[str]:
    return buf.getvalue().splitlines()


def test_json_lines_carry_room_and_peer(stream: io.StringIO) -> None:
    logs.setup("DEBUG", "json", stream)
    log = logging.getLogger("kvd.test")
    log.warning("explicit", extra={"room": 7, "peer": "tcp://10.0.0.2:5000"})
    logs.remember_peer(8, "tcp://10.0.0.3:5000")
    log.warning("room 8: timed out in Transferring after 1.0s on prefill")
    log.info("room 9: cannot reach prefill rank tcp://10.0.0.4:17000")
    log.info("engine registered: 8 KV buffers")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("room 10 crashed")
    out = [json.loads(line) for line in lines(stream)]
    assert out[0]["room"] == 7 and out[0]["peer"] == "tcp://10.0.0.2:5000"
    assert out[1]["room"] == 8 and out[1]["peer"] == "tcp://10.0.0.3:5000"  # remembered
    assert out[2]["room"] == 9 and out[2]["peer"] == "tcp://10.0.0.4:17000"  # from the text
    assert "room" not in out[3] and out[3]["level"] == "INFO" and out[3]["logger"] == "kvd.test"
    assert out[4]["room"] == 10 and out[4]["peer"] == "-" and "ValueError: boom" in out[4]["exc"]
    assert all(o["ts"].endswith("+00:00") for o in out)


def test_text_lines_and_level(stream: io.StringIO) -> None:
    logs.setup("warning", "text", stream)
    log = logging.getLogger("kvd.test")
    log.info("hidden")
    log.warning("room 12 aborted on decode: x", extra={"peer": "10.0.0.1:8998"})
    log.warning("no room here")
    first, second = lines(stream)
    assert " WARNING kvd.test room=12 peer=10.0.0.1:8998: room 12 aborted" in first
    assert second.endswith(" WARNING kvd.test: no room here")


def test_remembered_peers_are_bounded() -> None:
    for room in range(10_000):
        logs.remember_peer(room, "p")
    assert len(logs._room_peers) <= logs._MAX_ROOMS
    assert 9_999 in logs._room_peers and 0 not in logs._room_peers
