"""Engine <-> kvd RPC messages (Unix socket). PURE.

Stream framing: a 4-byte big-endian length, then one versioned frame
(:mod:`kvd.protocol.codec`). The engine sends :class:`Request`, kvd answers
with a :class:`Reply` carrying the same ``id``.
"""

from __future__ import annotations

import struct
import typing
from typing import Annotated, Any, TypeAlias

import msgspec
import msgspec.inspect

from kvd import errors
from kvd.errors import ProtocolError
from kvd.protocol import codec
from kvd.protocol.bounds import I64, Count, RoomId, Size
from kvd.protocol.control import (
    MAX_AUX_FIELDS,
    MAX_BUFFERS,
    MAX_GROUP_BUFFERS,
    MAX_GROUPS,
    MAX_STATE_BUFFERS,
    MAX_WINDOW_BUFFERS,
    AuxField,
    Compat,
    GroupSpec,
    Ints,
    Name,
    StateSpec,
)
from kvd.protocol.memory import CudaIpcHandle, FdHandle, MemoryHandle, ShmHandle
from kvd.protocol.ring import ring_bytes
from kvd.text import clean

__all__ = ["I64", "CudaIpcHandle", "FdHandle", "MemoryHandle", "RoomId",  # re-exported
           "ShmHandle"]

LENGTH = struct.Struct(">I")
#: Most descriptors one request may carry with ``SCM_RIGHTS`` (more close the connection).
MAX_FDS = 64


# Every integer of a call carries a wire bound (one definition, :mod:`kvd.protocol.bounds`):
# :data:`RoomId` (uint64) for room ids, :data:`I64` for a room call's other integers
# (pages, slots, ranks), and a registration's the bounds its peers decode it with
# (:class:`~kvd.protocol.control.KVArgsWire`: :data:`Count` layers, heads, sizes and item
# lengths, list lengths capped alike). A call naming another does not decode: the engine
# gets a ProtocolError naming the field (``... at `$.call.layer_start```) and nothing
# runs. Before, ``SenderCreate(room=-1)`` made a room kvd could not publish and answered
# "internal error", ``ReceiverInit(state_index=2**63)`` failed inside the room machine's
# numpy arrays, and ``RegisterKV(layer_start=-1)`` registered, failing only when the daemon
# registered with a peer (a RegisterRank no peer would decode).

#: Handles a registration lists: as many as its peers take (``KVArgsWire``'s bounds).
KVHandles = Annotated[list[MemoryHandle], msgspec.Meta(max_length=MAX_BUFFERS)]
StateHandles = Annotated[list[MemoryHandle],
                         msgspec.Meta(max_length=MAX_STATE_BUFFERS + MAX_WINDOW_BUFFERS)]
GroupHandles = Annotated[list[MemoryHandle],
                         msgspec.Meta(max_length=MAX_GROUPS * MAX_GROUP_BUFFERS)]


class EngineRanks(msgspec.Struct, frozen=True):
    """Where the registering engine rank sits in its instance, as the engine knows it:
    attention TP/DP and PP rank and size (ranks in ``[0, size)``). kvd checks them against
    its settings and takes unset ones from here (:func:`kvd.ranks.resolve`)."""

    attn_tp_rank: Count
    attn_tp_size: Size
    attn_dp_rank: Count = 0
    attn_dp_size: Size = 1
    pp_rank: Count = 0
    pp_size: Size = 1


class RegisterKV(msgspec.Struct, tag="register_kv", frozen=True):
    """The engine's KV and aux buffers (see :class:`~kvd.protocol.control.KVArgsWire`
    for the meaning of the fields; handles replace raw pointers). Handles of any kind
    (:data:`~kvd.protocol.memory.MemoryHandle`), mixed freely; :class:`FdHandle` ones
    name descriptors sent with the request (:func:`number_fds`). ``ranks``: the engine's
    parallel position (None: take kvd's settings). ``fused_kv``: see ``KVArgsWire``."""

    kv_buffers: KVHandles
    kv_item_lens: Ints
    aux_buffers: KVHandles
    aux_item_lens: Ints
    page_size: Count
    num_kv_heads: Count
    head_dim: Count
    dtype_size: Count
    num_layers: Count
    layer_start: Count = 0
    is_mla: bool = False
    layout: Name = "NHD"
    total_kv_heads: Count = 0
    engine_id: str = ""         # the same engine after a reconnect keeps its rooms
    ranks: EngineRanks | None = None
    fused_kv: bool = False
    compat: Compat | None = None  # the engine's fingerprint fields (wire_version: kvd's)
    state: StateSpec | None = None  # hybrid models: what state_buffers hold
    state_buffers: StateHandles = []  # state slots, then the window pool's buffers
    # extra paged caches (draft KV, indexer K): their shapes, then every group's buffers in
    # group order; named fields of the aux slot (typed aux). Wire version 7.
    groups: Annotated[list[GroupSpec], msgspec.Meta(max_length=MAX_GROUPS)] = []
    group_buffers: GroupHandles = []
    aux_fields: Annotated[list[AuxField], msgspec.Meta(max_length=MAX_AUX_FIELDS)] = []


