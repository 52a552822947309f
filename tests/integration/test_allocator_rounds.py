"""Scheduling rounds against both Store backends, with node agents played by the test (their reports)."""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from dataclasses import replace

import grpc
import numpy as np
import pytest

from elastico.domain import JobState, Shape, StateReason, TrainingWork, Workload, placement_id
from elastico.errors import StaleEpoch, Unavailable
from elastico.rpc.server import ServiceBinding, create_server
from elastico.state.memory import MemoryStore
from elastico.v1 import allocator_pb2, predictor_pb2_grpc, pricer_pb2_grpc
from services.allocator import triggers
from services.allocator.clients import GrpcSolver, PredictorClient
from services.allocator.leader import LeaderLease
from services.allocator.plan import build_view
from services.allocator.rounds import STATUS_NAME, Scheduler
from services.allocator.servicer import AllocatorServicer
from services.allocator.settings import AllocatorSettings
from services.predictor.servicer import PredictorServicer
from services.predictor.settings import PredictorSettings
from services.pricer.servicer import PricerServicer
from services.pricer.settings import PricerSettings
from tests.conftest import make_job, make_node, make_spec


def settings(**kw) -> AllocatorSettings:
    # decide in a thread here (a worker process costs a spawn per scheduler); process mode has its own tests
    base = {"redis_url": "redis://unused:1", "estimator": "rule", "node_stale_s": 5.0, "node_grace_s": 1.0,
            "decide_worker": "thread"}
    return AllocatorSettings.from_env({}, insecure=True, **{**base, **kw})


async def heartbeat(store, *node_ids: str, gpus: int = 2, age_s: float = 0.0) -> None:
    for n in node_ids:
        await store.put_node(replace(make_node(n, gpus=gpus), last_heartbeat_s=time.time() - age_s))


async def agent_reports(store, node_id: str, status: str = "running", reason=None, progress: float = 0.0,
                        only: set[str] | None = None) -> list[str]:
    """Play the node agent: report every desired placement of ``node_id`` with ``status``."""
    gen, desired = await store.get_desired(node_id)
    _, current = await store.get_workloads(node_id)
    out = dict(current)
    for job_id, p in desired.items():
        if only is not None and job_id not in only:
            continue
        s = p.slices[0]
        out[job_id] = Workload(job_id, (s.gpu_index,), s.compute_share_pct, s.mem_mib, status=status, reason=reason,
                               progress_steps=progress, placement_id=placement_id(p))
    out = {j: w for j, w in out.items() if j in desired}  # acknowledged (no longer desired) outcomes are forgotten
    await store.report_workloads(node_id, gen, list(out.values()))
    return sorted(out)


async def leader(store, name: str, ttl_s: float = 30.0) -> tuple[LeaderLease, int]:
    lease = LeaderLease(store, name, ttl_s=ttl_s)
    epoch = await lease.try_acquire()
    assert epoch is not None
    return lease, epoch


async def test_jobs_are_placed_started_and_completed_from_agent_reports(store):
    await heartbeat(store, "n1", "n2")
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(), lease)
    jobs = [(await store.create_job(make_job(spec=make_spec(model_family="ResNet-18", batch_size=64))))[0] for _ in range(3)]
    rep = await sch.round(epoch)
    assert sorted(rep.placed) == sorted(j.job_id for j in jobs)
    assert {(await store.get_job(j.job_id)).state for j in jobs} == {JobState.PLACED}
    for n in ("n1", "n2"):
        await agent_reports(store, n, "running")
    rep = await sch.round(epoch)
    assert rep.started == 3 and {(await store.get_job(j.job_id)).state for j in jobs} == {JobState.RUNNING}
    for n in ("n1", "n2"):
        await agent_reports(store, n, "succeeded", StateReason.COMPLETED, progress=1000)
    rep = await sch.round(epoch)
    assert rep.released == {"completed": 3}
    assert {(await store.get_job(j.job_id)).state for j in jobs} == {JobState.SUCCEEDED}
    assert await store.list_active_jobs() == []
    assert all(g.allocated_share_pct == 0 and g.allocated_mem_mib == 0 for n in await store.list_nodes() for g in n.gpus)
    for n in ("n1", "n2"):
        assert (await store.get_desired(n))[1] == {}


