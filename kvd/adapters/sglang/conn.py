"""kvd as an SGLang transfer backend: ``disaggregation.base.conn`` classes that delegate
every transfer to the rank's kvd sidecar.

Selected with ``--disaggregation-transfer-backend kvd`` once the plugin in
:mod:`kvd.adapters.sglang.plugin` is loaded (SGLang loads it from the
``sglang.srt.plugins`` entry point group). What each class does, in SGLang's order:

* :class:`KvdKVBootstrapServer` (prefill rank 0's tokenizer process,
  ``start_disagg_service``): nothing to serve -- the bootstrap server IS the prefill
  rank 0 kvd (``serve_bootstrap = true``, ``http_port`` = SGLang's
  ``--disaggregation-bootstrap-port``), speaking SGLang's ``/route`` API. It only
  checks, without blocking start-up, that something answers there.
* :class:`KvdKVManager` (each scheduler): connects to the local kvd
  (``SGLANG_KVD_SOCKET``, placeholders ``{engine_rank}`` ``{tp_rank}`` ``{pp_rank}``
  ``{dp_rank}``, default kvd's own: ``/run/kvd/kvd.sock`` as root,
  ``$XDG_RUNTIME_DIR/kvd/kvd.sock`` otherwise), proves it is kvd's (``SO_PEERCRED``;
  ``KVD_EXPECTED_UID`` names kvd's uid when it is not root, the engine's user or the
  socket folder's owner: :mod:`kvd.client.peer`), and registers the rank's ``KVArgs``
  (:mod:`kvd.adapters.sglang.kvargs`: the pool must live in ``/dev/shm``) with its
  attention TP/DP and PP position (:func:`engine_ranks`): kvd takes them where its rank
  settings are unset and refuses a mismatch where they are set. The prefill kvd registers
  itself with the bootstrap server under those ranks.
* :class:`KvdKVSender` / :class:`KvdKVReceiver`: one kvd room each
  (``Sender``/``Receiver`` of :mod:`kvd.client`). The receiver creates its kvd room in
  ``init(prefill_dp_rank)`` and hands its pages over in ``send_metadata``. A hybrid
  model's ``state_indices`` (Mamba slot, SWA window pages) become the room's state index
  and window pages (:func:`kvd.adapters.sglang.kvargs.room_state`): the receiver's in
  ``send_metadata``, the sender's with its last chunk (it announces the room again with
  them). A decode whose Mamba state moves only as whole slots refuses a prefill of
  another attention TP in ``init``, naming the buffer.

Polling: SGLang polls every room every scheduler step. The manager answers all of them
from one refresh per ``poll_interval`` (default 2 ms) over every live room: kvd's status
table in one gather (no syscall), plus one ``Poll`` RPC only for rooms the table does not
answer or that just ended (their reason and stats), so a step with N rooms costs at most
one round trip, not N. Room calls go through kvd's submission ring (issue 21): a create
waits for kvd (its refusal fails the request at once, as before); an init or send
returns once written, and kvd's refusal of it fails the room at its next ``poll()``; a
clear of a room read ended and releasable returns once written too (kvd cannot refuse
it; it runs before any later call, a room of the same id included), so the scheduler
thread pays no round trip per room.
Failures raise SGLang's own ``KVTransferError`` (from ``failure_exception``) with kvd's reason.

Deferred release: kvd releases a failed or aborted room's decode pages only once no
prefill write can still land in them; the manager says so
(``enable_deferred_decode_kv_release``) and answers ``is_abort_release_safe`` from kvd.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import numpy.typing as npt
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import KVTransferError, PrefillServerInfo

from kvd.adapters.sglang.kvargs import KVArgsError, registration_state, room_state, state_kinds
from kvd.adapters.shmmaps import read_maps
from kvd.addr import http_url
from kvd.bootstrap import client as signed_http
from kvd.client import KvdClient, Receiver, Sender
from kvd.engine_rpc.socket_path import default_engine_socket
from kvd.errors import ConfigError, KvdError, KvdUnreachable
from kvd.filetrust import read_secret_file
from kvd.protocol import rpc
from kvd.rooms import UNKNOWN_ROOM
from kvd.security import Authenticator

log = logging.getLogger(__name__)

SOCKET_ENV = "SGLANG_KVD_SOCKET"
WINDOW_ENV = "SGLANG_KVD_WINDOW_TOKENS"
_TERMINAL = (int(KVPoll.Success), int(KVPoll.Failed))


def socket_path(args: Any, template: str | None = None) -> str:
    """The kvd socket of the rank described by ``args`` (``SGLANG_KVD_SOCKET``)."""
    template = template or os.environ.get(SOCKET_ENV) or str(default_engine_socket())
    rank = int(getattr(args, "engine_rank", 0) or 0)
    return template.format(engine_rank=rank, tp_rank=rank,
                           pp_rank=int(getattr(args, "pp_rank", 0) or 0),
                           dp_rank=int(getattr(args, "system_dp_rank", 0) or 0))


def engine_ranks(args: Any) -> rpc.EngineRanks | None:
    """This scheduler's attention TP/DP and PP position, from SGLang's published parallel
    context (what its own Mooncake manager reads); None where SGLang has not published it
    (then kvd's settings decide). kvd checks them against its settings (issue 13)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        return rpc.EngineRanks(attn_tp_rank=int(p.attn_tp_rank), attn_tp_size=int(p.attn_tp_size),
                               attn_dp_rank=int(p.attn_dp_rank), attn_dp_size=int(p.attn_dp_size),
                               pp_rank=int(getattr(args, "pp_rank", 0) or 0),
                               pp_size=int(p.pp_size))
    except (ImportError, ValueError, RuntimeError, AttributeError, TypeError):
        return None


