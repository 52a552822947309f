"""One contract, two backends: MemoryStore and RedisStore (real redis-server) must behave the same."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from elastico.domain import GpuSlice, JobState, Placement, Shape, StateReason
from elastico.errors import Conflict, NotFound, ResourceExhausted, StaleEpoch, WrongState
from tests.conftest import make_job, make_node, make_spec


def placement_on(node: str, gpu: int, share: float = 50.0, mem: int = 8192) -> Placement:
    shape = Shape(num_gpus=1, compute_share_pct=share, mem_mib=mem)
    return Placement(job_id="", shape_index=0, shape=shape, slices=(GpuSlice(node, gpu, share, mem),))


async def test_create_is_idempotent_by_request_id(store):
    job = make_job(request_id="same-request")
    first, created = await store.create_job(job)
    assert created and first.version == 1 and first.state is JobState.PENDING
    again, created_again = await store.create_job(make_job(request_id="same-request"))
    assert not created_again
    assert again.job_id == first.job_id
    assert (await store.find_job_by_request("team-a", "same-request")).job_id == first.job_id


async def test_get_unknown_job_is_not_found(store):
    with pytest.raises(NotFound):
        await store.get_job("nope")


async def test_update_with_stale_version_is_rejected_and_changes_nothing(store):
    job, _ = await store.create_job(make_job())
    updated = await store.update_job(job, job.__class__(**{**job.__dict__, "message": "first"}))
    assert updated.version == 2
    with pytest.raises(Conflict):
        await store.update_job(job, job.__class__(**{**job.__dict__, "message": "stale writer"}))
    assert (await store.get_job(job.job_id)).message == "first"


async def test_leader_epoch_fences_writes(store):
    await store.put_node(make_node())
    epoch1 = await store.acquire_leadership("alloc-a", ttl_s=0.2)
    assert epoch1 is not None
    assert await store.acquire_leadership("alloc-b", ttl_s=5) is None  # lease held
    assert await store.acquire_leadership("alloc-a", ttl_s=0.2) == epoch1  # renewal keeps the epoch
    await asyncio.sleep(0.35)
    epoch2 = await store.acquire_leadership("alloc-b", ttl_s=5)
    assert epoch2 is not None and epoch2 > epoch1
    assert await store.current_leader() == ("alloc-b", epoch2)

    job, _ = await store.create_job(make_job())
    with pytest.raises(StaleEpoch):
        await store.commit_placements(epoch1, [(job, placement_on("node-1", 0))])
    # nothing changed: job still pending at version 1, GPU still empty, no desired state
    assert (await store.get_job(job.job_id)).state is JobState.PENDING
    assert (await store.get_job(job.job_id)).version == 1
    assert (await store.get_node("node-1")).gpus[0].allocated_share_pct == 0
    assert (await store.get_desired("node-1"))[1] == {}
    placed = await store.commit_placements(epoch2, [(job, placement_on("node-1", 0))])
    assert placed[0].state is JobState.PLACED and placed[0].placement.epoch == epoch2


async def test_commit_never_oversubscribes_a_gpu(store):
    await store.put_node(make_node(gpus=1, mem_mib=16384))
    epoch = await store.acquire_leadership("a", 5)
    j1, _ = await store.create_job(make_job())
    j2, _ = await store.create_job(make_job())
    j3, _ = await store.create_job(make_job())
    await store.commit_placements(epoch, [(j1, placement_on("node-1", 0, 60.0, 4096))])
    # 60 + 50 > 100: the whole batch (including j3's fitting slice) is rejected
    with pytest.raises(Conflict):
        await store.commit_placements(epoch, [(j3, placement_on("node-1", 0, 10.0, 1024)), (j2, placement_on("node-1", 0, 50.0, 4096))])
    assert (await store.get_job(j3.job_id)).state is JobState.PENDING
    gpu = (await store.get_node("node-1")).gpus[0]
    assert (gpu.allocated_share_pct, gpu.allocated_mem_mib) == (60.0, 4096)
    # memory is checked too
    with pytest.raises(Conflict):
        await store.commit_placements(epoch, [(j2, placement_on("node-1", 0, 10.0, 16000))])
    # exactly full is fine
    await store.commit_placements(epoch, [(j2, placement_on("node-1", 0, 40.0, 12288))])
    gpu = (await store.get_node("node-1")).gpus[0]
    assert (gpu.allocated_share_pct, gpu.allocated_mem_mib) == (100.0, 16384)


async def test_commit_rejects_unknown_gpu_and_non_pending_jobs(store):
    await store.put_node(make_node(gpus=1))
    epoch = await store.acquire_leadership("a", 5)
    job, _ = await store.create_job(make_job())
    with pytest.raises(Conflict):
        await store.commit_placements(epoch, [(job, placement_on("node-1", 7))])
    (placed,) = await store.commit_placements(epoch, [(job, placement_on("node-1", 0))])
    with pytest.raises(WrongState):
        await store.commit_placements(epoch, [(placed, placement_on("node-1", 0))])
    with pytest.raises(Conflict):  # stale read of the job: version moved
        await store.commit_placements(epoch, [(job, placement_on("node-1", 0))])


async def test_release_frees_capacity_and_desired_state(store):
    await store.put_node(make_node(gpus=1))
    epoch = await store.acquire_leadership("a", 5)
    job, _ = await store.create_job(make_job())
    (placed,) = await store.commit_placements(epoch, [(job, placement_on("node-1", 0))])
    gen, desired = await store.get_desired("node-1")
    assert set(desired) == {job.job_id} and gen >= 1
    assert desired[job.job_id].slices[0].compute_share_pct == 50.0
    requeued = await store.release_job(epoch, placed, JobState.PENDING, StateReason.PREEMPTED, "resize")
    assert requeued.state is JobState.PENDING and requeued.restarts == 1 and requeued.placement is None
    gen2, desired2 = await store.get_desired("node-1")
    assert desired2 == {} and gen2 > gen
    assert (await store.get_node("node-1")).gpus[0].allocated_share_pct == 0


async def test_many_add_remove_cycles_do_not_drift(store):
    await store.put_node(make_node(gpus=1))
    epoch = await store.acquire_leadership("a", 5)
    for _ in range(20):
        job, _ = await store.create_job(make_job())
        (placed,) = await store.commit_placements(epoch, [(job, placement_on("node-1", 0, 33.33, 100))])
        await store.release_job(epoch, placed, JobState.SUCCEEDED, StateReason.COMPLETED)
    assert (await store.get_node("node-1")).gpus[0].allocated_share_pct == 0


async def test_list_jobs_pages_and_filters(store):
    ids = []
    for _ in range(7):
        job, _ = await store.create_job(make_job(spec=None))
        ids.append(job.job_id)
    page1, token = await store.list_jobs(page_size=3)
    assert [j.job_id for j in page1] == ids[::-1][:3] and token
    page2, token2 = await store.list_jobs(page_size=3, page_token=token)
    page3, token3 = await store.list_jobs(page_size=3, page_token=token2)
    assert [j.job_id for j in page1 + page2 + page3] == ids[::-1] and token3 == ""
    job = await store.get_job(ids[0])
    await store.update_job(job, job.__class__(**{**job.__dict__, "state": JobState.CANCELLED, "reason": StateReason.CANCELLED_BY_CLIENT}))
    cancelled, _ = await store.list_jobs(states=[JobState.CANCELLED])
    assert [j.job_id for j in cancelled] == [ids[0]]
    assert (await store.list_jobs(tenant="someone-else"))[0] == []


async def test_event_stream_is_ordered_and_resumable(store):
    job, _ = await store.create_job(make_job())
    await store.update_job(job, job.__class__(**{**job.__dict__, "state": JobState.CANCELLED, "reason": StateReason.CANCELLED_BY_CLIENT}))
    events = await store.read_events("0")
    mine = [e for e in events if e.job_id == job.job_id]
    assert [e.state for e in mine] == [JobState.PENDING, JobState.CANCELLED]
    assert [e.version for e in mine] == [1, 2]
    after = await store.read_events(mine[0].event_id)
    assert [e.event_id for e in after] == [mine[1].event_id]
    assert await store.read_events(mine[1].event_id) == []


async def test_blocking_read_wakes_on_new_event(store):
    last = await store.last_event_id()
    reader = asyncio.create_task(store.read_events(last, block_s=3.0))
    await asyncio.sleep(0.1)
    job, _ = await store.create_job(make_job())
    async with asyncio.timeout(5):
        events = await reader
    assert [e.job_id for e in events] == [job.job_id]


async def test_concurrent_commits_race_safely(store):
    """Two writers race for the last slice of one GPU: exactly one wins, capacity is never exceeded."""
    await store.put_node(make_node(gpus=1))
    epoch = await store.acquire_leadership("a", 5)
    jobs = [ (await store.create_job(make_job()))[0] for _ in range(6)]
    results = await asyncio.gather(*(store.commit_placements(epoch, [(j, placement_on("node-1", 0, 40.0, 1000))]) for j in jobs),
                                   return_exceptions=True)
    wins = [r for r in results if not isinstance(r, Exception)]
    assert len(wins) == 2
    assert all(isinstance(r, Conflict) for r in results if isinstance(r, Exception))
    assert (await store.get_node("node-1")).gpus[0].allocated_share_pct == 80.0


async def test_node_roundtrip_and_removal(store):
    node = make_node("n7", gpus=3)
    await store.put_node(node)
    got = await store.get_node("n7")
    assert [g.uuid for g in got.gpus] == [g.uuid for g in node.gpus]
    assert [n.node_id for n in await store.list_nodes()] == ["n7"]
    await store.remove_node("n7")
    with pytest.raises(NotFound):
        await store.get_node("n7")


async def test_actual_workloads_are_replaced_atomically_per_node(store):
    from elastico.domain import GpuCounters, Workload

    assert await store.get_workloads("node-1") == (0, {})
    running = Workload(job_id="j1", gpu_indices=(0,), compute_share_pct=50.0, mem_mib=4096, status="running", pid=123,
                       progress_steps=10.5, throughput=2.5, started_at_s=1.0, placement_id="3:1.000000",
                       cotenants=("j2",), norm_throughput=0.6, counters=GpuCounters(sm_util_pct=40.0))
    ended = Workload(job_id="j2", gpu_indices=(0, 1), compute_share_pct=25.0, mem_mib=1024, status="failed",
                     placement_id="3:2.000000", reason=StateReason.COTENANT_FAULT, exit_code=-9,
                     message="MPS server fault on GPU 0", ended_at_s=5.0)
    await store.report_workloads("node-1", 7, [running, ended])
    await store.report_workloads("node-2", 1, [running])
    gen, table = await store.get_workloads("node-1")
    assert gen == 7 and table == {"j1": running, "j2": ended}  # every field round-trips, enums and None included
    # a new report replaces the whole table (j2 acknowledged and dropped), other nodes untouched
    await store.report_workloads("node-1", 8, [running])
    assert await store.get_workloads("node-1") == (8, {"j1": running})
    await store.report_workloads("node-1", 9, [])
    assert await store.get_workloads("node-1") == (9, {})
    assert (await store.get_workloads("node-2"))[1] == {"j1": running}


async def test_unhealthy_gpu_has_no_capacity_until_healthy_again(store):
    """A drained GPU (MPS server fault) takes no new placements; capacity returns with its health."""
    from dataclasses import replace

    node = make_node(gpus=2)
    await store.put_node(replace(node, gpus=(replace(node.gpus[0], healthy=False), node.gpus[1])))
    epoch = await store.acquire_leadership("a", 5)
    job, _ = await store.create_job(make_job())
    with pytest.raises(Conflict):
        await store.commit_placements(epoch, [(job, placement_on("node-1", 0, 10.0, 100))])
    await store.commit_placements(epoch, [(job, placement_on("node-1", 1, 10.0, 100))])
    await store.put_node(node)
    job2, _ = await store.create_job(make_job())
    await store.commit_placements(epoch, [(job2, placement_on("node-1", 0, 10.0, 100))])


async def test_active_jobs_follow_state_changes(store):
    await store.put_node(make_node())
    epoch = await store.acquire_leadership("alloc", ttl_s=5)
    a, _ = await store.create_job(make_job())
    b, _ = await store.create_job(make_job())
    c, _ = await store.create_job(make_job())
    assert {j.job_id for j in await store.list_active_jobs()} == {a.job_id, b.job_id, c.job_id}
    [placed] = await store.commit_placements(epoch, [(a, placement_on("node-1", 0))])
    await store.release_job(epoch, placed, JobState.SUCCEEDED, StateReason.COMPLETED)
    await store.update_job(b, b.__class__(**{**b.__dict__, "state": JobState.CANCELLED,
                                             "reason": StateReason.CANCELLED_BY_CLIENT}))
    active = await store.list_active_jobs()
    assert [j.job_id for j in active] == [c.job_id]
    assert active[0].version == c.version
    # a changed record is decoded afresh, an unchanged one is the same object (memoised decode)
    again = await store.list_active_jobs()
    assert again[0] is active[0]
    moved = await store.update_job(c, c.__class__(**{**c.__dict__, "message": "m"}))
    assert (await store.list_active_jobs())[0].version == moved.version


async def test_status_documents_round_trip(store):
    assert await store.get_status("allocator") is None
    await store.put_status("allocator", '{"gap": 0.01}')
    await store.put_status("allocator", '{"gap": 0.02}')
    assert await store.get_status("allocator") == '{"gap": 0.02}'


async def test_create_jobs_batch_is_idempotent_per_request_and_indexed_in_order(store):
    """A batch creates each job on its own: a repeat (in the batch or from before) returns the first job."""
    old, _ = await store.create_job(make_job(request_id="r-old"))
    results = await store.create_jobs([make_job(request_id="r-a"), make_job(request_id="r-old"),
                                       make_job(request_id="r-b"), make_job(request_id="r-a")])
    (a, a_new), (dup_old, old_new), (b, b_new), (dup_a, a_again) = results
    assert (a_new, old_new, b_new, a_again) == (True, False, True, False)
    assert dup_old == old and dup_a == a and a.version == b.version == 1
    assert a.queued_at_s == a.submitted_at_s == a.updated_at_s > 0
    page, _ = await store.list_jobs(page_size=10)
    assert [j.job_id for j in page] == [b.job_id, a.job_id, old.job_id]  # newest first, one index entry each
    assert (await store.find_job_by_request("team-a", "r-b")).job_id == b.job_id
    events = [e for e in await store.read_events("0") if e.job_id in (a.job_id, b.job_id)]
    assert [(e.job_id, e.state) for e in events] == [(a.job_id, JobState.PENDING), (b.job_id, JobState.PENDING)]
    assert await store.create_jobs([]) == []


async def test_a_tenant_past_its_live_job_limit_is_refused_atomically_and_alone(store):
    """``live_limit`` counts the tenant's non-terminal jobs: the next one is refused and nothing is written;
    other tenants, retries of stored requests and room freed by a finished job are unaffected."""
    a = [await store.create_job(make_job(request_id=f"a{i}"), live_limit=2) for i in range(2)]
    with pytest.raises(ResourceExhausted) as err:
        await store.create_job(make_job(request_id="a-over"), live_limit=2)
    assert "'team-a' has 2 jobs queued or running" in str(err.value)
    assert await store.find_job_by_request("team-a", "a-over") is None  # nothing written
    again, created = await store.create_job(make_job(request_id="a0"), live_limit=2)
    assert not created and again.job_id == a[0][0].job_id  # a retry still answers its job
    results = await store.create_jobs([make_job(request_id="a-batch"), make_job(request_id="b0", spec=make_spec(tenant="team-b"))],
                                      live_limit=2)
    assert isinstance(results[0], ResourceExhausted) and results[1][1] is True  # the other tenant's job is created
    done = a[0][0]
    await store.update_job(done, replace(done, state=JobState.CANCELLED, reason=StateReason.CANCELLED_BY_CLIENT))
    _, created = await store.create_job(make_job(request_id="a-after"), live_limit=2)
    assert created  # the cancelled job no longer counts
    with pytest.raises(ResourceExhausted):
        await store.create_job(make_job(request_id="a-over-2"), live_limit=2)
    assert (await store.create_job(make_job(request_id="a-nolimit")))[1]  # no limit given: none applies


async def test_update_jobs_each_change_is_checked_on_its_own(store):
    j1, _ = await store.create_job(make_job())
    j2, _ = await store.create_job(make_job())
    moved = await store.update_job(j2, j2.__class__(**{**j2.__dict__, "message": "moved"}))
    r1, r2 = await store.update_jobs([(j1, j1.__class__(**{**j1.__dict__, "reason": StateReason.UNSCHEDULABLE_NOW})),
                                      (j2, j2.__class__(**{**j2.__dict__, "message": "stale writer"}))])
    assert r1.version == 2 and r1.reason is StateReason.UNSCHEDULABLE_NOW
    assert isinstance(r2, Conflict)  # j2 moved: only that change is rejected
    assert (await store.get_job(j1.job_id)) == r1
    assert (await store.get_job(j2.job_id)) == moved
    # a reason update is not a requeue: the queue-entry time stays
    assert r1.queued_at_s == j1.queued_at_s and r1.updated_at_s >= j1.updated_at_s
    assert [e.reason for e in await store.read_events("0") if e.job_id == j1.job_id] == [
        StateReason.SUBMITTED, StateReason.UNSCHEDULABLE_NOW]
    assert await store.update_jobs([]) == []


async def test_release_jobs_batch_frees_each_and_is_fenced(store):
    await store.put_node(make_node(gpus=2))
    epoch = await store.acquire_leadership("a", 5)
    jobs = [(await store.create_job(make_job()))[0] for _ in range(3)]
    placed = await store.commit_placements(epoch, [(jobs[0], placement_on("node-1", 0)), (jobs[1], placement_on("node-1", 1)),
                                                   (jobs[2], placement_on("node-1", 0, 30.0, 1000))])
    stale = placed[2]
    again = await store.update_job(stale, stale.__class__(**{**stale.__dict__, "message": "moved"}), epoch=epoch)
    with pytest.raises(StaleEpoch):  # a stale epoch writes nothing at all
        await store.release_jobs(epoch + 1, [(placed[0], JobState.SUCCEEDED, StateReason.COMPLETED, "")])
    assert (await store.get_job(placed[0].job_id)).state is JobState.PLACED
    done, requeued, conflict = await store.release_jobs(epoch, [
        (placed[0], JobState.SUCCEEDED, StateReason.COMPLETED, ""),
        (placed[1], JobState.PENDING, StateReason.PREEMPTED, "by the policy"),
        (stale, JobState.SUCCEEDED, StateReason.COMPLETED, "")])
    assert done.state is JobState.SUCCEEDED and done.placement is None
    assert requeued.state is JobState.PENDING and requeued.restarts == 1 and requeued.queued_at_s == requeued.updated_at_s
    assert isinstance(conflict, Conflict)
    gpus = (await store.get_node("node-1")).gpus
    assert (gpus[0].allocated_share_pct, gpus[0].allocated_mem_mib, gpus[1].allocated_share_pct) == (30.0, 1000, 0.0)
    assert set((await store.get_desired("node-1"))[1]) == {again.job_id}
    assert {j.job_id for j in await store.list_active_jobs()} == {requeued.job_id, again.job_id}


async def test_all_workloads_and_nodes_read_together(store):
    from elastico.domain import Workload

    await store.put_node(make_node("n2", gpus=2))
    await store.put_node(make_node("n1", gpus=3))
    epoch = await store.acquire_leadership("a", 5)
    job, _ = await store.create_job(make_job())
    await store.commit_placements(epoch, [(job, placement_on("n1", 2, 25.0, 512))])
    nodes = await store.list_nodes()
    assert [n.node_id for n in nodes] == ["n1", "n2"]
    assert [(g.index, g.allocated_share_pct, g.allocated_mem_mib) for g in nodes[0].gpus] == [(0, 0.0, 0), (1, 0.0, 0), (2, 25.0, 512)]
    assert nodes == await store.list_nodes() and nodes[0] == await store.get_node("n1")
    w = Workload(job_id=job.job_id, gpu_indices=(2,), compute_share_pct=25.0, mem_mib=512, status="running")
    await store.report_workloads("n1", 4, [w])
    assert await store.get_all_workloads(["n1", "n2", "gone"]) == {"n1": (4, {job.job_id: w}), "n2": (0, {}), "gone": (0, {})}
    await store.report_workloads("n1", 5, [])
    assert (await store.get_all_workloads(["n1"]))["n1"] == (5, {})
    assert await store.get_all_workloads([]) == {}


def test_redis_transaction_payload_carries_every_field():
    """RedisStore builds the script's JSON by hand (hot path): a new Transaction field must not be dropped."""
    from dataclasses import fields

    from elastico.state.redis_store import RedisStore
    from elastico.state.transaction import DesiredOp, EventRecord, GpuDelta, JobWrite, Transaction

    tx = Transaction(epoch=1, claim_request=("r", "j"), jobs=[JobWrite("j", 0, 1, "pending", "{}", index_seq=True)],
                     gpus=[GpuDelta("n", 0, 100, 5)], desired=[DesiredOp("n", "j", "{}"), DesiredOp("n", "k", None)],
                     events=[EventRecord("j", "pending", "submitted", "", 1, 2.5)])
    records: list[str] = []
    payload = RedisStore._tx_payload(tx, records)
    assert set(payload) == {f.name for f in fields(Transaction)}
    assert set(payload["jobs"][0]) == {f.name for f in fields(JobWrite)} - {"data"} | {"data_arg"}
    assert set(payload["gpus"][0]) == {f.name for f in fields(GpuDelta)}
    assert set(payload["desired"][0]) == {f.name for f in fields(DesiredOp)} - {"data"} | {"data_arg"}
    assert set(payload["events"][0]) == {f.name for f in fields(EventRecord)}
    assert records == ["{}", "{}"] and payload["jobs"][0]["data_arg"] == 4 and payload["desired"][1]["data_arg"] is None


