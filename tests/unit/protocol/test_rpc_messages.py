"""kvd.protocol.rpc: engine <-> kvd requests and replies round trip; bad frames are refused."""

from __future__ import annotations

from typing import get_args

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvd.errors import ProtocolError
from kvd.protocol import codec, rpc

U64 = st.integers(min_value=0, max_value=2**64 - 1)
I64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
COUNT = st.integers(min_value=0, max_value=2**63 - 1)
# room ids are 64-bit unsigned on the wire (rpc.RoomId); a room call's other integers int64;
# a registration's counts, sizes, offsets and lengths [0, 2**63) (kvd.protocol.bounds)
TEXT = st.text(max_size=40)
INT_LISTS = st.lists(COUNT, max_size=8)

shm_handles = (st.builds(rpc.ShmHandle, path=TEXT, offset=COUNT, length=COUNT)
               | st.builds(rpc.FdHandle, fd=COUNT, offset=COUNT, length=COUNT)
               | st.builds(rpc.CudaIpcHandle, handle=st.binary(min_size=64, max_size=64),
                           offset=COUNT, length=COUNT, device_uuid=TEXT, device=COUNT))

CALLS = {
    "RegisterKV": st.builds(
        rpc.RegisterKV, kv_buffers=st.lists(shm_handles, max_size=4), kv_item_lens=INT_LISTS,
        aux_buffers=st.lists(shm_handles, max_size=3), aux_item_lens=INT_LISTS, page_size=COUNT,
        num_kv_heads=COUNT, head_dim=COUNT, dtype_size=COUNT, num_layers=COUNT,
        layer_start=COUNT,
        is_mla=st.booleans(), layout=TEXT, engine_id=TEXT),
    "SenderCreate": st.builds(rpc.SenderCreate, room=U64),
    "SenderInit": st.builds(rpc.SenderInit, room=U64, num_pages=I64, aux_index=I64),
    "SenderSend": st.builds(rpc.SenderSend, room=U64, pages=st.binary(max_size=64),
                            is_last=st.booleans()),
    "SenderSendLayers": st.builds(rpc.SenderSendLayers, room=U64, pages=st.binary(max_size=64),
                                  layer_start=st.integers(0, rpc.MAX_LAYERS),
                                  layer_end=st.integers(0, rpc.MAX_LAYERS),
                                  is_last=st.booleans()),
    "ReceiverCreate": st.builds(rpc.ReceiverCreate, room=U64, bootstrap_addr=TEXT,
                                dp_rank=st.none() | I64),
    "ReceiverInit": st.builds(rpc.ReceiverInit, room=U64, dst_pages=st.binary(max_size=64),
                              aux_index=I64),
    "Poll": st.builds(rpc.Poll, rooms=st.lists(U64, max_size=10)),
    "Wait": st.builds(rpc.Wait, rooms=st.lists(U64, max_size=10),
                      timeout=st.floats(allow_nan=False)),
    "Abort": st.builds(rpc.Abort, room=U64, reason=TEXT, bootstrap_addr=st.none() | TEXT,
                       dp_rank=st.none() | I64),
    "Clear": st.builds(rpc.Clear, room=U64),
    "Info": st.just(rpc.Info()),
    "Release": st.just(rpc.Release()),
    "OpenTable": st.just(rpc.OpenTable()),
    "OpenRing": st.builds(rpc.OpenRing, capacity=I64, record_bytes=I64),
}
CALLS["Many"] = st.builds(rpc.Many, calls=st.lists(st.one_of(
    [CALLS[t.__name__] for t in get_args(rpc.NowCall)]), max_size=5))

# Values that survive a msgpack round trip unchanged and compare equal (no NaN, no tuples).
plain_values = st.recursive(
    st.none() | st.booleans() | I64 | U64 | st.floats(allow_nan=False) | TEXT
    | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=20,
)

replies = st.builds(rpc.Reply, id=I64, ok=st.booleans(), result=plain_values, error=TEXT,
                    kind=TEXT)


def _split(stream: bytes) -> bytes:
    """Check the 4-byte big-endian length prefix and return the frame after it."""
    (n,) = rpc.LENGTH.unpack(stream[:4])
    assert n == len(stream) - 4
    return stream[4:]