def window_tokens(args: Any, server_args: Any) -> int | None:
    """The model's sliding window in tokens, for an SGLang SWA pool (``KVArgs`` does not
    carry it): ``SGLANG_KVD_WINDOW_TOKENS``, else ``args.sliding_window_size`` where set,
    else SGLang's ``ModelConfig`` of ``server_args`` (its ``sliding_window_size``, what the
    scheduler's SWA payload uses); None without an SWA pool or when none of them says."""
    if "swa" not in state_kinds(args):
        return None
    value = os.environ.get(WINDOW_ENV) or getattr(args, "sliding_window_size", None)
    if value:
        return int(value)
    try:
        from sglang.srt.configs.model_config import ModelConfig

        size = ModelConfig.from_server_args(server_args).sliding_window_size
    except (ImportError, OSError, ValueError, AttributeError, TypeError, RuntimeError) as exc:
        log.warning("kvd: the model's sliding window is unknown (%s); set %s", exc, WINDOW_ENV)
        return None
    return int(size) if size else None


def cluster_secret() -> bytes | None:
    """kvd's cluster secret as the operator gives it to kvd (``KVD_CLUSTER_SECRET`` or the
    first line of ``KVD_CLUSTER_SECRET_FILE``, checked as kvd checks it: S22,
    :func:`kvd.filetrust.read_secret_file`); None when kvd runs without one, or when the
    file is refused (logged: the bootstrap then refuses the unsigned query)."""
    value = os.environ.get("KVD_CLUSTER_SECRET", "").strip().encode()
    path = os.environ.get("KVD_CLUSTER_SECRET_FILE")
    if not value and path:
        try:
            data = read_secret_file(Path(path), "KVD_CLUSTER_SECRET_FILE")
        except ConfigError as exc:
            log.warning("kvd: %s", exc)
            return None
        value = (data.splitlines() or [b""])[0].strip()
    return value or None


def fetch_parallel_info(bootstrap_addr: str, timeout: float = 5.0) -> dict[str, Any] | None:
    """``GET /route`` (all ranks: the instance's parallel info) from a kvd bootstrap server,
    signed with the cluster secret when there is one; None if not available (yet)."""
    params = {"engine_rank": -1, "target_dp_group": -1, "target_pp_rank": -1}
    auth = Authenticator(cluster_secret())
    with httpx.Client(timeout=timeout, trust_env=False) as client:  # no proxy: kvd traffic
        try:
            r = signed_http.request_sync(client, auth, "GET",
                                         http_url(bootstrap_addr, "/route"), params=params)
        except httpx.HTTPError:
            return None
    if r.status_code != 200:
        if r.status_code == 401:
            log.warning("kvd: %s refused the bootstrap query (set KVD_CLUSTER_SECRET for the "
                        "engine too): %s", bootstrap_addr, r.text[:200])
        return None
    return dict(r.json())


