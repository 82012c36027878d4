"""kvd.rooms.sender: the prefill side's room machine, transition by transition (tier 1, pure).

Times are plain numbers (seconds); the deadlines come from ``roomkit.TIMEOUTS``
(bootstrap 10, waiting 20, transfer 5, release 3, tombstone 50, finished_ttl 40).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from roomkit import (
    AUX,
    D0,
    D1,
    POOL,
    TIMEOUTS,
    kv_args,
    of,
    one,
    pages,
    register,
    registered,
    room_abort,
    room_pages,
    sender,
)

from kvd.errors import RoomError
from kvd.rooms.effects import CancelWrites, Ended, ForgetPeer, Refuse, Report, Wake, Write
from kvd.rooms.sender import Limits, SenderRooms
from kvd.rooms.state import FailureKind, KVPoll, RoomFailure

R = 7


def bound(now: float = 0.0, dst: tuple[int, ...] = (0, 1), within: float = 20.0,
          aux_index: int = 0) -> SenderRooms:
    """D0 registered, room R created and bound to D0 incarnation 1: WaitingForInput."""
    s = sender()
    registered(s, now)
    s.create(R, now)
    s.init(R, len(dst), 1, now)
    assert s.on_pages(room_pages(R, 1, dst, within=within, aux_index=aux_index), now) == []
    assert s.poll(R).status == KVPoll.WaitingForInput
    return s


def status(s: SenderRooms, room: int = R) -> KVPoll:
    p = s.poll(room)
    assert p is not None
    return p.status


# ---- creation, init, refusals of engine calls ---------------------------------------------

def test_create_starts_bootstrapping() -> None:
    s = sender()
    assert s.create(R, 0.0) == []
    p = s.poll(R)
    assert p is not None and p.status == KVPoll.Bootstrapping and p.failure is None
    assert s.poll(R + 1) is None  # unknown: a defined value, never raises


def test_k03_duplicate_active_room_refused_first_unharmed() -> None:
    s = bound()
    with pytest.raises(RoomError, match="already active"):
        s.create(R, 1.0)
    assert status(s) == KVPoll.WaitingForInput
    assert s.rooms[R].attempt == 1


def test_create_after_end_is_a_new_attempt() -> None:
    s = bound()
    s.abort(R, "client gone", 1.0)
    s.create(R, 2.0)
    assert status(s) == KVPoll.Bootstrapping
    assert s.rooms[R].attempt == 2
    assert R in s.tombstones  # the ended attempt is remembered


@pytest.mark.parametrize("num_pages, aux_index, match", [
    (POOL + 1, 0, "num_pages"),
    (-1, 0, "num_pages"),
    (1, AUX, "aux_index"),
    (1, -1, "aux_index"),
])
def test_init_refuses_indices_out_of_range(num_pages: int, aux_index: int, match: str) -> None:
    s = sender()
    s.create(R, 0.0)
    with pytest.raises(RoomError, match=match):
        s.init(R, num_pages, aux_index, 0.0)
    assert status(s) == KVPoll.Bootstrapping  # a refused call changes nothing


def test_init_and_send_of_unknown_room_raise() -> None:
    s = sender()
    with pytest.raises(RoomError, match="unknown room"):
        s.init(R, 1, 0, 0.0)
    with pytest.raises(RoomError, match="unknown room"):
        s.send(R, pages(0), True, 0.0)
    assert s.abort(R, "x", 0.0) == [] and s.clear(R, 0.0) == []


def test_send_source_page_outside_pool_fails_room_and_tells_decode() -> None:
    s = bound()
    with pytest.raises(RoomError, match="source page index") as refused:
        s.send(R, pages(0, POOL), True, 1.0)
    assert status(s) == KVPoll.Failed
    assert s.rooms[R].failure.kind == FailureKind.LAYOUT
    # the decode must hear it now, not at its waiting timeout: the refusal carries it
    rep = one(refused.value.effects, Report)
    assert (rep.to, rep.inc, rep.status, rep.quiesced) == (D0, 1, KVPoll.Failed, True)
    assert rep.failure.kind == FailureKind.LAYOUT


# ---- binding destinations ------------------------------------------------------------------

def test_pages_before_room_are_buffered_then_bound() -> None:
    s = sender()
    registered(s)
    assert s.on_pages(room_pages(R, 1, (3, 4)), 1.0) == []
    assert s.table_sizes()["pending"] == 1 and s.pending_bytes == 8
    s.create(R, 2.0)
    assert status(s) == KVPoll.WaitingForInput
    assert s.table_sizes()["pending"] == 0 and s.pending_bytes == 0
    assert list(s.rooms[R].dests[D0].pages) == [3, 4]
    assert s.rooms[R].dests[D0].write_deadline == 1.0 + 20.0  # arrival + write_within


def test_two_destinations_required_tp_1_to_2() -> None:
    s = sender()
    registered(s, endpoint=D0, tp_rank=0, tp_size=2)
    registered(s, endpoint=D1, instance="d1-a", tp_rank=1, tp_size=2)
    s.create(R, 0.0)
    s.on_pages(room_pages(R, 1, required=2), 0.0)
    assert status(s) == KVPoll.Bootstrapping
    s.on_pages(room_pages(R, 5, (8, 9), endpoint=D1, instance="d1-a", required=2), 0.5)
    assert status(s) == KVPoll.WaitingForInput
    w = one(s.send(R, pages(10, 11), True, 1.0), Write)
    assert {(d.endpoint, tuple(d.dst_pages)) for d in w.dests} == {(D0, (0, 1)), (D1, (8, 9))}


def test_s11_destinations_disagreeing_on_their_number_fail_the_room_unwritten() -> None:
    """A peer binds first saying two decode ranks, the real one then says one: the later
    count must not let the first stay on as an extra destination; the room fails on both,
    before any write."""
    s = sender()
    registered(s, endpoint=D0)
    registered(s, endpoint=D1, instance="d1-a")
    s.create(R, 0.0)
    assert s.on_pages(room_pages(R, 9, endpoint=D1, instance="d1-a", required=2), 0.0) == []
    out = s.on_pages(room_pages(R, 1, required=1), 0.5)
    assert not of(out, Write)
    reps = {(r.to, r.status) for r in of(out, Report)}
    assert reps == {(D0, KVPoll.Failed), (D1, KVPoll.Failed)}
    assert status(s) == KVPoll.Failed
    assert s.rooms[R].failure.kind == FailureKind.DUPLICATE
    assert s.send(R, pages(10), True, 1.0) == []


def test_destination_beyond_required_dst_info_num_refused() -> None:
    s = bound()
    registered(s, endpoint=D1, instance="d1-a")
    rep = one(s.on_pages(room_pages(R, 9, endpoint=D1, instance="d1-a"), 1.0), Report)
    assert (rep.to, rep.inc, rep.status, rep.quiesced) == (D1, 9, KVPoll.Failed, True)
    assert rep.failure.kind == FailureKind.DUPLICATE
    assert status(s) == KVPoll.WaitingForInput and set(s.rooms[R].dests) == {D0}


def test_k03_second_incarnation_from_bound_rank_refused() -> None:
    s = bound()
    rep = one(s.on_pages(room_pages(R, 2, (5, 6)), 1.0), Report)
    assert (rep.inc, rep.status, rep.failure.kind) == (2, KVPoll.Failed, FailureKind.DUPLICATE)
    assert s.rooms[R].dests[D0].inc == 1  # P never merges their pages


@pytest.mark.parametrize("msg_kw, kind, match", [
    ({"dst": (0, POOL)}, FailureKind.LAYOUT, "outside the registered pool"),
    ({"aux_index": AUX}, FailureKind.LAYOUT, "aux_index"),
    ({"within": 0.0}, FailureKind.TIMEOUT, "deadline already passed"),
    ({"required": 0}, FailureKind.LAYOUT, "required_dst_info_num"),
])
def test_refused_destination_fails_room(msg_kw: dict, kind: FailureKind, match: str) -> None:
    s = sender()
    registered(s)
    s.create(R, 0.0)
    out = s.on_pages(room_pages(R, 1, **msg_kw), 1.0)
    rep = of(out, Report)[0]
    assert (rep.to, rep.inc, rep.status, rep.quiesced) == (D0, 1, KVPoll.Failed, True)
    assert rep.failure.kind == kind and match in rep.failure.reason
    assert status(s) == KVPoll.Failed and s.rooms[R].failure.kind == kind
    assert one(out, Ended).status == KVPoll.Failed


def test_malformed_page_indices_answered_not_raised() -> None:
    s = sender()
    registered(s)
    s.create(R, 0.0)
    bad = room_pages(R, 1).__class__(**{**{f: getattr(room_pages(R, 1), f) for f in
                                           room_pages(R, 1).__struct_fields__},
                                        "dst_pages": b"\x01\x02\x03"})
    rep = one(s.on_pages(bad, 1.0), Report)
    assert rep.status == KVPoll.Failed and rep.failure.kind == FailureKind.LAYOUT
    assert s.on_pages(bad, 1.0)  # still answered, still no exception


def test_messages_from_unregistered_or_stale_instance_dropped() -> None:
    """Dropped and counted. Another instance at a registered endpoint is answered
    ``unregistered`` (K16: the refusal is sealed for that instance, only it acts on it);
    an endpoint that never registered is not (S13: nothing connects to it)."""
    s = sender()
    registered(s)
    s.create(R, 0.0)
    assert s.on_pages(room_pages(R, 1, endpoint=D1), 1.0) == []
    stale = [room_pages(R, 1, instance="d-old"), room_abort(R, 1, instance="d-old")]
    assert [s.on_pages(stale[0], 1.0), s.on_abort(stale[1], 1.0)] == [
        [Refuse(m, "unregistered")] for m in stale]
    assert s.dropped == {"unregistered": 1, "stale_instance": 2}
    assert status(s) == KVPoll.Bootstrapping and not s.rooms[R].dests


def test_k16_a_forgotten_decode_is_told_it_is_unregistered() -> None:
    """A decode rank forgotten after ``peer_ttl`` (S08) that sends pages again is
    answered ``unregistered`` (it registers again and resends, K16) -- that instance
    only, and only for ``peer_ttl`` after it was forgotten."""
    s = sender(limits=Limits(peer_ttl=10.0))
    registered(s)
    assert of(s.tick(11.0), ForgetPeer) == [ForgetPeer(D0)]
    msg = room_pages(R, 1)
    assert s.on_pages(msg, 12.0) == [Refuse(msg, "unregistered")]
    assert s.on_pages(room_pages(R, 1, instance="d-other"), 12.0) == []
    s.tick(22.0)  # remembered for peer_ttl only
    assert s.on_pages(msg, 22.0) == []
    assert s.dropped["unregistered"] == 3


# ---- the chunk pump -------------------------------------------------------------------------

def test_chunks_written_one_at_a_time_then_success() -> None:
    s = bound(dst=(0, 1, 2), aux_index=2)
    w1 = one(s.send(R, pages(10, 11), False, 1.0), Write)
    assert status(s) == KVPoll.Transferring
    assert (list(w1.src_pages), list(w1.dests[0].dst_pages), w1.is_last) == ([10, 11], [0, 1],
                                                                            False)
    assert w1.aux_index is None
    assert w1.deadline == min(1.0 + TIMEOUTS.transfer, 20.0)
    assert s.send(R, pages(12), True, 1.5) == []  # waits for the write in flight
    w2 = one(s.write_done(R, w1.attempt, None, 100, 0.1, 2.0), Write)
    assert (list(w2.dests[0].dst_pages), w2.is_last, w2.aux_index) == ([2], True, 1)
    out = s.write_done(R, w2.attempt, None, 50, 0.1, 2.5)
    rep = one(out, Report)
    assert (rep.to, rep.inc, rep.status, rep.quiesced, rep.aux_index) == (
        D0, 1, KVPoll.Success, True, 1)
    end = one(out, Ended)
    assert (end.status, end.nbytes) == (KVPoll.Success, 150)
    assert of(out, Wake)
    assert s.send(R, pages(13), True, 3.0) == []  # nothing after the end


def test_chunks_sent_before_binding_wait_for_every_destination() -> None:
    s = sender()
    registered(s)
    s.create(R, 0.0)
    assert s.send(R, pages(10, 11), True, 0.5) == []
    w = one(s.on_pages(room_pages(R, 1), 1.0), Write)
    assert w.is_last and list(w.dests[0].dst_pages) == [0, 1]


def test_write_failure_fails_room_and_reports() -> None:
    s = bound()
    w = one(s.send(R, pages(1), False, 1.0), Write)
    s.send(R, pages(2), True, 1.0)
    f = RoomFailure(FailureKind.TRANSPORT, "batch refused", "prefill")
    out = s.write_done(R, w.attempt, f, 0, 0.1, 2.0)
    assert not of(out, Write)
    rep = one(out, Report)
    assert (rep.status, rep.failure, rep.quiesced) == (KVPoll.Failed, f, True)


def test_k10_index_length_mismatch_fails_only_that_room() -> None:
    s = bound(dst=(0, 1))  # the decode sent 2 destination pages
    s.create(R + 1, 0.0)
    s.on_pages(room_pages(R + 1, 2, (4,)), 0.0)
    out = s.send(R, pages(5, 6, 7), True, 1.0)  # the last chunk describes 3
    assert not of(out, Write)
    assert "index length mismatch 3 vs 2" in one(out, Report).failure.reason
    assert s.rooms[R].failure.kind == FailureKind.LAYOUT
    assert one(s.send(R + 1, pages(9), True, 1.0), Write).room == R + 1  # neighbour unharmed


def test_k10_last_chunk_short_of_destination_fails() -> None:
    s = bound(dst=(0, 1, 2))
    out = s.send(R, pages(5, 6), True, 1.0)
    assert not of(out, Write) and status(s) == KVPoll.Failed
    assert "index length mismatch" in s.rooms[R].failure.reason


# ---- engine abort and clear -------------------------------------------------------------------

def test_abort_while_idle_reports_quiesced_failure() -> None:
    s = bound()
    out = s.abort(R, "client gone", 1.0)
    rep = one(out, Report)
    assert (rep.status, rep.quiesced, rep.failure.kind) == (KVPoll.Failed, True,
                                                            FailureKind.ABORTED)
    assert "client gone" in rep.failure.reason and rep.failure.origin == "prefill"
    assert s.abort(R, "again", 2.0) == []  # Failed is sticky; said once


def test_k07_abort_mid_write_reports_twice_and_writes_no_more() -> None:
    s = bound()
    w = one(s.send(R, pages(1), False, 1.0), Write)
    s.send(R, pages(2), True, 1.1)
    rep = one(s.abort(R, "client gone", 1.2), Report)
    assert (rep.status, rep.quiesced) == (KVPoll.Failed, False)
    out = s.write_done(R, w.attempt, None, 10, 0.1, 3.0)
    assert not of(out, Write)  # the queued chunk is never scheduled
    rep = one(out, Report)
    assert (rep.status, rep.quiesced) == (KVPoll.Failed, True)
    assert status(s) == KVPoll.Failed


def test_s16_engine_lost_fails_every_room_with_the_reason_and_cancels_writes() -> None:
    s = bound()
    w = one(s.send(R, pages(1), False, 1.0), Write)
    lost = RoomFailure(FailureKind.LAYOUT, "KV buffer 0 now ends at byte 0", "prefill")
    out = s.engine_lost(lost, 1.1)
    assert one(out, CancelWrites) == CancelWrites(R, w.attempt)
    rep = one(out, Report)
    assert (rep.status, rep.quiesced, rep.failure) == (KVPoll.Failed, False, lost)
    assert s.engine_lost(lost, 1.2) == []  # ended rooms are left alone
    rep = one(s.write_done(R, w.attempt, None, 10, 0.1, 2.0), Report)
    assert (rep.status, rep.quiesced) == (KVPoll.Failed, True)


def test_clear_while_writing_retires_until_write_returns() -> None:
    s = bound()
    w = one(s.send(R, pages(1, 2), True, 1.0), Write)
    out = s.clear(R, 1.5)  # unfinished: aborted first
    assert one(out, Report).quiesced is False
    assert s.poll(R) is None and (R, w.attempt) in s.retired
    rep = one(s.write_done(R, w.attempt, None, 10, 0.1, 2.0), Report)
    assert (rep.status, rep.quiesced) == (KVPoll.Failed, True)
    assert not s.retired


def test_k26_old_attempt_write_result_never_decides_new_attempt() -> None:
    s = bound()
    w1 = one(s.send(R, pages(1, 2), True, 1.0), Write)
    s.clear(R, 1.2)
    s.create(R, 1.5)  # the retry reuses the room id
    s.on_pages(room_pages(R, 2, (10, 11)), 1.6)
    w2 = one(s.send(R, pages(3, 4), True, 1.7), Write)
    assert w2.attempt != w1.attempt and list(w2.dests[0].dst_pages) == [10, 11]
    out = s.write_done(R, w1.attempt, None, 10, 0.1, 2.0)  # attempt 1's late success
    assert {(r.inc, r.status) for r in of(out, Report)} == {(1, KVPoll.Failed)}
    assert status(s) == KVPoll.Transferring
    assert one(s.write_done(R, w2.attempt, None, 10, 0.1, 2.5), Report).inc == 2
    assert status(s) == KVPoll.Success


# ---- decode aborts ------------------------------------------------------------------------

def test_abort_from_bound_rank_fails_room() -> None:
    s = bound()
    out = s.on_abort(room_abort(R, 1, reason="decode timed out", kind="timeout"), 1.0)
    assert s.rooms[R].failure == RoomFailure(FailureKind.TIMEOUT, "decode timed out", "decode")
    assert all(r.quiesced and r.to == D0 and r.inc == 1 for r in of(out, Report))


def test_abort_naming_another_incarnation_dropped() -> None:
    s = bound()
    assert s.on_abort(room_abort(R, 2), 1.0) == []
    assert s.dropped["stale"] == 1 and status(s) == KVPoll.WaitingForInput


def test_abort_any_incarnation_zero_applies() -> None:
    s = bound()
    s.on_abort(room_abort(R, 0), 1.0)
    assert status(s) == KVPoll.Failed


def test_k29_decode_rank_abort_reaches_every_destination() -> None:
    s = sender()
    registered(s, endpoint=D0, tp_rank=0, tp_size=2)
    registered(s, endpoint=D1, instance="d1-a", tp_rank=1, tp_size=2)
    s.create(R, 0.0)
    s.on_pages(room_pages(R, 1, required=2), 0.0)
    s.on_pages(room_pages(R, 4, endpoint=D1, instance="d1-a", required=2), 0.0)
    out = s.on_abort(room_abort(R, 1, reason="rank 0 gave up"), 1.0)
    to_d1 = [r for r in of(out, Report) if r.to == D1]
    assert len(to_d1) == 1
    assert (to_d1[0].inc, to_d1[0].status) == (4, KVPoll.Failed)
    assert to_d1[0].failure.reason == "rank 0 gave up"


def test_k29_abort_by_rank_not_feeding_this_prefill_dropped() -> None:
    s = sender(tp_rank=1, tp_size=2)  # decode rank 0 of TP 2 is fed by prefill rank 0 only
    registered(s, endpoint=D0, tp_rank=0, tp_size=2)
    s.create(R, 0.0)
    assert s.on_abort(room_abort(R, 1), 1.0) == []
    assert s.dropped["unbound"] == 1 and status(s) == KVPoll.Bootstrapping


def test_k29_abort_by_routed_rank_that_never_bound_fails_room() -> None:
    s = sender()
    registered(s, endpoint=D0, tp_rank=0, tp_size=2)
    registered(s, endpoint=D1, instance="d1-a", tp_rank=1, tp_size=2)
    s.create(R, 0.0)
    s.on_pages(room_pages(R, 1, required=2), 0.0)
    out = s.on_abort(room_abort(R, 3, endpoint=D1, instance="d1-a"), 1.0)
    assert status(s) == KVPoll.Failed
    assert {(r.to, r.inc) for r in of(out, Report)} == {(D0, 1), (D1, 3)}


def test_k34_abort_before_sender_exists_fails_it_at_once() -> None:
    s = sender()
    registered(s)
    out = s.on_abort(room_abort(R, 1, reason="prefix hit on decode"), 1.0)
    rep = one(out, Report)  # answered at once, quiesced: nothing was or will be written
    assert (rep.inc, rep.status, rep.quiesced) == (1, KVPoll.Failed, True)
    assert len(s.early) == 1
    out = s.create(R, 2.0)
    assert status(s) == KVPoll.Failed
    assert s.rooms[R].failure.reason == "prefix hit on decode"
    assert s.rooms[R].failure.kind == FailureKind.ABORTED
    assert one(out, Ended).status == KVPoll.Failed
    assert len(s.early) == 0


def test_k34_abort_from_restarted_decode_any_incarnation() -> None:
    s = sender()
    registered(s)
    s.on_abort(room_abort(R, 0, reason="decode kvd restarted"), 1.0)
    s.create(R, 2.0)
    assert status(s) == KVPoll.Failed


def test_early_abort_answers_later_pages_of_that_rank() -> None:
    s = sender()
    registered(s)
    s.on_abort(room_abort(R, 1), 1.0)
    rep = one(s.on_pages(room_pages(R, 1), 1.5), Report)
    assert (rep.status, rep.failure.origin) == (KVPoll.Failed, "decode")
    assert s.table_sizes()["pending"] == 0


def test_early_abort_expires_after_bootstrap_timeout() -> None:
    s = sender()
    registered(s)
    s.on_abort(room_abort(R, 1), 1.0)
    s.tick(1.0 + TIMEOUTS.bootstrap)
    assert len(s.early) == 1
    s.tick(1.0 + TIMEOUTS.bootstrap + 0.01)
    assert len(s.early) == 0
    s.create(R, 12.0)
    assert status(s) == KVPoll.Bootstrapping


# ---- K21 / K30: tombstones and refused registrations --------------------------------------

def test_k21_pages_after_abort_and_clear_answered_with_reason() -> None:
    s = sender()
    registered(s)
    s.create(R, 0.0)
    s.abort(R, "client gone", 0.5)
    s.clear(R, 0.6)
    rep = one(s.on_pages(room_pages(R, 1), 2.0), Report)
    assert (rep.inc, rep.status, rep.quiesced) == (1, KVPoll.Failed, True)
    assert rep.failure.kind == FailureKind.ABORTED and "client gone" in rep.failure.reason
    assert s.table_sizes()["pending"] == 0  # answered, not buffered


def test_k21_pages_after_abort_before_clear_kind_aborted() -> None:
    s = sender()
    registered(s)
    s.create(R, 0.0)
    s.abort(R, "client gone", 0.5)
    rep = one(s.on_pages(room_pages(R, 1), 2.0), Report)
    assert rep.failure.kind == FailureKind.ABORTED  # not "duplicate"


def test_k30_refused_registration_answers_pages_at_once() -> None:
    s = sender()
    refused = RoomFailure(FailureKind.REGISTRATION, "kv item len mismatch", "prefill")
    registered(s, rejected=refused)
    rep = one(s.on_pages(room_pages(R, 1), 1.0), Report)
    assert (rep.status, rep.failure) == (KVPoll.Failed, refused)
    out = s.create(R, 2.0)  # and the sender created later fails at once
    assert status(s) == KVPoll.Failed and s.rooms[R].failure == refused
    assert one(out, Ended).failure == refused


def test_k30_refused_registration_fails_existing_room() -> None:
    s = sender()
    refused = RoomFailure(FailureKind.REGISTRATION, "layer mismatch 4 vs 5", "prefill")
    registered(s, rejected=refused)
    s.create(R, 0.0)
    out = s.on_pages(room_pages(R, 1), 1.0)
    assert of(out, Report)[0].failure == refused
    assert s.rooms[R].failure == refused


def test_tombstone_expires_and_is_bounded() -> None:
    s = sender(limits=Limits(tombstones=3))
    registered(s)
    for room in range(5):
        s.create(room, 0.0)
        s.abort(room, "x", 0.0)
        s.clear(room, float(room))
    assert len(s.tombstones) == 3 and 0 not in s.tombstones and 4 in s.tombstones
    s.tick(2.0 + TIMEOUTS.tombstone + 0.01)
    assert 2 not in s.tombstones and 3 in s.tombstones
    s.tick(4.0 + TIMEOUTS.tombstone + 0.01)
    assert len(s.tombstones) == 0


# ---- K28: decode restarts ------------------------------------------------------------------

def test_k28_decode_restart_fails_bound_rooms_and_never_writes_them() -> None:
    s = bound()
    s.send(R, pages(1), False, 1.0)  # a write in flight
    out = registered(s, 2.0, instance="d-b")  # same endpoint, new instance
    assert s.rooms[R].failure.kind == FailureKind.PEER
    assert not of(out, Report)  # the new instance does not know the room
    assert s.dropped["restarted_peer"] == 1
    w = s.rooms[R]
    out = s.write_done(R, w.attempt, None, 1, 0.1, 2.5)
    assert not of(out, Write) and not of(out, Report)


def test_k28_pages_of_old_instance_dropped_after_restart() -> None:
    s = sender()
    registered(s)
    s.on_pages(room_pages(R, 1), 0.5)  # buffered for the old instance
    registered(s, 1.0, instance="d-b")
    assert s.table_sizes()["pending"] == 0
    s.create(R, 2.0)
    assert status(s) == KVPoll.Bootstrapping


# ---- deadlines ------------------------------------------------------------------------------

def _bootstrapping() -> tuple[SenderRooms, float, bool]:
    s = sender()
    s.create(R, 1.0)
    return s, 1.0 + TIMEOUTS.bootstrap, True


def _bootstrapping_one_of_two() -> tuple[SenderRooms, float, bool]:
    s = sender()
    registered(s, endpoint=D0, tp_rank=0, tp_size=2)
    s.create(R, 1.0)
    s.on_pages(room_pages(R, 1, required=2, within=100.0), 2.0)
    return s, 1.0 + TIMEOUTS.bootstrap, True


def _waiting() -> tuple[SenderRooms, float, bool]:
    return bound(0.0, within=100.0), TIMEOUTS.waiting, True


def _transferring() -> tuple[SenderRooms, float, bool]:
    s = bound(0.0, within=100.0)
    s.send(R, pages(1), False, 1.0)
    return s, 1.0 + TIMEOUTS.transfer, False  # a write is in flight: not quiesced


def _decode_write_bound() -> tuple[SenderRooms, float, bool]:
    return bound(0.0, within=4.0), 4.0, True  # sooner than the waiting timeout


def _decode_write_bound_transferring() -> tuple[SenderRooms, float, bool]:
    s = bound(0.0, within=3.0)
    s.send(R, pages(1), False, 1.0)
    return s, 3.0, False


@pytest.mark.parametrize("setup, state", [
    (_bootstrapping, "Bootstrapping"),
    (_bootstrapping_one_of_two, "Bootstrapping"),
    (_waiting, "WaitingForInput"),
    (_transferring, "Transferring"),
    (_decode_write_bound, "WaitingForInput"),
    (_decode_write_bound_transferring, "Transferring"),
])
def test_every_state_has_a_deadline(setup: Callable[[], tuple[SenderRooms, float, bool]],
                                    state: str) -> None:
    s, deadline, quiesced = setup()
    assert s.rooms[R].status.name == state
    assert s.rooms[R].deadline(TIMEOUTS) == deadline
    assert s.tick(deadline) == []  # not before
    assert status(s) == KVPoll[state]
    out = s.tick(deadline + 0.01)
    f = s.rooms[R].failure
    assert status(s) == KVPoll.Failed and f.kind == FailureKind.TIMEOUT
    assert one(out, Ended).failure == f and of(out, Wake)
    assert all(r.quiesced == quiesced and r.failure == f for r in of(out, Report))


def test_k22_no_write_after_destination_write_deadline() -> None:
    s = bound(0.0, within=3.0)
    w = one(s.send(R, pages(1), False, 2.5), Write)
    assert w.deadline == 3.0  # no sub-batch may start after the decode's bound
    out = s.write_done(R, w.attempt, None, 1, 0.1, 3.0)
    s.send(R, pages(2), True, 5.5)  # chunk 2 comes too late; no tick in between
    assert not of(out, Write) and status(s) == KVPoll.Failed
    assert "write deadline passed" in s.rooms[R].failure.reason


def test_pending_pages_expire_with_an_answer() -> None:
    s = sender()
    registered(s)
    s.on_pages(room_pages(R, 1), 1.0)
    s.on_pages(room_pages(R + 1, 1), 5.0)
    assert s.tick(11.0) == []
    rep = one(s.tick(11.01), Report)
    assert (rep.room, rep.status, rep.failure.kind) == (R, KVPoll.Failed, FailureKind.TIMEOUT)
    assert s.table_sizes()["pending"] == 1 and s.pending_bytes == 8
    s.tick(15.01)
    assert s.table_sizes()["pending"] == 0 and s.pending_bytes == 0


def test_pending_bounded_per_peer() -> None:
    s = sender(limits=Limits(max_rooms_per_peer=2))
    registered(s)
    s.on_pages(room_pages(1, 1), 0.0)
    s.on_pages(room_pages(2, 1), 0.0)
    rep = one(s.on_pages(room_pages(3, 1), 0.0), Report)
    assert rep.room == 3 and rep.status == KVPoll.Failed
    assert s.table_sizes()["pending"] == 2


def test_finished_room_never_cleared_is_retired() -> None:
    s = bound()
    s.abort(R, "x", 1.0)
    s.tick(1.0 + TIMEOUTS.finished_ttl)
    assert s.poll(R) is not None
    s.tick(1.0 + TIMEOUTS.finished_ttl + 0.01)
    assert s.poll(R) is None and R in s.tombstones


def test_idle_peer_forgotten_after_peer_ttl() -> None:
    s = sender(limits=Limits(peer_ttl=15.0))
    registered(s, 0.0)
    registered(s, 0.0, endpoint=D1, instance="d1-a")
    s.create(R, 0.0)
    s.on_pages(room_pages(R, 1, within=100.0), 0.0)  # D0 bound to a live room
    s.tick(15.0)
    assert set(s.peers) == {D0, D1}
    out = s.tick(15.01)
    assert of(out, ForgetPeer) == [ForgetPeer(D1)] and set(s.peers) == {D0}
    s.abort(R, "x", 16.0)
    assert of(s.tick(16.5), ForgetPeer) == [ForgetPeer(D0)]  # idle since 0.0, nothing bound
    assert not s.peers


def test_k16_max_peers_drops_new_registration_and_says_so() -> None:
    """Past ``max_peers`` a registration is dropped, and answered ``full`` so the decode's
    rooms fail now instead of at their deadline (K16)."""
    s = sender(limits=Limits(max_peers=1))
    registered(s)
    msg = register(D1, "d1-a")
    assert s.on_register(msg, POOL, AUX, None, "plan", 0.0) == [Refuse(msg, "full")]
    assert set(s.peers) == {D0} and s.dropped["max_peers"] == 1
    assert s.on_register(register(D0, "d-a"), POOL, AUX, None, None, 1.0) == []


def test_many_cycles_leave_tables_at_baseline() -> None:
    s = sender(limits=Limits(tombstones=100))
    registered(s)
    for i in range(500):
        room, now = i % 37, float(i)
        s.create(room, now)
        s.on_pages(room_pages(room, i + 1, (i % POOL,), within=100.0), now)
        w = one(s.send(room, pages(i % POOL), True, now), Write)
        s.write_done(room, w.attempt, None, 1, 0.0, now)
        s.clear(room, now)
        s.on_abort(room_abort(room, i + 1), now)  # a late abort of the ended attempt
    s.tick(1000.0)
    sizes = s.table_sizes()
    assert sizes == {**sizes, "rooms": 0, "retired": 0, "pending": 0, "pending_bytes": 0,
                     "early_aborts": 0, "tombstones": 0, "words": 0}


def test_k05_late_abort_after_success_and_clear_leaves_next_room_fresh() -> None:
    s = bound()
    w = one(s.send(R, pages(1, 2), True, 1.0), Write)
    s.write_done(R, w.attempt, None, 1, 0.1, 1.5)
    assert status(s) == KVPoll.Success
    s.clear(R, 2.0)
    out = s.on_abort(room_abort(R, 1, reason="decode timed out"), 2.5)  # late
    assert all(r.quiesced for r in of(out, Report))
    assert len(s.early) == 0  # not mistaken for an abort of a room to come
    s.create(R, 3.0)
    assert status(s) == KVPoll.Bootstrapping


# ---- regressions: what the stateful test (and reading) found -----------------------------

def test_k26_late_abort_of_retired_attempt_never_decides_the_new_one() -> None:
    s = bound()
    w = one(s.send(R, pages(1, 2), True, 1.0), Write)
    s.clear(R, 1.1)  # attempt 1 retired with its write in flight
    s.create(R, 1.2)  # attempt 2: not bound yet
    out = s.on_abort(room_abort(R, 1, reason="decode timed out"), 1.5)  # about attempt 1
    assert status(s) == KVPoll.Bootstrapping and len(s.early) == 0
    assert all(r.inc == 1 and not r.quiesced for r in of(out, Report))  # still writing
    assert s.dropped["late"] == 1
    rep = one(s.write_done(R, w.attempt, None, 1, 0.1, 2.0), Report)
    assert (rep.inc, rep.quiesced) == (1, True)


def test_k05_tombstone_remembers_the_binding_of_every_attempt() -> None:
    s = bound()
    w = one(s.send(R, pages(1, 2), True, 1.0), Write)
    s.write_done(R, w.attempt, None, 1, 0.1, 1.5)  # attempt 1: Success for D0 incarnation 1
    s.create(R, 2.0)  # attempt 2 ends before any decode rank bound
    s.abort(R, "client gone", 2.1)
    s.clear(R, 2.2)
    rep = one(s.on_abort(room_abort(R, 1), 3.0), Report)  # attempt 1's late abort
    assert (rep.inc, rep.status, rep.quiesced) == (1, KVPoll.Success, True)  # its own word
    assert len(s.early) == 0
    s.create(R, 4.0)
    assert status(s) == KVPoll.Bootstrapping


def test_duplicate_pages_of_a_bound_incarnation_change_nothing() -> None:
    s = bound()
    w = one(s.send(R, pages(1), False, 1.0), Write)
    assert s.on_pages(room_pages(R, 1), 1.5) == []  # no "duplicate room" answer
    assert s.dropped["duplicate"] == 1 and status(s) == KVPoll.Transferring
    s.write_done(R, w.attempt, None, 1, 0.1, 2.0)
    s.abort(R, "x", 2.5)
    rep = one(s.on_pages(room_pages(R, 1), 3.0), Report)  # once ended: the outcome again
    assert (rep.inc, rep.status) == (1, KVPoll.Failed)


def test_duplicate_pages_buffered_before_the_room_bind_once() -> None:
    s = sender()
    registered(s)
    s.on_pages(room_pages(R, 1), 0.5)
    s.on_pages(room_pages(R, 1), 0.6)
    out = s.create(R, 1.0)
    assert not of(out, Report) and status(s) == KVPoll.WaitingForInput


def test_k22_buffered_pages_keep_their_arrival_write_bound() -> None:
    s = sender()
    registered(s)
    s.on_pages(room_pages(R, 1, within=3.0), 0.0)  # the decode's bound: 3 s from now
    out = s.create(R, 4.0)  # the sender appears after that bound
    rep = one(out, Report)
    assert (rep.status, rep.failure.kind, rep.quiesced) == (KVPoll.Failed, FailureKind.TIMEOUT,
                                                           True)
    assert status(s) == KVPoll.Failed
    s.create(R + 1, 0.0)
    s.on_pages(room_pages(R + 1, 2, within=3.0), 1.0)
    assert s.rooms[R + 1].dests[D0].write_deadline == 4.0


def test_k28_restarted_decode_never_inherits_an_old_binding() -> None:
    s = bound()
    w = one(s.send(R, pages(1, 2), True, 1.0), Write)
    s.write_done(R, w.attempt, None, 1, 0.1, 1.5)  # Success for d-a incarnation 1
    registered(s, 2.0, instance="d-b")  # restart; the engine has not cleared R yet
    out = s.on_pages(room_pages(R, 1, instance="d-b"), 2.5)  # the new instance's inc 1
    rep = one(out, Report)
    assert (rep.to_instance, rep.status) == ("d-b", KVPoll.Failed)  # never its Success
    assert rep.failure.kind == FailureKind.DUPLICATE


def test_reports_reach_a_decode_that_registered_again_with_the_same_instance() -> None:
    s = bound()
    registered(s, 1.0)  # the decode registers again (it saw the bootstrap epoch change)
    rep = one(s.abort(R, "client gone", 2.0), Report)
    assert (rep.to, rep.to_instance, rep.inc) == (D0, "d-a", 1)


def test_k28_restart_after_a_same_instance_registration_still_fails_bound_rooms() -> None:
    s = bound()
    registered(s, 1.0)  # the same instance registers again
    registered(s, 2.0, instance="d-b")  # then the decode restarts
    assert status(s) == KVPoll.Failed and s.rooms[R].failure.kind == FailureKind.PEER
    assert s.send(R, pages(1, 2), True, 2.5) == []  # never written to the new instance


def test_k33_each_attempt_of_a_room_has_its_own_outcome() -> None:
    s = bound()
    s.abort(R, "sample 1 cancelled", 1.0)
    s.create(R, 2.0)  # sample 2 reuses the room id
    s.on_pages(room_pages(R, 2, (5, 6)), 2.0)
    w = one(s.send(R, pages(1, 2), True, 2.5), Write)
    rep = one(s.write_done(R, w.attempt, None, 1, 0.1, 3.0), Report)
    assert (rep.inc, rep.status) == (2, KVPoll.Success)
    assert s.poll(R).failure is None


def test_k26_an_incarnation_once_answered_never_binds_a_later_attempt() -> None:
    s = sender()
    registered(s)
    s.create(R, 0.0)
    rep = one(s.on_abort(room_abort(R, 5), 1.0), Report)  # its pages are still on the way
    assert (rep.inc, rep.status, rep.quiesced) == (5, KVPoll.Failed, True)
    assert status(s) == KVPoll.Failed
    s.create(R, 2.0)  # a retry
    out = s.on_pages(room_pages(R, 5), 2.5)  # incarnation 5's pages, overtaken by its abort
    rep = one(out, Report)
    assert (rep.inc, rep.status) == (5, KVPoll.Failed) and not of(out, Write)
    assert status(s) == KVPoll.Bootstrapping and not s.rooms[R].dests


def test_refused_pages_duplicated_after_a_retry_never_bind() -> None:
    s = sender()
    registered(s)
    s.create(R, 0.0)
    s.abort(R, "client gone", 0.5)
    rep = one(s.on_pages(room_pages(R, 3), 1.0), Report)  # refused: the room ended (K21)
    assert rep.status == KVPoll.Failed
    s.create(R, 2.0)
    s.on_pages(room_pages(R, 3), 2.5)  # the same message again
    assert not s.rooms[R].dests and status(s) == KVPoll.Bootstrapping


def test_k16_a_late_sweep_never_lets_a_room_outlive_its_deadline() -> None:
    s = bound(0.0, within=100.0)
    out = s.send(R, pages(1, 2), True, TIMEOUTS.waiting + 1.0)  # the sweep has not run
    assert not of(out, Write) and status(s) == KVPoll.Failed
    assert "WaitingForInput" in s.rooms[R].failure.reason
    s.create(R + 1, 0.0)
    rep = one(s.on_pages(room_pages(R + 1, 2, within=100.0), TIMEOUTS.bootstrap + 1.0),
              Report)
    assert (rep.status, rep.failure.kind) == (KVPoll.Failed, FailureKind.TIMEOUT)
    assert s.rooms[R + 1].status == KVPoll.Failed and not s.rooms[R + 1].dests


@pytest.mark.parametrize("written", [False, True])
def test_a_chunk_after_the_last_one_is_refused_not_dropped(written: bool) -> None:
    """A chunk sent after ``is_last`` (queued or already written) used to be accepted
    and silently never written; the engine now hears it, and the room is unaffected."""
    s = bound() if written else sender()
    if not written:
        s.create(R, 0.0)
        s.init(R, 2, 1, 0.0)
    s.send(R, pages(3, 4), True, 0.0)
    with pytest.raises(RoomError, match=r"last send \(is_last\) was refused"):
        s.send(R, pages(5), True, 0.0)
    with pytest.raises(RoomError, match=r"last send \(is_last\) was refused"):
        s.send(R, pages(), False, 0.0)
    assert status(s) in (KVPoll.Bootstrapping, KVPoll.Transferring)


# ---- K43: an ended attempt cancels its write ------------------------------------------------

@pytest.mark.parametrize("end", ["abort", "decode_abort", "clear", "deadline", "restart"])
def test_k43_every_ending_mid_write_cancels_that_attempts_write(end: str) -> None:
    """Whatever ends an attempt while its write is in flight, the same step cancels the
    write (its queued parts are dropped), before the reports; idle endings cancel
    nothing; the write's late result still reports quiescence."""
    s = bound()
    w = one(s.send(R, pages(1, 2), True, 1.0), Write)
    match end:
        case "abort":
            out = s.abort(R, "client gone", 1.2)
        case "decode_abort":
            out = s.on_abort(room_abort(R, 1), 1.2)
        case "clear":
            out = s.clear(R, 1.2)
        case "deadline":
            out = s.tick(1.0 + TIMEOUTS.transfer + 1.0)
        case _:
            out = registered(s, 1.2, instance="d0-restarted")
    c = one(out, CancelWrites)
    assert (c.room, c.attempt) == (R, w.attempt)
    assert out.index(c) < min((i for i, e in enumerate(out) if isinstance(e, Report)),
                              default=len(out))
    rep = one(s.write_done(R, w.attempt, None, 0, 0.1, 3.0), Report) if end != "restart" \
        else None
    assert rep is None or rep.quiesced
    idle = bound()
    assert not of(idle.abort(R, "client gone", 1.0), CancelWrites)