def test_every_call_type_has_a_strategy() -> None:
    assert {getattr(rpc, name) for name in CALLS} == set(get_args(rpc.Call))


@pytest.mark.parametrize("name", sorted(CALLS))
@given(data=st.data())
def test_request_round_trip(name: str, data: st.DataObject) -> None:
    req = rpc.Request(id=data.draw(I64), call=data.draw(CALLS[name]))
    assert type(req.call).__name__ == name
    frame = _split(rpc.encode(req))
    assert frame[:3] == codec.MAGIC and frame[3] == codec.VERSION
    out = rpc.decode_request(frame)
    assert type(out.call) is type(req.call)
    assert out == req


@given(replies)
def test_reply_round_trip(reply: rpc.Reply) -> None:
    out = rpc.decode_reply(_split(rpc.encode(reply)))
    assert out == reply


@given(st.builds(rpc.PollResult, statuses=st.lists(st.integers(-1, 4), max_size=10),
                 reasons=st.dictionaries(I64, TEXT, max_size=5)))
def test_poll_result_inside_reply_round_trip(result: rpc.PollResult) -> None:
    out = rpc.decode_reply(_split(rpc.encode(rpc.Reply(id=1, ok=True, result=result))))
    assert msgspec.convert(out.result, rpc.PollResult) == result


def test_reply_defaults() -> None:
    out = rpc.decode_reply(_split(rpc.encode(rpc.Reply(id=3, ok=False))))
    assert (out.id, out.ok, out.result, out.error, out.kind) == (3, False, None, "", "")


def test_request_is_not_a_reply() -> None:
    frame = _split(rpc.encode(rpc.Request(id=1, call=rpc.Info())))
    with pytest.raises(ProtocolError):
        rpc.decode_reply(frame)
    frame = _split(rpc.encode(rpc.Reply(id=1, ok=True)))
    with pytest.raises(ProtocolError):
        rpc.decode_request(frame)


def _raw(obj: object) -> bytes:
    return codec.MAGIC + bytes([codec.VERSION]) + msgspec.msgpack.encode(obj)


def test_unknown_call_tag_refused() -> None:
    with pytest.raises(ProtocolError):
        rpc.decode_request(_raw({"id": 1, "call": {"type": "format_disk"}}))


@pytest.mark.parametrize("request_obj", [
    {"id": "1", "call": {"type": "info"}},
    {"id": 1, "call": {"type": "poll", "rooms": "1,2"}},
    {"id": 1, "call": {"type": "poll", "rooms": [1, "2"]}},
    {"id": 1, "call": {"type": "wait", "rooms": [1]}},
    {"id": 1, "call": {"type": "wait", "rooms": [1], "timeout": "5"}},
    {"id": 1, "call": {"type": "sender_send", "room": 1, "pages": [1, 2], "is_last": True}},
    {"id": 1, "call": {"type": "sender_send", "room": 1, "pages": b"", "is_last": 1}},
    {"id": 1, "call": {"type": "receiver_create", "room": 1, "bootstrap_addr": "h:1",
                       "dp_rank": "0"}},
    {"id": 1, "call": {"type": "register_kv", "kv_buffers": [{"path": "p", "offset": -1}],
                       "kv_item_lens": [], "aux_buffers": [], "aux_item_lens": [],
                       "page_size": 1, "num_kv_heads": 1, "head_dim": 1, "dtype_size": 1,
                       "num_layers": 1}},
    {"id": 1},
    [1, {"type": "info"}],
])
def test_wrong_field_types_refused(request_obj: object) -> None:
    with pytest.raises(ProtocolError):
        rpc.decode_request(_raw(request_obj))


def test_truncated_request_refused() -> None:
    frame = _split(rpc.encode(rpc.Request(id=9, call=rpc.Poll(rooms=[1, 2, 3]))))
    for cut in range(len(frame)):
        with pytest.raises(ProtocolError):
            rpc.decode_request(frame[:cut])


def test_oversized_frames_refused() -> None:
    frame = _split(rpc.encode(rpc.Request(id=9, call=rpc.SenderSend(room=1, pages=b"\0" * 4096,
                                                                     is_last=False))))
    assert rpc.decode_request(frame, max_frame=len(frame)).id == 9
    with pytest.raises(ProtocolError, match="exceeds"):
        rpc.decode_request(frame, max_frame=len(frame) - 1)
    reply = _split(rpc.encode(rpc.Reply(id=1, ok=True, result="x" * 2000)))
    with pytest.raises(ProtocolError, match="exceeds"):
        rpc.decode_reply(reply, max_frame=1024)


