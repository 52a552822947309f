"""The probe's own live cluster: started as ``make up`` starts it, the credentials it probes with, its processes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from devtools import cluster, processes
from elastico import auth
from elastico.redis_embedded import free_port
from elastico.v1 import allocator_pb2 as apb
from elastico.v1 import allocator_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "elastico"
# the end-to-end tests' fast timers (tests/e2e/test_allocator_e2e.py), at time scale 1
CLUSTER_ENV = {"ELASTICO_ESTIMATOR": "rule", "ELASTICO_ROUND_INTERVAL_S": "0.2", "ELASTICO_REPORT_POLL_S": "0.1",
               "ELASTICO_RECONCILE_INTERVAL_S": "0.2", "ELASTICO_HEARTBEAT_INTERVAL_S": "0.5", "ELASTICO_LEASE_TTL_S": "2",
               "ELASTICO_SIM_GPU_COUNT": "4", "ELASTICO_STOP_GRACE_S": "2", "ELASTICO_OBSERVATION_INTERVAL_S": "1000000",
               "ELASTICO_LOG_FORMAT": "json"}
TENANTS = ("team-a", "team-b")
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024), ("grpc.max_send_message_length", 64 * 1024 * 1024)]
T0 = time.monotonic()


def say(*args: object) -> None:
    print(*args, flush=True)


def section(title: str) -> None:
    say(f"\n== {title}  [t={time.monotonic() - T0:.0f} s]")


@dataclass
class Run:
    """The running cluster and the credentials the probe uses."""

    state: dict
    run_dir: Path
    operator_token: str
    tenant_tokens: dict[str, str]  # tenant -> bearer token (role tenant, no commands allowed)
    admin_url: str  # Redis admin user's URL (store inserts, the sampler's committed-usage reads)

    def addr(self, name: str) -> str:
        return next(p["address"] for p in self.state["procs"] if p["name"] == name)

    def pid(self, name: str) -> int:
        return next(p["pid"] for p in self.state["procs"] if p["name"] == name)

    @property
    def agents(self) -> dict[str, str]:
        return {p["name"]: p["address"] for p in self.state["procs"] if p["name"].startswith("node-")}

    def cert_only(self):
        """The operator's certificate without a token (the other services; hostile metadata on the allocator)."""
        return cluster.client_tls(self.state, token=False)

    def operator(self):
        return cluster.client_tls(self.state)

    def refresh(self) -> None:
        self.state = cluster.load_state() or self.state


def start_cluster(tmp: Path) -> Run:
    """``cluster.up(2)`` in ``tmp/run`` with the fast timers, secure; two tenant tokens issued and live."""
    for k in [k for k in os.environ if k.startswith("ELASTICO_") and k != "ELASTICO_REDIS_SERVER"]:
        del os.environ[k]
    os.environ.update(CLUSTER_ENV, ELASTICO_RUN_DIR=str(tmp / "run"), ELASTICO_BASE_PORT=str(free_port()))
    with contextlib.redirect_stdout(io.StringIO()):  # up() prints its endpoint table
        state = cluster.up(2, timeout_s=90)
    rd = cluster.run_dir()
    tokens_file = rd / "auth" / "tokens.json"
    tenant_tokens = {t: auth.issue(tokens_file, f"reliability-{t}", "tenant", tenant=t) for t in TENANTS}
    admin_url = json.loads(Path(state["redis_users_file"]).read_text())["admin"]
    run = Run(state, rd, Path(state["client"]["token_file"]).read_text().strip(), tenant_tokens, admin_url)
    deadline = time.monotonic() + 10  # the allocator re-reads the tokens file within a second
    for tenant, token in tenant_tokens.items():
        with run.cert_only().channel(run.addr("allocator")) as ch:
            stub = allocator_pb2_grpc.AllocatorStub(ch)
            while True:
                try:
                    stub.ListJobs(apb.ListJobsRequest(tenant=tenant, page_size=1), timeout=5,
                                  metadata=(("authorization", f"Bearer {token}"),))
                    break
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAUTHENTICATED or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
    return run


def save_pid(run: Run, name: str, pid: int) -> None:
    """Record a restarted process in the cluster's state file, so that ``cluster.down`` stops it too."""
    state = cluster.load_state()
    for p in state["procs"]:
        if p["name"] == name:
            p["pid"] = pid
    (run.run_dir / "cluster.json").write_text(json.dumps(state, indent=2))
    run.refresh()


def kill9(pid: int) -> None:
    """SIGKILL one process of the cluster and reap it (``cluster.up`` started it as our child)."""
    os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
        return
    while processes.alive(pid):  # not our child (a restarted process): wait until it is gone
        time.sleep(0.02)


def proc_env(pid: int) -> dict[str, str]:
    """The environment a process was started with (``/proc/<pid>/environ``)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="surrogateescape").split("\0") if "=" in item)


def leftover_workloads(run_dir: Path) -> list[int]:
    """Pids of processes still running from this run (workload shims name their directory under the run dir)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            with contextlib.suppress(OSError):
                if str(run_dir) in (d / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(d.name))
    return out


def retry(fn, attempts: int = 60):
    """A call retried while the allocator is away (a fault on purpose) or slow."""
    for k in range(attempts):
        try:
            return fn()
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or k == attempts - 1:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")
