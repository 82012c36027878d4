"""kvd <-> kvd control messages (ZMQ). PURE.

Flow for room R (equal names to SGLang's connector where they exist):
decode kvd -> prefill kvd: :class:`RegisterRank` once per (decode rank,
prefill rank), then :class:`RoomPages` per room and :class:`RoomAbort` when the
decode ends a room; prefill kvd -> decode kvd: :class:`RoomStatus` when the room
ends (and again, quiesced, once a write in flight returned). Messages queued for one
peer travel together in a :class:`Batch` frame.
"""

from __future__ import annotations

from typing import Annotated, TypeAlias

import msgspec

from kvd.errors import ProtocolError
from kvd.protocol import codec
from kvd.protocol.memory import ExportedPool
from kvd.text import clean

#: A kvd's instance id as a peer names itself: ``Settings.instance_id``'s alphabet and
#: length (empty: unknown). Anything else is a malformed frame (S21: no text from a peer
#: reaches a log or a report unchecked).
InstanceId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._-]{0,64}$")]
#: A ZMQ endpoint (``tcp://host:port``, ``tcp://[v6]:port``): printable ASCII, no space.
Endpoint = Annotated[str, msgspec.Meta(pattern=r"^[!-~]{0,300}$")]


class KVArgsWire(msgspec.Struct, frozen=True):
    """A rank's KV args as its peers see them.

    ``kv_data_ptrs``/``kv_data_lens`` list K buffers of every layer then V
    buffers (MHA), or one buffer per layer (MLA, and MHA with ``fused_kv``: each token
    slot of a head holds its K then its V, ``[..][2 * head_dim]``, as vLLM's CPU cache
    ``[page][head][token][2 * head_dim]``); addresses are in the owning
    daemon's address space (u64), lengths and ``kv_item_lens`` in bytes
    (``kv_item_lens[i]`` = bytes of one page of buffer i). Aux buffers alike.
    """

    session_id: str
    kv_data_ptrs: list[int]
    kv_data_lens: list[int]
    kv_item_lens: list[int]
    aux_data_ptrs: list[int]
    aux_data_lens: list[int]
    aux_item_lens: list[int]
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype_size: int
    num_layers: int
    layer_start: int = 0
    is_mla: bool = False
    layout: str = "NHD"
    total_kv_heads: int = 0     # KV heads of the model; 0: num_kv_heads * attn_tp_size
    fused_kv: bool = False      # MHA, one buffer per layer: a head's K and V side by side


class RegisterRank(msgspec.Struct, tag="register_rank", frozen=True):
    """Decode rank registers its KV args with one prefill rank (once per peer)."""

    instance_id: InstanceId
    endpoint: Endpoint            # decode kvd's ZMQ endpoint, where RoomStatus goes
    attn_tp_rank: int
    attn_tp_size: int
    kv_args: KVArgsWire
    pool: ExportedPool | None = None  # for a same-host prefill's ``local`` backend


class RoomPages(msgspec.Struct, tag="room_pages", frozen=True):
    """Destination of room R, incarnation ``inc``, on one decode rank.

    ``inc`` is the decode receiver's incarnation: every message about this
    attempt of R carries it, so a late message of an earlier attempt that reused
    the room id is recognised (case K26). ``dst_pages`` is int32 little-endian
    bytes (see :func:`codec.pack_indices`); ``required_dst_info_num`` is how many
    decode ranks will send RoomPages for R to this prefill rank (SGLang's field of
    the same name). ``write_within`` (s, > 0): the prefill rank must not start a
    write for this destination later than this after receiving the message; the
    decode treats the pages as releasable ``release_timeout`` after that bound.
    ``first_page``: the room page that ``dst_pages[0]`` receives; the decode already
    holds the pages before it (decode-side prefix caching), so the prefill rank writes
    only room pages ``[first_page, first_page + len(dst_pages))``.
    """

    room: int
    inc: int
    endpoint: Endpoint
    instance_id: InstanceId
    dst_pages: bytes
    aux_index: int
    write_within: float
    required_dst_info_num: int = 1
    is_dummy: bool = False
    first_page: int = 0


