"""Framing shared by the control plane (kvd<->kvd) and the engine RPC.

A frame is ``MAGIC (3 bytes) | VERSION (1 byte) | msgpack body``. The version
is checked before the body is parsed.

Version history:
  1 — first release (control: RegisterRank, RoomPages, RoomStatus, RoomAbort;
      rpc: Request/Reply envelopes).
  2 — room incarnations: RoomPages/RoomStatus/RoomAbort carry ``inc``; RoomStatus
      and RoomAbort carry a failure ``kind``; RoomPages carries ``write_within``;
      RoomStatus loses ``unregistered`` (a prefill never answers an unregistered
      endpoint); RPC replies are typed per call;
      memory handles are a tagged union on ``kind`` (``shm``, ``fd`` passed with
      SCM_RIGHTS, ``cuda_ipc``; :mod:`kvd.protocol.memory`); RegisterRank may carry the
      decode rank's ExportedPool (``pool``) for the same-host ``local`` backend.
  3 — decode-side prefix caching and engine ranks: RoomPages and ReceiverInit carry
      ``first_page`` (the prefill skips the room's pages before it); KVArgsWire and
      RegisterKV carry ``fused_kv`` (one MHA buffer per layer, K and V side by side);
      RegisterKV carries the engine's ``ranks`` (attention TP/DP, PP). A v2 prefill
      would ignore ``first_page`` and write pages the decode did not ask for.
  4 — control: ``Batch`` carries several room messages for one peer in one frame (one
      seal, one ZMQ send); a sender batches what is queued for a peer, in order.
  5 — control: ``Refused`` answers an authentic frame a daemon will not act on (sealed
      for a previous instance of it, or outside its freshness window: clock skew), naming
      its current instance and the measured clock offset; every control field is bounded
      (pages, buffers, aux, text, names) and a frame is capped at the largest real message
      (``control.max_frame()``, S19). A v4 daemon would drop a ``Refused`` as malformed.
  6 — hybrid models (state buffers, window layers): KVArgsWire carries ``state`` (a
      ``StateWire``: layer types, state buffer shapes and window pool, with their memory)
      and RegisterKV its ``StateSpec`` and ``state_buffers``; RoomPages, SenderInit and
      ReceiverInit carry the room's ``state_index`` and ``window_pages``. A v5 prefill
      would ignore them and report Success with the decode's state slot never written.
  7 — extra paged caches and typed aux (speculative decoding, indexer caches): KVArgsWire
      carries ``groups`` (``GroupWire``: a draft model's KV or an indexer K cache, its own
      buffers, item lengths, layers and heads, indexed by the room's KV pages) and
      RegisterKV ``groups``, ``group_buffers`` and ``aux_fields`` (named fields of the aux
      slot); ``Compat`` carries ``aux_layout``, hashed into the fingerprint. A v6 prefill
      would ignore the groups and report Success with the decode's draft KV never written.

Control frames travel inside an authentication seal versioned on its own
(:data:`kvd.security.SEAL_VERSION`, checked before this frame is parsed):
seal 1 ``KVA1`` over PUSH -> PULL sockets; seal 2 ``KVA2`` binds each frame to
its recipient's instance id and MACs a fixed header carrying the frame's
SHA-256, over DEALER -> ROUTER sockets (a PUSH socket cannot connect to a kvd
that speaks seal 2). The seal is independent of the frame versions above.
"""

from __future__ import annotations

import struct
from typing import Any, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt

from kvd.errors import ProtocolError

MAGIC = b"KVD"
VERSION = 7
HEADER_LEN = len(MAGIC) + 1
#: Default upper bound on a frame (bytes); daemons pass their configured limit.
DEFAULT_MAX_FRAME = 64 << 20

T = TypeVar("T")
_SMALL = 64
_I32_MAX = (1 << 31) - 1
#: struct formats of native-order integers (what a memoryview of an integer array says)
_NATIVE_INTS = frozenset("bBhHiIlLqQnN")

_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    """Serialise ``msg`` into one versioned frame (bytes)."""
    return MAGIC + bytes([VERSION]) + _encoder.encode(msg)


def decode(data: bytes, decoder: msgspec.msgpack.Decoder[T],
           max_frame: int = DEFAULT_MAX_FRAME) -> T:
    """Parse one frame with ``decoder``.

    Raises :class:`ProtocolError` on an oversized frame, bad magic, unknown
    version, or a body that does not match the message schema.
    """
    if len(data) > max_frame:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds the {max_frame}-byte limit")
    if len(data) < HEADER_LEN or data[:3] != MAGIC:
        raise ProtocolError("not a kvd frame (bad magic)")
    if data[3] != VERSION:
        raise ProtocolError(f"unsupported wire version {data[3]} (this kvd speaks {VERSION})")
    try:
        return decoder.decode(data[HEADER_LEN:])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed frame: {exc}") from exc
    except RecursionError as exc:
        raise ProtocolError("malformed frame: nested too deeply") from exc


def pack_indices(indices: npt.ArrayLike) -> bytes:
    """Page indices as little-endian int32 bytes (4 bytes per page). Raises
    ProtocolError unless they are 1-D integers in ``[0, 2**31)``."""
    if type(indices) is np.ndarray and indices.ndim == 1 and indices.size <= _SMALL:
        # a few pages: read through the buffer, not numpy's conversions, which cost a
        # thread coming back from a wait 3-9 us more (issue 21's P5 init)
        view = memoryview(indices)  # type: ignore[arg-type]  # numpy is a buffer
        if view.format in _NATIVE_INTS:
            values = view.tolist()
            if values and (min(values) < 0 or max(values) > _I32_MAX):
                raise ProtocolError("page indices must be in [0, 2**31)")
            return struct.pack(f"<{len(values)}i", *values)
    arr = np.asarray(indices)
    if arr.ndim != 1:
        raise ProtocolError(f"page indices must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ProtocolError(f"page indices must be integers, got {arr.dtype}")
    if arr.size:
        # a few pages (a decode step's chunk): Python's min/max over a list cost less
        # than two numpy reductions (about 1 us instead of 10)
        lo, hi = ((min(v := arr.tolist()), max(v)) if arr.size <= _SMALL
                  else (arr.min(), arr.max()))
        if lo < 0 or hi > _I32_MAX:
            raise ProtocolError("page indices must be in [0, 2**31)")
    return arr.astype("<i4", copy=False).tobytes()


def unpack_indices(data: bytes) -> npt.NDArray[np.int64]:
    """Inverse of :func:`pack_indices`; returns int64 page indices.

    Raises :class:`ProtocolError` if the length is not a multiple of 4 or an
    index is negative.
    """
    if len(data) % 4:
        raise ProtocolError(f"page index field of {len(data)} bytes is not a multiple of 4")
    arr = np.frombuffer(data, dtype="<i4").astype(np.int64)
    if arr.size and arr.min() < 0:
        raise ProtocolError("negative page index")
    return arr


def to_builtins(obj: Any) -> Any:
    """Structs to plain dicts/lists (for JSON reports)."""
    return msgspec.to_builtins(obj)