async def test_prepared_updates_apply_like_update_jobs_and_check_versions_when_applied(store):
    """prepare_updates encodes now; apply_updates checks each change's version only when applied."""
    j1, _ = await store.create_job(make_job())
    j2, _ = await store.create_job(make_job())
    j3, _ = await store.create_job(make_job())
    prepared = store.prepare_updates([(j, j.__class__(**{**j.__dict__, "reason": StateReason.UNSCHEDULABLE_NOW}))
                                      for j in (j1, j2, j3)])
    moved = await store.update_job(j2, j2.__class__(**{**j2.__dict__, "message": "moved meanwhile"}))
    assert [j.job_id for _, j in prepared.only({j1.job_id, j2.job_id}).items] == [j1.job_id, j2.job_id]
    r1, r2 = await store.apply_updates(prepared.only({j1.job_id, j2.job_id}))
    assert r1.reason is StateReason.UNSCHEDULABLE_NOW and await store.get_job(j1.job_id) == r1
    assert isinstance(r2, Conflict) and await store.get_job(j2.job_id) == moved
    assert (await store.get_job(j3.job_id)).version == 1  # left out: not written
    assert await store.apply_updates(prepared.only(set())) == []


# --- job indexes (list by state, by tenant, paging) and retention -------------------------------------------------

