"""Pure halves of a round: reports -> transitions, state -> ClusterView, Decision -> store operations."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastico.domain import (
    POD_LABEL,
    POD_OWNER_LABEL,
    POD_UID_LABEL,
    GpuSlice,
    Job,
    JobKind,
    JobState,
    Placement,
    Shape,
    StateReason,
    Workload,
    placement_id,
)
from services.allocator.clients import GrpcSolver
from services.allocator.estimate import TypeResolver, default_types, split_type_name
from services.allocator.plan import (
    BARE_POD_GONE_MESSAGE,
    BARE_POD_WHY,
    POD_GONE_MESSAGE,
    build_view,
    still_running,
    transitions,
    translate,
)
from services.allocator.policy import POLICY_NAMES, Decision, make_policy, options_for
from services.pricer.core import PricingProblem, SolverOptions
from tests.conftest import make_job, make_node, make_spec

NOW = 1_000_000.0
TYPES = default_types()
RESOLVE = TypeResolver(TYPES)


def node(node_id="n1", gpus=2, age_s=0.0, ready=True, **kw):
    return replace(make_node(node_id, gpus=gpus, **kw), last_heartbeat_s=NOW - age_s, ready=ready)


def placed(job: Job, node_id="n1", gpus=(0,), share=50.0, state=JobState.RUNNING, epoch=3) -> Job:
    p = Placement(job.job_id, 0, Shape(len(gpus), share, int(16384 * share // 100)),
                  tuple(GpuSlice(node_id, g, share, int(16384 * share // 100)) for g in gpus), epoch=epoch, committed_at_s=NOW - 10)
    return replace(job, state=state, reason=StateReason.PLACED, placement=p, version=2)


def wl(job: Job, status="running", reason=None, progress=0.0, pid_override=None) -> Workload:
    return Workload(job.job_id, (0,), 50.0, 8192, status=status, reason=reason, progress_steps=progress,
                    placement_id=pid_override or placement_id(job.placement))


@pytest.mark.parametrize(("status", "reason", "state", "want_reason"), [
    ("succeeded", StateReason.COMPLETED, JobState.SUCCEEDED, StateReason.COMPLETED),
    ("failed", StateReason.OWN_FAILURE, JobState.FAILED, StateReason.OWN_FAILURE),
    ("failed", StateReason.COTENANT_FAULT, JobState.PENDING, StateReason.COTENANT_FAULT),
    ("killed", StateReason.PREEMPTED, JobState.PENDING, StateReason.PREEMPTED),
], ids=["completed", "own-failure", "cotenant-fault-requeued", "stopped-requeued"])
def test_ended_workloads_become_job_outcomes(status, reason, state, want_reason):
    job = placed(make_job())
    [t] = transitions([job], {"n1": node()}, {"n1": {job.job_id: wl(job, status, reason, progress=70)}}, NOW, 15, 30)
    assert (t.state, t.reason, t.release) == (state, want_reason, True)
    assert t.job.progress_steps == 70  # where a requeued job resumes


def test_running_report_marks_placed_job_running_once():
    job = placed(make_job(), state=JobState.PLACED)
    [t] = transitions([job], {"n1": node()}, {"n1": {job.job_id: wl(job)}}, NOW, 15, 30)
    assert t.state is JobState.RUNNING and not t.release
    running = replace(job, state=JobState.RUNNING)
    assert transitions([running], {"n1": node()}, {"n1": {job.job_id: wl(job)}}, NOW, 15, 30) == []


def test_report_of_an_older_placement_is_ignored():
    job = placed(make_job())
    old = wl(job, "succeeded", StateReason.COMPLETED, pid_override="1:123.000000")
    assert transitions([job], {"n1": node()}, {"n1": {job.job_id: old}}, NOW, 15, 30) == []


@pytest.mark.parametrize(("age_s", "lost"), [(10, False), (40, False), (46, True)], ids=["fresh", "stale-in-grace", "past-grace"])
def test_silent_node_requeues_its_jobs_after_the_grace_period(age_s, lost):
    job = placed(make_job())
    out = transitions([job], {"n1": node(age_s=age_s)}, {}, NOW, 15, 30)
    assert bool(out) == lost
    if lost:
        assert out[0].state is JobState.PENDING and out[0].reason is StateReason.NODE_LOST


def test_view_maps_rows_and_hides_stale_nodes_and_drained_gpus():
    a, b = placed(make_job(), "n1", (1,), 50.0), make_job(submitted_at_s=NOW - 5)
    c = make_job(submitted_at_s=NOW - 50)
    n1 = node("n1", gpus=2)
    n1 = replace(n1, gpus=(n1.gpus[0], replace(n1.gpus[1], allocated_share_pct=50.0, allocated_mem_mib=8192)))
    n2 = node("n2", gpus=2, age_s=100)  # stale: no rows
    n3 = node("n3", gpus=2)
    n3 = replace(n3, gpus=(replace(n3.gpus[0], healthy=False), n3.gpus[1]))
    view, idx = build_view([b, a, c], [n2, n3, n1], TYPES, RESOLVE, NOW, 15, time_scale=2.0)
    assert idx.gpus == [("n1", 0), ("n1", 1), ("n3", 1)]
    assert [j.job_id for j in idx.jobs] == [a.job_id, c.job_id, b.job_id]  # placed first, then pending by submission
    assert view.jobs.job_ids == (a.job_id, c.job_id, b.job_id)  # rows are positions: the policy's memos need ids
    assert list(view.pending) == [1, 2] and list(view.running) == [0]
    assert view.gpu_job[1, 0] == 0 and view.gpu_share[1, 0] == 50.0 and (view.gpu_job[[0, 2]] < 0).all()
    assert view.now_s == NOW * 2.0 and view.jobs.queued_since_s[1] == c.submitted_at_s * 2.0
    assert idx.free[("n1", 1)] == [5000, 8192] and idx.free[("n3", 0)] == [0, 0]


def test_view_carries_readings_taken_with_the_current_co_tenants_only():
    from services.allocator.rounds import Scheduler

    a, b = placed(make_job(), "n1", (0,)), placed(make_job(), "n1", (0,))
    lone, waiting = placed(make_job(), "n1", (1,)), make_job()
    reports = {"n1": {a.job_id: replace(wl(a), norm_throughput=0.6, cotenants=(b.job_id,)),
                      b.job_id: replace(wl(b), norm_throughput=0.7, cotenants=()),  # taken before a joined
                      lone.job_id: replace(wl(lone, pid_override="1:2.000000"), norm_throughput=0.5)}}  # old placement
    readings = Scheduler._readings([a, b, lone, waiting], reports)
    assert readings == {a.job_id: (0.6, (b.job_id,)), b.job_id: (0.7, ())}  # the stale incarnation is dropped
    view, idx = build_view([a, b, lone, waiting], [node("n1")], TYPES, RESOLVE, NOW, 15, observed=readings)
    got = dict(zip((j.job_id for j in idx.jobs), view.jobs.observed_norm.tolist()))
    cap = min(1.0, 0.5 / view.jobs.solo_util[0])  # a's 50 % caps its speed alone (ResNet-50 saturates a GPU)
    assert cap < 1.0 and got[a.job_id] == pytest.approx(0.6 * cap)  # the reading against its shape, as a pace
    assert all(np.isnan(got[j.job_id]) for j in (b, lone, waiting))  # co-tenants changed / no reading / pending


def test_a_reading_at_full_shape_speed_of_a_capped_job_says_no_pace():
    """An agent reads a job's speed against its shape; a job its share caps that runs at its shape's full speed
    runs at a pace of at least the cap, which says nothing a pair estimate may be lowered to."""
    a, b = placed(make_job(), "n1", (0,)), placed(make_job(), "n1", (0,))
    readings = {a.job_id: (1.0, (b.job_id,)), b.job_id: (0.8, (a.job_id,))}
    view, idx = build_view([a, b], [node("n1")], TYPES, RESOLVE, NOW, 15, observed=readings)
    got = dict(zip((j.job_id for j in idx.jobs), view.jobs.observed_norm.tolist()))
    cap = min(1.0, 0.5 / view.jobs.solo_util[0])
    assert np.isnan(got[a.job_id]) and got[b.job_id] == pytest.approx(0.8 * cap)


def test_translate_keeps_fitting_placements_and_drops_the_rest():
    jobs = [make_job(submitted_at_s=NOW - i) for i in range(3)]
    view, idx = build_view(jobs, [node("n1", gpus=1)], TYPES, RESOLVE, NOW, 15)
    d = Decision(place=[(0, np.array([0]), 75.0), (1, np.array([0]), 50.0), (2, np.array([0]), 25.0)])
    plan = translate(d, view, idx)
    assert [(j.job_id, p.slices[0].compute_share_pct) for j, p in plan.place] == [(idx.jobs[0].job_id, 75.0), (idx.jobs[2].job_id, 25.0)]
    assert [j for j, _ in plan.dropped] == [idx.jobs[1].job_id]
    assert all(p.slices[0].mem_mib == int(16384 * p.slices[0].compute_share_pct // 100) for _, p in plan.place)


def test_a_training_placement_is_limited_by_its_share_only_next_to_a_service():
    """limited_slots, live: slices book the share either way; the shape (the MPS limit the node agent launches
    with) is the share on a GPU a service holds -- running, or placed by the same decision -- and 100 % elsewhere."""
    svc = placed(make_job(spec=make_spec(kind=JobKind.INFERENCE)), "n1", (0,), 50.0)
    queued = [make_job(submitted_at_s=NOW - i) for i in range(3)] + [make_job(spec=make_spec(kind=JobKind.INFERENCE))]
    n1 = node("n1", gpus=3)
    n1 = replace(n1, gpus=(replace(n1.gpus[0], allocated_share_pct=50.0, allocated_mem_mib=8192), *n1.gpus[1:]))
    view, idx = build_view([svc, *queued], [n1], TYPES, RESOLVE, NOW, 15)
    rows = {j.job_id: r for r, j in enumerate(idx.jobs)}
    d = Decision(place=[(rows[queued[3].job_id], np.array([2]), 25.0), (rows[queued[0].job_id], np.array([0]), 25.0),
                        (rows[queued[1].job_id], np.array([1]), 50.0), (rows[queued[2].job_id], np.array([2]), 50.0)])
    plan = translate(d, view, idx, unlimited_training=True)
    got = {j.job_id: (p.shape.compute_share_pct, p.slices[0].compute_share_pct, p.slices[0].mem_mib) for j, p in plan.place}
    assert got[queued[0].job_id] == (25.0, 25.0, 4096)  # next to the running service: its share is its limit
    assert got[queued[1].job_id] == (100.0, 50.0, 8192)  # alone: unlimited, half the GPU booked
    assert got[queued[2].job_id] == (50.0, 50.0, 8192)  # next to the service this decision places
    assert got[queued[3].job_id][0] == 25.0  # a service's shape is its share
    limits = translate(d, view, idx)  # every share a limit (ELASTICO_UNLIMITED_TRAINING=0, or another policy)
    assert all(p.shape.compute_share_pct == p.slices[0].compute_share_pct for _, p in limits.place)


def test_a_job_resized_off_a_departed_services_limit_relaunches_without_one():
    """A training job still at the 25 % limit it launched with next to a service that has left, resized by the
    policy to an unlimited slice: live it relaunches with no limit (shape 100 %) and half the GPU booked; with
    every share a limit, the resize keeps the share as the limit."""
    run = placed(make_job(), "n1", (0,), 25.0)
    n1 = node("n1", gpus=1)
    n1 = replace(n1, gpus=(replace(n1.gpus[0], allocated_share_pct=25.0, allocated_mem_mib=4096),))
    view, idx = build_view([run], [n1], TYPES, RESOLVE, NOW, 15)
    for unlimited, limit in ((True, 100.0), (False, 50.0)):
        plan = translate(Decision(resize=[(0, 50.0)]), view, idx, unlimited_training=unlimited)
        assert [(j.job_id, p.shape.compute_share_pct, p.slices[0].compute_share_pct) for j, p in plan.resize] == [
            (run.job_id, limit, 50.0)]


def test_the_view_flags_training_whose_share_is_the_limit_it_launched_with():
    """JobTable.limited: a training job whose shape's compute share is below 100 % runs under that MPS limit (it
    launched next to a service), whatever its GPU holds now; one launched without a limit (shape 100 %, half the
    GPU booked) and a queued job are not flagged."""
    lim = placed(make_job(), "n1", (0,), 50.0)
    free = placed(make_job(), "n1", (1,), 50.0)
    free = replace(free, placement=replace(free.placement, shape=replace(free.placement.shape, compute_share_pct=100.0)))
    n1 = node("n1", gpus=2)
    n1 = replace(n1, gpus=tuple(replace(g, allocated_share_pct=50.0, allocated_mem_mib=8192) for g in n1.gpus))
    view, idx = build_view([lim, free, make_job()], [n1], TYPES, RESOLVE, NOW, 15)
    assert [j.job_id for j in idx.jobs] == [lim.job_id, free.job_id, idx.jobs[2].job_id]
    assert view.jobs.limited.tolist() == [True, False, False]


def test_translate_preempt_then_place_is_a_resize():
    run = placed(make_job(), "n1", (0,), 50.0)
    n1 = node("n1", gpus=1)
    n1 = replace(n1, gpus=(replace(n1.gpus[0], allocated_share_pct=50.0, allocated_mem_mib=8192),))
    view, idx = build_view([run], [n1], TYPES, RESOLVE, NOW, 15)
    plan = translate(Decision(preempt=[0], place=[(0, np.array([0]), 100.0)]), view, idx)
    assert plan.preempt == [] and [(j.job_id, p.slices[0].compute_share_pct) for j, p in plan.resize] == [(run.job_id, 100.0)]


def test_a_relaunch_on_another_node_is_a_preemption_now_and_a_placement_after_the_stop():
    """Two agents would stop and start it with nothing ordering them: the job could run on both nodes at once."""
    run = placed(make_job(), "n1", (0,), 50.0)
    n1 = node("n1", gpus=1)
    n1 = replace(n1, gpus=(replace(n1.gpus[0], allocated_share_pct=50.0, allocated_mem_mib=8192),))
    view, idx = build_view([run], [n1, node("n2", gpus=1)], TYPES, RESOLVE, NOW, 15)
    plan = translate(Decision(preempt=[0], place=[(0, np.array([1]), 100.0)]), view, idx)
    assert idx.gpus[1] == ("n2", 0)
    assert plan.preempt == [run] and plan.resize == [] and plan.place == []
    assert plan.waiting == [(run.job_id, "relaunches on another node once its current run has stopped")]


def test_a_pending_job_still_reported_running_by_a_live_node_is_held():
    gone = replace(placed(make_job(), "n1"), state=JobState.PENDING, placement=None)
    report = {"n1": {gone.job_id: wl(placed(gone, "n1"))}}
    nodes = {"n1": node("n1")}
    assert still_running([gone], nodes, report, NOW, 45) == {gone.job_id}
    stopped = {"n1": {gone.job_id: wl(placed(gone, "n1"), "killed", StateReason.PREEMPTED)}}
    assert still_running([gone], nodes, stopped, NOW, 45) == set()
    assert still_running([gone], {"n1": node("n1", age_s=46)}, report, NOW, 45) == set()  # a lost node holds nothing
    runs = placed(make_job(), "n1")  # a placed job's own report is no reason to hold anything
    assert still_running([runs], nodes, {"n1": {runs.job_id: wl(runs)}}, NOW, 45) == set()


def test_explicit_shapes_keep_their_memory_limit_and_index():
    spec = make_spec(shapes=(Shape(1, 50.0, 4000, throughput=5.0), Shape(1, 100.0, 9000, throughput=10.0)))
    view, idx = build_view([make_job(spec=spec)], [node("n1", gpus=1)], TYPES, RESOLVE, NOW, 15)
    [(_, p)] = translate(Decision(place=[(0, np.array([0]), 100.0)]), view, idx).place
    assert (p.shape_index, p.slices[0].mem_mib) == (1, 9000)
    assert idx.iso_rate[0] == 10.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.sampled_from([25.0, 50.0, 75.0, 100.0])), max_size=12))
def test_translate_never_exceeds_committed_capacity(decisions):
    jobs = [make_job(submitted_at_s=NOW - i) for i in range(6)]
    view, idx = build_view(jobs, [node("n1", gpus=2), node("n2", gpus=2)], TYPES, RESOLVE, NOW, 15)
    plan = translate(Decision(place=[(r, np.array([g]), s) for r, g, s in decisions]), view, idx)
    used: dict = {}
    for _, p in plan.place:
        for s in p.slices:
            used[(s.node_id, s.gpu_index)] = used.get((s.node_id, s.gpu_index), 0) + s.compute_share_pct
    assert all(v <= 100.0 for v in used.values())
    assert len({j.job_id for j, _ in plan.place}) == len(plan.place)


def test_type_resolution_follows_the_simulators_mapping():
    assert TYPES.names[RESOLVE(make_spec(model_family="ResNet-18", batch_size=64))] == "ResNet-18 (batch size 64)"
    fam = TYPES.names[RESOLVE(make_spec(model_family="ResNet-18", batch_size=3))]
    assert split_type_name(fam)[0] == "ResNet-18"
    assert RESOLVE(make_spec(model_family="NoSuchModel")) < TYPES.inference_index
    # spelled otherwise, the same type, as the simulator and the node agent read it (case and punctuation ignored)
    for spelling in ("resnet 18", "RESNET_18", "ResNet18"):
        assert RESOLVE(make_spec(model_family=spelling, batch_size=64)) == RESOLVE(make_spec(model_family="ResNet-18", batch_size=64))


def test_pricer_down_falls_back_to_last_good_prices_within_capacity():
    solver = GrpcSolver("127.0.0.1:1", timeout_s=0.2)
    u = np.array([[1.0, 2.0], [1.0, 3.0], [0.5, 0.6]])
    d = np.array([[[25, 1], [50, 1]], [[25, 1], [100, 1]], [[25, 1], [50, 1]]], float)
    prob = PricingProblem(utility=u, demand=d, mask=np.ones((3, 2), bool), capacity=np.array([100.0, 4.0]))
    res = solver(prob, SolverOptions(), None)
    solver.close()
    assert solver.degraded.startswith("pricer unavailable")
    load = sum(d[j, c] for j, c in enumerate(res.choice) if c >= 0)
    assert (np.asarray(load) <= prob.capacity).all() and (res.choice >= 0).any()


def test_translate_keeps_jobs_at_gang_sizes_they_declare():
    """A grow (preempt + place on more GPUs) of a job without such a shape is dropped whole: it keeps running."""
    job = placed(make_job(), gpus=(0,), share=100.0)
    elastic = placed(make_job(spec=make_spec(shapes=(Shape(1, 100.0, 16384), Shape(2, 100.0, 16384)))),
                     gpus=(1,), share=100.0)
    n1 = node(gpus=4)
    n1 = replace(n1, gpus=tuple(replace(g, allocated_share_pct=100.0, allocated_mem_mib=16384) if g.index < 2 else g
                                for g in n1.gpus))
    view, idx = build_view([job, elastic], [n1], TYPES, RESOLVE, NOW, 15)
    rows = {j.job_id: r for r, j in enumerate(idx.jobs)}
    a, b = rows[job.job_id], rows[elastic.job_id]
    plan = translate(Decision(preempt=[a, b], place=[(a, np.array([0, 2]), 100.0), (b, np.array([1, 3]), 100.0)]), view, idx)
    assert plan.preempt == [] and [j.job_id for j, _ in plan.resize] == [elastic.job_id]
    assert len(plan.resize[0][1].slices) == 2
    assert plan.dropped == [(job.job_id, "gang of 2 GPUs: the job runs on 1")]


def test_view_carries_the_gang_sizes_each_job_allows_and_translate_never_resizes_a_gang():
    """A queued job started on more GPUs than it allows is not started on fewer instead: the decision is the
    policy's, and the policy sees the sizes in the view (its request without shapes, else its declared counts)."""
    job, two = make_job(), make_job(spec=make_spec(shapes=(Shape(1, 50.0, 8192), Shape(2, 100.0, 16384))))
    view, idx = build_view([job, two], [node(gpus=4)], TYPES, RESOLVE, NOW, 15)
    rows = {j.job_id: r for r, j in enumerate(idx.jobs)}
    assert view.jobs.gang_sizes[rows[job.job_id]] == (1,) and view.jobs.gang_sizes[rows[two.job_id]] == (1, 2)
    plan = translate(Decision(place=[(rows[job.job_id], np.array([1, 2, 3]), 100.0)]), view, idx)
    assert plan.place == [] and plan.dropped == [(job.job_id, "gang of 3 GPUs: the job runs on 1")]


