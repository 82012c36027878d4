"""Every engine command line in deploy/ and the READMEs, through the REAL engines' argument
parsers (where vLLM / SGLang are installed: ``make test-vllm``); and the recorded flag lists
that the main suite checks them against (tests/unit/deploy/data) still match those parsers.
Elsewhere these tests skip; tests/unit/deploy checks the same lines against the lists."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.deploy import engine_commands as ec

REPO = Path(__file__).resolve().parents[2]


def _need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed here (make test-vllm runs this in .venv-vllm)")


def _vllm_parser():  # type: ignore[no-untyped-def]
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def _sglang_parser():  # type: ignore[no-untyped-def]
    import argparse

    from tests.adapters.sglang_env import prepare_imports

    prepare_imports()
    from sglang.srt.server_args import ServerArgs

    from kvd.adapters.sglang.plugin import register

    register()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


@pytest.mark.parametrize("cmd", ec.all_commands(), ids=lambda c: f"{c.where}:{c.engine}")
def test_command_lines_parse_with_the_real_parser(cmd: ec.EngineCommand) -> None:
    _need(cmd.engine)
    parser = _vllm_parser() if cmd.engine == "vllm" else _sglang_parser()
    args = parser.parse_args(cmd.args)
    if cmd.engine == "vllm":
        kt = args.kv_transfer_config
        assert kt.kv_connector == "KvdConnector"
        assert kt.kv_connector_module_path == "kvd.adapters.vllm"
    else:
        assert args.disaggregation_transfer_backend == "kvd"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_recorded_flags_match_the_installed_engine(engine: str) -> None:
    _need(engine)
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "engine_flags.py"), engine],
                          capture_output=True, text=True, timeout=300, cwd=REPO, check=False,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(REPO), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-2000:]
    live, recorded = json.loads(proc.stdout), ec.flags(engine)
    if live["version"] != recorded["version"]:
        pytest.skip(f"{engine} {live['version']} installed, flags recorded for "
                    f"{recorded['version']}: regenerate with scripts/engine_flags.py")
    assert live["flags"] == recorded["flags"]