def test_k44_a_decode_registering_another_pool_ends_rooms_bound_to_the_old_one() -> None:
    """The same instance registers other KV args (its engine registered a new pool):
    the room bound to the previous pool fails (its write in flight is cancelled) and is
    never written again; the same args again change nothing."""
    import msgspec

    s = bound()
    w = one(s.send(R, pages(1, 2), False, 1.0), Write)
    assert registered(s, 1.1) == [] and status(s) == KVPoll.Transferring  # same args
    moved = msgspec.structs.replace(register(), kv_args=msgspec.structs.replace(
        kv_args(), kv_data_ptrs=[1 << 20]))
    out = s.on_register(moved, POOL, AUX, None, "plan", 1.2)
    assert one(out, CancelWrites).attempt == w.attempt
    assert status(s) == KVPoll.Failed and s.rooms[R].failure.kind == FailureKind.PEER
    assert "another KV pool" in s.rooms[R].failure.reason
    assert not of(s.write_done(R, w.attempt, None, 0, 0.1, 2.0), Write)


def test_i22_state_slot_and_window_pages_ride_the_last_chunk_only() -> None:
    """Both sides' state index and window pages reach the write of the last chunk (and no
    earlier one); a malformed window page list fails the room with kind layout."""
    from msgspec.structs import replace

    from kvd.protocol.codec import pack_indices
    from kvd.rooms.effects import StateRef

    s = sender()
    registered(s, 0.0)
    s.create(R, 0.0)
    s.init(R, 3, 1, 0.0, StateRef(2, pages(5, 6)))
    msg = replace(room_pages(R, 1, (0, 1, 2)), state_index=3,
                              window_pages=pack_indices(pages(7, 8)))
    assert s.on_pages(msg, 0.0) == []
    w1 = one(s.send(R, pages(10, 11), False, 1.0), Write)
    assert w1.state is None and w1.dests[0].state is None
    s.send(R, pages(12), True, 1.5)
    w2 = one(s.write_done(R, w1.attempt, None, 100, 0.1, 2.0), Write)
    assert w2.state is not None and (w2.state.index, list(w2.state.window)) == (2, [5, 6])
    d = w2.dests[0].state
    assert d is not None and (d.index, list(d.window)) == (3, [7, 8])
    s.create(R + 1, 3.0)
    bad = replace(room_pages(R + 1, 2, (3,)), window_pages=b"\x01\x02\x03")
    out = s.on_pages(bad, 3.0)
    assert status(s, R + 1) == KVPoll.Failed
    assert any("malformed window pages" in str(e) for e in out)