async def test_the_round_loop_stops_when_a_wake_up_arrives_with_the_cancel(store):
    """A wake-up (an arrival) and the cancel of ``Scheduler.close()`` land together: the loop ends on the one cancel
    (on Python 3.11 an asyncio.wait_for around the wake-up dropped it, and the loop outlived close)."""
    sch = Scheduler(store, settings(round_interval_s=30.0, round_min_gap_s=0.0), LeaderLease(store, "a", ttl_s=30))
    loop = asyncio.create_task(sch.run())
    await asyncio.sleep(0.05)  # not leading: the loop waits for the next wake-up
    sch.wake("arrival")
    loop.cancel()
    done, _ = await asyncio.wait([loop], timeout=2.0)
    assert loop in done and loop.cancelled()


async def test_cotenant_fault_requeues_with_progress_and_is_placed_again(store):
    await heartbeat(store, "n1", gpus=1)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(), lease)
    job, _ = await store.create_job(make_job())
    await sch.round(epoch)
    first = (await store.get_job(job.job_id)).placement
    await agent_reports(store, "n1", "failed", StateReason.COTENANT_FAULT, progress=420)
    rep = await sch.round(epoch)
    again = await store.get_job(job.job_id)
    assert rep.released == {"cotenant_fault": 1} and rep.placed == [job.job_id]
    assert again.state is JobState.PLACED and again.progress_steps == 420 and again.restarts == 1
    assert placement_id(again.placement) != placement_id(first)  # a new incarnation: the agent starts it afresh


async def test_elastic_gpus_start_a_job_grown_by_the_policy_on_its_own_gang(store):
    """With GPU-count shapes on, the policy starts a job on more GPUs than it asked for when GPUs idle; a
    live job runs only at gang sizes it declares, so it starts on its own gang -- not left pending."""
    await heartbeat(store, "n1", gpus=4)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(elastic_gpus=True), lease)
    spec = make_spec(model_family="ResNet-50", batch_size=64, training=TrainingWork(total_steps=10**8))
    job, _ = await store.create_job(make_job(spec=spec))
    rep = await sch.round(epoch)
    got = await store.get_job(job.job_id)
    assert rep.placed == [job.job_id] and got.state is JobState.PLACED and len(got.placement.slices) == 1


@pytest.mark.parametrize("policy", ["elastico", "exclusive-fifo", "lucid"])
async def test_a_gang_that_fits_one_node_is_never_split_across_nodes(store, policy):
    """Two nodes of two GPUs, one GPU taken on each: a 2-GPU job waits rather than span both nodes; once a
    node has two free GPUs it starts there."""
    await heartbeat(store, "n1", "n2", gpus=2)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(policy=policy), lease)
    whole = make_spec(shapes=(Shape(1, 100.0, 16384),), training=TrainingWork(total_steps=10**8))
    singles = [(await store.create_job(make_job(spec=whole)))[0] for _ in range(4)]
    await sch.round(epoch)
    on = {j.job_id: (await store.get_job(j.job_id)).placement.slices[0] for j in singles}
    assert len({(s.node_id, s.gpu_index) for s in on.values()}) == 4

    async def finish(job_ids):
        for n in ("n1", "n2"):
            await agent_reports(store, n, "succeeded", StateReason.COMPLETED, only=set(job_ids))
        await sch.round(epoch)

    await finish([j for j, s in on.items() if s.gpu_index == 0])  # GPU 0 of each node becomes free
    gang = make_spec(shapes=(Shape(2, 100.0, 16384),), training=TrainingWork(total_steps=10**6))
    job, _ = await store.create_job(make_job(spec=gang))
    await sch.round(epoch)
    assert (await store.get_job(job.job_id)).placement is None  # one free GPU per node: it waits
    await finish([j for j, s in on.items() if s.node_id == "n1" and s.gpu_index == 1])  # node n1 empties
    await sch.round(epoch)
    got = (await store.get_job(job.job_id)).placement
    assert got is not None and {s.node_id for s in got.slices} == {"n1"} and len(got.slices) == 2


class _Outage:
    """The store, unreachable while ``down`` is set (every call raises Unavailable)."""

    def __init__(self, store):
        self._store, self.down = store, False

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        async def call(*a, **kw):
            if self.down:
                raise Unavailable("redis down (test)")
            return await attr(*a, **kw)
        return call


