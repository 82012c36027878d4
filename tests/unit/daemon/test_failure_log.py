"""K41: room failures are logged one line per cause a second, not one per room (the
side's :class:`FailureLog`; lines counted, no clock: the window's end is a loop timer)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvd.daemon import side
from kvd.daemon.side import FailureLog
from kvd.rooms.state import FailureKind, RoomFailure


def _failure(kind: FailureKind, room: int) -> RoomFailure:
    return RoomFailure(kind, f"room {room}: bootstrap 127.1.0.{room % 250}:9 unreachable",
                       "decode")


def test_k41_a_mass_failure_is_two_lines_per_cause_counting_every_room(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(side, "FAILURE_LOG_S", 0.01)
    flog = FailureLog(logging.getLogger("kvd.rooms"))

    async def main() -> None:
        for room in range(1000):
            flog.add(room, "p:1", _failure(FailureKind.BOOTSTRAP, room))
        flog.add(5000, "p:1", _failure(FailureKind.PEER, 5000))
        for _ in range(200):  # poll until the window closed, within a generous bound
            if flog.lines >= 3:
                break
            await asyncio.sleep(0.01)

    with caplog.at_level(logging.WARNING, "kvd.rooms"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records]
    assert flog.lines == len(lines) == 3
    assert lines[0] == "room 0: bootstrap 127.1.0.0:9 unreachable"  # the first, as before
    assert lines[1] == "room 5000: bootstrap 127.1.0.0:9 unreachable"  # another cause
    assert lines[2].startswith("999 more rooms failed (kind bootstrap)")
    assert "rooms 1, 2, 3, 4, 5, ..." in lines[2]


def test_without_a_loop_every_failure_is_its_own_line(
        caplog: pytest.LogCaptureFixture) -> None:
    flog = FailureLog(logging.getLogger("kvd.rooms"))
    with caplog.at_level(logging.WARNING, "kvd.rooms"):
        for room in range(3):
            flog.add(room, "", _failure(FailureKind.TIMEOUT, room))
    assert flog.lines == len(caplog.records) == 3
