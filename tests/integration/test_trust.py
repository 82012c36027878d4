"""Local trust on real daemon processes: the engine proves its daemon (S17), text from
peers and engines cannot forge log lines or terminal output (S21), and the secret file
must be kvd's own (S22).

No test asserts a wall-clock bound: waits are "poll until, within a generous bound".
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.client import KvdClient, KVPoll, Receiver, Sender
from kvd.errors import KvdError, UntrustedDaemon
from kvd.launch import LAUNCH_SECRET, DaemonProcess, start_daemon
from kvd.protocol import rpc
from kvd.text import MAX_REASON_BYTES
from tests.conftest import PdPair
from tests.helpers.squatter import NOBODY, Squatter
from tests.integration.test_second_round import ended, status, until

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def work() -> Iterator[Path]:
    """A folder another user can reach (pytest's tmp_path is root's 0700)."""
    path = Path(tempfile.mkdtemp(prefix="kvd-trust-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# ---- S17: the engine talks only to its kvd -------------------------------------------------------

def test_s17_the_engine_talks_to_its_daemon_and_never_to_a_squatter(work: Path) -> None:
    sock = work / "run" / "kvd.sock"
    daemon = start_daemon("decode", work, engine_socket=str(sock))
    try:
        assert sock.parent.stat().st_mode & 0o777 == 0o750  # kvd made its folder
        client = KvdClient(str(sock), timeout=30)
        assert client.call(rpc.Info())["status"] == "ok"  # the real daemon passes the check
        client.close()
    finally:
        daemon.stop()
    sock.parent.chmod(0o1777)  # the folder turns shared, like /tmp: a squatter moves in
    with Squatter(sock, NOBODY) as squatter:
        with pytest.raises(UntrustedDaemon, match=f"runs as uid {NOBODY}") as err:
            KvdClient(str(sock), timeout=30).call(rpc.Info())
        assert err.value.found_uid == NOBODY
        assert squatter.bytes_received() == 0  # refused before the first byte
        with pytest.raises(KvdError, match="writable by group or others"):
            start_daemon("decode", work, engine_socket=str(sock))  # kvd will not serve there


# ---- S21: text from peers and engines in logs and status -----------------------------------------

FORGED = "client gone\n2026-01-01 00:00:00,000 ERROR kvd: forged\x1b[2J\x1b[31m"


def _recent_reasons(daemon: DaemonProcess, room: int) -> list[str]:
    return [f["reason"] for f in status(daemon)["recent_failures"] if f["room"] == room]


def _log_is_clean(daemon: DaemonProcess) -> str:
    """The daemon's log; fails if foreign text forged a line or reached it raw."""
    text = daemon.log.read_text(errors="replace")
    assert "\x1b" not in text  # no raw ESC byte (escapes are written as the text \\x1b)
    assert not any(line.startswith("2026-01-01 00:00:00,000 ERROR")
                   for line in text.splitlines())
    return text


def test_s21_a_forged_abort_reason_cannot_forge_log_lines_or_status(
        pd_pair: PdPair, room_ids: Iterator[int]) -> None:
    """The decode engine aborts a bound room with a reason carrying a newline, a forged
    record and ANSI escapes, 1 MiB long: the decode (the engine's text) and the prefill
    (the same text, now a peer's, in its RoomAbort) log it escaped on one line and show it
    escaped and bounded in /v1/status."""
    pd, room = pd_pair, next(room_ids)
    sender = Sender(pd.p_engine.client, room)
    receiver = Receiver(pd.d_engine.client, room, pd.bootstrap)
    receiver.init([40, 41], 40)
    until(lambda: sender.poll() == KVPoll.WaitingForInput, "the prefill has the pages")
    receiver.abort(FORGED + "x" * (1 << 20))
    assert ended(receiver) == KVPoll.Failed and ended(sender) == KVPoll.Failed
    for daemon in (pd.decode, pd.prefill):
        reasons = until(lambda d=daemon: _recent_reasons(d, room), f"{room} in /v1/status")
        for reason in reasons:
            assert reason.isprintable() and len(reason.encode()) <= MAX_REASON_BYTES, reason
            assert "client gone\\n2026-01-01" in reason and "\\x1b[2J" in reason
    for daemon in (pd.decode, pd.prefill):  # logged, escaped, on the record's own line
        until(lambda d=daemon: "ERROR kvd: forged\\x1b[2J" in _log_is_clean(d),
              "the escaped reason in the log")
    sender.clear()
    receiver.clear()


# ---- S22: the secret file's owner ----------------------------------------------------------------

def test_s22_kvd_refuses_a_secret_file_owned_by_another_user(work: Path) -> None:
    """Root kvd could read another user's 0600 secret file; it refuses to start instead,
    naming the owner and never the secret. Owned by root again, the same file starts it."""
    secret = "s22-" + LAUNCH_SECRET
    path = work / "cluster.secret"
    path.write_text(secret + "\n")
    path.chmod(0o600)
    os.chown(path, NOBODY, NOBODY)
    env = {"KVD_CLUSTER_SECRET": "", "KVD_CLUSTER_SECRET_FILE": str(path)}
    with pytest.raises(KvdError, match=f"belongs to uid {NOBODY}, not to kvd's user") as exc:
        start_daemon("decode", work, env=env)
    assert secret not in str(exc.value)
    os.chown(path, 0, 0)
    daemon = start_daemon("decode", work, env=env)
    try:
        assert secret not in daemon.log.read_text()
    finally:
        daemon.stop()
