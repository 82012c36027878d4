"""SGLang conformance: SGLang's real ``disaggregation.base.conn`` interfaces, the kvd
backend selected through SGLang's real plugin loader, real kvd daemons (Mooncake TCP).

The tests drive the classes in the order SGLang's prefill and decode schedulers do
(``prefill.py``/``decode.py`` of SGLang 0.5.23): manager per rank from ``get_kv_class``
with a ``KVArgs`` filled like ``_init_kv_manager``, bootstrap server as in
``start_disagg_service``, decode ``try_ensure_parallel_info`` + DP-rank resolution, sender
and receiver from ``get_kv_class``, receiver ``init(dp_rank)`` -> WaitingForInput ->
``send_metadata``, sender WaitingForInput -> ``init(num_pages, aux)`` -> ``send`` per
chunk -> poll to Success, ``clear``; failures raise SGLang's ``KVTransferError``.

Skipped where SGLang is not installed (the main venv); ``make test-vllm`` runs them in
``.venv-vllm``, which has it (``pip install --no-deps sglang==0.5.23`` + a few pure deps).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvd.client import ShmPool, poll_array
from kvd.launch import LAUNCH_SECRET, DaemonProcess, start_daemon
from kvd.rooms import UNKNOWN_ROOM
from tests.adapters import sglang_env

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not sglang_env.have_sglang(),
                       reason="SGLang is not installed here: `make test-vllm` runs these in "
                              ".venv-vllm (pip install --no-deps sglang==0.5.23)"),
]

LAYERS, HEADS, HEAD_DIM, PAGE, DTYPE = 3, 2, 16, 4, "bfloat16"
ITEM = PAGE * HEADS * HEAD_DIM * 2
PAGES, AUX_SLOTS, AUX_ITEMS = 64, 8, (16, 32)


@pytest.fixture(scope="module")
def sgl(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """SGLang's modules, with the kvd plugin loaded by SGLang's ``load_plugins()``."""
    sglang_env.prepare_imports()
    sglang_env.load_kvd_plugin(tmp_path_factory.mktemp("entry"))
    import sglang.srt.disaggregation.utils as utils
    from sglang.srt.disaggregation.base import conn as base
    from sglang.srt.disaggregation.common.conn import KVTransferError
    from sglang.srt.server_args import ServerArgs

    return argparse.Namespace(utils=utils, base=base, KVTransferError=KVTransferError,
                              ServerArgs=ServerArgs, backend=utils.TransferBackend("kvd"))


class Rank:
    """One engine rank's KV pool (K buffers, then V buffers) and aux buffers in /dev/shm."""

    def __init__(self, seed: int, page_size: int = PAGE, head_dim: int = HEAD_DIM) -> None:
        self.page_size, self.item = page_size, page_size * HEADS * head_dim * 2
        kv = [PAGES * self.item] * (2 * LAYERS)
        aux = [AUX_SLOTS * n for n in AUX_ITEMS]
        self.pool = ShmPool(ShmPool.size_for(kv + aux))
        self.pool.bytes[:] = np.random.default_rng(seed).integers(0, 256, self.pool.nbytes,
                                                                   dtype=np.uint8)
        self.kv = [self.pool.alloc(n)[0].reshape(PAGES, self.item) for n in kv]
        self.aux = [self.pool.alloc(n)[0].reshape(AUX_SLOTS, k) for n, k in zip(aux, AUX_ITEMS,
                                                                                 strict=True)]

    def kv_args(self, sgl: Any, rank: int = 0, start_layer: int | None = 0) -> Any:
        """A ``KVArgs`` filled the way SGLang's ``_init_kv_manager`` fills it."""
        a = sgl.utils.get_kv_class(sgl.backend, sgl.utils.KVClassType.KVARGS)()
        a.engine_rank, a.pp_rank, a.system_dp_rank = rank, 0, 0
        a.kv_cache_dtype_str, a.kv_layout = DTYPE, "nhd"
        if start_layer is not None:  # prefill only
            a.prefill_start_layer, a.prefill_end_layer = start_layer, start_layer + LAYERS
        a.kv_data_ptrs = [int(b.ctypes.data) for b in self.kv]
        a.kv_data_lens = [int(b.nbytes) for b in self.kv]
        a.kv_item_lens = [self.item] * len(self.kv)
        a.num_draft_entries, a.state_data_ptrs, a.state_types = 0, [], []
        a.kv_head_num, a.total_kv_head_num, a.page_size = HEADS, HEADS, self.page_size
        a.aux_data_ptrs = [int(b.ctypes.data) for b in self.aux]
        a.aux_data_lens = [int(b.nbytes) for b in self.aux]
        a.aux_item_lens = list(AUX_ITEMS)
        a.ib_device, a.gpu_id = None, 0
        return a

    def close(self) -> None:
        self.kv, self.aux = [], []
        self.pool.close()


