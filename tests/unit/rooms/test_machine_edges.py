"""Room machines at their edges: a decode rank registering again (same or new instance),
and engine calls refused after they changed a room (the RoomError carries the effects
of that change, so the peers still hear the room's end)."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.errors import RoomError
from kvd.protocol import control
from kvd.protocol.codec import pack_indices
from kvd.rooms.effects import Ended, Report, Resolve, Send, Write
from kvd.rooms.receiver import ReceiverRooms, Target
from kvd.rooms.sender import SenderRooms
from kvd.rooms.state import FailureKind, KVPoll

EP = "tcp://127.0.0.1:9"


def _args() -> control.KVArgsWire:
    return control.KVArgsWire(session_id="d:1", kv_data_ptrs=[0], kv_data_lens=[64 * 16],
                              kv_item_lens=[64], aux_data_ptrs=[], aux_data_lens=[],
                              aux_item_lens=[], page_size=16, num_kv_heads=1, head_dim=32,
                              dtype_size=2, num_layers=1)


def _register(m: SenderRooms, instance: str, now: float) -> list:
    msg = control.RegisterRank(instance_id=instance, endpoint=EP, attn_tp_rank=0,
                               attn_tp_size=1, kv_args=_args())
    return m.on_register(msg, num_pages=16, num_aux_slots=0, rejected=None,
                         payload=object(), now=now)


def _bound_room(m: SenderRooms, room: int, instance: str, now: float) -> Write:
    m.create(room, now)
    m.init(room, 1, 0, now)
    m.on_pages(control.RoomPages(room=room, inc=7, endpoint=EP, instance_id=instance,
                                 dst_pages=pack_indices([3]), aux_index=0,
                                 write_within=60.0), now)
    writes = [e for e in m.send(room, np.asarray([5]), True, now) if isinstance(e, Write)]
    assert len(writes) == 1
    return writes[0]


def _reports(effects: list) -> list[Report]:
    return [e for e in effects if isinstance(e, Report)]


def test_the_same_instance_registering_again_still_hears_its_rooms() -> None:
    m = SenderRooms()
    m.num_pages = 16
    _register(m, "a", 0.0)
    w = _bound_room(m, 1, "a", 0.0)
    assert _register(m, "a", 1.0) == []  # e.g. a new bootstrap epoch: same instance
    out = _reports(m.write_done(1, w.attempt, None, 64, 0.1, 2.0))
    assert [(r.to, r.inc, r.status) for r in out] == [(EP, 7, KVPoll.Success)]


def test_a_new_instance_fails_rooms_bound_to_any_earlier_registration_of_the_old_one() -> None:
    m = SenderRooms()
    m.num_pages = 16
    _register(m, "a", 0.0)
    w = _bound_room(m, 1, "a", 0.0)
    _register(m, "a", 1.0)
    _register(m, "b", 2.0)  # restarted
    p = m.poll(1)
    assert p is not None and p.status == KVPoll.Failed
    assert p.failure is not None and p.failure.kind == FailureKind.PEER
    assert _reports(m.write_done(1, w.attempt, None, 64, 0.1, 3.0)) == []  # never to "b"


def test_clearing_an_unfinished_receiver_tells_its_targets_even_when_refused() -> None:
    m = ReceiverRooms("tcp://d:1", "inst")
    m.num_pages, m.num_aux_slots = 16, 1
    (resolve,) = m.create(1, "boot:1", None, 0.0)
    assert isinstance(resolve, Resolve)
    m.init(1, pack_indices([2, 3]), 0, 0.0)
    m.resolved(1, resolve.inc, [Target("tcp://p:1", "p-inst")], 0.0)  # RoomPages sent
    with pytest.raises(RoomError, match="not releasable") as info:
        m.clear(1, 1.0)
    aborts = [e for e in info.value.effects
              if isinstance(e, Send) and isinstance(e.msg, control.RoomAbort)]
    assert [a.to for a in aborts] == ["tcp://p:1"]
    assert any(isinstance(e, Ended) for e in info.value.effects)
    p = m.poll(1, 1.0)
    assert p is not None and p.status == KVPoll.Failed and not p.releasable


def test_a_bad_chunk_fails_the_sender_and_its_destinations_hear_it() -> None:
    m = SenderRooms()
    m.num_pages = 16
    _register(m, "a", 0.0)
    m.create(1, 0.0)
    m.init(1, 1, 0, 0.0)
    m.on_pages(control.RoomPages(room=1, inc=3, endpoint=EP, instance_id="a",
                                 dst_pages=pack_indices([3]), aux_index=0,
                                 write_within=60.0), 0.0)
    with pytest.raises(RoomError) as info:
        m.send(1, np.asarray([99]), True, 1.0)  # outside the 16-page pool
    reports = [e for e in info.value.effects if isinstance(e, Report)]
    assert [(r.to, r.inc, r.status) for r in reports] == [(EP, 3, KVPoll.Failed)]
    assert reports[0].failure is not None and reports[0].failure.kind == FailureKind.LAYOUT
    assert any(isinstance(e, Ended) for e in info.value.effects)
