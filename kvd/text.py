"""Text that came from elsewhere (peers, engines, native libraries), made safe to show.

A reason, endpoint or instance id a peer or an engine sent may carry a newline (a forged
log line: ``"x\\n2026-01-01 ... ERROR kvd: forged"``), terminal escapes (ANSI ``ESC[``
sequences that rewrite what an operator sees) or megabytes (case S21). Two rules, each
idempotent, so applying them again at every sink is harmless:

* :func:`escape` writes every character Python calls non-printable (C0/C1 controls,
  DEL, line and paragraph separators, bidi and other format characters, surrogates) as
  ``\\n``, ``\\x1b``, ``\\u2028``...; printable text, spaces included, is unchanged;
* :func:`bound` cuts text to :data:`MAX_REASON_BYTES` of UTF-8 (on a character
  boundary), saying how long it was.

Where they apply: a reason is cleaned where it enters (the engine's ``Abort``, a peer's
``RoomStatus``/``RoomAbort``, every :class:`~kvd.rooms.state.RoomFailure`), and every sink
cleans again: text logs (:class:`~kvd.logs.TextFormatter`), ``/v1/status`` and
``/v1/rooms`` (:mod:`kvd.schemas`), metric labels. PURE, stdlib only.
"""

from __future__ import annotations

#: The most UTF-8 bytes of one reason (or other foreign text field) kvd keeps or shows.
MAX_REASON_BYTES = 1024
#: The most UTF-8 bytes of one log message (its text, after formatting its arguments).
MAX_LOG_MESSAGE_BYTES = 16 << 10


def _escape_char(ch: str) -> str:
    code = ord(ch)
    if ch in "\n\r\t":
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}[ch]
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def escape(text: str, keep: str = "") -> str:
    """``text`` with every non-printable character (but those in ``keep``) escaped."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch in keep else _escape_char(ch)
                   for ch in text)


def bound(text: str, limit: int = MAX_REASON_BYTES) -> str:
    """``text`` if its UTF-8 form fits in ``limit`` bytes, else its start (whole
    characters) and ``...[cut, N bytes]``, the whole at most ``limit`` bytes."""
    if len(text) * 4 <= limit:  # fast path: a character is at most 4 bytes
        return text
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        return text
    marker = f"...[cut, {len(data)} bytes]"
    return data[:max(limit - len(marker), 0)].decode("utf-8", "ignore") + marker


def clean(text: str, limit: int = MAX_REASON_BYTES) -> str:
    """:func:`escape` then :func:`bound`: foreign text as kvd keeps and shows it."""
    return bound(escape(text), limit)
