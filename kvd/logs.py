"""Daemon logging: text or JSON lines on stderr, with structured context fields.

Context (``room``, ``peer``, or any other field) reaches a record in one of
two ways, never by reading the message text:

* :func:`log_context` — a ``contextvars`` scope. Everything logged inside it,
  including by asyncio tasks *created* inside it (a task copies the context
  when it is created), carries its fields::

      with log_context(room=msg.room, peer=msg.endpoint):
          side.on_room_pages(msg)          # and the tasks it spawns

* :func:`fields` — per record: ``log.info("kvd ready", extra=fields(http_port=8998))``.

Per-record fields win over context fields; an inner :func:`log_context` wins
over an outer one. ``None`` values are dropped. Field values must be
JSON-serialisable (others are written with ``str``).

Where context is set today: every engine RPC runs inside
``log_context(**message_context(call))`` (:mod:`kvd.engine_rpc.server`: the call's
room, and a receiver's bootstrap address as peer), every inbound control message
likewise (``Daemon._recv_loop``: room and the sender's endpoint), so tasks spawned
while handling them carry both. Code that acts on rooms outside those paths (deadline
sweeps, heartbeats failing a prefill's rooms) wraps each room's handling in
``with log_context(room=r, peer=p):``; a per-room task may call :func:`bind` first.

Text: ``2026-01-01 12:00:00,000 WARNING kvd.prefill room=12 peer=tcp://h:p: message k=v``
(``room``/``peer`` before the message, other fields after it).
JSON: ``{"ts", "level", "logger", "room", "peer", <other fields>, "msg", "exc"}``.

:func:`setup` also routes what native libraries write to file descriptor 2
(the transfer engine's glog lines) through a pipe and re-emits each line as a
``kvd.native`` record, so a JSON log is JSON only (:class:`NativeStderr`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextvars import ContextVar, Token
from datetime import UTC, datetime
from types import MappingProxyType, TracebackType
from typing import Any, TextIO

from kvd.text import MAX_LOG_MESSAGE_BYTES, bound, clean, escape

#: The record attribute that carries the fields (one attribute: no clash with LogRecord's).
FIELDS_ATTR = "kvd_fields"
_PREFIX_FIELDS = ("room", "peer")
_RESERVED = {"ts", "level", "logger", "msg", "exc"}
_EMPTY: Mapping[str, Any] = MappingProxyType({})
_context: ContextVar[Mapping[str, Any]] = ContextVar("kvd_log_context", default=_EMPTY)


@contextlib.contextmanager
def log_context(**values: Any) -> Iterator[None]:
    """Add ``values`` (e.g. ``room=R, peer="tcp://h:p"``) to every record logged inside.

    Nests (inner values win) and is inherited by asyncio tasks created inside the
    block. ``None`` values are ignored, so optional context can be passed as is.
    """
    token = bind(**values)
    try:
        yield
    finally:
        unbind(token)


def bind(**values: Any) -> Token[Mapping[str, Any]]:
    """Add ``values`` to the current context for the rest of the current asyncio task
    (each task has its own copy), e.g. first thing in a per-room task; returns the token
    for :func:`unbind`. Prefer :func:`log_context` where a ``with`` block fits."""
    merged = {**_context.get(), **{k: v for k, v in values.items() if v is not None}}
    return _context.set(merged)


def unbind(token: Token[Mapping[str, Any]]) -> None:
    """Undo the :func:`bind` that returned ``token``."""
    _context.reset(token)


def current_context() -> dict[str, Any]:
    """The fields :func:`log_context` has bound here (a copy)."""
    return dict(_context.get())


def message_context(msg: object) -> dict[str, Any]:
    """``room`` and ``peer`` of a typed message, for :func:`log_context`: its ``room``
    field, and as peer its ``endpoint`` (control messages: the sender's ZMQ endpoint) or
    ``bootstrap_addr`` (a receiver's prefill). Fields it lacks are left out."""
    peer = getattr(msg, "endpoint", None) or getattr(msg, "bootstrap_addr", None)
    return {k: v for k, v in (("room", getattr(msg, "room", None)), ("peer", peer))
            if v is not None}


def fields(**values: Any) -> dict[str, Any]:
    """``extra=`` for one record: ``log.warning("...", extra=fields(room=R, peer=P))``."""
    return {FIELDS_ATTR: {k: v for k, v in values.items() if v is not None}}


class ContextFilter(logging.Filter):
    """Sets ``record.kvd_fields``: the context's fields overlaid with the record's own."""

    def filter(self, record: logging.LogRecord) -> bool:
        own = getattr(record, FIELDS_ATTR, None) or {}
        setattr(record, FIELDS_ATTR, {**_context.get(), **own})
        return True


def _fields_of(record: logging.LogRecord) -> dict[str, Any]:
    return dict(getattr(record, FIELDS_ATTR, None) or {})


class TextFormatter(logging.Formatter):
    """``time LEVEL logger [room=R] [peer=P]: message [k=v ...]``, one line per record.

    Text from peers and engines cannot forge a record or reach the terminal raw (S21):
    the message and every field value are escaped (:func:`kvd.text.escape`: a newline is
    ``\\n``, ESC is ``\\x1b``) and bounded (:data:`~kvd.text.MAX_LOG_MESSAGE_BYTES`,
    :data:`~kvd.text.MAX_REASON_BYTES`); a traceback's lines follow, escaped likewise and
    indented, so no line but a record's first starts at column 0.
    """

    def format(self, record: logging.LogRecord) -> str:
        f = _fields_of(record)
        context = "".join(f" {k}={_text(f.pop(k))}" for k in _PREFIX_FIELDS if k in f)
        tail = "".join(f" {k}={_text(v)}" for k, v in f.items())
        message = clean(record.getMessage(), MAX_LOG_MESSAGE_BYTES)
        line = f"{self.formatTime(record)} {record.levelname} {record.name}{context}: " \
               f"{message}{tail}"
        return line + "".join(f"\n    {escape(extra)}" for extra in _extra_lines(self, record))


def _extra_lines(fmt: logging.Formatter, record: logging.LogRecord) -> list[str]:
    """The lines of a record's traceback and stack (as :class:`logging.Formatter` adds)."""
    text = []
    if record.exc_info and not record.exc_text:
        record.exc_text = fmt.formatException(record.exc_info)
    if record.exc_text:
        text.append(record.exc_text)
    if record.stack_info:
        text.append(fmt.formatStack(record.stack_info))
    return bound("\n".join(text), MAX_LOG_MESSAGE_BYTES).splitlines()


def _text(value: Any) -> str:
    """A field value in a text line: escaped and bounded, quoted when it has a space."""
    shown = json.dumps(value, default=str) if isinstance(value, str) and " " in value \
        else str(value)
    return clean(shown)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, room/peer and other fields, msg, exc.
    JSON escapes control characters itself; strings are bounded as in text (S21)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name}
        f = _fields_of(record)
        for key in (*_PREFIX_FIELDS, *f):
            if key in f and key not in _RESERVED:
                out[key] = bound(f[key]) if isinstance(f[key], str) else f[key]
        out["msg"] = bound(record.getMessage(), MAX_LOG_MESSAGE_BYTES)
        if record.exc_info:
            out["exc"] = bound(self.formatException(record.exc_info), MAX_LOG_MESSAGE_BYTES)
        return json.dumps(out, default=str)


# ---- native stderr -----------------------------------------------------------------------------

#: glog's severity letter -> logging level (``E1130 20:09:24.665266  6011 file.cc:1098] msg``).
_GLOG = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ ([^\]]+)\] ?(.*)$")
_GLOG_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR,
                "F": logging.CRITICAL}
