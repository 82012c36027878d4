"""kvd <-> kvd control messages (ZMQ). PURE.

Flow for room R (equal names to SGLang's connector where they exist):
decode kvd -> prefill kvd: :class:`RegisterRank` once per (decode rank,
prefill rank), then :class:`RoomPages` per room and :class:`RoomAbort` when the
decode ends a room; prefill kvd -> decode kvd: :class:`RoomStatus` when the room
ends (and again, quiesced, once a write in flight returned). Messages queued for one
peer travel together in a :class:`Batch` frame. Either side answers an authentic frame it
will not act on with a :class:`Refused` (sealed for a previous instance of it, or sealed
outside its freshness window), so the sender learns at once instead of timing out.

Bounds (case S19): every field has a bound (:data:`MAX_ROOM_PAGES`, :data:`MAX_BUFFERS`,
:data:`MAX_AUX_BUFFERS`, :data:`MAX_AUX_ITEM`, :data:`MAX_TEXT`, :data:`MAX_NAME`),
checked when a frame is decoded; :func:`max_frame` is the largest frame a real message
can need, derived from them, and the control socket refuses anything larger before it
is read (ZMQ ``MAXMSGSIZE``). A reason is cut to the one reason bound,
:data:`kvd.text.MAX_REASON_BYTES`, when encoded (:func:`clipped`).
"""

from __future__ import annotations

import functools
from typing import Annotated, Literal, TypeAlias

import msgspec

from kvd.errors import ProtocolError
from kvd.protocol import codec
from kvd.protocol.bounds import I64, I64_MAX, Address, Count, RoomId, Size
from kvd.protocol.memory import CUDA_IPC_HANDLE_BYTES, CudaIpcHandle, ExportedBuffer, ExportedPool
from kvd.text import MAX_REASON_BYTES, bound, clean

#: Most pages one RoomPages may name (a 1M-page room: 1M tokens at page size 1).
MAX_ROOM_PAGES = 1 << 20
#: Most KV (or aux) buffers a rank registers (MHA: 2 per layer).
MAX_BUFFERS = 4096
#: Most aux buffers, and bytes of one aux slot of one buffer, a RoomStatus carries
#: (``aux_transport = "control"``; SGLang's largest aux item is a hidden state).
MAX_AUX_BUFFERS = 32
MAX_AUX_ITEM = 128 << 10
#: Longest reason text on the wire (characters). The one bound is
#: :data:`kvd.text.MAX_REASON_BYTES` (UTF-8 bytes): a sender cuts a reason to it with
#: :func:`kvd.text.bound`, so it is at most that many characters too; a receiver refuses
#: longer (malformed) and cleans what it takes with :func:`kvd.text.clean`.
MAX_TEXT = MAX_REASON_BYTES
#: Longest name: endpoints, instance ids, transfer sessions, failure kinds.
MAX_NAME = 256
#: Most named aux fields a rank declares, and the longest ``Compat.aux_layout`` (characters).
MAX_AUX_FIELDS = 32
MAX_AUX_LAYOUT = 4096

Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
#: A kvd's instance id as a peer names itself: ``Settings.instance_id``'s alphabet and
#: length (empty: unknown). Anything else is a malformed frame (S21: no text from a peer
#: reaches a log or a report unchecked).
InstanceId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._-]{0,64}$")]
#: A ZMQ endpoint (``tcp://host:port``, ``tcp://[v6]:port``): printable ASCII, no space,
#: at most MAX_NAME characters.
Endpoint = Annotated[str, msgspec.Meta(pattern=r"^[!-~]{0,256}$")]

#: Integer bounds on the wire: one definition, :mod:`kvd.protocol.bounds` (re-exported here,
#: where the engine RPC and older code import them). Before, a peer's
#: ``RoomPages(room=-1)`` reached the room machines and the status table, and an index of
#: ``2**63`` the numpy arrays, and failed there (OverflowError, "internal error").

