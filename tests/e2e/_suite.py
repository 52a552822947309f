"""The local suite as `make up` starts it, with fast timers, for the end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from devtools import cluster
from elastico.client import AllocatorClient, NodeAgentClient
from elastico.domain import JobKind, JobSpec, JobState, TrainingWork
from elastico.redis_embedded import free_port


@contextlib.contextmanager
def fast_suite(run_dir: Path, monkeypatch: pytest.MonkeyPatch, nodes: int, scale: float,
               env: Mapping[str, str]) -> Iterator[dict]:
    """``nodes`` node agents on simulated GPUs at ``scale`` policy seconds per wall second, the environment cleared
    of ``ELASTICO_*`` and set to fast timers plus ``env``; stopped afterwards whatever happens."""
    for k in [k for k in os.environ if k.startswith("ELASTICO_")]:
        monkeypatch.delenv(k)
    base = {"ELASTICO_RUN_DIR": str(run_dir), "ELASTICO_BASE_PORT": str(free_port()), "ELASTICO_ESTIMATOR": "rule",
            "ELASTICO_TIME_SCALE": repr(scale), "ELASTICO_SIM_TIME_SCALE": repr(scale), "ELASTICO_ROUND_INTERVAL_S": "0.2",
            "ELASTICO_REPORT_POLL_S": "0.1", "ELASTICO_RECONCILE_INTERVAL_S": "0.2", "ELASTICO_HEARTBEAT_INTERVAL_S": "0.5",
            "ELASTICO_STOP_GRACE_S": "2", "ELASTICO_OBSERVATION_INTERVAL_S": "1000000", "ELASTICO_LOG_FORMAT": "json"}
    for k, v in {**base, **env}.items():
        monkeypatch.setenv(k, v)
    state = cluster.up(nodes)
    try:
        yield state
    finally:
        cluster.down(quiet=True)


def until(what, timeout_s: float, every_s: float = 0.05):
    """Poll ``what()`` until it returns something truthy (returned), or fail after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s} s")


def children(pid: int) -> list[int]:
    """Child process ids of ``pid`` (a workload's supervisor: its workload), [] once it is gone."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def running_training_job(suite: dict):
    """A long training job submitted to ``suite`` (two node agents) and RUNNING: (allocator client, node agent
    clients by name, the job, its workload on its node, the workload process's pid)."""
    tls = cluster.client_tls(suite)
    procs = {p["name"]: p for p in suite["procs"]}
    api = AllocatorClient(procs["allocator"]["address"], tls=tls)
    agents = {n: NodeAgentClient(procs[n]["address"], tls=tls) for n in ("node-1", "node-2")}
    job = api.submit(JobSpec(name="train", tenant="demo", kind=JobKind.TRAINING, model_family="ResNet-18", batch_size=64,
                             training=TrainingWork(total_steps=10**9)))
    first = until(lambda: (j := api.get(job.job_id)).state is JobState.RUNNING and j, 30)
    home = first.placement.slices[0].node_id
    [w] = [w for w in agents[home].workloads([job.job_id]) if w.status == "running"]
    [child] = until(lambda: children(w.pid), 5)
    return api, agents, first, w, child
