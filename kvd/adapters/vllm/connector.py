"""``KvdConnector``: vLLM's KV transfer handed to kvd (a ``KVConnectorBase_V1``).

Load it without patching vLLM::

    --kv-transfer-config '{"kv_connector": "KvdConnector",
                           "kv_connector_module_path": "kvd.adapters.vllm",
                           "kv_role": "kv_producer",          # or "kv_consumer"
                           "kv_connector_extra_config": {
                               "kvd_socket": "/run/kvd/gpu{tp_rank}/kvd.sock",
                               "bootstrap_addr": "10.0.0.1:8998"}}'   # producer only

(plus ``--disable-hybrid-kv-cache-manager``: the connector does not declare HMA support).
See :mod:`kvd.adapters.vllm.spec` for the transfer params and the KV args.

Flow of one request (vLLM's push-style P/D, as in its Mooncake connector, with kvd doing
the bytes): the proxy prefills with ``max_tokens=1`` and ``do_remote_decode``.

* Prefill scheduler, ``request_finished``: the request ended by length, so its prompt
  blocks are held (``delay_free_blocks=True``) and a send is queued; the response carries
  room, bootstrap address and block ids. ``has_pending_push_work`` keeps the engine
  stepping until kvd reports the room finished.
* Prefill worker, next step: ``Sender(room).init(n)`` + ``send(blocks)``; kvd(P) waits
  for the decode's destination pages, then writes them. ``get_transfer_results`` reports
  the room in ``finished_sending`` once it is Success or Failed; vLLM frees the blocks.
* Decode scheduler: ``get_num_new_matched_tokens`` claims the whole prompt as an async
  load; ``update_state_after_alloc`` queues a receive into the freshly allocated blocks.
* Decode worker: ``Receiver(room, bootstrap_addr).init(blocks)`` in ``start_load_kv``;
  ``get_transfer_results`` reports ``finished_recving`` on Success; on Failed (or kvd
  unreachable) also ``failed_recving`` -- but only once kvd says no prefill write can
  still land in the pages. vLLM then recomputes or fails the request
  (``kv_load_failure_policy``). The decode recomputes the last prompt token itself, so no
  aux data is sent.

One RPC per step polls every room in flight (``Poll``); when the scheduler had nothing
to run, the worker blocks in kvd's ``Wait`` for up to ``idle_wait`` seconds instead, so
an engine that only waits for transfers does not spin a core.

Memory: on CPU the worker's ``get_mem_pool_context`` places the KV cache in ``/dev/shm``
as it is allocated (:mod:`kvd.adapters.vllm.shm`); registration then describes those
files to kvd. On CUDA the buffers are described by CUDA IPC handles (``kind="cuda_ipc"``,
see :func:`cuda_ipc_handle`), which the kvd daemon does not import yet.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from kvd.adapters.vllm.shm import ShmAllocation
from kvd.adapters.vllm.spec import (
    ConnectorConfig,
    KvdAdapterError,
    LayerCache,
    RemotePrefill,
    pages_for,
    prefill_reply,
    register_kv,
    room_of,
)
from kvd.client import KvdClient, KVPoll, Receiver, Sender
from kvd.errors import KvdError, KvdUnreachable
from kvd.protocol import rpc
from kvd.protocol.memory import MemoryHandle

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = init_logger(f"vllm.{__name__}")  # under "vllm" so the engine's log config applies

_DONE = (KVPoll.Success, KVPoll.Failed)


# ---------------------------------------------------------------- scheduler -> worker

@dataclass(frozen=True)
class SendTask:
    """Prefill: hand ``block_ids`` (the prompt's blocks, in order) to kvd as ``room``."""

    req_id: str
    room: int
    block_ids: list[int]


@dataclass(frozen=True)
class RecvTask:
    """Decode: receive ``room`` from ``bootstrap_addr`` into ``block_ids``."""

    req_id: str
    room: int
    bootstrap_addr: str
    block_ids: list[int]
    prefill_tp_size: int


@dataclass(frozen=True)
class AbortTask:
    """Decode: fail ``room`` on both sides (no receive will happen) so prefill frees it."""

    req_id: str
    room: int
    bootstrap_addr: str
    reason: str


@dataclass
class KvdConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers; ``idle``: the step schedules no tokens."""

    sends: list[SendTask] = field(default_factory=list)
    recvs: list[RecvTask] = field(default_factory=list)
    aborts: list[AbortTask] = field(default_factory=list)
    idle: bool = False


# ---------------------------------------------------------------- the connector

class KvdConnector(KVConnectorBase_V1):
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
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = _Scheduler(vllm_config, self.config)
        else:
            self.worker = _Worker(vllm_config, self.config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Layer-compact, head-major blocks: one contiguous run per layer and block."""
        model = vllm_config.model_config
        return None if model is None or model.use_mla else "LBHNC"

    # -- scheduler side
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
        return self.scheduler.finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        self.scheduler.sending.difference_update(connector_output.finished_sending or ())

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and bool(self.scheduler.sending)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(self._kv_cache_config.transfer_group_ids)

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

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


# ---------------------------------------------------------------- scheduler side

class _Scheduler:
    """Decides which requests move KV and queues the work for the workers."""

    def __init__(self, vllm_config: VllmConfig, config: ConnectorConfig) -> None:
        kt = vllm_config.kv_transfer_config
        assert kt is not None
        self.config = config
        self.block_size = vllm_config.cache_config.block_size
        self.engine_id = str(kt.engine_id)
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.is_producer, self.is_consumer = kt.is_kv_producer, kt.is_kv_consumer
        self.meta = KvdConnectorMetadata()
        self.sending: set[str] = set()  # prefill requests whose blocks kvd still reads

    def _remote(self, request: Request) -> RemotePrefill | None:
        params = request.kv_transfer_params
        if not (self.is_consumer and params and params.get("do_remote_prefill")):
            return None
        try:
            return RemotePrefill.parse(params)
        except KvdAdapterError as exc:
            log.warning("request %s: %s; computing it locally", request.request_id, exc)
            params["do_remote_prefill"] = False
            return None

    def matched_tokens(self, request: Request, num_computed: int) -> tuple[int, bool]:
        """The whole prompt loads asynchronously, unless part of it is cached locally
        (kvd pairs prefill and decode pages one to one: a partial load is declined and
        the room aborted in ``after_alloc``)."""
        if self._remote(request) is None or num_computed > 0:
            return 0, False
        count = len(request.prompt_token_ids or ())
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        remote = self._remote(request)
        if remote is None:
            return
        assert request.kv_transfer_params is not None
        request.kv_transfer_params["do_remote_prefill"] = False  # one transfer per request
        if num_external <= 0:
            self.meta.aborts.append(AbortTask(request.request_id, remote.room,
                                              remote.bootstrap_addr,
                                              "decode computes this prompt locally"))
            return
        group = blocks.get_block_ids()[0]
        block_ids = list(group[:pages_for(num_external, self.block_size)])
        self.meta.recvs.append(RecvTask(request.request_id, remote.room,
                                        remote.bootstrap_addr, block_ids,
                                        remote.prefill_tp_size))

    def build_meta(self, scheduler_output: SchedulerOutput) -> KvdConnectorMetadata:
        meta, self.meta = self.meta, KvdConnectorMetadata()
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        return meta

    def finished(self, request: Request, block_ids: list[int]) -> tuple[bool,
                                                                         dict[str, Any] | None]:
        params = request.kv_transfer_params
        if not params:
            return False, None
        remote = self._remote(request)
        if remote is not None:  # finished (aborted) before its KV was ever received
            params["do_remote_prefill"] = False
            self.meta.aborts.append(AbortTask(request.request_id, remote.room,
                                              remote.bootstrap_addr,
                                              "decode request finished before its KV"))
            return False, None
        if not (self.is_producer and params.get("do_remote_decode")):
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None  # stopped (EOS) or aborted: nothing to hand off
        return self._hand_off(request, params, block_ids)

    def _hand_off(self, request: Request, params: dict[str, Any],
                  block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        n = pages_for(request.num_prompt_tokens, self.block_size)
        if len(block_ids) < n or self.config.bootstrap_addr is None:
            return False, None
        try:
            room = room_of(params)
        except KvdAdapterError as exc:
            log.warning("request %s: %s; no KV hand-off", request.request_id, exc)
            return False, None
        pages = [int(b) for b in block_ids[:n]]
        self.meta.sends.append(SendTask(request.request_id, room, pages))
        self.sending.add(request.request_id)
        return True, prefill_reply(room, self.config.bootstrap_addr, pages, self.engine_id,
                                   self.tp_size, request.num_prompt_tokens)


# ---------------------------------------------------------------- worker side

@dataclass
class _Room:
    kind: str  # "send" | "recv" | "abort"
    obj: Sender | Receiver | None
    room: int
    reason: str = ""  # set when the room failed on the engine side (never reached kvd)
    started: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class _Status:
    state: KVPoll | None  # None: in flight, or a failed decode room whose pages kvd holds
    reason: str = ""
    stats: tuple[int, float] | None = None  # prefill: (bytes written, s in transfers)


def layer_cache(name: str, tensor: torch.Tensor) -> LayerCache:
    """Describe one of vLLM's per-layer KV cache views (dim 0 = blocks)."""
    from vllm.model_executor.models.utils import extract_layer_index

    item = tensor.element_size()
    return LayerCache(name=name, layer=extract_layer_index(name), addr=tensor.data_ptr(),
                      num_blocks=int(tensor.shape[0]), block_stride=tensor.stride(0) * item,
                      block_bytes=math.prod(tensor.shape[1:]) * item,
                      dense=bool(tensor[0].is_contiguous()))


def cuda_ipc_handle(tensor: torch.Tensor, addr: int, length: int) -> MemoryHandle:
    """Describe ``[addr, addr + length)`` of a CUDA tensor by its CUDA IPC handle
    (:func:`kvd.client.cuda.cuda_ipc_handle`: segment handle + offset + GPU UUID)."""
    from kvd.client.cuda import cuda_ipc_handle as export

    return export(tensor, addr, length)


class _Worker:
    """Registers the KV cache with the local kvd and drives its rooms."""

    def __init__(self, vllm_config: VllmConfig, config: ConnectorConfig) -> None:
        from vllm.distributed.parallel_state import (
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        self.vllm_config, self.config = vllm_config, config
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        pp_rank = get_pp_group().rank_in_group
        self.client = KvdClient(config.socket_for(self.tp_rank, pp_rank),
                                timeout=config.rpc_timeout)
        on_cpu = vllm_config.device_config.device_type == "cpu"
        self.shm = ShmAllocation(shm_dir=config.shm_dir) if on_cpu else None
        self.rooms: dict[str, _Room] = {}

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describe the layers' KV cache views to kvd (RegisterKV). Raises
        KvdAdapterError for a layout kvd cannot move and kvd's error if it refuses."""
        seen: dict[int, tuple[str, torch.Tensor]] = {}
        for name, tensor in kv_caches.items():
            seen.setdefault(tensor.data_ptr(), (name, tensor))  # layers sharing a cache
        views = sorted(((layer_cache(n, t), t) for n, t in seen.values()),
                       key=lambda p: p[0].layer)
        layers = [c for c, _ in views]
        handles = [self._handle(t, c.addr, c.num_blocks * c.block_stride) for c, t in views]
        model, parallel = self.vllm_config.model_config, self.vllm_config.parallel_config
        kv_heads = model.get_num_kv_heads(parallel)
        registration = register_kv(
            layers, handles, block_size=self.vllm_config.cache_config.block_size,
            num_kv_heads=kv_heads, head_dim=model.get_head_size(),
            dtype_size=views[0][1].element_size(), total_kv_heads=kv_heads * self.tp_size)
        self.client.call(registration)
        log.info("kvd: registered %d KV layers (%d blocks of %d bytes each) with %s",
                 len(layers), layers[0].num_blocks, layers[0].block_stride, self.client.path)

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
        """Create this step's rooms in kvd (one failure never stops the others)."""
        for s in meta.sends:
            self._guard(s.req_id, s.room, "send", lambda s=s: self._send(s))
        for r in meta.recvs:
            self._guard(r.req_id, r.room, "recv", lambda r=r: self._recv(r))
        for a in meta.aborts:
            self._guard(a.req_id, a.room, "abort", lambda a=a: self._abort(a))

    def _guard(self, req_id: str, room: int, kind: str, create: Any) -> None:
        try:
            self.rooms[req_id] = _Room(kind, create(), room)
        except KvdError as exc:
            log.warning("kvd: room %d (%s %s) failed to start: %s", room, kind, req_id, exc)
            self.rooms[req_id] = _Room(kind, None, room, f"{type(exc).__name__}: {exc}")

    def _send(self, task: SendTask) -> Sender:
        sender = Sender(self.client, task.room)
        sender.init(len(task.block_ids), 0)
        sender.send(task.block_ids, is_last=True)
        return sender

    def _recv(self, task: RecvTask) -> Receiver:
        receiver = Receiver(self.client, task.room, task.bootstrap_addr)
        if task.prefill_tp_size != self.tp_size:
            receiver.abort(f"prefill TP {task.prefill_tp_size} != decode TP {self.tp_size}: "
                           f"the vLLM adapter moves whole blocks between equal TP sizes")
            return receiver
        receiver.init(task.block_ids, 0)
        return receiver

    def _abort(self, task: AbortTask) -> Receiver:
        receiver = Receiver(self.client, task.room, task.bootstrap_addr)
        receiver.abort(task.reason)
        return receiver

    def results(self, idle: bool) -> KVConnectorTransferResults:
        """Rooms that ended since the last step, in one kvd RPC (Wait when idle)."""
        out = KVConnectorTransferResults()
        live = [r.room for r in self.rooms.values() if r.obj is not None and not r.reason]
        status = self._statuses(live, idle)
        for req_id, r in list(self.rooms.items()):
            st = status.get(r.room, _Status(KVPoll.Failed, r.reason))
            if st.state is not None:
                self._finish(req_id, r, st, out)
        return out

    def _statuses(self, rooms: list[int], idle: bool) -> dict[int, _Status]:
        if not rooms:
            return {}
        call: rpc.Call = (rpc.Wait(rooms=rooms, timeout=self.config.idle_wait) if idle
                          else rpc.Poll(rooms=rooms))
        try:
            res = self.client.call(call)
        except KvdUnreachable as exc:
            return {room: _Status(KVPoll.Failed, f"kvd unreachable: {exc}") for room in rooms}
        reasons, stats, releasable = res.reasons, res.stats, set(res.releasable)
        out = {}
        for room, s in zip(rooms, res.statuses, strict=True):
            done = (s in _DONE or s < 0) and room in releasable
            state = (KVPoll.Success if s == KVPoll.Success else KVPoll.Failed) if done else None
            out[room] = _Status(state, reasons.get(room, "room unknown to kvd" if s < 0 else ""),
                                stats.get(room))
        return out

    def _finish(self, req_id: str, r: _Room, st: _Status,
                out: KVConnectorTransferResults) -> None:
        del self.rooms[req_id]
        if r.obj is not None:
            with contextlib.suppress(KvdError):
                r.obj.clear()
        if r.kind == "send":
            out.finished_sending.add(req_id)
        elif r.kind == "recv":
            out.finished_recving.add(req_id)
            if st.state != KVPoll.Success:
                out.failed_recving.add(req_id)
        ms = (time.monotonic() - r.started) * 1e3
        if st.state != KVPoll.Success and r.kind != "abort":
            log.warning("kvd: room %d (%s %s) failed after %.1f ms: %s", r.room, r.kind,
                        req_id, ms, st.reason)
        elif st.state == KVPoll.Success:
            nbytes, secs = st.stats or (0, 0.0)
            log.info("kvd: room %d %s done in %.1f ms (%d bytes, %.1f ms in transfers)",
                     r.room, r.kind, ms, nbytes, secs * 1e3)

    def shutdown(self) -> None:
        """Forget every room, close the socket, unlink the shared-memory files."""
        for r in self.rooms.values():
            if r.obj is not None:
                with contextlib.suppress(KvdError):
                    r.obj.abort("engine shutting down")
        self.rooms.clear()
        self.client.close()
        if self.shm is not None:
            self.shm.close()