def _with(job, **kw):
    return job.__class__(**{**job.__dict__, **kw})


async def _jobs_in_every_state(store):
    """Per tenant (team-a, team-b), one job in each state; returns {(tenant, state): job_id} and the epoch."""
    from tests.conftest import make_spec

    await store.put_node(make_node(gpus=1, mem_mib=100_000))
    epoch = await store.acquire_leadership("a", 5)
    where: dict[tuple[str, JobState], str] = {}
    for tenant in ("team-a", "team-b"):
        jobs = {s: (await store.create_job(make_job(spec=make_spec(tenant=tenant))))[0] for s in JobState}
        placed = {s: p for s, p in zip(
            (JobState.PLACED, JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED),
            await store.commit_placements(epoch, [(jobs[s], placement_on("node-1", 0, 1.0, 10)) for s in
                                                  (JobState.PLACED, JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED)]),
            strict=True)}
        await store.update_job(placed[JobState.RUNNING], _with(placed[JobState.RUNNING], state=JobState.RUNNING,
                                                               reason=StateReason.STARTED))
        await store.release_job(epoch, placed[JobState.SUCCEEDED], JobState.SUCCEEDED, StateReason.COMPLETED)
        await store.release_job(epoch, placed[JobState.FAILED], JobState.FAILED, StateReason.OWN_FAILURE)
        await store.update_job(jobs[JobState.CANCELLED], _with(jobs[JobState.CANCELLED], state=JobState.CANCELLED,
                                                               reason=StateReason.CANCELLED_BY_CLIENT))
        where.update({(tenant, s): j.job_id for s, j in jobs.items()})
    return where, epoch