#: A parallel rank (``[0, size)``, checked against the size where the pair is planned)
#: and a parallel size (at least 1); the engine's ranks have no bound of their own
#: (``Settings.attn_tp_size``), so int64 is the ceiling.
Rank = Count
#: A room status a prefill reports: a :class:`~kvd.rooms.state.KVPoll` value (0..4).
StatusCode = Annotated[int, msgspec.Meta(ge=0, le=4)]
Ints = Annotated[list[Count], msgspec.Meta(max_length=MAX_BUFFERS)]
Addresses = Annotated[list[Address], msgspec.Meta(max_length=MAX_BUFFERS)]


class Compat(msgspec.Struct, frozen=True):
    """A rank's compatibility fingerprint (issue 22 item 5; like vLLM's compat hash):
    what must be equal on both ends of a pair for the bytes moved to mean the same thing.

    Set by the engine (``RegisterKV.compat``; ``""``: the engine does not say): ``model_id``
    (model name or checkpoint hash), ``kv_dtype`` (e.g. ``"bfloat16"``, ``"fp8_e4m3"``),
    ``scale_layout`` (KV quantisation scales: ``"none"``, ``"per_tensor"``, ...),
    ``layer_types`` (one letter per layer, e.g. ``"AAAL"``: full attention, linear),
    ``spec_config`` (speculative decoding: draft model and depth, ``""`` none). Set by the
    daemon: ``wire_version`` (:data:`kvd.protocol.codec.VERSION`), ``page_size``
    (tokens per page) and ``aux_layout`` (the aux item lengths and the engine's named aux
    fields, :class:`AuxField`, one canonical string; ``""`` when it names none).
    ``page_size`` is informational, not in the fingerprint: pairs may differ in it (and in
    TP), and the planner checks those (:mod:`kvd.transfer.compat`).
    """

    model_id: Name = ""
    kv_dtype: Name = ""
    scale_layout: Name = ""
    layer_types: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    spec_config: Name = ""
    wire_version: Count = 0
    page_size: Count = 0
    aux_layout: Annotated[str, msgspec.Meta(max_length=MAX_AUX_LAYOUT)] = ""


class AuxField(msgspec.Struct, frozen=True):
    """A named field of every aux slot (typed aux, issue 22 item 2): bytes ``[offset, offset
    + nbytes)`` of one slot of aux buffer ``buffer`` hold ``name`` (e.g. ``"hidden"``, the
    last token's hidden state for a draft model; ``"ids"``, the output token ids) as
    ``dtype`` elements. The daemon checks each field lies inside its buffer's item and that
    fields do not overlap, and folds them into the fingerprint (``Compat.aux_layout``), so a
    pair whose aux slots mean different things is refused at pairing."""

    name: Annotated[str, msgspec.Meta(max_length=32)]
    dtype: Annotated[str, msgspec.Meta(max_length=32)]
    offset: Count
    nbytes: Count
    buffer: Count = 0
#: Most state buffers (per-request state slots) a rank registers, and most layers a model
#: names in ``StateSpec.layer_types``.
MAX_STATE_BUFFERS = 1024
MAX_LAYERS = 4096
#: Most buffers of a window pool (K and V of 512 sliding-window layers).
MAX_WINDOW_BUFFERS = 1024
#: Most window pages a RoomPages names (a 128k-token window at page size 1).
MAX_WINDOW_PAGES = 1 << 17


#: A layer's type in ``StateSpec.layer_types``; a state buffer's kind and dtype names.
LayerType = Literal["full", "window", "state"]
ShortName = Annotated[str, msgspec.Meta(max_length=32)]


class StateBufSpec(msgspec.Struct, frozen=True):
    """One state buffer's shape (:class:`~kvd.transfer.state.StateBuffer` less its memory):
    absolute ``layer``, ``kind`` (``"conv"``, ``"ssm"``, a conv section: pairs buffers
    across ranks), ``slot_bytes`` (bytes of one slot on this rank, ``heads * head bytes``),
    ``dtype`` (element type name, compared only), ``heads`` held by this rank and
    ``total_heads`` of the model (split over attention TP like KV heads)."""

    layer: Count
    kind: ShortName
    slot_bytes: Count
    dtype: ShortName
    heads: Count
    total_heads: Count