class SenderCreate(msgspec.Struct, tag="sender_create", frozen=True):
    """``release_digest``: SHA-256 of the opener's release token (32 bytes; empty: the
    room cannot be released by token, K45/K46, :mod:`kvd.protocol.release`)."""

    room: RoomId
    release_digest: bytes = b""


class SenderInit(msgspec.Struct, tag="sender_init", frozen=True):
    """``state_index``: the room's state slot (-1: none); ``window_pages`` (int32 LE
    bytes): the window pool's pages holding the room's last ``window_tokens`` tokens."""

    room: RoomId
    num_pages: I64
    aux_index: I64
    state_index: I64 = -1
    window_pages: bytes = b""


class SenderSend(msgspec.Struct, tag="sender_send", frozen=True):
    """One prefill chunk: int32 page indices (bytes); ``is_last`` triggers aux."""

    room: RoomId
    pages: bytes
    is_last: bool


#: Most layers a :class:`SenderSendLayers` may name (a bound on the field, not a model
#: limit: the largest models have about 200).
MAX_LAYERS = 4096


class SenderSendLayers(msgspec.Struct, tag="sender_send_layers", frozen=True):
    """Local layers ``[layer_start, layer_end)`` of this rank's registered pool (its KV
    buffers' layer order, ``0 .. num_layers``) of some pages of a room, ready to move
    while later layers compute (layer streaming, issue 22 item 4). ``pages`` (int32 LE
    bytes): pages the room never named (a new chunk), pages it named before, or none (every
    page named so far that still misses a layer). ``is_last``: the room's last send (it
    carries aux); every layer of every page must have been named by then."""

    room: RoomId
    pages: bytes
    layer_start: Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYERS)]
    layer_end: Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYERS)]
    is_last: bool = False


class ReceiverCreate(msgspec.Struct, tag="receiver_create", frozen=True):
    room: RoomId
    bootstrap_addr: str
    dp_rank: I64 | None = None


class ReceiverInit(msgspec.Struct, tag="receiver_init", frozen=True):
    """Destination pages (int32 LE bytes) and aux slot of a room. ``first_page``: the
    index, in the room's page sequence, of the page ``dst_pages[0]`` receives -- the
    decode already holds the ``first_page`` pages before it (a local prefix-cache hit)
    and the prefill writes none of them."""

    room: RoomId
    dst_pages: bytes
    aux_index: I64
    first_page: I64 = 0
    state_index: I64 = -1       # the room's state slot here (-1: none)
    window_pages: bytes = b""   # window pool pages (int32 LE) receiving the window


class Poll(msgspec.Struct, tag="poll", frozen=True):
    """Status of many rooms in one call; unknown rooms answer ``UNKNOWN_ROOM``."""

    rooms: list[RoomId]


class Wait(msgspec.Struct, tag="wait", frozen=True):
    """Block until every room is Success/Failed/unknown (``any_done``: until one is) or
    ``timeout`` seconds pass; answers like :class:`Poll`. Cheaper than polling in a loop:
    no RPC per round. An engine that only waits for transfers sleeps here with
    ``any_done`` and reports each room as soon as it ends."""

    rooms: list[RoomId]
    timeout: float
    any_done: bool = False


class Abort(msgspec.Struct, tag="abort", frozen=True):
    """End a room. On decode, ``bootstrap_addr`` (and ``dp_rank``) let kvd tell the
    prefill ranks even when it does not know the room (e.g. it restarted)."""

    room: RoomId
    reason: str = "aborted by engine"
    bootstrap_addr: str | None = None
    dp_rank: I64 | None = None

    def __post_init__(self) -> None:  # the engine's text, escaped and bounded on entry (S21)
        msgspec.structs.force_setattr(self, "reason", clean(self.reason))


class Clear(msgspec.Struct, tag="clear", frozen=True):
    room: RoomId


class Info(msgspec.Struct, tag="info", frozen=True):
    pass


class OpenTable(msgspec.Struct, tag="open_table", frozen=True):
    """The engine asks for kvd's room status table (issue 21, :mod:`kvd.protocol.table`):
    answered with :class:`TableResult`, the table's memfd riding with the reply
    (``SCM_RIGHTS``). Refused (``RpcError``) when kvd runs with ``engine_channel`` off."""


