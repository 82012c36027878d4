"""kvd.protocol.control: every control message survives encode/decode; bad frames are refused."""

from __future__ import annotations

from typing import get_args

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvd.errors import ProtocolError
from kvd.protocol import codec, control

U64 = st.integers(min_value=0, max_value=2**64 - 1)
I64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
#: a count, size, index or incarnation (control.Count), a parallel size (control.Size), a
#: room status (control.StatusCode): what decodes (tests/unit/protocol/test_control_bounds.py)
COUNT = st.integers(min_value=0, max_value=2**63 - 1)
SIZE = st.integers(min_value=1, max_value=2**63 - 1)
STATUS = st.integers(min_value=0, max_value=4)
TEXT = st.text(max_size=40)
INT_LISTS = st.lists(COUNT, max_size=8)
PTR_LISTS = st.lists(U64, max_size=8)

kv_args_wire = st.builds(
    control.KVArgsWire,
    session_id=TEXT,
    kv_data_ptrs=PTR_LISTS,
    kv_data_lens=INT_LISTS,
    kv_item_lens=INT_LISTS,
    aux_data_ptrs=PTR_LISTS,
    aux_data_lens=INT_LISTS,
    aux_item_lens=INT_LISTS,
    page_size=COUNT,
    num_kv_heads=COUNT,
    head_dim=COUNT,
    dtype_size=COUNT,
    num_layers=COUNT,
    layer_start=COUNT,
    is_mla=st.booleans(),
    layout=TEXT,
)

#: Peer names as the codec admits them (S21): other text is a malformed frame.
IID = st.from_regex(r"[A-Za-z0-9._-]{0,64}", fullmatch=True)
ENDPOINT = st.from_regex(r"[!-~]{0,300}", fullmatch=True)
register_rank = st.builds(control.RegisterRank, instance_id=IID, endpoint=ENDPOINT,
                          attn_tp_rank=COUNT, attn_tp_size=SIZE, kv_args=kv_args_wire)
FLOATS = st.floats(allow_nan=False)
room_pages = st.builds(control.RoomPages, room=U64, inc=COUNT, endpoint=ENDPOINT, instance_id=IID,
                       dst_pages=st.binary(max_size=64), aux_index=I64, write_within=FLOATS,
                       required_dst_info_num=COUNT, is_dummy=st.booleans())
room_status = st.builds(control.RoomStatus, room=U64, inc=COUNT, status=STATUS, kind=TEXT,
                        reason=TEXT, endpoint=ENDPOINT, instance_id=IID, quiesced=st.booleans())
room_abort = st.builds(control.RoomAbort, room=U64, inc=COUNT, kind=TEXT, reason=TEXT,
                       endpoint=ENDPOINT, instance_id=IID)
refused = st.builds(control.Refused, why=st.sampled_from(["instance", "clock_skew"]),
                    endpoint=ENDPOINT, instance_id=IID, offset_s=FLOATS, window_s=FLOATS)
control_messages = st.one_of(register_rank, room_pages, room_status, room_abort, refused)


@pytest.mark.parametrize("strategy", [register_rank, room_pages, room_status, room_abort,
                                      refused],
                         ids=["RegisterRank", "RoomPages", "RoomStatus", "RoomAbort", "Refused"])
@given(data=st.data())
def test_round_trip_each_message_type(strategy: st.SearchStrategy, data: st.DataObject) -> None:
    msg = data.draw(strategy)
    frame = control.encode(msg)
    assert frame[:3] == codec.MAGIC
    assert frame[3] == codec.VERSION
    out = control.decode(frame)
    assert type(out) is type(msg)
    assert out == msg


def test_every_control_message_has_a_strategy() -> None:
    assert set(get_args(control.ControlMessage)) == {
        control.RegisterRank, control.RoomPages, control.RoomStatus, control.RoomAbort,
        control.Refused}