class RoomStatus(msgspec.Struct, tag="room_status", frozen=True):
    """Prefill rank reports the final status of room R incarnation ``inc`` to one
    decode rank.

    ``quiesced`` is True when no write for R is in flight on the prefill rank
    any more: only then may the decode engine reuse R's pages. A Failed status
    may be sent first with ``quiesced=False`` (fast failure) and again with
    ``quiesced=True`` once the in-flight write returned. ``kind`` is a
    :class:`~kvd.rooms.state.FailureKind` value (Failed only).
    """

    room: int
    inc: int
    status: int
    kind: str
    reason: str
    endpoint: Endpoint            # the reporting prefill kvd's ZMQ endpoint
    instance_id: InstanceId
    quiesced: bool = True
    aux: list[bytes] = []       # aux_transport = "control": the aux slot's bytes, per buffer

    def __post_init__(self) -> None:  # a peer's text, escaped and bounded on entry (S21)
        msgspec.structs.force_setattr(self, "reason", clean(self.reason))


class RoomAbort(msgspec.Struct, tag="room_abort", frozen=True):
    """A decode rank ends room R incarnation ``inc`` (0: whatever incarnation the
    prefill rank holds or will hold — the decode does not know it, e.g. after a
    restart). The prefill rank stops the room, answers with a quiesced
    :class:`RoomStatus`, and remembers an abort for a room it has not created yet.
    """

    room: int
    inc: int
    kind: str
    reason: str
    endpoint: Endpoint
    instance_id: InstanceId

    def __post_init__(self) -> None:  # a peer's text, escaped and bounded on entry (S21)
        msgspec.structs.force_setattr(self, "reason", clean(self.reason))


ControlMessage: TypeAlias = RegisterRank | RoomPages | RoomStatus | RoomAbort

#: Most messages one :class:`Batch` may carry (a longer one is malformed).
MAX_BATCH = 256


class Batch(msgspec.Struct, tag="batch", frozen=True):
    """Several messages to one peer in one frame, in the order they were queued (wire
    version 4). A batch never nests and carries at most :data:`MAX_BATCH` messages."""

    messages: list[ControlMessage]


Frame: TypeAlias = ControlMessage | Batch

_decoder: msgspec.msgpack.Decoder[Frame] = msgspec.msgpack.Decoder(Frame)


def encode(msg: ControlMessage | Batch) -> bytes:
    """One versioned frame for ``msg`` (a message or a :class:`Batch`)."""
    return codec.encode(msg)


def encode_many(msgs: list[ControlMessage]) -> bytes:
    """One frame for ``msgs``: the message itself when there is one, else a Batch."""
    if len(msgs) == 1:
        return codec.encode(msgs[0])
    return codec.encode(Batch(messages=msgs))


def decode_many(data: bytes, max_frame: int = codec.DEFAULT_MAX_FRAME) -> list[ControlMessage]:
    """The messages of a control frame (one, or a Batch's, in order); raises
    :class:`~kvd.errors.ProtocolError`."""
    msg = codec.decode(data, _decoder, max_frame)
    if isinstance(msg, Batch):
        if len(msg.messages) > MAX_BATCH:
            raise ProtocolError(f"batch of {len(msg.messages)} messages exceeds {MAX_BATCH}")
        return msg.messages
    return [msg]


def decode(data: bytes, max_frame: int = codec.DEFAULT_MAX_FRAME) -> ControlMessage:
    """Parse a control frame holding ONE message; raises :class:`~kvd.errors.ProtocolError`
    (also for a Batch: use :func:`decode_many`)."""
    msg = codec.decode(data, _decoder, max_frame)
    if isinstance(msg, Batch):
        raise ProtocolError("a batch where one message was expected")
    return msg
