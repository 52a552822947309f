"""What a workload gets from its node agent: an environment built from an allow-list (none of the agent's own
variables), and no way to read the ledger, launch records or another workload's log. Real shims and processes."""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from pathlib import Path

import pytest

from elastico.domain import GpuSlice, Placement, Shape
from services.node_agent.runner import WORKLOAD_PATH, LedgerEntry, LedgerFile, Runner, workload_dir
from services.node_agent.settings import WorkloadPolicy
from tests.conftest import reachable_dir

SECRETS = {"AWS_SECRET_ACCESS_KEY": "s3cr3t-aws", "ELASTICO_REDIS_URL": "redis://node:s3cr3t-redis@127.0.0.1:1/0",
           "ELASTICO_TLS_KEY_FILE": "/root/pki/node.key", "CUDA_MPS_PIPE_DIRECTORY": "/agent/own/pipe",
           "CUDA_VISIBLE_DEVICES": "0,1,2,3", "PYTHONPATH": "/root/private/lib", "LD_PRELOAD": "/root/evil.so",
           "PATH": "/root/.secret/bin:/usr/local/bin:/usr/bin:/bin"}
PASSED = {"LANG": "C.UTF-8", "LC_TIME": "C", "TZ": "UTC"}


def _entry(state_dir: Path, job_id: str) -> LedgerEntry:
    p = Placement(job_id, 0, Shape(1, 50.0, 1024), (GpuSlice("n", 0, 50.0, 1024),), epoch=1, committed_at_s=1.0)
    return LedgerEntry(job_id=job_id, placement_id="1:1.000000", placement=p, gpu_indices=(0,), compute_share_pct=50.0,
                       mem_mib=1024, workdir=str(workload_dir(state_dir, job_id, "1:1.000000")))


def _wait_for(path: Path, timeout_s: float = 10) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size:
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} not written within {timeout_s} s")


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode()
    return dict(item.split("=", 1) for item in raw.split("\0") if item)


@pytest.fixture
def runner(monkeypatch):
    for k in [k for k in os.environ if k.startswith("LC_") or k == "LANGUAGE"]:  # the caller's locale would pass too
        monkeypatch.delenv(k)
    for k, v in {**SECRETS, **PASSED}.items():
        monkeypatch.setenv(k, v)
    with reachable_dir() as d:  # a root agent's workloads run as nobody, who must enter the state dir
        r = Runner(d / "state", WorkloadPolicy.default())
        started: list[LedgerEntry] = []
        yield r, started
        for e in started:
            try:
                os.killpg(e.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in r._children.values():
            proc.wait(timeout=10)


def test_a_workload_gets_only_the_allow_listed_environment(runner):
    r, started = runner
    job_env = {"CUDA_VISIBLE_DEVICES": "0", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50", "ELASTICO_SIM_RATE_FILE": "/x/rate"}
    e = r.start(_entry(r.state_dir, "job-env"), ["sleep", "30"], job_env)  # found on the standard PATH
    started.append(e)
    child = json.loads(_wait_for(Path(e.workdir) / "child.json"))["pid"]
    policy = r.policy
    want = {**PASSED, **job_env, "PATH": WORKLOAD_PATH, "HOME": policy.home, "USER": policy.user, "LOGNAME": policy.user,
            "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PYTHONUNBUFFERED": "1", "ELASTICO_JOB_ID": "job-env",
            "ELASTICO_PROGRESS_FILE": str(Path(e.workdir) / "work" / "progress"),
            "ELASTICO_WORKLOAD_TAG": f"{r.state_dir}|job-env|1:1.000000"}
    for pid in (e.pid, child):  # the shim and the command alike
        got = _environ(pid)
        assert got == want, sorted(set(got.items()) ^ set(want.items()))
        assert not [v for v in SECRETS.values() if any(v in x for x in got.values())]


def test_variables_the_operator_names_are_passed_and_no_others(runner):
    """ELASTICO_WORKLOAD_PASS_ENV: a GPU node whose CUDA libraries are found through the agent's LD_LIBRARY_PATH and
    PATH passes them on; what it does not name stays out, and names the agent sets per job are refused."""
    from dataclasses import replace

    from elastico.errors import ConfigError
    from services.node_agent.settings import NodeAgentSettings

    r, started = runner
    r.policy = replace(r.policy, pass_env=("LD_PRELOAD", "PATH", "NOT_SET_ANYWHERE"))
    env = r.workload_env(_entry(r.state_dir, "job-pass"), {})
    assert (env["LD_PRELOAD"], env["PATH"]) == (SECRETS["LD_PRELOAD"], SECRETS["PATH"])
    assert "NOT_SET_ANYWHERE" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    base = {"ELASTICO_INSECURE": "1", "ELASTICO_REDIS_URL": "redis://h:1"}
    passed = NodeAgentSettings.from_env({**base, "ELASTICO_WORKLOAD_PASS_ENV": " PATH, LD_LIBRARY_PATH ,"})
    assert passed.workload_pass_env_names == ("PATH", "LD_LIBRARY_PATH")
    for bad in ("ELASTICO_REDIS_URL", "CUDA_VISIBLE_DEVICES", "A=B", "1X"):
        with pytest.raises(ConfigError, match="ELASTICO_WORKLOAD_PASS_ENV"):
            NodeAgentSettings.from_env({**base, "ELASTICO_WORKLOAD_PASS_ENV": bad})


def test_a_non_job_variable_is_refused(runner):
    r, _ = runner
    with pytest.raises(ValueError, match="LD_PRELOAD not a job variable"):
        r.start(_entry(r.state_dir, "job-bad"), ["true"], {"LD_PRELOAD": "/tmp/x.so"})


def _mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_ledger_launch_record_and_workload_log_are_the_agents_only(runner):
    r, started = runner
    ledger = LedgerFile(r.state_dir / "ledger.json")
    r.state_dir.mkdir(parents=True, exist_ok=True)
    ledger.path.write_text("{}")
    ledger.path.chmod(0o644)  # written by an older agent
    ledger.save()
    assert _mode(ledger.path) == 0o600

    secret = r.start(_entry(r.state_dir, "job-a"), ["sh", "-c", "echo job-a-output"], {})
    started.append(secret)
    _wait_for(Path(secret.workdir) / "exit.json")
    assert Path(secret.log_path).read_text().endswith("job-a-output\n")  # written through the descriptor it was handed
    # another job (the same workload user) tries to read job-a's log, the ledger and job-a's launch record
    spy = r.start(_entry(r.state_dir, "job-b"), ["sh", "-c", f"cat {secret.log_path} {ledger.path} "
                                                             f"{Path(secret.workdir) / 'launch.json'}; echo rc=$?"], {})
    started.append(spy)
    _wait_for(Path(spy.workdir) / "exit.json")
    for path in (secret.log_path, spy.log_path, Path(secret.workdir) / "launch.json", ledger.path,
                 Path(secret.workdir) / "exit.json", Path(secret.workdir) / "child.json"):
        assert _mode(path) == 0o600, path
    if r.policy.drops_privileges:
        out = Path(spy.log_path).read_text()
        assert "job-a-output" not in out and "entries" not in out and out.count("Permission denied") == 3, out


def test_a_service_port_is_free_and_below_the_ephemeral_range():
    """Outgoing connections take ephemeral ports: one picked there could be gone before the service binds it."""
    import socket

    from services.node_agent.runner import free_loopback_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        port = free_loopback_port()
        assert 1024 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
