"""deploy/container/README.md's ``docker run`` example works as written (no Docker here):
its options are checked against the Dockerfile (user, paths the image has, entrypoint) and
its settings against kvd's own CLI and config (the same code ``kvd serve`` runs)."""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvd.config import Settings

REPO = Path(__file__).resolve().parents[3]
README = REPO / "deploy" / "container" / "README.md"
DOCKERFILE = REPO / "deploy" / "container" / "Dockerfile"


@dataclass
class Run:
    """One parsed ``docker run`` command."""

    options: dict[str, list[str]] = field(default_factory=dict)
    image: str = ""
    args: list[str] = field(default_factory=list)

    def one(self, name: str) -> str:
        (value,) = self.options[name]
        return value

    @property
    def env(self) -> dict[str, str]:
        return dict(e.split("=", 1) for e in self.options.get("-e", []))

    @property
    def volumes(self) -> dict[str, str]:
        """target -> source"""
        return {v.split(":")[1]: v.split(":")[0] for v in self.options.get("-v", [])}


_FLAGS = {"-d", "--rm"}


def _parse(words: list[str]) -> Run:
    assert words[:2] == ["docker", "run"], words
    run, i = Run(), 2
    while i < len(words) and words[i].startswith("-"):
        if words[i] in _FLAGS:
            run.options.setdefault(words[i], []).append("")
            i += 1
        else:
            run.options.setdefault(words[i], []).append(words[i + 1])
            i += 2
    run.image, run.args = words[i], words[i + 1:]
    return run


def example_runs() -> list[Run]:
    text = README.read_text()
    block = text.split("<!-- run-example:", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    joined = re.sub(r"\\\n\s*", " ", block)
    commands = [ln.split("#", 1)[0].strip() for ln in joined.splitlines()]
    return [_parse(shlex.split(c)) for c in commands if c.startswith("docker run")]


def dockerfile() -> dict[str, Any]:
    text = DOCKERFILE.read_text()
    runtime = text.split("AS runtime", 1)[1]
    copies = re.findall(r"^COPY (?!--from)(.+) (\S+/)$", runtime, re.M)
    image_files = {f"{dest}{Path(src).name}": REPO / src for srcs, dest in copies
                   for src in srcs.split()}
    env = dict(re.findall(r"(\w+)=(\S+)", runtime.split("\nENV ", 1)[1].split("\nUSER", 1)[0]))
    return {"user": re.findall(r"^USER (\S+)", runtime, re.M)[-1], "files": image_files,
            "env": env, "cmd": json.loads(re.findall(r"^CMD (.+)$", runtime, re.M)[-1]),
            "entrypoint": json.loads(re.findall(r"^ENTRYPOINT (.+)$", runtime, re.M)[-1])}


@pytest.fixture
def runs() -> tuple[Run, Run]:
    kvd, engine = example_runs()
    assert kvd.image.startswith("kvd:") and not engine.image.startswith("kvd:")
    return kvd, engine


def test_shares_socket_shm_user_and_network(runs: tuple[Run, Run]) -> None:
    kvd, engine = runs
    image = dockerfile()
    assert kvd.one("--network") == engine.one("--network") == "host"  # Mooncake's ports
    assert kvd.one("--ipc") == "shareable" and kvd.one("--shm-size")
    assert engine.one("--ipc") == f"container:{kvd.one('--name')}"  # the same /dev/shm
    assert kvd.volumes["/run/kvd"] == engine.volumes["/run/kvd"]  # the socket folder
    assert engine.one("--user") == image["user"]  # the socket is mode 0600
    assert image["entrypoint"][0] == "/usr/bin/tini"


def _settings(run: Run, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings ``kvd serve`` gets in the container: the image's env, the run's env,
    the config file the image was built with; parsed by kvd's CLI (``serve`` is stopped
    just before it would start a daemon)."""
    import kvd.cli.doctor
    import kvd.daemon
    from kvd.cli.main import main

    image = dockerfile()
    env = {**image["env"], **run.env}
    config_in_image = env["KVD_CONFIG"]
    assert config_in_image in image["files"], f"{config_in_image} is not in the image"
    for name in [n for n in os.environ if n.startswith("KVD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KVD_CONFIG", str(image["files"][config_in_image]))
    got: list[Settings] = []
    monkeypatch.setattr(kvd.cli.doctor, "refusals", lambda s: [])  # host paths: not here
    monkeypatch.setattr(kvd.daemon, "serve", lambda s: got.append(s) or 0)
    args = [*image["entrypoint"][2:], *(run.args or image["cmd"])]
    assert args[0] == "kvd"
    assert main(args[1:]) == 0
    return got[0]


def test_settings_are_valid_and_fit_the_run(runs: tuple[Run, Run],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    kvd, engine = runs
    s = _settings(kvd, monkeypatch)
    assert s.engine_socket.parent == Path("/run/kvd")  # inside the shared volume
    assert engine.env["SGLANG_KVD_SOCKET"] == str(s.engine_socket)
    assert s.http_port != 0  # the health check (kvd status) finds it
    assert s.host not in ("127.0.0.1", "::1") and s.host == kvd.env["KVD_HOST"]
    assert s.http_host == s.host  # reachable by the decode hosts (bootstrap), not 0.0.0.0
    secret = s.cluster_secret_file
    assert secret is not None and str(secret) in kvd.volumes  # mounted read-only
    assert f"{kvd.volumes[str(secret)]}:{secret}:ro" in kvd.options["-v"]
    assert engine.env["KVD_CLUSTER_SECRET_FILE"] == str(secret)
    assert s.serve_bootstrap and "--disaggregation-bootstrap-port" in engine.args
    port = engine.args[engine.args.index("--disaggregation-bootstrap-port") + 1]
    assert int(port) == s.http_port


def test_the_secret_line_makes_a_secret_kvd_accepts(tmp_path: Path) -> None:
    import subprocess
    import sys

    from kvd.config import read_secret

    text = README.read_text()
    line = next(ln for ln in text.splitlines() if "token_hex" in ln)
    generate = line.split("|", 1)[0].strip().replace("python3", shlex.quote(sys.executable))
    out = subprocess.run(generate, shell=True, capture_output=True, text=True, check=True)
    path = tmp_path / "cluster.secret"
    path.write_text(out.stdout)
    assert read_secret(Settings(role="decode", cluster_secret_file=path)) == \
        out.stdout.strip().encode()