async def _all_pages(store, page_size, **kw):
    out, token = [], ""
    while True:
        page, token = await store.list_jobs(page_size=page_size, page_token=token, **kw)
        out += page
        if not token:
            return out


async def test_list_jobs_by_state_and_tenant_reads_the_matching_jobs_newest_first(store):
    where, _ = await _jobs_in_every_state(store)
    order = list(where.values())  # creation order
    newest_first = lambda ids: sorted(ids, key=order.index, reverse=True)  # noqa: E731
    for state in JobState:
        for tenant in ("", "team-a", "team-b"):
            expect = newest_first(j for (t, s), j in where.items() if s is state and tenant in ("", t))
            got = await _all_pages(store, 1, states=[state], tenant=tenant)
            assert [j.job_id for j in got] == expect, (state, tenant)
            assert all(j.state is state for j in got)
    mixed = [JobState.PENDING, JobState.SUCCEEDED, JobState.RUNNING]
    for page_size in (1, 2, 100):
        got = await _all_pages(store, page_size, states=mixed, tenant="team-b")
        assert [j.job_id for j in got] == newest_first(j for (t, s), j in where.items() if s in mixed and t == "team-b")
    assert [j.job_id for j in await _all_pages(store, 3, tenant="team-a")] == newest_first(
        j for (t, _), j in where.items() if t == "team-a")
    assert [j.job_id for j in await _all_pages(store, 5)] == newest_first(order)
    assert await store.list_jobs(tenant="nobody") == ([], "")
    assert await store.list_jobs(states=[JobState.FAILED], tenant="nobody") == ([], "")
    page, token = await store.list_jobs(states=[JobState.SUCCEEDED, JobState.FAILED], page_size=2)
    assert len(page) == 2 and token  # exactly the page, and more follow
    rest, last = await store.list_jobs(states=[JobState.SUCCEEDED, JobState.FAILED], page_size=2, page_token=token)
    assert len(rest) == 2 and last == ""  # 4 in all: the last page says so