class TableResult(msgspec.Struct, frozen=True):
    """Answer to :class:`OpenTable`: the table's slots and its size in bytes (the memfd
    came with the reply)."""

    nslots: int
    size: int


#: Bounds of an :class:`OpenRing`: records per ring, bytes per record (a multiple of 8),
#: and bytes of the memfd holding both rings.
MAX_RING_CAPACITY = 4096
MIN_RING_RECORD = 512
MAX_RING_RECORD = 1 << 16
MAX_RING_BYTES = 16 << 20


def ring_sizes(capacity: int, record_bytes: int) -> int:
    """Bytes of the memfd holding a submission and a completion ring of ``capacity``
    records of ``record_bytes`` bytes each; ValueError naming the bound unless
    ``capacity`` is a power of two in ``[1, MAX_RING_CAPACITY]``, ``record_bytes`` a
    multiple of 8 in ``[MIN_RING_RECORD, MAX_RING_RECORD]`` and both rings fit in
    ``MAX_RING_BYTES``. The one rule: kvd refuses an :class:`OpenRing` outside it and the
    engine's client refuses to be made with one."""
    if not MIN_RING_RECORD <= record_bytes <= MAX_RING_RECORD or \
            not 1 <= capacity <= MAX_RING_CAPACITY:
        raise ValueError(f"a ring has 1..{MAX_RING_CAPACITY} records of "
                         f"{MIN_RING_RECORD}..{MAX_RING_RECORD} bytes, asked {capacity} "
                         f"of {record_bytes}")
    size = 2 * ring_bytes(capacity, record_bytes)
    if size > MAX_RING_BYTES:
        raise ValueError(f"two rings of {capacity} x {record_bytes} bytes take {size} "
                         f"bytes, at most {MAX_RING_BYTES}")
    return size


class OpenRing(msgspec.Struct, tag="open_ring", frozen=True):
    """The engine asks for a submission ring and a completion ring (issue 21 step B,
    :mod:`kvd.protocol.ring`) of ``capacity`` records of ``record_bytes`` bytes each,
    after its registration, on the connection that registered. Answered with
    :class:`RingResult`; the rings' memfd (submission ring at offset 0, completion ring
    right after it), kvd's eventfd (write it to wake kvd) and the engine's (kvd writes it
    to wake the engine) ride with the reply, in that order (``SCM_RIGHTS``). Refused
    (``RpcError``) with ``engine_channel`` off, on a connection that did not register the
    engine, or a second time for one registration (a registration on the connection
    closes its ring: the engine asks again); ``ProtocolError`` for sizes out of the
    bounds above.

    A submission record's payload is a :class:`Request` frame (:mod:`kvd.protocol.codec`,
    without the length prefix) whose ``id`` is the record's seq and whose call is one of
    :data:`RingCall`; kvd answers a refused call with a :class:`Reply` frame of that ``id``
    in the completion ring, and publishes the submission ring's ``tail`` past a record
    only once its call ran (and its refusal, if any, is in the completion ring). A record
    that depends on an earlier one (its ``after``, :mod:`kvd.protocol.ring`) is run only
    if that call was not refused, else refused with that refusal's kind."""

    capacity: int = 256
    record_bytes: int = 4096


class RingResult(msgspec.Struct, frozen=True):
    """Answer to :class:`OpenRing`: the sizes kvd laid out and the memfd's size (bytes)."""

    capacity: int
    record_bytes: int
    size: int


class Release(msgspec.Struct, tag="release", frozen=True):
    """The engine is leaving on purpose (``KvdClient.close``): fail its rooms and release
    its memory now, without the reconnect grace a dropped connection gets."""


#: The calls a :class:`Many` may carry: those kvd answers at once, without waiting.
NowCall: TypeAlias = (SenderCreate | SenderInit | SenderSend | SenderSendLayers
                      | ReceiverCreate | ReceiverInit | Poll | Abort | Clear)

#: The calls a submission ring carries (:class:`OpenRing`): the engine's calls on one room.
RingCall: TypeAlias = (SenderCreate | SenderInit | SenderSend | SenderSendLayers
                       | ReceiverCreate | ReceiverInit | Abort | Clear)

#: Most calls in one :class:`Many`.
MAX_MANY = 4096
#: Most rooms the ``Poll`` calls of one :class:`Many` name together. A Poll answers each
#: failed room's reason once, so the same rooms polled in every call of a Many would make
#: an answer thousands of times bigger than its request (and than any one Poll's);
#: bounded so, a Many's answer is no bigger than one Poll of this many rooms.
MAX_MANY_POLLED = 1 << 16