class _Board:
    """Statuses of every live room of one kvd, refreshed at most every ``max_age`` seconds
    (or when a room is not on the board yet): from kvd's status table in one gather (issue
    21), and in ONE Poll RPC for the rooms the table does not answer and those that ended
    since (their reason and transfer stats); all of them by Poll without a table."""

    def __init__(self, client: KvdClient, max_age: float) -> None:
        self.client, self.max_age = client, max_age
        self.live: set[int] = set()
        self.status: dict[int, int] = {}
        self.reasons: dict[int, str] = {}
        self.stats: dict[int, tuple[int, float]] = {}
        self.releasable: set[int] = set()
        self.detailed: set[int] = set()  # ended rooms whose reason and stats are in
        #: rooms read Failed because kvd could not be reached, not because kvd said so:
        #: kvd may still hold them (a timeout, not a death), so their clear is waited for
        self.unheard: set[int] = set()
        self.refreshed = 0.0

    def add(self, room: int) -> None:
        self.live.add(room)

    def drop(self, room: int) -> None:
        self.live.discard(room)
        for table in (self.status, self.reasons, self.stats):
            table.pop(room, None)
        self.releasable.discard(room)
        self.detailed.discard(room)
        self.unheard.discard(room)

    def settled(self, room: int) -> bool:
        """Whether ``room`` was last read ended (Success or Failed) with its pages
        releasable: both stay true (kvd frees a room's pages only once it ended, K06), so
        kvd cannot refuse its Clear and the clear need not be waited for. A room read
        Failed only because kvd could not be reached is not settled: kvd never said it
        ended, so its Clear may be refused, and a refusal must be heard (logged)."""
        return (self.status.get(room) in _TERMINAL and room in self.releasable
                and room not in self.unheard)

    def get(self, room: int) -> int:
        if room not in self.status or time.monotonic() - self.refreshed > self.max_age:
            self.refresh()
        return self.status.get(room, UNKNOWN_ROOM)

    def refresh(self) -> None:
        rooms = self._from_table(sorted(self.live))
        self.refreshed = time.monotonic()
        if not rooms:
            return
        try:
            res = self.client.call(rpc.Poll(rooms=rooms))
        except KvdUnreachable as exc:
            for room in rooms:
                self.status[room], self.reasons[room] = int(KVPoll.Failed), str(exc)
            self.releasable.update(rooms)
            self.unheard.update(rooms)
            return
        self.unheard.difference_update(rooms)
        self.status.update(zip(rooms, (int(s) for s in res.statuses), strict=True))
        self.reasons.update(res.reasons)
        self.stats.update(res.stats)
        free = set(res.releasable)
        for room, s in zip(rooms, res.statuses, strict=True):
            (self.releasable.add if room in free else self.releasable.discard)(room)
            if s in _TERMINAL:
                self.detailed.add(room)

    def _from_table(self, rooms: list[int]) -> list[int]:
        """Take the statuses of ``rooms`` the status table answers (no syscall); the rooms
        left for the socket: those it does not answer, and those that ended but whose
        reason and stats are not in yet. All of them without a fresh table."""
        if not rooms:
            return rooms
        read = self.client.read_table(np.asarray(rooms, dtype=np.uint64))
        if read is None:
            return rooms
        statuses, free, hit = read
        ask = []
        for room, s, f, h in zip(rooms, statuses.tolist(), free.tolist(), hit.tolist(),
                                 strict=True):
            if not h or (s in _TERMINAL and room not in self.detailed):
                ask.append(room)
                continue
            self.status[room] = s
            self.unheard.discard(room)
            (self.releasable.add if f else self.releasable.discard)(room)
        return ask


