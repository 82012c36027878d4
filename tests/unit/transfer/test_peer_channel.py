"""The same-host peer channel (case S18): the pure handshake parts (proofs bound to both
nonces, both instances, the server's pid and the registered pool; credentials; names;
descriptor checks), then real sockets: an honest exchange, and a fake decode that
names a foreign pid, another instance, a path, or squats the socket as another uid."""

from __future__ import annotations

import fcntl
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvd.errors import HandleError
from kvd.protocol.memory import ExportedBuffer, ExportedPool, PassedFdHandle
from kvd.security import Authenticator
from kvd.transfer.backends import peerchannel as pc
from tests.helpers.channel_squatter import ChannelSquatter

SECRET = b"s18-unit-secret-0123456789abcdef"
SIZE = 8192
DEC = pc.Claim("dec", "tcp://127.0.0.1:1", "sess-dec")


def me(instance: str, secret: bytes | None = SECRET) -> pc.Identity:
    return pc.Identity(instance, frozenset({os.geteuid()}),
                       Authenticator(secret, instance).channel_mac)


def pool(pid: int, channel: str = "peer-dec.sock", length: int = 4096) -> ExportedPool:
    return ExportedPool("h/b", [ExportedBuffer(1 << 30, length, PassedFdHandle(0, 0, length))],
                        channel=channel, pid=pid)


# ---- tier 1: the pure parts --------------------------------------------------------------


def test_s18_proofs_bind_nonces_instances_pid_and_pool() -> None:
    mac = Authenticator(SECRET).channel_mac
    base = ("server", b"a" * 16, b"b" * 16, "dec", "pre", 42, b"d" * 32)
    want = pc.proof(mac, *base)
    pc.check_proof(mac, want, pc.proof(mac, *base), "server")
    for i, other in [(0, "client"), (1, b"x" * 16), (2, b"y" * 16), (3, "relay"),
                     (4, "pre2"), (5, 43), (6, b"e" * 32)]:
        changed = list(base)
        changed[i] = other
        with pytest.raises(HandleError, match="did not prove"):
            pc.check_proof(mac, want, pc.proof(mac, *changed), "server")
    other_secret = Authenticator(b"another-secret-0123456789abcdef!").channel_mac
    assert pc.proof(other_secret, *base) != want
    assert Authenticator(None).channel_mac(b"x") == b""  # insecure: nothing to prove


def test_s18_credentials_uid_and_registered_pid() -> None:
    pc.check_credentials(10, 0, 10, frozenset({0}), "peer")
    pc.check_credentials(10, 0, None, frozenset({0}), "peer")
    with pytest.raises(HandleError, match="uid 65534"):
        pc.check_credentials(10, 65534, 10, frozenset({0}), "peer")
    with pytest.raises(HandleError, match="not pid 11"):
        pc.check_credentials(10, 0, 11, frozenset({0}), "peer")


@pytest.mark.parametrize("name", ["../kvd.sock", "/etc/passwd", "peer-a/../../x.sock",
                                  "peer-.sock", "x.sock", "peer-a.sock\0", ""])
def test_s18_a_channel_is_named_never_a_path(name: str) -> None:
    with pytest.raises(HandleError, match="not a socket name"):
        pc.channel_path(Path("/run/kvd/peers"), name)
    assert pc.channel_path(Path("/p"), "peer-dec-1.sock") == Path("/p/peer-dec-1.sock")


def test_s18_regions_say_what_each_passed_file_must_hold() -> None:
    p = ExportedPool("h", [ExportedBuffer(0, 64, PassedFdHandle(0, 0, 64)),
                           ExportedBuffer(64, 64, PassedFdHandle(0, 4096, 64)),
                           ExportedBuffer(128, 8, PassedFdHandle(1, 8, 8))])
    assert pc.needed_sizes(p) == {0: 4160, 1: 16}
    bad = ExportedPool("h", [ExportedBuffer(0, 64, PassedFdHandle(0, 0, 32))])
    with pytest.raises(HandleError, match="malformed"):
        pc.needed_sizes(bad)


