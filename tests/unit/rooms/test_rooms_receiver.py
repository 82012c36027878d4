"""kvd.rooms.receiver: the decode side's room machine, transition by transition (tier 1, pure).

Times are plain numbers (seconds); the deadlines come from ``roomkit.TIMEOUTS``
(bootstrap 10, waiting 20, transfer 5, release 3, tombstone 50, finished_ttl 40).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from roomkit import (
    AUX,
    BOOT,
    D0,
    P0,
    P1,
    POOL,
    TIMEOUTS,
    of,
    one,
    receiver,
    room_status,
    targets,
)

from kvd.errors import RoomError
from kvd.protocol import control
from kvd.protocol.codec import pack_indices, unpack_indices
from kvd.rooms.effects import AbortUnknown, Ended, Resolve, Send, Wake, WriteAux
from kvd.rooms.receiver import ReceiverRooms, Target
from kvd.rooms.state import FailureKind, KVPoll, RoomFailure

R = 7
DST = pack_indices([4, 5])


def waiting(*endpoints: str, now: float = 0.0, aux_sizes: tuple[int, ...] = ()
            ) -> tuple[ReceiverRooms, list[Send]]:
    """Room R created, initialised and resolved to ``endpoints``: pages sent, WaitingForInput."""
    d = receiver(aux_sizes=aux_sizes)
    d.create(R, BOOT, None, now)
    d.init(R, DST, 1, now)
    sends = of(d.resolved(R, 1, targets(*endpoints), now), Send)
    assert d.rooms[R].status == KVPoll.WaitingForInput
    return d, sends


def state(d: ReceiverRooms, now: float = 0.0) -> tuple[KVPoll, bool]:
    p = d.poll(R, now)
    assert p is not None
    return p.status, p.releasable


# ---- creation and init ---------------------------------------------------------------------

def test_create_resolves_with_a_new_incarnation() -> None:
    d = receiver(first_inc=5)
    assert d.create(R, BOOT, 1, 0.0) == [Resolve(R, 5, BOOT, 1)]
    assert state(d) == (KVPoll.Bootstrapping, False)
    assert d.poll(R + 1, 0.0) is None
    d.abort(R, "x", 1.0)
    assert d.create(R, BOOT, None, 2.0) == [Resolve(R, 6, BOOT, None)]


def test_k03_duplicate_receiver_refused() -> None:
    d, _ = waiting(P0)
    with pytest.raises(RoomError, match="duplicate room"):
        d.create(R, BOOT, None, 1.0)
    assert d.rooms[R].inc == 1 and state(d)[0] == KVPoll.WaitingForInput


@pytest.mark.parametrize("dst, aux_index, match", [
    (pack_indices([0, POOL]), 0, "outside"),
    (pack_indices([1]), AUX, "aux_index"),
    (pack_indices([1]), -1, "aux_index"),
    (b"\x00\x01\x02", 0, "multiple of 4"),
])
def test_init_refuses_bad_indices(dst: bytes, aux_index: int, match: str) -> None:
    d = receiver()
    d.create(R, BOOT, None, 0.0)
    with pytest.raises(RoomError, match=match):
        d.init(R, dst, aux_index, 0.0)
    assert d.rooms[R].dst_pages is None  # a refused call changes nothing
    d.init(R, DST, 0, 0.0)


def test_init_twice_and_unknown_room_refused() -> None:
    d = receiver()
    with pytest.raises(RoomError, match="unknown room"):
        d.init(R, DST, 0, 0.0)
    d.create(R, BOOT, None, 0.0)
    d.init(R, DST, 0, 0.0)
    with pytest.raises(RoomError, match="twice"):
        d.init(R, DST, 0, 0.0)


# ---- sending pages --------------------------------------------------------------------------

def test_pages_go_to_every_target_once_resolved_and_initialised() -> None:
    d = receiver()
    d.create(R, BOOT, None, 0.0)
    assert d.init(R, DST, 2, 1.0) == []  # targets not known yet
    out = d.resolved(R, 1, [Target(P0, "p-a", 2), Target(P1, "p1-a", 1, True)], 2.0)
    assert state(d, 2.0) == (KVPoll.WaitingForInput, False)
    sends = of(out, Send)
    assert [(s.to, s.to_instance, s.room, s.inc) for s in sends] == [
        (P0, "p-a", R, 1), (P1, "p1-a", R, 1)]
    m = sends[0].msg
    assert isinstance(m, control.RoomPages)
    assert (m.room, m.inc, m.endpoint, m.instance_id, m.aux_index) == (R, 1, D0, "d-a", 2)
    assert list(unpack_indices(m.dst_pages)) == [4, 5]
    assert m.write_within == TIMEOUTS.waiting  # the bound is this room's own deadline
    assert (m.required_dst_info_num, m.is_dummy) == (2, False)
    assert sends[1].msg.is_dummy and sends[1].msg.required_dst_info_num == 1
    assert d.rooms[R].write_deadline == 2.0 + TIMEOUTS.waiting


def test_init_after_resolve_sends_with_remaining_time() -> None:
    d = receiver()
    d.create(R, BOOT, None, 0.0)
    assert d.resolved(R, 1, targets(P0), 1.0) == []
    (s,) = of(d.init(R, DST, 0, 5.0), Send)
    assert s.msg.write_within == pytest.approx(1.0 + TIMEOUTS.waiting - 5.0)


def test_resolve_results_of_another_incarnation_ignored() -> None:
    d = receiver()
    d.create(R, BOOT, None, 0.0)
    assert d.resolved(R, 2, targets(P0), 1.0) == []
    f = RoomFailure(FailureKind.BOOTSTRAP, "503", "decode")
    assert d.resolve_failed(R, 2, f, 1.0) == []
    assert state(d, 1.0)[0] == KVPoll.Bootstrapping


def test_resolve_failed_fails_room_releasable_at_once() -> None:
    d = receiver()
    d.create(R, BOOT, None, 0.0)
    d.init(R, DST, 0, 0.0)
    f = RoomFailure(FailureKind.BOOTSTRAP, "bootstrap unreachable", "decode")
    out = d.resolve_failed(R, 1, f, 1.0)
    assert not of(out, Send) and one(out, Ended).failure == f
    assert state(d, 1.0) == (KVPoll.Failed, True)  # no page ever left this rank


def test_k34_abort_while_resolving_reaches_targets_when_resolved() -> None:
    d = receiver()
    d.create(R, BOOT, None, 0.0)
    d.init(R, DST, 0, 0.0)
    d.abort(R, "prefix hit", 0.5)
    out = d.resolved(R, 1, targets(P0, P1), 1.0)
    aborts = of(out, Send)
    assert {s.to for s in aborts} == {P0, P1}
    assert all(isinstance(s.msg, control.RoomAbort) and s.msg.inc == 1 for s in aborts)
    assert "prefix hit" in aborts[0].msg.reason and aborts[0].msg.kind == "aborted"
    assert state(d, 1.0) == (KVPoll.Failed, True)  # no pages were sent


def test_k34_abort_of_unknown_room_still_reaches_prefill() -> None:
    d = receiver()
    (a,) = d.abort(R, "cancelled", 0.0, bootstrap_addr=BOOT, dp_rank=1)
    assert isinstance(a, AbortUnknown) and (a.room, a.bootstrap_addr, a.dp_rank) == (R, BOOT, 1)
    assert a.failure.kind == FailureKind.ABORTED
    assert d.abort(R, "cancelled", 0.0) == []


# ---- statuses from prefill ranks ----------------------------------------------------------

def test_success_only_when_every_target_succeeded() -> None:
    d, _ = waiting(P0, P1)
    assert d.on_status(room_status(R, 1, KVPoll.Success), 1.0) == []
    assert state(d, 1.0)[0] == KVPoll.WaitingForInput
    out = d.on_status(room_status(R, 1, KVPoll.Success, endpoint=P1), 2.0)
    assert one(out, Ended).status == KVPoll.Success and of(out, Wake)
    assert state(d, 2.0) == (KVPoll.Success, True)


def test_k08_failure_from_one_target_aborts_the_others() -> None:
    d, _ = waiting(P0, P1)
    out = d.on_status(room_status(R, 1, KVPoll.Failed, kind="transport", reason="batch failed",
                                  quiesced=False), 1.0)
    assert d.rooms[R].failure == RoomFailure(FailureKind.TRANSPORT, "batch failed", "prefill")
    (s,) = of(out, Send)  # the reporter knows already
    assert s.to == P1 and isinstance(s.msg, control.RoomAbort)
    assert (s.msg.inc, s.msg.kind, s.msg.reason) == (1, "transport", "batch failed")
    assert s.room is None  # an abort's delivery does not decide anything


@pytest.mark.parametrize("msg, counter", [
    (room_status(R, 2, KVPoll.Success), "stale"),
    (room_status(R + 1, 1, KVPoll.Success), "stale"),
    (room_status(R, 1, KVPoll.Success, endpoint="tcp://px:1"), "unbound"),
    (room_status(R, 1, KVPoll.Transferring), "malformed"),
])
def test_statuses_that_do_not_match_are_dropped(msg: control.RoomStatus, counter: str) -> None:
    d, _ = waiting(P0)
    assert d.on_status(msg, 1.0) == []
    assert d.dropped == {counter: 1}
    assert state(d, 1.0)[0] == KVPoll.WaitingForInput


@pytest.mark.parametrize("status", [KVPoll.Success, KVPoll.Failed])
def test_k28_status_from_another_instance_of_a_target_means_it_restarted(
        status: KVPoll) -> None:
    d, _ = waiting(P0, P1)
    out = d.on_status(room_status(R, 1, status, instance="p-new", quiesced=True), 1.0)
    assert d.dropped == {"stale_instance": 1}
    assert d.rooms[R].failure.kind == FailureKind.PEER  # at once, not at the timeout
    assert "restarted" in d.rooms[R].failure.reason
    assert {s.to for s in of(out, Send)} == {P0, P1}  # whoever listens there must stop
    assert state(d, 1.0) == (KVPoll.Failed, False)  # never trusted as quiescence


def test_k26_status_of_previous_incarnation_never_decides_the_new_one() -> None:
    d, _ = waiting(P0)
    d.on_status(room_status(R, 1, KVPoll.Failed, reason="x"), 1.0)  # quiesced
    d.clear(R, 1.0)
    d.create(R, BOOT, None, 2.0)
    d.init(R, DST, 0, 2.0)
    d.resolved(R, 2, targets(P0), 2.0)
    d.on_status(room_status(R, 1, KVPoll.Success), 3.0)  # attempt 1's late word
    assert state(d, 3.0)[0] == KVPoll.WaitingForInput and d.dropped["stale"] == 1


def test_aux_over_control_plane_copied() -> None:
    d, _ = waiting(P0, aux_sizes=(3, 2))
    out = d.on_status(room_status(R, 1, KVPoll.Success, aux=[b"abc", b"de"]), 1.0)
    assert of(out, WriteAux) == [WriteAux(R, 1, (b"abc", b"de"), 1, P0)]
    assert state(d, 1.0)[0] != KVPoll.Success  # not before the slot is written
    d.aux_written(R, 1, P0, None, 1.0)
    assert state(d, 1.0)[0] == KVPoll.Success


def test_s16_a_refused_aux_write_fails_the_room_never_success() -> None:
    d, _ = waiting(P0, aux_sizes=(3,))
    d.on_status(room_status(R, 1, KVPoll.Success, aux=[b"abc"]), 1.0)
    d.aux_written(R, 1, P0, RoomFailure(FailureKind.LAYOUT, "aux buffer 0 shrank"), 1.0)
    assert state(d, 1.0)[0] == KVPoll.Failed
    assert d.rooms[R].failure.kind == FailureKind.LAYOUT
    assert d.rooms[R].releasable(1.0, d.timeouts)  # the prefill's Success confirmed its end
    assert d.aux_written(R, 1, P0, None, 2.0) == []  # sticky


def test_s16_a_dropped_registration_fails_every_room_with_its_reason() -> None:
    d, _ = waiting(P0, P1)
    lost = RoomFailure(FailureKind.LAYOUT, "KV buffer 0 now ends at byte 0", "decode")
    out = d.engine_released(1.0, lost)
    assert d.rooms[R].failure == lost and d.released
    assert sorted(s.to for s in of(out, Send)) == [P0, P1]  # every target is told


def test_k09_bad_aux_fails_only_that_room_and_aborts_the_others() -> None:
    d, _ = waiting(P0, P1, aux_sizes=(3,))
    out = d.on_status(room_status(R, 1, KVPoll.Success, aux=[b"abcd"]), 1.0)
    assert not of(out, WriteAux)
    assert d.rooms[R].failure.kind == FailureKind.LAYOUT
    assert [s.to for s in of(out, Send)] == [P1]


# ---- failures from the daemon -------------------------------------------------------------

def test_k32_send_failure_fails_room_at_once() -> None:
    d, sends = waiting(P0, P1)
    assert all(s.room == R and s.inc == 1 for s in sends)
    f = RoomFailure(FailureKind.UNREACHABLE, "cannot reach prefill rank", "decode")
    out = d.send_failed(R, 1, P0, f, 1.0)
    assert d.rooms[R].failure == f
    assert [s.to for s in of(out, Send)] == [P1]  # no more messages queued to the dead peer
    assert state(d, 1.0) == (KVPoll.Failed, False)  # P1 holds the pages: it must confirm
    # P1's pages never left either: nobody can write them, they are releasable at once
    assert of(d.send_failed(R, 1, P1, f, 1.0), Wake)
    assert state(d, 1.0) == (KVPoll.Failed, True)


def test_k16_resend_to_sends_the_pages_again_to_that_instance_only() -> None:
    """After an ``unregistered`` refusal and a new registration the daemon asks the
    machine to send the room's pages again: only to the rank (and instance) that
    dropped them, with the same pages and a write bound that shrank with time."""
    d, sends = waiting(P0, P1)
    first = next(s for s in sends if s.to == P0)
    again = of(d.resend_to(P0, "p-a", 1.0), Send)
    assert [(s.to, s.to_instance, s.room, s.inc) for s in again] == [(P0, "p-a", R, 1)]
    msg, was = again[0].msg, first.msg
    assert isinstance(msg, control.RoomPages) and isinstance(was, control.RoomPages)
    assert (msg.dst_pages, msg.aux_index) == (was.dst_pages, was.aux_index)
    assert msg.write_within == pytest.approx(was.write_within - 1.0)
    assert d.resend_to(P0, "p-other", 1.0) == []  # another instance: not bound to it
    d.abort(R, "engine abort", 1.5)
    assert of(d.resend_to(P0, "p-a", 2.0), Send) == []  # an ended room is not sent again


def test_peer_lost_fails_the_rooms_of_that_prefill_only() -> None:
    d = receiver()
    d.create(1, BOOT, None, 0.0)
    d.create(2, BOOT, None, 5.0)
    d.create(3, "other:1", None, 0.0)
    f = RoomFailure(FailureKind.PEER, "prefill restarted", "decode")
    out = d.peer_lost(BOOT, f, 6.0)
    assert [d.rooms[k].status for k in (1, 2, 3)] == [
        KVPoll.Failed, KVPoll.Failed, KVPoll.Bootstrapping]
    assert d.rooms[1].failure == f and len(of(out, Ended)) == 2


def test_peer_lost_at_one_endpoint_fails_only_rooms_bound_to_another_instance() -> None:
    """One rank replaced (a watch put, a verified refusal: the membership machine's
    ``FailRooms(endpoint=, keep=new)``) fails the rooms bound to the instance that is
    gone at that endpoint; a room resolved to the new instance there, a room at another
    endpoint, or one not resolved yet, is untouched."""
    d = receiver()
    for room in (1, 2, 3, 4):
        d.create(room, BOOT, None, 0.0)
    d.resolved(1, 1, targets(P0, instance="p-old"), 1.0)
    d.resolved(2, 2, targets(P0, instance="p-new"), 1.0)
    d.resolved(3, 3, targets(P1, instance="p-old"), 1.0)
    f = RoomFailure(FailureKind.PEER, "prefill rank restarted", "decode")
    out = d.peer_lost(BOOT, f, 2.0, keep="p-new", endpoint=P0)
    assert [d.rooms[k].status for k in (1, 2, 3, 4)] == [
        KVPoll.Failed, KVPoll.WaitingForInput, KVPoll.WaitingForInput, KVPoll.Bootstrapping]
    assert d.rooms[1].failure == f and len(of(out, Ended)) == 1
    assert d.peer_lost(BOOT, f, 3.0, keep="p-new", endpoint=P0) == []  # nothing twice


# ---- deadlines and release safety ---------------------------------------------------------

def _bootstrapping() -> tuple[ReceiverRooms, float]:
    d = receiver()
    d.create(R, BOOT, None, 1.0)
    return d, 1.0 + TIMEOUTS.bootstrap


def _bootstrapping_initialised() -> tuple[ReceiverRooms, float]:
    d, _ = _bootstrapping()
    d.init(R, DST, 0, 2.0)
    return d, 1.0 + TIMEOUTS.bootstrap


def _waiting_not_initialised() -> tuple[ReceiverRooms, float]:
    d = receiver()
    d.create(R, BOOT, None, 0.0)
    d.resolved(R, 1, targets(P0), 1.0)
    return d, 1.0 + TIMEOUTS.waiting


def _waiting() -> tuple[ReceiverRooms, float]:
    d, _ = waiting(P0, P1, now=1.0)
    d.on_status(room_status(R, 1, KVPoll.Success), 2.0)  # one of two targets done
    return d, 1.0 + TIMEOUTS.waiting


@pytest.mark.parametrize("setup, state, aborts", [
    (_bootstrapping, "Bootstrapping", []),
    (_bootstrapping_initialised, "Bootstrapping", []),
    (_waiting_not_initialised, "WaitingForInput", [P0]),
    (_waiting, "WaitingForInput", [P1]),
])
def test_every_state_has_a_deadline(setup: Callable[[], tuple[ReceiverRooms, float]],
                                    state: str, aborts: list[str]) -> None:
    d, deadline = setup()
    assert d.rooms[R].status.name == state and d.rooms[R].deadline(TIMEOUTS) == deadline
    assert d.tick(deadline) == [] and d.rooms[R].status.name == state  # not before
    out = d.tick(deadline + 0.01)
    f = one(out, Ended).failure
    assert f.kind == FailureKind.TIMEOUT and state in f.reason and f.origin == "decode"
    assert d.rooms[R].status == KVPoll.Failed
    sends = of(out, Send)  # every target that does not know yet must stop writing
    assert [s.to for s in sends] == aborts
    assert all(isinstance(s.msg, control.RoomAbort) and s.msg.kind == "timeout" for s in sends)


def test_k22_pages_not_releasable_until_write_deadline_plus_release() -> None:
    d, _ = waiting(P0, now=0.0)
    d.abort(R, "client gone", 1.0)
    bound = TIMEOUTS.waiting + TIMEOUTS.release  # write deadline + release margin
    assert state(d, bound - 0.01) == (KVPoll.Failed, False)
    assert state(d, bound) == (KVPoll.Failed, True)
    assert of(d.tick(bound), Wake)  # wait() callers learn that the pages freed up
    assert d.tick(bound + 1) == []  # once


def test_k06_abort_mid_transfer_releasable_once_every_writer_quiesced() -> None:
    d, _ = waiting(P0, P1)
    d.abort(R, "client gone", 1.0)
    assert state(d, 1.0) == (KVPoll.Failed, False)
    d.on_status(room_status(R, 1, KVPoll.Failed, quiesced=False), 1.5)
    assert state(d, 1.5) == (KVPoll.Failed, False)  # a write is still in flight on P0
    d.on_status(room_status(R, 1, KVPoll.Failed, quiesced=True), 2.0)
    assert state(d, 2.0) == (KVPoll.Failed, False)  # P1 has not confirmed
    out = d.on_status(room_status(R, 1, KVPoll.Failed, endpoint=P1), 2.5)
    assert of(out, Wake)
    assert state(d, 2.5) == (KVPoll.Failed, True)


def test_k06_clear_refused_while_not_releasable() -> None:
    d, _ = waiting(P0)
    d.abort(R, "client gone", 1.0)
    with pytest.raises(RoomError, match="not releasable"):
        d.clear(R, 2.0)
    assert R in d.rooms
    with pytest.raises(RoomError, match="not releasable"):
        d.create(R, BOOT, None, 2.0)
    d.on_status(room_status(R, 1, KVPoll.Failed), 2.5)
    d.clear(R, 3.0)
    assert d.poll(R, 3.0) is None


def test_clear_of_unfinished_room_tells_its_writers() -> None:
    d, _ = waiting(P0)
    with pytest.raises(RoomError, match="not releasable") as refused:
        d.clear(R, 1.0)
    out = refused.value.effects
    (s,) = of(out, Send)  # the prefill must stop writing whatever clear answers
    assert isinstance(s.msg, control.RoomAbort) and s.to == P0
    assert one(out, Ended).status == KVPoll.Failed


def test_clear_of_room_whose_pages_never_left_removes_it() -> None:
    d = receiver()
    d.create(R, BOOT, None, 0.0)
    out = d.clear(R, 1.0)
    assert one(out, Ended).status == KVPoll.Failed and R not in d.rooms


def test_finished_room_never_cleared_dropped_after_ttl() -> None:
    d, _ = waiting(P0)
    d.on_status(room_status(R, 1, KVPoll.Success), 1.0)
    d.tick(1.0 + TIMEOUTS.finished_ttl)
    assert R in d.rooms
    d.tick(1.0 + TIMEOUTS.finished_ttl + 0.01)
    assert d.table_sizes() == {"rooms": 0}


def test_k05_many_cycles_with_late_words_leave_table_at_baseline() -> None:
    d = receiver()
    for i in range(1000):
        now = float(i)
        d.create(R, BOOT, None, now)
        d.init(R, DST, 0, now)
        d.resolved(R, i + 1, targets(P0), now)
        d.on_status(room_status(R, i + 1, KVPoll.Success), now)
        d.clear(R, now)
        assert d.abort(R, "late", now) == []
        assert d.on_status(room_status(R, i + 1, KVPoll.Failed, reason="late"), now) == []
    assert d.table_sizes() == {"rooms": 0} and d.dropped["stale"] == 1000


# ---- regressions: what the stateful test found ------------------------------------------

def test_k28_two_instances_of_a_decode_number_incarnations_apart() -> None:
    old = ReceiverRooms(D0, "d-old", TIMEOUTS)
    new = ReceiverRooms(D0, "d-new", TIMEOUTS)
    (a,) = old.create(R, BOOT, None, 0.0)
    (b,) = new.create(R, BOOT, None, 0.0)
    assert isinstance(a, Resolve) and isinstance(b, Resolve) and a.inc != b.inc
    assert a.inc >= 1 and b.inc >= 1  # 0 means "any incarnation" in RoomAbort
    new.num_pages = POOL
    new.init(R, DST, 0, 0.0)
    new.resolved(R, b.inc, targets(P0), 0.0)
    # the old instance's Success, queued before the restart, reaches the new one
    assert new.on_status(room_status(R, a.inc, KVPoll.Success), 1.0) == []
    assert new.rooms[R].status == KVPoll.WaitingForInput and new.dropped["stale"] == 1


def test_k44_engine_released_aborts_then_keeps_rooms_until_quiet() -> None:
    """The rule kvd/daemon/decode.py runs: abort every unfinished room (its targets told), refuse
    new rooms, keep the rooms until nothing can land in the pool (the target confirmed
    quiescence, or the write bound plus the release margin passed), then forget them;
    the instance stays (it is the daemon's, K28), incarnations keep counting."""
    d, _ = waiting(P0)
    inc = d.rooms[R].inc
    d.create(R + 1, BOOT, None, 0.0)  # still resolving: its pages never left
    out = d.engine_released(1.0)
    (s,) = of(out, Send)
    assert isinstance(s.msg, control.RoomAbort) and s.to == P0 and s.msg.instance_id == "d-a"
    assert not d.quiet(1.0)  # room R's pages went to P0, which has not confirmed
    with pytest.raises(RoomError, match="released its KV pool"):
        d.create(R + 2, BOOT, None, 1.0)
    d.on_status(room_status(R, inc, KVPoll.Failed, quiesced=True), 1.5)
    assert d.quiet(1.5)
    d.forget_rooms()
    assert d.table_sizes() == {"rooms": 0} and d.instance == "d-a"
    d.engine_registered(POOL, AUX, (16,))
    (res,) = d.create(R, BOOT, None, 3.0)
    assert isinstance(res, Resolve) and res.inc > inc


def test_k44_a_silent_target_holds_the_pool_until_the_write_bound() -> None:
    d, _ = waiting(P0)
    d.engine_released(1.0)
    bound = d.rooms[R].write_deadline
    assert bound is not None and not d.quiet(bound + TIMEOUTS.release - 0.01)
    assert d.quiet(bound + TIMEOUTS.release)


def test_k33_samples_sharing_a_room_never_share_an_outcome() -> None:
    d, _ = waiting(P0)
    with pytest.raises(RoomError, match="duplicate room"):
        d.create(R, BOOT, None, 0.5)  # the second sample of the request
    d.on_status(room_status(R, 1, KVPoll.Success), 1.0)
    d.clear(R, 1.0)
    d.create(R, BOOT, None, 2.0)  # a later sample reusing the room starts from nothing
    assert state(d, 2.0) == (KVPoll.Bootstrapping, False)
    assert d.on_status(room_status(R, 1, KVPoll.Success), 2.5) == []
    assert state(d, 2.5)[0] == KVPoll.Bootstrapping


def test_k16_a_lookup_answered_after_the_deadline_fails_the_room() -> None:
    d = receiver()
    d.create(R, BOOT, None, 0.0)
    d.init(R, DST, 0, 0.0)
    out = d.resolved(R, 1, targets(P0), TIMEOUTS.bootstrap + 0.5)  # the sweep has not run
    assert d.rooms[R].status == KVPoll.Failed and "Bootstrapping" in d.rooms[R].failure.reason
    assert [type(s.msg) for s in of(out, Send)] == [control.RoomAbort]  # no pages, an abort
    assert state(d, 9.0) == (KVPoll.Failed, True)


# ---- refusals (issue 19: push, don't wait) -------------------------------------------------

def test_a_refusal_naming_a_new_instance_fails_only_rooms_bound_to_the_old_one() -> None:
    """A prefill rank refused a frame sealed for its previous instance: rooms bound to that
    one fail (kind peer) and hold their pages until confirmed or the release bound, as on a
    lost peer; a room bound to the instance it names now is untouched (K37)."""
    d, _ = waiting(P0)
    old = d.rooms[R].targets[0].instance  # type: ignore[index]
    d.create(R + 1, BOOT, None, 0.0)
    d.init(R + 1, pack_indices([8, 9]), 2, 0.0)  # pages and aux of its own: R is live (K42)
    d.resolved(R + 1, d.rooms[R + 1].inc, [Target(P0, "new")], 0.0)
    failure = RoomFailure(FailureKind.PEER, "restarted", "decode")
    out = d.peer_lost(BOOT, failure, 1.0, keep="new", endpoint=P0)
    assert one(out, Ended).room == R and d.rooms[R].failure == failure
    assert d.rooms[R + 1].status == KVPoll.WaitingForInput and old != "new"
    assert state(d, 1.0) == (KVPoll.Failed, False)  # its pages went out: not yet releasable
    assert d.peer_lost(BOOT, failure, 2.0, endpoint=P0)  # a skew: every room at P0
    assert d.rooms[R + 1].status == KVPoll.Failed


def test_i22_room_pages_carry_the_state_slot_and_window_pages_to_every_prefill_rank() -> None:
    d = receiver()
    d.create(R, BOOT, None, 0.0)
    d.init(R, DST, 1, 0.0, 0, state_index=3, window_pages=pack_indices([4, 9]))
    sends = of(d.resolved(R, 1, targets(P0, P1), 0.0), Send)
    msgs = [s.msg for s in sends]
    assert len(msgs) == 2 and all(isinstance(m, control.RoomPages) for m in msgs)
    assert all(m.state_index == 3 and list(unpack_indices(m.window_pages)) == [4, 9]
               for m in msgs)  # type: ignore[union-attr]


def test_i22_init_refuses_window_pages_that_are_not_int32_indices() -> None:
    d = receiver()
    d.create(R, BOOT, None, 0.0)
    with pytest.raises(RoomError, match="window pages"):
        d.init(R, DST, 1, 0.0, 0, state_index=0, window_pages=b"\x01")