async def test_silence_the_allocator_could_not_see_never_loses_a_node(store):
    """A new leader, or one whose store was down (no heartbeat could land), counts a node's silence from when
    it could watch: a node that went quiet before then keeps its jobs for stale + grace after it."""
    await heartbeat(store, "n1", gpus=1)
    lease, epoch = await leader(store, "a")
    ahead = [0.0]
    clock = lambda: time.time() + ahead[0]  # noqa: E731
    first = Scheduler(store, settings(), lease, clock=clock)
    job, _ = await store.create_job(make_job())
    await first.round(epoch)
    ahead[0] = 7.0  # n1's last heartbeat is 7 s old (> stale 5 s + grace 1 s) when a new leader takes over
    new = Scheduler(store, settings(), lease, clock=clock)
    rep = await new.round(epoch)
    assert rep.released == {} and (await store.get_job(job.job_id)).state is JobState.PLACED
    ahead[0] = 13.5  # 6.5 s of silence this leader saw: lost
    assert (await new.round(epoch)).released == {"node_lost": 1}

    await heartbeat(store, "n1", gpus=1, age_s=-13.5)  # back: the requeued job is placed there again
    flaky = _Outage(store)
    sch = Scheduler(flaky, settings(), lease, clock=clock)
    assert (await sch.round(epoch)).placed == [job.job_id]
    flaky.down = True
    ahead[0] = 30.0  # Redis down for 16.5 s: no heartbeat could land
    with pytest.raises(Unavailable):
        await sch.round(epoch)
    flaky.down = False
    rep = await sch.round(epoch)
    assert rep.released == {} and (await store.get_job(job.job_id)).state is JobState.PLACED
    ahead[0] = 36.5
    assert (await sch.round(epoch)).released == {"node_lost": 1}


async def test_stale_node_gets_nothing_and_its_jobs_are_requeued_after_grace(store):
    await heartbeat(store, "n1", gpus=1)
    lease, epoch = await leader(store, "a")
    ahead = [0.0]
    sch = Scheduler(store, settings(), lease, clock=lambda: time.time() + ahead[0])
    job, _ = await store.create_job(make_job())
    await sch.round(epoch)
    ahead[0] = 7.0  # n1 silent for 7 s > stale 5 s + grace 1 s, while this leader watched
    await heartbeat(store, "n2", gpus=1, age_s=-7.0)
    rep = await sch.round(epoch)
    assert rep.released == {"node_lost": 1}
    moved = await store.get_job(job.job_id)
    assert moved.state is JobState.PLACED and moved.placement.slices[0].node_id == "n2"
    assert any(d.startswith("node n1") for d in rep.degraded)


async def test_jobs_no_gpu_has_the_memory_for_keep_no_gpu_from_others(store):
    """Jobs whose every declared shape needs more memory than any GPU has are NEVER_SCHEDULABLE, saying why, and
    hold nothing: another job is placed in the same round (before, the policy planned them every round on GPUs
    their placements could not get, and the other job waited for ever)."""
    await heartbeat(store, "n1", gpus=2)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(), lease)
    huge = [(await store.create_job(make_job(spec=make_spec(shapes=(Shape(1, 50.0, 16385),)))))[0] for _ in range(4)]
    other, _ = await store.create_job(make_job(spec=make_spec(tenant="team-b", shapes=(Shape(2, 100.0, 8192),))))
    rep = await sch.round(epoch)
    assert rep.placed == [other.job_id]
    for j in huge:
        marked = await store.get_job(j.job_id)
        assert (marked.state, marked.reason) == (JobState.PENDING, StateReason.NEVER_SCHEDULABLE)
        assert marked.message == "every declared shape needs at least 16385 MiB per GPU; the largest healthy GPU has 16384 MiB"


async def test_jobs_their_allowed_nodes_or_one_node_cannot_host_are_never_schedulable_once(store):
    """A job pinned to a node without enough GPUs, and a one-node gang whose big-memory GPUs are spread over
    nodes, say NEVER_SCHEDULABLE with the reason -- written once, never flipped to UNSCHEDULABLE_NOW by later
    rounds -- while a job that fits is placed."""
    await heartbeat(store, "n1", gpus=2)
    await heartbeat(store, "n2", gpus=2)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(), lease)
    pinned, _ = await store.create_job(make_job(spec=make_spec(allowed_nodes=("n1",), shapes=(Shape(3, 100.0, 1024),))))
    other, _ = await store.create_job(make_job(spec=make_spec(tenant="team-b")))
    for _ in range(3):
        await heartbeat(store, "n1", gpus=2)
        await heartbeat(store, "n2", gpus=2)
        await sch.round(epoch)
    assert (await store.get_job(other.job_id)).state is not JobState.PENDING
    marked = await store.get_job(pinned.job_id)
    assert (marked.state, marked.reason) == (JobState.PENDING, StateReason.NEVER_SCHEDULABLE)
    assert "its allowed nodes (n1)" in marked.message
    events = [e.reason for e in await store.read_events("0") if e.job_id == pinned.job_id]
    assert events == [StateReason.SUBMITTED, StateReason.NEVER_SCHEDULABLE]


