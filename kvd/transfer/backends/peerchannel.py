"""The same-host peer channel: how a decode daemon hands its KV pool to a prefill daemon
for the ``local`` backend, proving who sends it (case S18).

A control message never names memory to open (no path, pid or descriptor number). The
decode's signed ``RegisterRank`` carries an :class:`~kvd.protocol.memory.ExportedPool`
that names only: the channel socket (a plain file NAME, joined to this daemon's own
``peer_channel_dir``), the decode daemon's pid (checked, never opened), and regions as
offsets/lengths within "the ``file``-th descriptor the channel passes". The prefill
then connects to that socket and, over one ``SOCK_SEQPACKET`` connection:

1. reads the server's ``SO_PEERCRED`` (set by the kernel): its uid must be trusted
   (kvd's own euid, or ``peer_channel_uid``) and its pid the one the registration
   names -- before a byte is sent;
2. ``Hello(client, claim, nonce_c)`` -> ``Challenge(nonce_s, pool_digest, proof_s)``:
   the decode first refuses a ``claim`` (instance, control endpoint, transfer session:
   who the registration says it is) that is not its own; ``proof_s = HMAC(cluster
   secret, "server" | nonce_c | nonce_s | claim | client instance | server pid |
   pool_digest)``; the prefill checks it and that
   ``pool_digest`` is the SHA-256 of the pool its registration named (the memory served
   is the memory registered, not a later or another one);
3. ``Proof(proof_c)``, ``proof_c = HMAC(secret, "client" | nonce_s | nonce_c | ...)``:
   the decode checks it (and the client's ``SO_PEERCRED`` uid) before handing over
   anything; fresh nonces on both sides make a replayed answer useless, the instance
   ids and pid make a relayed one fail;
4. ``Files(count)`` with the descriptors (``SCM_RIGHTS``): each is checked on the
   descriptor (:func:`check_passed_file`: a regular file or a sealed memfd, opened
   read-write, at least as large as the regions named in it) before it is mapped.

Every refusal is a :class:`~kvd.errors.HandleError` whose text says what was refused;
the prefill turns it into a registration failure (``local``) or a fallback to Mooncake
(``auto``). Without a cluster secret (``insecure``) the proofs are empty and only the
credentials are checked. The pure parts (messages, proofs, checks) are functions here;
the blocking socket code is :func:`fetch_pool` (prefill) and :func:`serve_one` (decode,
run in a thread per connection by :class:`ChannelServer`).

CUDA IPC handles (``cuda_ipc``) still travel in the registration itself: a handle is a
capability for one ``cudaMalloc`` segment that only a process on the same GPU can open,
and opening it cannot write outside that segment; the trust rule for it is that the
registration is sealed with the cluster secret and names the decode daemon's instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import re
import socket
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kvd.errors import HandleError
from kvd.memory.host import check_passed_fd
from kvd.protocol.memory import ExportedPool, PassedFdHandle

log = logging.getLogger(__name__)

_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
#: A channel socket's name (a file name, never a path).
CHANNEL_NAME = re.compile(r"^peer-[A-Za-z0-9._-]{1,64}\.sock$")
NONCE_BYTES = 16
MAX_MESSAGE = 4096
#: Most descriptors one pool passes (one per mapped file; an engine has a few).
MAX_FILES = 64
#: Most channel connections a decode daemon serves at once (each holds a thread and dups
#: of its pool's files until it ends, at most ``timeout`` s); one more is closed at once,
#: so clients that connect and stay silent cost bounded descriptors (S18). A host's
#: prefill daemons connect once each, at registration.
MAX_CLIENTS = 16
_DOMAIN = b"kvd-peer-channel-v1\0"

#: ``mac(*parts) -> bytes``: the cluster secret's HMAC-SHA256 (empty: insecure mode).
Mac = Callable[..., bytes]


class Claim(msgspec.Struct, frozen=True):
    """Who the registration says the exporting decode is: its ``instance`` id, control
    ``endpoint`` and transfer ``session`` (the KV args' ``session_id``). The decode proves
    all three are its own, so a secret holder registering under its own endpoint or
    session cannot be handed an honest decode's memory (S18 with S11)."""

    instance: str
    endpoint: str
    session: str

    def key(self) -> str:
        """The claim as one string for the proofs (NUL-separated)."""
        return f"{self.instance}\0{self.endpoint}\0{self.session}"


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """Step 2, prefill -> decode: the client's instance, whom it asks for, its nonce
    (:data:`NONCE_BYTES` bytes)."""

    client: str
    server: Claim
    nonce: bytes


class Challenge(msgspec.Struct, tag="challenge", frozen=True):
    """Step 2, decode -> prefill: its nonce, the SHA-256 of the pool it serves (32
    bytes) and its proof (HMAC-SHA256, empty without a secret)."""

    nonce: bytes
    pool_digest: bytes
    proof: bytes


class Proof(msgspec.Struct, tag="proof", frozen=True):
    """Step 3, prefill -> decode: the client's proof (HMAC-SHA256)."""

    proof: bytes


class Files(msgspec.Struct, tag="files", frozen=True):
    """Step 4, decode -> prefill: how many descriptors ride with it (``SCM_RIGHTS``, at
    most :data:`MAX_FILES`)."""

    count: int


class Refusal(msgspec.Struct, tag="refusal", frozen=True):
    """Either side gives up: why (at most 500 characters sent)."""

    reason: str


Message = Hello | Challenge | Proof | Files | Refusal
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


# ---- pure parts -------------------------------------------------------------------------

def pool_digest(pool: ExportedPool) -> bytes:
    """SHA-256 of the pool's canonical encoding (what the registration named)."""
    return hashlib.sha256(msgspec.msgpack.encode(pool)).digest()


def proof(mac: Mac, role: str, nonce_mine: bytes, nonce_theirs: bytes, server: str,
          client: str, server_pid: int, digest: bytes) -> bytes:
    """The ``role`` side's answer (``"server"``/``"client"``), bound to both nonces, both
    instance ids, the server's pid and the pool's digest."""
    return mac(_DOMAIN, role.encode(), b"\0", nonce_theirs, nonce_mine, server.encode(), b"\0",
               client.encode(), b"\0", struct.pack(">q", server_pid), digest)


def check_proof(mac: Mac, got: bytes, want: bytes, who: str) -> None:
    """Raise HandleError unless ``got == want`` (constant time); ``want`` empty: insecure
    mode, nothing to check."""
    if want and not hmac.compare_digest(got, want):
        raise HandleError(f"the peer channel's {who} did not prove the cluster secret "
                          f"(a replayed, relayed or forged answer)")


def check_credentials(pid: int, uid: int, want_pid: int | None, uids: frozenset[int],
                      who: str) -> None:
    """The kernel's view of the other end: uid trusted, pid as registered (None: any)."""
    if uid not in uids:
        raise HandleError(f"{who} runs as uid {uid} (pid {pid}), not as a trusted uid "
                          f"({', '.join(map(str, sorted(uids)))}): refused")
    if want_pid is not None and pid != want_pid:
        raise HandleError(f"{who} is pid {pid}, not pid {want_pid} that the registration "
                          f"names: refused")


def channel_path(folder: Path, name: str) -> Path:
    """``folder / name`` for a channel socket name from a peer; HandleError unless it is a
    plain name (:data:`CHANNEL_NAME`)."""
    if not CHANNEL_NAME.fullmatch(name):
        raise HandleError(f"peer channel name {name[:80]!r} is not a socket name "
                          f"(peer-<instance>.sock)")
    return folder / name


def channel_name(instance_id: str) -> str:
    """The channel socket name of daemon ``instance_id``."""
    return f"peer-{instance_id}.sock"


def needed_sizes(pool: ExportedPool) -> dict[int, int]:
    """Bytes each passed file must hold: the end of the last region named in it."""
    need: dict[int, int] = {}
    for b in pool.buffers:
        h = b.handle
        if isinstance(h, PassedFdHandle):
            if h.offset < 0 or h.length <= 0 or h.length != b.length:
                raise HandleError(f"region [{h.offset}, +{h.length}) of buffer {b.address:#x} "
                                  f"({b.length} bytes) is malformed")
            need[h.file] = max(need.get(h.file, 0), h.offset + h.length)
    return need


def check_passed_file(fd: int, index: int, need: int) -> None:
    """A descriptor from the channel: a regular file (or a memfd sealed against
    shrinking) opened read-write, at least ``need`` bytes. Raises HandleError."""
    what = f"descriptor #{index} from the peer channel"
    check_passed_fd(fd, what)
    size = os.fstat(fd).st_size
    if size < need:
        raise HandleError(f"{what} holds {size} bytes, fewer than the {need} its regions need")


def check_not_own(fds: Sequence[int], own: set[tuple[int, int]]) -> None:
    """Refuse a passed descriptor that is one of this daemon's own engine files (keyed by
    ``(st_dev, st_ino)``): a peer's pool is never this daemon's memory. HandleError."""
    for i, fd in enumerate(fds):
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) in own:
            raise HandleError(f"descriptor #{i} from the peer channel is this daemon's own "
                              f"engine memory: refused")


