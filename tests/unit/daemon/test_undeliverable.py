"""K16 on the sending side (tier 1, pure): a control frame no peer would act on -- longer
than the frame every peer accepts, or with a field past its protocol bound -- is named
before it leaves (kvd.daemon.core.undeliverable), so its room fails at once."""

from __future__ import annotations

import msgspec

from kvd.daemon.core import CHECK_FRAMES_FROM, undeliverable
from kvd.protocol import control


def status(aux: list[bytes]) -> bytes:
    return control.encode(control.RoomStatus(room=1, inc=1, status=4, kind="", reason="",
                                             endpoint="tcp://p:1", instance_id="p-a",
                                             aux=aux))


def test_k16_a_frame_longer_than_the_cap_is_named_with_its_size() -> None:
    frame = status([b"a" * 4096])
    assert undeliverable(frame, len(frame)) is None
    why = undeliverable(frame, len(frame) - 1)
    assert why is not None and f"{len(frame)}-byte control frame exceeds the " \
                                f"{len(frame) - 1}-byte frame" in why


def test_k16_a_field_past_its_bound_is_named_even_under_the_cap() -> None:
    """33 aux buffers (the bound is 32): a peer refuses it as malformed, unanswered."""
    frame = status([b"a" * 4096] * (control.MAX_AUX_BUFFERS + 1))
    assert CHECK_FRAMES_FROM <= len(frame) < control.max_frame()
    why = undeliverable(frame, control.max_frame())
    assert why is not None and "malformed" in why
    assert undeliverable(status([b"a" * 4096] * control.MAX_AUX_BUFFERS),
                         control.max_frame()) is None


def test_k16_the_largest_real_messages_are_deliverable() -> None:
    pages = control.RoomPages(room=2**64 - 1, inc=2**63 - 1, endpoint="e" * 64, instance_id="i",
                              dst_pages=b"\xff" * (4 * control.MAX_ROOM_PAGES),
                              aux_index=0, write_within=1.0)
    assert undeliverable(control.encode(pages), control.max_frame()) is None
    over = control.RoomPages(room=1, inc=1, endpoint="e", instance_id="i",
                             dst_pages=b"\x01" * (4 * control.MAX_ROOM_PAGES + 4),
                             aux_index=0, write_within=1.0)
    assert undeliverable(control.encode(over), control.max_frame()) is not None


def test_a_small_registration_with_an_integer_past_its_bound_is_named_when_checked_whole() -> None:
    """A short registration with ``layer_start=-1`` is under CHECK_FRAMES_FROM, yet a peer
    refuses it as malformed, so Core.send checks a registration whole and names the field.
    The engine socket refuses such a ``RegisterKV`` first (its integers carry the same
    bounds, tests/inproc/test_register_bounds.py); this check stays for what the daemon
    itself builds."""
    args = control.KVArgsWire("s", [1], [64], [64], [], [], [], 16, 1, 64, 2, 1,
                              layer_start=-1)
    frame = control.encode(control.RegisterRank("d-a", "tcp://d:1", 0, 1, args))
    assert len(frame) < CHECK_FRAMES_FROM
    assert undeliverable(frame, control.max_frame()) is None  # not decoded: too short
    why = undeliverable(frame, control.max_frame(), whole=True)
    assert why is not None and "malformed" in why and "`$.kv_args.layer_start`" in why
    ok = control.encode(control.RegisterRank("d-a", "tcp://d:1", 0, 1,
                                             msgspec.structs.replace(args, layer_start=0)))
    assert undeliverable(ok, control.max_frame(), whole=True) is None