def test_room_status_defaults_to_quiesced() -> None:
    body = msgspec.msgpack.encode({"type": "room_status", "room": 1, "inc": 1, "status": 0,
                                   "kind": "aborted", "reason": "x", "endpoint": "e",
                                   "instance_id": "i"})
    out = control.decode(codec.MAGIC + bytes([codec.VERSION]) + body)
    assert isinstance(out, control.RoomStatus) and out.quiesced is True


def _sample_abort() -> control.RoomAbort:
    return control.RoomAbort(room=7, inc=3, kind="aborted", reason="engine gone",
                             endpoint="tcp://h:1", instance_id="i")


def test_decoded_type_follows_the_tag() -> None:
    pages = control.RoomPages(room=1, inc=2, endpoint="e", instance_id="i",
                              dst_pages=b"\x01\x00\x00\x00", aux_index=3, write_within=1.5)
    out = control.decode(control.encode(pages))
    assert isinstance(out, control.RoomPages)
    assert out.required_dst_info_num == 1
    assert out.is_dummy is False
    assert out.dst_pages == b"\x01\x00\x00\x00"


def test_unknown_tag_refused() -> None:
    body = msgspec.msgpack.encode({"type": "room_explode", "room": 1, "reason": "x",
                                   "endpoint": "e", "instance_id": "i"})
    with pytest.raises(ProtocolError):
        control.decode(codec.MAGIC + bytes([codec.VERSION]) + body)


def test_missing_tag_refused() -> None:
    body = msgspec.msgpack.encode({"room": 1, "reason": "x", "endpoint": "e", "instance_id": "i"})
    with pytest.raises(ProtocolError):
        control.decode(codec.MAGIC + bytes([codec.VERSION]) + body)


@pytest.mark.parametrize("field, bad", [("room", "seven"), ("reason", 5), ("endpoint", None),
                                        ("instance_id", [1])])
def test_wrong_field_type_refused(field: str, bad: object) -> None:
    fields = msgspec.to_builtins(_sample_abort())
    fields["type"] = "room_abort"
    fields[field] = bad
    with pytest.raises(ProtocolError):
        control.decode(codec.MAGIC + bytes([codec.VERSION]) + msgspec.msgpack.encode(fields))


def test_missing_required_field_refused() -> None:
    fields = {"type": "room_status", "room": 1, "status": 4, "reason": "", "endpoint": "e"}
    with pytest.raises(ProtocolError):
        control.decode(codec.MAGIC + bytes([codec.VERSION]) + msgspec.msgpack.encode(fields))


def test_nested_kv_args_wrong_type_refused() -> None:
    reg = msgspec.to_builtins(control.RegisterRank(
        instance_id="i", endpoint="e", attn_tp_rank=0, attn_tp_size=1,
        kv_args=control.KVArgsWire(session_id="s", kv_data_ptrs=[1], kv_data_lens=[2],
                                   kv_item_lens=[1], aux_data_ptrs=[], aux_data_lens=[],
                                   aux_item_lens=[], page_size=1, num_kv_heads=1, head_dim=1,
                                   dtype_size=2, num_layers=1)))
    reg["type"] = "register_rank"
    reg["kv_args"]["kv_data_ptrs"] = ["0x1000"]
    with pytest.raises(ProtocolError):
        control.decode(codec.MAGIC + bytes([codec.VERSION]) + msgspec.msgpack.encode(reg))


@given(room_abort)
def test_truncated_frames_refused(msg: control.RoomAbort) -> None:
    frame = control.encode(msg)
    for cut in range(len(frame)):
        with pytest.raises(ProtocolError):
            control.decode(frame[:cut])


def test_max_frame_is_honoured() -> None:
    frame = control.encode(_sample_abort())
    assert control.decode(frame, max_frame=len(frame)) == _sample_abort()
    with pytest.raises(ProtocolError, match="exceeds"):
        control.decode(frame, max_frame=len(frame) - 1)


