"""deploy/k8s: the manifests validate against the Kubernetes schemas (kubernetes-validate,
strict: unknown fields are errors) and have the sidecar shape kvd needs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

kv_utils = pytest.importorskip(
    "kubernetes_validate.utils",
    reason="kubernetes-validate is in the dev extra: pip install -c constraints.txt -e '.[dev]'")

MANIFESTS = sorted((Path(__file__).resolve().parents[3] / "deploy" / "k8s").glob("*.yaml"))
# Native sidecars (initContainers[].restartPolicy) exist from 1.28; beta (on) from 1.29.
VERSIONS = ["1.29.0", kv_utils.latest_version()]


def docs() -> list[dict[str, Any]]:
    return [d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d]


def test_there_are_manifests() -> None:
    assert MANIFESTS and {d["kind"] for d in docs()} >= {"Pod", "ConfigMap"}


@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_validate(version: str) -> None:
    for doc in docs():
        kv_utils.validate(doc, version, strict=True)


def test_validator_rejects_an_unknown_field() -> None:
    pod = next(d for d in docs() if d["kind"] == "Pod")
    pod["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kv_utils.ValidationError):
        kv_utils.validate(pod, VERSIONS[-1], strict=True)


def test_pod_runs_kvd_as_a_native_sidecar_sharing_socket_and_shm() -> None:
    pod = next(d for d in docs() if d["kind"] == "Pod")
    spec = pod["spec"]
    (kvd,) = [c for c in spec["initContainers"] if c["name"] == "kvd"]
    assert kvd["restartPolicy"] == "Always"
    assert kvd["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert kvd["livenessProbe"]["httpGet"]["path"] == "/health"
    assert kvd["startupProbe"]["httpGet"]["path"] == "/health"
    engine = spec["containers"][0]
    mounts = {c["name"]: {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
              for c in (kvd, engine)}
    volumes = {v["name"]: v for v in spec["volumes"]}
    for name, path in (("kvd-run", "/run/kvd"), ("dshm", "/dev/shm")):
        assert mounts["kvd"][name] == path and mounts["engine"][name] == path
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert spec["securityContext"]["runAsNonRoot"] is True  # same uid for both: socket 0600
    config = next(d for d in docs() if d["kind"] == "ConfigMap")
    assert 'engine_socket = "/run/kvd/kvd.sock"' in config["data"]["kvd.toml"]
