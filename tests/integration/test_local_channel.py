"""Case S18 on real daemon processes: with ``transfer_backend = local`` a decode's memory
reaches the prefill only through the decode's peer channel (``SO_PEERCRED`` + the cluster
secret + ``SCM_RIGHTS``), never from what a control message names.

Two real daemons move a room byte for byte through the channel; then a holder of the
cluster secret forges registrations (sealed as :mod:`tests.integration.test_security_cases`
forges them) that name another process's descriptor or a path in every way the wire
allows -- each is refused with a reason, and the victim file is unchanged byte for byte.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvd.client import KVPoll
from kvd.errors import KvdError
from kvd.hostid import host_identity
from kvd.launch import start_daemon
from kvd.protocol import codec, control
from kvd.protocol.memory import ExportedBuffer, ExportedPool, PassedFdHandle
from kvd.refengine.standin import transfer_room, wait_rooms
from kvd.transfer.backends.peerchannel import channel_name
from tests.conftest import PdPair, push_frames
from tests.helpers.channel_squatter import ChannelSquatter
from tests.integration.test_second_round import until
from tests.integration.test_security_cases import (
    AUTH,
    BOUND,
    dropped,
    fake_peer,
    forge,
    pair,
    peer_row,
    standin_wire,
    status,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VICTIM_BYTES = 65379


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as s:
        yield s


class Victim:
    """An unrelated process holding a file open read-write (descriptor ``fd`` in it)."""

    def __init__(self, path: Path) -> None:
        self.path, self.data = path, os.urandom(VICTIM_BYTES)
        path.write_bytes(self.data)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
             "print(fd, flush=True); sys.stdin.read()", str(path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.fd = int(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def forged_pool(channel: str, pid: int) -> ExportedPool:
    """A pool shaped like :func:`standin_wire`'s buffers, every region in passed file 0."""
    wire = standin_wire("x")
    spans = [*zip(wire.kv_data_ptrs, wire.kv_data_lens, strict=True),
             *zip(wire.aux_data_ptrs, wire.aux_data_lens, strict=True)]
    return ExportedPool(host_identity(), [ExportedBuffer(a, n, PassedFdHandle(0, 0, n))
                                          for a, n in spans], channel=channel, pid=pid)


def register_with(endpoint: str, instance: str, pool: ExportedPool) -> control.RegisterRank:
    return control.RegisterRank(instance_id=instance, endpoint=endpoint, attn_tp_rank=0,
                                attn_tp_size=1, kv_args=standin_wire(f"local:{instance}"),
                                pool=pool)


def old_proc_fd_frame(endpoint: str, instance: str, pid: int, fd: int) -> bytes:
    """A RegisterRank in the shape the wire had before S18 (a ``proc_fd`` handle naming a
    pid and descriptor number), encoded by hand: no such handle kind exists any more."""
    reg = msgspec.to_builtins(register_with(endpoint, instance, forged_pool("", 0)))
    st = os.stat(f"/proc/{pid}/fd/{fd}")
    for b in reg["pool"]["buffers"]:
        b["handle"] = {"kind": "proc_fd", "pid": pid, "fd": fd, "st_dev": st.st_dev,
                       "st_ino": st.st_ino, "offset": 0, "length": b["length"]}
    reg["type"] = "register_rank"
    return codec.MAGIC + bytes([codec.VERSION]) + msgspec.msgpack.encode(reg)


def local_pair(stack: contextlib.ExitStack, tmp: Path) -> PdPair:
    opts = {"transfer_backend": "local", "peer_channel_dir": str(tmp / "peers")}
    return pair(stack, tmp, p_opts=opts, d_opts=opts)