def test_i22_init_again_names_the_state_before_the_last_send_only() -> None:
    """An engine that learns the room's state slot with its last chunk (SGLang) inits
    again: the same page count and aux slot, the state named once; another page count or
    aux slot, another state, or an init after the last send raise and change nothing."""
    from kvd.rooms.effects import StateRef

    s = sender()
    registered(s, 0.0)
    s.create(R, 0.0)
    s.init(R, 2, 1, 0.0)
    with pytest.raises(RoomError, match="init again with num_pages 3"):
        s.init(R, 3, 1, 0.1)
    with pytest.raises(RoomError, match="aux_index 0"):
        s.init(R, 2, 0, 0.1)
    s.init(R, 2, 1, 0.2, StateRef(4, pages(5)))
    s.init(R, 2, 1, 0.3, StateRef(4, pages(5)))  # the same again: nothing changes
    s.init(R, 2, 1, 0.3)  # no state: the named one is kept
    with pytest.raises(RoomError, match="already named slot 4"):
        s.init(R, 2, 1, 0.4, StateRef(6, pages(5)))
    assert s.on_pages(room_pages(R, 1, (0, 1)), 0.5) == []
    w = one(s.send(R, pages(10, 11), True, 1.0), Write)
    assert w.state is not None and (w.state.index, list(w.state.window)) == (4, [5])
    with pytest.raises(RoomError, match="after the room's last send"):
        s.init(R, 2, 1, 1.1, StateRef(4, pages(5)))
    assert status(s) != KVPoll.Failed


def test_k16_pages_sent_again_before_the_room_exists_are_buffered_once() -> None:
    """A decode that was refused ``unregistered`` registers again and sends its rooms'
    pages again (K16); pages of a room this rank has not created yet, sent again by the
    same instance for the same incarnation, are a duplicate: buffered once, counted once
    against ``max_rooms_per_peer``, never a refusal of the room."""
    s = sender(limits=Limits(max_rooms_per_peer=2))
    registered(s)
    msg = room_pages(R, 1)
    for t in (1.0, 2.0, 3.0):
        assert s.on_pages(msg, t) == []
    assert s.pending_by_peer[D0] == 1 and s.dropped["duplicate"] == 2
    assert s.on_pages(room_pages(R + 1, 1), 4.0) == []  # another room still fits
    s.create(R, 5.0)
    assert set(s.rooms[R].dests) == {D0} and s.pending_by_peer[D0] == 1
