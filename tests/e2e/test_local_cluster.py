"""The whole suite as separate processes: `python -m devtools.cluster up` / `down`, as `make up` runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from devtools import cluster
from elastico import pki
from elastico.redis_embedded import free_port
from elastico.rpc.security import ClientTLS, TLSFiles

EXPECTED_SERVICE = {
    "allocator": "elastico.v1.Allocator",
    "pricer": "elastico.v1.Pricer",
    "predictor": "elastico.v1.Predictor",
    "node-1": "elastico.v1.NodeAgent",
    "node-2": "elastico.v1.NodeAgent",
}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return False


@pytest.fixture
def cluster_env(open_tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICO_")}
    env.update({"ELASTICO_RUN_DIR": str(open_tmp / "run"), "ELASTICO_BASE_PORT": str(free_port()), "ELASTICO_NODES": "2"})
    return env


def _cli(env: dict[str, str], *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "devtools.cluster", *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_up_serves_everything_and_down_leaves_nothing(cluster_env):
    started = time.monotonic()
    up = _cli(cluster_env, "up")
    elapsed = time.monotonic() - started
    state_file = Path(cluster_env["ELASTICO_RUN_DIR"]) / "cluster.json"
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert elapsed < 30, f"up took {elapsed:.1f}s"
        state = json.loads(state_file.read_text())
        procs = {p["name"]: p for p in state["procs"]}
        assert set(procs) == {"redis", *EXPECTED_SERVICE}
        tls = cluster.client_tls(state, token=False)  # the operator certificate up issued
        for name, service in EXPECTED_SERVICE.items():
            with grpc.insecure_channel(procs[name]["address"]) as ch:  # secure by default: no plaintext at all
                with pytest.raises(grpc.RpcError) as refused:
                    health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert refused.value.code() is grpc.StatusCode.UNAVAILABLE, name
            with tls.channel(procs[name]["address"]) as ch:
                for svc in ("", service):
                    resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=svc), timeout=5)
                    assert resp.status == health_pb2.HealthCheckResponse.SERVING, (name, svc)
                listing = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
                names = {s.name for r in listing for s in r.list_services_response.service}
                assert {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names, (name, names)
        _commands_need_a_token_and_never_run_as_root(state, procs["allocator"]["address"])
        status = _cli(cluster_env, "status")
        assert status.returncode == 0, status.stderr
        assert status.stdout.count("simulated") == 8  # 2 nodes x 4 simulated GPUs, reported by the agents
        again = _cli(cluster_env, "up")  # idempotent: does not start a second suite
        assert "already running" in again.stdout
    finally:
        down = _cli(cluster_env, "down")
    assert down.returncode == 0, down.stderr
    assert not state_file.exists()
    deadline = time.monotonic() + 5
    while any(_alive(p["pid"]) for p in state["procs"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p["name"] for p in state["procs"] if _alive(p["pid"])]


def _commands_need_a_token_and_never_run_as_root(state: dict, address: str) -> None:
    """The outsider's probe: a command submitted without a token never runs; the operator's runs unprivileged."""
    from elastico.v1 import allocator_pb2, allocator_pb2_grpc, types_pb2

    marker = Path(tempfile.gettempdir()) / f"elastico-uid-{uuid.uuid4().hex}"
    spec = types_pb2.JobSpec(name="probe", kind=types_pb2.JOB_KIND_TRAINING, model_family="ResNet-50", batch_size=32,
                             training=types_pb2.TrainingWork(total_steps=10), command=f"sh -c 'id -u > {marker}.part && mv {marker}.part {marker}'")
    with cluster.client_tls(state, token=False).channel(address) as ch:
        with pytest.raises(grpc.RpcError) as refused:
            allocator_pb2_grpc.AllocatorStub(ch).SubmitJob(allocator_pb2.SubmitJobRequest(request_id="probe-1", spec=spec), timeout=5)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    with cluster.client_tls(state).channel(address) as ch:
        stub = allocator_pb2_grpc.AllocatorStub(ch)
        job = stub.SubmitJob(allocator_pb2.SubmitJobRequest(request_id="probe-2", spec=spec), timeout=5).job
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    try:
        uid = int(marker.read_text())
    finally:
        marker.unlink(missing_ok=True)
        Path(f"{marker}.part").unlink(missing_ok=True)
    assert uid != 0 and uid == (65534 if os.getuid() == 0 else os.getuid())
    log = next(p["log"] for p in state["procs"] if p["name"] == "allocator")
    audit = [json.loads(line) for line in Path(log).read_text().splitlines()
             if '"audit"' in line and job.job_id in line]
    assert audit and audit[0]["identity"] == "operator" and audit[0]["outcome"] == "OK"


def test_services_log_json_and_stop_gracefully_on_sigterm(cluster_env, tmp_path):
    """A service started alone answers health, then on SIGTERM logs shutdown and exits 0."""
    port = free_port()
    port_file = tmp_path / "port"
    certs = pki.throwaway(tmp_path / "pki", ["pricer", "operator"])
    env = {**cluster_env, **pki.tls_env(certs["pricer"]), "ELASTICO_PORT": "0", "ELASTICO_PORT_FILE": str(port_file),
           "ELASTICO_LOG_FORMAT": "json"}
    proc = subprocess.Popen([sys.executable, "-m", "services.pricer"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        port = int(port_file.read_text())
        op = certs["operator"]
        with ClientTLS(TLSFiles(op.cert_file, op.key_file, op.ca_file)).channel(f"127.0.0.1:{port}") as ch:
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0
    events = [json.loads(line)["event"] for line in out.splitlines() if line.startswith("{")]
    assert events[:1] == ["serving"] and events[-2:] == ["shutting down", "stopped"]
