"""S01: every listening socket of a real daemon, the transfer engine's included, is bound to
the configured host, with the transfer engine's ports inside the configured range."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvd.cli import doctor
from kvd.config import Settings
from kvd.launch import start_daemon
from kvd.netstat import listeners, wider_than

pytestmark = pytest.mark.integration


def _settings() -> Settings:
    return Settings(role="decode")


def test_s01_transfer_engine_listeners_bind_only_the_configured_host(tmp_path: Path) -> None:
    daemon = start_daemon("decode", tmp_path, host="127.0.0.1", http_host="127.0.0.1",
                          transfer_port_range="15310-15311")
    try:
        found = listeners(daemon.proc.pid)
        assert len(found) >= 4  # REST, ZMQ control, transfer handshake, transfer TCP data
        assert wider_than(found, {"127.0.0.1"}) == [], [str(x) for x in found]
        rpc_port = int(daemon.ready["session_id"].rsplit(":", 1)[1])
        transfer = {x.port for x in found} - {daemon.ready["http_port"],
                                              int(daemon.ready["control_endpoint"]
                                                  .rsplit(":", 1)[1])}
        assert rpc_port in transfer and transfer <= {15310, 15311}, transfer
        c = doctor.check_listeners(doctor.daemon_pid(Path(daemon.socket)) or 0, _settings())
        assert c.status == "ok", c.detail
        assert f"127.0.0.1:{rpc_port}" in c.detail
    finally:
        daemon.stop()


def test_s01_listeners_of_base_code_were_wider(tmp_path: Path) -> None:
    """Positive control of the check itself: bind host 0.0.0.0 keeps Mooncake's own
    behaviour (every interface), and the check sees it."""
    daemon = start_daemon("decode", tmp_path, transfer_bind_host="0.0.0.0")
    try:
        wide = wider_than(listeners(daemon.proc.pid), {"127.0.0.1"})
        assert wide and all(x.wildcard for x in wide)
        c = doctor.check_listeners(doctor.daemon_pid(Path(daemon.socket)) or 0, _settings())
        assert c.status == "warn" and "wider than configured" in c.detail
    finally:
        daemon.stop()
