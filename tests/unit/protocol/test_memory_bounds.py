"""kvd.protocol.memory: every integer of a memory handle and of an exported pool has a wire
bound (offsets, lengths, descriptor positions, device ordinals, pids in ``[0, 2**63)``;
addresses u64), and a pool lists at most MAX_EXPORTED_BUFFERS buffers. A handle with an
integer outside its bound does not decode -- at the engine socket (inside ``RegisterKV``)
and on the control plane (inside ``RegisterRank.pool``), ProtocolError naming the field --
and one with every integer inside round-trips (case S19)."""

from __future__ import annotations

from typing import Any, get_args

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.errors import ProtocolError
from kvd.protocol import codec, control, memory, rpc

EDGES = st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, -(2**63), 2**64 - 1])
INTS = EDGES | st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what msgpack carries
STRUCTS = (memory.ShmHandle, memory.FdHandle, memory.CudaIpcHandle, memory.PassedFdHandle,
           memory.ExportedBuffer, memory.ExportedPool)
#: every integer field of the module: (struct, field, its bound)
FIELDS = [(cls, f.encode_name, f.type) for cls in STRUCTS
          for f in mi.type_info(cls).fields if isinstance(f.type, mi.IntType)]
KV_ARGS = control.KVArgsWire("s", [], [], [], [], [], [], 1, 1, 1, 1, 1)


def _valid(cls: type) -> Any:
    """A valid instance of ``cls`` (memory structs only)."""
    handle = memory.CudaIpcHandle(b"h" * memory.CUDA_IPC_HANDLE_BYTES, 0, 8, "GPU-0")
    return {memory.ShmHandle: memory.ShmHandle("/dev/shm/x", 0, 8),
            memory.FdHandle: memory.FdHandle(0, 0, 8),
            memory.CudaIpcHandle: handle,
            memory.PassedFdHandle: memory.PassedFdHandle(0, 0, 8),
            memory.ExportedBuffer: memory.ExportedBuffer(1 << 40, 8, handle),
            memory.ExportedPool: memory.ExportedPool("h", [], "c", 1)}[cls]


def _frames(cls: type, field: str, value: int) -> list[tuple[str, bytes, Any]]:
    """``cls`` with ``field`` set to ``value``, inside every message that carries it: the
    path the decoder names, the frame, and how to read the field back from the decoded
    message."""
    doc = _doc(_valid(cls))
    doc[field] = value
    out = []
    if cls in get_args(memory.MemoryHandle):  # an engine's registration
        reg = _doc(rpc.RegisterKV([], [], [], [], 1, 1, 1, 1, 1))
        reg["kv_buffers"] = [doc]
        out.append((f"$.call.kv_buffers[0].{field}",
                    _frame({"id": 1, "call": reg}),
                    lambda m: getattr(m.call.kv_buffers[0], field)))
    pool = _doc(_valid(memory.ExportedPool))
    if cls in get_args(memory.PeerHandle):  # a peer's exported pool
        pool["buffers"] = [_doc(_valid(memory.ExportedBuffer)) | {"handle": doc}]
        where, get = f"$.pool.buffers[0].handle.{field}", \
            lambda m: getattr(m.pool.buffers[0].handle, field)
    elif cls is memory.ExportedBuffer:
        pool["buffers"] = [doc]
        where, get = f"$.pool.buffers[0].{field}", lambda m: getattr(m.pool.buffers[0], field)
    elif cls is memory.ExportedPool:
        pool = doc
        where, get = f"$.pool.{field}", lambda m: getattr(m.pool, field)
    else:
        return out
    rank = _doc(control.RegisterRank("i", "tcp://h:1", 0, 1, KV_ARGS))
    out.append((where, _frame(rank | {"pool": pool}), get))
    return out


def _doc(obj: Any) -> Any:
    """``obj`` as msgpack's builtin values (bytes stay bytes)."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(obj))


def _frame(doc: Any) -> bytes:
    return codec.MAGIC + bytes([codec.VERSION]) + msgspec.msgpack.encode(doc)


def _decode(frame: bytes, rank: bool) -> Any:
    return control.decode(frame) if rank else rpc.decode_request(frame)


def test_every_integer_of_the_module_is_bounded_and_only_addresses_are_u64() -> None:
    assert {(c.__name__, f) for c, f, t in FIELDS if t.ge is None} == set()
    assert {(c.__name__, f) for c, f, t in FIELDS if t.le is None} == {
        ("ExportedBuffer", "address")}
    assert all(t.ge == 0 and t.le in (None, 2**63 - 1) for _, _, t in FIELDS)
    assert len(FIELDS) == 14  # 2 + 3 + 3 + 3 + 2 + 1


def test_every_field_reaches_a_wire_message() -> None:
    for cls, field, _ in FIELDS:
        assert _frames(cls, field, 0), (cls, field)


@settings(max_examples=300)  # 14 fields, each at and around its bounds
@given(st.sampled_from(FIELDS), INTS)
def test_an_integer_outside_its_bound_is_refused_naming_it_and_one_inside_round_trips(
        field: tuple[type, str, Any], value: int) -> None:
    cls, name, it = field
    lo, hi = it.ge, 2**64 - 1 if it.le is None else it.le
    for where, frame, get in _frames(cls, name, value):
        rank = where.startswith("$.pool")
        if lo <= value <= hi:
            msg = _decode(frame, rank)
            assert get(msg) == value
            again = control.encode(msg) if rank else codec.encode(msg)
            assert _decode(again, rank) == msg
        else:
            with pytest.raises(ProtocolError, match="malformed frame") as err:
                _decode(frame, rank)
            assert f"at `{where}`" in str(err.value), str(err.value)


def test_a_pool_lists_at_most_its_bound_which_covers_every_registered_buffer() -> None:
    most = (2 * control.MAX_BUFFERS + control.MAX_STATE_BUFFERS + control.MAX_WINDOW_BUFFERS
            + control.MAX_GROUPS * control.MAX_GROUP_BUFFERS)
    assert most <= memory.MAX_EXPORTED_BUFFERS
    buf = _valid(memory.ExportedBuffer)
    for n, ok in ((memory.MAX_EXPORTED_BUFFERS, True), (memory.MAX_EXPORTED_BUFFERS + 1, False)):
        pool = memory.ExportedPool("h", [buf] * n)
        msg = control.RegisterRank("i", "tcp://h:1", 0, 1, KV_ARGS, pool)
        frame = codec.encode(msg)
        if ok:
            assert codec.decode(frame, msgspec.msgpack.Decoder(control.RegisterRank)) == msg
        else:
            with pytest.raises(ProtocolError, match=r"at `\$.pool.buffers`"):
                codec.decode(frame, msgspec.msgpack.Decoder(control.RegisterRank))
