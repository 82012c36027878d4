"""Local trust on real daemon processes: the engine proves its daemon (S17), text from
peers and engines cannot forge log lines or terminal output (S21), and the secret file
must be kvd's own (S22).

No test asserts a wall-clock bound: waits are "poll until, within a generous bound".
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.client import KvdClient
from kvd.errors import KvdError, UntrustedDaemon
from kvd.launch import start_daemon
from kvd.protocol import rpc
from tests.helpers.squatter import NOBODY, Squatter

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
