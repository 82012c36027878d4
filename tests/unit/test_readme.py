"""README.md's operator and engine snippets are the real thing: the engine example is
examples/engine_minimal.py (run against daemons in tests/integration/test_ops.py), the two
host settings load, and the secret commands make a secret kvd accepts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvd.cli.main import main
from kvd.config import Settings, load_settings, read_secret

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def block_after(marker: str) -> str:
    """The fenced block that follows ``<!-- marker`` in the README."""
    rest = README.split(f"<!-- {marker}", 1)[1]
    return rest.split("```", 1)[1].split("\n", 1)[1].split("```", 1)[0]


def test_engine_snippet_is_the_example_file() -> None:
    assert block_after("engine-example") == (REPO / "examples" / "engine_minimal.py").read_text()


def test_two_host_settings_load_and_advertise_reachable_addresses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("KVD_")]:
        monkeypatch.delenv(name)
    secret = tmp_path / "cluster.secret"
    secret.write_text("0123456789abcdef0123\n")
    secret.chmod(0o600)  # as `kvd secret` makes it (kvd refuses a file others may read)
    loaded: dict[str, Settings] = {}
    for host in ("A", "B"):
        text = block_after(f"two-host: {host}").replace("/etc/kvd/cluster.secret", str(secret))
        path = tmp_path / f"{host}.toml"
        path.write_text(text)
        loaded[host] = load_settings(path)
        assert read_secret(loaded[host]) is not None
    a, b = loaded["A"], loaded["B"]
    assert a.role == "prefill" and a.serve_bootstrap and b.role == "decode"
    for s in (a, b):
        assert s.host not in ("0.0.0.0", "127.0.0.1", "::", "::1") and s.zmq_port
    assert a.http_host == a.host  # B's kvd reaches A's bootstrap at A's address
    assert f"`{a.host}:{a.http_port}`" in README  # the bootstrap address the text names


def test_secret_commands_make_a_secret_kvd_accepts(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    first, second = [ln for ln in block_after("secret-commands").splitlines() if ln.strip()]
    made = tmp_path / "kvd.secret"
    assert first.startswith("kvd secret ")
    assert main(["secret", str(made)]) == 0
    by_hand = tmp_path / "hand.secret"
    cmd = second.replace("/etc/kvd/cluster.secret", str(by_hand)).replace(
        "python3", sys.executable)
    subprocess.run(["bash", "-c", cmd], check=True, timeout=30)
    for path in (made, by_hand):
        assert path.stat().st_mode & 0o777 == 0o600
        assert re.fullmatch(r"[0-9a-f]{64}\n", path.read_text())
        assert read_secret(Settings(role="decode", cluster_secret_file=path)) is not None


def test_example_configs_have_fixed_http_ports() -> None:
    for name in ("prefill.toml", "decode.toml"):
        s = load_settings(REPO / "config" / name)
        assert s.http_port != 0, name
    assert load_settings(REPO / "config" / "prefill.toml").http_port != \
        load_settings(REPO / "config" / "decode.toml").http_port  # one host in the examples


def test_etcd_settings_load_on_both_hosts(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("KVD_")]:
        monkeypatch.delenv(name)
    etcd = block_after("etcd-settings")
    for host in ("A", "B"):
        path = tmp_path / f"{host}.toml"
        path.write_text(block_after(f"two-host: {host}") + etcd)
        s = load_settings(path)
        assert s.discovery == "etcd" and s.etcd_prefix == "/kvd/prod"
        assert s.etcd_endpoints.startswith("https://") and s.etcd_ca_file is not None
