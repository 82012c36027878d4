"""deploy/k8s/etcd: the etcd manifests validate (strict), its pods meet Pod Security
"restricted", only kvd pods reach its client port, and the kvd settings the k8s README
adds for etcd load on top of every kvd sidecar's ConfigMap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvd.config import load_settings
from tests.unit.deploy import test_k8s_manifests as k8s

kv_utils = pytest.importorskip("kubernetes_validate.utils",
                               reason="kubernetes-validate is in the dev extra")

ETCD = k8s.REPO / "deploy" / "k8s" / "etcd" / "etcd.yaml"
README = (k8s.REPO / "deploy" / "k8s" / "README.md").read_text()


def _docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(ETCD.read_text()) if d]


@pytest.mark.parametrize("version", k8s.VERSIONS)
def test_etcd_manifests_validate(version: str) -> None:
    assert {d["kind"] for d in _docs()} == {"Service", "StatefulSet", "NetworkPolicy"}
    for doc in _docs():
        kv_utils.validate(doc, version, strict=True)


def test_etcd_pods_meet_pod_security_restricted() -> None:
    [sts] = [d for d in _docs() if d["kind"] == "StatefulSet"]
    assert k8s.restricted_violations(sts["spec"]["template"]["spec"]) == []
    assert {d["metadata"]["namespace"] for d in _docs()} == {"llm-pd"}


def test_only_kvd_pods_reach_the_client_port() -> None:
    [pol] = [d for d in _docs() if d["kind"] == "NetworkPolicy"]
    client = [r for r in pol["spec"]["ingress"] if r["ports"][0]["port"] == 2379]
    [rule] = client
    allowed = set(rule["from"][0]["podSelector"]["matchExpressions"][0]["values"])
    assert allowed == {"prefill", "decode", "etcd"}  # not the router, not the engines


def test_readme_etcd_settings_load_with_every_sidecar(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    snippet = README.split("<!-- k8s-etcd-settings", 1)[1].split("```", 2)[1]
    snippet = snippet.split("\n", 1)[1]
    loaded = 0
    for name, text in k8s._config_files().items():
        if not text.lstrip().startswith(("role", "#")) or "role =" not in text:
            continue
        path = tmp_path / f"{name.replace('/', '_')}.toml"
        path.write_text(text + "\n" + snippet)
        monkeypatch.setenv("KVD_HOST", "10.1.2.3")
        monkeypatch.setenv("KVD_BOOTSTRAP_ADDR", "10.1.2.3:8998")
        monkeypatch.setenv("KVD_CLUSTER_SECRET", "0123456789abcdef0123")
        s = load_settings(path)
        assert s.discovery == "etcd" and s.etcd_user == "kvd", name
        assert s.etcd_prefix == "/kvd/llm-pd"
        loaded += 1
    assert loaded >= 3  # prefill, decode and the TP 2 sidecars' files
