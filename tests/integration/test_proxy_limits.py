"""``kvd proxy`` as a real process in front of fake OpenAI engines (case S20): what a
client of a public HTTP service can do to it -- a huge body, half-sent requests, a body
that never ends, more connections than it takes, no token."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s20-0123456789abcdef-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
MAX_BODY = 1 << 20


class FakeEngine(BaseHTTPRequestHandler):
    """A prefill and decode engine in one: a prefill leg (``do_remote_decode``) answers
    transfer params for its room, a decode leg answers its prompt and the params it got."""

    seen: list[dict[str, Any]] = []

    def do_GET(self) -> None:
        self._answer({"status": "ok"} if self.path == "/health" else {"data": []})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.seen.append(body)
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            self._answer({"kv_transfer_params": {"do_remote_prefill": True,
                                                 "bootstrap_room": params["bootstrap_room"]}})
        else:
            self._answer({"choices": [{"text": f"decoded {body['prompt']}"}], "kv": params})

    def _answer(self, doc: dict[str, Any]) -> None:
        data = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@dataclass
class ProxyProcess:
    proc: subprocess.Popen[str]
    port: int
    engine: str
    stderr: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss(self) -> int:
        """Resident set size (bytes)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
        raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeEngine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def start_proxy(engine: str, tmp: Path, *opts: str) -> ProxyProcess:
    """``kvd proxy`` on a free loopback port, prefill and decode ``engine``, the token
    file in ``tmp``; returns once it answers ``/health``."""
    token = tmp / "proxy-token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvd.cli.main", "proxy", "-p", engine, "-d", engine,
         "--port", "0", "--token-file", str(token), "--health-interval", "0", *opts],
        stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "listening on" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(60):
        proc.kill()
        raise AssertionError(f"kvd proxy did not start: {''.join(lines)}")
    port = int(next(x for x in lines if "listening on" in x).rsplit(":", 1)[1])
    return ProxyProcess(proc, port, engine, lines)


def stop_proxy(p: ProxyProcess) -> None:
    p.proc.terminate()
    try:
        p.proc.wait(30)
    except subprocess.TimeoutExpired:
        p.proc.kill()
        p.proc.wait()


