"""A node agent frozen (SIGSTOP) past the allocator's node-loss timeout, on real processes: its workload's
supervisor stops the workload (the fence) before the allocator places the job on the other node, so the job
never runs on both; resumed, the agent reports the old run ended and the job runs on the other node only."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from elastico.domain import JobState
from tests.e2e._suite import fast_suite, running_training_job, until

# heartbeat 0.5 s + 1 + fence 4 s + stop grace 2 s (the suite's) < node stale 5 s + grace 3 s: the workload is gone
# before the job moves; a healthy agent must miss ten heartbeats to be taken for lost on a loaded machine
TIMERS = {"ELASTICO_NODE_STALE_S": "5", "ELASTICO_NODE_GRACE_S": "3", "ELASTICO_FENCE_S": "4", "ELASTICO_SIM_GPU_COUNT": "1"}


@pytest.fixture
def suite(open_tmp: Path, monkeypatch: pytest.MonkeyPatch):
    with fast_suite(open_tmp / "run", monkeypatch, 2, 1.0, TIMERS) as state:
        yield state


def test_a_frozen_agents_workload_is_stopped_before_its_job_runs_elsewhere(suite):
    procs = {p["name"]: p for p in suite["procs"]}
    api, agents, job, w, child = running_training_job(suite)
    home = job.placement.slices[0].node_id
    other = next(n for n in agents if n != home)

    os.kill(procs[home]["pid"], signal.SIGSTOP)
    try:
        seen_elsewhere = until(lambda: [x for x in agents[other].workloads([job.job_id]) if x.status in ("starting", "running")],
                                30, every_s=0.02)
        assert not Path(f"/proc/{child}").exists(), "the job started on the other node while its old run still lived"
        assert seen_elsewhere[0].placement_id != w.placement_id
    finally:
        os.kill(procs[home]["pid"], signal.SIGCONT)

    def ended_at_home():
        return [x for x in agents[home].workloads([job.job_id]) if x.placement_id == w.placement_id and x.status == "killed"]

    # back, the agent finds its workload stopped by the fence (or has already forgotten it: the job left its node)
    gone = until(lambda: ended_at_home() or not agents[home].workloads([job.job_id]), 15)
    if isinstance(gone, list):
        assert "no sign of life" in gone[0].message
    moved = until(lambda: (j := api.get(job.job_id)).state is JobState.RUNNING and j, 15)
    assert moved.placement.slices[0].node_id == other and moved.restarts >= 1, _story(moved, agents)
    assert not [x for x in agents[home].workloads([job.job_id]) if x.status in ("starting", "running")]


def _story(job, agents) -> str:
    """The job and every node's workloads of it, for a failure message."""
    runs = {n: [(w.placement_id, w.status, w.message) for w in a.workloads([job.job_id])] for n, a in agents.items()}
    return (f"job on {job.placement.slices[0].node_id}, restarts {job.restarts}, reason {job.reason}: {job.message!r}; "
            f"workloads by node {runs}")
