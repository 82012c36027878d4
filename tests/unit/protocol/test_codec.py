"""kvd.protocol.codec: frame header checks, size limit, page-index packing, fuzzing."""

from __future__ import annotations

import contextlib

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvd.errors import ProtocolError
from kvd.protocol import codec, control, rpc


class Ping(msgspec.Struct, frozen=True):
    n: int
    text: str


PING_DECODER = msgspec.msgpack.Decoder(Ping)
HEADER = codec.MAGIC + bytes([codec.VERSION])
DECODERS = [control.decode, rpc.decode_request, rpc.decode_reply]


def test_frame_layout() -> None:
    frame = codec.encode(Ping(1, "a"))
    assert codec.MAGIC == b"KVD"
    assert codec.HEADER_LEN == 4
    assert frame[:4] == b"KVD" + bytes([codec.VERSION])
    assert msgspec.msgpack.decode(frame[4:], type=Ping) == Ping(1, "a")
    assert codec.decode(frame, PING_DECODER) == Ping(1, "a")


@pytest.mark.parametrize("data", [b"", b"K", b"KV", b"KVD", b"XYZ\x01\x80",
                                  b"kvd\x01\x80", b"\x00KVD\x01"])
def test_bad_magic_or_short_frame_refused(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="magic"):
        codec.decode(data, PING_DECODER)


@pytest.mark.parametrize("version", [0, 1, 2, 3, 4, 5, 6, 8, 255])
def test_unknown_version_refused(version: int) -> None:
    assert version != codec.VERSION
    body = codec.encode(Ping(1, "a"))[4:]
    with pytest.raises(ProtocolError, match=f"version {version}"):
        codec.decode(codec.MAGIC + bytes([version]) + body, PING_DECODER)


def test_version_checked_before_body() -> None:
    """A frame with a future version and a garbage body names the version, not the body."""
    with pytest.raises(ProtocolError, match="version"):
        codec.decode(codec.MAGIC + bytes([codec.VERSION + 1]) + b"\xc1\xc1", PING_DECODER)


def test_truncated_body_refused() -> None:
    frame = codec.encode(Ping(123456, "hello world"))
    for cut in range(codec.HEADER_LEN, len(frame)):
        with pytest.raises(ProtocolError, match="malformed"):
            codec.decode(frame[:cut], PING_DECODER)


def test_wrong_field_types_refused() -> None:
    with pytest.raises(ProtocolError, match="malformed"):
        codec.decode(HEADER + msgspec.msgpack.encode({"n": "1", "text": "a"}), PING_DECODER)
    with pytest.raises(ProtocolError, match="malformed"):
        codec.decode(HEADER + msgspec.msgpack.encode({"n": 1}), PING_DECODER)


def test_oversized_frame_refused_before_parsing() -> None:
    frame = codec.encode(Ping(1, "x" * 100))
    assert codec.decode(frame, PING_DECODER, max_frame=len(frame)) == Ping(1, "x" * 100)
    with pytest.raises(ProtocolError, match=f"{len(frame)} bytes exceeds the {len(frame) - 1}"):
        codec.decode(frame, PING_DECODER, max_frame=len(frame) - 1)
    # the size check comes first: even a bad-magic frame is reported as oversized
    with pytest.raises(ProtocolError, match="exceeds"):
        codec.decode(b"X" * 2000, PING_DECODER, max_frame=1000)


def test_default_max_frame() -> None:
    assert codec.DEFAULT_MAX_FRAME == 64 << 20
    with pytest.raises(ProtocolError, match="exceeds"):
        codec.decode(b"\0" * (codec.DEFAULT_MAX_FRAME + 1), PING_DECODER)


# --------------------------------------------------------------------------- fuzzing

def _decodes_or_protocol_error(data: bytes) -> None:
    for decode in DECODERS:
        with contextlib.suppress(ProtocolError):  # anything else fails the test
            decode(data)


@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_but_protocol_error(data: bytes) -> None:
    _decodes_or_protocol_error(data)
    _decodes_or_protocol_error(HEADER + data)


TAGS = ["register_rank", "room_pages", "room_status", "room_abort", "register_kv",
        "sender_create", "sender_init", "sender_send", "receiver_create", "receiver_init",
        "poll", "wait", "abort", "clear", "info", "bogus"]
KEYS = ["type", "id", "call", "ok", "result", "error", "kind", "room", "reason", "endpoint",
        "instance_id", "status", "dst_pages", "aux_index", "pages", "is_last", "rooms", "timeout",
        "kv_args", "kv_buffers", "kv_item_lens", "page_size", "dp_rank", "statuses"]
scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
           | st.text(max_size=8) | st.binary(max_size=8) | st.sampled_from(TAGS))
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(KEYS) | st.integers(-5, 5), inner, max_size=6),
    max_leaves=25,
)


