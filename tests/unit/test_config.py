"""kvd.config.load_settings: defaults, TOML < env < overrides, SGLang aliases, errors."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from kvd.config import Settings, env_snapshot, load_settings, read_secret
from kvd.engine_rpc.socket_path import default_engine_socket
from kvd.errors import ConfigError

FIELDS = list(Settings.model_fields)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No KVD_*/SGLANG_DISAGGREGATION_* (or bare field-name) variables from the caller."""
    for name in list(os.environ):
        upper = name.upper()
        if upper.startswith(("KVD_", "SGLANG_DISAGGREGATION_")) or name.lower() in FIELDS:
            monkeypatch.delenv(name)


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvd.toml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    s = load_settings(role="decode")
    assert s.role == "decode"
    assert s.host == "127.0.0.1" and s.http_host == "127.0.0.1"
    assert s.http_port == 0 and s.zmq_port == 0
    assert s.engine_socket == default_engine_socket()  # /run/kvd/kvd.sock as root (S17)
    assert s.serve_bootstrap is False
    assert s.bootstrap_addr is None
    assert s.shm_dir == Path("/dev/shm")
    # ranks unset: taken from the engine at registration (kvd/ranks.py)
    assert (s.attn_tp_size, s.attn_tp_rank, s.attn_dp_size, s.attn_dp_rank, s.pp_size,
            s.pp_rank) == (None,) * 6
    # the reference connector's defaults for the settings it shares
    assert s.bootstrap_timeout == 300.0
    assert s.waiting_timeout == 300.0
    assert s.heartbeat_interval == 5.0
    assert s.heartbeat_max_failures == 2
    assert s.transfer_queue_size == 4
    assert s.transfer_threads == 1
    assert s.transfer_timeout == 120.0
    assert s.max_batch_entries == 512
    assert s.control_send_timeout == 5.0 and s.http_timeout == 5.0
    assert s.bootstrap_retry_budget == 30.0
    assert s.max_frame_bytes == 64 * 1024 * 1024
    assert s.log_level == "INFO"
    assert len(s.instance_id) == 16
    int(s.instance_id, 16)
    assert load_settings(role="decode").instance_id != s.instance_id


def test_role_is_required() -> None:
    with pytest.raises(ConfigError, match="role"):
        load_settings()
    with pytest.raises(ConfigError, match="role"):
        load_settings(role="router")


def test_toml_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'role = "decode"\nhttp_port = 1111\ntransfer_threads = 3\n'
                               'shm_dir = "/dev/shm/kvd"\n')
    s = load_settings(path)
    assert (s.role, s.http_port, s.transfer_threads) == ("decode", 1111, 3)
    assert s.shm_dir == Path("/dev/shm/kvd")
    assert load_settings(str(path)).http_port == 1111


def test_priority_toml_env_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_toml(tmp_path, 'role = "decode"\nhttp_port = 1111\nzmq_port = 2111\n'
                               'transfer_threads = 3\n')
    monkeypatch.setenv("KVD_ZMQ_PORT", "2222")
    monkeypatch.setenv("KVD_TRANSFER_THREADS", "5")
    s = load_settings(path, transfer_threads=7)
    assert s.http_port == 1111  # TOML only
    assert s.zmq_port == 2222  # env beats TOML
    assert s.transfer_threads == 7  # override beats env and TOML


def test_none_overrides_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVD_HTTP_PORT", "4321")
    s = load_settings(role="decode", http_port=None, bootstrap_addr=None)
    assert s.http_port == 4321


def test_env_values_are_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVD_ROLE", "prefill")
    monkeypatch.setenv("KVD_SERVE_BOOTSTRAP", "true")
    monkeypatch.setenv("KVD_ATTN_TP_SIZE", "4")
    monkeypatch.setenv("KVD_ATTN_TP_RANK", "3")
    monkeypatch.setenv("KVD_ENGINE_SOCKET", "/run/kvd/0.sock")
    s = load_settings()
    assert s.role == "prefill" and s.serve_bootstrap is True
    assert (s.attn_tp_size, s.attn_tp_rank) == (4, 3)
    assert s.engine_socket == Path("/run/kvd/0.sock")