@dataclass
class Pd:
    kvd_p: DaemonProcess
    kvd_d: DaemonProcess
    p: Rank
    d: Rank
    mgr_p: Any
    mgr_d: Any
    bootstrap: str


def manager(sgl: Any, daemon: DaemonProcess, rank: Rank, mode: str, **kv: Any) -> Any:
    """A manager as the scheduler makes it (socket from SGLANG_KVD_SOCKET)."""
    os.environ["SGLANG_KVD_SOCKET"] = daemon.socket
    server_args = sgl.ServerArgs(model_path="unused", disaggregation_mode=mode,
                                 disaggregation_transfer_backend="kvd")
    cls = sgl.utils.get_kv_class(sgl.backend, sgl.utils.KVClassType.MANAGER)
    args = rank.kv_args(sgl, start_layer=0 if mode == "prefill" else None, **kv)
    return cls(args, sgl.utils.DisaggregationMode(mode), server_args, False)


@pytest.fixture(scope="module")
def pd(sgl: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pd]:
    work = tmp_path_factory.mktemp("sgl-pd")
    # the engine side gets the cluster secret the daemons got (kvd's /route is signed)
    os.environ["KVD_CLUSTER_SECRET"] = LAUNCH_SECRET
    kvd_p = start_daemon("prefill", work, serve_bootstrap=True, bootstrap_timeout=4.0,
                         waiting_timeout=4.0)
    kvd_d = start_daemon("decode", work, heartbeat_interval=0.5, heartbeat_max_failures=2)
    p, d = Rank(1), Rank(2)
    try:
        pd = Pd(kvd_p, kvd_d, p, d, manager(sgl, kvd_p, p, "prefill"),
                manager(sgl, kvd_d, d, "decode"), kvd_p.http_addr)
        yield pd
    finally:
        p.close()
        d.close()
        kvd_p.stop()
        kvd_d.stop()


_rooms = iter(range(7000, 8000))


def wait_for(fn: Callable[[], Any], want: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got in want or time.monotonic() > deadline:
            return got
        time.sleep(0.005)


def test_plugin_selects_kvd_through_sglangs_own_hooks(sgl: Any) -> None:
    utils = sgl.utils
    assert utils.TransferBackend("kvd").value == "kvd"
    assert {m.value for m in utils.TransferBackend} >= {"mooncake", "nixl", "fake", "kvd"}
    names = {t: utils.get_kv_class(sgl.backend, t).__name__ for t in utils.KVClassType}
    assert names == {utils.KVClassType.KVARGS: "KVArgs",
                     utils.KVClassType.MANAGER: "KvdKVManager",
                     utils.KVClassType.SENDER: "KvdKVSender",
                     utils.KVClassType.RECEIVER: "KvdKVReceiver",
                     utils.KVClassType.BOOTSTRAP_SERVER: "KvdKVBootstrapServer"}
    mooncake = utils.get_kv_class(utils.TransferBackend.MOONCAKE, utils.KVClassType.KVARGS)
    assert mooncake is sgl.base.KVArgs  # other backends still go to SGLang's function
    for kind in ("MANAGER", "SENDER", "RECEIVER", "BOOTSTRAP_SERVER"):
        cls = utils.get_kv_class(sgl.backend, utils.KVClassType[kind])
        base = getattr(sgl.base, f"BaseKV{kind.title().replace('_', '')}")
        assert issubclass(cls, base)
    parser = argparse.ArgumentParser()
    sgl.ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", "m", "--disaggregation-mode", "decode",
                            "--disaggregation-transfer-backend", "kvd"])
    assert sgl.ServerArgs.from_cli_args(ns).disaggregation_transfer_backend == "kvd"
    from sglang.srt.managers import disagg_service  # a module that imported the names

    assert disagg_service.TransferBackend("kvd") is sgl.backend


