"""What the vLLM connector agrees on with the proxy, with kvd and with itself. PURE.

No vLLM, no torch, no sockets: the connector (:mod:`kvd.adapters.vllm.connector`) feeds
plain values in, so everything here is unit-tested in the main virtualenv.

Transfer params (``kv_transfer_params`` of a request / of a response), following vLLM's
disaggregated proxies (NIXL, Mooncake): the proxy sends the prompt to the prefill engine
with ``max_tokens=1`` and ``{"do_remote_decode": true, "bootstrap_room": R,
"num_samples": n}`` (the room is optional: the prefill connector picks one when absent;
``num_samples``, default 1, is the decode request's ``n``). The prefill response carries
:func:`prefill_reply`::

    {"do_remote_prefill": true, "do_remote_decode": false, "bootstrap_room": R,
     "bootstrap_rooms": [R, R1, ...], "bootstrap_addr": "host:port",
     "remote_block_ids": [...], "remote_engine_id": "...", "prefill_tp_size": N,
     "prefill_dp_rank": D, "num_prompt_tokens": T}

and the proxy forwards it unchanged to the decode engine, whose connector receives the
room's pages from the prefill instance through kvd. ``bootstrap_addr`` is the prefill
instance's kvd bootstrap server (SGLang's ``/route`` API), as SGLang routers pass it.

Release (K45, K46): the proxy also puts a fresh ``release_token`` in the prefill leg's
params; the connector binds its digest (:func:`release_digest_of`) to every room of the
request, so the proxy can end rooms no decode will claim (``POST /v1/rooms/release`` to
``bootstrap_addr``, :mod:`kvd.protocol.release`). The reply does not carry the token.

Samples (K33): a decode request with ``n > 1`` is ``n`` child requests in vLLM, each of
which loads the prompt's KV. Each needs its own room: the prefill sends the same pages
as rooms :func:`sample_rooms` ``(R, n)`` (``R`` first) and lists them in
``bootstrap_rooms``; each decode child claims a different entry of that list, and a child
that finds none left computes its prompt itself. No two requests ever share a room.

Prefix caching on the decode: a decode that already holds the first ``k`` blocks of the
prompt receives only the rest -- its receiver names ``first_page = k`` and the prefill
writes room pages ``k..`` only (kvd's ``RoomPages.first_page``).

KV args (:func:`register_kv`): vLLM's KV cache is one buffer per layer whose page (block)
``b`` is ``block_stride`` bytes at ``base + b * block_stride``. With a layer-compact layout
(``LBHNC``/``LBNHC``, the only ones the CPU backend and the connector accept) a block of
a layer is ONE contiguous byte run; on the CPU backend it is ``[kv_heads][block_size]
[2 * head_dim]`` (``CPUAttentionBackendImpl.forward``: per token slot of a head, its K then
its V). That is kvd's fused-KV MHA layout (``fused_kv``, HND): one buffer per layer, and a
head's slice of a block is one contiguous run, so kvd plans heterogeneous TP between
prefill and decode by head slices, as for any HND pool (decode TP a multiple of prefill
TP or the reverse; GQA replication included). A layer whose block is not shaped like that
(a GPU layout) is registered as whole blocks (``is_mla=True``, one buffer per layer): byte
exact between EQUAL TP sizes only, and kvd refuses other pairs at registration.

KV cache groups (hybrid models, :func:`check_groups`, :func:`room_blocks`): with vLLM's
hybrid KV cache manager a model whose layers keep different caches has several groups,
each with its own block table: full attention, sliding window, Mamba state. vLLM lays the
groups over each other (``KVCacheTensor``: a tensor is shared by one layer of every group,
and a block id belongs to one group at a time; a Mamba layer's conv and SSM state are one
page padded to the attention page size), so the connector registers the distinct tensors
once, as paged KV, and a room's pages are every group's blocks in kind order: a full
group's prompt blocks, a window group's blocks holding the tokens the decode still attends
to, a state group's running-state block. Moving block ``b`` of every tensor moves exactly
the layers of the group that owns ``b``. With a state group the pages are whole blocks
(equal TP only; the per-rank state shapes and the TP size are in the fingerprint) and the
prefill computes all but the last prompt token (:func:`prefill_backoff`): the state then
holds the prompt but its last token, from which the decode, computing that token itself,
continues (vLLM's NIXL connector "backs off" the same token). A group of any other kind
(chunked local attention, cross attention...), or Mamba state with prefix caching (state
checkpoints per block), is refused at registration, naming the group.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvd.protocol.control import Compat
from kvd.protocol.memory import MemoryHandle
from kvd.protocol.release import ReleaseError, check_token, token_digest
from kvd.protocol.rpc import EngineRanks, RegisterKV

ROOM_LIMIT = 2**63
"""Rooms the connector picks are below this (SGLang's routers use 63-bit rooms too)."""

MAX_SAMPLES = 64
"""Most rooms one prefill request sends (``num_samples``: the decode request's ``n``)."""

LAYER_COMPACT_LAYOUTS = ("LBHNC", "LBNHC")


class KvdAdapterError(ValueError):
    """Invalid connector configuration, transfer params or KV cache layout."""


# ---------------------------------------------------------------- configuration

@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` of the kvd connector.

    ``kvd_socket``: the local kvd's engine socket; ``{tp_rank}``, ``{pp_rank}`` and
    ``{rank}`` are replaced per worker (one kvd per engine rank). ``bootstrap_addr``
    (``host:port``, prefill only): the kvd bootstrap server of this prefill instance,
    returned to the proxy. ``rpc_timeout`` (s): bound of one kvd RPC. ``idle_wait`` (s):
    how long an engine step that runs no model blocks in kvd until one of its rooms ends
    (vLLM keeps stepping while a request's blocks wait for kvd; blocking here is what
    keeps such an engine near zero CPU, K36). A request that arrives meanwhile waits at
    most this long. ``shm_dir``: where the CPU KV cache files go (kvd's ``shm_dir``).
    ``kvd_expected_uid``: the uid kvd runs as, when it is not root, the engine's user or
    the owner of the socket's folder (default: ``KVD_EXPECTED_UID``, else derived); the
    client refuses any other server before sending a byte (S17, :mod:`kvd.client.peer`).
    ``batch`` (default true): a worker's room calls of one step go to kvd together
    (through the submission ring, else one ``Many``) and its status reads come from kvd's
    status table (issue 21); false: one RPC per room call and one ``Poll`` per step.
    """

    kvd_socket: str
    bootstrap_addr: str | None = None
    rpc_timeout: float = 30.0
    idle_wait: float = 0.05
    shm_dir: str = "/dev/shm"
    kvd_expected_uid: int | None = None
    batch: bool = True

    @staticmethod
    def from_extra(extra: Mapping[str, Any] | None, is_producer: bool) -> ConnectorConfig:
        """Parse and check ``extra``; KvdAdapterError lists every problem at once."""
        extra = dict(extra or {})
        problems = []
        socket = extra.pop("kvd_socket", None)
        if not isinstance(socket, str) or not socket:
            problems.append("kvd_socket (path of the local kvd's engine socket) is required")
        addr = extra.pop("bootstrap_addr", None)
        if is_producer and not _is_host_port(addr):
            problems.append(f"bootstrap_addr must be 'host:port' on a producer, got {addr!r}")
        numbers = {}
        for key, default in (("rpc_timeout", 30.0), ("idle_wait", 0.05)):
            value = extra.pop(key, default)
            if not isinstance(value, int | float) or value < 0:
                problems.append(f"{key} must be a non-negative number, got {value!r}")
            numbers[key] = float(value) if isinstance(value, int | float) else default
        shm_dir = str(extra.pop("shm_dir", "/dev/shm"))
        uid = extra.pop("kvd_expected_uid", None)
        if uid is not None and (isinstance(uid, bool) or not isinstance(uid, int) or uid < 0):
            problems.append(f"kvd_expected_uid must be a uid (an integer >= 0), got {uid!r}")
            uid = None
        batch = extra.pop("batch", True)
        if not isinstance(batch, bool):
            problems.append(f"batch must be true or false, got {batch!r}")
            batch = True
        if extra:
            problems.append(f"unknown keys {sorted(extra)}")
        if problems:
            raise KvdAdapterError("kv_connector_extra_config: " + "; ".join(problems))
        return ConnectorConfig(str(socket), addr, numbers["rpc_timeout"], numbers["idle_wait"],
                               shm_dir, uid, batch)

    def socket_for(self, tp_rank: int, pp_rank: int = 0, rank: int | None = None) -> str:
        """The socket path of one worker (placeholders filled in)."""
        return self.kvd_socket.format(tp_rank=tp_rank, pp_rank=pp_rank,
                                      rank=tp_rank if rank is None else rank)


def _is_host_port(value: Any) -> bool:
    if not isinstance(value, str) or ":" not in value:
        return False
    host, _, port = value.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


# ---------------------------------------------------------------- transfer params

def pages_for(num_tokens: int, block_size: int) -> int:
    """Blocks holding ``num_tokens`` tokens (ceil division)."""
    if block_size < 1 or num_tokens < 0:
        raise KvdAdapterError(f"bad token count {num_tokens} or block size {block_size}")
    return -(-num_tokens // block_size)


def sample_rooms(room: int, n: int) -> list[int]:
    """The rooms of ``n`` samples of one request whose first room is ``room``: ``room``
    itself, then ``n - 1`` rooms derived by hashing ``(room, i)`` into ``[0, 2**63)`` --
    no arithmetic on ``room``, so nothing overflows 64 bits, and distinct requests' rooms
    collide no more often than random ones. KvdAdapterError for ``n`` outside
    ``[1, MAX_SAMPLES]`` or a room outside ``[0, 2**64)``."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES:
        raise KvdAdapterError(f"num_samples must be an int in [1, {MAX_SAMPLES}], got {n!r}")
    if not 0 <= room < 2**64:
        raise KvdAdapterError(f"room {room} is not a 64-bit unsigned int")
    out = [room]
    for i in range(1, n):
        digest = hashlib.blake2b(room.to_bytes(8, "little") + i.to_bytes(4, "little"),
                                 digest_size=8, person=b"kvd-sample").digest()
        derived = int.from_bytes(digest, "little") % ROOM_LIMIT
        while derived in out:  # astronomically rare; keep the rooms distinct anyway
            derived = (derived + 1) % ROOM_LIMIT
        out.append(derived)
    return out


def room_of(params: Mapping[str, Any]) -> int:
    """The request's room: ``bootstrap_room`` if given (a 64-bit unsigned int), else a
    fresh random 63-bit one. KvdAdapterError for a bad value."""
    room = params.get("bootstrap_room")
    if room is None:
        return secrets.randbelow(ROOM_LIMIT)
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 2**64:
        raise KvdAdapterError(f"bootstrap_room must be a 64-bit unsigned int, got {room!r}")
    return room


def prefill_reply(rooms: list[int], bootstrap_addr: str, block_ids: Iterable[int],
                  engine_id: str, tp_size: int, num_prompt_tokens: int,
                  dp_rank: int = 0) -> dict[str, Any]:
    """Transfer params the prefill engine returns (the proxy forwards them to decode);
    ``rooms``: the request's rooms, one per decode sample (:func:`sample_rooms`)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "bootstrap_room": rooms[0],
            "bootstrap_rooms": list(rooms), "bootstrap_addr": bootstrap_addr,
            "remote_block_ids": [int(b) for b in block_ids], "remote_engine_id": engine_id,
            "prefill_tp_size": tp_size, "prefill_dp_rank": dp_rank,
            "num_prompt_tokens": num_prompt_tokens}


def release_digest_of(params: Mapping[str, Any]) -> bytes:
    """The digest of the request's ``release_token`` (the proxy's, K45/K46), which kvd
    binds to each of the request's rooms; ``b""`` when there is none or it is malformed
    (the rooms then end only by the decode or the bootstrap deadline). The token never
    goes into :func:`prefill_reply`: only its opener and this engine see it."""
    token = params.get("release_token")
    try:
        return token_digest(check_token(token)) if token is not None else b""
    except ReleaseError:
        return b""


def num_samples(params: Mapping[str, Any]) -> int:
    """``num_samples`` of a prefill request's params (default 1); KvdAdapterError if bad."""
    n = params.get("num_samples", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES:
        raise KvdAdapterError(f"num_samples must be an int in [1, {MAX_SAMPLES}], got {n!r}")
    return n


@dataclass(frozen=True)
class RemotePrefill:
    """A decode request's parsed transfer params."""

    room: int
    bootstrap_addr: str
    prefill_tp_size: int
    num_prompt_tokens: int | None
    rooms: tuple[int, ...] = ()   # one per sample, ``room`` first (``bootstrap_rooms``)
    dp_rank: int | None = None    # the prefill's DP rank that holds the KV

    @staticmethod
    def parse(params: Mapping[str, Any]) -> RemotePrefill:
        """KvdAdapterError names every missing or bad field."""
        problems = []
        room = params.get("bootstrap_room")
        if not _is_room(room):
            problems.append(f"bootstrap_room {room!r}")
        rooms = params.get("bootstrap_rooms", [room])
        if not isinstance(rooms, list) or not rooms or not all(_is_room(r) for r in rooms) \
                or rooms[0] != room or len(set(rooms)) != len(rooms):
            problems.append(f"bootstrap_rooms {rooms!r} (distinct rooms, bootstrap_room first)")
        dp = params.get("prefill_dp_rank")
        if dp is not None and (isinstance(dp, bool) or not isinstance(dp, int) or dp < 0):
            problems.append(f"prefill_dp_rank {dp!r}")
        addr = params.get("bootstrap_addr")
        if not _is_host_port(addr):
            problems.append(f"bootstrap_addr {addr!r}")
        tp = params.get("prefill_tp_size", 1)
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            problems.append(f"prefill_tp_size {tp!r}")
        n = params.get("num_prompt_tokens")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            problems.append(f"num_prompt_tokens {n!r}")
        if problems:
            raise KvdAdapterError("invalid kv_transfer_params for a remote prefill: "
                                  + ", ".join(problems))
        return RemotePrefill(int(room), str(addr), int(tp), n,  # type: ignore[arg-type]
                             tuple(int(r) for r in rooms), dp)


def _is_room(room: Any) -> bool:
    return not isinstance(room, bool) and isinstance(room, int) and 0 <= room < 2**64


# ---------------------------------------------------------------- KV cache description

@dataclass(frozen=True)
class LayerCache:
    """One layer's KV cache as vLLM registers it with a connector.

    ``addr``: address of block 0 (bytes); ``num_blocks`` blocks, ``block_stride`` bytes
    apart; ``block_bytes``: bytes of one block's content (``prod(shape[1:]) * itemsize``);
    ``dense``: the block's content is one contiguous run starting at its block address.
    ``layer``: absolute layer index (from the layer name). ``block_shape``: the shape of
    one block (``tensor.shape[1:]``), e.g. ``(kv_heads, block_size, 2 * head_dim)`` on CPU.
    """

    name: str
    layer: int
    addr: int
    num_blocks: int
    block_stride: int
    block_bytes: int
    dense: bool
    block_shape: tuple[int, ...] = ()

    def fused_heads(self, num_kv_heads: int, block_size: int, head_dim: int) -> bool:
        """Is a block ``[kv_heads][block_size][2 * head_dim]`` (a head's K and V per token
        slot side by side, one contiguous run per head: kvd's fused-KV HND layout)?"""
        return self.dense and self.block_shape == (num_kv_heads, block_size, 2 * head_dim)


def check_layer_compact(layers: list[LayerCache]) -> list[str]:
    """Problems that keep kvd from moving whole blocks of ``layers`` byte-exactly."""
    problems = [f"{c.name}: block content is not one contiguous run" for c in layers
                if not c.dense]
    problems += [f"{c.name}: block stride {c.block_stride} != block size {c.block_bytes} "
                 f"bytes (a block-outermost layout interleaves layers; use LBHNC)"
                 for c in layers if c.block_stride != c.block_bytes]
    spans = sorted((c.addr, c.addr + c.num_blocks * c.block_stride, c.name) for c in layers)
    problems += [f"{a[2]} and {b[2]} overlap" for a, b in itertools.pairwise(spans)
                 if b[0] < a[1]]
    sizes = {c.block_bytes for c in layers}
    if len(sizes) > 1:
        problems.append(f"layers differ in block size {sorted(sizes)} (their KV cache "
                        f"groups are not attention groups of one shape)")
    return problems


def register_kv(layers: list[LayerCache], handles: list[MemoryHandle], *, block_size: int,
                num_kv_heads: int, head_dim: int, dtype_size: int,
                total_kv_heads: int, is_mla: bool = False,
                ranks: EngineRanks | None = None, shared: bool = False,
                compat: Compat | None = None) -> RegisterKV:
    """The kvd registration of ``layers`` (sorted by layer; ``handles[i]`` covers
    ``layers[i]``'s ``num_blocks * block_stride`` bytes), one buffer per layer with
    ``item_len = block_stride``: fused-KV MHA (HND, ``num_kv_heads`` of ``total_kv_heads``
    heads on this rank; any TP pair) when every block is shaped like vLLM's CPU cache,
    else whole blocks (``is_mla=True``: equal TP only; see the module docstring). No aux
    buffers (vLLM's decode recomputes the last prompt token, so nothing rides along).
    ``ranks``: the worker's TP/DP/PP position, sent to kvd. ``shared``: ``layers`` are the
    tensors of several KV cache groups laid over each other (one per tensor, named by its
    first layer): buffer ``i`` is registered as layer ``i`` and the layer numbers are not
    checked. ``compat``: the fingerprint fields (:func:`groups_signature` in
    ``layer_types``).

    KvdAdapterError if the layers are not layer-compact or not consecutive layers.
    """
    problems = check_layer_compact(layers)
    indices = [c.layer for c in layers]
    if not indices:
        problems.append("no KV cache layers")
    elif shared:
        indices = list(range(len(layers)))
    elif indices != list(range(indices[0], indices[0] + len(indices))):
        problems.append(f"layers {indices} are not consecutive")
    if problems:
        raise KvdAdapterError("vLLM KV cache layout not supported by kvd: "
                              + "; ".join(problems))
    fused = not is_mla and all(c.fused_heads(num_kv_heads, block_size, head_dim)
                               for c in layers)
    return RegisterKV(kv_buffers=list(handles), kv_item_lens=[c.block_stride for c in layers],
                      aux_buffers=[], aux_item_lens=[], page_size=block_size,
                      num_kv_heads=num_kv_heads, head_dim=head_dim,
                      dtype_size=dtype_size, num_layers=len(layers), layer_start=indices[0],
                      is_mla=not fused, layout="HND",
                      total_kv_heads=total_kv_heads, fused_kv=fused,
                      ranks=ranks, compat=compat)


# ---------------------------------------------------------------- KV cache groups

@dataclass(frozen=True)
class CacheGroup:
    """One of vLLM's KV cache groups as the connector moves it: ``kind`` ``"full"`` (full
    attention: every prompt block moves), ``"window"`` (sliding window: the blocks of the
    tokens the decode still attends to) or ``"state"`` (Mamba / linear-attention state:
    the request's running-state block), ``block_size`` tokens per block, ``window`` tokens
    a window layer attends to (its own token included; window groups only), ``layers``
    (names, for messages). State groups: ``spec_blocks`` speculative scratch blocks vLLM
    appends after the state block, ``state`` the per-rank state shapes, dtypes and TP size
    (fingerprint), ``prefix_cached`` whether vLLM checkpoints the state per block (prefix
    caching, ``mamba_cache_mode`` other than ``"none"``: refused)."""

    kind: str
    block_size: int
    window: int = 0
    layers: tuple[str, ...] = ()
    spec_blocks: int = 0
    state: str = ""
    prefix_cached: bool = False


FULL = CacheGroup("full", 0)
PAGED_KINDS = ("full", "window")
KINDS = (*PAGED_KINDS, "state")


def check_groups(groups: list[CacheGroup], pp_size: int = 1) -> None:
    """Refuse, with one reason, KV cache groups the connector cannot move byte-exactly:
    no group, a kind other than ``full``/``window``/``state`` (the caller names the vLLM
    spec in ``kind``, e.g. ``"a ChunkedLocalAttentionSpec cache"``), a state group with
    prefix caching, paged groups of different block sizes (a state group's block size is
    vLLM's bookkeeping, not a page), only state groups, several groups under pipeline
    parallelism. KvdAdapterError."""
    if not groups:
        raise KvdAdapterError("vLLM has no KV cache group to move")
    for i, g in enumerate(groups):
        names = f", layers {', '.join(g.layers[:3])}{'...' if len(g.layers) > 3 else ''}"
        if g.kind not in KINDS:
            raise KvdAdapterError(
                f"KV cache group {i} holds {g.kind}{names if g.layers else ''}: the kvd "
                f"connector moves full-attention and sliding-window KV and Mamba state "
                f"only, so it refuses the model rather than serve a decode without that "
                f"cache")
        if g.kind == "state" and g.prefix_cached:
            raise KvdAdapterError(
                f"KV cache group {i} holds Mamba state with prefix caching"
                f"{names if g.layers else ''}: vLLM then keeps a state checkpoint per "
                f"block and the kvd connector moves one running state; start the engines "
                f"with --no-enable-prefix-caching")
        if g.kind == "window" and g.window < 1:
            raise KvdAdapterError(f"KV cache group {i}: sliding window {g.window} tokens")
    sizes = sorted({g.block_size for g in groups if g.kind in PAGED_KINDS})
    if not sizes:
        raise KvdAdapterError("only state KV cache groups: no attention pages to move")
    if len(sizes) > 1:
        raise KvdAdapterError(f"KV cache groups differ in block size {sizes}")
    if len(groups) > 1 and pp_size > 1:
        raise KvdAdapterError(f"{len(groups)} KV cache groups with pipeline parallelism "
                              f"{pp_size} (the stages' layer ranges are not described)")


def has_state(groups: list[CacheGroup]) -> bool:
    """Does a group keep per-request state (whole-block pages, equal TP only)?"""
    return any(g.kind == "state" for g in groups)


def groups_signature(groups: list[CacheGroup]) -> str:
    """The groups as one string for the fingerprint (``Compat.layer_types``), e.g.
    ``"full@32 window@32:64"`` or ``"state@1024:tp1:3x544,8x64x16:float32,float32
    full@64"``: a pair that moves other blocks, or state of other shapes (another TP
    size), is refused at pairing."""
    def one(g: CacheGroup) -> str:
        extra = f":{g.window}" if g.kind == "window" else f":{g.state}" if g.state else ""
        return f"{g.kind}@{g.block_size}{extra}"
    return " ".join(one(g) for g in groups)


def prefill_backoff(groups: list[CacheGroup]) -> int:
    """Prompt tokens a prefill leaves out for the decode to compute: 1 with a state group
    (the state is a running summary, so the prefill must stop one token short for the
    decode to compute the last prompt token from it; vLLM's NIXL connector,
    ``_prefill_backoff``), else 0."""
    return 1 if has_state(groups) else 0


def truncation(groups: list[CacheGroup], params: Mapping[str, Any] | None,
               num_prompt_tokens: int) -> int:
    """Tokens to drop from the end of a new prefill request's prompt: :func:`prefill_backoff`
    for a request handed to a decode (``do_remote_decode``) whose prompt has more tokens
    than that and that was not truncated yet (``TRUNCATED`` in its params), else 0."""
    backoff = prefill_backoff(groups)
    if not backoff or not params or not params.get("do_remote_decode"):
        return 0
    return backoff if num_prompt_tokens > backoff and not params.get(TRUNCATED) else 0


TRUNCATED = "_kvd_truncated"
"""The key the connector sets in a truncated prefill request's own transfer params."""


def handed_tokens(groups: list[CacheGroup], num_prompt_tokens: int, truncated: bool) -> int:
    """Prompt tokens whose pages a prefill request of ``num_prompt_tokens`` tokens (as it
    ran) hands off: with a state group the whole (truncated) prompt, else
    :func:`loaded_tokens`. KvdAdapterError for a state group whose request was not
    truncated (its state is one token past where the decode continues)."""
    if prefill_backoff(groups):
        if not truncated:
            raise KvdAdapterError("the prefill computed the whole prompt (not truncated): "
                                  "its state is past the token the decode computes")
        return num_prompt_tokens
    return loaded_tokens(groups, num_prompt_tokens)


def loaded_tokens(groups: list[CacheGroup], num_prompt_tokens: int) -> int:
    """The prompt tokens a decode loads through kvd: all of them with full-attention groups
    only (vLLM then recomputes the last one), all but the last one with a window or state
    group, so that the decode computes the last token itself from a window it holds or
    from the state of the prompt before it (:func:`prefill_backoff`). Loading all
    ``T`` tokens, vLLM's decode keeps window blocks from token ``T - window + 1`` on
    (``SlidingWindowManager.get_num_skipped_tokens(T)``) and then recomputes token ``T - 1``,
    which attends to token ``T - window``: when that token opens a block (``T - window + 1``
    a multiple of the block size), its block is the null block (seen on vLLM 0.32 CPU as
    PD tokens that differ from the colocated engine's). Loading ``T - 1`` keeps it; the
    prefill, which kept only what its own next token attends to, may have freed it, and
    :func:`room_blocks` then refuses the hand-off."""
    if any(g.kind in ("window", "state") for g in groups):
        return max(0, num_prompt_tokens - 1)
    return num_prompt_tokens


def window_blocks(num_tokens: int, window: int, block_size: int) -> range:
    """Block indices of a window group the decode needs after it loaded ``num_tokens``
    tokens (:func:`loaded_tokens`): from the block of token ``num_tokens - window + 1``
    (the first one vLLM keeps on a decode that loads ``num_tokens`` tokens:
    ``SlidingWindowManager.get_num_skipped_tokens``) to the last loaded token's block. At
    most ``ceil(window / block_size) + 1`` blocks."""
    first = max(0, num_tokens - window + 1) // block_size
    return range(first, pages_for(num_tokens, block_size))


def state_block(ids: list[int], spec_blocks: int) -> int:
    """A state group's running-state block of a request whose group blocks are ``ids``:
    the last one before the ``spec_blocks`` speculative scratch blocks (vLLM's
    ``clip_ssm_state_blocks``). KvdAdapterError when there is none or it is the null
    block."""
    kept = ids[:len(ids) - min(spec_blocks, max(0, len(ids) - 1))]
    if not kept or int(kept[-1]) == NULL_BLOCK:
        raise KvdAdapterError(f"state blocks {list(ids)} name no state block")
    return int(kept[-1])


NULL_BLOCK = 0
"""vLLM's null block (``BlockPool.null_block``): a window group's skipped blocks name it."""


def room_blocks(groups: list[CacheGroup], block_ids: tuple[list[int], ...] | list[list[int]],
                num_tokens: int, first_page: int = 0) -> list[int]:
    """The room's pages of a request whose decode loads ``num_tokens`` prompt tokens
    (:func:`loaded_tokens`) and whose blocks per group are ``block_ids``: every full
    group's blocks ``[first_page, ceil(num_tokens / block_size))``, then every window
    group's :func:`window_blocks`, then every state group's :func:`state_block`, each kind
    in group order (the same on both sides, so room page ``i`` of the prefill is room page
    ``i`` of the decode; ``first_page``: a decode's local prefix hit, only with one full
    group). KvdAdapterError if a group holds fewer blocks, a window block is the null
    block (the prefill freed a block the decode needs: the request is not handed off, the
    decode computes it), a state group names no state block, or a prefix hit comes with
    window or state groups."""
    if len(block_ids) != len(groups):
        raise KvdAdapterError(f"{len(block_ids)} block lists for {len(groups)} KV cache groups")
    if first_page and (len(groups) > 1 or groups[0].kind != "full"):
        raise KvdAdapterError("a local prefix hit with sliding-window or state groups")
    out: list[int] = []
    for kind in KINDS:
        for g, ids in zip(groups, block_ids, strict=True):
            if g.kind != kind:
                continue
            if kind == "state":
                out.append(state_block(list(ids), g.spec_blocks))
                continue
            want = (range(first_page, pages_for(num_tokens, g.block_size)) if kind == "full"
                    else window_blocks(num_tokens, g.window, g.block_size))
            if len(ids) < want.stop:
                raise KvdAdapterError(f"a {kind} KV cache group holds {len(ids)} blocks, "
                                      f"the prompt needs {want.stop}")
            picked = [int(ids[b]) for b in want]
            if kind == "window" and NULL_BLOCK in picked:
                raise KvdAdapterError(f"window blocks {picked} name the null block")
            out += picked
    return out


def page_views(views: list[LayerCache]) -> LayerCache:
    """The one region several KV cache groups' views of one tensor describe (vLLM lays the
    groups over each other: the views start at the same address): the view whose block is
    its whole block stride (an attention layer's), else the first view widened to whole
    blocks (a Mamba layer's page: conv and SSM state, then the padding vLLM adds so that
    its page equals the attention page -- moved too, it is part of the page).
    KvdAdapterError if the views differ in block count or stride, or a view's block does
    not fit in its stride."""
    first = views[0]
    problems = [f"{v.name} and {first.name} share memory in different block layouts "
                f"({v.num_blocks} x {v.block_stride} vs {first.num_blocks} x "
                f"{first.block_stride} bytes)" for v in views[1:]
                if (v.num_blocks, v.block_stride) != (first.num_blocks, first.block_stride)]
    problems += [f"{v.name}: block content is not one run inside its {v.block_stride}-byte "
                 f"block" for v in views if not v.dense or v.block_bytes > v.block_stride]
    if problems:
        raise KvdAdapterError("vLLM KV cache layout not supported by kvd: "
                              + "; ".join(problems))
    whole = [v for v in views if v.block_bytes == v.block_stride]
    if whole:
        return whole[0]
    return dataclasses.replace(first, block_bytes=first.block_stride,
                               block_shape=(first.block_stride,))
