"""SGLang hybrid models through the kvd backend: SGLang's real ``KVArgs``, ``StateType``
and backend classes (selected by SGLang's plugin loader), real kvd daemons over Mooncake
TCP. A Mamba hybrid room moves its KV pages, aux and state slots; an SWA room its KV
pages and window pages; each compared byte for byte, and nothing else is written.

Skipped where SGLang is not installed (the main venv): run in ``.venv-bench`` or
``.venv-vllm``. The same mapping runs without SGLang, through kvd's client, in
``tests/integration/test_sglang_state_rooms.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvd.client import ShmPool
from kvd.launch import LAUNCH_SECRET, start_daemon
from kvd.protocol.rpc import EngineRanks
from tests.adapters import sglang_env
from tests.adapters.test_sglang_backend import sgl, wait_for  # noqa: F401 (fixture)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not sglang_env.have_sglang(),
                       reason="SGLang is not installed here: run in .venv-bench or .venv-vllm"),
]

PAGE, HEADS, HEAD_DIM, PAGES, SLOTS, AUX = 4, 2, 16, 32, 6, 32
ITEM = PAGE * HEADS * HEAD_DIM * 2
CONV, SSM = 8 * 3 * 2, 2 * 4 * 4 * 4  # per-slot bytes: [rows, kernel-1] bf16, [heads, d, n] f32
WINDOW = 6


class HybridRank:
    """One rank's pools in /dev/shm: 2 full-attention layers (model layers 0 and 2) and
    either Mamba state of layers 1 and 3 (conv, then temporal tensor per layer) or an SWA
    pool of 2 window layers; random bytes."""

    def __init__(self, seed: int, kind: str) -> None:
        self.kind = kind
        kv = [PAGES * ITEM] * 4
        state = [SLOTS * n for n in (CONV, CONV, SSM, SSM)] if kind == "mamba" else \
            [PAGES * ITEM] * 4
        self.pool = ShmPool(ShmPool.size_for([*kv, *state, 8 * AUX]))
        self.pool.bytes[:] = np.random.default_rng(seed).integers(0, 256, self.pool.nbytes,
                                                                   dtype=np.uint8)
        self.kv = [self.pool.alloc(n)[0].reshape(PAGES, ITEM) for n in kv]
        items = [CONV, CONV, SSM, SSM] if kind == "mamba" else [ITEM] * 4
        self.state = [self.pool.alloc(n)[0].reshape(-1, i) for n, i in zip(state, items,
                                                                             strict=True)]
        self.aux = self.pool.alloc(8 * AUX)[0].reshape(8, AUX)

    def kv_args(self, sgl: Any, prefill: bool) -> Any:  # noqa: F811
        """A ``KVArgs`` as SGLang's ``_init_kv_manager`` and ``append_state_component``
        fill it for a HybridLinearKVPool (mamba) or an SWAKVPool (swa)."""
        st = sgl.base.StateType
        a = sgl.utils.get_kv_class(sgl.backend, sgl.utils.KVClassType.KVARGS)()
        a.engine_rank, a.pp_rank, a.system_dp_rank = 0, 0, 0
        a.kv_cache_dtype_str, a.kv_layout = "bfloat16", "nhd"
        if prefill:
            a.prefill_start_layer, a.prefill_end_layer = 0, 4
        a.kv_data_ptrs = [int(b.ctypes.data) for b in self.kv]
        a.kv_data_lens = [int(b.nbytes) for b in self.kv]
        a.kv_item_lens = [ITEM] * 4
        a.num_draft_entries = 0
        a.kv_head_num, a.total_kv_head_num, a.page_size = HEADS, HEADS, PAGE
        a.aux_data_ptrs, a.aux_data_lens = [int(self.aux.ctypes.data)], [int(self.aux.nbytes)]
        a.aux_item_lens = [AUX]
        a.ib_device, a.gpu_id = None, 0
        ptrs = [int(b.ctypes.data) for b in self.state]
        lens = [int(b.nbytes) for b in self.state]
        if self.kind == "mamba":
            a.kv_layer_ids = [0, 2, 0, 2]
            a.state_types, a.state_data_ptrs, a.state_data_lens = [st.MAMBA], [ptrs], [lens]
            a.state_item_lens, a.state_layer_ids = [[CONV, CONV, SSM, SSM]], [[1, 3, 1, 3]]
            a.state_dim_per_tensor, a.state_slice_outer_counts = [[8, 8, 2, 2]], [[1] * 4]
            a.state_conv_shard_groups = [[None] * 4]
            a.swa_kv_cache_layout = None
        else:
            a.kv_layer_ids = []
            a.state_types, a.state_data_ptrs, a.state_data_lens = [st.SWA], [ptrs], [lens]
            a.state_item_lens, a.state_layer_ids = [[ITEM] * 4], [[]]
            a.state_dim_per_tensor, a.state_slice_outer_counts = [[]], [[]]
            a.state_conv_shard_groups, a.swa_kv_cache_layout = [[]], "nhd"
        return a

    def close(self) -> None:
        self.kv, self.state = [], []
        self.pool.close()


def _managers(sgl: Any, work: Path, kind: str, monkeypatch: pytest.MonkeyPatch  # noqa: F811
              ) -> Iterator[tuple[Any, Any, HybridRank, HybridRank, str]]:
    import kvd.adapters.sglang.conn as conn

    # SGLang publishes its parallel context in a scheduler; here the ranks are given
    monkeypatch.setattr(conn, "engine_ranks", lambda args: EngineRanks(0, 1))
    monkeypatch.setenv(conn.WINDOW_ENV, str(WINDOW))
    monkeypatch.setenv("KVD_CLUSTER_SECRET", LAUNCH_SECRET)
    kvd_p = start_daemon("prefill", work, serve_bootstrap=True, waiting_timeout=10.0)
    kvd_d = start_daemon("decode", work)
    p, d = HybridRank(11, kind), HybridRank(12, kind)
    try:
        mgrs = []
        for daemon, rank, mode in ((kvd_p, p, "prefill"), (kvd_d, d, "decode")):
            os.environ["SGLANG_KVD_SOCKET"] = daemon.socket
            args = rank.kv_args(sgl, mode == "prefill")
            server_args = sgl.ServerArgs(model_path="unused", disaggregation_mode=mode,
                                         disaggregation_transfer_backend="kvd")
            cls = sgl.utils.get_kv_class(sgl.backend, sgl.utils.KVClassType.MANAGER)
            mgrs.append(cls(args, sgl.utils.DisaggregationMode(mode), server_args, False))
        yield mgrs[0], mgrs[1], p, d, kvd_p.http_addr
    finally:
        p.close()
        d.close()
        kvd_p.stop()
        kvd_d.stop()


def _room(sgl: Any, mgr_p: Any, mgr_d: Any, boot: str, room: int, src: np.ndarray,  # noqa: F811
          dst: np.ndarray, src_state: list[Any], dst_state: list[Any]) -> tuple[Any, Any]:
    utils, polls = sgl.utils, sgl.base.KVPoll
    sender = utils.get_kv_class(sgl.backend, utils.KVClassType.SENDER)(
        mgr=mgr_p, bootstrap_addr=boot, bootstrap_room=room)
    receiver = utils.get_kv_class(sgl.backend, utils.KVClassType.RECEIVER)(
        mgr=mgr_d, bootstrap_addr=boot, bootstrap_room=room)
    assert wait_for(lambda: mgr_d.try_ensure_parallel_info(boot), (True,))
    receiver.init(0)
    assert wait_for(receiver.poll, (polls.WaitingForInput, polls.Failed)) == \
        polls.WaitingForInput
    receiver.send_metadata(dst.astype(np.int32), 5, dst_state, decode_prefix_len=0)
    assert wait_for(sender.poll, (polls.WaitingForInput, polls.Failed)) == \
        polls.WaitingForInput
    sender.init(len(src), 2)
    sender.send(src[:2].astype(np.int32))  # a first prefill chunk: no state yet
    sender.send(src[2:].astype(np.int32), src_state)  # the last chunk names the state
    assert wait_for(sender.poll, (polls.Success, polls.Failed)) == polls.Success, \
        mgr_p.failure(room)
    assert wait_for(receiver.poll, (polls.Success, polls.Failed)) == polls.Success
    return sender, receiver


def test_mamba_room_moves_kv_aux_and_state_slots_byte_for_byte(
        sgl: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    for mgr_p, mgr_d, p, d, boot in _managers(sgl, tmp_path, "mamba", monkeypatch):
        assert mgr_p.registration.state is not None and mgr_p.state.whole_slots == ()
        before = [b.copy() for b in d.state]
        src, dst = np.array([3, 17, 8, 30]), np.array([9, 1, 22, 4])
        # the decode's mamba payload is [array([slot])], the prefill's [[slot]]
        s, r = _room(sgl, mgr_p, mgr_d, boot, 8101, src, dst, [[4]], [np.array([1])])
        for mine, theirs in zip(d.kv, p.kv, strict=True):
            assert np.array_equal(mine[dst], theirs[src])
        assert np.array_equal(d.aux[5], p.aux[2])
        for mine, theirs, old in zip(d.state, p.state, before, strict=True):
            assert np.array_equal(mine[1], theirs[4])  # every state buffer's slot
            others = [i for i in range(SLOTS) if i != 1]
            assert np.array_equal(mine[others], old[others])  # nothing else written
        r.clear()
        s.clear()
        # a decode whose Mamba state moves only as whole slots refuses a prefill of another
        # attention TP in init, naming the buffer (kvd's pairing would refuse it too)
        import dataclasses

        mgr_d.state = dataclasses.replace(mgr_d.state, whole_slots=(
            "layer 1 mamba0 (conv sub-blocks [4, 4, 8] sharded separately)",))
        info = mgr_d.prefill_info_table[boot]
        mgr_d.prefill_info_table[boot] = dataclasses.replace(info, attn_tp_size=2)
        polls = sgl.base.KVPoll
        rec = sgl.utils.get_kv_class(sgl.backend, sgl.utils.KVClassType.RECEIVER)(
            mgr=mgr_d, bootstrap_addr=boot, bootstrap_room=8103)
        rec.init(0)
        assert rec.poll() == polls.Failed
        with pytest.raises(sgl.KVTransferError, match=r"layer 1 mamba0 \(conv sub-blocks .* "
                                                      r"TP 2 \(prefill\) and 1 \(decode\)"):
            rec.failure_exception()
        rec.clear()


def test_swa_room_moves_kv_and_window_pages_byte_for_byte(
        sgl: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    for mgr_p, mgr_d, p, d, boot in _managers(sgl, tmp_path, "swa", monkeypatch):
        spec = mgr_d.registration.state
        assert spec is not None and spec.window_tokens == WINDOW
        before = [b.copy() for b in d.state]
        # a 4-page (16-token) prompt: the window's last 6 tokens start in page 2 -> 2 pages
        src, dst = np.array([3, 17, 8, 30]), np.array([9, 1, 22, 4])
        swa_src, swa_dst = np.array([12, 5]), np.array([7, 20])
        s, r = _room(sgl, mgr_p, mgr_d, boot, 8102, src, dst, [swa_src], [swa_dst])
        for mine, theirs in zip(d.kv, p.kv, strict=True):
            assert np.array_equal(mine[dst], theirs[src])
        for mine, theirs, old in zip(d.state, p.state, before, strict=True):
            assert np.array_equal(mine[swa_dst], theirs[swa_src])
            others = [i for i in range(PAGES) if i not in swa_dst]
            assert np.array_equal(mine[others], old[others])
        r.clear()
        s.clear()


@pytest.mark.parametrize("tp", [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)])
def test_kvds_mamba_reshard_is_sglangs_slice_byte_for_byte(sgl: Any,  # noqa: F811
                                                           tp: tuple[int, int]) -> None:
    """For every prefill rank that writes a decode rank, kvd's state plan of the buffers
    the adapter calls head-major (and replicated) writes exactly the byte blocks SGLang's
    own ``compute_mamba_state_slice_byte_blocks`` computes for them."""
    from kvd.adapters.sglang.kvargs import sglang_state
    from kvd.transfer.layout import prefill_targets
    from kvd.transfer.state import STATE_ID_BASE, StateBuffer, StateLayout, StatePairPlan

    rows, row_bytes = 8, 48  # whole-model rows of a temporal state, bytes per row
    src_tp, dst_tp = tp

    def layout(rank: int, size: int) -> StateLayout:
        dim = rows // size
        args = type("A", (), dict(
            state_types=["mamba"], state_data_ptrs=[[1, 2]], state_data_lens=[[1, 1]],
            state_item_lens=[[dim * row_bytes, 40]], state_layer_ids=[[1, 1]],
            state_dim_per_tensor=[[dim, 0]], state_slice_outer_counts=[[1, 1]],
            state_conv_shard_groups=[[None, None]], prefill_start_layer=0))()
        spec = sglang_state(args, [0], 1, 4, 1, 1, 2, EngineRanks(rank, size), None).spec
        assert spec is not None
        bufs = tuple(StateBuffer(b.layer, b.kind, (i + 1) << 32, 4 * b.slot_bytes,
                                 b.slot_bytes, b.dtype, b.heads, b.total_heads)
                     for i, b in enumerate(spec.buffers))
        return StateLayout(bufs, tuple(spec.layer_types), 0, 2, rank, size)

    checked = 0
    for d in range(dst_tp):
        dst = layout(d, dst_tp)
        for s in prefill_targets(d, dst_tp, src_tp):
            src = layout(s, src_tp)
            plan = StatePairPlan.of(src, dst)
            desc = plan.plan(0, 0)  # one descriptor per written buffer, in plan.s_ids order
            got = {(int(k) - STATE_ID_BASE, int(a) - src.buffers[int(k) - STATE_ID_BASE].ptr,
                    int(b) - dst.buffers[int(k) - STATE_ID_BASE].ptr, int(n))
                   for a, b, n, k in zip(desc.src, desc.dst, desc.length, plan.s_ids,
                                         strict=True)}
            want = set()
            for k, (sb, db) in enumerate(zip(src.buffers, dst.buffers, strict=True)):
                sdim = 0 if k else rows // src_tp
                ddim = 0 if k else rows // dst_tp
                for blk in sgl.utils.compute_mamba_state_slice_byte_blocks(
                        src_item_len=sb.slot_bytes, dst_item_len=db.slot_bytes, src_dim=sdim,
                        dst_dim=ddim, outer_count=1, src_attn_tp_size=src_tp,
                        dst_attn_tp_size=dst_tp, dst_tp_rank_in_group=d,
                        local_tp_rank_in_group=s, conv_shard_groups=None):
                    want.add((k, *(int(x) for x in blk)))
            assert got == want, (s, d)
            checked += len(want)
    assert checked >= dst_tp  # at least the temporal state's block per decode rank