async def test_paging_is_stable_while_jobs_change_state(store):
    """Tokens follow the submission sequence: no job twice, order kept, every job that matched throughout listed."""
    await store.put_node(make_node(gpus=1, mem_mib=100_000))
    epoch = await store.acquire_leadership("a", 5)
    jobs = [(await store.create_job(make_job()))[0] for _ in range(30)]
    ids = [j.job_id for j in jobs]
    current = {j.job_id: j for j in jobs}

    async def finish(job_id):
        current[job_id] = await store.update_job(current[job_id], _with(current[job_id], state=JobState.CANCELLED,
                                                                        reason=StateReason.CANCELLED_BY_CLIENT))

    async def place(job_id):
        (current[job_id],) = await store.commit_placements(epoch, [(current[job_id], placement_on("node-1", 0, 1.0, 10))])

    # pending jobs, 4 a page; between pages jobs move: ones already listed, ones not listed yet
    seen, moved_out, token, step = [], set(), "", 0
    while True:
        page, token = await store.list_jobs(states=[JobState.PENDING], page_size=4, page_token=token)
        seen += [j.job_id for j in page]
        if not token:
            break
        ahead = ids.index(seen[-1]) - 1 - step % 3  # one job listed already, one still ahead (older)
        await (finish if step % 2 else place)(seen[-1])
        if ahead >= 0:
            await (finish if step % 2 else place)(ids[ahead])
            moved_out.add(ids[ahead])
        step += 1
    assert len(seen) == len(set(seen)) and seen == sorted(seen, key=ids.index, reverse=True)
    assert moved_out and not moved_out & set(seen)  # left PENDING before their page: not listed
    assert set(ids) - moved_out <= set(seen)  # every job pending until its page was listed

    # no filter: every job exactly once while states keep changing
    seen, token, flip = [], "", 0
    while True:
        page, token = await store.list_jobs(page_size=7, page_token=token)
        seen += [j.job_id for j in page]
        if not token:
            break
        for job_id in ids[flip:flip + 3]:
            if current[job_id].state is JobState.PENDING:
                await finish(job_id)
        flip += 3
    assert seen == ids[::-1]


