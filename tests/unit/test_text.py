"""S21: foreign text (peers, engines) escaped and bounded where it enters and where it is
shown: the sanitizer's properties, the protocol's entry points, the failure type, the
status schemas."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvd.errors import ProtocolError
from kvd.protocol import control, rpc
from kvd.rooms.state import FailureKind, RoomFailure
from kvd.schemas import FailureRow, Peer, Room
from kvd.text import MAX_REASON_BYTES, bound, clean, escape

FORGED = "boom\n2026-01-01 00:00:00,000 ERROR kvd: forged\x1b[2J\x1b[31mred\r\u2028\u202e"


def _safe(text: str, limit: int = MAX_REASON_BYTES) -> bool:
    return text.isprintable() and len(text.encode("utf-8")) <= limit


def test_s21_escape_writes_controls_as_visible_text() -> None:
    assert escape(FORGED) == ("boom\\n2026-01-01 00:00:00,000 ERROR kvd: forged\\x1b[2J"
                              "\\x1b[31mred\\r\\u2028\\u202e")
    assert escape("plain text, ünïcode ok") == "plain text, ünïcode ok"
    assert escape("a\nb", keep="\n") == "a\nb"


@given(st.text(), st.integers(64, 4096))
def test_s21_clean_is_printable_bounded_and_idempotent(text: str, limit: int) -> None:
    out = clean(text, limit)
    assert _safe(out, limit)
    assert clean(out, limit) == out  # every sink may clean again
    assert escape(escape(text)) == escape(text)


@given(st.text(), st.integers(32, 2048))
def test_s21_bound_keeps_whole_characters_and_says_it_cut(text: str, limit: int) -> None:
    out = bound(text, limit)
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        assert out == text
    else:
        assert len(out.encode("utf-8", "surrogatepass")) <= limit
        assert out.endswith(f"...[cut, {len(data)} bytes]")
        assert text.startswith(out[:out.rindex("...[cut")])


def test_s21_reasons_are_cleaned_where_they_enter() -> None:
    huge = FORGED + "x" * (1 << 20)
    abort = rpc.decode_request(rpc.encode(rpc.Request(id=1, call=rpc.Abort(room=1,
                                                                          reason=huge)))[4:])
    assert isinstance(abort.call, rpc.Abort) and _safe(abort.call.reason)
    assert abort.call.reason.startswith("boom\\n2026")
    for msg in (control.RoomAbort(room=1, inc=1, kind="peer", reason=huge, endpoint="tcp://e:1",
                                  instance_id="i"),
                control.RoomStatus(room=1, inc=1, status=4, kind="peer", reason=huge,
                                   endpoint="tcp://e:1", instance_id="i")):
        raw = msgspec.msgpack.encode(msg)  # as a peer could send it (not cleaned on its side)
        got = msgspec.msgpack.decode(raw, type=type(msg))
        assert _safe(got.reason) and got.reason.startswith("boom\\n")
        assert _safe(control.decode(control.encode(msg)).reason)  # type: ignore[union-attr]
    assert _safe(RoomFailure(FailureKind.ABORTED, huge, "decode").reason)


def test_s21_status_rows_show_foreign_text_escaped_and_bounded() -> None:
    peer = Peer(endpoint="tcp://h:1\x1b[2J", kind="prefill", instance_id=FORGED, state="up",
                heartbeat="ok", last_error=FORGED * 1000)
    room = Room(room=1, state="Failed", age_s=1, state_age_s=1, peer="p\n", reason=FORGED)
    row = FailureRow(time=0, side="decode", room=1, peer="p", category="peer", reason=FORGED)
    for text in (peer.endpoint, peer.instance_id, peer.last_error, room.peer, room.reason,
                 row.reason):
        assert _safe(text)
    assert "\\x1b[2J" in peer.endpoint and "\\n" in room.reason
    assert Peer.model_validate_json(peer.model_dump_json()) == peer  # the CLI reads it back


def test_s21_peer_names_outside_their_alphabet_are_malformed_frames() -> None:
    good = control.RoomAbort(room=1, inc=1, kind="aborted", reason="r",
                             endpoint="tcp://[::1]:5000", instance_id="0123abcd.x-y_z")
    assert control.decode(control.encode(good)) == good
    for bad in ({"instance_id": "i\nERROR kvd: forged"}, {"instance_id": "i" * 65},
                {"endpoint": "tcp://h:1\x1b[2J"}, {"endpoint": "tcp://h:1 x"},
                {"endpoint": "tcp://" + "h" * 300}):
        frame = control.encode(msgspec.structs.replace(good, **bad))
        with pytest.raises(ProtocolError):
            control.decode(frame)
