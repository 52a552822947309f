"""A node agent of the local suite killed with ``kill -9``: ``up`` restarts it with its recorded environment (it re-adopts
its workload from the ledger) and records the new pid; ``down`` leaves no process of the run behind, not even one
started by hand or a workload of a dead agent. Also the file modes a workload user must not get past."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import stat
import subprocess
from pathlib import Path

import pytest

from devtools import cluster, processes
from tests.e2e._suite import children, fast_suite, running_training_job, until

TAG = "ELASTICO_WORKLOAD_TAG"


@pytest.fixture
def suite(open_tmp: Path, monkeypatch: pytest.MonkeyPatch):
    with fast_suite(open_tmp / "run", monkeypatch, 2, 1.0, {"ELASTICO_SIM_GPU_COUNT": "1"}) as state:
        yield state


def _running(pid: int) -> bool:
    """Alive and not a zombie (the suite's processes are children of this test process until reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][:1] not in "ZX"
    except OSError:
        return False


def _of_run(run_dir: Path, state_dirs: list[str]) -> list[str]:
    """Every live process that belongs to this run: a workload tag naming one of its state dirs, a node agent of one
    of them, or the run dir on its command line (services, Redis, shims)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid() or not _running(int(d.name)):
            continue
        with contextlib.suppress(OSError):
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = (d / "environ").read_bytes().decode(errors="replace").split("\0")
            tag = next((e[len(TAG) + 1:] for e in env if e.startswith(f"{TAG}=")), "")
            sd = next((e.split("=", 1)[1] for e in env if e.startswith("ELASTICO_STATE_DIR=")), "")
            if tag.split("|")[0] in state_dirs or sd in state_dirs or str(run_dir) in cmd:
                out.append(f"{d.name}: {cmd[:120]}")
    return out


def _mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _quiet(fn, *args):
    """``fn(*args)`` and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        got = fn(*args)
    return got, out.getvalue()


def test_up_restarts_a_killed_agent_which_readopts_and_down_leaves_nothing(suite, open_tmp):
    run_dir = cluster.run_dir()
    api, agents, job, w, child = running_training_job(suite)
    home = job.placement.slices[0].node_id
    procs = {p["name"]: p for p in cluster.load_state()["procs"]}
    state_dirs = [p["env"]["ELASTICO_STATE_DIR"] for n, p in procs.items() if n.startswith("node-")]
    old_pid, log = procs[home]["pid"], Path(procs[home]["log"])

    # the workload user reads none of the run's logs, ledgers or workload logs
    assert _mode(run_dir / "logs") == 0o700
    assert {p.name: _mode(p) for p in (run_dir / "logs").iterdir()} == {f"{n}.log": 0o600 for n in procs if n != "redis"}
    home_dir = Path(procs[home]["env"]["ELASTICO_STATE_DIR"])
    assert _mode(home_dir / "ledger.json") == 0o600
    assert _mode(Path(w.log_path)) == 0o600 and _mode(Path(w.log_path).parent / "launch.json") == 0o600

    os.kill(old_pid, signal.SIGKILL)
    until(lambda: not _running(old_pid), 10)
    _, table = _quiet(cluster.ps)
    assert next(line for line in table.splitlines() if line.startswith(home)).split()[3] == "DEAD", table
    assert _quiet(cluster.status)[0] is False

    mark = log.stat().st_size
    state, out = _quiet(cluster.up, 2)
    new = {p["name"]: p for p in cluster.load_state()["procs"]}[home]
    assert f"restarted {home}: pid {old_pid} was not running; now pid {new['pid']}" in out, out
    assert new["pid"] != old_pid and _running(new["pid"]) and new["ident"] == processes.ident(new["pid"])
    assert [p["pid"] for p in state["procs"] if p["name"] == home] == [new["pid"]]
    assert processes.running(new) and _quiet(cluster.status)[0] is True
    # the same workload, re-adopted from the ledger: same supervisor and process, reported running, no second run
    assert "re-adopted running workloads from the ledger" in log.read_text()[mark:]
    readopted = until(lambda: [x for x in agents[home].workloads([job.job_id]) if x.status == "running"], 10)
    assert [(x.pid, x.placement_id) for x in readopted] == [(w.pid, w.placement_id)]
    assert _running(w.pid) and children(w.pid) == [child]
    assert not [x for n, a in agents.items() if n != home for x in a.workloads([job.job_id]) if x.status == "running"]

    # the probe's case: the agent killed again and restarted by hand, unrecorded; up refuses to start a second one,
    # down stops it and its workload all the same
    os.kill(new["pid"], signal.SIGKILL)
    until(lambda: not _running(new["pid"]), 10)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ELASTICO_")}, **new["env"]}
    with open(os.devnull, "wb") as devnull:
        by_hand = subprocess.Popen(new["argv"], env=env, cwd=new["cwd"], stdout=devnull, stderr=subprocess.STDOUT)
    try:
        cluster.wait_serving({"procs": [{**new, "pid": by_hand.pid, "ident": processes.ident(by_hand.pid)}],
                              "client": state["client"]}, 30)
        with pytest.raises(RuntimeError, match=f"cannot restart {home}: its port .* is taken"):
            _quiet(cluster.up, 2)
        assert _running(w.pid) and _running(child)

        recorded = [p["pid"] for p in cluster.load_state()["procs"]]
        _, said = _quiet(cluster.down)
        assert "1 node agent(s) not recorded" in said, said
        by_hand.wait(timeout=5)
    finally:
        by_hand.kill()
        by_hand.wait()
    assert not [pid for pid in recorded if _running(pid)]
    assert not _running(w.pid) and not _running(child)
    assert not _of_run(run_dir, state_dirs)
    assert cluster.load_state() is None