def test_view_keeps_the_type_utilisation_of_a_job_its_declared_shapes_cap():
    """A job declaring 1 % of a GPU is read at its best declared shape (solo_util 0.01), while its type's
    utilisation stays in the view (``type_util``): what its share caps its activity against."""
    tiny = make_job(spec=make_spec(model_family="ResNet-50", batch_size=64, shapes=(Shape(1, 1.0, 1024),)))
    plain = make_job(spec=make_spec(model_family="ResNet-50", batch_size=64))
    view, idx = build_view([tiny, plain], [node(gpus=2)], TYPES, RESOLVE, NOW, 15)
    rows = {j.job_id: r for r, j in enumerate(idx.jobs)}
    t, p = rows[tiny.job_id], rows[plain.job_id]
    assert view.jobs.solo_util[t] == pytest.approx(0.01) and view.jobs.activity_util(t) == view.jobs.solo_util[p] > 0.5
    assert view.jobs.activity_util(p) == view.jobs.solo_util[p]
    view, _ = build_view([plain], [node(gpus=2)], TYPES, RESOLVE, NOW, 15)
    assert view.jobs.type_util is None  # no job is capped below its type: the simulator's view


def test_view_groups_gpus_by_node_and_translate_drops_a_split_gang():
    """The live view carries each GPU's node; a 2-GPU gang across two nodes is dropped, inside one it is kept;
    a gang of a size the job does not declare is dropped, never shrunk."""
    a, b = make_job(spec=make_spec(shapes=(Shape(2, 100.0, 16384),))), make_job(spec=make_spec(shapes=(Shape(2, 100.0, 16384),)))
    c = make_job(spec=make_spec(shapes=(Shape(2, 100.0, 16384),)))
    view, idx = build_view([a, b, c], [node("n1", gpus=2), node("n2", gpus=4)], TYPES, RESOLVE, NOW, 15)
    assert view.topo.node_size.tolist() == [2, 4] and view.topo.gpu_node.tolist() == [0, 0, 1, 1, 1, 1]
    rows = {j.job_id: r for r, j in enumerate(idx.jobs)}
    d = Decision(place=[(rows[a.job_id], np.array([1, 2]), 100.0), (rows[b.job_id], np.array([2, 3]), 100.0),
                        (rows[c.job_id], np.array([0, 1, 4, 5]), 100.0)])
    plan = translate(d, view, idx)
    placed_on = {j.job_id: [(s.node_id, s.gpu_index) for s in p.slices] for j, p in plan.place}
    assert sorted(plan.dropped) == sorted([
        (a.job_id, "gang [1, 2] breaks the node topology (one node, or whole nodes plus one partial)"),
        (c.job_id, "gang of 4 GPUs: the job runs on 2")])
    assert placed_on == {b.job_id: [("n2", 0), ("n2", 1)]}


