"""Workloads never run as root unless the operator says so (docs/security.md "Workloads").

A real agent process, real workloads, a real redis-server. The workloads here are ``sh`` command lines (not
Python), so the uid drop is tested even where ``nobody`` cannot run this interpreter; tests that switch
users need root and are skipped otherwise.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from elastico.domain import JobState, StateReason
from elastico.errors import ConfigError
from services.node_agent.runner import find_tagged
from services.node_agent.settings import NodeAgentSettings
from tests.conftest import reachable_dir
from tests.integration.test_node_agent_process import (
    NODE,
    REPO,
    ROOT_WORKLOADS,
    eventually,
    place,
    registered,
    run_agent,
    workloads,
)

pytestmark = pytest.mark.slow
as_root = pytest.mark.skipif(os.getuid() != 0, reason="switching to another user needs root")
NOBODY = pwd.getpwnam("nobody")

# what the workload sees of itself, written next to its progress file (its own directory)
REPORT = r"""
{ id -u; id -g; id -G; echo "$HOME $USER $LOGNAME"; umask; grep NoNewPrivs /proc/self/status;
  if { echo x >> ../launch.json; } 2>/dev/null; then echo launch-writable; else echo launch-protected; fi; cat /proc/self/limits
} > "$ELASTICO_PROGRESS_FILE.report" 2>&1
echo 1 > "$ELASTICO_PROGRESS_FILE"
"""
LOOP = 'while :; do echo "$$" > "$ELASTICO_PROGRESS_FILE"; sleep 0.2; done'


def sh(script: str) -> str:
    return f"sh -c {shlex.quote(script)}"


def settings(state_dir: Path, **env: str) -> NodeAgentSettings:
    return NodeAgentSettings.from_env({"ELASTICO_INSECURE": "1", "ELASTICO_REDIS_URL": "redis://h:1",
                                       "ELASTICO_STATE_DIR": str(state_dir), **env})


def limit(report: str, name: str) -> tuple[str, str]:
    """(soft, hard) of one /proc/<pid>/limits row, e.g. ``limit(text, "Max open files")``."""
    row = next(line for line in report.splitlines() if line.startswith(name))
    soft, hard = row[len(name):].split()[:2]
    return soft, hard


@as_root
async def test_workloads_run_as_nobody_with_limits_and_are_readopted(redis_server, tmp_path):
    limits = {"ELASTICO_WORKLOAD_RLIMIT_NOFILE": "1024", "ELASTICO_WORKLOAD_RLIMIT_NPROC": "512",
              "ELASTICO_WORKLOAD_RLIMIT_AS_MIB": "4096"}
    log_path = tmp_path / "agent.log"
    with reachable_dir() as root:
        state_dir = root / "state"
        async with run_agent(redis_server.url, state_dir, log_path, **limits) as (a, store):
            epoch = await registered(store)
            report_job = await place(store, epoch, 0, 50.0, 1024, "ResNet-18", 16, command=sh(REPORT))
            loop_job = await place(store, epoch, 1, 50.0, 1024, "ResNet-18", 16, command=sh(LOOP))

            async def states():
                w = await workloads(store)
                ok = w.get(report_job) and w[report_job].status == "succeeded" and w.get(loop_job) and \
                    w[loop_job].status == "running" and w[loop_job].progress_steps > 0
                return w if ok else None

            w = await eventually(states)
            work = Path(w[report_job].log_path).parent / "work"
            lines = (work / "progress.report").read_text().splitlines()
            assert lines[:3] == [str(NOBODY.pw_uid), str(NOBODY.pw_gid), str(NOBODY.pw_gid)]  # no other groups
            assert lines[3] == f"{NOBODY.pw_dir} nobody nobody" and lines[4] == "0077"
            assert lines[5].split() == ["NoNewPrivs:", "1"]
            assert lines[6] == "launch-protected"  # its launch record and exit status stay the agent's
            report = "\n".join(lines)
            assert limit(report, "Max open files") == ("1024", "1024")
            assert limit(report, "Max processes") == ("512", "512")
            assert limit(report, "Max core file size") == ("0", "0")  # core dumps off by default
            assert limit(report, "Max address space") == (str(4096 << 20),) * 2
            assert (work.stat().st_uid, oct(work.stat().st_mode & 0o777)) == (NOBODY.pw_uid, "0o700")
            assert os.stat(work.parent / "exit.json").st_uid == 0 and os.stat(work.parent / "launch.json").st_uid == 0
            assert (w[report_job].reason, w[report_job].exit_code) == (StateReason.COMPLETED, 0)
            started = [json.loads(line) for line in log_path.read_text().splitlines() if "workloads run as" in line]
            assert started and (started[0]["uid"], started[0]["gid"]) == (NOBODY.pw_uid, NOBODY.pw_gid)

            # the shim keeps the agent's uid, so a restarted agent re-adopts the workload
            shim = w[loop_job].pid
            child = int(json.loads((Path(w[loop_job].log_path).parent / "child.json").read_text())["pid"])
            assert os.stat(f"/proc/{shim}").st_uid == 0 and os.stat(f"/proc/{child}").st_uid == NOBODY.pw_uid
            a.kill9()
            a.start()

            async def readopted():
                w = await workloads(store)
                tagged = find_tagged(str(a.state_dir.resolve()))
                return w[loop_job].status == "running" and w[loop_job].pid == shim and list(tagged.values()) == [shim]

            await eventually(readopted)
            await store.release_job(epoch, await store.get_job(loop_job), JobState.PENDING, StateReason.PREEMPTED, "test")

            async def stopped():
                return loop_job not in await workloads(store) and not find_tagged(str(a.state_dir.resolve()))

            await eventually(stopped)


async def test_commands_refused_when_disabled_even_for_root_workloads(redis_server, tmp_path):
    marker = tmp_path / "ran"
    log_path = tmp_path / "agent.log"
    with reachable_dir() as root:
        async with run_agent(redis_server.url, root / "state", log_path, ELASTICO_ALLOW_COMMANDS="0",
                             **(ROOT_WORKLOADS if os.getuid() == 0 else {})) as (a, store):
            epoch = await registered(store)
            cmd = await place(store, epoch, 0, 50.0, 1024, "ResNet-18", 16, command=sh(f"touch {marker}"))
            synthetic = await place(store, epoch, 1, 50.0, 1024, "ResNet-18", 16, total_steps=5)

            async def ended():
                w = await workloads(store)
                return w if len(w) == 2 and all(x.status in ("succeeded", "failed") for x in w.values()) else None

            w = await eventually(ended)
            assert (w[cmd].status, w[cmd].reason, w[cmd].exit_code) == ("failed", StateReason.OWN_FAILURE, None)
            assert w[cmd].message.startswith("cannot start") and "ELASTICO_ALLOW_COMMANDS=0" in w[cmd].message
            assert w[synthetic].status == "succeeded"  # jobs without a command still run
            await asyncio.sleep(1.0)  # still desired: never started later either
            assert not marker.exists() and not find_tagged(str(a.state_dir.resolve()))
            assert (await workloads(store))[cmd].started_at_s == w[cmd].started_at_s
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    if os.getuid() == 0:
        assert any(x["level"] == "warning" and "WORKLOADS RUN AS ROOT" in x["event"] for x in lines)
    assert any(x["event"] == "workloads run as" and x["commands_allowed"] is False for x in lines)


# --- settings -------------------------------------------------------------------------------------------
@as_root
def test_root_agent_defaults_to_nobody_and_root_needs_an_explicit_opt_in(tmp_path):
    with reachable_dir() as root:
        p = settings(root / "state").workload_policy
        assert (p.uid, p.gid, p.user, p.home) == (NOBODY.pw_uid, NOBODY.pw_gid, "nobody", NOBODY.pw_dir)
        assert dict(p.rlimits) == {"nofile": 65536, "core": 0} and p.allow_commands and p.drops_privileges
        for user in ("root", "0"):
            with pytest.raises(ConfigError, match="ELASTICO_ALLOW_ROOT_WORKLOADS=1"):
                settings(root / "state", ELASTICO_WORKLOAD_USER=user)
            assert settings(root / "state", ELASTICO_WORKLOAD_USER=user, ELASTICO_ALLOW_ROOT_WORKLOADS="1").workload_policy.uid == 0
        numeric = settings(root / "state", ELASTICO_WORKLOAD_USER=str(NOBODY.pw_uid), ELASTICO_WORKLOAD_GROUP="12345").workload_policy
        assert (numeric.uid, numeric.gid, numeric.user) == (NOBODY.pw_uid, 12345, "nobody")
    private = tmp_path / "private"  # under pytest's 0700 base directory: nobody cannot enter it
    with pytest.raises(ConfigError, match="ELASTICO_STATE_DIR=.*cannot enter"):
        settings(private / "state")


@pytest.mark.parametrize(("env", "var"), [
    ({"ELASTICO_WORKLOAD_USER": "no-such-user-x"}, "ELASTICO_WORKLOAD_USER"),
    ({"ELASTICO_WORKLOAD_GROUP": "no-such-group-x"}, "ELASTICO_WORKLOAD_GROUP"),
    ({"ELASTICO_WORKLOAD_RLIMIT_NOFILE": "-1"}, "ELASTICO_WORKLOAD_RLIMIT_NOFILE"),
    ({"ELASTICO_WORKLOAD_RLIMIT_AS_MIB": "-5"}, "ELASTICO_WORKLOAD_RLIMIT_AS_MIB"),
    ({"ELASTICO_ALLOW_COMMANDS": "maybe"}, "ELASTICO_ALLOW_COMMANDS"),
], ids=["unknown-user", "unknown-group", "nofile", "as", "allow-commands"])
def test_bad_workload_settings_name_the_variable(env, var):
    with reachable_dir() as root, pytest.raises(ConfigError, match=var):
        settings(root / "state", **env)


def test_agent_refuses_to_start_with_root_workloads(redis_server):
    with reachable_dir() as root:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICO_")}
        env.update({"ELASTICO_INSECURE": "1", "ELASTICO_REDIS_URL": redis_server.url, "ELASTICO_PORT": "0",
                    "ELASTICO_STATE_DIR": str(root / "state"), "ELASTICO_GPU_BACKEND": "simulated", "ELASTICO_NODE_ID": NODE,
                    "ELASTICO_WORKLOAD_USER": "root" if os.getuid() == 0 else "no-such-user-x"})
        res = subprocess.run([sys.executable, "-m", "services.node_agent"], env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert "configuration error" in res.stderr and "ELASTICO_WORKLOAD_USER" in res.stderr
    assert "Traceback" not in res.stderr


@as_root
def test_a_private_checkout_keeps_commands_unprivileged(tmp_path, open_tmp, monkeypatch):
    """Where the workload user cannot read the checkout, only the agent's own synthetic workload runs as the agent;
    a local cluster in a private run dir keeps its node state where the workload user can enter."""
    from devtools import cluster
    from services.node_agent import settings as agent_settings

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    nobody = pwd.getpwnam("nobody")
    monkeypatch.setattr(agent_settings, "REPO_ROOT", private)
    assert agent_settings.workload_python(nobody.pw_uid, nobody.pw_gid) == ""
    policy = settings(open_tmp / "state").workload_policy
    assert policy.uid == nobody.pw_uid and policy.drops_privileges and not policy.synthetic_drops
    (private / "run").mkdir()
    nodes = cluster._nodes_dir(private / "run")
    assert not str(nodes).startswith(str(private)) and nodes.stat().st_mode & 0o005 == 0o005
    nodes.rmdir()
