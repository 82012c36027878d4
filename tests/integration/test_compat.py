"""The compatibility fingerprint with real daemons and real Mooncake TCP (issue 22 item 5):
engines registering different KV dtypes fail the first room with a registration reason
naming the field, and the decode's pool is untouched."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvd.client import KVPoll, Receiver, Sender
from kvd.launch import start_daemon
from kvd.protocol.control import Compat
from kvd.refengine.standin import ModelSpec, ShardStandIn

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_i22_kv_dtype_mismatch_fails_the_first_room_and_never_writes(tmp_path: Path) -> None:
    spec = ModelSpec()
    p = start_daemon("prefill", tmp_path, serve_bootstrap=True)
    d = start_daemon("decode", tmp_path)
    pe = de = None
    try:
        pe = ShardStandIn(p.socket, spec, 0, 1, source=spec.global_kv(seed=3), seed=1,
                          compat=Compat(model_id="m", kv_dtype="bfloat16"))
        de = ShardStandIn(d.socket, spec, 0, 1, seed=2,
                          compat=Compat(model_id="m", kv_dtype="fp8_e4m3"))
        before = [b.copy() for b in de.buffers]
        r = Receiver(de.client, 1, p.http_addr)
        r.init(np.array([1, 2]), 1)
        s = Sender(pe.client, 1)
        s.init(2, 0)
        s.send(np.array([3, 4]))
        assert r.wait(20) == KVPoll.Failed
        reason = r.failure_reason()
        assert "fingerprint mismatch" in reason and "kv_dtype 'bfloat16' vs 'fp8_e4m3'" in reason
        assert all(np.array_equal(a, b) for a, b in zip(de.buffers, before, strict=True))
    finally:
        for e in (pe, de):
            if e is not None:
                e.close()
        d.stop()
        p.stop()