# --------------------------------------------------------------------------------------------------
# Declared shapes: every policy places a job that declares its shapes in exactly one of them


def _declared_pairs(job: Job) -> set[tuple[int, float]]:
    return {(s.num_gpus, s.compute_share_pct) for s in job.spec.shapes}


def _assert_declared_placement(job: Job, p: Placement) -> None:
    """``p`` is exactly one of ``job``'s declared shapes: its index, its GPUs, its share and memory on every slice."""
    assert 0 <= p.shape_index < len(job.spec.shapes), (job.job_id, p.shape_index)
    want = job.spec.shapes[p.shape_index]
    assert p.shape == want
    assert len(p.slices) == want.num_gpus
    assert all((s.compute_share_pct, s.mem_mib) == (want.compute_share_pct, want.mem_mib) for s in p.slices)


def _commit(jobs: list[Job], nodes: list, plan, now: float) -> tuple[list[Job], list]:
    """Apply a plan the way the store does: preempted jobs back to PENDING, placements RUNNING, GPU usage recounted."""
    by_id = {j.job_id: j for j in jobs}
    for j in plan.preempt:
        by_id[j.job_id] = replace(by_id[j.job_id], state=JobState.PENDING, placement=None, queued_at_s=now)
    for j, p in [*plan.resize, *plan.place]:
        by_id[j.job_id] = replace(by_id[j.job_id], state=JobState.RUNNING, placement=replace(p, committed_at_s=now))
    use: dict = {}
    for j in by_id.values():
        for s in j.placement.slices if j.placement else ():
            u = use.setdefault((s.node_id, s.gpu_index), [0.0, 0])
            u[0] += s.compute_share_pct
            u[1] += s.mem_mib
    nodes = [replace(n, last_heartbeat_s=now, gpus=tuple(
        replace(g, allocated_share_pct=use.get((n.node_id, g.index), [0.0, 0])[0],
                allocated_mem_mib=use.get((n.node_id, g.index), [0.0, 0])[1]) for g in n.gpus)) for n in nodes]
    for n in nodes:
        for g in n.gpus:
            assert g.allocated_share_pct <= 100.0 + 1e-6 and g.allocated_mem_mib <= g.mem_total_mib
    return list(by_id.values()), nodes


