"""The SGLang adapter's state mapping on real daemons over real Mooncake, without SGLang:
``KVArgs`` shaped as SGLang 0.5.23 fills them for a Mamba hybrid pool
(``kvd.adapters.sglang.kvargs.registration_state``), rooms named as the backend names them
(``room_state``; the prefill announces the state with its last chunk, as
``KvdKVSender.send`` does). A prefill of attention TP 1 feeds a decode of TP 2: the KV and
every head-major state slot are resharded, each decode rank holding its half of SGLang's
rows, byte for byte; a GDN conv state (sub-blocks sharded on their own) is refused at
pairing with the buffer named. SGLang's own classes drive the same mapping in
``tests/adapters/test_sglang_state_backend.py`` (where SGLang is installed)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from kvd.adapters.sglang.kvargs import SglState, registration_state, room_state
from kvd.adapters.shmmaps import read_maps
from kvd.client import KvdClient, KVPoll, Receiver, Sender, ShmPool
from kvd.launch import DaemonProcess, start_daemon
from kvd.protocol.rpc import EngineRanks

pytestmark = [pytest.mark.integration]

PAGE, TOTAL_HEADS, HEAD_DIM, PAGES, SLOTS, AUX = 4, 2, 8, 16, 5, 16
CONV_ROWS, CONV_ROW, SSM_HEADS, SSM_HEAD = 16, 3 * 2, 4, 4 * 4 * 4  # whole-model rows


class SglRank:
    """One rank's SGLang-shaped pools in /dev/shm (random bytes) registered with its kvd:
    full-attention layers 0 and 2, Mamba layers 1 and 3 (a conv then a temporal tensor per
    layer, ``tp``-sharded by rows), as ``HybridLinearKVPool`` describes them."""

    def __init__(self, daemon: DaemonProcess, tp_rank: int, tp: int, seed: int,
                 groups: list[int] | None = None) -> None:
        self.daemon = daemon
        heads = TOTAL_HEADS // tp
        self.item = PAGE * heads * HEAD_DIM * 2
        self.items = [CONV_ROWS // tp * CONV_ROW] * 2 + [SSM_HEADS // tp * SSM_HEAD] * 2
        sizes = [PAGES * self.item] * 4 + [SLOTS * n for n in self.items] + [8 * AUX]
        self.pool = ShmPool(ShmPool.size_for(sizes))
        self.pool.bytes[:] = np.random.default_rng(seed).integers(0, 256, self.pool.nbytes,
                                                                   dtype=np.uint8)
        self.kv = [self.pool.alloc(PAGES * self.item)[0].reshape(PAGES, self.item)
                   for _ in range(4)]
        self.state = [self.pool.alloc(SLOTS * n)[0].reshape(SLOTS, n) for n in self.items]
        self.aux = self.pool.alloc(8 * AUX)[0].reshape(8, AUX)
        rows = [CONV_ROWS // tp] * 2 + [SSM_HEADS // tp] * 2
        args = SimpleNamespace(
            kv_data_ptrs=[int(b.ctypes.data) for b in self.kv],
            kv_data_lens=[int(b.nbytes) for b in self.kv], kv_item_lens=[self.item] * 4,
            kv_layer_ids=[0, 2, 0, 2], aux_data_ptrs=[int(self.aux.ctypes.data)],
            aux_data_lens=[int(self.aux.nbytes)], aux_item_lens=[AUX], page_size=PAGE,
            kv_head_num=heads, total_kv_head_num=TOTAL_HEADS, kv_cache_dtype_str="bfloat16",
            kv_layout="nhd", prefill_start_layer=0, num_draft_entries=0,
            state_types=[SimpleNamespace(value="mamba")],
            state_data_ptrs=[[int(b.ctypes.data) for b in self.state]],
            state_data_lens=[[int(b.nbytes) for b in self.state]],
            state_item_lens=[self.items], state_layer_ids=[[1, 3, 1, 3]],
            state_dim_per_tensor=[rows], state_slice_outer_counts=[[1] * 4],
            state_conv_shard_groups=[[groups, groups, None, None]])
        ranks = EngineRanks(attn_tp_rank=tp_rank, attn_tp_size=tp)
        reg, self.sgl = registration_state(args, False, read_maps(), ranks=ranks)
        self.client = KvdClient(daemon.socket)
        self.client.call(msgspec.structs.replace(reg, ranks=ranks))

    @property
    def st(self) -> SglState:
        return self.sgl

    def close(self) -> None:
        self.client.close()
        self.kv, self.state = [], []
        self.pool.close()
        self.daemon.stop()


def _run_room(ranks: list[SglRank], room: int, src: np.ndarray, dst: np.ndarray,
              src_slot: int, dst_slot: int) -> tuple[Sender, list[Receiver]]:
    p = ranks[0]
    receivers = []
    for r in ranks[1:]:
        rec = Receiver(r.client, room, p.daemon.http_addr)
        index, window = room_state(r.st.types, [np.array([dst_slot])], dst)  # decode payload
        rec.init(dst, 3, state_index=index, window_pages=window)
        receivers.append(rec)
    send = Sender(p.client, room)
    send.init(len(src), 1)  # SGLang's sender.init: no state yet
    send.send(src[:2])
    index, window = room_state(p.st.types, [[src_slot]], src)  # with the last chunk
    send.init(len(src), 1, state_index=index, window_pages=window)
    send.send(src[2:])
    return send, receivers


def test_sglang_mamba_state_reshards_tp1_to_tp2_byte_for_byte(tmp_path: Path) -> None:
    ranks: list[SglRank] = []
    try:
        p = start_daemon("prefill", tmp_path, serve_bootstrap=True)
        ranks.append(SglRank(p, 0, 1, seed=1))
        for tp in (0, 1):
            d = start_daemon("decode", tmp_path, attn_tp_size=2, attn_tp_rank=tp)
            ranks.append(SglRank(d, tp, 2, seed=10 + tp))
        before = [[b.copy() for b in r.state] for r in ranks[1:]]
        src, dst = np.array([3, 9, 4, 12]), np.array([7, 0, 15, 2])
        send, receivers = _run_room(ranks, 31, src, dst, src_slot=2, dst_slot=4)
        assert [rec.wait(30) for rec in receivers] == [KVPoll.Success] * 2, \
            [rec.failure() for rec in receivers]
        assert send.wait(30) == KVPoll.Success
        sp = ranks[0]
        for tp, r in enumerate(ranks[1:]):
            for mine, theirs in zip(r.kv, sp.kv, strict=True):  # NHD: token, head, dim
                half = theirs[src].reshape(len(src), PAGE, TOTAL_HEADS, -1)[:, :, tp]
                assert np.array_equal(mine[dst].reshape(half.shape), half)
            assert np.array_equal(r.aux[3], sp.aux[1])
            for mine, theirs, old in zip(r.state, sp.state, before[tp], strict=True):
                n = mine.shape[1]  # this rank's rows of SGLang's head-major slot
                assert np.array_equal(mine[4], theirs[2][tp * n:(tp + 1) * n])
                assert np.array_equal(np.delete(mine, 4, axis=0), np.delete(old, 4, axis=0))
    finally:
        for r in ranks:
            r.close()


def test_sglang_conv_sub_blocks_between_tp_sizes_are_refused_naming_the_buffer(
        tmp_path: Path) -> None:
    """A GDN conv state (q, k, v sub-blocks, each sharded on its own) moves only as a whole
    slot per rank: prefill TP 1 -> decode TP 2 is refused at pairing, the room failing with
    the buffer named; the adapter's own reason (what the SGLang receiver aborts with) names
    it too."""
    ranks: list[SglRank] = []
    try:
        p = start_daemon("prefill", tmp_path, serve_bootstrap=True)
        ranks.append(SglRank(p, 0, 1, seed=1, groups=[4, 4, 8]))
        d = start_daemon("decode", tmp_path, attn_tp_size=2, attn_tp_rank=0)
        ranks.append(SglRank(d, 0, 2, seed=10, groups=[4, 4, 8]))
        why = ranks[1].st.tp_refusal(1, 2)
        assert why is not None and "layer 1 mamba0 (conv sub-blocks [4, 4, 8]" in why
        send, (rec,) = _run_room(ranks, 32, np.array([1, 2, 3]), np.array([4, 5, 6]), 0, 1)
        assert rec.wait(30) == KVPoll.Failed
        kind, reason = rec.failure()
        assert "mamba0" in reason and "total_heads 1 vs 2" in reason, (kind, reason)
        assert send.wait(30) == KVPoll.Failed
    finally:
        for r in ranks:
            r.close()
