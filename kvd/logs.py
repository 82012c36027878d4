"""Daemon logging: text or JSON lines on stderr; room lines carry the room id and peer.

A record gets ``room`` and ``peer`` from ``extra={"room": ..., "peer": ...}``
when the caller gives them; otherwise the room is read from the message
(``room 1234``) and the peer read from the message (``tcp://host:port``), or
else looked up among the peers recently seen for that room
(:func:`remember_peer`, fed by :class:`kvd.metrics.RoomEvents`). Lines about
no room carry neither.

Text: ``2026-01-01 12:00:00,000 WARNING kvd.prefill room=12 peer=tcp://h:p: message``.
JSON: ``{"ts": ..., "level": ..., "logger": ..., "room": ..., "peer": ..., "msg": ...}``.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections import OrderedDict
from datetime import UTC, datetime
from typing import Any, TextIO

_ROOM = re.compile(r"\broom[ =](\d+)")
_PEER = re.compile(r"tcp://\S+?(?=[\s,;)]|$)")
_MAX_ROOMS = 4096
_room_peers: OrderedDict[int, str] = OrderedDict()


def remember_peer(room: int, peer: str) -> None:
    """Annotate later log lines about ``room`` with ``peer`` (bounded, newest kept)."""
    _room_peers[room] = peer
    _room_peers.move_to_end(room)
    while len(_room_peers) > _MAX_ROOMS:
        _room_peers.popitem(last=False)


class RoomContext(logging.Filter):
    """Sets ``record.room`` / ``record.peer`` (``None`` when the line is about no room)."""

    def filter(self, record: logging.LogRecord) -> bool:
        room = getattr(record, "room", None)
        peer = getattr(record, "peer", None)
        if room is None or peer is None:
            text = record.getMessage()
            if room is None and (m := _ROOM.search(text)):
                room = int(m.group(1))
            if peer is None and room is not None:
                peer = _peer_in(text) or _room_peers.get(room, "-")
        record.room, record.peer = room, peer
        return True


def _peer_in(text: str) -> str:
    m = _PEER.search(text)
    return m.group(0) if m else ""


class TextFormatter(logging.Formatter):
    """``time LEVEL logger [room=R peer=P]: message``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(context)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        room = getattr(record, "room", None)
        record.context = "" if room is None else f" room={room} peer={getattr(record, 'peer', '-')}"
        return super().format(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, and room/peer/exc when present."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name}
        if (room := getattr(record, "room", None)) is not None:
            out["room"] = room
            out["peer"] = getattr(record, "peer", "-")
        out["msg"] = record.getMessage()
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Send every log record to ``stream`` (stderr) as ``fmt`` (text or json) at ``level``."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(RoomContext())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