async def test_the_view_is_built_off_the_event_loop(store, monkeypatch):
    """With thousands of jobs pending, building the view is most of a round (~260 ms at 10,000): it runs in a
    thread, so the API's other calls are answered meanwhile (a probe saw 300-ms stalls of every caller)."""
    import threading

    from services.allocator import rounds

    threads = []

    def recording(*args, **kw):
        threads.append(threading.current_thread())
        return build_view(*args, **kw)

    monkeypatch.setattr(rounds, "build_view", recording)
    await heartbeat(store, "n1")
    lease, epoch = await leader(store, "a")
    job, _ = await store.create_job(make_job())
    assert (await Scheduler(store, settings(), lease).round(epoch)).placed == [job.job_id]
    assert threads and all(t is not threading.main_thread() for t in threads)


async def test_a_placement_the_store_cannot_take_holds_no_gpu_for_more_than_a_round(store):
    """On GPUs of two memory sizes, a job declaring a big-memory shape (it fits the big GPU, which is taken) and a
    small one: the policy may plan the big shape on a small GPU, which the store cannot take. That job sits out the
    next rounds (``SIT_OUT_ROUNDS``), so the others' jobs are placed within a few rounds (a probe kept 4 GPUs idle
    for a minute)."""
    big = replace(make_node("big", gpus=1, mem_mib=40960), last_heartbeat_s=time.time())
    await store.put_node(big)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(), lease)
    hog, _ = await store.create_job(make_job(spec=make_spec(tenant="carol", shapes=(Shape(1, 100.0, 20000),))))
    assert (await sch.round(epoch)).placed == [hog.job_id]
    await store.put_node(replace(make_node("small", gpus=2, mem_mib=16384), last_heartbeat_s=time.time()))
    mixed = (Shape(1, 100.0, 20000), Shape(1, 50.0, 1000))
    for _ in range(4):
        await store.create_job(make_job(spec=make_spec(shapes=mixed, priority=100)))
    other, _ = await store.create_job(make_job(spec=make_spec(tenant="team-b")))
    placed: list[str] = []
    for _ in range(3):  # two rounds drop the greedy jobs' plans, two each
        await store.put_node(replace(big, last_heartbeat_s=time.time()))
        placed += (await sch.round(epoch)).placed
    assert other.job_id in placed, placed


async def test_unplaced_pending_job_is_marked_unschedulable_now_once(store):
    """A job a round leaves queued for lack of capacity carries UNSCHEDULABLE_NOW (never NEVER_SCHEDULABLE):
    written once on the transition, not every round; the mark is no requeue (its queue time stays)."""
    await heartbeat(store, "n1", gpus=1)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(), lease)
    whole = make_spec(shapes=(Shape(num_gpus=1, compute_share_pct=100.0, mem_mib=16384),))
    first, _ = await store.create_job(make_job(spec=whole))
    second, _ = await store.create_job(make_job(spec=whole))
    big, _ = await store.create_job(make_job(spec=make_spec(shapes=(Shape(num_gpus=2, compute_share_pct=100.0, mem_mib=1024),))))
    rep = await sch.round(epoch)
    assert rep.placed == [first.job_id] and rep.unschedulable == 1
    waiting = await store.get_job(second.job_id)
    assert (waiting.state, waiting.reason, waiting.version) == (JobState.PENDING, StateReason.UNSCHEDULABLE_NOW, 2)
    assert waiting.message and waiting.queued_at_s == second.queued_at_s
    assert (await store.get_job(big.job_id)).reason is StateReason.NEVER_SCHEDULABLE  # distinct from "not now"
    for _ in range(3):  # later rounds that still cannot place it write nothing more
        rep = await sch.round(epoch)
        assert rep.placed == [] and rep.unschedulable == 0
    assert (await store.get_job(second.job_id)).version == 2
    events = [e for e in await store.read_events("0") if e.job_id in (second.job_id, big.job_id)]
    assert [e.reason for e in events if e.job_id == second.job_id] == [StateReason.SUBMITTED, StateReason.UNSCHEDULABLE_NOW]
    assert [e.reason for e in events if e.job_id == big.job_id] == [StateReason.SUBMITTED, StateReason.NEVER_SCHEDULABLE]
    # capacity frees: the marked job is placed; requeued later and left queued, it is marked again
    await agent_reports(store, "n1", "succeeded", StateReason.COMPLETED)
    rep = await sch.round(epoch)
    assert rep.placed == [second.job_id] and (await store.get_job(second.job_id)).reason is StateReason.PLACED
    third, _ = await store.create_job(make_job(spec=whole))
    await agent_reports(store, "n1", "failed", StateReason.COTENANT_FAULT)
    rep = await sch.round(epoch)
    assert rep.released == {"cotenant_fault": 1} and len(rep.placed) == 1 and rep.unschedulable == 1
    left = next(j for j in (second.job_id, third.job_id) if j not in rep.placed)
    assert (await store.get_job(left)).reason is StateReason.UNSCHEDULABLE_NOW