class Many(msgspec.Struct, tag="many", frozen=True):
    """Several engine calls in ONE round trip, run in order exactly as if sent one by
    one (issue 14: round trips per room). Only :data:`NowCall` calls (no ``Wait``,
    registration, ``Info`` or nested ``Many``), at most :data:`MAX_MANY`, naming at most
    :data:`MAX_MANY_POLLED` rooms in their polls; each call has its own :class:`Outcome`,
    so one room's refusal does not affect the others. Answered with :class:`ManyResult`."""

    calls: list[NowCall]

    def polled(self) -> int:
        """How many rooms its ``Poll`` calls name together."""
        return sum(len(c.rooms) for c in self.calls if isinstance(c, Poll))


class Outcome(msgspec.Struct, frozen=True):
    """One call's answer inside a :class:`ManyResult`: as :class:`Reply` without an id."""

    ok: bool
    result: Any = None
    error: str = ""
    kind: str = ""


class ManyResult(msgspec.Struct, frozen=True):
    """``outcomes[i]`` answers ``Many.calls[i]``."""

    outcomes: list[Outcome]


Call: TypeAlias = (RegisterKV | SenderCreate | SenderInit | SenderSend | SenderSendLayers
                   | ReceiverCreate | ReceiverInit | Poll | Wait | Abort | Clear | Info
                   | Release | Many | OpenTable | OpenRing)


class Request(msgspec.Struct, frozen=True):
    id: int
    call: Call


class PollResult(msgspec.Struct, frozen=True):
    """Answer to :class:`Poll` and :class:`Wait`.

    ``statuses[i]`` is the KVPoll value of ``rooms[i]`` (``UNKNOWN_ROOM`` = -1 for a
    room kvd does not know); ``reasons``/``kinds`` (a FailureKind value) only for
    Failed rooms; ``releasable`` lists the rooms whose pages the engine may reuse
    (every room on prefill; on decode only once no prefill write can land);
    ``stats`` maps a finished prefill room to ``(bytes moved, seconds in writes)``.
    """

    statuses: list[int]
    reasons: dict[int, str] = {}
    kinds: dict[int, str] = {}
    releasable: list[int] = []
    stats: dict[int, tuple[int, float]] = {}


class RegisterResult(msgspec.Struct, frozen=True):
    """Answer to :class:`RegisterKV`: pages and aux slots every buffer holds, this kvd's
    transfer address (opaque) and its ``instance_id`` (a new one at every start: a client
    that registered again and finds another one knows its earlier rooms are gone, K27;
    ``""`` from an older kvd)."""

    num_pages: int
    num_aux_slots: int
    session_id: str
    instance_id: str = ""


class Reply(msgspec.Struct, frozen=True):
    id: int
    ok: bool
    result: Any = None
    error: str = ""
    kind: str = ""


class RawReply(msgspec.Struct, frozen=True):
    """A :class:`Reply` whose result is left undecoded (the client decodes it into the
    call's typed result directly, without an intermediate ``Any`` tree)."""

    id: int
    ok: bool
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil
    error: str = ""
    kind: str = ""


_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_raw_reply_decoder = msgspec.msgpack.Decoder(RawReply)


def encode(msg: Request | Reply) -> bytes:
    """Length-prefixed versioned frame for a stream socket."""
    frame = codec.encode(msg)
    return LENGTH.pack(len(frame)) + frame


def decode_request(frame: bytes, max_frame: int = codec.DEFAULT_MAX_FRAME) -> Request:
    """Parse one request frame (without its length prefix); raises ProtocolError."""
    return codec.decode(frame, _request_decoder, max_frame)


def decode_reply(frame: bytes, max_frame: int = codec.DEFAULT_MAX_FRAME) -> Reply:
    """Parse one reply frame (without its length prefix); raises ProtocolError."""
    return codec.decode(frame, _reply_decoder, max_frame)


def decode_raw_reply(frame: bytes, max_frame: int = codec.DEFAULT_MAX_FRAME) -> RawReply:
    """Parse one reply frame leaving ``result`` raw; raises ProtocolError."""
    return codec.decode(frame, _raw_reply_decoder, max_frame)


