"""poll_many turns kvd's status values into KVPoll; a value that is no status is a
ProtocolError naming it (it used to escape as an IndexError, or read as UNKNOWN_ROOM)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvd.client import poll_many
from kvd.errors import ProtocolError
from kvd.protocol import rpc
from kvd.rooms import UNKNOWN_ROOM, KVPoll


class _Answers:
    """A client whose every call answers ``statuses``."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = statuses

    def call(self, call: Any) -> rpc.PollResult:
        return rpc.PollResult(statuses=self.statuses, releasable=[])


@given(st.lists(st.sampled_from([*map(int, KVPoll), UNKNOWN_ROOM]), max_size=200))
def test_every_status_value_maps_to_its_kvpoll(values: list[int]) -> None:
    got = poll_many(_Answers(values), list(range(len(values))))  # type: ignore[arg-type]
    assert got == [UNKNOWN_ROOM if v == UNKNOWN_ROOM else KVPoll(v) for v in values]
    assert all(type(g) is KVPoll for g, v in zip(got, values, strict=True) if v >= 0)


@pytest.mark.parametrize("bad", [5, 9, -2, 2**40])
def test_a_value_that_is_no_status_is_a_protocol_error(bad: int) -> None:
    with pytest.raises(ProtocolError, match=f"room status {bad}"):
        poll_many(_Answers([4, bad]), [1, 2])  # type: ignore[arg-type]