async def test_reason_marks_do_not_wake_rounds(store):
    """The scheduler's event watch ignores UNSCHEDULABLE_NOW / NEVER_SCHEDULABLE events (no round storm)."""
    await heartbeat(store, "n1", gpus=1)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(round_interval_s=30.0), lease)
    job, _ = await store.create_job(make_job())
    watcher = asyncio.create_task(triggers.watch_events(store, sch.s.round_min_gap_s, sch.wake))
    try:
        await asyncio.sleep(0.2)
        sch._wake.clear()
        await store.update_job(job, replace(job, reason=StateReason.UNSCHEDULABLE_NOW), epoch=epoch)
        await asyncio.sleep(0.3)
        assert not sch._wake.is_set()
        await store.create_job(make_job())
        for _ in range(40):
            if sch._wake.is_set():
                break
            await asyncio.sleep(0.05)
        assert sch._wake.is_set()
    finally:
        watcher.cancel()


async def test_stale_leader_round_writes_nothing(store):
    await heartbeat(store, "n1", gpus=2)
    a, ea = await leader(store, "alloc-a", ttl_s=0.2)
    sa = Scheduler(store, settings(), a)
    await asyncio.sleep(0.3)  # a is "paused" past its lease
    b, eb = await leader(store, "alloc-b")
    sb = Scheduler(store, settings(), b)
    job, _ = await store.create_job(make_job())
    with pytest.raises(StaleEpoch):
        await sa.round(ea)  # its writes are fenced off
    assert (await store.get_job(job.job_id)).state is JobState.PENDING
    assert all(g.allocated_share_pct == 0 for n in await store.list_nodes() for g in n.gpus)
    rep = await sb.round(eb)
    assert rep.placed == [job.job_id] and (await store.get_job(job.job_id)).placement.epoch == eb


async def test_a_new_leader_continues_from_the_store_without_placing_twice(store):
    await heartbeat(store, "n1", "n2")
    a, ea = await leader(store, "a")
    jobs = [(await store.create_job(make_job()))[0] for _ in range(6)]
    await Scheduler(store, settings(), a).round(ea)
    placed_before = {j.job_id: (await store.get_job(j.job_id)).placement for j in jobs}
    await a.stop()  # the leader goes away; everything it knew is in the store
    b, eb = await leader(store, "b")
    sb = Scheduler(store, settings(), b)
    await agent_reports(store, "n1", "succeeded", StateReason.COMPLETED)
    rep = await sb.round(eb)
    for j in jobs:
        now = await store.get_job(j.job_id)
        if placed_before[j.job_id] is not None and now.state is JobState.PLACED:
            assert now.placement == placed_before[j.job_id]  # untouched by the new leader
    assert rep.released.get("completed", 0) >= 1
    desired = [j for n in ("n1", "n2") for j in (await store.get_desired(n))[1]]
    assert len(desired) == len(set(desired))