def _declared_mix() -> list[Job]:
    """Jobs declaring one shape (the outside probe's 10 %/12,000 MiB, and 10 %/1 GiB), two shapes on one GPU
    count, two shapes on two counts, a declared inference service, and jobs without shapes."""
    one = Shape(1, 10.0, 12000)
    small = Shape(1, 10.0, 1024)
    two = (Shape(1, 30.0, 3000), Shape(1, 100.0, 15000))
    counts = (Shape(2, 40.0, 5000), Shape(1, 60.0, 7000))
    specs = ([make_spec(model_family="ResNet-18", batch_size=32, shapes=(one,))] * 3
             + [make_spec(model_family="ResNet-18", batch_size=32, shapes=(small,))] * 3
             + [make_spec(model_family="ResNet-50", batch_size=64, shapes=two)] * 2
             + [make_spec(model_family="Transformer", batch_size=64, shapes=counts)] * 2
             + [make_spec(JobKind.INFERENCE, model_family="ResNet-50", batch_size=1, shapes=(Shape(1, 20.0, 2000),))]
             + [make_spec(model_family="ResNet-18", batch_size=64)] * 3)
    return [make_job(spec=replace(s, training=replace(s.training, total_steps=10**9)) if s.training else s,
                     submitted_at_s=NOW - 100 + i) for i, s in enumerate(specs)]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_places_declared_jobs_in_exactly_a_declared_shape(policy):
    """Rounds of every policy over jobs that declare one or two shapes (and some that declare none): every
    placement and resize of a declaring job, in the policy's decision and in the Placement committed, is one of
    its declared shapes -- GPU count, share and memory -- with a shape_index into its declared list."""
    from services.allocator.estimate import default_kappa, rule_matrix

    kappa = default_kappa()
    pol = make_policy(policy, rule_matrix(TYPES, kappa), kappa, **options_for(policy, {"train_floor": 0.5}))
    jobs, nodes = _declared_mix(), [node("n1", gpus=4), node("n2", gpus=4)]
    now, declared_placements = NOW, 0
    for _ in range(6):
        view, idx = build_view(jobs, nodes, TYPES, RESOLVE, now, 15, max_tenants=8)
        d = pol.decide(view)
        for r, g, sh in d.place:  # the policy's own decision already uses declared shapes only
            job = idx.jobs[int(r)]
            if job.spec.shapes:
                assert (len(np.atleast_1d(g)), float(sh)) in _declared_pairs(job), (policy, job.spec.shapes, len(g), sh)
        for r, sh in d.resize:
            job = idx.jobs[int(r)]
            if job.spec.shapes:
                assert float(sh) in {s for _, s in _declared_pairs(job)}, (policy, job.spec.shapes, sh)
        plan = translate(d, view, idx)
        assert not [w for _, w in plan.dropped if "declared" in w]
        for job, p in [*plan.place, *plan.resize]:
            if job.spec.shapes:
                _assert_declared_placement(job, p)
                declared_placements += 1
        jobs, nodes = _commit(jobs, nodes, plan, now)
        now += 3600.0  # past every hysteresis (min_run_s, shrink_after_s): preemption and resizing may happen
    assert declared_placements > 0
    for job in jobs:
        if job.placement is not None and job.spec.shapes:
            _assert_declared_placement(job, job.placement)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_the_probes_job_runs_with_its_declared_share_and_memory(policy):
    """The outside probe: a job declaring only 10 %/12,000 MiB ran at 50 % with 8,192 MiB, shape_index 1 of a
    one-shape list. Now: its share, its memory, shape_index 0 -- under every policy."""
    from services.allocator.estimate import default_kappa, rule_matrix

    kappa = default_kappa()
    job = make_job(spec=make_spec(shapes=(Shape(num_gpus=1, compute_share_pct=10, mem_mib=12000),)))
    view, idx = build_view([job], [node("n1", gpus=2)], TYPES, RESOLVE, NOW, 15)
    plan = translate(make_policy(policy, rule_matrix(TYPES, kappa), kappa).decide(view), view, idx)
    [(_, p)] = plan.place
    assert p.shape_index == 0 and p.shape == job.spec.shapes[0]
    assert [(s.compute_share_pct, s.mem_mib) for s in p.slices] == [(10.0, 12000)]