class WindowSpec(msgspec.Struct, frozen=True):
    """A window (sliding-window attention) pool: paged like KV (K buffers of its layers, then
    V), ``item_lens`` bytes per page of each, layers numbered in the window layers' own
    index space from ``layer_start``; page size is the rank's ``page_size``."""

    item_lens: Annotated[list[Count], msgspec.Meta(max_length=MAX_WINDOW_BUFFERS)]
    num_layers: Count
    num_kv_heads: Count
    head_dim: Count
    dtype_size: Count
    layer_start: Count = 0
    total_kv_heads: Count = 0
    layout: Name = "NHD"


class StateSpec(msgspec.Struct, frozen=True):
    """What a hybrid rank keeps besides paged KV: ``layer_types`` (one of ``full``,
    ``window``, ``state`` per model layer), its ``buffers`` (state slots of its stage's
    state layers, in the order of their memory) and, with window layers, the ``window``
    pool and ``window_tokens`` (tokens a window layer attends to). Memory is listed after
    it: the state buffers, then the window pool's buffers. Layers are absolute model layers
    (``layer_types`` lists all of them; the paged KV's layers are the ``full`` ones, numbered
    in their own index space, the window pool's the ``window`` ones)."""

    layer_types: Annotated[list[LayerType], msgspec.Meta(max_length=MAX_LAYERS)]
    buffers: Annotated[list[StateBufSpec], msgspec.Meta(max_length=MAX_STATE_BUFFERS)]
    window: WindowSpec | None = None
    window_tokens: Count = 0
    stage_start: Count = 0        # this PP stage's model layers [stage_start, stage_end)
    stage_end: I64 = -1         # -1: to the model's last layer


class StateWire(msgspec.Struct, frozen=True):
    """A rank's :class:`StateSpec` with its memory as peers see it: ``ptrs``/``lens`` (u64
    addresses and byte lengths) of the state buffers, then of the window buffers."""

    spec: StateSpec
    ptrs: Annotated[list[Address], msgspec.Meta(max_length=MAX_STATE_BUFFERS + MAX_WINDOW_BUFFERS)]
    lens: Annotated[list[Count], msgspec.Meta(max_length=MAX_STATE_BUFFERS + MAX_WINDOW_BUFFERS)]


#: Most extra paged cache groups a rank registers, and most buffers of one group.
MAX_GROUPS = 4
MAX_GROUP_BUFFERS = 1024


class GroupSpec(msgspec.Struct, frozen=True):
    """An extra paged cache beside the main KV (issue 22 items 1 and 2): a draft model's KV,
    an indexer's K cache. Its pages are the room's main KV pages (the same page indices and
    tokens per page, as SGLang shares the target's page table with the draft), each buffer
    with its own bytes per page (``item_lens``). ``name`` pairs groups across ranks
    (``"draft"``, ``"indexer"``). Layers are the group's own, numbered from 0 in the group
    (``layer_start``: this PP stage's first). ``replicated``: every TP rank holds the whole
    cache (one buffer per layer, MLA-like: a DeepSeek draft layer's latent KV, an indexer K
    cache); otherwise K buffers of its layers then V (or one per layer with ``fused_kv``),
    ``num_kv_heads`` of ``total_kv_heads`` split over attention TP like the main KV."""

    name: Annotated[str, msgspec.Meta(max_length=32)]
    item_lens: Annotated[list[Count], msgspec.Meta(max_length=MAX_GROUP_BUFFERS)]
    num_layers: Count
    num_kv_heads: Count
    head_dim: Count
    dtype_size: Count
    layer_start: Count = 0
    total_kv_heads: Count = 0
    replicated: bool = False
    fused_kv: bool = False
    layout: Name = "NHD"