def _poll_board(side: Any) -> int:
    """A sender's or receiver's KVPoll from the manager's shared poll board (no RPC of its
    own); a room kvd no longer knows is Failed; terminal states are remembered."""
    handle = getattr(side, "sender", None) or getattr(side, "receiver", None)
    if handle is not None:  # its create, an init, a send (a refused create reads
        handle.wait_created()  # Failed, never the board's other incarnation)
        refusal = handle.refusal()
    else:
        refusal = side.kv_mgr.client.ring_refusal(side.bootstrap_room)
    if refusal is not None:  # a call through the ring that kvd refused: as a
        # refused RPC, a receiver aborts its room (the prefill stops), a sender fails
        fail = getattr(side, "abort_with", side._fail)
        fail(f"kvd refused a call of room {side.bootstrap_room}: "
             f"{type(refusal).__name__}: {refusal}")
        return int(KVPoll.Failed)
    status = side.kv_mgr.board.get(side.bootstrap_room)
    if status == UNKNOWN_ROOM:
        side._fail("room unknown to kvd (kvd restarted?)")
        return int(KVPoll.Failed)
    if status in _TERMINAL:
        side.conclude_state = status
    return int(status)


class KvdKVManager(BaseKVManager):
    """One engine rank's link to its kvd: registration, room statuses, prefill info."""

    enable_deferred_decode_kv_release = True
    supports_deferred_decode_kv_release = True
    supports_host_destination = False

    def __init__(self, args: KVArgs, disaggregation_mode: Any, server_args: Any,
                 is_mla_backend: bool | None = False, poll_interval: float = 0.002) -> None:
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.client = KvdClient(socket_path(args), timeout=30.0, use_ring=True)
        self.fds: dict[str, int] = {}  # descriptors of unnamed shared memory, kept open
        ranks = engine_ranks(args)
        reg, self.state = registration_state(args, self.is_mla_backend, read_maps(),
                                             fds=self.fds, ranks=ranks,
                                             window_tokens=window_tokens(args, server_args))
        self.registration = msgspec.structs.replace(reg, ranks=ranks)
        self.client.call(self.registration)
        self.board = _Board(self.client, poll_interval)
        self.prefill_info_table: dict[str, PrefillServerInfo] = {}
        log.info("kvd: %s rank %s registered %d KV buffers with %s",
                 getattr(disaggregation_mode, "value", disaggregation_mode),
                 getattr(args, "engine_rank", 0), len(self.registration.kv_buffers),
                 self.client.path)

    def register_to_bootstrap(self) -> None:
        """Nothing to do: the prefill kvd registered this rank with the bootstrap server
        when the engine registered its KV (RegisterKV above)."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode: fetch the prefill instance's parallel info once (kvd's ``/route``);
        False while the prefill is not (fully) registered or not reachable yet."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        info = fetch_parallel_info(bootstrap_addr)
        if info is None:
            return False
        self.prefill_info_table[bootstrap_addr] = PrefillServerInfo(
            attn_tp_size=info["prefill_attn_tp_size"], attn_cp_size=1,
            dp_size=info["prefill_dp_size"], pp_size=info["prefill_pp_size"],
            page_size=info.get("prefill_page_size"), kv_cache_dtype=None,
            follow_bootstrap_room=True)  # kvd's rule: dp group = room % dp_size
        return True

    def is_abort_release_safe(self, room: int, required_acks: int = 0) -> bool:
        """May a failed/aborted room's decode pages be reused? (kvd knows.)"""
        self.board.refresh()
        return room in self.board.releasable or room not in self.board.live

    def clear_deferred_abort_state(self, room: int) -> None:
        """kvd keeps no engine-visible abort state beyond the room (cleared by clear())."""

    def failure(self, room: int) -> str:
        return self.board.reasons.get(room) or "failed in kvd (no reason given)"

    def state_refusal(self, bootstrap_addr: str) -> str | None:
        """Why this decode's state cannot come from the prefill at ``bootstrap_addr`` (its
        attention TP against ours: :meth:`SglState.tp_refusal`); None if it can or either
        TP is unknown."""
        info, ranks = self.prefill_info_table.get(bootstrap_addr), self.registration.ranks
        if info is None or ranks is None:
            return None
        return self.state.tp_refusal(int(info.attn_tp_size), ranks.attn_tp_size)


