"""The allocator's round metrics: the predicted speeds come from the policy that decides (in its worker process
when there is one), the write counters from what the store accepted."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from elastico.domain import GpuSlice, Placement, Shape, TrainingWork, Workload, placement_id
from elastico.state.memory import MemoryStore
from services.allocator.decider import predicted_norm
from services.allocator.plan import build_view
from services.allocator.round_metrics import RoundMetrics, RoundReport
from services.allocator.rounds import Scheduler
from tests.conftest import make_job, make_spec
from tests.integration.test_allocator_rounds import heartbeat, leader, settings

READING = 0.35  # what the agent reports for each of two co-located jobs: slower than the rule predicts


def _hist(name: str) -> tuple[float, float]:
    return (REGISTRY.get_sample_value(f"{name}_sum") or 0.0, REGISTRY.get_sample_value(f"{name}_count") or 0.0)


def _delta(before: tuple[float, float], name: str) -> tuple[float, float]:
    after = _hist(name)
    return after[0] - before[0], after[1] - before[1]


async def _running_pair(store, epoch: int) -> list[str]:
    """Two training jobs sharing GPU 0 of n1, reported running at ``READING`` of their speed alone, each next to
    the other (a clean measurement of the pair the policy may learn from). Each books half the GPU and runs
    unlimited (its shape's 100 %), as ``plan.make_placement`` places training on a GPU without a service."""
    spec = make_spec(model_family="ResNet-18", batch_size=64, training=TrainingWork(total_steps=10**8))
    jobs = [(await store.create_job(make_job(spec=spec)))[0] for _ in range(2)]
    half = Shape(1, 100.0, 8192)
    placed = await store.commit_placements(epoch, [(j, Placement(j.job_id, 0, half, (GpuSlice("n1", 0, 50.0, 8192),)))
                                                   for j in jobs])
    ids = [j.job_id for j in placed]
    gen, _ = await store.get_desired("n1")
    await store.report_workloads("n1", gen, [
        Workload(j.job_id, (0,), 50.0, 8192, status="running", placement_id=placement_id(j.placement),
                 cotenants=tuple(i for i in ids if i != j.job_id), norm_throughput=READING) for j in placed])
    return ids


@pytest.mark.parametrize("worker", ["thread", "process"])
async def test_predicted_speeds_come_from_the_deciding_policys_learnt_matrix(worker):
    """ElastiCo learns the pair's observed speed into ITS matrix while deciding (in the worker process with
    decide_worker=process); the predicted-throughput metric must come from that matrix, not from the
    allocator's initial estimate (which predicts this pair far faster), in a round that decides and in one
    with nothing to decide alike."""
    store = MemoryStore()
    await heartbeat(store, "n1", gpus=2)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(decide_worker=worker, elastic_gpus=False), lease)
    try:
        pair = await _running_pair(store, epoch)
        waiting, _ = await store.create_job(make_job(spec=make_spec(model_family="ResNet-18", batch_size=64)))
        view, _ = build_view(await store.list_active_jobs(), await store.list_nodes(), sch.types, sch.resolve,
                             sch.clock(), 5.0)
        initial = [predicted_norm(sch.estimate.matrix, sch.kappa, view, r) for r in view.running]
        assert all(p is not None and p > READING + 0.1 for p in initial)  # what the allocator's own copy would say

        pred, err = _hist("elastico_allocator_predicted_norm_throughput"), _hist("elastico_allocator_norm_throughput_error")
        rep = await sch.round(epoch)  # the pair starts RUNNING; the policy decides on the waiting job (and learns)
        assert rep.started == 2 and rep.placed == [waiting.job_id]
        assert _delta(pred, "elastico_allocator_predicted_norm_throughput") == pytest.approx((2 * READING, 2))
        assert _delta(err, "elastico_allocator_norm_throughput_error") == pytest.approx((0.0, 2), abs=1e-9)

        pred = _hist("elastico_allocator_predicted_norm_throughput")
        rep = await sch.round(epoch)  # nothing pending: the policy's report alone, from the same (learnt) matrix
        assert rep.pending == 0 and all(j.placement is not None for j in [await store.get_job(i) for i in pair])
        assert _delta(pred, "elastico_allocator_predicted_norm_throughput") == pytest.approx((2 * READING, 2))
        if worker == "process":
            assert sch._decider.failures == 0  # decided in the worker, not in the thread fallback
    finally:
        await sch.close()


def test_write_counters_count_what_the_store_accepted():
    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    names = [("elastico_allocator_releases_total", {"reason": "completed"}),
             ("elastico_allocator_releases_total", {"reason": "preempted"}),
             ("elastico_allocator_releases_total", {"reason": "resized"}),
             ("elastico_allocator_placements_total", {}), ("elastico_allocator_commit_conflicts_total", {})]
    before = [value(n, **lb) for n, lb in names]
    RoundMetrics.writes(RoundReport(epoch=1, released={"completed": 2}, preempted=1, resized=3, placed_jobs=4))
    RoundMetrics.writes(RoundReport(epoch=1, conflict="job j-1 is at version 3, expected 2"))
    assert [value(n, **lb) - b for (n, lb), b in zip(names, before, strict=True)] == [2, 1, 3, 4, 1]
