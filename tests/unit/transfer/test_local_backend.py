"""The ``local`` backend: attach a same-host peer's exported pool (its descriptors from
the peer's channel, S18), copy page runs into it (bytes checked in the peer process),
refuse anything outside one exported buffer; the pure backend choice."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvd.errors import HandleError, RegistrationError, TransportError
from kvd.hostid import host_identity, same_host
from kvd.protocol.memory import (
    CudaIpcHandle,
    ExportedBuffer,
    ExportedPool,
    PassedFdHandle,
)
from kvd.security import Authenticator
from kvd.transfer.backends.choice import AutoEngine, choose_backend
from kvd.transfer.backends.fake import FakeFabric
from kvd.transfer.backends.local import Channel, LocalEngine
from kvd.transfer.backends.peerchannel import Identity
from kvd.transfer.plan import Descriptors, plan_pages

NBUF, NBYTES, ITEM = 4, 64 * 1024, 4096
SECRET = b"s18-test-secret-0123456789abcdef"
PEER = "decode-inst"


class Peer:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        env = {**os.environ, "KVD_TEST_SECRET": SECRET.hex()}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.exporter",
                                      str(NBUF), str(NBYTES), str(folder), PEER],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        assert self.proc.stdout is not None
        self.pool = msgspec.json.decode(self.proc.stdout.readline(), type=ExportedPool)

    def digest(self) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("digest\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[Peer]:
    folder = tmp_path / "peers"
    p = Peer(folder)
    yield p
    p.close()


def engine(folder: Path, secret: bytes = SECRET) -> LocalEngine:
    """A prefill's local backend that fetches peers' pools from channels in ``folder``."""
    me = Identity("prefill-inst", frozenset({os.geteuid()}),
                  Authenticator(secret, "prefill-inst").channel_mac)
    return LocalEngine(channel=Channel(folder, me))


def _source() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, (NBUF, NBYTES), dtype=np.uint8)


def test_local_write_lands_byte_for_byte_in_the_peer(peer: Peer) -> None:
    src = _source()
    eng = engine(peer.folder)
    eng.register(src.ctypes.data, src.nbytes)
    assert eng.attach_peer("decode-1", peer.pool, PEER) == "local"
    src_pages, dst_pages = np.array([3, 4, 5, 9, 0]), np.array([1, 2, 3, 15, 7])
    dst_ptrs = [b.address for b in peer.pool.buffers]
    desc = plan_pages(src.ctypes.data + np.arange(NBUF) * NBYTES, dst_ptrs, [ITEM] * NBUF,
                      [ITEM] * NBUF, src_pages, dst_pages)
    eng.write("decode-1", desc)
    expect = np.zeros((NBUF, NBYTES // ITEM, ITEM), dtype=np.uint8)
    expect[:, dst_pages] = src.reshape(NBUF, -1, ITEM)[:, src_pages]
    assert peer.digest() == hashlib.sha256(expect.tobytes()).hexdigest()
    eng.close()


def test_local_write_outside_one_exported_buffer_moves_nothing(peer: Peer) -> None:
    src = _source()
    eng = engine(peer.folder)
    eng.register(src.ctypes.data, src.nbytes)
    eng.attach_peer("decode-1", peer.pool, PEER)
    before = peer.digest()
    b0, b1 = peer.pool.buffers[0], peer.pool.buffers[1]
    assert b1.address >= b0.address + b0.length
    ok = Descriptors(np.array([src.ctypes.data], np.uint64), np.array([b0.address], np.uint64),
                     np.array([ITEM], np.uint64))
    straddle = Descriptors(np.array([src.ctypes.data, src.ctypes.data], np.uint64),
                           np.array([b0.address, b0.address + b0.length - 8], np.uint64),
                           np.array([ITEM, 16], np.uint64))  # 2nd crosses the buffer's end
    with pytest.raises(TransportError, match="outside every buffer"):
        eng.write("decode-1", straddle)
    assert peer.digest() == before  # checked for the whole batch before any byte moved
    with pytest.raises(TransportError, match="source"):
        eng.write("decode-1", Descriptors(np.array([src.ctypes.data + src.nbytes], np.uint64),
                                          ok.dst, ok.length))
    with pytest.raises(TransportError, match="not attached"):
        eng.write("decode-2", ok)
    eng.detach_peer("decode-1")
    with pytest.raises(TransportError, match="not attached"):
        eng.write("decode-1", ok)


def test_pool_from_another_host_or_without_a_proven_channel_is_refused(peer: Peer) -> None:
    eng = engine(peer.folder)
    other = msgspec.structs.replace(peer.pool, host_id="other-machine/boot")
    with pytest.raises(HandleError, match="another host"):
        eng.attach_peer("x", other, PEER)
    with pytest.raises(HandleError, match="no peer channel"):
        LocalEngine().attach_peer("decode-1", peer.pool, PEER)
    with pytest.raises(HandleError, match="did not prove the cluster secret"):
        engine(peer.folder, b"another-secret-0123456789abcdef!").attach_peer(
            "decode-1", peer.pool, PEER)
    with pytest.raises(HandleError, match="refused the channel"):  # wrong instance named
        eng.attach_peer("decode-1", peer.pool, "someone-else")
    with pytest.raises(HandleError, match="refused the channel"):  # another session
        eng.attach_peer("x", peer.pool, PEER)
    assert not eng.has_peer("x") and not eng.has_peer("decode-1")


def test_host_identity_is_machine_id_and_boot_id() -> None:
    me = host_identity()
    assert same_host(me, me) and "/" in me
    assert not same_host(me, "other/" + me.split("/")[1])
    assert not same_host("m/", "m/")  # no boot id: never "same host"


def _pool(host: str, kinds: tuple[str, ...] = ("passed_fd",)) -> ExportedPool:
    handles = {"passed_fd": PassedFdHandle(0, 0, 64),
               "cuda_ipc": CudaIpcHandle(b"\0" * 64, 0, 64, "GPU-x")}
    return ExportedPool(host, [ExportedBuffer(4096 * i, 64, handles[k])
                               for i, k in enumerate(kinds)])


@pytest.mark.parametrize(("setting", "pool", "importable", "expect"), [
    ("mooncake", _pool("h/b"), {"passed_fd"}, "mooncake"),
    ("auto", _pool("h/b"), {"passed_fd"}, "local"),
    ("auto", None, {"passed_fd"}, "mooncake"),
    ("auto", _pool("other/b"), {"passed_fd"}, "mooncake"),
    ("auto", _pool("h/b", ("passed_fd", "cuda_ipc")), {"passed_fd"}, "mooncake"),
    ("auto", _pool("h/b", ("cuda_ipc",)), {"passed_fd", "cuda_ipc"}, "local"),
    ("local", _pool("h/b"), {"passed_fd"}, "local"),
])
def test_choose_backend(setting: str, pool: ExportedPool | None, importable: set[str],
                        expect: str) -> None:
    assert choose_backend(setting, "h/b", pool, frozenset(importable))[0] == expect


def test_choose_local_refuses_a_peer_it_cannot_serve() -> None:
    with pytest.raises(RegistrationError, match="another host"):
        choose_backend("local", "h/b", _pool("other/b"), frozenset({"passed_fd"}))


def test_auto_falls_back_to_mooncake_when_the_import_fails() -> None:
    fabric = FakeFabric()
    mc, dst = fabric.engine(), fabric.engine()
    auto = AutoEngine(mc, LocalEngine(), frozenset({"passed_fd"}))
    bogus = msgspec.structs.replace(_pool(host_identity()), channel="peer-nobody.sock", pid=1)
    auto.local.channel = Channel(Path("/nonexistent"), Identity("p", frozenset({0}),
                                                               lambda *p: b""))
    assert auto.attach_peer(dst.session_id, bogus) == "mooncake"
    buf = np.arange(64, dtype=np.uint8)
    out = np.zeros(64, dtype=np.uint8)
    auto.register(buf.ctypes.data, 64)
    dst.register(out.ctypes.data, 64)
    auto.write(dst.session_id, Descriptors(np.array([buf.ctypes.data], np.uint64),
                                           np.array([out.ctypes.data], np.uint64),
                                           np.array([64], np.uint64)))
    assert (out == buf).all()
    strict = AutoEngine(mc, LocalEngine(), frozenset({"passed_fd"}), "local")
    with pytest.raises(HandleError):
        strict.attach_peer(dst.session_id, bogus)