@given(values)
def test_structured_garbage_never_raises_anything_but_protocol_error(obj: object) -> None:
    """Well-formed msgpack with plausible keys and tags but arbitrary shapes."""
    _decodes_or_protocol_error(HEADER + msgspec.msgpack.encode(obj))


@given(st.binary(min_size=1, max_size=60), st.integers(0, 59), st.integers(0, 255))
def test_corrupted_valid_frames(seed: bytes, pos: int, byte: int) -> None:
    msg = control.RoomPages(room=int.from_bytes(seed[:4], "little"), inc=len(seed),
                            endpoint=seed.hex(), instance_id="i", dst_pages=seed,
                            aux_index=len(seed), write_within=1.0)
    frame = bytearray(control.encode(msg))
    frame[pos % len(frame)] = byte
    _decodes_or_protocol_error(bytes(frame))


# --------------------------------------------------------------------------- page indices

index_arrays = hnp.arrays(
    dtype=st.sampled_from([np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                           np.uint32, np.uint64]),
    shape=hnp.array_shapes(min_dims=1, max_dims=1, min_side=0, max_side=50),
    elements=st.integers(0, 127),
)


@given(index_arrays)
def test_indices_round_trip(arr: np.ndarray) -> None:
    data = codec.pack_indices(arr)
    assert len(data) == 4 * arr.size
    out = codec.unpack_indices(data)
    assert out.dtype == np.int64
    assert out.tolist() == arr.tolist()


@given(st.lists(st.integers(0, 2**31 - 1), max_size=50))
def test_indices_round_trip_full_int32_range(values: list[int]) -> None:
    data = codec.pack_indices(values)
    assert data == b"".join(v.to_bytes(4, "little") for v in values)
    assert codec.unpack_indices(data).tolist() == values


@given(hnp.arrays(dtype=st.sampled_from(["<i8", ">i8", "<u4", ">i4", "<i2", "u1", "<u8"]),
                  shape=st.integers(0, 130)),
       st.sampled_from([1, 2, -1]))
def test_pack_indices_of_any_integer_array_is_its_int32_or_a_refusal(
        arr: np.ndarray, step: int) -> None:
    """Small arrays are read through their buffer, larger ones with numpy: either way
    (any byte order, strided) the int32 bytes of the values, or ProtocolError for a value
    outside [0, 2**31)."""
    view = arr[::step]
    values = view.tolist()
    if values and (min(values) < 0 or max(values) >= 2**31):
        with pytest.raises(ProtocolError, match="2\\*\\*31"):
            codec.pack_indices(view)
        return
    assert codec.pack_indices(view) == b"".join(v.to_bytes(4, "little") for v in values)


def test_pack_indices_is_little_endian_int32() -> None:
    assert codec.pack_indices([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert codec.pack_indices(np.array([], dtype=np.int64)) == b""
    assert codec.pack_indices([]) == b""
    assert codec.unpack_indices(b"").size == 0


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_unpack_length_not_multiple_of_4_refused(n: int) -> None:
    with pytest.raises(ProtocolError, match="multiple of 4"):
        codec.unpack_indices(b"\x01" * n)


def test_unpack_negative_refused() -> None:
    data = (5).to_bytes(4, "little") + (-1).to_bytes(4, "little", signed=True)
    with pytest.raises(ProtocolError, match="negative"):
        codec.unpack_indices(data)


@pytest.mark.parametrize("bad", [[-1], [3, -7, 2], np.array([0, -1], dtype=np.int8)])
def test_pack_negative_refused(bad: object) -> None:
    with pytest.raises(ProtocolError):
        codec.pack_indices(bad)


@pytest.mark.parametrize("bad", [[2**31], np.array([2**32 + 1], dtype=np.uint64),
                                 np.array([2**40], dtype=np.int64)])
def test_pack_out_of_int32_range_refused(bad: object) -> None:
    """Values that would silently wrap in int32 are refused instead."""
    with pytest.raises(ProtocolError):
        codec.pack_indices(bad)


@pytest.mark.parametrize("bad", [[1.0, 2.0], np.array([1.5]), np.array([True, False]),
                                 ["1", "2"], np.array([1 + 2j])])
def test_pack_non_integer_refused(bad: object) -> None:
    with pytest.raises(ProtocolError, match="integers"):
        codec.pack_indices(bad)


@pytest.mark.parametrize("bad", [[[1, 2], [3, 4]], np.zeros((2, 0), dtype=np.int32),
                                 np.int32(5), 7])
def test_pack_not_1d_refused(bad: object) -> None:
    with pytest.raises(ProtocolError, match="1-D"):
        codec.pack_indices(bad)


def test_to_builtins() -> None:
    out = codec.to_builtins(control.RoomAbort(room=1, inc=2, kind="aborted", reason="r",
                                              endpoint="e", instance_id="i"))
    assert out == {"type": "room_abort", "room": 1, "inc": 2, "kind": "aborted", "reason": "r",
                   "endpoint": "e", "instance_id": "i"}