async def test_decide_worker_process_decides_as_a_thread_and_survives_its_death(store):
    """decide_worker=process: the worker builds the same policy and returns the same decision as a thread
    would; a SIGTERM to the process group leaves it running; a killed worker costs nothing but a warning (that round
    decides in a thread)."""
    import os
    import signal

    from services.allocator.decider import _WORKER, _decide_in_worker

    await heartbeat(store, "n1", "n2", gpus=4)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(decide_worker="process"), lease)
    threaded = Scheduler(store, settings(), lease)
    try:
        for _ in range(6):
            await store.create_job(make_job(spec=make_spec(model_family="ResNet-18", batch_size=64)))
        jobs = await store.list_active_jobs()
        view, _ = build_view(jobs, await store.list_nodes(), sch.types, sch.resolve, time.time(), 5.0)
        policy = sch._policy(sch.estimate.matrix)
        assert sch._spec is not None
        _WORKER.clear()  # what the worker process does, here in-process: same decision as the thread's policy
        local = _decide_in_worker(sch._spec, view, (), True)[0].decision
        remote = (await sch._run_policy(policy, view, [])).decision
        reference = threaded._policy(threaded.estimate.matrix).decide(view)
        for d in (local, remote):
            assert [(int(r), [int(g) for g in np.atleast_1d(gs)], float(sh)) for r, gs, sh in d.place] == \
                   [(int(r), [int(g) for g in np.atleast_1d(gs)], float(sh)) for r, gs, sh in reference.place]
        rep = await sch.round(epoch)
        assert len(rep.placed) == 6 and sch._decider.pid is not None
        pid = sch._decider.pid
        os.kill(pid, signal.SIGTERM)  # as the process group gets it at shutdown: the scheduler stops the worker
        await asyncio.sleep(0.3)
        await store.create_job(make_job(spec=make_spec(model_family="ResNet-18", batch_size=64)))
        rep = await sch.round(epoch)
        assert rep.placed and sch._decider.failures == 0 and sch._decider.pid == pid
        os.kill(sch._decider.pid, signal.SIGKILL)
        for _ in range(2):
            await store.create_job(make_job(spec=make_spec(model_family="ResNet-18", batch_size=64)))
        rep = await sch.round(epoch)
        assert rep.placed and sch._decider.failures == 1  # decided in a thread
    finally:
        await sch.close()
        _WORKER.clear()


async def test_a_stuck_decide_worker_is_killed_and_the_next_round_places_with_a_fresh_one(store):
    """A worker that stops answering (here SIGSTOP) held every later round while the lease kept renewing; after
    decide_timeout_s it is killed, that round raises DecideTimeout, and the next round spawns a new worker."""
    import os
    import signal

    from services.allocator.decider import DecideTimeout

    await heartbeat(store, "n1", gpus=4)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(decide_worker="process", decide_timeout_s=3.0), lease)
    try:
        await store.create_job(make_job(spec=make_spec(model_family="ResNet-18", batch_size=64)))
        assert len((await sch.round(epoch)).placed) == 1
        stuck = sch._decider.pid
        os.kill(stuck, signal.SIGSTOP)
        await store.create_job(make_job(spec=make_spec(model_family="ResNet-18", batch_size=64)))
        t = time.monotonic()
        with pytest.raises(DecideTimeout):
            await sch.round(epoch)
        assert 3.0 <= time.monotonic() - t < 10.0 and sch._decider.timeouts == 1
        for _ in range(50):  # the stopped worker was killed (SIGKILL ends a stopped process)
            try:
                os.kill(stuck, 0)
            except ProcessLookupError:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"worker {stuck} still exists")
        rep = await sch.round(epoch)
        assert len(rep.placed) == 1 and sch._decider.pid not in (None, stuck)
    finally:
        await sch.close()


async def test_marks_encoded_during_a_worker_decide_are_written_for_the_jobs_left_only(store):
    """decide_worker=process with a per-round cap below the queue: the UNSCHEDULABLE_NOW marks are encoded
    while the worker decides; the round writes them for the jobs it left queued, none for those it placed."""
    await heartbeat(store, "n1", "n2", gpus=4)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(decide_worker="process", policy_max_attempts=2), lease)
    try:
        jobs = [(await store.create_job(make_job(spec=make_spec(model_family="ResNet-18", batch_size=64))))[0]
                for _ in range(6)]
        rep = await sch.round(epoch)
        assert 1 <= len(rep.placed) <= 2 and rep.unschedulable == 6 - len(rep.placed)
        for j in jobs:
            now = await store.get_job(j.job_id)
            expected = StateReason.PLACED if j.job_id in rep.placed else StateReason.UNSCHEDULABLE_NOW
            assert now.reason is expected and now.version == 2
    finally:
        await sch.close()