async def test_sweep_deletes_old_and_excess_finished_jobs_never_active_ones(store):
    where, epoch = await _jobs_in_every_state(store)
    active = {j for (_, s), j in where.items() if not s.terminal}
    finished = {j for (_, s), j in where.items() if s.terminal}
    requests = {j: (await store.get_job(j)).request_id for j in where.values()}
    # nothing is due: young and few
    assert (await store.sweep_finished_jobs(3600, 100)).deleted == 0
    # at most 4 finished kept: the 2 oldest-finished go (team-a's succeeded and failed finished first)
    res = await store.sweep_finished_jobs(3600, 4)
    assert (res.deleted, res.more) == (2, False)
    gone = {where["team-a", JobState.SUCCEEDED], where["team-a", JobState.FAILED]}
    for job_id in gone:
        with pytest.raises(NotFound):
            await store.get_job(job_id)
        assert await store.find_job_by_request("team-a", requests[job_id]) is None
    assert not gone & {j.job_id for j in await _all_pages(store, 2)}
    assert not gone & {j.job_id for j in await _all_pages(store, 2, states=[JobState.SUCCEEDED, JobState.FAILED])}
    assert not gone & {j.job_id for j in await _all_pages(store, 2, tenant="team-a")}
    # later than the retention: every finished job goes, in bounded steps; active jobs never do
    later = time.time() + 7200
    steps = []
    while True:
        res = await store.sweep_finished_jobs(3600, 100, limit=3, now=later)
        steps.append(res.deleted)
        if not res.more:
            break
    assert sum(steps) == len(finished) - 2 and max(steps) <= 3
    assert (await store.sweep_finished_jobs(0, 0, now=later + 10 ** 6)).deleted == 0  # active jobs: never
    assert {j.job_id for j in await store.list_active_jobs()} == active
    assert {j.job_id for j in await _all_pages(store, 2)} == active
    for job_id in finished:
        with pytest.raises(NotFound):
            await store.get_job(job_id)
    assert await store.list_jobs(states=[JobState.CANCELLED]) == ([], "")
    # a request id of a deleted job is free again: SubmitJob creates a new job
    old = where["team-b", JobState.CANCELLED]
    again, created = await store.create_job(make_job(spec=make_spec(tenant="team-b"), request_id=requests[old]))
    assert created and again.job_id != old
    # an active job's request id still answers with that job (within its tenant: request ids are each tenant's own)
    pending = where["team-b", JobState.PENDING]
    same, created = await store.create_job(make_job(spec=make_spec(tenant="team-b"), request_id=requests[pending]))
    assert not created and same.job_id == pending
    other, created = await store.create_job(make_job(request_id=requests[pending]))
    assert created and other.job_id != pending