@pytest.fixture(scope="module")
def proxy(engine: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    p = start_proxy(engine, tmp_path_factory.mktemp("proxy"), "--max-body", str(MAX_BODY),
                    "--header-timeout", "1", "--body-timeout", "2",
                    "--max-connections", "512")
    yield p
    stop_proxy(p)


def _connect(p: ProxyProcess, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", p.port), timeout=60)
    s.sendall(data)
    return s


def _until_closed(s: socket.socket) -> bytes:
    """What the server sent until it closed the connection (generous bound: 60 s)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def _push(p: ProxyProcess, head: bytes, total: int, chunked: bool) -> tuple[int, bytes]:
    """Send ``head`` then up to ``total`` body bytes (HTTP chunks of 64 KiB if
    ``chunked``) until the proxy answers; (body bytes it took, its answer)."""
    piece = b"x" * (64 << 10)
    frame = b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece
    s, sent = _connect(p, head), 0
    s.settimeout(0)
    try:
        while sent < total:
            try:
                sent += s.send(frame) if chunked else s.send(piece[: total - sent])
            except BlockingIOError:
                try:
                    if s.recv(1, socket.MSG_PEEK):
                        break  # the proxy answered
                except BlockingIOError:
                    time.sleep(0.001)
                except OSError:
                    return sent, b"reset"
            except OSError:  # reset: it closed after answering
                return sent, b"reset"
        s.settimeout(60)
        try:
            return sent, _until_closed(s)
        except ConnectionResetError:
            return sent, b"reset"
    finally:
        s.close()


def _head(path: str, extra: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"{extra}\r\n").encode()


def _refused(p: ProxyProcess, reason: str) -> float:
    """The proxy's ``kvd_proxy_refused_total{reason}``."""
    text = httpx.get(f"{p.url}/metrics", timeout=30).text
    line = f'kvd_proxy_refused_total{{reason="{reason}"}} '
    return next((float(x.removeprefix(line)) for x in text.splitlines()
                 if x.startswith(line)), 0.0)


def test_s20_a_huge_body_is_refused_unread_and_memory_stays_flat(proxy: ProxyProcess) -> None:
    """S20: a client announcing 300 MB (Expect: 100-continue) gets 413 from the headers
    and sends nothing; 300 MB pushed without waiting, declared without a token and
    chunked with it, are each refused (counted) after a few MB at most (socket buffers:
    the client then sees the 413 or a reset, as the proxy closes without reading on);
    the proxy's RSS does not grow by the body's size and no engine sees a request."""
    seen, before, refused = len(FakeEngine.seen), proxy.rss(), _refused(proxy, "body_too_large")
    declared = _head("/v1/completions", f"Content-Length: {300 << 20}\r\n")
    s = _connect(proxy, declared.replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n"))
    try:
        answer = _until_closed(s)
    finally:
        s.close()
    assert answer.startswith(b"HTTP/1.1 413 ") and b'"code": 413' in answer, answer
    assert b"314572800 bytes" in answer
    chunked = _head("/v1/chat/completions",
                    f"Transfer-Encoding: chunked\r\nAuthorization: Bearer {TOKEN}\r\n")
    pushes = ((declared, False), (chunked, True), (declared, False), (chunked, True))
    for head, is_chunked in pushes:
        sent, answer = _push(proxy, head, 300 << 20, is_chunked)
        assert answer.startswith(b"HTTP/1.1 413 ") or answer == b"reset", answer[:200]
        assert sent < 64 << 20, sent
    for _ in range(600):  # the proxy counts each refusal as it answers (generous bound)
        if _refused(proxy, "body_too_large") == refused + 1 + len(pushes):
            break
        time.sleep(0.1)
    assert _refused(proxy, "body_too_large") == refused + 1 + len(pushes)
    assert proxy.rss() - before < 64 << 20, (before, proxy.rss())
    assert len(FakeEngine.seen) == seen


def test_s20_half_sent_requests_are_closed_at_the_header_deadline(proxy: ProxyProcess) -> None:
    """S20: 200 connections that send half a request head and then nothing are each
    closed by the proxy (head deadline 1 s; waited for within a generous bound), without
    an answer; a request after them is served."""
    conns = [_connect(proxy, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
             for _ in range(200)]
    try:
        assert [_until_closed(s) for s in conns] == [b""] * 200
    finally:
        for s in conns:
            s.close()
    assert httpx.get(f"{proxy.url}/health", timeout=30).status_code == 200


def test_s20_a_body_that_never_finishes_is_answered_408(proxy: ProxyProcess) -> None:
    """S20: a body announced as 1 MB of which 1000 bytes come -> 408 at the body deadline
    (2 s; waited for within a generous bound), and the connection closed."""
    head = _head("/v1/completions", f"Content-Length: {1 << 20}\r\n"
                                    f"Authorization: Bearer {TOKEN}\r\n")
    s = _connect(proxy, head + b"{" + b" " * 999)
    try:
        answer = _until_closed(s)
    finally:
        s.close()
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]


def test_s20_the_token_is_required_and_answers_name_no_engine(proxy: ProxyProcess) -> None:
    """S20: without the bearer token (or with a wrong one) -> 401 and nothing forwarded;
    with it -> the decode's answer byte for byte; /health and /metrics are open and
    name no engine address."""
    seen, body = len(FakeEngine.seen), {"model": "m", "prompt": "s20", "max_tokens": 3}
    with httpx.Client(base_url=proxy.url, timeout=30) as c:
        assert c.post("/v1/completions", json=body).status_code == 401
        assert c.post("/v1/completions", json=body,
                      headers={"authorization": "Bearer not-the-token-at-all"}
                      ).status_code == 401
        assert len(FakeEngine.seen) == seen
        r = c.post("/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 200, r.text
        legs = FakeEngine.seen[seen:]
        room = legs[0]["kv_transfer_params"]["bootstrap_room"]
        expected = {"choices": [{"text": "decoded s20"}],
                    "kv": {"do_remote_prefill": True, "bootstrap_room": room}}
        assert r.content == json.dumps(expected).encode()
        health, metrics = c.get("/health"), c.get("/metrics")
    assert health.status_code == 200 and metrics.status_code == 200
    engine_addr = proxy.engine.removeprefix("http://")
    assert engine_addr not in health.text and engine_addr not in metrics.text
    assert 'kvd_proxy_refused_total{reason="unauthenticated"}' in metrics.text


def _one_response(s: socket.socket) -> bytes:
    """One whole response with a Content-Length from ``s`` (the connection stays)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed after {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(rest) < length:
        rest += s.recv(65536)
    return head + b"\r\n\r\n" + rest


def test_s20_the_connection_cap_holds(engine: str, tmp_path: Path) -> None:
    """S20: a proxy taking 8 connections, 8 of them busy sending a body -> each newcomer
    is closed at once without an answer; the 8 are kept and answered when their bodies
    complete."""
    p = start_proxy(engine, tmp_path, "--max-connections", "8", "--header-timeout", "60",
                    "--body-timeout", "60")
    body = json.dumps({"model": "m", "prompt": "cap"}).encode()
    post = _head("/v1/completions", f"Content-Length: {len(body)}\r\nConnection: close\r\n"
                                    f"Authorization: Bearer {TOKEN}\r\n") + body[:5]
    probe = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    busy: list[socket.socket] = []
    try:
        for _ in range(8):
            # pipelined: the proxy starts the POST as it finishes the GET's answer, so
            # once the answer is here this connection is busy (a body in progress)
            busy.append(_connect(p, probe + post))
            assert _one_response(busy[-1]).startswith(b"HTTP/1.1 200 ")
        for _ in range(5):
            s = _connect(p, probe)
            try:
                assert _until_closed(s) == b""
            except ConnectionResetError:
                pass
            finally:
                s.close()
        for s in busy:
            s.sendall(body[5:])
        answers = [_until_closed(s) for s in busy]
        assert all(a.startswith(b"HTTP/1.1 200 ") and b'"decoded cap"' in a
                   for a in answers), answers
    finally:
        for s in busy:
            s.close()
        stop_proxy(p)