#: Native lines that are expected and harmless, logged at INFO whatever their glog level.
#: Mooncake logs "Local segment descriptor not found" at ERROR on every healthy start
#: (transfer_metadata.cpp: the first lookup of the engine's own segment, before it is
#: published); "Logging before InitGoogleLogging()" is glog's own preamble.
_BENIGN = ("Local segment descriptor not found", "Logging before InitGoogleLogging()")
NATIVE_LOGGER = "kvd.native"


def native_record(line: str) -> tuple[int, str, dict[str, Any]]:
    """(level, message, fields) for one line a native library wrote to stderr.

    glog lines keep their severity and give ``source`` (file:line); other lines are
    WARNING (an unexpected write to stderr). Known-benign lines are INFO.
    """
    m = _GLOG.match(line)
    level, msg, extra = logging.WARNING, line, {}
    if m:
        level, msg, extra = _GLOG_LEVELS[m.group(1)], m.group(3), {"source": m.group(2)}
    if any(b in line for b in _BENIGN):
        level = min(level, logging.INFO)
    return level, msg, extra


class NativeStderr:
    """Route file descriptor 2 through a pipe to a small log-shipper process.

    The shipper (``python -m kvd.logs LEVEL FORMAT``: stdlib only) turns each line into
    a ``kvd.native`` record (:func:`native_record`) in this process's format and writes
    it to the original stderr. A process rather than a thread, so that what a native
    library writes while the interpreter finalises or just before it aborts (a glog
    ``F`` line, a crash report) is still read: the shipper reads until the last writer
    is gone. It ignores SIGINT/SIGTERM (a terminal's Ctrl-C or systemd's stop reach the
    whole group) and exits at end of file.

    Python's own writes go to :attr:`stream` (the original stderr; ``sys.stderr`` is
    pointed at it too), not to fd 2, or they would go through the shipper as native text.
    """

    def __init__(self, level: str, fmt: str) -> None:
        sys.stderr.flush()
        saved = os.dup(2)
        self.stream: TextIO = os.fdopen(saved, "w", buffering=1, encoding="utf-8",
                                        errors="replace")
        read_fd, write_fd = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvd.logs", level, fmt], stdin=read_fd, stdout=saved,
                stderr=saved, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        finally:
            os.close(read_fd)
        os.dup2(write_fd, 2)
        os.close(write_fd)