def test_bootstrap_server_is_the_prefill_kvd(sgl: Any, pd: Pd) -> None:
    cls = sgl.utils.get_kv_class(sgl.backend, sgl.utils.KVClassType.BOOTSTRAP_SERVER)
    host, port = pd.bootstrap.rsplit(":", 1)
    assert cls(host=host, port=int(port)).check()
    assert pd.mgr_d.try_ensure_parallel_info(pd.bootstrap)
    info = pd.mgr_d.prefill_info_table[pd.bootstrap]
    assert (info.attn_tp_size, info.dp_size, info.pp_size, info.follow_bootstrap_room) == \
        (1, 1, 1, True)


def _start_pair(sgl: Any, pd: Pd, room: int, dst: np.ndarray, aux: int) -> tuple[Any, Any]:
    """Prefill sender (bootstrap queue) and decode receiver up to send_metadata."""
    utils = sgl.utils
    sender = utils.get_kv_class(sgl.backend, utils.KVClassType.SENDER)(
        mgr=pd.mgr_p, bootstrap_addr=pd.bootstrap, bootstrap_room=room,
        req_has_disagg_prefill_dp_rank=False)
    receiver = utils.get_kv_class(sgl.backend, utils.KVClassType.RECEIVER)(
        mgr=pd.mgr_d, bootstrap_addr=pd.bootstrap, bootstrap_room=room)
    assert receiver.poll() == sgl.base.KVPoll.Bootstrapping
    assert pd.mgr_d.try_ensure_parallel_info(pd.bootstrap)
    receiver.init(0)  # prefill dp_size 1 -> dp rank 0 (decode.py _resolve_prefill_dp_rank)
    polls = sgl.base.KVPoll
    assert wait_for(receiver.poll, (polls.WaitingForInput, polls.Failed)) == \
        polls.WaitingForInput
    receiver.send_metadata(dst.astype(np.int32), aux)
    return sender, receiver


def test_transfer_in_chunks_lands_every_byte(sgl: Any, pd: Pd) -> None:
    polls, room = sgl.base.KVPoll, next(_rooms)
    src, dst = np.array([5, 9, 2, 40, 41, 42, 7]), np.array([60, 1, 33, 34, 35, 8, 20])
    pd.p.aux[0][3], pd.p.aux[1][3] = 7, 9
    sender, receiver = _start_pair(sgl, pd, room, dst, aux=6)
    assert wait_for(sender.poll, (polls.WaitingForInput, polls.Failed)) == \
        polls.WaitingForInput
    sender.init(len(src), 3)
    for i in range(0, len(src), 3):  # one send per prefill chunk
        sender.send(src[i:i + 3].astype(np.int32))
    assert wait_for(sender.poll, (polls.Success, polls.Failed)) == polls.Success
    assert wait_for(receiver.poll, (polls.Success, polls.Failed)) == polls.Success
    for mine, theirs in zip(pd.d.kv, pd.p.kv, strict=True):
        assert np.array_equal(mine[dst], theirs[src])
    assert all(np.array_equal(d[6], p[3]) for d, p in zip(pd.d.aux, pd.p.aux, strict=True))
    metric = sender.get_transfer_metric()
    assert metric.transfer_total_bytes == 2 * LAYERS * len(src) * ITEM + sum(AUX_ITEMS)
    receiver.clear()
    sender.clear()