def number_fds(call: Call) -> tuple[Call, list[int]]:
    """Engine side: ``call`` with every :class:`FdHandle`'s descriptor NUMBER replaced by
    its position in the returned list of distinct descriptors, to send with ``SCM_RIGHTS``.
    Calls without fd handles come back unchanged with ``[]``."""
    if not isinstance(call, RegisterKV):
        return call, []
    fds: list[int] = []

    def renumber(hs: list[MemoryHandle]) -> list[MemoryHandle]:
        out: list[MemoryHandle] = []
        for h in hs:
            if isinstance(h, FdHandle):
                if h.fd not in fds:
                    fds.append(h.fd)
                h = msgspec.structs.replace(h, fd=fds.index(h.fd))
            out.append(h)
        return out

    kv, aux = renumber(call.kv_buffers), renumber(call.aux_buffers)
    state, groups = renumber(call.state_buffers), renumber(call.group_buffers)
    if not fds:
        return call, []
    return msgspec.structs.replace(call, kv_buffers=kv, aux_buffers=aux,
                                   state_buffers=state, group_buffers=groups), fds


def check_fd_indices(call: Call, received: int) -> None:
    """Daemon side: raise :class:`ProtocolError` unless every :class:`FdHandle` of ``call``
    names one of the ``received`` descriptors that came with it."""
    if not isinstance(call, RegisterKV):
        return
    for h in (*call.kv_buffers, *call.aux_buffers, *call.state_buffers, *call.group_buffers):
        if isinstance(h, FdHandle) and not 0 <= h.fd < received:
            raise ProtocolError(f"fd handle names descriptor #{h.fd} but the request carried "
                                f"{received} (send them with SCM_RIGHTS: KvdClient does)")


#: The errors an engine call can raise, by the name on the wire: the one table both ends
#: use. Anything else crosses as :class:`~kvd.errors.RpcError` naming its class.
ERRORS: dict[str, type[errors.KvdError]] = {cls.__name__: cls for cls in (
    errors.ConfigError, errors.ProtocolError, errors.AuthError, errors.LayoutError,
    errors.IndexLengthMismatch, errors.BoundsError, errors.RegistrationError,
    errors.HandleError, errors.CudaUnavailable, errors.RoomError, errors.BootstrapError)}


def error_kind(exc: BaseException) -> str:
    """The wire name of ``exc``: its nearest class in :data:`ERRORS`, else its own name
    (which the client turns into an RpcError)."""
    return next((c.__name__ for c in type(exc).__mro__ if c.__name__ in ERRORS),
                type(exc).__name__)


def failure(exc: BaseException) -> tuple[str, str]:
    """``(kind, message)`` of a failed call's reply: the error table's name and the
    message for a kvd error, ``InternalError`` for anything else (the caller logs it)."""
    if isinstance(exc, errors.KvdError):
        return error_kind(exc), str(exc)
    return "InternalError", f"internal error: {exc}"


def error_from(kind: str, message: str) -> errors.KvdError:
    """The exception an engine sees for a failed reply."""
    cls = ERRORS.get(kind)
    return cls(message) if cls is not None else errors.RpcError(message, kind)


_U64_MAX = (1 << 64) - 1


def _int_bounds(cls: type) -> tuple[tuple[str, int, int], ...]:
    """``(field, lowest, highest)`` of each integer field of ``cls`` (an int that may be
    None included), from its annotations: :data:`RoomId`, :data:`I64`, or any int
    msgpack carries."""
    out = []
    for field in msgspec.inspect.type_info(cls).fields:  # type: ignore[attr-defined]
        kind = field.type
        if isinstance(kind, msgspec.inspect.UnionType):
            kind = next((t for t in kind.types if isinstance(t, msgspec.inspect.IntType)),
                        None)
        if isinstance(kind, msgspec.inspect.IntType):
            out.append((field.name, -(1 << 63) if kind.ge is None else kind.ge,
                        _U64_MAX if kind.le is None else kind.le))
    return tuple(out)


_RING_BOUNDS: dict[type, tuple[tuple[str, int, int], ...]] = {
    cls: _int_bounds(cls) for cls in typing.get_args(RingCall)}


def check_bounds(call: object) -> None:
    """ValueError naming the field unless every integer field of the room call ``call``
    holds an int within its wire bounds (:data:`RoomId`, :data:`I64`); other calls
    pass. The engine's
    client checks each room call before it sends it, whichever way: in a submission
    ring a record kvd cannot decode fails the whole channel and aborts every room it
    carried (:mod:`kvd.engine_rpc.ring`), over the socket kvd would answer a
    ProtocolError; either way nothing is sent and the caller gets the same error."""
    for name, lo, hi in _RING_BOUNDS.get(type(call), ()):
        value = getattr(call, name)
        if value is not None and not (isinstance(value, int) and lo <= value <= hi):
            raise ValueError(f"{type(call).__name__}.{name} must be an integer in "
                             f"[{lo}, {hi}], got {value}")
