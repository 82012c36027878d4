"""kvd.logs: text and JSON lines; context fields from log_context/fields, never from text;
native stderr (glog) re-emitted as records; chatty third-party loggers quiet."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from kvd import logs
from kvd.text import MAX_LOG_MESSAGE_BYTES, MAX_REASON_BYTES


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    buf = io.StringIO()
    yield buf
    root.handlers[:] = saved
    root.setLevel(level)
    for name in logs.CHATTY:
        logging.getLogger(name).setLevel(logging.NOTSET)


def lines(buf: io.StringIO) -> list[str]:
    return buf.getvalue().splitlines()


def test_json_lines_carry_context_fields(stream: io.StringIO) -> None:
    logs.setup("DEBUG", "json", stream)
    log = logging.getLogger("kvd.test")
    log.warning("explicit", extra=logs.fields(room=7, peer="tcp://10.0.0.2:5000"))
    with logs.log_context(room=8, peer="tcp://10.0.0.3:5000"):
        log.warning("timed out in Transferring")
        with logs.log_context(peer="tcp://10.0.0.9:1"):
            log.info("inner peer wins")
    log.info("room 9: cannot reach prefill rank tcp://10.0.0.4:17000")  # text is not read
    try:
        raise ValueError("boom")
    except ValueError:
        with logs.log_context(room=10):
            log.exception("crashed")
    log.info("kvd ready", extra=logs.fields(http_port=8998, bootstrap_addr=None))
    out = [json.loads(line) for line in lines(stream)]
    assert out[0]["room"] == 7 and out[0]["peer"] == "tcp://10.0.0.2:5000"
    assert out[1]["room"] == 8 and out[1]["peer"] == "tcp://10.0.0.3:5000"
    assert out[2]["room"] == 8 and out[2]["peer"] == "tcp://10.0.0.9:1"
    assert "room" not in out[3] and "peer" not in out[3] and out[3]["level"] == "INFO"
    assert out[4]["room"] == 10 and "peer" not in out[4] and "ValueError: boom" in out[4]["exc"]
    assert out[5]["http_port"] == 8998 and "bootstrap_addr" not in out[5]
    assert out[5]["msg"] == "kvd ready"
    assert all(o["ts"].endswith("+00:00") and o["logger"] == "kvd.test" for o in out)
    assert logs.current_context() == {}


def test_record_fields_win_over_context(stream: io.StringIO) -> None:
    logs.setup("INFO", "json", stream)
    with logs.log_context(room=1, peer="a"):
        logging.getLogger("kvd.test").info("x", extra=logs.fields(peer="b"))
    (line,) = [json.loads(x) for x in lines(stream)]
    assert (line["room"], line["peer"]) == (1, "b")


def test_reserved_names_are_not_overwritten(stream: io.StringIO) -> None:
    logs.setup("INFO", "json", stream)
    logging.getLogger("kvd.test").info("real", extra=logs.fields(msg="fake", level="X"))
    (line,) = [json.loads(x) for x in lines(stream)]
    assert line["msg"] == "real" and line["level"] == "INFO"


async def test_tasks_inherit_the_context_they_were_created_in(stream: io.StringIO) -> None:
    logs.setup("INFO", "json", stream)
    log = logging.getLogger("kvd.test")

    async def later() -> None:
        await asyncio.sleep(0)
        log.info("in task")

    with logs.log_context(room=5, peer="p"):
        task = asyncio.create_task(later())
    log.info("outside")  # the block is over here, the task still carries room 5
    await task

    async def bound() -> None:
        logs.bind(room=6)
        log.info("bound in task")

    await asyncio.create_task(bound())
    log.info("after bound task")  # bind() inside a task does not leak out
    by_msg = {x["msg"]: x for x in map(json.loads, lines(stream))}
    assert by_msg["in task"]["room"] == 5 and by_msg["in task"]["peer"] == "p"
    assert "room" not in by_msg["outside"]
    assert by_msg["bound in task"]["room"] == 6
    assert "room" not in by_msg["after bound task"]


def test_message_context_reads_typed_fields() -> None:
    from kvd.protocol import control, rpc

    assert logs.message_context(rpc.ReceiverCreate(room=3, bootstrap_addr="h:1", dp_rank=None)) \
        == {"room": 3, "peer": "h:1"}
    assert logs.message_context(control.RoomAbort(room=4, inc=1, kind="aborted", reason="r",
                                                  endpoint="tcp://d:2", instance_id="i")) == \
        {"room": 4, "peer": "tcp://d:2"}
    assert logs.message_context(rpc.Poll(rooms=[1, 2])) == {}


def test_text_lines_and_level(stream: io.StringIO) -> None:
    logs.setup("warning", "text", stream)
    log = logging.getLogger("kvd.test")
    log.info("hidden")
    with logs.log_context(room=12, peer="10.0.0.1:8998"):
        log.warning("aborted on decode: x")
    log.warning("no room here")
    log.warning("ready", extra=logs.fields(http_port=1, note="two words"))
    first, second, third = lines(stream)
    assert " WARNING kvd.test room=12 peer=10.0.0.1:8998: aborted on decode: x" in first
    assert second.endswith(" WARNING kvd.test: no room here")
    assert third.endswith(' WARNING kvd.test: ready http_port=1 note="two words"')


def test_httpx_request_lines_are_quiet_unless_debug(stream: io.StringIO) -> None:
    logs.setup("INFO", "text", stream)
    logging.getLogger("httpx").info('HTTP Request: GET http://h/health "HTTP/1.1 200 OK"')
    logging.getLogger("httpx").warning("a real problem")
    assert len(lines(stream)) == 1 and "a real problem" in stream.getvalue()
    logs.setup("DEBUG", "text", stream)
    logging.getLogger("httpx").info("HTTP Request: visible at DEBUG")
    assert "visible at DEBUG" in stream.getvalue()


@pytest.mark.parametrize(("line", "level", "msg", "source"), [
    ("E1130 20:09:24.665266  6011 transfer_metadata.cpp:1098] Local segment descriptor "
     "not found", logging.INFO, "Local segment descriptor not found",
     "transfer_metadata.cpp:1098"),
    ("W1130 20:09:24.665222  6011 topology.cpp:201] No RDMA devices found",
     logging.WARNING, "No RDMA devices found", "topology.cpp:201"),
    ("E1130 20:09:24.665266  6011 tcp_transport.cpp:10] connect failed", logging.ERROR,
     "connect failed", "tcp_transport.cpp:10"),
    ("F1130 20:09:24.665266  6011 x.cpp:1] Check failed", logging.CRITICAL, "Check failed",
     "x.cpp:1"),
    ("something else on stderr", logging.WARNING, "something else on stderr", None),
])
def test_native_record(line: str, level: int, msg: str, source: str | None) -> None:
    got_level, got_msg, extra = logs.native_record(line)
    assert (got_level, got_msg, extra.get("source")) == (level, msg, source)


_NATIVE_CHILD = textwrap.dedent("""
    import ctypes, logging, os, sys
    from kvd import logs
    logs.setup("INFO", "json", capture_native=True)
    libc = ctypes.CDLL(None)
    # what glog does: write(2, ...) from native code, bypassing Python's sys.stderr
    for line in (b"W1130 20:09:24.665222  6011 topology.cpp:201] No RDMA devices found\\n",
                 b"E1130 20:09:24.665266  6011 transfer_metadata.cpp:1098] Local segment "
                 b"descriptor not found\\n", b"plain native text\\n"):
        libc.write(2, line, len(line))
    import warnings
    warnings.warn("python warning", UserWarning, stacklevel=1)
    logging.getLogger("kvd").info("kvd ready", extra=logs.fields(http_port=1))
    if sys.argv[1] == "crash":
        raise RuntimeError("boom")
    if sys.argv[1] == "abort":  # a glog F line, then abort(): nothing may be lost
        line = b"F1130 20:09:24.665266  6011 x.cpp:1] Check failed: fatal\\n"
        libc.write(2, line, len(line))
        libc.abort()
    class Late:  # written while the interpreter shuts down (the transfer engine's teardown)
        def __del__(self):
            line = b"I1130 20:09:25.0  6011 transfer_metadata.cpp:616] late\\n"
            libc.write(2, line, len(line))
    Late.me = Late()