def test_view_carries_declared_shapes_and_caps_the_utilisation_at_the_largest():
    one = make_job(spec=make_spec(model_family="Transformer", batch_size=64, shapes=(Shape(1, 10.0, 1024),)))
    plain = make_job(spec=make_spec(model_family="Transformer", batch_size=64))
    view, idx = build_view([one, plain], [node("n1", gpus=1)], TYPES, RESOLVE, NOW, 15)
    rows = {j.job_id: r for r, j in enumerate(idx.jobs)}
    assert view.jobs.any_declared and view.jobs.declared[rows[one.job_id]] == one.spec.shapes
    assert view.jobs.declared[rows[plain.job_id]] == ()
    u = float(TYPES.solo_util[RESOLVE(plain.spec)])
    assert u > 0.1 and view.jobs.solo_util[rows[plain.job_id]] == u
    assert view.jobs.solo_util[rows[one.job_id]] == pytest.approx(0.1)  # MPS caps it at its 10 %


def test_translate_drops_a_shape_the_job_did_not_declare_with_its_relaunch():
    """A placement or resize of a declaring job at a share it did not declare is not applied (no policy-made shape,
    no out-of-range shape_index); a relaunch of it (preempt + place) is dropped whole, so it keeps running."""
    spec = make_spec(shapes=(Shape(1, 10.0, 12000), Shape(1, 40.0, 6000)))
    queued = make_job(spec=spec)
    run = placed(make_job(spec=spec), gpus=(0,), share=10.0)
    run = replace(run, placement=replace(run.placement, slices=(GpuSlice("n1", 0, 10.0, 12000),)))
    n1 = node(gpus=2)
    n1 = replace(n1, gpus=(replace(n1.gpus[0], allocated_share_pct=10.0, allocated_mem_mib=12000), n1.gpus[1]))
    view, idx = build_view([run, queued], [n1], TYPES, RESOLVE, NOW, 15)
    rows = {j.job_id: r for r, j in enumerate(idx.jobs)}
    a, b = rows[run.job_id], rows[queued.job_id]
    plan = translate(Decision(preempt=[a], resize=[], place=[(a, np.array([1]), 50.0), (b, np.array([1]), 50.0)]), view, idx)
    assert (plan.preempt, plan.resize, plan.place) == ([], [], [])
    assert sorted(plan.dropped) == sorted([(run.job_id, "1 x 50.0% is not among the job's declared shapes"),
                                           (queued.job_id, "1 x 50.0% is not among the job's declared shapes")])
    plan = translate(Decision(resize=[(a, 75.0)]), view, idx)
    assert plan.resize == [] and plan.dropped == [(run.job_id, "resize to 75.0% is not among the job's declared shapes")]
    plan = translate(Decision(resize=[(a, 40.0)], place=[(b, np.array([1]), 40.0)]), view, idx)
    [(_, grown)] = plan.resize
    [(_, new)] = plan.place
    assert (grown.shape_index, grown.slices[0].mem_mib, new.shape_index, new.slices[0].mem_mib) == (1, 6000, 1, 6000)