def test_many_rooms_poll_in_one_rpc_per_round(sgl: Any, pd: Pd) -> None:
    polls = sgl.base.KVPoll
    rooms = [next(_rooms) for _ in range(8)]
    pairs = [_start_pair(sgl, pd, r, np.array([10 + i]), aux=i % AUX_SLOTS)
             for i, r in enumerate(rooms)]
    calls = []
    original = pd.mgr_p.client.call

    def counting(call: Any) -> Any:
        calls.append(type(call).__name__)
        return original(call)

    pd.mgr_p.client.call = counting
    # a round of 8 polls must fit in one refresh period: on a loaded 2-core machine it can
    # take longer than the default 2 ms, which would look like "one RPC per room" although
    # the board shares each RPC among all rooms
    max_age, pd.mgr_p.board.max_age = pd.mgr_p.board.max_age, 1.0
    try:
        for s, _ in pairs:
            wait_for(s.poll, (polls.WaitingForInput,))
        for i, (s, _) in enumerate(pairs):
            s.init(1, i % AUX_SLOTS)
            s.send(np.array([20 + i], dtype=np.int32))
        calls.clear()
        deadline = time.monotonic() + 20
        states: list[int] = []
        rounds = 0
        while time.monotonic() < deadline:  # one scheduler step polls every room
            rounds += 1
            states = [s.poll() for s, _ in pairs]
            if all(x in (polls.Success, polls.Failed) for x in states):
                break
            time.sleep(0.003)
        assert states == [polls.Success] * len(rooms)
        # Not one RPC per room per step (8 rooms): at most one refresh per step, plus one
        # when a step spans the board's refresh period on a loaded machine.
        assert calls.count("Poll") <= 2 * rounds
        calls.clear()  # ended rooms' reasons and stats are in: the status table answers
        pd.mgr_p.board.max_age = 0.0  # (issue 21) every refresh, no RPC
        assert [s.poll() for s, _ in pairs] == [polls.Success] * len(rooms)
        assert pd.mgr_p.client.table is not None and calls == []
    finally:
        pd.mgr_p.client.call, pd.mgr_p.board.max_age = original, max_age
    for s, r in pairs:
        assert wait_for(r.poll, (polls.Success, polls.Failed)) == polls.Success
        r.clear()
        s.clear()


def _transfer(sgl: Any, pd: Pd, room: int, src: np.ndarray, dst: np.ndarray,
              aux: int) -> tuple[Any, Any]:
    """One room moved as SGLang's schedulers move it, polled until both sides read
    Success; its pages compared byte for byte."""
    polls = sgl.base.KVPoll
    sender, receiver = _start_pair(sgl, pd, room, dst, aux)
    assert wait_for(sender.poll, (polls.WaitingForInput, polls.Failed)) == \
        polls.WaitingForInput
    sender.init(len(src), aux)
    sender.send(src.astype(np.int32))
    assert wait_for(sender.poll, (polls.Success, polls.Failed)) == polls.Success
    assert wait_for(receiver.poll, (polls.Success, polls.Failed)) == polls.Success
    for mine, theirs in zip(pd.d.kv, pd.p.kv, strict=True):
        assert np.array_equal(mine[dst], theirs[src])
    return sender, receiver


def _count_waits(client: Any, log: list[str]) -> None:
    """Log each socket call of ``client`` and each time it blocks on its ring (a wait
    whose condition does not hold yet); undone by deleting the instance attributes."""
    exchange, wait = client._exchange, client.ring._wait

    def counting_exchange(call: Any, kind: Any) -> Any:
        log.append(f"socket {type(call).__name__}")
        return exchange(call, kind)

    def counting_wait(ready: Any, timeout: float) -> None:
        if not ready():
            log.append("ring wait")
        wait(ready, timeout)

    client._exchange, client.ring._wait = counting_exchange, counting_wait


