"""Issue 22 items 1 and 2 on real processes: real daemons over real Mooncake (TCP; and the
same-host ``local`` backend) move a room's draft-model KV group (head-sliced, re-sharded
from prefill TP 1 to decode TP 2) and an indexer K group (replicated) with its paged KV,
every decode rank's bytes equal to the truth's; and ``kvd demo``'s speculative rows are
token-exact (tokens and trace) against the colocated run."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from kvd.client import KvdClient, KVPoll, Receiver, Sender
from kvd.launch import DaemonProcess, start_daemon
from kvd.refengine.grouppool import GroupDef, GroupShard
from kvd.refengine.standin import ModelSpec

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SPEC = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, page_size=4, num_pages=32)
GROUPS = (GroupDef("draft", layers=1, heads=2, head_bytes=12),
          GroupDef("indexer", layers=2, heads=1, head_bytes=20, replicated=True))


class Rank:
    """A daemon and the stand-in engine with paged cache groups registered with it."""

    def __init__(self, daemon: DaemonProcess, shard: GroupShard) -> None:
        self.daemon, self.shard = daemon, shard
        self.client = KvdClient(daemon.socket)
        self.client.call(shard.registration)

    def close(self) -> None:
        self.client.close()
        self.shard.close()
        self.daemon.stop()


@pytest.mark.parametrize("backend", ["mooncake", "local"])
def test_i22_draft_and_indexer_groups_move_tp1_to_tp2_bytes_exact(tmp_path: Path,
                                                                  backend: str) -> None:
    """``local``: the decode's group buffers travel in its exported pool."""
    kv = SPEC.global_kv(5)
    truth = {g.name: g.truth(SPEC, 50 + i) for i, g in enumerate(GROUPS)}
    opts = {"transfer_backend": backend}
    if backend == "local":
        opts["peer_channel_dir"] = str(tmp_path / "peers")
    ranks: list[Rank] = []
    try:
        p = start_daemon("prefill", tmp_path, serve_bootstrap=True, **opts)
        ranks.append(Rank(p, GroupShard(SPEC, GROUPS, 0, 1, source=kv, group_source=truth,
                                        seed=1, spec_config="draft=x;steps=3")))
        for tp in (0, 1):
            d = start_daemon("decode", tmp_path, attn_tp_size=2, attn_tp_rank=tp, **opts)
            ranks.append(Rank(d, GroupShard(SPEC, GROUPS, tp, 2, seed=10 + tp,
                                            spec_config="draft=x;steps=3")))
        src, dst = np.array([3, 4, 5, 6]), np.array([20, 2, 9, 11])
        receivers = []
        for r in ranks[1:]:
            rec = Receiver(r.client, 12, p.http_addr)
            rec.init(dst, 0)
            receivers.append(rec)
        send = Sender(ranks[0].client, 12)
        send.init(len(src), 0)
        send.send(src[:2])
        send.send(src[2:])
        assert [rec.wait(30) for rec in receivers] == [KVPoll.Success] * 2
        assert send.wait(30) == KVPoll.Success
        for r in ranks[1:]:
            assert r.shard.holds(kv, src, dst)
            assert r.shard.group_holds(truth, src, dst) == {"draft": True, "indexer": True}
            assert r.shard.g_heads["draft"][1] == 1  # a half of the draft's heads each
    finally:
        for r in ranks:
            r.close()


def test_i22_speculative_demo_rows_are_token_exact_tp1_to_tp2() -> None:
    """The demo's speculative rows: target KV, draft KV and typed aux PD over real daemons
    and Mooncake, prefill TP 1 -> decode TP 2; tokens equal the target alone and the
    colocated speculative run, and so does every round's trace."""
    from rich.console import Console

    from kvd.refengine.specdemo import run_spec_rows

    out = io.StringIO()
    assert run_spec_rows(Console(file=out, width=200), 1, 2, n_prompts=2) == 0, out.getvalue()
    assert out.getvalue().count("yes") == 2