def test_s18_local_rooms_move_through_the_peer_channel_and_forged_memory_is_refused(
        tmp_path: Path, stack: contextlib.ExitStack) -> None:
    pd = local_pair(stack, tmp_path)
    p, d = pd.p_engine, pd.d_engine
    transfer_room(p, d, pd.bootstrap, 1800, [1, 2, 3], [4, 5, 6], chunk=2)
    assert wait_rooms(d.client, [1800], timeout=BOUND) == [KVPoll.Success]
    assert d.pages_equal(p, [1, 2, 3], [4, 5, 6])
    session = pd.decode.ready["session_id"]
    assert f"peer {session}: local backend" in pd.prefill.log.read_text()

    victim = Victim(tmp_path / "victim.bin")
    stack.callback(victim.close)
    before = [b.copy() for b in d.kv]
    folder = tmp_path / "peers"
    decode_channel = channel_name(pd.decode.ready["instance_id"])
    decode_pid = pd.decode.proc.pid
    held = os.open(victim.path, os.O_RDWR)  # what the squatter passes
    stack.callback(os.close, held)
    squat = ChannelSquatter(folder / "peer-s18-squat.sock", held)
    stack.callback(squat.stop)
    cases = {  # forger's instance -> (its pool, what the refusal must say)
        "s18-path": (forged_pool(f"../{victim.path.name}", victim.proc.pid),
                     "not a socket name"),
        "s18-abs": (forged_pool(str(victim.path), victim.proc.pid), "not a socket name"),
        "s18-pid": (forged_pool(decode_channel, victim.proc.pid),
                    f"not pid {victim.proc.pid}"),
        "s18-relay": (forged_pool(decode_channel, decode_pid), "asked for instance"),  # own id
        "s18-squat": (forged_pool("peer-s18-squat.sock", squat.proc.pid), "uid 65534"),
    }
    peers = {name: fake_peer(stack, name) for name in [*cases, "s18-old", "s18-claim"]}
    errors = int(status(pd.prefill)["totals"]["protocol_errors"])
    push_frames(pd.prefill.ready["control_endpoint"], [AUTH.seal(
        old_proc_fd_frame(peers["s18-old"].endpoint, "s18-old", victim.proc.pid, victim.fd),
        pd.prefill.ready["instance_id"])], linger_ms=60_000)
    claim = msgspec.structs.replace(  # the decode's instance, the forger's endpoint
        register_with(peers["s18-claim"].endpoint, "s18-claim",
                      forged_pool(decode_channel, decode_pid)),
        instance_id=pd.decode.ready["instance_id"])
    forge(pd.prefill, claim, *(register_with(peers[name].endpoint, name, pool)
                               for name, (pool, _) in cases.items()))
    rows = until(lambda: all(peer_row(pd.prefill, peers[n].endpoint) for n in cases)
                 and {n: peer_row(pd.prefill, peers[n].endpoint) for n in cases},
                 "P answered every forged registration")
    for name, (_, why) in cases.items():
        row = rows[name]
        assert row is not None and row["state"] == "rejected", (name, row)
        assert why in row["detail"], (name, row["detail"])
    row = until(lambda: peer_row(pd.prefill, peers["s18-claim"].endpoint),
                "P answered the registration claiming the decode's instance")
    assert row["state"] == "rejected" and "asked for instance" in row["detail"], row
    until(lambda: int(status(pd.prefill)["totals"]["protocol_errors"]) > errors,
          "P dropped the old proc_fd frame as malformed")
    assert peer_row(pd.prefill, peers["s18-old"].endpoint) is None
    assert dropped(pd.prefill, "max_peers") == 0
    assert victim.path.read_bytes() == victim.data  # byte for byte
    assert all((b == a).all() for b, a in zip(before, d.kv, strict=True))
    # the honest decode still pairs and moves bytes
    transfer_room(p, d, pd.bootstrap, 1801, [7, 8], [9, 10], chunk=1)
    assert wait_rooms(d.client, [1801], timeout=BOUND) == [KVPoll.Success]
    assert d.pages_equal(p, [7, 8], [9, 10])


def test_s18_a_channel_folder_others_may_write_is_refused(tmp_path: Path) -> None:
    """A peer channel folder another user could write (where a squatter could replace the
    socket): a ``local`` decode refuses to start; an ``auto`` one starts, exports no pool
    (its prefills use Mooncake) and says why."""
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(KvdError, match="peer channel"):
        start_daemon("decode", tmp_path, transfer_backend="local", peer_channel_dir=str(folder))
    d = start_daemon("decode", tmp_path, transfer_backend="auto", peer_channel_dir=str(folder))
    try:
        assert "writable by group or others" in d.log.read_text()
        assert list(folder.iterdir()) == []  # no socket was bound there
    finally:
        d.stop()


def test_s18_auto_falls_back_to_mooncake_when_the_channel_is_refused(
        tmp_path: Path, stack: contextlib.ExitStack) -> None:
    """``auto`` on one host whose prefill cannot reach the decode's channel (another
    ``peer_channel_dir``, as in another mount namespace): the pairing goes to Mooncake,
    the log says why, and the room still moves byte for byte."""
    pd = pair(stack, tmp_path,
              p_opts={"transfer_backend": "auto", "peer_channel_dir": str(tmp_path / "p")},
              d_opts={"transfer_backend": "auto", "peer_channel_dir": str(tmp_path / "d")})
    p, d = pd.p_engine, pd.d_engine
    transfer_room(p, d, pd.bootstrap, 1900, [3, 4], [5, 6], chunk=1)
    assert wait_rooms(d.client, [1900], timeout=BOUND) == [KVPoll.Success]
    assert d.pages_equal(p, [3, 4], [5, 6])
    log = pd.prefill.log.read_text()
    assert "mooncake backend (local import refused, falling back: cannot reach the peer " \
           "channel" in log, log[-2000:]
