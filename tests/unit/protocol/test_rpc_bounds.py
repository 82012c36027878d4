"""kvd.protocol.rpc: the integers of a room call have wire bounds (a room id is a 64-bit
unsigned integer, a call's other integers int64), kvd's decoder refuses any other value
(ProtocolError), and the engine's client check (``check_bounds``) refuses exactly what
the decoder refuses, so a call it lets into a submission ring always decodes there."""

from __future__ import annotations

from typing import Any, get_args

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvd.errors import ProtocolError
from kvd.protocol import codec, rpc

#: integers around every bound that matters: int64, uint64, and past them
EDGES = st.sampled_from([0, 1, -1, 2**31, -(2**31) - 1, 2**63 - 1, 2**63, -(2**63),
                         -(2**63) - 1, 2**64 - 1, 2**64])
INTS = EDGES | st.integers(min_value=-(2**65), max_value=2**65)


def _calls(i: Any) -> dict[type, Any]:
    """A strategy per room call, every integer field drawn from ``i``."""
    return {
        rpc.SenderCreate: st.builds(rpc.SenderCreate, room=i),
        rpc.SenderInit: st.builds(rpc.SenderInit, room=i, num_pages=i, aux_index=i,
                                  state_index=i),
        rpc.SenderSend: st.builds(rpc.SenderSend, room=i, pages=st.just(b""),
                                  is_last=st.booleans()),
        rpc.SenderSendLayers: st.builds(rpc.SenderSendLayers, room=i, pages=st.just(b""),
                                        layer_start=st.integers(0, 4),
                                        layer_end=st.integers(0, 4)),
        rpc.ReceiverCreate: st.builds(rpc.ReceiverCreate, room=i, bootstrap_addr=st.just("a:1"),
                                      dp_rank=st.none() | i),
        rpc.ReceiverInit: st.builds(rpc.ReceiverInit, room=i, dst_pages=st.just(b""),
                                    aux_index=i, first_page=i, state_index=i),
        rpc.Abort: st.builds(rpc.Abort, room=i, dp_rank=st.none() | i),
        rpc.Clear: st.builds(rpc.Clear, room=i),
    }


def test_every_room_call_has_a_strategy() -> None:
    assert set(_calls(INTS)) == set(get_args(rpc.RingCall))


@given(st.one_of(list(_calls(INTS).values())))
def test_the_clients_check_refuses_exactly_what_kvds_decoder_refuses(call: Any) -> None:
    """Whatever the integers: a call ``check_bounds`` passes decodes to itself; a call it
    refuses (ValueError naming the field) cannot be encoded or does not decode."""
    try:
        rpc.check_bounds(call)
    except ValueError as exc:
        assert f"{type(call).__name__}." in str(exc)
        try:
            frame = codec.encode(rpc.Request(id=1, call=call))
        except (OverflowError, msgspec.EncodeError):
            return  # past what msgpack carries: it never reaches kvd
        with pytest.raises(ProtocolError):
            rpc.decode_request(frame)
        return
    assert rpc.decode_request(codec.encode(rpc.Request(id=1, call=call))).call == call


@pytest.mark.parametrize("call", [
    rpc.SenderCreate(room=-1), rpc.Clear(room=-(2**63)), rpc.Abort(room=-5),
    rpc.ReceiverCreate(room=-1, bootstrap_addr="a:1"),
    rpc.ReceiverInit(room=1, dst_pages=b"", aux_index=0, state_index=2**63),
    rpc.SenderInit(room=1, num_pages=2**64 - 1, aux_index=0),
    rpc.ReceiverCreate(room=1, bootstrap_addr="a:1", dp_rank=2**63),
    rpc.Poll(rooms=[1, -1]), rpc.Wait(rooms=[-1], timeout=0.0),
])
def test_a_room_id_outside_uint64_or_an_index_past_int64_does_not_decode(call: Any) -> None:
    """Before, ``SenderCreate(room=-1)`` decoded, made a room, and failed publishing it
    ("internal error"); ``ReceiverInit(state_index=2**63)`` failed inside the room
    machine's numpy arrays. Now neither reaches a handler."""
    with pytest.raises(ProtocolError, match="malformed frame"):
        rpc.decode_request(codec.encode(rpc.Request(id=1, call=call)))


def test_the_largest_room_id_and_the_int64_edges_decode() -> None:
    for call in (rpc.SenderCreate(room=2**64 - 1), rpc.Poll(rooms=[0, 2**64 - 1]),
                 rpc.ReceiverInit(room=2**64 - 1, dst_pages=b"", aux_index=-(2**63),
                                  state_index=2**63 - 1, first_page=0)):
        rpc.check_bounds(call)
        assert rpc.decode_request(codec.encode(rpc.Request(id=1, call=call))).call == call


def test_the_check_refuses_a_room_that_is_no_int_and_passes_other_calls() -> None:
    with pytest.raises(ValueError, match=r"Clear\.room"):
        rpc.check_bounds(rpc.Clear(room=1.5))  # type: ignore[arg-type]
    rpc.check_bounds(rpc.Info())
    rpc.check_bounds(rpc.Poll(rooms=[-1]))  # not a room call: kvd's decoder refuses it