def test_s18_passed_descriptors_are_checked_before_mapping(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x" * 100)
    fd = os.open(f, os.O_RDWR)
    ro = os.open(f, os.O_RDONLY)
    r, w = os.pipe()
    mfd = os.memfd_create("kvd-test", os.MFD_ALLOW_SEALING)
    os.ftruncate(mfd, 100)
    try:
        pc.check_passed_file(fd, 0, 100)
        with pytest.raises(HandleError, match="fewer than the 101"):
            pc.check_passed_file(fd, 0, 101)
        with pytest.raises(HandleError, match="read-write"):
            pc.check_passed_file(ro, 0, 1)
        with pytest.raises(HandleError, match="not a regular file"):
            pc.check_passed_file(r, 0, 1)
        with pytest.raises(HandleError, match="F_SEAL_SHRINK"):
            pc.check_passed_file(mfd, 0, 1)
        fcntl.fcntl(mfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        pc.check_passed_file(mfd, 0, 100)
    finally:
        for x in (fd, ro, r, w, mfd):
            os.close(x)


def test_s18_a_peer_never_passes_this_daemons_own_engine_file(tmp_path: Path) -> None:
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    mine.write_bytes(b"m" * 64)
    theirs.write_bytes(b"t" * 64)
    own = {(os.stat(mine).st_dev, os.stat(mine).st_ino)}
    fds = [os.open(theirs, os.O_RDWR), os.open(mine, os.O_RDWR)]
    try:
        pc.check_not_own(fds[:1], own)
        with pytest.raises(HandleError, match=r"#1 .* own engine memory"):
            pc.check_not_own(fds, own)
    finally:
        pc.close_all(fds)


def test_s18_a_refusal_or_a_wrong_message_is_a_clear_error() -> None:
    with pytest.raises(HandleError, match="refused the channel: no"):
        pc.decode(pc.encode(pc.Refusal("no")), pc.Challenge)
    with pytest.raises(HandleError, match="expected Files, got Proof"):
        pc.decode(pc.encode(pc.Proof(b"")), pc.Files)
    with pytest.raises(HandleError, match="malformed"):
        pc.decode(b"\xc1", pc.Files)


# ---- real sockets ----------------------------------------------------------------------------


class Server:
    """A decode's channel in a thread of this process (same uid, this pid)."""

    def __init__(self, folder: Path, instance: str = "dec", size: int = SIZE) -> None:
        self.instance, self.folder = instance, folder
        self.file = folder.parent / "pool"
        self.file.write_bytes(os.urandom(size))
        self.fd = os.open(self.file, os.O_RDWR)
        self.pool = pool(os.getpid(), pc.channel_name(instance))
        self.sock = pc.listen(folder, self.pool.channel)
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    pc.serve_one(conn, me(self.instance), DEC, self.pool, [self.fd])
                except (HandleError, OSError) as exc:
                    self.errors.append(str(exc))

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        os.close(self.fd)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path / "peers")
    yield s
    s.close()


def test_s18_an_honest_decode_passes_its_registered_file(server: Server) -> None:
    fds = pc.fetch_pool(server.folder, server.pool, me("pre"), DEC)
    try:
        assert len(fds) == 1
        st, want = os.fstat(fds[0]), os.stat(server.file)
        assert (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino)
    finally:
        pc.close_all(fds)


def test_s18_a_registration_naming_another_pid_is_refused(server: Server) -> None:
    forged = msgspec.structs.replace(server.pool, pid=1)  # the channel is not pid 1's
    with pytest.raises(HandleError, match="not pid 1 that the registration names"):
        pc.fetch_pool(server.folder, forged, me("pre"), DEC)


@pytest.mark.parametrize("claim", [
    pc.Claim("forger", DEC.endpoint, DEC.session),
    pc.Claim(DEC.instance, "tcp://127.0.0.1:2", DEC.session),  # the forger's own endpoint
    pc.Claim(DEC.instance, DEC.endpoint, "sess-forger"),  # ... or its own session
])
def test_s18_a_forger_cannot_claim_an_honest_decodes_memory(server: Server,
                                                            claim: pc.Claim) -> None:
    """A secret holder registers naming the honest decode's channel under another instance,
    or the decode's instance with its own endpoint or transfer session (so that its pages
    would be written into the decode's memory): the decode refuses to prove a registration
    that is not its own."""
    with pytest.raises(HandleError, match=r"refused the channel.*asked for instance"):
        pc.fetch_pool(server.folder, server.pool, me("pre"), claim)


def test_s18_a_forger_cannot_name_other_memory_or_lack_the_secret(server: Server) -> None:
    """A pool other than the one the decode serves (other regions) is refused by the
    digest; a client without the secret by the proof."""
    bigger = pool(os.getpid(), server.pool.channel, length=SIZE)  # other regions
    with pytest.raises(HandleError, match="other memory than its registration"):
        pc.fetch_pool(server.folder, bigger, me("pre"), DEC)
    with pytest.raises(HandleError, match="did not prove the cluster secret"):
        pc.fetch_pool(server.folder, server.pool,
                      me("pre", b"another-secret-0123456789abcdef!"), DEC)


def test_s18_a_squatter_running_as_another_uid_is_refused(tmp_path: Path) -> None:
    """A process of uid 65534 listening on the channel socket and passing a victim file's
    descriptor: refused on its credentials before a byte is sent; the file unchanged."""
    folder = tmp_path / "peers"
    folder.mkdir()
    victim = tmp_path / "victim"
    data = os.urandom(65379)
    victim.write_bytes(data)
    fd = os.open(victim, os.O_RDWR)
    try:
        with ChannelSquatter(folder / "peer-dec.sock", fd) as sq:
            forged = pool(sq.proc.pid, "peer-dec.sock")
            with pytest.raises(HandleError, match="uid 65534"):
                pc.fetch_pool(folder, forged, me("pre"), DEC)
    finally:
        os.close(fd)
    assert victim.read_bytes() == data


def test_s18_the_daemons_channel_server_passes_the_pool_it_has_now(tmp_path: Path) -> None:
    """:class:`ChannelServer` on an event loop (as the decode daemon runs it): a client
    gets the snapshot's file; with no engine registered (snapshot None) it is closed
    at once; the socket file goes with the server."""
    import asyncio

    folder = tmp_path / "peers"
    f = tmp_path / "pool"
    f.write_bytes(os.urandom(SIZE))
    fd = os.open(f, os.O_RDWR)
    exported = pool(os.getpid(), pc.channel_name("dec"))
    state: dict[str, bool] = {"registered": True}

    def snapshot() -> tuple[ExportedPool, list[int]] | None:
        return (exported, [os.dup(fd)]) if state["registered"] else None

    async def main() -> None:
        server = pc.ChannelServer(folder, me("dec"), DEC, snapshot)
        task = asyncio.ensure_future(server.run())
        await asyncio.sleep(0)
        got = await asyncio.to_thread(pc.fetch_pool, folder, exported, me("pre"), DEC)
        assert os.fstat(got[0]).st_ino == os.stat(f).st_ino
        pc.close_all(got)
        state["registered"] = False
        with pytest.raises(HandleError, match=r"closed|reset"):
            await asyncio.to_thread(pc.fetch_pool, folder, exported, me("pre"), DEC)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not (folder / exported.channel).exists()

    try:
        asyncio.run(main())
    finally:
        os.close(fd)


def test_s18_idle_channel_clients_cost_bounded_descriptors(tmp_path: Path) -> None:
    """Hostile clients that connect to the decode's channel and send nothing: each used
    to get the pool's descriptors dup'ed at accept (before any check) and wait in the
    default executor's queue, so 300 idle clients held 300 x the pool's files (a daemon
    runs out of descriptors: engine and control sockets fail). Connections in service are
    capped (:data:`MAX_CLIENTS`, the rest closed at once and counted), so at most that
    many snapshots are held; once they go, an honest client gets the pool."""
    import asyncio

    folder = tmp_path / "peers"
    f = tmp_path / "pool"
    f.write_bytes(os.urandom(SIZE))
    fd = os.open(f, os.O_RDWR)
    exported = pool(os.getpid(), pc.channel_name("dec"))
    held: list[int] = []

    def snapshot() -> tuple[ExportedPool, list[int]] | None:
        dup = os.dup(fd)
        held.append(dup)
        return exported, [dup]

    def open_snapshots() -> int:
        n = 0
        for x in held:
            try:
                os.fstat(x)
                n += 1
            except OSError:
                pass
        return n

    async def main() -> None:
        server = pc.ChannelServer(folder, me("dec"), DEC, snapshot, timeout=30.0)
        task = asyncio.ensure_future(server.run())
        await asyncio.sleep(0)
        idle: list[socket.socket] = []

        def connect_all() -> None:  # a thread: connect blocks while the backlog is full
            for _ in range(300):
                c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                c.connect(str(folder / exported.channel))
                idle.append(c)

        connector = threading.Thread(target=connect_all)  # not the loop's executor
        connector.start()
        for _ in range(3000):
            await asyncio.sleep(0.01)
            if not connector.is_alive():
                break
        for _ in range(1000):  # until every connection was accepted or refused
            await asyncio.sleep(0.01)
            if len(held) + server.refused >= 300:
                break
        assert open_snapshots() <= pc.MAX_CLIENTS
        assert server.refused >= 300 - pc.MAX_CLIENTS
        for c in idle:
            c.close()
        for _ in range(3000):  # until the served ones saw their clients go
            await asyncio.sleep(0.01)
            if open_snapshots() == 0:
                break
        got = await asyncio.to_thread(pc.fetch_pool, folder, exported, me("pre"), DEC)
        assert os.fstat(got[0]).st_ino == os.stat(f).st_ino
        pc.close_all(got)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(main())
    finally:
        os.close(fd)