class GroupWire(msgspec.Struct, frozen=True):
    """A rank's :class:`GroupSpec` with its memory as peers see it: ``ptrs``/``lens`` (u64
    addresses and byte lengths), one per buffer of the group."""

    spec: GroupSpec
    ptrs: Annotated[list[Address], msgspec.Meta(max_length=MAX_GROUP_BUFFERS)]
    lens: Annotated[list[Count], msgspec.Meta(max_length=MAX_GROUP_BUFFERS)]


class KVArgsWire(msgspec.Struct, frozen=True):
    """A rank's KV args as its peers see them.

    ``kv_data_ptrs``/``kv_data_lens`` list K buffers of every layer then V
    buffers (MHA), or one buffer per layer (MLA, and MHA with ``fused_kv``: each token
    slot of a head holds its K then its V, ``[..][2 * head_dim]``, as vLLM's CPU cache
    ``[page][head][token][2 * head_dim]``); addresses are in the owning
    daemon's address space (u64), lengths and ``kv_item_lens`` in bytes
    (``kv_item_lens[i]`` = bytes of one page of buffer i). Aux buffers alike.
    """

    session_id: Name
    kv_data_ptrs: Addresses
    kv_data_lens: Ints
    kv_item_lens: Ints
    aux_data_ptrs: Addresses
    aux_data_lens: Ints
    aux_item_lens: Ints
    page_size: Count
    num_kv_heads: Count
    head_dim: Count
    dtype_size: Count
    num_layers: Count
    layer_start: Count = 0
    is_mla: bool = False
    layout: Name = "NHD"
    total_kv_heads: Count = 0     # KV heads of the model; 0: num_kv_heads * attn_tp_size
    fused_kv: bool = False      # MHA, one buffer per layer: a head's K and V side by side
    compat: Compat | None = None  # the fingerprint (None: a peer that sends none)
    state: StateWire | None = None  # hybrid models: state slots and window pool
    # extra paged caches (draft KV, indexer K): indexed by the room's KV pages (version 7)
    groups: Annotated[list[GroupWire], msgspec.Meta(max_length=MAX_GROUPS)] = []


class RegisterRank(msgspec.Struct, tag="register_rank", frozen=True):
    """Decode rank registers its KV args with one prefill rank (once per peer)."""

    instance_id: InstanceId
    endpoint: Endpoint            # decode kvd's ZMQ endpoint, where RoomStatus goes
    attn_tp_rank: Rank
    attn_tp_size: Size
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

    room: RoomId
    inc: Count
    endpoint: Endpoint
    instance_id: InstanceId
    dst_pages: Annotated[bytes, msgspec.Meta(max_length=4 * MAX_ROOM_PAGES)]
    aux_index: I64
    write_within: float
    required_dst_info_num: Count = 1
    is_dummy: bool = False
    first_page: Count = 0
    state_index: I64 = -1       # the room's state slot on this decode rank (-1: none)
    window_pages: Annotated[bytes, msgspec.Meta(max_length=4 * MAX_WINDOW_PAGES)] = b""


class RoomStatus(msgspec.Struct, tag="room_status", frozen=True):
    """Prefill rank reports the final status of room R incarnation ``inc`` to one
    decode rank.

    ``quiesced`` is True when no write for R is in flight on the prefill rank
    any more: only then may the decode engine reuse R's pages. A Failed status
    may be sent first with ``quiesced=False`` (fast failure) and again with
    ``quiesced=True`` once the in-flight write returned. ``kind`` is a
    :class:`~kvd.rooms.state.FailureKind` value (Failed only).
    """

    room: RoomId
    inc: Count
    status: StatusCode
    kind: Name
    reason: Text
    endpoint: Endpoint            # the reporting prefill kvd's ZMQ endpoint
    instance_id: InstanceId
    quiesced: bool = True
    # aux_transport = "control": the aux slot's bytes, per buffer
    aux: Annotated[list[Annotated[bytes, msgspec.Meta(max_length=MAX_AUX_ITEM)]],
                   msgspec.Meta(max_length=MAX_AUX_BUFFERS)] = []

    def __post_init__(self) -> None:  # a peer's text, escaped and bounded on entry (S21)
        msgspec.structs.force_setattr(self, "reason", clean(self.reason))


