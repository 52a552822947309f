"""The suite as separate processes (embedded Redis, pricer, predictor, allocator(s), 2 node agents on simulated
GPUs) replaying a 50-job slice of the Philly trace through the gRPC API, in accelerated time, with
invariants checked on every sample (``devtools.replay``): no GPU above 100 % share or its memory, no job
running twice, every retried submission returning the same job, no job lost. Faults: ``kill -9`` of the
allocator mid-run (restarted), and the leader paused with SIGSTOP past its lease while a standby takes over.
"""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from pathlib import Path

import pytest

from devtools import cluster
from devtools.replay import Replay, trace_jobs
from elastico.redis_embedded import free_port
from elastico.v1 import allocator_pb2, allocator_pb2_grpc
from elastico.v1 import types_pb2 as tpb
from services.allocator.settings import AllocatorSettings
from tests.e2e._suite import fast_suite

SCALE = 2000.0  # trace seconds per wall second: the slice drains in ~10 s
WINDOW = (2653756.0, 2657677.0)  # the demo's slice (60 jobs over ~1.1 h), first 50 here


@pytest.fixture(scope="module")
def slice_jobs():
    from simulator.run import build_workload

    w = build_workload("data/traces/gavel_philly_vc_traces_seed0.csv", 8, window=WINDOW, max_jobs=50, estimator="rule")
    return trace_jobs(w, train_floor=AllocatorSettings().train_floor)


@pytest.fixture
def suite(open_tmp: Path, monkeypatch: pytest.MonkeyPatch):
    """A running cluster (as `make up` starts it) with fast timers; stopped afterwards whatever happens."""
    with fast_suite(open_tmp / "run", monkeypatch, 2, SCALE,
                    {"ELASTICO_LEASE_TTL_S": "2", "ELASTICO_SIM_GPU_COUNT": "4"}) as state:
        yield state


def _addr(state: dict, name: str) -> str:
    return next(p["address"] for p in state["procs"] if p["name"] == name)


def _agents(state: dict) -> list[str]:
    return [p["address"] for p in state["procs"] if p["name"].startswith("node-")]


def _check(obs, jobs) -> None:
    assert obs.violations == []
    assert len(obs.job_ids) == len(jobs) and len(set(obs.job_ids.values())) == len(jobs)
    assert {i: tpb.JobState.Name(s) for i, s in obs.terminal.items()} == {j.index: "JOB_STATE_SUCCEEDED" for j in jobs}, \
        obs.why_not_succeeded
    assert obs.samples and obs.max_share_seen > 0  # the checks did look at a loaded cluster


def test_trace_slice_runs_to_completion_through_the_api(suite, slice_jobs):
    obs = Replay(_addr(suite, "allocator"), _agents(suite), slice_jobs, SCALE, f"e2e-{uuid.uuid4().hex[:6]}",
                 out=lambda *_: None, tls=cluster.client_tls(suite)).run(timeout_s=60)
    _check(obs, slice_jobs)
    with cluster.client_tls(suite).channel(_addr(suite, "allocator")) as ch:
        cs = allocator_pb2_grpc.AllocatorStub(ch).GetClusterState(allocator_pb2.GetClusterStateRequest(), timeout=5)
    assert cs.leader_epoch >= 1 and cs.leader_id and len(cs.nodes) == 2


def test_allocator_killed_mid_run_is_restarted_and_nothing_is_lost_or_duplicated(suite, slice_jobs):
    pid = next(p["pid"] for p in suite["procs"] if p["name"] == "allocator")
    killed = []

    def fault(now: float) -> None:
        if not killed and now > 3.0:  # rounds run every 0.2 s and on every event: this lands mid-stream
            os.kill(pid, signal.SIGKILL)
            killed.append(now)
            cluster.spawn("allocator", "allocator")  # same port; a new replica id: it waits out the old lease

    obs = Replay(_addr(suite, "allocator"), _agents(suite), slice_jobs, SCALE, f"kill-{uuid.uuid4().hex[:6]}",
                 out=lambda *_: None, on_tick=fault, tls=cluster.client_tls(suite)).run(timeout_s=90)
    assert killed
    _check(obs, slice_jobs)
    log = (Path(os.environ["ELASTICO_RUN_DIR"]) / "logs" / "allocator.log").read_text()
    epochs = {m.group(1) for line in log.splitlines() if "leading: scheduling rounds start" in line
              for m in [re.search(r'"?epoch"?[=:] ?(\d+)', line)] if m}
    assert len(epochs) >= 2  # the restarted replica led under a new epoch


def test_paused_leader_is_fenced_and_the_standby_takes_over(suite, slice_jobs):
    standby = cluster.spawn("allocator", "allocator-2", port=free_port())
    leader_pid = next(p["pid"] for p in suite["procs"] if p["name"] == "allocator")
    paused = []

    def fault(now: float) -> None:
        if not paused and now > 2.0:
            os.kill(leader_pid, signal.SIGSTOP)
            paused.append(now)
        elif len(paused) == 1 and now > paused[0] + 5.0:  # 2.5 x the 2 s lease
            os.kill(leader_pid, signal.SIGCONT)
            paused.append(now)

    try:
        obs = Replay([_addr(suite, "allocator"), standby["address"]], _agents(suite), slice_jobs, SCALE,
                     f"pause-{uuid.uuid4().hex[:6]}", out=lambda *_: None, on_tick=fault, tls=cluster.client_tls(suite)).run(timeout_s=90)
    finally:
        os.kill(leader_pid, signal.SIGCONT)
    assert len(paused) == 2
    _check(obs, slice_jobs)
    logs = Path(os.environ["ELASTICO_RUN_DIR"]) / "logs"
    assert "leading: scheduling rounds start" in (logs / "allocator-2.log").read_text()
    old = (logs / "allocator.log").read_text()
    assert "lost leadership" in old or "round rejected" in old  # it woke up without the lease: no more writes
    time.sleep(0.5)
    with cluster.client_tls(suite).channel(standby["address"]) as ch:
        cs = allocator_pb2_grpc.AllocatorStub(ch).GetClusterState(allocator_pb2.GetClusterStateRequest(), timeout=5)
    assert cs.leader_id and cs.leader_id in (logs / "allocator-2.log").read_text()