def test_a_declared_shape_whose_memory_does_not_fit_goes_to_an_empty_gpu():
    """The policies plan share and tenant slots, not memory: two jobs declaring 10 %/12,000 MiB both put on GPU 0
    (16,384 MiB) -- the second goes to an empty GPU where its memory fits instead of waiting there for ever; with no
    empty GPU left it waits. Never a smaller memory limit than declared."""
    jobs = [make_job(spec=make_spec(shapes=(Shape(1, 10.0, 12000),)), submitted_at_s=NOW - 10 + i) for i in range(3)]
    view, idx = build_view(jobs, [node("n1", gpus=2)], TYPES, RESOLVE, NOW, 15)
    plan = translate(Decision(place=[(r, np.array([0]), 10.0) for r in range(3)]), view, idx)
    assert [(p.slices[0].gpu_index, p.slices[0].mem_mib) for _, p in plan.place] == [(0, 12000), (1, 12000)]
    assert [j for j, _ in plan.dropped] == [idx.jobs[2].job_id]


def test_a_queued_job_is_planned_only_in_shapes_whose_memory_some_gpu_has():
    """A job whose every declared shape needs more memory than any GPU has stays out of the view (planned anyway it
    would hold GPUs on paper, round after round, that its placement cannot get); one with some shapes that fit is
    planned in those only, on the GPUs with their memory."""
    from services.allocator.fit import hardware_misfit

    huge = make_job(spec=make_spec(shapes=(Shape(1, 50.0, 20000), Shape(1, 100.0, 2**40))), submitted_at_s=NOW - 9)
    mixed = make_job(spec=make_spec(shapes=(Shape(1, 50.0, 30000), Shape(2, 50.0, 12000))), submitted_at_s=NOW - 8)
    plain = make_job(submitted_at_s=NOW - 7)
    nodes = [node("n1", gpus=2, mem_mib=8192), node("n2", gpus=2, mem_mib=16384)]
    view, idx = build_view([huge, mixed, plain], nodes, TYPES, RESOLVE, NOW, 15)
    assert [j.job_id for j in idx.jobs] == [mixed.job_id, plain.job_id]
    assert view.jobs.declared[0] == (Shape(2, 50.0, 12000),)
    assert view.jobs.allowed_gpus[0].tolist() == [False, False, True, True]
    assert view.jobs.allowed_gpus[1] is None
    assert hardware_misfit(huge.spec, [(16384, "v100")]) == ("every declared shape needs at least 20000 MiB per GPU; "
                                                             "the largest healthy GPU has 16384 MiB")
    assert hardware_misfit(mixed.spec, [(16384, "v100")]) == "" and hardware_misfit(plain.spec, [(1, "v100")]) == ""


def test_placement_misfit_says_why_a_job_can_never_run_on_the_healthy_cluster():
    """Too large, memory, allowed nodes, a one-node gang on heterogeneous memory: each is a reason; a job some
    healthy GPUs can host (within one node, or a larger gang over several) gets ""."""
    from services.allocator.fit import healthy_gpus, placement_misfit

    small, big = node("n1", gpus=8, mem_mib=16384), node("n2", gpus=8, mem_mib=16384)
    mixed = node("n3", gpus=2, mem_mib=81920)
    healthy = healthy_gpus([small, big, mixed])
    ok = [make_spec(), make_spec(shapes=(Shape(16, 100.0, 8000),)), make_spec(shapes=(Shape(2, 50.0, 80000),)),
          make_spec(allowed_nodes=("n2",), shapes=(Shape(8, 100.0, 16384),))]
    assert [placement_misfit(s, healthy) for s in ok] == ["", "", "", ""]
    assert placement_misfit(make_spec(shapes=(Shape(32, 100.0, 1),)), healthy) == "needs 32 GPUs; the cluster has 18"
    assert "largest healthy GPU has 81920 MiB" in placement_misfit(make_spec(shapes=(Shape(1, 100.0, 90000),)), healthy)
    # two 80-GiB GPUs exist, but on one node only for a 2-GPU gang; a 4-GPU one must stay in one node too
    assert "on the cluster" in placement_misfit(make_spec(shapes=(Shape(4, 50.0, 80000),)), healthy)
    assert "its allowed nodes (n3)" in placement_misfit(make_spec(allowed_nodes=("n3",), shapes=(Shape(4, 50.0, 100),)), healthy)
    assert "its allowed nodes (gone)" in placement_misfit(make_spec(allowed_nodes=("gone",)), healthy)


