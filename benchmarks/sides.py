"""One engine rank per process, for the room benchmarks: kvd's client, or SGLang's own
Mooncake connector (``MooncakeKVManager``) in-process with CPU KV buffers over the same
transfer engine (TCP). Both expose ``start(room)``, ``poll(rooms)``, ``clear(room)``.

Pools are deterministic (buffer ``b`` of a prefill rank holds ``rng(100 + b)`` bytes), so
a decode process checks every room's bytes without seeing the prefill's memory. Room
``r`` moves prefill page ``r % PAGES`` to decode page ``r % PAGES`` (rooms in flight
never exceed ``PAGES``) and its aux slot ``r % AUX_SLOTS``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

PAGES, AUX_SLOTS, AUX_ITEM = 1024, 1024, 64  # a slot per page (K42)
SUCCESS, FAILED = 4, 0


def expected_kv(layers: int, item: int, pages: int = PAGES) -> list[np.ndarray]:
    """The prefill rank's KV buffers (K of every layer, then V): ``[pages, item]`` each."""
    return [np.random.default_rng(100 + b).integers(0, 256, (pages, item), dtype=np.uint8)
            for b in range(2 * layers)]


class KvdSide:
    """An engine rank that talks to its kvd (``kvd.client``)."""

    def __init__(self, role: str, socket: str, bootstrap: str, layers: int, item: int,
                 pages: int = PAGES, ring: bool = False) -> None:
        from kvd.client import Receiver, Sender, poll_array, poll_many
        from kvd.protocol import rpc
        from kvd.protocol.codec import pack_indices
        from kvd.refengine.standin import EngineStandIn

        self.role, self.bootstrap = role, bootstrap
        self._Sender, self._Receiver, self._poll, self._rpc = Sender, Receiver, poll_many, rpc
        self._pack = pack_indices
        # ring: room calls through the submission ring, polls from the status table
        # (issue 21); step() then submits a round's calls with ONE wait (submit_all)
        self.ring, self._poll_array = ring, poll_array
        opts = {"use_ring": True} if ring else {}  # (an older kvd's stand-in has no ring)
        self.eng = EngineStandIn(socket, num_layers=layers, num_pages=pages, item_len=item,
                                 aux_slots=AUX_SLOTS, aux_item_len=AUX_ITEM, seed=7, **opts)
        if ring and self.eng.client.ring is None:
            raise RuntimeError("kvd served no submission ring (engine_channel off?)")
        if role == "prefill":
            for mine, want in zip(self.eng.kv, expected_kv(layers, item, pages), strict=True):
                mine[:] = want
        self.client = self.eng.client
        import inspect  # an older kvd's Wait has no any_done (before/after runs)

        if "any_done" not in inspect.signature(self.client.wait).parameters:
            self.wait_any = None  # type: ignore[assignment]
        self.times: list[float] = []  # seconds of each init (decode) / send (prefill) call

    def start(self, room: int) -> None:
        page = np.array([room % PAGES])
        if self.role == "decode":
            r = self._Receiver(self.client, room, self.bootstrap)
            t = time.perf_counter()
            r.init(page, room % AUX_SLOTS)
            self.times.append(time.perf_counter() - t)
        else:
            s = self._Sender(self.client, room)
            s.init(1, room % AUX_SLOTS)
            t = time.perf_counter()
            s.send(page)
            self.times.append(time.perf_counter() - t)

    def bulk(self, room: int, pages: np.ndarray) -> None:
        """One room of many pages, one chunk (prefill: ``pages`` are sources)."""
        if self.role == "decode":
            self._Receiver(self.client, room, self.bootstrap).init(pages, 0)
        else:
            s = self._Sender(self.client, room)
            s.init(int(pages.size), 0)
            s.send(pages)

    def poll(self, rooms: list[int]) -> list[int]:
        if self.ring:
            return self._poll_array(self.client, np.array(rooms, dtype=np.uint64)).tolist()
        return [int(s) for s in self._poll(self.client, rooms)]

    def step(self, starts: list[int], clears: list[int], polls: list[int]) -> list[int]:
        """Start rooms ``starts`` (decode: create + init; prefill: create + init + send),
        clear rooms ``clears``, and poll ``polls``, in ONE round trip (``Many``); returns
        the polled statuses. A start or clear that kvd refuses raises."""
        rpc, calls = self._rpc, []
        for room in starts:
            page = self._pack(np.array([room % PAGES]))
            if self.role == "decode":
                calls += [rpc.ReceiverCreate(room=room, bootstrap_addr=self.bootstrap),
                          rpc.ReceiverInit(room=room, dst_pages=page, aux_index=room % AUX_SLOTS)]
            else:
                calls += [rpc.SenderCreate(room=room),
                          rpc.SenderInit(room=room, num_pages=1, aux_index=room % AUX_SLOTS),
                          rpc.SenderSend(room=room, pages=page, is_last=True)]
        calls += [rpc.Clear(room=room) for room in clears]
        if self.ring:  # the round's calls through the ring, one wait; polls from the table
            refused = self.client.submit_all(calls) if calls else {}
            if refused:
                raise next(iter(refused.values()))
            return self.poll(polls) if polls else []
        calls.append(rpc.Poll(rooms=polls))
        out = self.client.call_many(calls)
        failed = [x for x in out if isinstance(x, Exception)]
        if failed:
            raise failed[0]
        return [int(x) for x in out[-1].statuses]

    def wait_any(self, rooms: list[int], timeout: float) -> list[int]:
        """Statuses once one of ``rooms`` ended, or after ``timeout`` s: ONE ``Wait``
        (``any_done``) in kvd instead of a poll loop."""
        result = self.client.wait(rooms, timeout, any_done=True)
        return [int(s) for s in result.statuses]

    def clear(self, room: int) -> None:
        if self.ring:
            self.client.submit(self._rpc.Clear(room=room), wait=True)
        else:
            self.client.call(self._rpc.Clear(room=room))

    def kv(self) -> list[np.ndarray]:
        return self.eng.kv

    def close(self) -> None:
        self.eng.close()