def test_deeply_nested_reply_result_is_a_protocol_error() -> None:
    """``Reply.result`` is ``Any``: a few KB of nested arrays must not escape as RecursionError."""
    head = (b"\x83" + msgspec.msgpack.encode("id") + msgspec.msgpack.encode(1)
            + msgspec.msgpack.encode("ok") + msgspec.msgpack.encode(True)
            + msgspec.msgpack.encode("result"))
    frame = codec.MAGIC + bytes([codec.VERSION]) + head + b"\x91" * 5000 + b"\xc0"
    assert len(frame) < codec.DEFAULT_MAX_FRAME
    with pytest.raises(ProtocolError):
        rpc.decode_reply(frame)


def test_handles_are_tagged_by_kind_on_the_wire() -> None:
    reg = rpc.RegisterKV(kv_buffers=[rpc.ShmHandle("/dev/shm/p", 0, 8), rpc.FdHandle(0, 8, 8)],
                         kv_item_lens=[8, 8], aux_buffers=[
                             rpc.CudaIpcHandle(b"h" * 64, 0, 8, "GPU-1")], aux_item_lens=[8],
                         page_size=1, num_kv_heads=1, head_dim=1, dtype_size=1, num_layers=1)
    body = msgspec.msgpack.decode(codec.encode(rpc.Request(id=1, call=reg))[4:])
    kinds = [h["kind"] for h in body["call"]["kv_buffers"] + body["call"]["aux_buffers"]]
    assert kinds == ["shm", "fd", "cuda_ipc"]
    frame = rpc.encode(rpc.Request(id=1, call=reg))
    assert rpc.decode_request(_split(frame)).call == reg


def test_unknown_handle_kind_is_a_protocol_error() -> None:
    call = {"type": "register_kv", "kv_buffers": [{"kind": "nfs", "path": "x", "offset": 0,
                                                   "length": 1}],
            "kv_item_lens": [1], "aux_buffers": [], "aux_item_lens": [], "page_size": 1,
            "num_kv_heads": 1, "head_dim": 1, "dtype_size": 1, "num_layers": 1}
    frame = codec.MAGIC + bytes([codec.VERSION]) + msgspec.msgpack.encode(
        {"id": 1, "call": call})
    with pytest.raises(ProtocolError, match="malformed"):
        rpc.decode_request(frame)


def test_number_fds_renumbers_descriptors_in_order() -> None:
    reg = rpc.RegisterKV(kv_buffers=[rpc.FdHandle(17, 0, 8), rpc.ShmHandle("/dev/shm/p", 0, 8),
                                     rpc.FdHandle(9, 8, 8), rpc.FdHandle(17, 16, 8)],
                         kv_item_lens=[8] * 4, aux_buffers=[rpc.FdHandle(9, 0, 8)],
                         aux_item_lens=[8], page_size=1, num_kv_heads=1, head_dim=1,
                         dtype_size=1, num_layers=2)
    wire, fds = rpc.number_fds(reg)
    assert fds == [17, 9]
    assert [getattr(h, "fd", None) for h in wire.kv_buffers] == [0, None, 1, 0]
    assert wire.aux_buffers[0] == rpc.FdHandle(1, 0, 8)
    rpc.check_fd_indices(wire, 2)
    with pytest.raises(ProtocolError, match="carried 1"):
        rpc.check_fd_indices(wire, 1)
    assert rpc.number_fds(rpc.Poll(rooms=[1])) == (rpc.Poll(rooms=[1]), [])


def test_i22_layer_send_bounds_are_checked_on_decode() -> None:
    """A layer index outside ``[0, MAX_LAYERS]`` is a malformed frame, never a call."""
    for start, end in [(-1, 1), (0, rpc.MAX_LAYERS + 1)]:
        bad = rpc.Request(id=1, call=rpc.SenderSendLayers(room=1, pages=b"", layer_start=start,
                                                          layer_end=end))
        with pytest.raises(ProtocolError):
            rpc.decode_request(_split(rpc.encode(bad)))
