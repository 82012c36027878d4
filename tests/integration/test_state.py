"""Issue 22 item 1 on real processes: real daemons over real Mooncake (TCP; and the same-host
``local`` backend) move a hybrid
model's room -- paged KV, a per-request state slot re-sharded from prefill TP 1 to decode
TP 2, and its window pages -- and every decode rank's bytes equal the truth's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvd.client import KvdClient, KVPoll, Receiver, Sender
from kvd.launch import DaemonProcess, start_daemon
from kvd.refengine.statepool import HybridShard, HybridSpec

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class Rank:
    """A daemon and the hybrid stand-in engine registered with it."""

    def __init__(self, daemon: DaemonProcess, shard: HybridShard) -> None:
        self.daemon, self.shard = daemon, shard
        self.client = KvdClient(daemon.socket)
        self.client.call(shard.registration)

    def close(self) -> None:
        self.client.close()
        self.shard.close()
        self.daemon.stop()


@pytest.mark.parametrize("backend", ["mooncake", "local"])
def test_i22_state_slot_moves_tp1_to_tp2_bytes_exact(tmp_path: Path, backend: str) -> None:
    """``local``: the decode's state and window buffers travel in its exported pool."""
    spec = HybridSpec()
    truth = spec.truth(22)
    ranks: list[Rank] = []
    opts = {"transfer_backend": backend}
    if backend == "local":
        opts["peer_channel_dir"] = str(tmp_path / "peers")
    try:
        p = start_daemon("prefill", tmp_path, serve_bootstrap=True, **opts)
        ranks.append(Rank(p, HybridShard(spec, 0, 1, source=truth, seed=1)))
        for tp in (0, 1):
            d = start_daemon("decode", tmp_path, attn_tp_size=2, attn_tp_rank=tp, **opts)
            ranks.append(Rank(d, HybridShard(spec, tp, 2, seed=10 + tp)))
        src, dst = np.array([3, 4, 5, 6]), np.array([20, 2, 9, 11])
        s_win, d_win = np.array([5, 6, 7]), np.array([0, 13, 4])
        receivers = []
        for r in ranks[1:]:
            rec = Receiver(r.client, 11, p.http_addr)
            rec.init(dst, 0, state_index=3, window_pages=d_win)
            receivers.append(rec)
        send = Sender(ranks[0].client, 11)
        send.init(len(src), 0, state_index=1, window_pages=s_win)
        send.send(src[:2])
        send.send(src[2:])
        assert [rec.wait(30) for rec in receivers] == [KVPoll.Success] * 2
        assert send.wait(30) == KVPoll.Success
        for r in ranks[1:]:
            got = r.shard.holds(truth, src, dst, 1, 3, s_win, d_win)
            assert got == {"kv": True, "window": True, "state": True}, (r.shard.tp_rank, got)
            assert r.shard.nh == 2 and all(r.shard.state_shape[k][1] == 2
                                           for k in r.shard.state_keys)  # a half each
    finally:
        for r in ranks:
            r.close()


def _tokens(views: list[np.ndarray], pages: np.ndarray, spec: HybridSpec) -> np.ndarray:
    """``[buffer, token, token bytes]`` of ``pages`` (NHD, TP 1): token ``t`` is page
    ``pages[t // page_size]`` slot ``t % page_size``."""
    token = spec.total_kv_heads * spec.head_dim * 2
    return np.stack([v.reshape(-1, spec.page_size, token)[pages].reshape(-1, token)
                     for v in views])


def test_i22_a_hybrid_room_4_to_8_retiles_kv_and_window_over_mooncake(tmp_path: Path) -> None:
    """Another page size on the decode (4 -> 8 tokens): the paged KV and the window pool move
    in tokens, the window as the tokens both sides' window pages (the tail of each side's
    room pages) hold; every decode byte of them equals the prefill's, the state slot too."""
    ps_spec, pd_spec = HybridSpec(page_size=4), HybridSpec(page_size=8)
    ranks: list[Rank] = []
    try:
        p = start_daemon("prefill", tmp_path, serve_bootstrap=True)
        ranks.append(Rank(p, HybridShard(ps_spec, source=ps_spec.truth(23), seed=1)))
        d = start_daemon("decode", tmp_path)
        ranks.append(Rank(d, HybridShard(pd_spec, seed=2)))
        t_end = 22  # window_tokens 8: tokens [14, 22); 6 prefill pages, 3 decode pages
        src, dst = np.array([3, 4, 5, 6, 7, 8]), np.array([20, 2, 9])
        s_win, d_win = np.array([5, 6, 7]), np.array([0, 13])  # pages [3, 6) and [1, 3)
        before = [v.copy() for v in ranks[1].shard.window]
        Receiver(ranks[1].client, 12, p.http_addr).init(dst, 0, state_index=3,
                                                         window_pages=d_win)
        send = Sender(ranks[0].client, 12)
        send.init(len(src), 0, state_index=1, window_pages=s_win)
        send.send(src[:3])
        send.send(src[3:])
        assert send.wait(30) == KVPoll.Success
        sp, dp = ranks[0].shard, ranks[1].shard
        room_end = 24
        assert np.array_equal(_tokens(dp.kv, dst, pd_spec)[:, :room_end],
                              _tokens(sp.kv, src, ps_spec)[:, :room_end])
        # window tokens [12, 24): prefill window rows from token 12, decode rows from 8
        w_dst = _tokens(dp.window, d_win, pd_spec)
        assert np.array_equal(w_dst[:, 4:], _tokens(sp.window, s_win, ps_spec))
        assert np.array_equal(w_dst[:, :4], _tokens(before, d_win, pd_spec)[:, :4])
        assert t_end - ps_spec.window_tokens >= 12  # the request's window moved
        for k, v in dp.state.items():
            assert np.array_equal(v[3], sp.state[k][1])
    finally:
        for r in ranks:
            r.close()


def test_i22_hybrid_model_demo_rows_are_token_exact_tp1_to_tp2() -> None:
    """The demo's hybrid rows: the seeded hybrid model PD over real daemons and Mooncake,
    prefill TP 1 -> decode TP 2, every completion equal to the colocated one."""
    import io

    from rich.console import Console

    from kvd.refengine.hybriddemo import run_hybrid_rows

    out = io.StringIO()
    assert run_hybrid_rows(Console(file=out, width=160), 1, 2, n_prompts=2) == 0, \
        out.getvalue()
    assert out.getvalue().count("yes") == 2