async def test_a_job_leaving_a_terminal_state_is_never_swept_nor_listed_as_finished(store):
    job, _ = await store.create_job(make_job())
    done = await store.update_job(job, _with(job, state=JobState.CANCELLED, reason=StateReason.CANCELLED_BY_CLIENT))
    back = await store.update_job(done, _with(done, state=JobState.PENDING, reason=StateReason.SUBMITTED))
    assert await store.list_jobs(states=[JobState.CANCELLED]) == ([], "")
    assert [j.job_id for j in (await store.list_jobs(states=[JobState.PENDING]))[0]] == [job.job_id]
    assert (await store.sweep_finished_jobs(0, 0, now=time.time() + 10)).deleted == 0
    assert await store.get_job(job.job_id) == back
    # finished again later: then it is due, as any finished job
    again = await store.update_job(back, _with(back, state=JobState.FAILED, reason=StateReason.OWN_FAILURE))
    assert [j.job_id for j in (await store.list_jobs(states=[JobState.FAILED, JobState.CANCELLED]))[0]] == [again.job_id]
    assert (await store.sweep_finished_jobs(0, 0, now=time.time() + 10)).deleted == 1
    assert await store.list_jobs() == ([], "")


async def test_sweep_rejects_negative_limits(store):
    with pytest.raises(ValueError):
        await store.sweep_finished_jobs(-1, 10)
    with pytest.raises(ValueError):
        await store.sweep_finished_jobs(10, 10, limit=0)


async def test_other_readers_of_active_jobs_keep_their_own_decode_cache(store):
    """GetClusterState's read (for_round=False) is memoised on its own and leaves the round's memoised decodes."""
    a, _ = await store.create_job(make_job())
    b, _ = await store.create_job(make_job())
    done = await store.update_job(b, _with(b, state=JobState.CANCELLED, reason=StateReason.CANCELLED_BY_CLIENT))
    assert done.state is JobState.CANCELLED
    by_round = await store.list_active_jobs()
    by_reader = await store.list_active_jobs(for_round=False)
    assert [j.job_id for j in by_reader] == [a.job_id] == [j.job_id for j in by_round]
    assert (await store.list_active_jobs(for_round=False))[0] is by_reader[0]  # unchanged record: not decoded again
    assert (await store.list_active_jobs())[0] is by_round[0]  # the round's cache survived the reader's calls
    moved = await store.update_job(a, _with(a, message="m"))
    assert (await store.list_active_jobs(for_round=False))[0] == moved


async def test_resize_in_place_keeps_the_placement_identity_and_conserves_capacity(store):
    from elastico.domain import placement_id

    await store.put_node(make_node(gpus=1, mem_mib=16384))
    epoch = await store.acquire_leadership("a", 5)
    svc, _ = await store.create_job(make_job())
    train, _ = await store.create_job(make_job())
    svc, train = await store.commit_placements(epoch, [(svc, placement_on("node-1", 0, 30.0, 2048)),
                                                       (train, placement_on("node-1", 0, 70.0, 8192))])
    # growing the service while the training tenant still holds 70 % is refused, nothing written
    grown = await store.resize_in_place(epoch, [(svc, placement_on("node-1", 0, 50.0, 2048), "grow")])
    assert isinstance(grown[0], Conflict)
    assert (await store.get_node("node-1")).gpus[0].allocated_share_pct == 100.0
    # training first: it is released (relaunched smaller later); then the service grows in place
    await store.release_job(epoch, train, JobState.PENDING, StateReason.RESIZED, "restart at 50%")
    [new] = await store.resize_in_place(epoch, [(svc, placement_on("node-1", 0, 50.0, 2048), "forecast rose")])
    assert new.state is svc.state and new.reason is StateReason.RESIZED and new.message == "forecast rose"
    assert placement_id(new.placement) == placement_id(svc.placement)  # the agent keeps the process
    assert new.placement.slices[0].compute_share_pct == 50.0
    gpu = (await store.get_node("node-1")).gpus[0]
    assert (gpu.allocated_share_pct, gpu.allocated_mem_mib) == (50.0, 2048)
    assert (await store.get_desired("node-1"))[1][svc.job_id].slices[0].compute_share_pct == 50.0
    # a stale version, a stale epoch and a move to other GPUs are refused
    assert isinstance((await store.resize_in_place(epoch, [(svc, placement_on("node-1", 0, 40.0, 2048), "x")]))[0], Conflict)
    with pytest.raises(StaleEpoch):
        await store.resize_in_place(epoch + 1, [(new, placement_on("node-1", 0, 40.0, 2048), "x")])
    with pytest.raises(WrongState):
        await store.resize_in_place(epoch, [(new, placement_on("node-1", 1, 40.0, 2048), "x")])
    shrunk = await store.resize_in_place(epoch, [(new, placement_on("node-1", 0, 20.0, 2048), "forecast fell")])
    assert (await store.get_node("node-1")).gpus[0].allocated_share_pct == 20.0 and shrunk[0].version == new.version + 1