def test_bad_magic_and_version_refused() -> None:
    frame = control.encode(_sample_abort())
    with pytest.raises(ProtocolError, match="magic"):
        control.decode(b"KVX" + frame[3:])
    with pytest.raises(ProtocolError, match="version"):
        control.decode(frame[:3] + bytes([codec.VERSION + 1]) + frame[4:])


@given(msgs=st.lists(control_messages, min_size=1, max_size=20))
def test_batch_round_trips_messages_in_order(msgs: list[control.ControlMessage]) -> None:
    frame = control.encode_many(msgs)
    assert frame[3] == codec.VERSION == 7
    assert control.decode_many(frame) == msgs


def test_one_message_is_not_wrapped_in_a_batch() -> None:
    msg = control.RoomAbort(room=1, inc=2, kind="aborted", reason="x", endpoint="e",
                            instance_id="i")
    assert control.encode_many([msg]) == control.encode(msg)
    assert control.decode_many(control.encode(msg)) == [msg]


def test_batch_where_one_message_is_expected_is_refused() -> None:
    msg = control.RoomAbort(room=1, inc=2, kind="aborted", reason="x", endpoint="e",
                            instance_id="i")
    with pytest.raises(ProtocolError, match="batch"):
        control.decode(control.encode_many([msg, msg]))


def test_oversized_or_nested_batch_is_refused() -> None:
    msg = control.RoomAbort(room=1, inc=2, kind="aborted", reason="x", endpoint="e",
                            instance_id="i")
    too_many = codec.encode(control.Batch(messages=[msg] * (control.MAX_BATCH + 1)))
    with pytest.raises(ProtocolError, match="exceeds"):
        control.decode_many(too_many)
    nested = codec.MAGIC + bytes([codec.VERSION]) + msgspec.msgpack.encode(
        {"type": "batch", "messages": [{"type": "batch", "messages": []}]})
    with pytest.raises(ProtocolError):
        control.decode_many(nested)


# ---- bounds and the frame cap (case S19) --------------------------------------------------

def test_s19_max_frame_holds_the_largest_real_message_and_not_much_more() -> None:
    """The cap is derived from the field bounds: a RoomPages at MAX_ROOM_PAGES pages (and
    MAX_WINDOW_PAGES window pages) fits, and so does a RegisterRank of a hybrid rank with
    every buffer list at its bound; the cap is within a few KiB of the larger (not the
    64 MiB frames S19 was flooded with)."""
    biggest = control.RoomPages(room=2**64 - 1, inc=2**63 - 1, endpoint="e" * control.MAX_NAME,
                                instance_id="i" * 64,  # an instance id's longest (S21)
                                dst_pages=b"\xff" * (4 * control.MAX_ROOM_PAGES),
                                aux_index=2**31, write_within=1e9, state_index=2**31,
                                window_pages=b"\xff" * (4 * control.MAX_WINDOW_PAGES))
    frame = control.encode(biggest)
    register = control.encode(hybrid_registration())
    assert len(frame) <= control.max_frame() < max(len(frame), len(register)) + (64 << 10)
    assert len(register) <= control.max_frame()
    assert control.decode(frame) == biggest
    assert control.decode(register) == hybrid_registration()


