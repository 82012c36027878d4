"""In-process tier: an authenticated peer that sends a control message with an integer
outside its wire bound (a room id that is no uint64, an index past int64) is refused at
decode -- counted as a protocol error and logged naming the field -- and the pair's other
rooms are unharmed (before, ``RoomPages(room=-1)`` reached the prefill's room machines and
the status table, and failed there)."""

from __future__ import annotations

import logging

import pytest

from kvd.protocol import control
from kvd.security import Authenticator
from tests.inproc.harness import SECRET, SUCCESS, Cluster, same_pages, settle


async def test_a_peers_out_of_range_room_is_refused_and_a_good_room_moves(
        cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe, de = await p.engine(seed=1), await d.engine(seed=2)
    await de.receiver(60, [3, 4], p.http_addr, aux=1)
    await settle(cluster)  # D is registered with P: its RoomPages are acted on
    peer = Authenticator(SECRET.encode())
    pages = control.RoomPages(room=-1, inc=1, endpoint=d.endpoint,
                              instance_id=d.core.instance_id,
                              dst_pages=b"\x00\x00\x00\x00", aux_index=0, write_within=5.0)
    bad_p = [pages,
             control.RoomPages(**{**_fields(pages), "room": 61, "aux_index": 2**63}),
             control.RoomAbort(room=-5, inc=0, kind="aborted", reason="x",
                               endpoint=d.endpoint, instance_id=d.core.instance_id)]
    bad_d = [control.RoomStatus(room=60, inc=2**63, status=0, kind="peer", reason="x",
                                endpoint=p.endpoint, instance_id=p.core.instance_id),
             control.RoomStatus(room=-1, inc=1, status=0, kind="peer", reason="x",
                                endpoint=p.endpoint, instance_id=p.core.instance_id),
             control.RoomStatus(room=60, inc=1, status=9, kind="peer", reason="x",
                                endpoint=p.endpoint, instance_id=p.core.instance_id)]
    before_p, before_d = p.core.control.stats.protocol_errors, d.core.control.stats.protocol_errors
    with caplog.at_level(logging.WARNING, logger="kvd.control.inbound"):
        for node, msgs in ((p, bad_p), (d, bad_d)):
            for msg in msgs:
                frame = peer.seal(control.encode(msg), node.core.instance_id)
                node.core.control.queue.put_nowait((b"peer", frame))
            # a batch with one bad message among good ones is refused whole
            frame = peer.seal(control.encode(control.Batch(messages=[msgs[0], msgs[0]])),
                              node.core.instance_id)
            node.core.control.queue.put_nowait((b"peer", frame))
        await settle(cluster)
    assert p.core.control.stats.protocol_errors - before_p == len(bad_p) + 1
    assert d.core.control.stats.protocol_errors - before_d == len(bad_d) + 1
    logged = "\n".join(r.getMessage() for r in caplog.records
                       if "refused an authentic control frame" in r.getMessage())
    for field in ("$.room", "$.aux_index", "$.inc", "$.status", "$.messages[0].room"):
        assert f"`{field}`" in logged, (field, logged)
    assert -1 not in p.side.rooms.rooms and -1 not in d.side.rooms.rooms
    # the pair's room moves byte for byte, as if nothing had been sent
    await pe.sender(60, [10, 11], aux=2)
    await settle(cluster)
    assert await de.status(60) == SUCCESS and await pe.status(60) == SUCCESS
    assert same_pages(de, pe, [10, 11], [3, 4])
    assert (de.pool.aux[1] == pe.pool.aux[2]).all()


def _fields(msg: control.RoomPages) -> dict[str, object]:
    return {f: getattr(msg, f) for f in msg.__struct_fields__}