def test_a_shape_naming_a_gpu_type_is_planned_and_placed_on_gpus_of_that_type_only():
    """On a cluster of two GPU types, a queued job whose shapes name one type (any letter case) may use only the
    GPUs of that type, whatever the policy picks; one naming a type the cluster lacks stays out of the view and
    gets a reason that names the types; a shape naming no type runs anywhere."""
    from services.allocator.fit import healthy_gpus, placement_misfit

    a100 = make_job(spec=make_spec(shapes=(Shape(1, 50.0, 8000, gpu_type=" A100 "),)), submitted_at_s=NOW - 9)
    h100 = make_job(spec=make_spec(shapes=(Shape(1, 50.0, 8000, gpu_type="h100"),)), submitted_at_s=NOW - 8)
    anyt = make_job(spec=make_spec(shapes=(Shape(1, 50.0, 8000),)), submitted_at_s=NOW - 7)
    nodes = [node("n1", gpus=2, gpu_type="v100"), node("n2", gpus=2, gpu_type="a100")]
    view, idx = build_view([a100, h100, anyt], nodes, TYPES, RESOLVE, NOW, 15)
    assert [j.job_id for j in idx.jobs] == [a100.job_id, anyt.job_id]
    assert view.jobs.allowed_gpus[0].tolist() == [False, False, True, True]
    assert view.jobs.allowed_gpus[1] is None
    healthy = healthy_gpus(nodes)
    assert placement_misfit(a100.spec, healthy) == "" and placement_misfit(anyt.spec, healthy) == ""
    assert placement_misfit(h100.spec, healthy) == ("no healthy GPU has both the memory and the GPU type of a declared "
                                                    "shape (declared types: h100; the cluster's: a100, v100)")
    # two A100 GPUs, on one node: a 2-GPU gang of them fits, a 3-GPU one never does
    assert placement_misfit(make_spec(shapes=(Shape(2, 50.0, 8000, gpu_type="a100"),)), healthy) == ""
    assert "memory and GPU type on the cluster" in placement_misfit(
        make_spec(shapes=(Shape(3, 50.0, 8000, gpu_type="a100"),)), healthy)
    # whatever GPUs a decision names, the job lands on its type: the V100s are refused, an empty A100 taken
    plan = translate(Decision(place=[(0, np.array([0]), 50.0)]), view, idx)
    assert plan.place == [] and "not among the job's allowed GPUs" in " ".join(why for _, why in plan.dropped)
    plan = translate(Decision(place=[(0, np.array([2]), 50.0)]), view, idx)
    assert [(j.job_id, [(s.node_id, s.gpu_index) for s in p.slices]) for j, p in plan.place] == [(a100.job_id, [("n2", 0)])]


def test_a_declared_shape_of_another_gpu_type_is_not_the_one_a_placement_gets():
    """A job declaring the same (GPUs, share) for two types gets, on each GPU, the shape of that GPU's type."""
    from services.allocator.plan import _candidates, make_placement

    job = make_job(spec=make_spec(shapes=(Shape(1, 50.0, 30000, gpu_type="a100"), Shape(1, 50.0, 8000, gpu_type="v100"))))
    on_v100 = _candidates(job, [("n1", 0, 16384, "v100")], 50.0, 1.0, 1.0)
    on_a100 = _candidates(job, [("n2", 0, 81920, "A100")], 50.0, 1.0, 1.0)
    assert [p.shape_index for p in on_v100] == [1] and [p.shape_index for p in on_a100] == [0]
    assert _candidates(job, [("n3", 0, 81920, "h100")], 50.0, 1.0, 1.0) == []
    assert make_placement(job, [("n1", 0, 16384, "v100")], 50.0, 1.0).shape_index == 0  # (the index itself: no type check)


def test_make_placement_indexes_the_declared_list():
    from services.allocator.plan import make_placement

    job = make_job(spec=make_spec(shapes=(Shape(1, 100.0, 16000), Shape(1, 10.0, 2000), Shape(1, 10.0, 4000))))
    on = [("n1", 0, 16384, "v100")]
    p = make_placement(job, on, 10.0, 10.0)
    assert (p.shape_index, p.slices[0].mem_mib, p.shape) == (1, 2000, job.spec.shapes[1])
    assert make_placement(job, on, 10.0, 10.0, shape_index=2).slices[0].mem_mib == 4000
    assert make_placement(job, on, 50.0, 10.0) is None  # not declared: no placement (never the policy's own)
    assert make_placement(job, on, 10.0, 10.0, shape_index=0) is None  # index of another shape
    assert make_placement(job, [*on, ("n1", 1, 16384, "v100")], 100.0, 10.0) is None  # 2 GPUs: not declared


# --- Kubernetes pod jobs: terminal ends, eviction requests instead of releases --------------------------------

POD_SHAPES = tuple(Shape(1, float(s), 4096) for s in (25, 50, 75, 100))  # the extender's family: the share grid


def pod_job(owner: bool = True, **kw) -> Job:
    labels = [(POD_LABEL, "team-a/p-1"), (POD_UID_LABEL, "uid-1")] + ([(POD_OWNER_LABEL, "ReplicaSet/r")] if owner else [])
    return make_job(spec=make_spec(shapes=POD_SHAPES, labels=tuple(sorted(labels)), allowed_nodes=("n1",)), **kw)


