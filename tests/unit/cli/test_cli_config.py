"""``kvd config show`` / ``config template`` / ``serve`` with bad settings, through main(argv)."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest

from kvd.cli.main import main
from kvd.config import Settings, describe_fields, toml_template

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith(("KVD_", "SGLANG_DISAGGREGATION_")):
            monkeypatch.delenv(name)


def show(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["config", "show", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_config_show_names_the_source_of_every_value(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "kvd.toml"
    cfg.write_text('role = "decode"\nhttp_port = 1111\nzmq_port = 2111\ntransfer_threads = 3\n')
    monkeypatch.setenv("KVD_ZMQ_PORT", "2222")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "42")
    rows = show(capsys, "-c", str(cfg), "--set", "transfer_threads=7")
    assert set(rows) == set(Settings.model_fields)
    assert rows["http_port"] == {"value": 1111, "source": "file", "origin": str(cfg)}
    assert rows["zmq_port"] == {"value": 2222, "source": "env", "origin": "KVD_ZMQ_PORT"}
    assert rows["waiting_timeout"] == {"value": 42.0, "source": "env",
                                       "origin": "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"}
    assert rows["transfer_threads"] == {"value": 7, "source": "cli", "origin": ""}
    assert rows["role"]["source"] == "file"
    assert rows["host"] == {"value": "127.0.0.1", "source": "default", "origin": ""}


def test_config_show_table_lists_values_and_sources(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--role", "decode", "--set", "http_port=8998"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "http_port" in ln)
    assert "8998" in line and "cli" in line
    assert "default" in next(ln for ln in out.splitlines() if "zmq_port" in ln)


def test_bad_config_lists_every_error_and_exits_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('role = "router"\nhttp_port = "eighty"\ntransfer_threads = 0\nhttp_prot = 1\n')
    monkeypatch.setenv("KVD_MAX_BATCH_ENTRIES", "4096")
    for argv in (["config", "show", "-c", str(cfg)], ["serve", "-c", str(cfg)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvd: invalid kvd configuration")
        for name in ("role", "http_port", "transfer_threads", "http_prot", "max_batch_entries"):
            assert name in err, (argv, name, err)
        assert f"file ({cfg})" in err and "env (KVD_MAX_BATCH_ENTRIES)" in err
        assert "Traceback" not in err


def test_unreadable_file_and_bad_set_are_one_line(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "-c", str(tmp_path / "missing.toml")]) == 2
    err = capsys.readouterr().err
    assert "missing.toml' does not exist" in err and len(err.strip().splitlines()) == 1
    bad = tmp_path / "bad.toml"
    bad.write_text("role = \n")
    assert main(["config", "show", "-c", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "cannot read config file" in err and len(err.strip().splitlines()) == 1
    assert main(["config", "show", "--role", "decode", "--set", "http_port"]) == 2
    assert "--set expects KEY=VALUE" in capsys.readouterr().err


def _documented(text: str) -> dict[str, str]:
    """``#name = value`` lines of kvd.toml -> name: raw value (comment stripped)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") and " = " in line and line[1:2].isalpha():
            name, _, value = line[1:].partition(" = ")
            out[name.strip()] = value
    return out


def test_kvd_toml_documents_every_setting_with_its_default() -> None:
    text = (REPO / "config" / "kvd.toml").read_text()
    documented = _documented(text)
    for name, unit, help_, default in describe_fields():
        assert name in documented, f"config/kvd.toml does not document {name}"
        assert help_, f"{name} has no description"
        raw = documented[name]
        if default is None:
            assert "default:" in raw or "required" in raw, name
            continue
        value = tomllib.loads(f"v = {raw}")["v"]
        assert value == (str(default) if isinstance(default, Path) else default), name
        if unit:
            assert f"unit: {unit}" in text, name
    assert text == toml_template(), "regenerate: kvd config template > config/kvd.toml"


def test_config_template_command_prints_kvd_toml(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "template"]) == 0
    assert capsys.readouterr().out == toml_template()


@pytest.mark.parametrize("example", ["prefill.toml", "decode.toml", "kvd.toml"])
def test_example_configs_load(example: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--role", "decode"] if example == "kvd.toml" else []
    rows = show(capsys, "-c", str(REPO / "config" / example), *args)
    if example != "kvd.toml":
        assert rows["role"] == {"value": example.removesuffix(".toml"), "source": "file",
                                "origin": str(REPO / "config" / example)}
    else:  # every line is commented out: nothing comes from the file
        assert {r["source"] for r in rows.values()} <= {"default", "cli"}