@pytest.mark.parametrize("env, field, raw, value", [
    ("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "bootstrap_timeout", "12.5", 12.5),
    ("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "waiting_timeout", "33", 33.0),
    ("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "heartbeat_interval", "0.5", 0.5),
    ("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", "heartbeat_max_failures", "9", 9),
    ("SGLANG_DISAGGREGATION_THREAD_POOL_SIZE", "transfer_threads", "12", 12),
    ("SGLANG_DISAGGREGATION_QUEUE_SIZE", "transfer_queue_size", "16", 16),
])
def test_sglang_aliases(monkeypatch: pytest.MonkeyPatch, env: str, field: str, raw: str,
                        value: float) -> None:
    default = getattr(load_settings(role="decode"), field)
    assert default != value
    monkeypatch.setenv(env, raw)
    s = load_settings(role="decode")
    assert getattr(s, field) == value
    # an explicit override still wins over the SGLang variable
    assert getattr(load_settings(role="decode", **{field: default}), field) == default


def test_sglang_alias_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_DISAGGREGATION_QUEUE_SIZE", "0")
    with pytest.raises(ConfigError, match="transfer_queue_size"):
        load_settings(role="decode")


def test_several_invalid_entries_listed_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVD_HTTP_PORT", "70000")
    with pytest.raises(ConfigError) as exc:
        load_settings(role="decode", transfer_threads=0, bootstrap_timeout=-1,
                      max_batch_entries=2048, zmq_port="abc")
    text = str(exc.value)
    for name in ("http_port", "transfer_threads", "bootstrap_timeout", "max_batch_entries",
                 "zmq_port"):
        assert name in text, name
    assert text.startswith("invalid kvd configuration")


def test_rank_not_below_size_refused() -> None:
    with pytest.raises(ConfigError, match="attn_tp_rank=2 must be < attn_tp_size=2"):
        load_settings(role="decode", attn_tp_size=2, attn_tp_rank=2)
    with pytest.raises(ConfigError) as exc:
        load_settings(role="decode", attn_dp_rank=1, attn_dp_size=1, pp_size=2, pp_rank=5)
    assert "attn_dp_rank=1 must be < attn_dp_size=1" in str(exc.value)
    assert "pp_rank=5 must be < pp_size=2" in str(exc.value)
    s = load_settings(role="decode", attn_tp_size=2, attn_tp_rank=1, pp_size=2, pp_rank=1)
    assert (s.attn_tp_rank, s.pp_rank) == (1, 1)
    # a rank without its size is checked when the engine says the size (kvd/ranks.py)
    assert load_settings(role="decode", attn_tp_rank=3).attn_tp_size is None


def test_k16_a_frame_cap_below_the_largest_control_message_is_refused() -> None:
    """Peers do not exchange their caps: every peer must accept the protocol's largest real
    message, else it drops real messages unread and their rooms wait (K16)."""
    from kvd.protocol import control

    most = control.max_frame()
    with pytest.raises(ConfigError, match=rf"max_frame_bytes = {most - 1} is below the "
                                          rf"largest control message .* \({most} bytes\)"):
        load_settings(role="decode", max_frame_bytes=most - 1)
    assert load_settings(role="decode", max_frame_bytes=most).max_frame_bytes == most


def test_prefill_needs_bootstrap() -> None:
    with pytest.raises(ConfigError, match="bootstrap_addr"):
        load_settings(role="prefill")
    assert load_settings(role="prefill", serve_bootstrap=True).serve_bootstrap is True
    assert load_settings(role="prefill", bootstrap_addr="10.0.0.1:8998").bootstrap_addr == \
        "10.0.0.1:8998"
    assert load_settings(role="decode").bootstrap_addr is None


def test_missing_file_names_it(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="cannot read config file") as exc:
        load_settings(path, role="decode")
    assert str(path) in str(exc.value)


def test_directory_as_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(tmp_path, role="decode")
    assert str(tmp_path) in str(exc.value)


@pytest.mark.parametrize("text", ["role = ", "role = decode", "[[[", "http_port = 1\nhttp_port = 2",
                                  "\x00"])
def test_invalid_toml_names_the_file(tmp_path: Path, text: str) -> None:
    path = write_toml(tmp_path, text)
    with pytest.raises(ConfigError, match="cannot read config file") as exc:
        load_settings(path, role="decode")
    assert str(path) in str(exc.value)


def test_invalid_values_in_toml(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'role = "decode"\nhttp_port = "eighty"\ntransfer_threads = 0\n')
    with pytest.raises(ConfigError) as exc:
        load_settings(path)
    assert "http_port" in str(exc.value) and "transfer_threads" in str(exc.value)


def test_unknown_toml_key_refused(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'role = "decode"\nhttp_prot = 80\n')
    with pytest.raises(ConfigError, match="http_prot"):
        load_settings(path)


def test_unknown_override_refused() -> None:
    with pytest.raises(ConfigError, match="no_such_setting"):
        load_settings(role="decode", no_such_setting=1)


def test_unrelated_env_names_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only KVD_* and SGLANG_DISAGGREGATION_* variables configure kvd; generic names such as
    ROLE, HOST, HTTP_PORT or LOG_LEVEL (set by shells, containers, other tools) must not."""
    monkeypatch.setenv("ROLE", "prefill")
    monkeypatch.setenv("HOST", "203.0.113.9")
    monkeypatch.setenv("HTTP_PORT", "8080")
    monkeypatch.setenv("LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("INSTANCE_ID", "from-env")
    s = load_settings(role="decode")
    assert s.role == "decode"
    assert s.host == "127.0.0.1"
    assert s.http_port == 0
    assert s.log_level == "INFO"
    assert s.instance_id != "from-env"


def test_env_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVD_HTTP_PORT", "1")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_QUEUE_SIZE", "2")
    monkeypatch.setenv("SGLANG_OTHER", "3")
    snap = env_snapshot()
    assert snap["KVD_HTTP_PORT"] == "1"
    assert snap["SGLANG_DISAGGREGATION_QUEUE_SIZE"] == "2"
    assert "SGLANG_OTHER" not in snap


# ---- case S15: the secret never on the command line, in the config file or a message ---------

SECRET = "s15-secret-value-0123456789"


@pytest.mark.parametrize("key", ["cluster_secret", "CLUSTER_SECRET", "cluster-secret",
                                 "KVD_CLUSTER_SECRET", "Cluster_Secret"])
def test_s15_secret_is_refused_from_the_command_line_in_any_spelling(key: str) -> None:
    with pytest.raises(ConfigError, match="never taken from the command line") as exc:
        load_settings(role="decode", **{key: SECRET})
    assert SECRET not in str(exc.value)


def test_s15_secret_in_the_config_file_is_refused(tmp_path: Path) -> None:
    path = write_toml(tmp_path, f'role = "decode"\nCLUSTER_SECRET = "{SECRET}"\n')
    with pytest.raises(ConfigError, match="never goes in the config file") as exc:
        load_settings(path)
    assert SECRET not in str(exc.value)


def test_s15_invalid_entries_never_echo_a_secret_or_an_unknown_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(role="decode", cluster_secrte=SECRET, http_port="abc")
    text = str(exc.value)
    assert "cluster_secrte" in text and SECRET not in text
    assert "http_port = 'abc'" in text  # known, non-secret values are still shown


def test_s15_env_snapshot_masks_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVD_CLUSTER_SECRET", SECRET)
    assert env_snapshot()["KVD_CLUSTER_SECRET"] == "**********"


def secret_file(tmp_path: Path, text: str, mode: int) -> Path:
    path = tmp_path / "cluster.secret"
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o666])
def test_s15_secret_file_open_to_others_is_refused(tmp_path: Path, mode: int) -> None:
    path = secret_file(tmp_path, SECRET + "\n", mode)
    s = load_settings(role="decode", cluster_secret_file=str(path))
    with pytest.raises(ConfigError, match=f"open to group or others \\(mode {mode:04o}\\)") \
            as exc:
        read_secret(s)
    assert SECRET not in str(exc.value) and "chmod 600" in str(exc.value)


def test_s15_secret_file_check_warn_only_warns(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    path = secret_file(tmp_path, SECRET + "\nsecond line ignored\n", 0o644)
    s = load_settings(role="decode", cluster_secret_file=str(path),
                      cluster_secret_file_check="warn")
    assert read_secret(s) == SECRET.encode()
    assert "open to group or others" in caplog.text and SECRET not in caplog.text


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_s15_owner_only_secret_file_is_read(tmp_path: Path, mode: int) -> None:
    path = secret_file(tmp_path, f"  {SECRET}  \r\n", mode)
    assert read_secret(load_settings(role="decode", cluster_secret_file=str(path))) == \
        SECRET.encode()


@pytest.mark.parametrize("text", ["", "\n", "   \n" + SECRET])
def test_s15_empty_secret_file_is_a_clear_error(tmp_path: Path, text: str) -> None:
    path = secret_file(tmp_path, text, 0o600)
    with pytest.raises(ConfigError, match=r"is empty \(the secret is its first line\): kvd "
                                          r"secret .* --force writes a new one"):
        read_secret(load_settings(role="decode", cluster_secret_file=str(path)))


def test_s15_short_and_unreadable_secrets_are_named_without_the_value(tmp_path: Path) -> None:
    path = secret_file(tmp_path, "short-secret\n", 0o600)
    with pytest.raises(ConfigError, match="at least 16 bytes \\(it has 12\\)") as exc:
        read_secret(load_settings(role="decode", cluster_secret_file=str(path)))
    assert "short-secret" not in str(exc.value)
    missing = load_settings(role="decode", cluster_secret_file=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="cannot read cluster_secret_file"):
        read_secret(missing)


# ---- values that passed validation and then broke or hung the daemon ---------------------


@pytest.mark.parametrize("text", ["inf", "+inf", "nan", "1e400"])
@pytest.mark.parametrize("field", ["bootstrap_timeout", "waiting_timeout", "release_timeout"])
def test_non_finite_durations_are_refused(tmp_path: Path, field: str, text: str) -> None:
    """A room must end by its deadline: an infinite timeout (TOML ``inf``, or a number that
    overflows to it) is a configuration error, not a room that never times out."""
    with pytest.raises(ConfigError, match=field):
        load_settings(role="decode", **{field: text})
    path = write_toml(tmp_path, f'role = "decode"\n{field} = {text}\n')
    with pytest.raises(ConfigError, match=field):
        load_settings(path)


@pytest.mark.parametrize("path", ["", ".", "/", "/run/kvd/", "/tmp/.."])
def test_engine_socket_without_a_file_name_is_a_config_error(path: str) -> None:
    """``--engine-socket ''`` (or a folder) used to crash kvd serve with a traceback."""
    with pytest.raises(ConfigError, match="engine_socket"):
        load_settings(role="decode", engine_socket=path)


@pytest.mark.parametrize("host", ["not..a..host", "kvd-0.example.internal", "0.0.0.0"])
def test_host_the_transfer_engine_cannot_use_is_a_config_error(host: str) -> None:
    """``host`` is advertised and, unless ``transfer_host`` is set, is the transfer
    engine's IPv4 address: a name or garbage crashed kvd serve with a traceback at start,
    and 0.0.0.0 was advertised to peers as if it were reachable."""
    with pytest.raises(ConfigError, match="host"):
        load_settings(role="decode", host=host)


def test_a_host_name_is_fine_with_an_ipv4_transfer_host() -> None:
    s = load_settings(role="decode", host="kvd-0.example.internal", transfer_host="10.0.0.2")
    assert s.host == "kvd-0.example.internal"
    assert load_settings(role="decode", host="kvd-0", transfer_backend="local").host == "kvd-0"


def test_config_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    """A binary or Latin-1 file used to escape as a UnicodeDecodeError traceback (exit 1)."""
    path = tmp_path / "kvd.toml"
    path.write_bytes(b'role = "decode"\n# caf\xe9\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_settings(path)


@pytest.mark.parametrize("line", ["waiting_timeout = true", "http_port = false",
                                  "heartbeat_max_failures = true", "attn_tp_size = true"])
def test_a_boolean_in_a_number_setting_is_refused(tmp_path: Path, line: str) -> None:
    """``waiting_timeout = true`` used to load as a 1-second timeout."""
    with pytest.raises(ConfigError, match="not true/false"):
        load_settings(write_toml(tmp_path, f'role = "decode"\n{line}\n'))
    s = load_settings(write_toml(tmp_path, 'role = "decode"\ninsecure = true\n'))
    assert s.insecure is True


@pytest.mark.parametrize(("overrides", "message"), [
    ({"etcd_prefix": "kvd"}, "must be an absolute key path"),
    ({"etcd_endpoints": "127.0.0.1:2379"}, "is not http(s)://host:port"),
    ({"etcd_endpoints": "http://a:2379,ftp://b:1"}, "'ftp://b:1'"),
    ({"etcd_user": "kvd"}, "etcd_user and etcd_password_file go together"),
    ({"etcd_key_file": "/k.pem"}, "etcd_key_file needs etcd_cert_file"),
    ({"etcd_ca_file": "/ca.pem"}, "is plain http: use https://"),
    ({"etcd_lease_ttl": 1}, "greater than or equal to 2"),
    ({"discovery": "zookeeper"}, "'bootstrap' or 'etcd'"),
])
def test_etcd_settings_are_validated_with_clear_errors(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_settings(role="decode", **overrides)


def test_etcd_password_file_is_checked_like_the_secret_file(tmp_path: Path) -> None:
    from kvd.config import read_etcd_password

    pw = tmp_path / "pw"
    pw.write_text("s3cret\nignored\n")
    pw.chmod(0o644)
    s = load_settings(role="decode", etcd_user="kvd", etcd_password_file=str(pw))
    with pytest.raises(ConfigError, match="open to group or others"):
        read_etcd_password(s)
    pw.chmod(0o600)
    assert read_etcd_password(s) == "s3cret"
    ok = load_settings(role="decode", discovery="etcd", etcd_endpoints="https://e1:2379,"
                       "https://e2:2379/", etcd_ca_file="/ca.pem", etcd_prefix="/kvd/prod/")
    assert ok.etcd_prefix == "/kvd/prod"
