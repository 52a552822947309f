"""The store fence on real processes (services/node_agent/liveness.py).

* A node agent alive but cut off from Redis while the allocator is not (its Redis user switched off): the agent
  stops keeping its workloads alive, their supervisors stop them, and only then does the allocator, past the
  node-loss timeout, place the job on the other node -- the job never runs on both.
* Redis itself stopped (SIGSTOP) for longer than the fence: every allocator reports the store unreachable, so the
  agents keep their workloads running, and once Redis is back the job still runs where it ran, never requeued.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import redis

from elastico.domain import JobState
from elastico.redis_acl import node_user
from tests.e2e._suite import fast_suite, running_training_job, until

FENCE_S, STOP_GRACE_S = 6.0, 2.0
# the agent stops touching its liveness file within heartbeat 0.5 + 1 s of its last heartbeat and its workloads are
# gone about FENCE_S + 1 + STOP_GRACE_S later, well before the node counts as lost (stale 2 + grace 12 s); a store
# outage shows in the allocator's health within the lease's 1.5 s, well inside the fence
TIMERS = {"ELASTICO_NODE_STALE_S": "2", "ELASTICO_NODE_GRACE_S": "12", "ELASTICO_FENCE_S": repr(FENCE_S),
          "ELASTICO_STOP_GRACE_S": repr(STOP_GRACE_S), "ELASTICO_LEASE_TTL_S": "1.5", "ELASTICO_SIM_GPU_COUNT": "1"}


@pytest.fixture
def suite(open_tmp: Path, monkeypatch: pytest.MonkeyPatch):
    with fast_suite(open_tmp / "run", monkeypatch, 2, 1.0, TIMERS) as state:
        yield state


def _admin(suite) -> redis.Redis:
    users = json.loads(Path(suite["redis_users_file"]).read_text())
    return redis.Redis.from_url(users["admin"])


def test_an_agent_cut_off_from_redis_stops_its_workload_before_the_job_runs_elsewhere(suite):
    api, agents, job, w, child = running_training_job(suite)
    home = job.placement.slices[0].node_id
    other = next(n for n in agents if n != home)
    admin = _admin(suite)
    user = node_user(home)
    admin.execute_command("ACL", "SETUSER", user, "off")  # the agent's connections fail; the allocator's do not
    admin.execute_command("CLIENT", "KILL", "USER", user)
    cut = time.monotonic()
    try:
        seen_elsewhere = until(lambda: [x for x in agents[other].workloads([job.job_id]) if x.status in ("starting", "running")],
                               40, every_s=0.02)
        assert not Path(f"/proc/{child}").exists(), "the job started on the other node while its old run still lived"
        assert seen_elsewhere[0].placement_id != w.placement_id
        assert time.monotonic() - cut > FENCE_S  # it waited for the fence, as the node-loss timeout requires
    finally:
        admin.execute_command("ACL", "SETUSER", user, "on")
    log = Path(next(p["log"] for p in suite["procs"] if p["name"] == home)).read_text()
    assert "cut off from the store while an allocator may see it" in log
    moved = until(lambda: (j := api.get(job.job_id)).state is JobState.RUNNING and j, 15)
    assert moved.placement.slices[0].node_id == other
    # back, the agent reports its run ended by the fence (or has already forgotten it: the job left its node)
    until(lambda: not [x for x in agents[home].workloads([job.job_id]) if x.status in ("starting", "running")], 15)


def test_a_redis_outage_longer_than_the_fence_stops_no_workload_and_requeues_nothing(suite):
    api, agents, job, w, child = running_training_job(suite)
    home = job.placement.slices[0].node_id
    redis_pid = next(p["pid"] for p in suite["procs"] if p["name"] == "redis")
    os.kill(redis_pid, signal.SIGSTOP)
    try:
        end = time.monotonic() + FENCE_S + STOP_GRACE_S + 4.0
        while time.monotonic() < end:
            assert Path(f"/proc/{child}").exists(), "a store outage stopped a workload"
            time.sleep(0.2)
    finally:
        os.kill(redis_pid, signal.SIGCONT)
    log = Path(next(p["log"] for p in suite["procs"] if p["name"] == home)).read_text()
    assert "for every allocator too" in log
    time.sleep(3.0)  # heartbeats land again; a round runs
    after = api.get(job.job_id)
    assert after.state is JobState.RUNNING and after.placement == job.placement and after.restarts == job.restarts
    assert Path(f"/proc/{child}").exists()
    assert [x.status for x in agents[home].workloads([job.job_id]) if x.placement_id == w.placement_id] == ["running"]