@pytest.mark.parametrize(("owner", "status", "reason", "state", "want_reason", "message"), [
    (True, "succeeded", StateReason.COMPLETED, JobState.SUCCEEDED, StateReason.COMPLETED, "agent says"),
    (True, "failed", StateReason.OWN_FAILURE, JobState.FAILED, StateReason.OWN_FAILURE, "agent says"),
    (True, "failed", StateReason.COTENANT_FAULT, JobState.FAILED, StateReason.COTENANT_FAULT, "agent says"),
    (True, "killed", StateReason.PREEMPTED, JobState.CANCELLED, StateReason.PREEMPTED, POD_GONE_MESSAGE),
    (True, "killed", None, JobState.CANCELLED, StateReason.PREEMPTED, POD_GONE_MESSAGE),
    (False, "killed", StateReason.PREEMPTED, JobState.CANCELLED, StateReason.PREEMPTED, BARE_POD_GONE_MESSAGE),
], ids=["completed", "own-failure", "cotenant-fault-fails", "evicted-cancelled", "killed-cancelled", "bare-pod-deleted"])
def test_every_end_of_a_pod_job_is_terminal(owner, status, reason, state, want_reason, message):
    job = placed(pod_job(owner))
    [t] = transitions([job], {"n1": node()}, {"n1": {job.job_id: replace(wl(job, status, reason, progress=70),
                                                                         message="agent says")}}, NOW, 15, 30)
    assert (t.state, t.reason, t.message, t.release) == (state, want_reason, message, True)
    assert state.terminal


def test_a_pod_job_on_a_lost_node_stays_placed_until_its_pod_is_gone():
    job = placed(pod_job())
    assert transitions([job], {"n1": node(age_s=1000)}, {}, NOW, 15, 30) == []
    assert transitions([job], {}, {}, NOW, 15, 30) == []  # node deregistered: still kept (the reaper cancels it)
    [t] = transitions([placed(make_job())], {"n1": node(age_s=1000)}, {}, NOW, 15, 30)  # a process job is requeued
    assert t.reason is StateReason.NODE_LOST


def _pod_next_to_waiting(owner: bool = True, reason: StateReason = StateReason.PLACED):
    """A pod job running alone at 100 % of n1's only GPU, and a pending job."""
    pod = placed(pod_job(owner), share=100.0)
    pod = replace(pod, reason=reason, placement=replace(pod.placement, slices=(GpuSlice("n1", 0, 100.0, 4096),),
                                                        shape=POD_SHAPES[3], shape_index=3))
    waiting = make_job()
    n1 = node(gpus=1)
    n1 = replace(n1, gpus=(replace(n1.gpus[0], allocated_share_pct=100.0, allocated_mem_mib=4096),))
    view, idx = build_view([pod, waiting], [n1], TYPES, RESOLVE, NOW, 15)
    rows = {j.job_id: r for r, j in enumerate(idx.jobs)}
    return view, idx, rows[pod.job_id], rows[waiting.job_id]


def test_preempting_an_evictable_pod_job_requests_its_eviction_and_keeps_its_slices():
    view, idx, p, w = _pod_next_to_waiting()
    pod = idx.jobs[p]
    plan = translate(Decision(preempt=[p], place=[(w, np.array([0]), 100.0)]), view, idx)
    assert plan.evict == [(pod, StateReason.PREEMPTED, "preempted by the policy")]
    assert (plan.preempt, plan.resize, plan.place) == ([], [], [])  # its capacity is still booked: nothing fits there
    # not a failure: the waiting job's placement waits for the pod's eviction (logged at debug, not as a drop)
    assert plan.dropped == [] and plan.waiting == [(idx.jobs[w].job_id, f"waits for the eviction of pod job {pod.job_id}")]
    # a resize (training: release + re-place) or a relaunch at another share: an eviction "resized to N%"
    plan = translate(Decision(resize=[(p, 50.0)], place=[(w, np.array([0]), 50.0)]), view, idx)
    assert plan.evict == [(pod, StateReason.RESIZED, "resized to 50%")] and plan.resize == plan.place == []
    plan = translate(Decision(preempt=[p], place=[(p, np.array([0]), 25.0)]), view, idx)
    assert plan.evict == [(pod, StateReason.RESIZED, "resized to 25%")] and plan.resize == plan.place == []


def test_a_bare_pod_job_is_never_preempted_and_an_eviction_is_requested_once():
    view, idx, p, w = _pod_next_to_waiting(owner=False)
    plan = translate(Decision(preempt=[p], place=[(w, np.array([0]), 100.0)]), view, idx)
    assert plan.evict == plan.preempt == plan.place == []
    assert plan.dropped == [(idx.jobs[p].job_id, BARE_POD_WHY), (idx.jobs[w].job_id, "1 x 100.0% does not fit committed capacity")]
    view, idx, p, w = _pod_next_to_waiting(reason=StateReason.EVICTION_REQUESTED)
    plan = translate(Decision(preempt=[p], place=[(w, np.array([0]), 100.0)]), view, idx)
    assert plan.evict == plan.preempt == plan.place == []  # no second request; its slices still booked


def test_an_inference_pod_job_is_evicted_not_resized_in_place_nor_moved():
    spec = make_spec(kind=JobKind.INFERENCE, shapes=POD_SHAPES, allowed_nodes=("n1",),
                     labels=((POD_LABEL, "team-a/svc"), (POD_OWNER_LABEL, "ReplicaSet/r"), (POD_UID_LABEL, "u-2")))
    svc = placed(make_job(spec=spec), share=50.0)
    svc = replace(svc, placement=replace(svc.placement, slices=(GpuSlice("n1", 0, 50.0, 4096),), shape=POD_SHAPES[1],
                                         shape_index=1))
    n1 = node(gpus=2)
    n1 = replace(n1, gpus=(replace(n1.gpus[0], allocated_share_pct=50.0, allocated_mem_mib=4096), n1.gpus[1]))
    view, idx = build_view([svc], [n1], TYPES, RESOLVE, NOW, 15)
    plan = translate(Decision(resize=[(0, 75.0)]), view, idx)
    assert plan.evict == [(svc, StateReason.RESIZED, "resized to 75%")] and plan.in_place == []
    plan = translate(Decision(preempt=[0], place=[(0, np.array([1]), 50.0)]), view, idx)
    assert plan.evict == [(svc, StateReason.PREEMPTED, "moved by the policy to other GPUs")] and plan.move == []