def encode(msg: Message) -> bytes:
    """One channel message as msgpack (at most :data:`MAX_MESSAGE` bytes are read)."""
    return msgspec.msgpack.encode(msg)


def decode(data: bytes, want: type) -> Message:
    """One channel message of type ``want``; HandleError otherwise (a Refusal's reason)."""
    try:
        msg = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise HandleError(f"malformed peer channel message: {exc}") from None
    if isinstance(msg, Refusal) and want is not Refusal:
        raise HandleError(f"the peer refused the channel: {msg.reason[:200]}")
    if not isinstance(msg, want):
        raise HandleError(f"peer channel: expected {want.__name__}, got {type(msg).__name__}")
    return msg


# ---- sockets ----------------------------------------------------------------------------

def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the other end of a connected Unix socket (``SO_PEERCRED``)."""
    pid, uid, _ = _CREDS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                _CREDS.size))
    return pid, uid


def _recv(sock: socket.socket) -> bytes:
    data = sock.recv(MAX_MESSAGE)
    if not data:
        raise HandleError("the peer channel closed")
    return data


@dataclass(frozen=True)
class Identity:
    """One side of the channel: its instance id, the uids it trusts at the other end,
    and its MAC (:meth:`kvd.security.Authenticator.channel_mac`)."""

    instance: str
    uids: frozenset[int]
    mac: Mac


def fetch_pool(folder: Path, pool: ExportedPool, me: Identity, claim: Claim,
               timeout: float = 5.0) -> list[int]:
    """Prefill side: the descriptors of ``pool`` (a decode's registration, which says the
    decode is ``claim``) from its channel, each checked; the caller owns (and closes)
    them. Raises HandleError."""
    need = needed_sizes(pool)
    path = channel_path(folder, pool.channel)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    fds: list[int] = []
    try:
        try:
            sock.connect(str(path))
        except OSError as exc:
            raise HandleError(f"cannot reach the peer channel {path}: {exc.strerror or exc}"
                              ) from None
        pid, uid = peer_credentials(sock)
        check_credentials(pid, uid, pool.pid, me.uids, f"the peer channel {path}")
        nonce_c = os.urandom(NONCE_BYTES)
        sock.send(encode(Hello(me.instance, claim, nonce_c)))
        server = claim.key()
        ch = decode(_recv(sock), Challenge)
        assert isinstance(ch, Challenge)
        digest = pool_digest(pool)
        if not hmac.compare_digest(ch.pool_digest, digest):
            raise HandleError("the decode serves other memory than its registration names "
                              "(it registered again since): refused")
        check_proof(me.mac, ch.proof, proof(me.mac, "server", ch.nonce, nonce_c, server,
                                            me.instance, pid, digest), "server")
        sock.send(encode(Proof(proof(me.mac, "client", nonce_c, ch.nonce, server,
                                     me.instance, pid, digest))))
        data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FILES)
        if not data:
            raise HandleError("the peer channel closed")
        files = decode(data, Files)
        assert isinstance(files, Files)
        if files.count != len(fds) or any(i >= len(fds) or i < 0 for i in need):
            raise HandleError(f"the peer channel passed {len(fds)} descriptors "
                              f"({files.count} announced); the registration names "
                              f"{sorted(need)}")
        for i, n in need.items():
            check_passed_file(fds[i], i, n)
        return fds
    except (HandleError, OSError) as exc:
        close_all(fds)
        if isinstance(exc, HandleError):
            raise
        if isinstance(exc, BrokenPipeError | ConnectionResetError):  # the server hung up
            raise HandleError(f"the peer channel {path} closed: {exc}") from None
        raise HandleError(f"peer channel {path}: {exc}") from None
    finally:
        sock.close()


def serve_one(conn: socket.socket, me: Identity, mine: Claim, pool: ExportedPool,
              fds: Sequence[int], timeout: float = 5.0) -> None:
    """Decode side, one connection (blocking): refuse a client that asks for another
    daemon than ``mine`` (this one's instance, endpoint and session), prove this daemon,
    check the client, pass ``fds`` (the pool's files, in ``PassedFdHandle.file``
    order). Raises HandleError."""
    conn.settimeout(timeout)
    pid, uid = peer_credentials(conn)
    try:
        check_credentials(pid, uid, None, me.uids, "the peer channel's client")
        hello = decode(_recv(conn), Hello)
        assert isinstance(hello, Hello)
        if hello.server != mine:
            raise HandleError(f"the client asked for {_show(hello.server)}, this is "
                              f"{_show(mine)}")
        server = mine.key()
        digest, nonce_s, my_pid = pool_digest(pool), os.urandom(NONCE_BYTES), os.getpid()
        conn.send(encode(Challenge(nonce_s, digest, proof(
            me.mac, "server", nonce_s, hello.nonce, server, hello.client, my_pid,
            digest))))
        got = decode(_recv(conn), Proof)
        assert isinstance(got, Proof)
        check_proof(me.mac, got.proof, proof(me.mac, "client", hello.nonce, nonce_s,
                                             server, hello.client, my_pid, digest),
                    "client")
    except HandleError as exc:
        with contextlib.suppress(OSError):
            conn.send(encode(Refusal(str(exc)[:500])))
        raise
    socket.send_fds(conn, [encode(Files(len(fds)))], list(fds))


def _show(c: Claim) -> str:
    return (f"instance {c.instance[:80]!r} at {c.endpoint[:120]!r} (transfer session "
            f"{c.session[:120]!r})")


def close_all(fds: Sequence[int]) -> None:
    """Close every descriptor in ``fds``, ignoring ones already closed."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def make_folder(folder: Path) -> None:
    """Create ``folder`` (mode 0750) if missing; HandleError if another user could
    replace a socket in it (as the engine socket's folder, S17)."""
    from kvd.engine_rpc.socket_path import SOCKET_DIR_MODE, folder_trust_problem

    folder.mkdir(mode=SOCKET_DIR_MODE, parents=True, exist_ok=True)
    problem = folder_trust_problem(folder)
    if problem is not None:
        raise HandleError(f"peer_channel_dir: {problem}")


def listen(folder: Path, name: str) -> socket.socket:
    """A listening channel socket ``folder/name`` (mode 0600; a stale file replaced)."""
    make_folder(folder)
    path = channel_path(folder, name)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    sock.listen(16)
    return sock


#: ``() -> (pool, fds)``: the pool as registered now and dups of its files (the caller of
#: :func:`serve_one` closes them), or None when the engine registered nothing.
Snapshot = Callable[[], tuple[ExportedPool, list[int]] | None]


class ChannelServer:
    """The decode daemon's channel: accepts on the loop, checks the client's uid there,
    snapshots the pool there (one loop owns daemon state), answers each connection in a
    thread of its own pool (bounded by ``timeout``). At most :data:`MAX_CLIENTS`
    connections are in service; a client of another uid, or one past the cap, is closed
    at once with no snapshot taken (``refused`` counts both)."""

    def __init__(self, folder: Path, me: Identity, mine: Claim, snapshot: Snapshot,
                 timeout: float = 5.0) -> None:
        self.folder, self.me, self.snapshot, self.timeout = folder, me, snapshot, timeout
        self.mine = mine
        self.name = channel_name(me.instance)
        self.sock: socket.socket | None = None
        self.refused = 0
        self._pending: set[asyncio.Future[None]] = set()
        self._threads = ThreadPoolExecutor(MAX_CLIENTS, thread_name_prefix="kvd-channel")

    def open(self) -> None:
        """Bind the listening socket (:func:`listen`; HandleError for an untrusted
        folder, OSError from the bind)."""
        self.sock = listen(self.folder, self.name)
        self.sock.setblocking(False)

    async def run(self) -> None:
        """Serve until cancelled; the socket file is removed at the end."""
        if self.sock is None:
            self.open()
        assert self.sock is not None
        loop = asyncio.get_running_loop()
        try:
            while True:
                conn, _ = await loop.sock_accept(self.sock)
                snap = self._admit(conn)
                if snap is None:
                    conn.close()
                    continue
                fut = loop.run_in_executor(self._threads, self._serve, conn, *snap)
                self._pending.add(fut)
                fut.add_done_callback(self._pending.discard)
        finally:
            self.close()

    def _admit(self, conn: socket.socket) -> tuple[ExportedPool, list[int]] | None:
        """The pool to serve ``conn`` (dups of its files), or None to close it now: past
        :data:`MAX_CLIENTS`, a client of an untrusted uid, no engine registered, or out
        of descriptors. Nothing is dup'ed for a client that is not served."""
        if len(self._pending) >= MAX_CLIENTS:
            self.refused += 1
            log.debug("peer channel: %d clients in service; one more closed", MAX_CLIENTS)
            return None
        try:
            pid, uid = peer_credentials(conn)
            check_credentials(pid, uid, None, self.me.uids, "the peer channel's client")
        except (HandleError, OSError) as exc:
            self.refused += 1
            log.debug("peer channel: refused a client: %s", exc)
            return None
        try:
            return self.snapshot()
        except OSError as exc:  # out of descriptors: this client, not the channel
            log.warning("peer channel: cannot pass the pool now: %s", exc)
            return None

    def _serve(self, conn: socket.socket, pool: ExportedPool, fds: list[int]) -> None:
        try:
            serve_one(conn, self.me, self.mine, pool, fds, self.timeout)
        except (HandleError, OSError) as exc:
            self.refused += 1
            log.warning("peer channel: refused a client: %s", exc)
        finally:
            close_all(fds)
            conn.close()

    def close(self) -> None:
        """Stop listening and unlink the socket file (idempotent); connections in service
        end within ``timeout``, unwaited."""
        self._threads.shutdown(wait=False)
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            with contextlib.suppress(OSError):
                (self.folder / self.name).unlink()