""")


@pytest.mark.parametrize(("how", "rc"), [("exit", 0), ("crash", 1), ("abort", -6)])
def test_native_stderr_becomes_json_records(how: str, rc: int) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", _NATIVE_CHILD, how], capture_output=True,
                          text=True, timeout=60, check=False, env=env)
    assert proc.returncode == rc
    records = [json.loads(line) for line in proc.stderr.splitlines()]  # JSON only
    by_msg = {r["msg"]: r for r in records}
    rdma = by_msg["No RDMA devices found"]
    assert rdma["level"] == "WARNING" and rdma["logger"] == "kvd.native"
    assert rdma["source"] == "topology.cpp:201"
    assert by_msg["Local segment descriptor not found"]["level"] == "INFO"  # benign
    assert by_msg["plain native text"]["level"] == "WARNING"
    (warned,) = [r for r in records if "python warning" in r["msg"]]
    assert warned["logger"] == "py.warnings" and warned["level"] == "WARNING"
    assert by_msg["kvd ready"]["http_port"] == 1
    if how == "crash":
        crash = by_msg["uncaught exception"]
        assert crash["level"] == "CRITICAL" and "RuntimeError: boom" in crash["exc"]
    if how == "abort":
        assert by_msg["Check failed: fatal"]["level"] == "CRITICAL"
    if how == "exit":
        assert by_msg["late"]["source"] == "transfer_metadata.cpp:616"


# ---- S21: foreign text cannot forge a record or reach the terminal raw ---------------------------

FORGED = "bye\n2026-01-01 00:00:00,000 ERROR kvd: forged\x1b[31m"


def test_s21_text_records_stay_one_line_whatever_the_text(stream: io.StringIO) -> None:
    logs.setup("INFO", "text", stream)
    log = logging.getLogger("kvd.test")
    log.warning("abort: %s", FORGED, extra=logs.fields(room=1, peer="tcp://x\nERROR kvd:",
                                                       reason=FORGED, who="a\x1b]0;t\x07"))
    try:
        raise ValueError(FORGED)
    except ValueError:
        log.exception("crashed %s", "\x1b[2J")
    out = lines(stream)
    heads = [n for n, line in enumerate(out) if not line.startswith(" ")]
    assert heads == [0, 1]  # two records; a traceback's lines are indented under the second
    assert not any(line.startswith("2026-01-01 00:00:00,000 ERROR") for line in out)
    assert all("\x1b" not in line and "\x07" not in line for line in out)
    assert "abort: bye\\n2026-01-01 00:00:00,000 ERROR kvd: forged\\x1b[31m" in out[0]
    assert 'peer="tcp://x\\nERROR kvd:"' in out[0] and "who=a\\x1b]0;t\\x07" in out[0]
    assert out[1].endswith("crashed \\x1b[2J")
    # the exception's own newline stays a traceback line: indented, its ESC escaped
    assert "    2026-01-01 00:00:00,000 ERROR kvd: forged\\x1b[31m" in out[2:]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_s21_log_text_is_bounded(stream: io.StringIO, fmt: str) -> None:
    logs.setup("INFO", fmt, stream)
    log = logging.getLogger("kvd.test")
    log.warning("%s", "m" * (1 << 20), extra=logs.fields(reason="r" * (1 << 20)))
    try:
        raise ValueError("e" * (1 << 20))
    except ValueError:
        log.exception("crashed")
    out = stream.getvalue()
    assert len(out.encode()) < 3 * MAX_LOG_MESSAGE_BYTES + MAX_REASON_BYTES + 1000
    assert out.count("...[cut, ") == 3  # the message, the field, the traceback


def test_s21_json_records_escape_and_bound(stream: io.StringIO) -> None:
    logs.setup("INFO", "json", stream)
    logging.getLogger("kvd.test").warning("%s", FORGED, extra=logs.fields(reason="r" * 5000))
    (line,) = lines(stream)
    assert "\x1b" not in line
    record = json.loads(line)
    assert record["msg"] == FORGED and len(record["reason"]) <= MAX_REASON_BYTES