class KvdKVSender(BaseKVSender):
    """Prefill side of one request: a kvd ``Sender``."""

    def __init__(self, mgr: KvdKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        self.kv_mgr, self.bootstrap_addr = mgr, bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self.conclude_state: int | None = None
        self.reason = ""
        self.sender: Sender | None = None
        self.num_pages, self.aux_index = 0, 0
        self.pages: list[npt.NDArray[np.int64]] = []  # sent so far (a dsa entry names them)
        try:
            self.sender = Sender(mgr.client, self.bootstrap_room)
            mgr.board.add(self.bootstrap_room)
        except KvdError as exc:
            self._fail(f"{type(exc).__name__}: {exc}")

    def _fail(self, reason: str) -> None:
        self.conclude_state, self.reason = int(KVPoll.Failed), reason

    def _call(self, method: str, *args: Any) -> None:
        if self.conclude_state is not None or self.sender is None:
            return
        try:
            getattr(self.sender, method)(*args)
        except KvdError as exc:
            self._fail(f"{type(exc).__name__}: {exc}")

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.num_pages, self.aux_index = int(num_kv_indices), aux_index or 0
        self._call("init", self.num_pages, self.aux_index)

    def send(self, kv_indices: npt.NDArray[np.int32], state_indices: list[Any] | None = None,
             num_kv_tokens: int | None = None) -> None:
        """One chunk. SGLang names the room's state (``state_indices``, one entry per
        ``state_types``) with the last chunk only, so the room is announced again then,
        with its state slot and window pages (kvd's sender takes them until the last
        chunk: they move with it)."""
        pages = np.asarray(kv_indices)
        self.pages.append(pages.astype(np.int64).reshape(-1))
        if state_indices:
            try:
                index, window = room_state(self.kv_mgr.state.types, state_indices,
                                           np.concatenate(self.pages))
            except KVArgsError as exc:
                if self.sender is not None and self.conclude_state is None:
                    with contextlib.suppress(KvdError):
                        self.sender.abort(str(exc))
                self._fail(str(exc))
                return
            if index >= 0 or window is not None:
                self._call("init", self.num_pages, self.aux_index, index, window)
        self._call("send", pages)

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        return _poll_board(self)

    def failure_exception(self) -> None:
        reason = self.reason or self.kv_mgr.failure(self.bootstrap_room)
        self.clear()
        raise KVTransferError(self.bootstrap_room, reason)

    def get_transfer_metric(self) -> KVTransferMetric:
        nbytes, seconds = self.kv_mgr.board.stats.get(self.bootstrap_room, (None, None))
        return KVTransferMetric(transfer_latency_s=seconds, transfer_total_bytes=nbytes)

    def clear(self) -> None:
        """Forget the room in kvd: through the ring, not waited for, once the room was read
        ended (kvd runs it before any later call, a room of the same id included); waited
        for otherwise (an abort before the room was polled)."""
        if self.sender is not None:
            with contextlib.suppress(KvdError):
                self.sender.clear(wait=not self.kv_mgr.board.settled(self.bootstrap_room))
        self.kv_mgr.board.drop(self.bootstrap_room)

    def abort(self) -> None:
        if self.sender is not None and self.conclude_state is None:
            with contextlib.suppress(KvdError):
                self.sender.abort("aborted by the SGLang prefill scheduler")
        self._fail(self.reason or "aborted by the SGLang prefill scheduler")


class KvdKVReceiver(BaseKVReceiver):
    """Decode side of one request: a kvd ``Receiver``, created in ``init``."""

    require_staging = False

    def __init__(self, mgr: KvdKVManager, bootstrap_addr: str,
                 bootstrap_room: int | None = None) -> None:
        self.kv_mgr, self.bootstrap_addr = mgr, bootstrap_addr
        self.bootstrap_room = int(bootstrap_room or 0)
        self.conclude_state: int | None = None
        self.reason = ""
        self.receiver: Receiver | None = None
        self.abort_notified = False
        self.bootstrap_infos: list[str] = []  # prefill endpoints holding our pages

    def _fail(self, reason: str) -> None:
        self.conclude_state, self.reason = int(KVPoll.Failed), reason

    def init(self, prefill_dp_rank: int) -> None:
        if self.receiver is not None or self.conclude_state is not None:
            return
        try:
            self.receiver = Receiver(self.kv_mgr.client, self.bootstrap_room,
                                     self.bootstrap_addr, dp_rank=prefill_dp_rank)
            self.kv_mgr.board.add(self.bootstrap_room)
        except KvdError as exc:
            self._fail(f"{type(exc).__name__}: {exc}")
            return
        refusal = self.kv_mgr.state_refusal(self.bootstrap_addr)
        if refusal is not None:  # kvd's pairing refuses it too; this names the buffer
            self.abort_with(refusal)

    def send_metadata(self, kv_indices: npt.NDArray[np.int32], aux_index: int | None = None,
                      state_indices: list[Any] | None = None,
                      decode_prefix_len: int | None = None,
                      destination: KVTransferDestination = KVTransferDestination.DEVICE
                      ) -> None:
        if self.receiver is None or self.conclude_state is not None:
            return
        if decode_prefix_len:
            self.abort_with("kvd does not move decode-side prefixes yet")
            return
        try:
            index, window = room_state(self.kv_mgr.state.types, state_indices, kv_indices)
        except KVArgsError as exc:
            self.abort_with(str(exc))
            return
        try:
            self.receiver.init(np.asarray(kv_indices), aux_index or 0, state_index=index,
                               window_pages=window)
            self.bootstrap_infos = [self.bootstrap_addr]
        except KvdError as exc:
            self.abort_with(f"{type(exc).__name__}: {exc}")

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if self.receiver is None:
            return int(KVPoll.Bootstrapping)
        return _poll_board(self)

    def failure_exception(self) -> None:
        raise KVTransferError(self.bootstrap_room,
                              self.reason or self.kv_mgr.failure(self.bootstrap_room))

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Tell kvd (and through it the prefill) that this room is abandoned."""
        if self.receiver is not None and not self.abort_notified:
            with contextlib.suppress(KvdError):
                self.receiver.abort("aborted by the SGLang decode scheduler")
            self.abort_notified = bool(self.bootstrap_infos) or force_arm

    def abort_with(self, reason: str) -> None:
        self.ensure_abort_notified()
        self._fail(reason)

    def abort(self) -> None:
        self.abort_with(self.reason or "aborted by the SGLang decode scheduler")

    def is_abort_release_safe(self) -> bool:
        return self.kv_mgr.is_abort_release_safe(self.bootstrap_room)

    def clear(self) -> None:
        """Forget the room in kvd. Call once its pages are releasable (SGLang does: after
        Success, or after the deferred release); kvd refuses earlier, which is logged.
        A room read ended and releasable is cleared through the ring, not waited for (kvd
        cannot refuse it, and runs it before any later call, a room of the same id
        included); any other is waited for, its refusal logged, as nothing keeps it."""
        if self.receiver is not None:  # (nothing is sent if kvd refused its create)
            try:
                self.receiver.clear(timeout=0,
                                    wait=not self.kv_mgr.board.settled(self.bootstrap_room))
            except KvdError as exc:
                log.warning("kvd: room %d not cleared: %s", self.bootstrap_room, exc)
        self.kv_mgr.board.drop(self.bootstrap_room)


class KvdKVBootstrapServer(BaseKVBootstrapServer):
    """The bootstrap server is kvd's (prefill rank 0's kvd, ``serve_bootstrap = true``)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, int(port)
        if not self.check(timeout=0.5):
            log.warning("kvd: no bootstrap server answers at %s:%d yet; start prefill rank "
                        "0's kvd with serve_bootstrap = true and http_port = %d",
                        host, self.port, self.port)

    def check(self, timeout: float = 2.0) -> bool:
        """True if a kvd answers ``/health`` at ``host:port``."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        try:
            return httpx.get(f"http://{host}:{self.port}/health", timeout=timeout,
                             trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False
