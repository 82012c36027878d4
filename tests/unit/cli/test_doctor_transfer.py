"""kvd doctor's transfer checks: which build, protocol and NICs and why; RDMA without a NIC."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvd.cli import doctor
from kvd.config import Settings
from kvd.errors import TransportError
from kvd.transfer.backends import mooncake


def _settings(**kw: object) -> Settings:
    return Settings(role="decode", **kw)  # type: ignore[arg-type]


def test_build_names_the_installed_mooncake() -> None:
    c = doctor.check_build()
    assert c.status == "ok" and "mooncake-transfer-engine" in c.detail and "cpu" in c.detail


def test_tcp_settings_say_what_is_used_and_why() -> None:
    c = doctor.check_transfer_settings(_settings(transfer_port_range="15100-15101"))
    assert c.status == "ok"
    assert "protocol tcp" in c.detail and "15100-15101" in c.detail
    assert "listeners on 127.0.0.1" in c.detail


def test_wildcard_bind_host_is_a_warning() -> None:
    c = doctor.check_transfer_settings(_settings(transfer_bind_host="0.0.0.0"))
    assert c.status == "warn" and "every interface" in c.detail


def test_rdma_without_a_device_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    monkeypatch.setattr(mooncake, "RDMA_SYSFS", tmp_path / "infiniband")  # none here either
    c = doctor.check_transfer_settings(_settings(transfer_protocol="rdma"))
    assert c.status == "fail" and "no RDMA device" in c.detail
    with pytest.raises(TransportError, match="no RDMA device"):
        mooncake.MooncakeEngine(mooncake.MooncakeOptions("127.0.0.1", protocol="rdma"))


def test_named_nic_that_does_not_exist_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    sysfs = tmp_path / "infiniband"
    (sysfs / "mlx5_0" / "ports" / "1").mkdir(parents=True)
    (sysfs / "mlx5_0" / "ports" / "1" / "state").write_text("4: ACTIVE\n")
    monkeypatch.setattr(mooncake, "RDMA_SYSFS", sysfs)
    with pytest.raises(TransportError, match="mlx5_9"):
        mooncake.check_rdma(["mlx5_0", "mlx5_9"])
    mooncake.check_rdma(["mlx5_0"])
    c = doctor.check_transfer_settings(_settings(transfer_protocol="rdma"))
    assert "topology discovery" in c.detail


@pytest.mark.parametrize(("value", "match"), [
    ("15000", "FIRST-LAST"), ("15000-15000", "two ports"), ("40000-40001", "32768-60999"),
    ("80-81", "1024-65535"), ("20000-62000", "32768-60999")])
def test_port_range_rules(value: str, match: str) -> None:
    from kvd.config import load_settings
    from kvd.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        load_settings(role="decode", transfer_port_range=value)


def test_every_transfer_problem_is_listed_at_once() -> None:
    from kvd.config import load_settings
    from kvd.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_settings(role="decode", transfer_port_range="1-2", transfer_devices="a,,b",
                      transfer_bind_host="::1", transfer_protocol="udp")
    text = str(info.value)
    for part in ("transfer_protocol", "transfer_port_range", "transfer_devices",
                 "transfer_bind_host"):
        assert part in text


def test_k40_doctor_judges_peer_clocks_against_the_freshness_window() -> None:
    from kvd.cli.doctor import check_peer_clocks

    def rows(*offsets: float | None) -> list[dict]:
        return [{"endpoint": f"tcp://h:{i}", "clock_offset_s": o} for i, o in enumerate(offsets)]

    assert check_peer_clocks(rows(None), 30.0).status == "ok"
    ok = check_peer_clocks(rows(0.002, -0.4), 30.0)
    assert ok.status == "ok" and "-0.400s" in ok.detail and "tcp://h:1" in ok.detail
    assert check_peer_clocks(rows(0.0, 20.0), 30.0).status == "warn"
    bad = check_peer_clocks(rows(0.0, -3600.2), 30.0)
    assert bad.status == "fail" and "tcp://h:1 -3600.2s" in bad.detail and "NTP" in bad.fix