class RoomAbort(msgspec.Struct, tag="room_abort", frozen=True):
    """A decode rank ends room R incarnation ``inc`` (0: whatever incarnation the
    prefill rank holds or will hold — the decode does not know it, e.g. after a
    restart). The prefill rank stops the room, answers with a quiesced
    :class:`RoomStatus`, and remembers an abort for a room it has not created yet.
    """

    room: RoomId
    inc: Count
    kind: Name
    reason: Text
    endpoint: Endpoint
    instance_id: InstanceId

    def __post_init__(self) -> None:  # a peer's text, escaped and bounded on entry (S21)
        msgspec.structs.force_setattr(self, "reason", clean(self.reason))


#: Why a daemon refused an authentic frame (:class:`Refused`).
RefusedWhy: TypeAlias = Literal["instance", "clock_skew", "unregistered", "full"]


class Refused(msgspec.Struct, tag="refused", frozen=True, omit_defaults=True):
    """This daemon (``endpoint``, now instance ``instance_id``) did not act on an authentic
    frame from the recipient (wire version 5):

    * ``instance``: it was sealed for a previous instance of this daemon (a restart since
      the sender looked it up, case S09): the sender re-resolves this peer at once;
    * ``clock_skew``: it was sealed outside this daemon's freshness window (``window_s``,
      s): the sender's clock minus this daemon's was ``offset_s`` seconds (case K40);
    * ``unregistered`` (prefill to decode): a room message from a decode rank this prefill
      does not hold a registration of (never registered, forgotten after ``peer_ttl``, or
      registered as another instance, S08/S13): the decode registers again and sends the
      pages of its rooms bound to this instance again;
    * ``full`` (prefill to decode): a registration dropped because this prefill holds
      ``max_peers`` decode ranks: the decode fails the rooms bound to this instance now
      (kind ``registration``) instead of waiting for their deadline.

    Every dropped authentic message is answered (rate-limited), so no room waits for a
    deadline because a message was dropped in silence (K16's kind).

    A refusal is sealed at the refused frame's own time (the sender's clock), is never
    larger than the frame it answers, is rate-limited per peer, and is never answered.
    """

    why: RefusedWhy
    endpoint: Endpoint
    instance_id: InstanceId
    offset_s: float = 0.0
    window_s: float = 0.0


ControlMessage: TypeAlias = RegisterRank | RoomPages | RoomStatus | RoomAbort | Refused

#: Most messages one :class:`Batch` may carry (a longer one is malformed).
MAX_BATCH = 256


class Batch(msgspec.Struct, tag="batch", frozen=True):
    """Several messages to one peer in one frame, in the order they were queued (wire
    version 4). A batch never nests and carries at most :data:`MAX_BATCH` messages."""

    messages: list[ControlMessage]


Frame: TypeAlias = ControlMessage | Batch

_decoder: msgspec.msgpack.Decoder[Frame] = msgspec.msgpack.Decoder(Frame)


def clipped(msg: ControlMessage) -> ControlMessage:
    """``msg`` with its reason cut by :func:`kvd.text.bound` to
    :data:`~kvd.text.MAX_REASON_BYTES` bytes of UTF-8, the cut said (a peer refuses a
    reason past :data:`MAX_TEXT` characters as malformed). Other messages unchanged."""
    if isinstance(msg, RoomStatus | RoomAbort):
        reason = bound(msg.reason)
        if reason is not msg.reason:
            return msgspec.structs.replace(msg, reason=reason)
    return msg


def encode(msg: ControlMessage | Batch) -> bytes:
    """One versioned frame for ``msg`` (a message or a :class:`Batch`)."""
    if isinstance(msg, Batch):
        return codec.encode(Batch(messages=[clipped(m) for m in msg.messages]))
    return codec.encode(clipped(msg))


