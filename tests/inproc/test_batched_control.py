"""Messages queued for one peer leave as one Batch frame, in order, and every room lands."""

from __future__ import annotations

from kvd.protocol import control
from tests.inproc.harness import FAILED, SUCCESS, Cluster, same_pages, settle, until


async def test_queued_room_messages_travel_as_batch_frames_in_order(cluster: Cluster) -> None:
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe, de = await p.engine(seed=1), await d.engine(seed=2)
    core = d.daemon.core
    assert core is not None
    frames: list[list[control.ControlMessage]] = []
    original = core.control.send

    async def recording(endpoint: str, frame: bytes, instance: str | None = None) -> None:
        frames.append(control.decode_many(frame))  # sealed by the control plane itself
        await original(endpoint, frame, instance)

    core.control.send = recording  # type: ignore[method-assign]
    rooms = list(range(300, 316))
    await de.receiver(rooms[0], [0], p.http_addr)
    # registered, resolved and its pages sent: later rooms resolve from the cache and queue
    # at once (waiting only for the RegisterRank frame let a later room's pages go first)
    await until(lambda: any(isinstance(m, control.RoomPages) for f in frames for m in f))
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


async def test_a_batch_holds_only_messages_sealed_for_one_instance(cluster: Cluster) -> None:
    """A frame is sealed for one recipient instance: where the queued messages' instances
    change, the outbox starts a new frame (order kept, nothing lost)."""
    d = await cluster.node("decode")
    core = d.daemon.core
    assert core is not None
    sent: list[tuple[str | None, list[int]]] = []

    async def recording(endpoint: str, frame: bytes, instance: str | None = None) -> None:
        sent.append((instance, [m.room for m in control.decode_many(frame)]))  # type: ignore[union-attr]

    core.control.send = recording  # type: ignore[method-assign]
    failed: list[str] = []
    plan = ["a", "a", "b", "b", "b", None, "a"]
    for room, inst in enumerate(plan):
        core.post("tcp://nowhere:1", control.RoomAbort(room=room, inc=1, kind="aborted",
                                                       reason="r", endpoint=d.endpoint,
                                                       instance_id="x"),
                  failed.append, instance=inst)
    await until(lambda: sum(len(rooms) for _, rooms in sent) == len(plan))
    assert sent == [("a", [0, 1]), ("b", [2, 3, 4]), (None, [5]), ("a", [6])]
    assert not failed


async def test_a_batch_too_large_for_one_frame_is_split(cluster: Cluster) -> None:
    d = await cluster.node("decode")
    core = d.daemon.core
    assert core is not None
    sizes: list[int] = []

    async def recording(endpoint: str, frame: bytes, instance: str | None = None) -> None:
        sizes.append(len(frame))
        assert len(control.decode_many(frame, core.settings.max_frame_bytes)) >= 1

    core.control.send = recording  # type: ignore[method-assign]
    one = len(control.encode(control.RoomAbort(room=0, inc=1, kind="aborted", reason="r" * 200,
                                               endpoint=d.endpoint, instance_id="x")))
    core.settings.max_frame_bytes = one * 5  # about four messages fit in one Batch frame
    for room in range(20):
        core.post("tcp://nowhere:1", control.RoomAbort(room=room, inc=1, kind="aborted",
                                                       reason="r" * 200, endpoint=d.endpoint,
                                                       instance_id="x"), instance="a")
    await until(lambda: len(sizes) >= 5 and not core.outboxes)
    assert all(s <= core.settings.max_frame_bytes for s in sizes)


async def test_k16_a_room_whose_pages_no_peer_would_take_fails_at_once_naming_why(
        cluster: Cluster) -> None:
    """A peer drops a frame longer than its cap unread and unanswered (S19). The sender
    checks each frame against the cap every peer accepts before it leaves: the room whose
    RoomPages would not fit fails at once, naming the sizes, instead of waiting for its
    deadline; a neighbour room on the same peer still moves. (The test lowers both sides'
    caps to a few pages, standing for the protocol's largest message.)"""
    p = await cluster.node("prefill")
    d = await cluster.node("decode")
    pe, de = await p.engine(seed=1), await d.engine(seed=2)
    await de.receiver(1, [0], p.http_addr)  # registered with the prefill rank first
    await pe.sender(1, [0])
    await settle(cluster)
    assert await de.status(1) == SUCCESS
    core, peer = d.daemon.core, p.daemon.core
    assert core is not None and peer is not None and peer.control.inbound is not None

    def pages_frame(n: int) -> int:
        return len(control.encode(control.RoomPages(
            room=2, inc=2**40, endpoint=core.control.endpoint, instance_id=core.instance_id,
            dst_pages=b"\x01" * (4 * n), aux_index=2, write_within=60.0)))

    cap = (pages_frame(2) + pages_frame(20)) // 2
    core.settings.max_frame_bytes = peer.control.inbound.max_frame = cap
    clock = cluster.clock.now
    await de.receiver(2, list(range(1, 21)), p.http_addr)  # 20 pages: over the cap
    await de.receiver(3, [21, 22], p.http_addr)            # 2 pages: fits
    await pe.sender(3, [5, 6])
    await settle(cluster)
    assert await de.status(2) == FAILED and cluster.clock.now == clock  # at once
    kind, reason = await de.failure(2)
    assert "RoomPages" in reason and f"exceeds the {cap}-byte frame" in reason, (kind, reason)
    assert await de.status(3) == SUCCESS and same_pages(de, pe, [5, 6], [21, 22])
