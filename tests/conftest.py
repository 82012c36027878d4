"""Shared fixtures: real kvd daemons on loopback with the real Mooncake TCP transport."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, settings

from kvd.launch import DaemonProcess, start_daemon
from kvd.refengine.standin import EngineStandIn

# Property tests run on a busy 2-core machine (CI, other jobs): no per-example wall-clock
# deadline and no "too slow" health check -- speed lives in the benchmarks, not here.
settings.register_profile("kvd", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvd")


@dataclass
class PdPair:
    """A prefill kvd (serving bootstrap) and a decode kvd, each with an engine stand-in."""

    prefill: DaemonProcess
    decode: DaemonProcess
    p_engine: EngineStandIn
    d_engine: EngineStandIn

    @property
    def bootstrap(self) -> str:
        return self.prefill.http_addr


def start_pair(workdir: Path, p_opts: dict | None = None, d_opts: dict | None = None,
               engine_opts: dict | None = None, d_engine_opts: dict | None = None) -> PdPair:
    """Start P (bootstrap) + D daemons and register a stand-in engine with each."""
    prefill = start_daemon("prefill", workdir, serve_bootstrap=True, **(p_opts or {}))
    decode = start_daemon("decode", workdir, **(d_opts or {}))
    p_engine = EngineStandIn(prefill.socket, seed=1, **(engine_opts or {}))
    d_engine = EngineStandIn(decode.socket, seed=2, **(d_engine_opts or engine_opts or {}))
    return PdPair(prefill, decode, p_engine, d_engine)


def stop_pair(pair: PdPair) -> None:
    """Close stand-ins and stop both daemons."""
    pair.p_engine.close()
    pair.d_engine.close()
    pair.prefill.stop()
    pair.decode.stop()


@pytest.fixture(scope="session")
def shared_pd_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdPair]:
    """One P/D pair shared by the integration tests (creating engines is cheap, stopping not)."""
    pair = start_pair(tmp_path_factory.mktemp("pd"))
    yield pair
    stop_pair(pair)


@pytest.fixture
def pd_pair(shared_pd_pair: PdPair) -> Iterator[PdPair]:
    """The shared pair, with every room a test left unfinished ended after it: a live room
    holds its destination pages (K42), so one test's leftovers must not refuse the next
    test's pages."""
    yield shared_pd_pair
    settle_rooms(shared_pd_pair)


def settle_rooms(pair: PdPair, bound: float = 30.0) -> None:
    """Abort every unfinished room on both daemons of ``pair`` and clear it once its pages
    are releasable (at most ``bound`` s each); best effort, never raises."""
    from kvd.client import Receiver, Sender

    for daemon, engine, kind in ((pair.decode, pair.d_engine, Receiver),
                                 (pair.prefill, pair.p_engine, Sender)):
        try:
            resp = signed("GET", f"http://{daemon.http_addr}/v1/rooms")
            rows = resp.json() if resp.status_code == 200 else []
        except Exception:  # a test that stopped a daemon: nothing to settle
            continue
        for row in rows:
            room = kind.attach(engine.client, int(row["room"]))
            try:
                if row.get("state") not in ("Success", "Failed"):
                    room.abort("test over")
                room.clear(timeout=bound)
            except Exception:  # the room ended meanwhile, or the engine went away
                pass


BACKENDS = ["mooncake", "local"]


@pytest.fixture(scope="session", params=BACKENDS)
def room_pair(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdPair]:
    """A P/D pair per transfer backend (the room tests run with each): ``mooncake`` over
    loopback TCP, and ``local`` (same-host direct copies of the imported pool)."""
    opts = {"transfer_backend": request.param}
    pair = start_pair(tmp_path_factory.mktemp(f"pd-{request.param}"), p_opts=opts,
                      d_opts=opts)
    yield pair
    stop_pair(pair)


@pytest.fixture
def room_ids() -> Iterator[int]:
    """An iterator of fresh room ids, unique across the session (``next(room_ids)``)."""
    return _room_counter


def _rooms() -> Iterator[int]:
    n = 1000
    while True:
        n += 1
        yield n


_room_counter = _rooms()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def health(daemon: DaemonProcess) -> dict:
    """The daemon's /health JSON."""
    import httpx

    return httpx.get(f"http://{daemon.http_addr}/health", timeout=5).json()


def signed(method: str, url: str, to_instance: str | None = None,
           **kwargs: object) -> httpx.Response:
    """An HTTP request authenticated with the launched daemons' cluster secret, addressed
    to ``to_instance`` (default: the instance that serves ``url``, from its /health)."""

    from kvd.launch import LAUNCH_SECRET
    from kvd.security import Authenticator

    auth = Authenticator(LAUNCH_SECRET.encode())
    with httpx.Client(timeout=5) as client:
        req = client.build_request(method, url, **kwargs)  # type: ignore[arg-type]
        if to_instance is None:
            health = client.get(req.url.copy_with(path="/health", query=None))
            to_instance = str(health.json()["instance_id"])
        req.headers.update(auth.http_header(method, req.url.path, req.url.query.decode(),
                                            req.content, to_instance))
        return client.send(req)


def push_frames(endpoint: str, frames: list[bytes], linger_ms: int = 2000) -> None:
    """Send raw frames to a daemon's control socket, as any process on the network can
    (a DEALER: the control socket is a ROUTER)."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.connect(endpoint)
    for f in frames:
        sock.send(f)
    sock.close()
    ctx.term()


def eventually_transfers(p_engine: object, d_engine: object, bootstrap: str, first_room: int,
                         src: list[int], dst: list[int], within: float = 20.0) -> int:
    """Start rooms until one succeeds (a recovering peer is seen by the next heartbeat);
    returns the room that succeeded, or fails the test after ``within`` seconds."""
    import time

    from kvd.client import KVPoll, Receiver
    from kvd.refengine.standin import transfer_room, wait_rooms

    deadline, room = time.monotonic() + within, first_room
    while time.monotonic() < deadline:
        transfer_room(p_engine, d_engine, bootstrap, room, src, dst, chunk=1)  # type: ignore[arg-type]
        if wait_rooms(d_engine.client, [room], timeout=10) == [KVPoll.Success]:  # type: ignore[attr-defined]
            return room
        # the failed attempt holds ``dst`` until nothing can land in it (K42: live rooms'
        # pages never overlap): clear it, which waits for that, before the next attempt
        Receiver.attach(d_engine.client, room).clear()  # type: ignore[attr-defined]
        room += 1
        time.sleep(0.5)
    raise AssertionError(f"no room succeeded within {within}s after recovery")


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[object]:
    """A real etcd server on loopback (free ports, temp data dir), stopped afterwards;
    skipped with the reason when the etcd binary is missing."""
    from tests.helpers.etcd import EtcdServer, etcd_binary

    binary = etcd_binary()
    if binary is None:
        pytest.skip("etcd is not installed (scripts/system-deps.sh installs etcd-server)")
    server = EtcdServer(tmp_path, binary)
    server.start()
    yield server
    server.stop()