@pytest.fixture
async def services():
    """Pricer and predictor servicers in-process on port 0 (the predictor answers what its build serves)."""
    s = PricerSettings.from_env({}, insecure=True, port=0)
    server, port = await create_server(s, [
        ServiceBinding("elastico.v1.Pricer", PricerServicer(s), pricer_pb2_grpc.add_PricerServicer_to_server),
        ServiceBinding("elastico.v1.Predictor", PredictorServicer(PredictorSettings.from_env({}, insecure=True)),
                       predictor_pb2_grpc.add_PredictorServicer_to_server)])
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


async def _contested(store, n_jobs: int = 12) -> None:
    await heartbeat(store, "n1", gpus=2)
    for _ in range(n_jobs):
        await store.create_job(make_job(spec=make_spec(model_family="ResNet-18", batch_size=64)))


@pytest.mark.parametrize("worker", ["thread", "process"])
async def test_pricing_through_the_pricer_service_is_published(services, worker):
    store = MemoryStore()
    await _contested(store)
    lease, epoch = await leader(store, "a")
    solver = GrpcSolver(services, timeout_s=5.0)
    sch = Scheduler(store, settings(pricer_address=services, decide_worker=worker), lease, solver=solver)
    rep = await sch.round(epoch)
    await sch.close()  # closes the solver (and the worker process)
    assert rep.placed and rep.gap is not None and not rep.degraded
    doc = json.loads(await store.get_status(STATUS_NAME))
    assert [p["pool"] for p in doc["prices"]] == ["gpu_share_pct", "tenant_slots"] and doc["epoch"] == epoch
    cs = await AllocatorServicer(store, settings()).GetClusterState(allocator_pb2.GetClusterStateRequest(), None)
    assert cs.leader_id == "a" and len(cs.prices) == 2 and cs.degraded == []


@pytest.mark.parametrize("worker", ["thread", "process"])
async def test_pricer_down_degrades_explicitly_and_still_places_within_capacity(worker):
    store = MemoryStore()
    await _contested(store)
    lease, epoch = await leader(store, "a")
    solver = GrpcSolver("127.0.0.1:1", timeout_s=0.3)
    sch = Scheduler(store, settings(decide_worker=worker), lease, solver=solver)
    rep = await sch.round(epoch)
    await sch.close()
    assert rep.placed and any(d.startswith("pricer unavailable") for d in rep.degraded)
    assert all(g.allocated_share_pct <= 100 for n in await store.list_nodes() for g in n.gpus)
    cs = await AllocatorServicer(store, settings()).GetClusterState(allocator_pb2.GetClusterStateRequest(), None)
    assert any("pricer unavailable" in d for d in cs.degraded)


async def test_predictor_unavailable_means_no_new_colocation(services):
    store = MemoryStore()
    await _contested(store)
    lease, epoch = await leader(store, "a")
    predictor = PredictorClient(services, timeout_s=2.0)
    try:
        matrix = await predictor.pair_matrix(Scheduler(store, settings(), lease).types)
    except Exception:  # noqa: BLE001 - the predictor build may not serve predictions yet
        matrix = None
    if matrix is not None:
        predictor = PredictorClient("127.0.0.1:1", timeout_s=0.3)  # this build serves: make it unreachable
    sch = Scheduler(store, settings(estimator="predictor", predictor_address=predictor.address), lease, predictor=predictor)
    rep = await sch.round(epoch)
    await predictor.close()
    assert any(d.startswith("predictor unavailable") and "no new co-location" in d for d in rep.degraded)
    shares = [(await store.get_job(j)).placement.slices[0].compute_share_pct for j in rep.placed]
    assert shares and all(s == 100.0 for s in shares)  # whole GPUs only