async def test_demand_history_is_idempotent_per_window_end_and_trimmed(store):
    from elastico.domain import DemandReport

    reports = [DemandReport("svc-1", 1000.0 + i, 1.0, float(i), 5.0, 9.0, 0.0, "api:x") for i in range(10)]
    assert await store.record_demand(reports, keep_s=5.0) == [True] * 10
    assert await store.record_demand(reports[-2:], keep_s=5.0) == [False, False]  # retried windows: not twice
    assert await store.record_demand([reports[0]], keep_s=5.0) == [False]  # older than the kept span
    hist = await store.demand_history(["svc-1", "svc-2"], since_s=0.0)
    assert list(hist) == ["svc-1"]
    assert [r.window_end_s for r in hist["svc-1"]] == [1004.0 + i for i in range(6)]  # newest - 5 s .. newest
    assert hist["svc-1"][-1] == reports[-1]
    assert [r.request_rate_rps for r in (await store.demand_history(["svc-1"], since_s=1008.0))["svc-1"]] == [8.0, 9.0]


async def test_a_moving_service_keeps_its_old_slices_until_its_new_replica_runs(store):
    from elastico.domain import drain_key, placement_id

    await store.put_node(make_node("n1", gpus=1))
    await store.put_node(make_node("n2", gpus=1))
    epoch = await store.acquire_leadership("a", 5)
    svc, _ = await store.create_job(make_job())
    [svc] = await store.commit_placements(epoch, [(svc, placement_on("n1", 0, 40.0, 2048))])
    with pytest.raises(WrongState):  # only a running service moves
        await store.move_services(epoch, [(svc, placement_on("n2", 0, 60.0, 2048), "move")])
    svc = await store.update_job(svc, replace(svc, state=JobState.RUNNING, reason=StateReason.STARTED))
    old_id = placement_id(svc.placement)
    [moving] = await store.move_services(epoch, [(svc, placement_on("n2", 0, 60.0, 2048), "move")])
    assert moving.state is JobState.PLACED and placement_id(moving.draining) == old_id
    # both replicas booked and desired: the old one under its drain key on n1, the new one on n2
    assert [(await store.get_node(n)).gpus[0].allocated_share_pct for n in ("n1", "n2")] == [40.0, 60.0]
    assert list((await store.get_desired("n1"))[1]) == [drain_key(svc.job_id)]
    assert placement_id((await store.get_desired("n1"))[1][drain_key(svc.job_id)]) == old_id
    assert list((await store.get_desired("n2"))[1]) == [svc.job_id]
    with pytest.raises(WrongState):  # one move at a time
        await store.move_services(epoch, [(moving, placement_on("n2", 0, 10.0, 1024), "again")])
    [done] = await store.finish_moves(epoch, [moving])
    assert done.state is JobState.RUNNING and done.draining is None
    assert [(await store.get_node(n)).gpus[0].allocated_share_pct for n in ("n1", "n2")] == [0.0, 60.0]
    assert (await store.get_desired("n1"))[1] == {}


async def test_releasing_a_moving_service_frees_both_replicas(store):
    from elastico.domain import drain_key

    await store.put_node(make_node("n1", gpus=2))
    epoch = await store.acquire_leadership("a", 5)
    svc, _ = await store.create_job(make_job())
    [svc] = await store.commit_placements(epoch, [(svc, placement_on("n1", 0, 40.0, 2048))])
    svc = await store.update_job(svc, replace(svc, state=JobState.RUNNING, reason=StateReason.STARTED))
    [moving] = await store.move_services(epoch, [(svc, placement_on("n1", 1, 40.0, 2048), "move")])
    desired = (await store.get_desired("n1"))[1]
    assert sorted(desired) == sorted([svc.job_id, drain_key(svc.job_id)])  # same node: both keys
    gone = await store.release_job(epoch, moving, JobState.CANCELLED, StateReason.CANCELLED_BY_CLIENT)
    assert gone.draining is None and gone.placement is None
    assert [g.allocated_share_pct for g in (await store.get_node("n1")).gpus] == [0.0, 0.0]
    assert (await store.get_desired("n1"))[1] == {}