def _ship(level: str, fmt: str) -> int:
    """The shipper's main: stdin lines -> records on stdout, until end of file."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    log = logging.getLogger(NATIVE_LOGGER)
    log.addHandler(handler)
    log.setLevel(level.upper())
    log.propagate = False
    for raw in sys.stdin.buffer:
        line = raw.decode("utf-8", "replace").rstrip()
        if line:
            lvl, msg, extra = native_record(line)
            log.log(lvl, "%s", msg, extra=fields(**extra))
    return 0


_native: NativeStderr | None = None


def _log_uncaught(kind: type[BaseException], exc: BaseException,
                  tb: TracebackType | None) -> None:
    """sys.excepthook: a crash is one record (with ``exc``), not loose traceback lines."""
    logging.getLogger("kvd").critical("uncaught exception", exc_info=(kind, exc, tb))


#: Third-party loggers whose INFO lines are per request (httpx: one per heartbeat and
#: bootstrap lookup); they log at WARNING and above unless the level is DEBUG.
CHATTY = ("httpx", "httpcore")


def configured() -> bool:
    """True once :func:`setup` installed kvd's handler on the root logger."""
    return any(isinstance(h.formatter, TextFormatter | JsonFormatter)
               for h in logging.getLogger().handlers)


def setup(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None,
          capture_native: bool = False) -> None:
    """Send every log record to ``stream`` (stderr) as ``fmt`` (text or json) at ``level``.

    ``capture_native`` (the daemon sets it): also turn what native libraries write to
    fd 2 into records (:class:`NativeStderr`), and log uncaught exceptions and
    warnings as records. Calling setup again replaces the previous handler.
    """
    global _native
    root = logging.getLogger()
    if capture_native and _native is None and stream is None:
        _native = NativeStderr(level, fmt)
        sys.stderr = _native.stream
        sys.excepthook = _log_uncaught
        logging.captureWarnings(True)  # warnings become records too
    out = stream or (_native.stream if _native is not None else sys.stderr)
    handler = logging.StreamHandler(out)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    quiet = logging.WARNING if root.level > logging.DEBUG else logging.NOTSET
    for name in CHATTY:
        logging.getLogger(name).setLevel(quiet)


if __name__ == "__main__":
    sys.exit(_ship(*sys.argv[1:3]))