async def test_scheduler_loop_runs_rounds_on_arrival_events(store):
    await heartbeat(store, "n1")
    lease = LeaderLease(store, "loop", ttl_s=5)
    lease.start()
    sch = Scheduler(store, settings(round_interval_s=30.0, report_poll_s=0.05), lease)
    sch.start()
    try:
        for _ in range(50):
            if lease.epoch is not None:
                break
            await asyncio.sleep(0.02)
        job, _ = await store.create_job(make_job())  # no explicit wake: the event stream must trigger the round
        for _ in range(100):
            if (await store.get_job(job.job_id)).state is JobState.PLACED:
                break
            await asyncio.sleep(0.05)
        assert (await store.get_job(job.job_id)).state is JobState.PLACED
        await agent_reports(store, "n1", "succeeded", StateReason.COMPLETED)  # the report poll must trigger it
        for _ in range(100):
            if (await store.get_job(job.job_id)).state is JobState.SUCCEEDED:
                break
            await asyncio.sleep(0.05)
        assert (await store.get_job(job.job_id)).state is JobState.SUCCEEDED
    finally:
        await sch.stop()
        await lease.stop()


def test_metrics_are_exported():
    from prometheus_client import generate_latest

    text = generate_latest().decode()
    for name in ("elastico_allocator_queue_length", "elastico_allocator_round_seconds", "elastico_allocator_placements_total",
                 "elastico_allocator_gpu_allocated_ratio", "elastico_allocator_norm_throughput_error"):
        assert name in text
    assert grpc  # imported for the fixtures' channels



class _PlaceOn:
    """A policy for one job: places it whole on GPU row ``row`` while it is pending and, with ``move``, relaunches it
    there once while it runs (preempt + place in one decision). Other jobs stay queued (one keeps rounds deciding)."""

    name = "place-on"
    needs_periodic_rounds = False

    def __init__(self, job_id: str, row: int):
        self.job_id, self.row, self.move = job_id, row, False

    def decide(self, view):
        from services.allocator.policy import Decision

        d = Decision()
        for r, job_id in enumerate(view.jobs.job_ids):
            if job_id != self.job_id:
                continue
            if r in view.running and self.move:
                self.move = False
                d.preempt.append(r)
                d.place.append((r, np.array([self.row]), 100.0))
            elif r in view.pending:
                d.place.append((r, np.array([self.row]), 100.0))
        return d


async def test_a_job_relaunched_on_another_node_starts_there_only_once_its_old_run_is_reported_stopped(store):
    """Its old node's agent stops it and the new node's agent starts it, in no order: the allocator places it on
    the new node only once the old node reports the run gone, so it never runs on both at once."""
    await heartbeat(store, "n1", "n2", gpus=1)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(), lease)
    job, _ = await store.create_job(make_job(spec=make_spec(model_family="ResNet-18", batch_size=64)))
    await store.create_job(make_job())
    policy = _PlaceOn(job.job_id, 0)  # GPU rows: n1:0, n2:0
    sch._policy = lambda matrix: policy  # noqa: SLF001 - the test's policy
    await sch.round(epoch)
    await agent_reports(store, "n1", "running")
    await sch.round(epoch)
    assert (await store.get_job(job.job_id)).state is JobState.RUNNING
    policy.row, policy.move = 1, True
    await sch.round(epoch)
    left = await store.get_job(job.job_id)
    assert (left.state, left.reason, left.placement) == (JobState.PENDING, StateReason.PREEMPTED, None)
    for _ in range(2):  # n1's agent has not stopped it yet: its last report still says running
        await sch.round(epoch)
        assert (await store.get_job(job.job_id)).state is JobState.PENDING
        assert (await store.get_desired("n2"))[1] == {}
    gen, _ = await store.get_workloads("n1")
    await store.report_workloads("n1", gen, [])  # stopped
    await sch.round(epoch)
    now = await store.get_job(job.job_id)
    assert now.state is JobState.PLACED and now.placement.slices[0].node_id == "n2"


async def test_a_relaunch_on_the_same_node_is_one_round(store):
    """The agent stops a job's old run before it starts the new one: a relaunch there needs no wait."""
    await heartbeat(store, "n1", gpus=2)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(), lease)
    job, _ = await store.create_job(make_job(spec=make_spec(model_family="ResNet-18", batch_size=64)))
    await store.create_job(make_job())
    policy = _PlaceOn(job.job_id, 0)
    sch._policy = lambda matrix: policy  # noqa: SLF001 - the test's policy
    await sch.round(epoch)
    await agent_reports(store, "n1", "running")
    await sch.round(epoch)
    policy.row, policy.move = 1, True
    await sch.round(epoch)
    now = await store.get_job(job.job_id)
    assert (now.state, now.reason) == (JobState.PLACED, StateReason.PLACED) and now.placement.slices[0].gpu_index == 1
    assert now.restarts == 1
