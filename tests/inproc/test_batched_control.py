"""Messages queued for one peer leave as one Batch frame, in order, and every room lands."""

from __future__ import annotations

from kvd.protocol import control
from tests.inproc.harness import SUCCESS, Cluster, same_pages, settle, until


async def test_queued_room_messages_travel_as_batch_frames_in_order(cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe, de = await p.engine(seed=1), await d.engine(seed=2)
    core = d.daemon.core
    assert core is not None
    frames: list[list[control.ControlMessage]] = []
    original = core.control.send

    async def recording(endpoint: str, frame: bytes) -> None:
        frames.append(control.decode_many(core.auth.open(frame)))
        await original(endpoint, frame)

    core.control.send = recording  # type: ignore[method-assign]
    rooms = list(range(300, 316))
    await de.receiver(rooms[0], [0], p.http_addr)
    await until(lambda: any(frames))  # registered and resolved: later rooms queue at once
    for i, room in enumerate(rooms[1:], start=1):
        await de.receiver(room, [i], p.http_addr)
    for i, room in enumerate(rooms):
        await pe.sender(room, [16 + i])
    await settle(cluster)
    for room in rooms:
        assert await de.status(room) == SUCCESS
    assert same_pages(de, pe, [16 + i for i in range(len(rooms))], list(range(len(rooms))))
    pages = [m.room for f in frames for m in f if isinstance(m, control.RoomPages)]
    assert pages == rooms  # in order, none lost, none twice
    assert any(len(f) > 1 for f in frames)  # several rooms' messages shared a frame