def test_a_clear_of_an_ended_room_is_one_ring_record_not_waited_for(sgl: Any, pd: Pd) -> None:
    """Issue 21: SGLang clears a room once it read it ended. The backend's clear of such a
    room is a ring record the scheduler thread does not wait for: four rooms cleared on
    both sides make not one socket call and not one wait on the ring (counted, not
    timed). kvd runs each clear before the calls made after it: a room of the same id
    created at once moves byte for byte, and the others read unknown once kvd ran them.
    A room not read ended (aborted and cleared before a poll) is cleared waited for."""
    rooms = [next(_rooms) for _ in range(4)]
    pairs = [_transfer(sgl, pd, r, np.array([30 + i]), np.array([40 + i]), aux=i)
             for i, r in enumerate(rooms)]
    clients = [pd.mgr_p.client, pd.mgr_d.client]
    made: list[str] = []
    for client in clients:
        assert client.ring is not None
        _count_waits(client, made)
    try:
        for s, r in pairs:
            r.clear()
            s.clear()
    finally:
        for client in clients:
            del client._exchange  # type: ignore[attr-defined]
            del client.ring._wait  # type: ignore[union-attr]
    assert made == []
    again = _transfer(sgl, pd, rooms[0], np.array([50, 51]), np.array([52, 53]), aux=5)
    for client in clients:
        ring = client.ring
        assert ring is not None
        assert wait_for(ring.drained, (True,)) is True
        assert poll_array(client, np.array(rooms[1:], dtype=np.uint64)).tolist() == \
            [UNKNOWN_ROOM] * 3
    again[1].clear()
    again[0].clear()
    # a room not read ended (aborted, then cleared before a poll) is cleared waited for
    sender, receiver = _start_pair(sgl, pd, next(_rooms), np.array([60]), aux=6)
    receiver.abort()
    sender.abort()
    asked: list[bool] = []
    for side in (receiver.receiver, sender.sender):
        clear = side.clear
        side.clear = lambda *a, _c=clear, **kw: asked.append(kw["wait"]) or _c(*a, **kw)
    receiver.clear()
    sender.clear()
    assert asked == [True, True]


def test_a_send_kvd_refuses_through_the_ring_fails_the_room_at_its_next_poll(
        sgl: Any, pd: Pd) -> None:
    """Issue 21: a send goes through kvd's submission ring and returns at once; kvd's
    refusal (a page beyond the pool) fails the room at its next ``poll()``, with kvd's
    reason in SGLang's error type."""
    polls, room = sgl.base.KVPoll, next(_rooms)
    sender, receiver = _start_pair(sgl, pd, room, np.array([3]), aux=0)
    assert pd.mgr_p.client.ring is not None
    assert wait_for(sender.poll, (polls.WaitingForInput, polls.Failed)) == \
        polls.WaitingForInput
    sender.init(1, 0)
    sender.send(np.array([PAGES + 9], dtype=np.int32))  # no answer waited for
    assert wait_for(sender.poll, (polls.Failed, polls.Success)) == polls.Failed
    with pytest.raises(sgl.KVTransferError, match="refused"):
        sender.failure_exception()
    receiver.abort()
    receiver.clear()


def test_decode_abort_fails_the_prefill_and_releases_pages(sgl: Any, pd: Pd) -> None:
    polls, room = sgl.base.KVPoll, next(_rooms)
    sender, receiver = _start_pair(sgl, pd, room, np.array([50, 51]), aux=1)
    receiver.abort()  # e.g. the decode request was cancelled
    assert receiver.poll() == polls.Failed
    assert receiver.abort_notified
    assert wait_for(receiver.is_abort_release_safe, (True,)) is True
    assert wait_for(sender.poll, (polls.Failed, polls.Success)) == polls.Failed
    with pytest.raises(sgl.KVTransferError) as err:
        sender.failure_exception()
    assert err.value.bootstrap_room == room and "abort" in str(err.value)
    receiver.clear()


def test_prefill_without_decode_times_out_with_the_engines_error(sgl: Any, pd: Pd) -> None:
    polls, room = sgl.base.KVPoll, next(_rooms)
    sender = sgl.utils.get_kv_class(sgl.backend, sgl.utils.KVClassType.SENDER)(
        mgr=pd.mgr_p, bootstrap_addr=pd.bootstrap, bootstrap_room=room)
    assert sender.poll() == polls.Bootstrapping
    assert wait_for(sender.poll, (polls.Failed,), timeout=15) == polls.Failed  # 4 s deadline
    with pytest.raises(sgl.KVTransferError, match=r"timeout|timed out|Bootstrapping"):
        sender.failure_exception()


def test_unreachable_prefill_fails_the_receiver(sgl: Any, pd: Pd) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"
    polls, room = sgl.base.KVPoll, next(_rooms)
    assert not pd.mgr_d.try_ensure_parallel_info(nobody)
    receiver = sgl.utils.get_kv_class(sgl.backend, sgl.utils.KVClassType.RECEIVER)(
        mgr=pd.mgr_d, bootstrap_addr=nobody, bootstrap_room=room)
    receiver.init(0)
    assert wait_for(receiver.poll, (polls.Failed,), timeout=20) == polls.Failed
    with pytest.raises(sgl.KVTransferError) as err:
        receiver.failure_exception()
    assert nobody in str(err.value) or "unreachable" in str(err.value)
    receiver.clear()


