"""A demand step on real processes (the suite as `make up` runs it, simulated GPUs): a service's request rate
quadruples; its node agent's scrape carries the new rate, and the allocator grows the service's share within two
rounds, the training co-tenant relaunched smaller first, the service's process never restarted; after the
resize the measured mean latency keeps the SLO."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from devtools import cluster
from devtools.loadgen import LoadGenerator, ProfileArrivals
from devtools.service_metrics import scrape_metrics
from elastico.client import AllocatorClient, NodeAgentClient
from elastico.domain import InferenceWork, JobKind, JobSpec, JobState, Shape, TrainingWork, placement_id
from tests.e2e._suite import fast_suite, until

SCALE = 60.0  # policy seconds per wall second: a 60-s demand bin is one wall second
ROUND_S, SCRAPE_S = 0.5, 0.25  # wall seconds
MU_FULL = 20.0  # the service's full-GPU rate, requests per policy second; SLO = 10 / MU_FULL = 500 ms
SLO_MS = 10 * 1000 / MU_FULL
FORECAST_WINDOW_S = 900.0  # policy seconds (15 wall s): a burst before the step leaves the forecast soon


@pytest.fixture
def suite(open_tmp: Path, monkeypatch: pytest.MonkeyPatch):
    with fast_suite(open_tmp / "run", monkeypatch, 1, SCALE, {
            "ELASTICO_ROUND_INTERVAL_S": repr(ROUND_S), "ELASTICO_SIM_GPU_COUNT": "1", "ELASTICO_SCRAPE_INTERVAL_S": repr(SCRAPE_S),
            "ELASTICO_FORECAST_WINDOW_S": repr(FORECAST_WINDOW_S)}) as state:
        yield state


def test_a_demand_step_grows_the_share_within_two_rounds_without_restarting_the_service(suite):
    tls = cluster.client_tls(suite)
    addr = next(p["address"] for p in suite["procs"] if p["name"] == "allocator")
    agent = NodeAgentClient(next(p["address"] for p in suite["procs"] if p["name"].startswith("node-")), tls=tls)
    api = AllocatorClient(addr, tls=tls)
    shapes = tuple(Shape(num_gpus=1, compute_share_pct=float(s), mem_mib=2048, throughput=MU_FULL * s / 100)
                   for s in range(5, 101, 5))
    svc = api.submit(JobSpec(name="svc", tenant="demo", kind=JobKind.INFERENCE, model_family="inference", shapes=shapes,
                             inference=InferenceWork(demand_rps=3.0, latency_slo_ms=SLO_MS)))
    train = api.submit(JobSpec(name="train", tenant="demo", kind=JobKind.TRAINING, model_family="ResNet-18", batch_size=64,
                               training=TrainingWork(total_steps=10**9)))

    def endpoint() -> str | None:
        ws = [w for w in agent.workloads([svc.job_id]) if w.status == "running" and w.endpoint]
        return ws[0].endpoint if ws else None

    rate = np.array([3.0])
    gen = LoadGenerator(ProfileArrivals(rate, seed=1), endpoint, SCALE, name="svc").start()
    try:
        until(lambda: api.get(svc.job_id).state is JobState.RUNNING and api.get(train.job_id).state is JobState.RUNNING, 30)
        time.sleep(2.0)  # measured windows replace the declared rate

        # settled at the low rate. A load generator starved of CPU (a busy machine) posts its backlog at once: the
        # service grows for that burst, the trainer gives way, and both stay so until the burst leaves the forecast
        # window and the policy's shrink hold (1,800 policy s) has passed -- wait for that instead of failing
        def settled():
            s, t = api.get(svc.job_id), api.get(train.job_id)
            ok = s.placement is not None and t.placement is not None and s.placement.slices[0].compute_share_pct < 70.0
            return ok and (s, t)

        before, tjob = until(settled, 45)
        share0, pid0 = before.placement.slices[0].compute_share_pct, placement_id(before.placement)
        proc0 = next(w.pid for w in agent.workloads([svc.job_id]))
        train0, restarts0 = tjob.placement.slices[0].compute_share_pct, tjob.restarts
        assert share0 + train0 <= 100.0

        rate[0] = 12.0  # the step: 3 -> 12 requests per policy second (load 0.15 -> 0.6 of a GPU)
        t_step = time.monotonic()
        # a forecast bin (60 policy s = 1 wall s) holds only the new rate at most one bin plus two scrape periods
        # after the step (a bin's rate is the mean of its windows); two rounds after that the share must have grown
        # to the new load + SLO margin (0.6 + 0.1 of a GPU)
        seen = []

        def grew():
            j = api.get(svc.job_id)
            seen.append((round(time.monotonic() - t_step, 2), j.placement.slices[0].compute_share_pct, j.message[:60]))
            return j.placement.slices[0].compute_share_pct >= 70.0 and j

        try:
            grown = until(grew, 10)
        except AssertionError:
            raise AssertionError(f"share never reached 70 %: {sorted(set(seen[::5]))}") from None
        took = time.monotonic() - t_step
        # 1 s: reconcile, report poll and this test's own polling (3.005 s against a 0.5-s grace once, on a loaded
        # machine)
        assert took <= 60.0 / SCALE + 2 * SCRAPE_S + 2 * ROUND_S + 1.0, took
        share1 = grown.placement.slices[0].compute_share_pct
        assert placement_id(grown.placement) == pid0  # in place
        assert next(w.pid for w in agent.workloads([svc.job_id])) == proc0  # the same serving process
        t = api.get(train.job_id)  # the co-tenant gave way first: relaunched smaller, or preempted and waiting
        assert t.state is JobState.PENDING or share1 + t.placement.slices[0].compute_share_pct <= 100.0
        if share1 + train0 > 100.0:  # its share before the step no longer fits: it was relaunched or preempted
            assert t.restarts > restarts0 or t.state is JobState.PENDING

        # the backlog queued while the share was still the old one drains at the new capacity (bounded time), and its
        # last requests complete within a window; from then on the mean latency (model time) keeps the SLO -- the
        # policy's criterion is the M/M/1 stationary mean. It is taken over six 60-s bins: one bin's mean is too noisy
        # near saturation (an M/M/1 queue at the 80 % share usually granted exceeds the SLO in one of six bins in
        # about 2 % of runs, at 75 % in a third of them; the six-bin mean at 75 % in 0.5 %)
        until(lambda: scrape_metrics(endpoint(), svc.job_id).waiting <= 5, 10)
        time.sleep(1.0)
        prev = first = scrape_metrics(endpoint(), svc.job_id)
        means = []
        for _ in range(6):
            time.sleep(1.0)
            cur = scrape_metrics(endpoint(), svc.job_id)
            n = cur.latency_count - prev.latency_count
            assert n > 100  # the load really flows
            means.append(1000 * (cur.latency_sum_s - prev.latency_sum_s) / n)
            prev = cur
        total_ms = 1000 * (prev.latency_sum_s - first.latency_sum_s) / (prev.latency_count - first.latency_count)
        assert total_ms <= SLO_MS, (total_ms, means, share1)
    finally:
        gen.stop()
        api.close()
        agent.close()
