"""SenderRooms: what a decode rank's (re-)registration does to the rooms bound to it."""

from __future__ import annotations

import numpy as np

from kvd.protocol import control
from kvd.protocol.codec import pack_indices
from kvd.rooms.effects import Report, Write
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
