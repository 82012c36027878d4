"""``KvdConnector``: vLLM's KV transfer handed to kvd (a ``KVConnectorBase_V1``).

Load it without patching vLLM::

    --kv-transfer-config '{"kv_connector": "KvdConnector",
                           "kv_connector_module_path": "kvd.adapters.vllm",
                           "kv_role": "kv_producer",          # or "kv_consumer"
                           "kv_connector_extra_config": {
                               "kvd_socket": "/run/kvd/gpu{tp_rank}/kvd.sock",
                               "bootstrap_addr": "10.0.0.1:8998"}}'   # producer only

The connector supports vLLM's hybrid KV cache manager (``SupportsHMA``): a model with
full-attention, sliding-window and Mamba layers has a KV cache group of each, and a room's
pages are every group's blocks (:func:`kvd.adapters.vllm.spec.room_blocks`); with Mamba
state the prefill computes all but the last prompt token (``on_new_request``). A model with
a group of another kind (chunked local attention...) is refused when the worker
registers, naming the group. With ``--disable-hybrid-kv-cache-manager`` vLLM keeps one
group (sliding-window layers then cache every block). See :mod:`kvd.adapters.vllm.spec`
for the transfer params and the KV args.

Flow of one request (vLLM's push-style P/D, as in its Mooncake connector, with kvd doing
the bytes): the proxy (``kvd proxy``) prefills with ``max_tokens=1`` and
``do_remote_decode``.

* Prefill scheduler, ``request_finished``: the request ended by length, so its prompt
  blocks are held (``delay_free_blocks=True``) and a send is queued, one room per decode
  sample (``num_samples``); the response carries rooms, bootstrap address and block ids.
* Prefill worker, next step: ``Sender(room).init(n)`` + ``send(blocks)`` per room; kvd(P)
  waits for the decode's destination pages, then writes them. ``get_transfer_results``
  reports the request in ``finished_sending`` once every room of it ended; vLLM frees the
  blocks.
* Decode scheduler: ``get_num_new_matched_tokens`` claims the prompt tokens the decode
  does not hold (a local prefix-cache hit of ``k`` blocks stays local) as an async load;
  ``update_state_after_alloc`` claims one of the request's rooms (each sample its own)
  and queues a receive into the blocks after the hit, naming ``first_page = k``.
* Decode worker: ``Receiver(room, bootstrap_addr).init(blocks, first_page=k)`` in
  ``start_load_kv``; ``get_transfer_results`` reports ``finished_recving`` on Success; on
  Failed (or kvd unreachable) also ``failed_recving`` -- but only once kvd says no prefill
  write can still land in the pages. vLLM then recomputes or fails the request
  (``kv_load_failure_policy``). The decode recomputes the last prompt token itself, so no
  aux data is sent. A status is looked up by the request's own rooms: a request never
  reads another request's room (K33).

Waiting costs nothing (K36): vLLM steps an engine as long as a request's blocks wait for
the connector, model or not, and each step is a round trip through the executor's
busy-waiting queues. So a step that schedules nothing and has no work for the workers
sleeps in the scheduler before it reaches them (:mod:`kvd.adapters.vllm.idle`: kvd's
``Wait`` on the rooms in flight, woken by a room's end or by new engine input). One RPC
per step polls the worker's rooms (``Poll``); in a step that runs no model the worker
waits in kvd for up to ``idle_wait`` seconds instead.

Batching (``batch``, the default; issue 21): a worker's room calls of one step go to kvd
together -- every create and abort in one ``Many``, then the inits and sends of the rooms
kvd created in another (a refused create sends nothing more for its room; a refused init
or send aborts its room; either fails the room in that step, as a refused RPC does), and
the step's clears in one more. Statuses are read from kvd's status table (one gather,
no syscall); a ``Poll`` asks only for the rooms the table says ended (their reason and
transfer stats) or does not answer. A step that starts N rooms costs 2 round trips, not
2-3 N; a step in which no room ends costs none.

Statistics: each finished room is recorded in :class:`~kvd.adapters.vllm.stats.
KvdConnectorStats`, which vLLM logs and exports on its ``/metrics`` (``vllm:kvd_*``).

Memory: on CPU the worker's ``get_mem_pool_context`` places the KV cache in ``/dev/shm``
as it is allocated (:mod:`kvd.adapters.vllm.shm`); registration then describes those
files to kvd. On CUDA the buffers are described by CUDA IPC handles (``kind="cuda_ipc"``,
see :func:`cuda_ipc_handle`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from kvd.adapters.vllm.idle import IdleSleeper
from kvd.adapters.vllm.shm import ShmAllocation
from kvd.adapters.vllm.spec import (
    FULL,
    TRUNCATED,
    CacheGroup,
    ConnectorConfig,
    KvdAdapterError,
    LayerCache,
    RemotePrefill,
    check_groups,
    groups_signature,
    handed_tokens,
    has_state,
    loaded_tokens,
    num_samples,
    page_views,
    prefill_reply,
    register_kv,
    release_digest_of,
    room_blocks,
    room_of,
    sample_rooms,
    truncation,
)
from kvd.adapters.vllm.stats import KvdConnectorStats, KvdPromMetrics
from kvd.client import KvdClient, KVPoll, Receiver, Sender
from kvd.errors import KvdError, KvdUnreachable
from kvd.protocol import rpc
from kvd.protocol.codec import pack_indices
from kvd.protocol.control import Compat
from kvd.protocol.memory import MemoryHandle

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = init_logger(f"vllm.{__name__}")  # under "vllm" so the engine's log config applies

_DONE = (KVPoll.Success, KVPoll.Failed)
#: Requests whose rooms the decode scheduler hands out one per sample, remembered at most.
MAX_CLAIMS = 65_536


# ---------------------------------------------------------------- scheduler -> worker

@dataclass(frozen=True)
class SendTask:
    """Prefill: hand ``block_ids`` (the prompt's blocks, in order) to kvd as every room of
    ``rooms`` (one per decode sample)."""

    req_id: str
    rooms: tuple[int, ...]
    block_ids: list[int]
    release_digest: bytes = b""  # the proxy's release token, hashed (K45/K46)


@dataclass(frozen=True)
class RecvTask:
    """Decode: receive ``room`` from ``bootstrap_addr`` into ``block_ids``, the room's
    pages from ``first_page`` on (the decode holds the ones before it)."""

    req_id: str
    room: int
    bootstrap_addr: str
    block_ids: list[int]
    first_page: int = 0
    dp_rank: int | None = None


@dataclass(frozen=True)
class AbortTask:
    """Decode: fail ``room`` on both sides (no receive will happen) so prefill frees it."""

    req_id: str
    room: int
    bootstrap_addr: str
    reason: str
    dp_rank: int | None = None


@dataclass
class KvdConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers; ``idle``: the step schedules no tokens."""

    sends: list[SendTask] = field(default_factory=list)
    recvs: list[RecvTask] = field(default_factory=list)
    aborts: list[AbortTask] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # requests whose receive to abort
    idle: bool = False


# ---------------------------------------------------------------- the connector

class KvdConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector whose transfers are done by the engine rank's kvd sidecar."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type, unused-ignore]
        kt = vllm_config.kv_transfer_config
        assert kt is not None
        self.config = ConnectorConfig.from_extra(kt.kv_connector_extra_config,
                                                 kt.is_kv_producer)
        self.scheduler: _Scheduler | None = None
        self.worker: _Worker | None = None
        self.groups, self.group_ids = cache_groups(
            kv_cache_config, vllm_config.parallel_config.tensor_parallel_size)
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = _Scheduler(vllm_config, self.config, self.groups, self.group_ids)
        else:
            self.worker = _Worker(vllm_config, self.config, self.groups)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Layer-compact, head-major blocks: one contiguous run per layer and block."""
        model = vllm_config.model_config
        return None if model is None or model.use_mla else "LBHNC"

    # -- scheduler side
    def on_new_request(self, request: Request) -> None:
        """A prefill request of a model with Mamba state computes all but its last prompt
        token (:func:`~kvd.adapters.vllm.spec.prefill_backoff`)."""
        if self.scheduler is not None:
            self.scheduler.new_request(request)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_meta(scheduler_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """As ``request_finished``, with every KV cache group's blocks (hybrid models)."""
        assert self.scheduler is not None
        return self.scheduler.finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Requests the workers finished no longer keep the engine waiting on kvd."""
        assert self.scheduler is not None
        self.scheduler.done(connector_output)

    def has_pending_push_work(self) -> bool:
        """Only work not yet handed to the workers (sends, aborts queued by
        ``request_finished``): one more step delivers it. Rooms in flight need no steps
        (kvd moves them), so an engine with only those does not spin (K36)."""
        return self.scheduler is not None and self.scheduler.has_queued()

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self.group_ids

    # -- worker side
    def get_mem_pool_context(self) -> contextlib.AbstractContextManager[Any] | None:
        assert self.worker is not None
        return self.worker.shm

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvdConnectorMetadata)
        self.worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and asynchronous: nothing to wait for per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """kvd reads the blocks straight from the engine's memory: no per-layer save."""

    def wait_for_save(self) -> None:
        """Sends are issued once the request finished (see ``request_finished``)."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker is not None
        meta = self._connector_metadata
        idle = isinstance(meta, KvdConnectorMetadata) and meta.idle
        return self.worker.results(idle)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending, res.finished_recving

    # -- statistics (vLLM's KVConnectorStats interface)
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The rooms finished since the last call (worker side; None on the scheduler)."""
        if self.worker is None or self.worker.stats.is_empty():
            return None
        return self.worker.stats.clone_and_reset()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KvdConnectorStats(data=data) if data is not None else KvdConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return KvdPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


# ---------------------------------------------------------------- scheduler side

@dataclass
class _Pending:
    """A decode request between ``matched_tokens`` and ``after_alloc``: its room (claimed
    once, however often vLLM asks) and the first page it needs."""

    remote: RemotePrefill
    room: int
    first_page: int


class _Scheduler:
    """Decides which requests move KV and queues the work for the workers."""

    def __init__(self, vllm_config: VllmConfig, config: ConnectorConfig,
                 groups: list[CacheGroup] | None = None,
                 group_ids: tuple[int, ...] = (0,)) -> None:
        kt = vllm_config.kv_transfer_config
        assert kt is not None
        self.config = config
        self.block_size = vllm_config.cache_config.block_size
        self.groups = groups or [dataclasses.replace(FULL, block_size=self.block_size)]
        self.group_ids = group_ids  # the groups' positions in vLLM's block lists
        self.engine_id = str(kt.engine_id)
        parallel = vllm_config.parallel_config
        self.tp_size = parallel.tensor_parallel_size
        self.dp_rank = parallel.data_parallel_rank
        self.is_producer, self.is_consumer = kt.is_kv_producer, kt.is_kv_consumer
        self.meta = KvdConnectorMetadata()
        self.pending: dict[str, _Pending] = {}
        self.receiving: set[str] = set()  # decode requests whose receive is in flight
        self.inflight: dict[str, tuple[int, ...]] = {}  # request -> its rooms in kvd
        self.sleeper = IdleSleeper(config.socket_for(0, 0), rpc_timeout=config.rpc_timeout,
                                   expected_uid=config.kvd_expected_uid)
        # (bootstrap addr, first room) -> rooms of that request claimed by samples so far
        # (least recently used dropped past MAX_CLAIMS; a finished request's entry stays so
        # that no later request with the same params ever claims a room twice)
        self.claims: OrderedDict[tuple[str, int], int] = OrderedDict()

    def has_queued(self) -> bool:
        m = self.meta
        return bool(m.sends or m.aborts or m.recvs or m.cancels)

    def _remote(self, request: Request) -> RemotePrefill | None:
        params = request.kv_transfer_params
        if not (self.is_consumer and params and params.get("do_remote_prefill")):
            return None
        try:
            return RemotePrefill.parse(params)
        except KvdAdapterError as exc:
            log.warning("request %s: %s; computing it locally", request.request_id, exc)
            self._own_params(request)["do_remote_prefill"] = False
            return None

    @staticmethod
    def _own_params(request: Request) -> dict[str, Any]:
        """The request's transfer params as its own dict: vLLM's ``n > 1`` children share
        one dict with their parent, and a flag set for one sample must not change the
        others (K33)."""
        params = dict(request.kv_transfer_params or {})
        request.kv_transfer_params = params
        return params

    def new_request(self, request: Request) -> None:
        """Drop the prompt tokens the decode computes from a prefill request that will be
        handed off (:func:`~kvd.adapters.vllm.spec.truncation`; as vLLM's NIXL connector
        does: prompt, all tokens, count, and one output token), marking its params. Not a
        request that skips the prefix cache (prompt logprobs): a decode loads none of its
        KV, and the prefill then hands nothing off."""
        drop = truncation(self.groups, request.kv_transfer_params, request.num_prompt_tokens)
        skips = getattr(request, "get_skip_reading_prefix_cache", lambda: False)()
        if not drop or skips or request.prompt_token_ids is None:
            return
        del request.prompt_token_ids[-drop:]
        del request._all_token_ids[-drop:]
        request.num_prompt_tokens -= drop
        request.max_tokens = 1
        self._own_params(request)[TRUNCATED] = drop

    def matched_tokens(self, request: Request, num_computed: int) -> tuple[int, bool]:
        """The prompt tokens after the local prefix-cache hit load asynchronously. A hit
        that does not end on a block boundary cannot be expressed in pages: declined (the
        decode computes the prompt and the room is aborted in ``after_alloc``)."""
        remote = self._remote(request)
        count = loaded_tokens(self.groups, len(request.prompt_token_ids or ())) - num_computed
        if remote is None or count <= 0 or num_computed % self.block_size:
            return 0, False
        if num_computed and (len(self.groups) > 1 or self.groups[0].kind != "full"):
            return 0, False  # a hit with window groups is not a prefix of the room's pages
        pending = self.pending.get(request.request_id)
        room = pending.room if pending is not None else self._claim(remote)
        if room is None:
            log.warning("request %s: every room of prefill room %d is taken by other "
                        "samples; computing this one locally", request.request_id,
                        remote.room)
            self._own_params(request)["do_remote_prefill"] = False
            return 0, False
        self.pending[request.request_id] = _Pending(remote, room,
                                                    num_computed // self.block_size)
        return count, True

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        remote = self._remote(request)
        if remote is None:
            return
        self._own_params(request)["do_remote_prefill"] = False  # one transfer per request
        pending = self.pending.pop(request.request_id, None)
        room = pending.room if pending is not None else self._claim(remote)
        if room is None:
            return  # every room taken by other samples: computed locally
        if num_external <= 0 or pending is None:
            self.meta.aborts.append(AbortTask(request.request_id, room, remote.bootstrap_addr,
                                              "decode computes this prompt locally",
                                              remote.dp_rank))
            return
        try:
            block_ids = room_blocks(
                self.groups, self._of_groups(blocks.get_block_ids()),
                loaded_tokens(self.groups, len(request.prompt_token_ids or ())),
                pending.first_page)
        except KvdAdapterError as exc:
            log.warning("request %s: %s; computing it locally", request.request_id, exc)
            self.meta.aborts.append(AbortTask(request.request_id, room, remote.bootstrap_addr,
                                              f"decode cannot name its pages: {exc}",
                                              remote.dp_rank))
            return
        self.meta.recvs.append(RecvTask(request.request_id, room, remote.bootstrap_addr,
                                        block_ids, pending.first_page, remote.dp_rank))
        self.receiving.add(request.request_id)

    def _of_groups(self, block_ids: tuple[list[int], ...] | list[list[int]]
                   ) -> list[list[int]]:
        """The block lists of the groups the connector moves (vLLM's transfer groups)."""
        if len(block_ids) == len(self.groups):
            return list(block_ids)
        return [block_ids[i] for i in self.group_ids]

    def _claim(self, remote: RemotePrefill) -> int | None:
        """The next unclaimed room of the request (each sample its own, K33); None when
        every room is taken."""
        key = (remote.bootstrap_addr, remote.room)
        taken = self.claims.pop(key, 0)
        self.claims[key] = min(taken + 1, len(remote.rooms))  # exhausted ones stay: no reuse
        while len(self.claims) > MAX_CLAIMS:
            self.claims.popitem(last=False)
        return remote.rooms[taken] if taken < len(remote.rooms) else None

    def build_meta(self, scheduler_output: SchedulerOutput) -> KvdConnectorMetadata:
        idle = scheduler_output.total_num_scheduled_tokens == 0
        if idle and not self.has_queued():  # only waiting for kvd: sleep, do not spin
            self.sleeper.sleep(sorted({r for rooms in self.inflight.values() for r in rooms}),
                               waiting_on_kvd=len(self.receiving))
        meta, self.meta = self.meta, KvdConnectorMetadata()
        meta.idle = idle
        for s in meta.sends:
            self.inflight[s.req_id] = s.rooms
        for r in meta.recvs:
            self.inflight[r.req_id] = (r.room,)
        return meta

    def done(self, output: KVConnectorOutput) -> None:
        for req_id in (*(output.finished_sending or ()), *(output.finished_recving or ())):
            self.inflight.pop(req_id, None)

    def finished(self, request: Request, block_ids: tuple[list[int], ...]
                 ) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: the request's blocks per KV cache group."""
        params = request.kv_transfer_params
        if not params:
            return False, None
        if request.request_id in self.receiving:
            self.receiving.discard(request.request_id)
            if request.status == RequestStatus.FINISHED_ABORTED:  # the client left (K35):
                self.meta.cancels.append(request.request_id)  # kvd stops the transfer too
            return False, None  # vLLM holds the blocks until the receive reports
        remote = self._remote(request)
        if remote is not None:  # finished (aborted) before its KV was ever received
            self._own_params(request)["do_remote_prefill"] = False
            pending = self.pending.pop(request.request_id, None)
            room = pending.room if pending is not None else self._claim(remote)
            if room is not None:
                self.meta.aborts.append(AbortTask(request.request_id, room,
                                                  remote.bootstrap_addr,
                                                  "decode request finished before its KV",
                                                  remote.dp_rank))
            return False, None
        if not (self.is_producer and params.get("do_remote_decode")):
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None  # stopped (EOS) or aborted: nothing to hand off
        return self._hand_off(request, params, block_ids)

    def _hand_off(self, request: Request, params: dict[str, Any],
                  block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        if self.config.bootstrap_addr is None:
            return False, None
        dropped = int(params.get(TRUNCATED, 0))
        try:
            pages = room_blocks(self.groups, self._of_groups(block_ids), handed_tokens(
                self.groups, request.num_prompt_tokens, bool(dropped)))
            rooms = sample_rooms(room_of(params), num_samples(params))
        except KvdAdapterError as exc:
            log.warning("request %s: %s; no KV hand-off", request.request_id, exc)
            return False, None
        self.meta.sends.append(SendTask(request.request_id, tuple(rooms), pages,
                                        release_digest_of(params)))
        return True, prefill_reply(rooms, self.config.bootstrap_addr, pages, self.engine_id,
                                   self.tp_size, request.num_prompt_tokens + dropped,
                                   self.dp_rank)


# ---------------------------------------------------------------- worker side

@dataclass
class _Room:
    """One kvd room of a transfer: its handle, or why it never reached kvd."""

    room: int
    obj: Sender | Receiver | None
    reason: str = ""
    state: KVPoll | None = None  # once ended (and, on decode, releasable)
    stats: tuple[int, float] | None = None
    kind: str = ""


@dataclass
class _Transfer:
    """A request's transfer: its rooms (a prefill request sends one per decode sample)."""

    kind: str  # "send" | "recv" | "abort"
    rooms: list[_Room]
    started: float = field(default_factory=time.monotonic)

    @property
    def done(self) -> bool:
        return all(r.state is not None for r in self.rooms)

    @property
    def ok(self) -> bool:
        return all(r.state == KVPoll.Success for r in self.rooms)


def cache_groups(kv_cache_config: KVCacheConfig | None, tp_size: int = 1
                 ) -> tuple[list[CacheGroup], tuple[int, ...]]:
    """vLLM's transferable KV cache groups as :class:`CacheGroup` s (their kind named
    by vLLM's spec class when the connector cannot move it: :func:`check_groups` refuses
    those), and their positions in vLLM's per-group block lists. A ``MambaSpec`` group is
    ``state``, with its per-rank shapes, dtypes and ``tp_size`` (TP ranks) for the
    fingerprint. No config (an older vLLM): one full group of the engine's block size."""
    if kv_cache_config is None:
        return [], (0,)
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    ids = tuple(getattr(kv_cache_config, "transfer_group_ids",
                        range(len(kv_cache_config.kv_cache_groups))))
    out = []
    for i in ids:
        g = kv_cache_config.kv_cache_groups[i]
        spec, names = g.kv_cache_spec, tuple(g.layer_names)
        kind = type(spec).__name__
        if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            out.append(CacheGroup("full", spec.block_size, layers=names))
        elif type(spec) is SlidingWindowSpec:
            out.append(CacheGroup("window", spec.block_size, spec.sliding_window, names))
        elif isinstance(spec, MambaSpec):
            out.append(CacheGroup(
                "state", spec.block_size, layers=names, spec_blocks=spec.num_speculative_blocks,
                state=_state_signature(spec, tp_size),
                prefix_cached=spec.mamba_cache_mode != "none"))
        else:
            out.append(CacheGroup(f"a {kind} cache", spec.block_size, layers=names))
    return out, ids


def _state_signature(spec: Any, tp_size: int) -> str:
    """``tp<N>:<shape>,<shape>:<dtype>,<dtype>`` of a ``MambaSpec`` (per-rank shapes)."""
    shapes = ",".join("x".join(str(d) for d in s) for s in spec.shapes)
    dtypes = ",".join(str(d).removeprefix("torch.") for d in spec.dtypes)
    return f"tp{1 if spec.tp_replicated else tp_size}:{shapes}:{dtypes}"


def cache_regions(kv_caches: dict[str, Any]) -> list[tuple[LayerCache, torch.Tensor]]:
    """The distinct memory regions of vLLM's per-layer KV cache views, by layer: views
    that start at one address (layers of several KV cache groups laid over one tensor,
    e.g. a Mamba layer's state page and an attention layer's KV) are one region
    (:func:`~kvd.adapters.vllm.spec.page_views`), described by the view it picks and that
    view's tensor. A list of tensors (as some vLLM versions give a Mamba layer: conv, SSM)
    counts each; one starting inside another's page overlaps it, which
    :func:`~kvd.adapters.vllm.spec.register_kv` refuses. KvdAdapterError if views of one
    address disagree."""
    views: dict[int, list[tuple[LayerCache, torch.Tensor]]] = {}
    for name, cache in kv_caches.items():
        for tensor in cache if isinstance(cache, list | tuple) else (cache,):
            views.setdefault(tensor.data_ptr(), []).append((layer_cache(name, tensor), tensor))
    out = []
    for vs in views.values():
        region = page_views([c for c, _ in vs])
        out.append((region, next(t for c, t in vs if c.name == region.name)))
    return sorted(out, key=lambda p: p[0].layer)


def layer_cache(name: str, tensor: torch.Tensor) -> LayerCache:
    """Describe one of vLLM's per-layer KV cache views (dim 0 = blocks)."""
    from vllm.model_executor.models.utils import extract_layer_index

    item = tensor.element_size()
    return LayerCache(name=name, layer=extract_layer_index(name), addr=tensor.data_ptr(),
                      num_blocks=int(tensor.shape[0]), block_stride=tensor.stride(0) * item,
                      block_bytes=math.prod(tensor.shape[1:]) * item,
                      dense=bool(tensor[0].is_contiguous()),
                      block_shape=tuple(int(d) for d in tensor.shape[1:]))


def cuda_ipc_handle(tensor: torch.Tensor, addr: int, length: int) -> MemoryHandle:
    """Describe ``[addr, addr + length)`` of a CUDA tensor by its CUDA IPC handle
    (:func:`kvd.client.cuda.cuda_ipc_handle`: segment handle + offset + GPU UUID)."""
    from kvd.client.cuda import cuda_ipc_handle as export

    return export(tensor, addr, length)


def _send_calls(room: int, task: SendTask) -> tuple[rpc.RingCall, list[rpc.RingCall]]:
    """The create, then the init and the one send, of a prefill room (batched start)."""
    pages = pack_indices(task.block_ids)
    return (rpc.SenderCreate(room=room, release_digest=task.release_digest),
            [rpc.SenderInit(room=room, num_pages=len(task.block_ids), aux_index=0),
             rpc.SenderSend(room=room, pages=pages, is_last=True)])


def _recv_calls(task: RecvTask) -> tuple[rpc.RingCall, list[rpc.RingCall]]:
    """The create, then the init, of a decode room (batched start)."""
    return (rpc.ReceiverCreate(room=task.room, bootstrap_addr=task.bootstrap_addr,
                               dp_rank=task.dp_rank),
            [rpc.ReceiverInit(room=task.room, dst_pages=pack_indices(task.block_ids),
                              aux_index=0, first_page=task.first_page)])


def _abort_call(task: AbortTask) -> rpc.RingCall:
    return rpc.Abort(room=task.room, reason=task.reason, bootstrap_addr=task.bootstrap_addr,
                     dp_rank=task.dp_rank)


class _Worker:
    """Registers the KV cache with the local kvd and drives its rooms."""

    def __init__(self, vllm_config: VllmConfig, config: ConnectorConfig,
                 groups: list[CacheGroup] | None = None) -> None:
        from vllm.distributed.parallel_state import (
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        self.vllm_config, self.config = vllm_config, config
        self.groups = groups or [dataclasses.replace(
            FULL, block_size=vllm_config.cache_config.block_size)]
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        pp = get_pp_group()
        self.pp_rank, self.pp_size = pp.rank_in_group, pp.world_size
        self.client = KvdClient(config.socket_for(self.tp_rank, self.pp_rank),
                                timeout=config.rpc_timeout,
                                expected_uid=config.kvd_expected_uid)
        # No submission ring: a step's room calls go as one Many (submit_all), which
        # measured faster than ring records and a wait from 4 rooms a step up (and as
        # fast for one); the ring pays off for single calls not waited for (SGLang's).
        on_cpu = vllm_config.device_config.device_type == "cpu"
        self.shm = ShmAllocation(shm_dir=config.shm_dir) if on_cpu else None
        self.transfers: dict[str, _Transfer] = {}
        self.owner: dict[int, str] = {}  # live room -> the request that created it (K33)
        self.stats = KvdConnectorStats()

    def _ranks(self) -> rpc.EngineRanks:
        parallel = self.vllm_config.parallel_config
        return rpc.EngineRanks(attn_tp_rank=self.tp_rank, attn_tp_size=self.tp_size,
                               attn_dp_rank=parallel.data_parallel_rank,
                               attn_dp_size=parallel.data_parallel_size,
                               pp_rank=self.pp_rank, pp_size=self.pp_size)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describe the layers' KV cache views and this worker's ranks to kvd (RegisterKV).
        Raises KvdAdapterError for a layout or a KV cache group kvd cannot move (before
        anything is sent: the engine does not start) and kvd's error if it refuses (e.g.
        ranks that contradict kvd's settings). Several groups share tensors (one layer of
        each per tensor): each tensor is registered once."""
        check_groups(self.groups, self.pp_size)
        regions = cache_regions(kv_caches)
        layers = [c for c, _ in regions]
        handles = [self._handle(t, c.addr, c.num_blocks * c.block_stride) for c, t in regions]
        dtype = next((t.dtype for _, t in regions if t.is_floating_point()), torch.uint8)
        model, parallel = self.vllm_config.model_config, self.vllm_config.parallel_config
        registration = register_kv(
            layers, handles, block_size=self.vllm_config.cache_config.block_size,
            num_kv_heads=model.get_num_kv_heads(parallel), head_dim=model.get_head_size(),
            dtype_size=dtype.itemsize,
            total_kv_heads=model.get_total_num_kv_heads(),
            is_mla=bool(model.use_mla) or has_state(self.groups),
            ranks=self._ranks(), shared=len(self.groups) > 1,
            compat=Compat(kv_dtype=str(dtype).removeprefix("torch."),
                          layer_types=groups_signature(self.groups)))
        self.client.call(registration)
        log.info("kvd: registered %d KV layers (%d blocks of %d bytes each, %s; groups %s) "
                 "with %s", len(layers), layers[0].num_blocks, layers[0].block_stride,
                 "fused K/V heads" if registration.fused_kv else "whole blocks",
                 groups_signature(self.groups), self.client.path)

    def _handle(self, tensor: torch.Tensor, addr: int, length: int) -> MemoryHandle:
        if tensor.is_cuda:
            return cuda_ipc_handle(tensor, addr, length)
        if self.shm is None:
            raise KvdAdapterError("CPU KV cache outside shared memory")
        try:
            return self.shm.handle_of(addr, length)
        except ValueError as exc:
            raise KvdAdapterError(f"the KV cache was not allocated in shared memory ({exc}): "
                                  f"the worker did not use get_mem_pool_context") from exc

    # -- per step
    def start(self, meta: KvdConnectorMetadata) -> None:
        """Create this step's rooms in kvd (one failure never stops the others): batched
        (``batch``, issue 21) or one RPC per call."""
        if self.config.batch:
            self._start_batched(meta)
            return
        for s in meta.sends:
            self.transfers[s.req_id] = _Transfer("send", [
                self._open(s.req_id, room, lambda room=room, s=s: self._send(room, s))
                for room in s.rooms])
        for r in meta.recvs:
            self.transfers[r.req_id] = _Transfer(
                "recv", [self._open(r.req_id, r.room, lambda r=r: self._recv(r))])
        for a in meta.aborts:
            self.transfers[a.req_id] = _Transfer(
                "abort", [self._open(a.req_id, a.room, lambda a=a: self._abort(a))])
        for req_id in meta.cancels:
            self._cancel(req_id)

    def _start_batched(self, meta: KvdConnectorMetadata) -> None:
        """The step's calls in two batches, each ONE round trip (a ``Many``,
        :meth:`KvdClient.submit_all`):
        every create and abort, then the inits and sends of the rooms kvd created (a room
        whose create was refused gets none: it may be another request's). A refusal fails
        its room at once, as a refused RPC does; a room whose init or send was refused is
        aborted (the prefill stops waiting for it)."""
        opened: list[tuple[_Room, rpc.RingCall, list[rpc.RingCall]]] = []
        for s in meta.sends:
            t = self.transfers[s.req_id] = _Transfer(
                "send", [self._claim(s.req_id, room, Sender) for room in s.rooms])
            opened += [(r, *_send_calls(r.room, s)) for r in t.rooms if r.obj is not None]
        for rt in meta.recvs:
            t = self.transfers[rt.req_id] = _Transfer(
                "recv", [self._claim(rt.req_id, rt.room, Receiver, rt.bootstrap_addr,
                                     rt.dp_rank)])
            opened += [(r, *_recv_calls(rt)) for r in t.rooms if r.obj is not None]
        for a in meta.aborts:
            t = self.transfers[a.req_id] = _Transfer(
                "abort", [self._claim(a.req_id, a.room, Receiver, a.bootstrap_addr,
                                      a.dp_rank)])
            opened += [(r, _abort_call(a), []) for r in t.rooms if r.obj is not None]
        cancels = [c for req_id in meta.cancels for c in self._cancel_calls(req_id)]
        refused = self._submit([c for _, c, _ in opened] + cancels)
        for r, _, _ in opened:
            if r.room in refused:
                self._refused(r, refused[r.room], "failed to start")
        started = [(r, rest) for r, _, rest in opened if r.state is None and rest]
        refused = self._submit([c for _, rest in started for c in rest])
        failed = [r for r, _ in started if r.room in refused]
        self._submit([rpc.Abort(room=r.room, reason="the engine could not hand its pages "
                                "to kvd") for r in failed])
        for r in failed:
            self._refused(r, refused[r.room], "failed to start")

    def _cancel_calls(self, req_id: str) -> list[rpc.RingCall]:
        """The ``Abort`` of each live room of request ``req_id`` (as :meth:`_cancel`)."""
        t = self.transfers.get(req_id)
        return [rpc.Abort(room=r.room, reason="the decode request was aborted (client gone)",
                          bootstrap_addr=getattr(r.obj, "bootstrap_addr", None),
                          dp_rank=getattr(r.obj, "dp_rank", None))
                for r in (t.rooms if t is not None else ())
                if r.obj is not None and r.state is None]

    def _claim(self, req_id: str, room: int, kind: type[Sender] | type[Receiver],
               bootstrap_addr: str | None = None, dp_rank: int | None = None) -> _Room:
        """A handle on room ``room`` for request ``req_id`` (no RPC yet), or a Failed room
        when another live request of this worker holds that number (K33, as :meth:`_open`)."""
        if room in self.owner:
            reason = f"room {room} is already used by request {self.owner[room]}"
            log.warning("kvd: request %s: %s", req_id, reason)
            return _Room(room, None, reason, KVPoll.Failed, kind="duplicate")
        self.owner[room] = req_id
        obj = kind.attach(self.client, room)
        obj.bootstrap_addr, obj.dp_rank = bootstrap_addr, dp_rank
        return _Room(room, obj)

    def _submit(self, calls: list[rpc.RingCall]) -> dict[int, KvdError]:
        """:meth:`KvdClient.submit_all` of ``calls``; kvd unreachable (or its ring gone)
        refuses every room of them."""
        try:
            return self.client.submit_all(calls)
        except KvdError as exc:
            return {c.room: exc for c in calls}

    def _refused(self, r: _Room, exc: KvdError, what: str) -> None:
        log.warning("kvd: room %d (%s) %s: %s", r.room, self.owner.pop(r.room, ""), what,
                    exc)
        r.obj, r.state, r.reason = None, KVPoll.Failed, f"{type(exc).__name__}: {exc}"
        r.kind = "unreachable" if isinstance(exc, KvdUnreachable) else "engine"

    def _cancel(self, req_id: str) -> None:
        """The request was aborted while its receive is in flight: end its rooms in kvd
        (the prefill stops writing); the request is reported once kvd says its pages are
        releasable."""
        t = self.transfers.get(req_id)
        for r in t.rooms if t is not None else ():
            if r.obj is not None and r.state is None:
                with contextlib.suppress(KvdError):
                    r.obj.abort("the decode request was aborted (client gone)")

    def _open(self, req_id: str, room: int, create: Any) -> _Room:
        """One room of request ``req_id``. A room number another live request of this
        worker holds is refused here, before kvd: a request never reads another's status
        (K33). A room kvd refuses is Failed at once."""
        if room in self.owner:
            reason = f"room {room} is already used by request {self.owner[room]}"
            log.warning("kvd: request %s: %s", req_id, reason)
            return _Room(room, None, reason, KVPoll.Failed, kind="duplicate")
        self.owner[room] = req_id
        try:
            return _Room(room, create())
        except KvdError as exc:
            del self.owner[room]
            log.warning("kvd: room %d (%s) failed to start: %s", room, req_id, exc)
            return _Room(room, None, f"{type(exc).__name__}: {exc}", KVPoll.Failed,
                         kind="engine")

    def _send(self, room: int, task: SendTask) -> Sender:
        sender = Sender(self.client, room, task.release_digest)
        try:
            sender.init(len(task.block_ids), 0)
            sender.send(task.block_ids, is_last=True)
        except KvdError:
            with contextlib.suppress(KvdError):
                sender.abort("the engine could not hand its pages to kvd")
            raise
        return sender

    def _recv(self, task: RecvTask) -> Receiver:
        receiver = Receiver(self.client, task.room, task.bootstrap_addr, task.dp_rank)
        try:
            receiver.init(task.block_ids, 0, first_page=task.first_page)
        except KvdError:
            with contextlib.suppress(KvdError):
                receiver.abort("the engine could not hand its pages to kvd")
            raise
        return receiver

    def _abort(self, task: AbortTask) -> Receiver:
        receiver = Receiver.attach(self.client, task.room)
        receiver.bootstrap_addr, receiver.dp_rank = task.bootstrap_addr, task.dp_rank
        receiver.abort(task.reason)  # reaches the prefill even for a room kvd never saw
        return receiver

    def results(self, idle: bool) -> KVConnectorTransferResults:
        """Requests whose rooms all ended since the last step, in one kvd RPC (a ``Wait``
        until one room ends when the step ran no model)."""
        out = KVConnectorTransferResults()
        live = [r for t in self.transfers.values() for r in t.rooms
                if r.obj is not None and r.state is None]
        if self.config.batch and not idle:
            live = self._ended(live)
        self._update(live, idle)
        clears: list[rpc.RingCall] = []
        for req_id, t in list(self.transfers.items()):
            if t.done:
                clears += self._finish(req_id, t, out)
        if clears:
            with contextlib.suppress(KvdError):
                self.client.submit_all(clears)  # a room kvd will not clear is its to log
        return out

    def _ended(self, rooms: list[_Room]) -> list[_Room]:
        """Of ``rooms``, those the status table says ended (and are releasable), or does
        not answer: one gather, no RPC (issue 21). All of them without a fresh table."""
        if not rooms:
            return rooms
        ids = np.fromiter((r.room for r in rooms), dtype=np.uint64, count=len(rooms))
        read = self.client.read_table(ids)
        if read is None:
            return rooms
        statuses, releasable, hit = read
        ended = ((statuses == int(KVPoll.Success)) | (statuses == int(KVPoll.Failed))
                 | (statuses < 0)) & releasable
        return [rooms[i] for i in np.flatnonzero(ended | ~hit)]

    def _update(self, rooms: list[_Room], idle: bool) -> None:
        """Refresh the state of ``rooms`` (each looked up by its own number)."""
        if not rooms:
            return
        numbers = [r.room for r in rooms]
        try:
            res = (self.client.wait(numbers, self.config.idle_wait, any_done=True) if idle
                   else self.client.call(rpc.Poll(rooms=numbers)))
        except KvdUnreachable as exc:
            for r in rooms:
                r.state, r.reason, r.kind = KVPoll.Failed, f"kvd unreachable: {exc}", \
                    "unreachable"
            return
        releasable = set(res.releasable)
        for r, s in zip(rooms, res.statuses, strict=True):
            if not ((s in _DONE or s < 0) and r.room in releasable):
                continue
            r.state = KVPoll.Success if s == KVPoll.Success else KVPoll.Failed
            r.reason = res.reasons.get(r.room, "room unknown to kvd" if s < 0 else "")
            r.kind, r.stats = res.kinds.get(r.room, "unknown" if s < 0 else ""), \
                res.stats.get(r.room)

    def _finish(self, req_id: str, t: _Transfer,
                out: KVConnectorTransferResults) -> list[rpc.RingCall]:
        """Report request ``req_id`` in ``out``; the ``Clear`` calls of its rooms (sent
        now, one by one, unless ``batch``: then the caller sends them together)."""
        del self.transfers[req_id]
        clears: list[rpc.RingCall] = []
        for r in t.rooms:
            if r.obj is not None:
                self.owner.pop(r.room, None)
                if self.config.batch:
                    clears.append(rpc.Clear(room=r.room))
                    continue
                with contextlib.suppress(KvdError):
                    r.obj.clear()
        if t.kind == "send":
            out.finished_sending.add(req_id)
        elif t.kind == "recv":
            out.finished_recving.add(req_id)
            if not t.ok:
                out.failed_recving.add(req_id)
        self._account(req_id, t)
        return clears

    def _account(self, req_id: str, t: _Transfer) -> None:
        """Stats and a log line per room."""
        room_s = time.monotonic() - t.started
        if t.kind == "abort":
            return
        for r in t.rooms:
            nbytes, secs = r.stats or (0, 0.0)
            outcome = "success" if r.state == KVPoll.Success else (r.kind or "failed")
            self.stats.record(t.kind, outcome, room_s, secs, nbytes)
            if r.state == KVPoll.Success:
                log.info("kvd: room %d %s done in %.1f ms (%d bytes, %.1f ms in transfers)",
                         r.room, t.kind, room_s * 1e3, nbytes, secs * 1e3)
            else:
                log.warning("kvd: room %d (%s %s) failed after %.1f ms: %s", r.room, t.kind,
                            req_id, room_s * 1e3, r.reason)

    def shutdown(self) -> None:
        """Forget every room, close the socket, unlink the shared-memory files."""
        for t in self.transfers.values():
            for r in t.rooms:
                if r.obj is not None and r.state is None:
                    with contextlib.suppress(KvdError):
                        r.obj.abort("engine shutting down")
        self.transfers.clear()
        self.client.close()
        if self.shm is not None:
            self.shm.close()