def test_incompatible_decode_layout_fails_with_a_reason(sgl: Any, pd: Pd,
                                                        tmp_path: Path) -> None:
    """A decode rank with another head size registers fine locally, but the prefill kvd
    refuses its pages and the room fails naming both values -- as SGLang's error type.
    (Another page size alone is re-tiled since issue 22 item 3: not incompatible.)"""
    kvd_d2 = start_daemon("decode", tmp_path)
    d2 = Rank(3, head_dim=2 * HEAD_DIM)
    try:
        mgr = manager(sgl, kvd_d2, d2, "decode")
        polls, room = sgl.base.KVPoll, next(_rooms)
        receiver = sgl.utils.get_kv_class(sgl.backend, sgl.utils.KVClassType.RECEIVER)(
            mgr=mgr, bootstrap_addr=pd.bootstrap, bootstrap_room=room)
        sender = sgl.utils.get_kv_class(sgl.backend, sgl.utils.KVClassType.SENDER)(
            mgr=pd.mgr_p, bootstrap_addr=pd.bootstrap, bootstrap_room=room)
        receiver.init(0)
        if wait_for(receiver.poll, (polls.Failed, polls.WaitingForInput)) != polls.Failed:
            receiver.send_metadata(np.array([1, 2], dtype=np.int32), 0)  # refused by prefill
        assert wait_for(receiver.poll, (polls.Failed, polls.Success)) == polls.Failed
        with pytest.raises(sgl.KVTransferError, match="head_dim"):
            receiver.failure_exception()
        assert wait_for(sender.poll, (polls.Failed, polls.Success)) == polls.Failed
        receiver.clear()
        sender.clear()
    finally:
        d2.close()
        kvd_d2.stop()


def test_kv_pool_outside_shared_memory_is_refused(sgl: Any, pd: Pd) -> None:
    from kvd.adapters.sglang.kvargs import KVArgsError

    rank = Rank(4)
    try:
        args = rank.kv_args(sgl)
        private = np.zeros(PAGES * ITEM, dtype=np.uint8)  # ordinary process memory
        args.kv_data_ptrs[0] = int(private.ctypes.data)
        cls = sgl.utils.get_kv_class(sgl.backend, sgl.utils.KVClassType.MANAGER)
        os.environ["SGLANG_KVD_SOCKET"] = pd.kvd_p.socket
        with pytest.raises(KVArgsError, match="anonymous or private memory"):
            cls(args, sgl.utils.DisaggregationMode.PREFILL, None, False)
    finally:
        rank.close()


def test_a_room_read_failed_only_because_kvd_was_unreachable_is_cleared_waited(
        sgl: Any) -> None:
    """The board reads every live room Failed (and releasable) when kvd cannot be reached,
    but kvd never said those rooms ended (a timeout is no death): their clear must be
    waited for, so a refusal is heard, never kept silently under an id SGLang will not
    clear again. Once kvd answers again, the room is settled as kvd says."""
    from kvd.adapters.sglang.conn import _Board
    from kvd.errors import KvdUnreachable
    from kvd.protocol import rpc
    from kvd.rooms import KVPoll

    class Client:
        reachable = False

        def read_table(self, rooms: Any) -> None:
            return None

        def call(self, msg: Any) -> Any:
            if not self.reachable:
                raise KvdUnreachable("kvd did not answer in time")
            return rpc.PollResult(statuses=[int(KVPoll.Success)] * len(msg.rooms),
                                  releasable=list(msg.rooms))

    client = Client()
    board = _Board(client, max_age=0.0)  # type: ignore[arg-type]
    board.add(7)
    assert board.get(7) == int(KVPoll.Failed)
    assert not board.settled(7)  # read Failed by the fallback: its clear waits
    client.reachable = True
    assert board.get(7) == int(KVPoll.Success)
    assert board.settled(7)  # kvd said it ended and is releasable