def encode_many(msgs: list[ControlMessage]) -> bytes:
    """One frame for ``msgs``: the message itself when there is one, else a Batch."""
    if len(msgs) == 1:
        return encode(msgs[0])
    return encode(Batch(messages=msgs))


@functools.cache
def max_frame() -> int:
    """The largest control frame a real message needs (bytes, without the seal; about
    6.6 MiB: a RegisterRank with every state and group field at its bound and an exported
    pool, for the same-host ``local`` backend, of 2 x :data:`MAX_BUFFERS` +
    :data:`MAX_STATE_BUFFERS` + :data:`MAX_WINDOW_BUFFERS` + :data:`MAX_GROUPS` x
    :data:`MAX_GROUP_BUFFERS` buffers -- KV and aux, state, window, groups; a RoomPages of
    :data:`MAX_ROOM_PAGES` pages and :data:`MAX_WINDOW_PAGES` window pages is 4.5 MiB):
    each message type encoded with every field at its bound. The control socket's ``MAXMSGSIZE`` is
    this plus the seal, and a Batch is split below it (S19). Computed once (~20 ms)."""
    name, text = "n" * MAX_NAME, "t" * MAX_TEXT
    # addresses at the u64 bound, lengths at int64's: 9 bytes of msgpack either way
    ptrs, ints = [2**64 - 1] * MAX_BUFFERS, [I64_MAX] * MAX_BUFFERS
    big, short = 2**31, "s" * 32
    n_st = MAX_STATE_BUFFERS + MAX_WINDOW_BUFFERS
    state = StateWire(StateSpec(["window"] * MAX_LAYERS,
                                [StateBufSpec(big, short, big, short, big, big)] *
                                MAX_STATE_BUFFERS,
                                WindowSpec(ints[:MAX_WINDOW_BUFFERS], big, big, big, big, big,
                                           big, name), big, big, big),
                      [2**64 - 1] * n_st, [I64_MAX] * n_st)
    compat = Compat(name, name, name, "A" * MAX_LAYERS, name, big, big, "a" * MAX_AUX_LAYOUT)
    groups = [GroupWire(GroupSpec(short, ints[:MAX_GROUP_BUFFERS], big, big, big, big, big, big,
                                  True, True, name),
                        ptrs[:MAX_GROUP_BUFFERS], ints[:MAX_GROUP_BUFFERS])] * MAX_GROUPS
    args = KVArgsWire(name, ptrs, ints, ints, ptrs, ints, ints, big, big, big, big,
                      big, big, True, name, big, True, compat=compat, state=state,
                      groups=groups)
    handle = CudaIpcHandle(b"h" * CUDA_IPC_HANDLE_BYTES, I64_MAX, I64_MAX, name, 2**31)
    pool = ExportedPool(name, [ExportedBuffer(2**64 - 1, I64_MAX, handle)] * (
        2 * MAX_BUFFERS + MAX_STATE_BUFFERS + MAX_WINDOW_BUFFERS
        + MAX_GROUPS * MAX_GROUP_BUFFERS))
    worst: list[ControlMessage] = [
        RegisterRank(name, name, 2**31, 2**31, args, pool),
        RoomPages(2**64 - 1, I64_MAX, name, name, b"\xff" * (4 * MAX_ROOM_PAGES), 2**31, 1e300,
                  2**31, True, 2**31, 2**31, b"\xff" * (4 * MAX_WINDOW_PAGES)),
        RoomStatus(2**64 - 1, I64_MAX, 4, name, text, name, name, True,
                   [b"a" * MAX_AUX_ITEM] * MAX_AUX_BUFFERS),
        RoomAbort(2**64 - 1, I64_MAX, name, text, name, name),
        Refused("clock_skew", name, name, 1e300, 1e300)]
    return max(len(codec.encode(m)) for m in worst)



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