def _sglang() -> Any:
    here = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(here / "tests" / "adapters"))
    import sglang_env

    sglang_env.prepare_imports()
    import sglang.srt.disaggregation.mooncake.conn as conn
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as te
    from sglang.srt.server_args import ServerArgs

    return conn, KVArgs, DisaggregationMode, te, ServerArgs


#: This process's place in its (single-rank) instance, as SGLang's launcher would stamp it.
#: (``pp_group`` is only used with pipeline parallelism; pp_size is 1 here.)
_RANKS: dict[str, int] = {"attn_tp_rank": 0, "attn_cp_rank": 0, "attn_dcp_rank": 0,
                          "attn_dp_rank": 0, "pp_group": 0}


class SglangSide:
    """An engine rank running SGLang 0.5.23's ``MooncakeKVManager`` in-process, driven the
    way its prefill/decode schedulers drive it (``tests/adapters/test_sglang_backend.py``
    documents the order); CPU buffers, TCP transport (``MC_FORCE_TCP=1``)."""

    def __init__(self, role: str, bootstrap_port: int, layers: int, item: int,
                 pages: int = PAGES) -> None:
        os.environ["MC_FORCE_TCP"] = "1"
        # Its default puts every entry of a room in one batch call, which the TCP transport
        # refuses above 1024 queued per peer: bound it to 64 pages x buffers per call.
        os.environ.setdefault("SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES", "64")
        conn, KVArgs, Mode, te, ServerArgs = _sglang()
        self.conn, self.role = conn, role
        self.bootstrap = f"127.0.0.1:{bootstrap_port}"
        te.init_mooncake_transfer_engine("127.0.0.1")
        rng_kv = (expected_kv(layers, item, pages) if role == "prefill" else
                  [np.zeros((pages, item), dtype=np.uint8) for _ in range(2 * layers)])
        self._kv = rng_kv
        self.aux = np.zeros((AUX_SLOTS, AUX_ITEM), dtype=np.uint8)
        a = KVArgs()
        a.engine_rank, a.pp_rank, a.system_dp_rank = 0, 0, 0
        a.kv_cache_dtype_str, a.kv_layout = "bfloat16", "nhd"
        if role == "prefill":
            a.prefill_start_layer, a.prefill_end_layer = 0, layers
        a.kv_data_ptrs = [int(b.ctypes.data) for b in self._kv]
        a.kv_data_lens = [int(b.nbytes) for b in self._kv]
        a.kv_item_lens = [item] * len(self._kv)
        a.num_draft_entries, a.state_data_ptrs, a.state_types = 0, [], []
        a.kv_layer_ids = list(range(layers)) * 2
        for name in ("state_data_lens", "state_item_lens", "state_layer_ids",
                     "state_dim_per_tensor", "state_slice_outer_counts",
                     "state_conv_shard_groups"):
            setattr(a, name, [])
        a.is_hybrid_mla_backend, a.swa_kv_cache_layout, a.rust_http_port = False, "nhd", None
        a.kv_head_num = a.total_kv_head_num = 1
        a.page_size = 1
        a.aux_data_ptrs, a.aux_data_lens = [int(self.aux.ctypes.data)], [int(self.aux.nbytes)]
        a.aux_item_lens = [AUX_ITEM]
        a.ib_device, a.gpu_id = None, 0
        if role == "prefill":
            self.server = conn.MooncakeKVBootstrapServer("127.0.0.1", bootstrap_port)
        args = ServerArgs(model_path="unused", disaggregation_mode=role,
                          disaggregation_bootstrap_port=bootstrap_port)
        from sglang.srt.runtime_context import get_context

        get_context().set_server_args(args)  # what the launcher publishes
        get_context().parallel.override_permanently(**_RANKS)  # one rank, no groups
        self.mgr = conn.MooncakeKVManager(a, Mode(role), args, False)
        self.rooms: dict[int, Any] = {}
        self.times: list[float] = []
        self.waiting: dict[int, Any] = {}  # prefill senders not yet given their chunk
        self.chunks: dict[int, np.ndarray] = {}  # bulk rooms: their source pages

    def start(self, room: int) -> None:
        self.bulk(room, np.array([room % PAGES], dtype=np.int32), timed=True)

    def bulk(self, room: int, pages: np.ndarray, timed: bool = False) -> None:
        page = pages.astype(np.int32)
        if self.role == "decode":
            r = self.conn.MooncakeKVReceiver(mgr=self.mgr, bootstrap_addr=self.bootstrap,
                                             bootstrap_room=room)
            self.mgr.try_ensure_parallel_info(self.bootstrap)
            r.init(0)
            t = time.perf_counter()
            while r.poll() == 1:  # Bootstrapping: the scheduler retries next step
                time.sleep(50e-6)
            r.send_metadata(page, room % AUX_SLOTS)
            if timed:
                self.times.append(time.perf_counter() - t)
            self.rooms[room] = r
        else:
            s = self.conn.MooncakeKVSender(mgr=self.mgr, bootstrap_addr=self.bootstrap,
                                           bootstrap_room=room,
                                           req_has_disagg_prefill_dp_rank=False)
            self.rooms[room] = s
            self.waiting[room] = s
            self.chunks[room] = page

    def _feed(self) -> None:
        """Prefill: a sender whose decode metadata arrived gets its (only) chunk."""
        for room, s in list(self.waiting.items()):
            st = s.poll()
            if st == 2:  # WaitingForInput
                t = time.perf_counter()
                pages = self.chunks.pop(room)
                s.init(int(pages.size), room % AUX_SLOTS)
                s.send(pages)
                if pages.size == 1:
                    self.times.append(time.perf_counter() - t)
                del self.waiting[room]
            elif st == FAILED:
                del self.waiting[room]

    def poll(self, rooms: list[int]) -> list[int]:
        if self.role == "prefill":
            self._feed()
        return [int(self.rooms[r].poll()) for r in rooms]

    def clear(self, room: int) -> None:
        obj = self.rooms.pop(room)
        self.waiting.pop(room, None)
        self.chunks.pop(room, None)
        obj.clear()

    def kv(self) -> list[np.ndarray]:
        return self._kv

    def close(self) -> None:
        pass
