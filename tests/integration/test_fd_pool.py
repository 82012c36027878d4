"""KV pools passed as descriptors (memfd, SCM_RIGHTS) work end to end on real daemons."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvd.client import KVPoll
from kvd.refengine.standin import transfer_room, wait_rooms
from tests.conftest import start_pair, stop_pair

pytestmark = pytest.mark.integration


def test_fd_passed_pools_transfer_end_to_end(tmp_path: Path) -> None:
    pair = start_pair(tmp_path, engine_opts={"pool": "fd"})
    try:
        p, d = pair.p_engine, pair.d_engine
        assert not hasattr(p.pool, "path")  # no file name anywhere
        transfer_room(p, d, pair.bootstrap, 77, [3, 4, 9], [10, 11, 40], chunk=2,
                      aux_src=1, aux_dst=2)
        assert wait_rooms(d.client, [77]) == [KVPoll.Success]
        assert d.pages_equal(p, [3, 4, 9], [10, 11, 40])
        assert (d.aux[2] == p.aux[1]).all()
    finally:
        stop_pair(pair)