def hybrid_registration() -> control.RegisterRank:
    """A decode rank of a hybrid model at every bound: 4096 KV buffers, 4096 aux buffers,
    MAX_STATE_BUFFERS state buffers, MAX_WINDOW_BUFFERS window buffers and MAX_GROUPS paged
    cache groups of MAX_GROUP_BUFFERS buffers, all exported on CUDA IPC handles with the
    longest names."""
    from kvd.protocol.memory import (
        CUDA_IPC_HANDLE_BYTES,
        CudaIpcHandle,
        ExportedBuffer,
        ExportedPool,
    )
    # addresses at the u64 bound, lengths and counts at int64's (both 9 bytes of msgpack)
    name, top, big, most = "n" * control.MAX_NAME, 2**64 - 1, 2**31, control.I64_MAX
    ptrs, ints = [top] * control.MAX_BUFFERS, [most] * control.MAX_BUFFERS
    n_state, n_win = control.MAX_STATE_BUFFERS, control.MAX_WINDOW_BUFFERS
    n_group = control.MAX_GROUP_BUFFERS
    spec = control.StateSpec(["state"] * control.MAX_LAYERS,
                             [control.StateBufSpec(big, "k" * 32, big, "d" * 32, big, big)] *
                             n_state, control.WindowSpec([most] * n_win, big, big, big, big, big,
                                                         big, name), big, big, big)
    args = control.KVArgsWire(name, ptrs, ints, ints, ptrs, ints, ints, big, big, big, big, big,
                              big, True, name, big, True,
                              compat=control.Compat(name, name, name, "A" * control.MAX_LAYERS,
                                                    name, big, big,
                                                    "a" * control.MAX_AUX_LAYOUT),
                              state=control.StateWire(spec, [top] * (n_state + n_win),
                                                      [most] * (n_state + n_win)),
                              groups=[control.GroupWire(control.GroupSpec(
                                  "g" * 32, [most] * n_group, big, big, big, big, big, big, True,
                                  True, name), [top] * n_group, [most] * n_group)] *
                              control.MAX_GROUPS)
    handle = CudaIpcHandle(b"h" * CUDA_IPC_HANDLE_BYTES, most, most, name, big)
    pool = ExportedPool(name, [ExportedBuffer(top, most, handle)] * (
        2 * control.MAX_BUFFERS + n_state + n_win + control.MAX_GROUPS * n_group))
    return control.RegisterRank("i" * 64, "e" * 256, big, big, args, pool)


@pytest.mark.parametrize("field,value", [
    ("dst_pages", b"\0" * (4 * control.MAX_ROOM_PAGES + 4)),
    ("endpoint", "e" * (control.MAX_NAME + 1)),
    ("instance_id", "i" * (control.MAX_NAME + 1))])
def test_s19_a_field_past_its_bound_is_refused(field: str, value: object) -> None:
    fields = {"room": 1, "inc": 1, "endpoint": "tcp://a:1", "instance_id": "x",
              "dst_pages": b"", "aux_index": 0, "write_within": 1.0, field: value}
    frame = codec.encode(msgspec.structs.replace(control.RoomPages(**fields)))  # unchecked
    with pytest.raises(ProtocolError, match="malformed"):
        control.decode(frame)


def test_a_long_reason_is_clipped_when_encoded_so_that_the_peer_takes_it() -> None:
    msg = control.RoomAbort(room=1, inc=2, kind="aborted", reason="r" * 10_000,
                            endpoint="tcp://a:1", instance_id="x")
    out = control.decode(control.encode(msg))
    # bounded where it entered (S21's clean(): at most MAX_REASON_BYTES, the cut said)
    assert isinstance(out, control.RoomAbort) and len(out.reason.encode()) <= control.MAX_TEXT
    assert "cut" in out.reason and out.room == 1
    batch = control.decode_many(control.encode_many([msg, msg]))
    assert all(len(m.reason.encode()) <= control.MAX_TEXT  # type: ignore[union-attr]
               for m in batch)


def test_s21_one_reason_bound_on_the_wire_and_in_every_sink() -> None:
    from kvd.text import MAX_REASON_BYTES, clean
    assert control.MAX_TEXT == MAX_REASON_BYTES
    # multibyte text: what is sent is what the receiver keeps (cut once, by one rule)
    msg = control.RoomAbort(room=1, inc=2, kind="aborted", reason="\u00e9" * 5_000,
                            endpoint="tcp://a:1", instance_id="x")
    sent = control.clipped(msg)
    assert isinstance(sent, control.RoomAbort)
    assert len(sent.reason.encode()) <= MAX_REASON_BYTES and sent.reason == clean(msg.reason)
    out = control.decode(control.encode(msg))
    assert isinstance(out, control.RoomAbort) and out.reason == sent.reason
