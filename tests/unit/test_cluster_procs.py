"""``devtools.cluster`` bookkeeping without a cluster: a recorded process is told from a later one that got its pid,
logs are the operator's only, ``down`` finds the workloads of a dead agent, ``up`` will not restart onto a taken port."""

from __future__ import annotations

import json
import os
import pwd
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

from devtools import cluster, processes
from tests.conftest import reachable_dir


def test_a_recorded_process_is_the_same_process_not_just_the_same_pid():
    me = {"pid": os.getpid(), "ident": processes.ident(os.getpid())}
    assert processes.running(me)
    pid, ticks = me["ident"].split("@")
    assert not processes.running({**me, "ident": f"{pid}@{int(ticks) - 1}"})  # the pid was reused by a later process
    assert processes.running({"pid": os.getpid()})  # a state file of an older version: the pid alone
    assert processes.running({"pid": os.getpid(), "ident": "1@5"})  # pid replaced by a tool that kept the old ident
    zombie = subprocess.Popen([sys.executable, "-c", ""])
    deadline = time.monotonic() + 10
    while processes.start_ticks(zombie.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        assert not processes.running({"pid": zombie.pid, "ident": ""})  # exited, not yet reaped: dead
    finally:
        zombie.wait()


def test_logs_are_created_and_tightened_to_the_operator_only(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTICO_RUN_DIR", str(tmp_path / "run"))
    logs = cluster._logs_dir(cluster.run_dir())
    old = logs / "allocator.log"
    old.write_text("from an older version\n")
    old.chmod(0o644)
    argv = [sys.executable, "-c", "import sys; print('hello'); sys.stdin.read()"]  # runs until its stdin (devnull) ends
    env = {**os.environ, "ELASTICO_X": "1"}  # recorded: every ELASTICO_* and what differs from this shell's
    procs = [cluster._start(n, argv, env, "", logs / f"{n}.log") for n in ("allocator", "node-1")]
    for p in procs:
        os.waitpid(p.pid, 0)
    assert procs[0].argv == argv and procs[0].env == {"ELASTICO_X": "1", "ELASTICO_RUN_DIR": os.environ["ELASTICO_RUN_DIR"]} and procs[0].ident.startswith(f"{procs[0].pid}@")
    assert stat.S_IMODE(logs.stat().st_mode) == 0o700
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in logs.iterdir()} == {"allocator.log": 0o600, "node-1.log": 0o600}
    assert old.read_text() == "from an older version\nhello\n"


def _sleeper(env: dict[str, str], **kw) -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"], env=env, start_new_session=True, **kw)


def test_down_stops_the_workloads_of_a_dead_agent_and_no_others(monkeypatch):
    """A node agent killed with -9 leaves its workloads running (they outlive agents by design): ``down`` finds them
    by their tag, whatever user they run as, and leaves alone those of another run's state dir."""
    as_nobody = {"user": pwd.getpwnam("nobody").pw_uid, "group": pwd.getpwnam("nobody").pw_gid} if os.getuid() == 0 else {}
    with reachable_dir() as d:
        run, mine, other = d / "run", d / "run" / "nodes" / "node-1", d / "elsewhere"
        monkeypatch.setenv("ELASTICO_RUN_DIR", str(run))
        mine.mkdir(parents=True)
        dead = subprocess.Popen([sys.executable, "-c", ""])
        dead.wait()
        state = {"redis_url": "", "procs": [{"name": "node-1", "pid": dead.pid, "address": "127.0.0.1:1", "log": "",
                                             "ident": f"{dead.pid}@1", "env": {"ELASTICO_STATE_DIR": str(mine)}}]}
        (run / "cluster.json").write_text(json.dumps(state))
        shim = _sleeper({"ELASTICO_WORKLOAD_TAG": f"{mine}|job-1|1:0"})
        workload = _sleeper({"ELASTICO_WORKLOAD_TAG": f"{mine}|job-2|1:0"}, **as_nobody)
        bystander = _sleeper({"ELASTICO_WORKLOAD_TAG": f"{other}|job-1|1:0"}, **as_nobody)
        try:
            time.sleep(0.2)  # exec'd: /proc/<pid>/environ is the sleeper's
            cluster.down(quiet=True, grace_s=2)
            assert shim.wait(timeout=5) == -signal.SIGTERM and workload.wait(timeout=5) == -signal.SIGTERM
            assert bystander.poll() is None
            assert not (run / "cluster.json").exists()
        finally:
            for p in (shim, workload, bystander):
                p.kill()
                p.wait()


def test_up_does_not_restart_onto_a_port_another_process_holds(monkeypatch, tmp_path):
    monkeypatch.setenv("ELASTICO_RUN_DIR", str(tmp_path))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        dead = {"name": "node-1", "pid": 1, "ident": "1@0", "address": f"127.0.0.1:{port}", "log": str(tmp_path / "n.log"),
                "argv": [sys.executable, "-c", "import time; time.sleep(60)"], "env": {}, "cwd": str(tmp_path)}
        with pytest.raises(RuntimeError, match=f"cannot restart node-1: its port {port} is taken"):
            cluster.restart({"procs": [dead], "client": None}, [dead], timeout_s=1)
    assert dead["pid"] == 1  # nothing started, nothing recorded
    with pytest.raises(RuntimeError, match="cannot restart node-1: the state file does not say how"):
        cluster.restart({"procs": [{**dead, "argv": []}]}, [{**dead, "argv": []}])


def test_bad_cluster_environment_and_arguments_are_usage_errors_not_tracebacks(monkeypatch, capsys):
    monkeypatch.setenv("ELASTICO_NODES", "abc")
    monkeypatch.setattr(cluster, "status", lambda: True)
    assert cluster.main(["status"]) == 0  # a bad ELASTICO_NODES matters to `up` only
    with pytest.raises(SystemExit) as exc:
        cluster.main(["up"])
    assert exc.value.code == 2 and "--nodes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cluster.main(["logs", "-n", "0"])
    assert exc.value.code == 2
    monkeypatch.setenv("ELASTICO_BASE_PORT", "abc")
    with pytest.raises(RuntimeError, match="ELASTICO_BASE_PORT"):
        cluster._ports(1)
