"""Live inference demand: the ReportDemand API, agent-scraped windows, the forecast, and in-place resizes."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import grpc
import numpy as np
import pytest

from elastico.domain import DemandReport, InferenceWork, JobKind, JobState, Shape, StateReason, Workload, placement_id
from elastico.rpc import convert
from elastico.v1 import allocator_pb2 as apb
from elastico.v1 import types_pb2 as tpb
from services.allocator import demand
from services.allocator.policy.forecast import BIN_S, looped_forecast, window_bins
from services.allocator.rounds import Scheduler
from tests.conftest import make_job, make_spec
from tests.integration.test_allocator_rounds import agent_reports, heartbeat, leader, settings

ISO_RPS = 10.0  # the test service's full-GPU request rate


def service_spec(rps: float, **kw):
    shapes = tuple(Shape(num_gpus=1, compute_share_pct=float(s), mem_mib=2048, throughput=ISO_RPS * s / 100)
                   for s in range(5, 101, 5))
    kw.setdefault("inference", InferenceWork(demand_rps=rps, latency_slo_ms=1000.0))
    return make_spec(kind=JobKind.INFERENCE, model_family="inference", shapes=shapes, **kw)


async def placed_service(store):
    """A scheduler leading a one-GPU node ``n1`` with a service placed there and reported running by its agent."""
    await heartbeat(store, "n1", gpus=1)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(), lease)
    svc, _ = await store.create_job(make_job(spec=service_spec(1.0)))
    await sch.round(epoch)
    await agent_reports(store, "n1", "running")
    return sch, epoch, svc


async def test_a_demand_step_grows_the_service_in_place_after_its_cotenant_is_relaunched(store):
    await heartbeat(store, "n1", gpus=1)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(), lease)
    svc, _ = await store.create_job(make_job(spec=service_spec(2.0)))
    train, _ = await store.create_job(make_job(spec=make_spec(model_family="ResNet-18", batch_size=64)))
    await sch.round(epoch)
    await agent_reports(store, "n1", "running")
    await sch.round(epoch)
    svc, train = await store.get_job(svc.job_id), await store.get_job(train.job_id)
    assert svc.state is JobState.RUNNING and train.state is JobState.RUNNING  # training in the service's slack
    before, pid = svc.placement.slices[0].compute_share_pct, placement_id(svc.placement)
    assert before + train.placement.slices[0].compute_share_pct <= 100.0

    # the service's node agent scraped a doubled (and more) rate: load 0.2 -> 0.5 of a GPU
    gen, ws = await store.get_workloads("n1")
    w = ws[svc.job_id]
    now = time.time()
    ws[svc.job_id] = Workload(**{**w.__dict__, "demand": DemandReport(svc.job_id, now, 5.0, 5.0, 80.0, 400.0, 3.0)})
    await store.report_workloads("n1", gen, list(ws.values()))
    for _ in range(2):  # within two rounds
        await sch.round(epoch)
        await agent_reports(store, "n1", "running")
        gpu = (await store.get_node("n1")).gpus[0]
        assert gpu.allocated_share_pct <= 100.0
    svc = await store.get_job(svc.job_id)
    assert svc.state is JobState.RUNNING and placement_id(svc.placement) == pid  # same process, never relaunched
    assert svc.placement.slices[0].compute_share_pct >= 60.0 > before  # load 0.5 + SLO margin 0.1
    assert svc.placement.slices[0].mem_mib == 2048
    assert svc.reason is StateReason.RESIZED and "in place" in svc.message and "forecast 5 req/s" in svc.message
    events = await store.read_events("0", limit=1000)
    mine = [(e.job_id, e.reason) for e in events if e.reason in (StateReason.RESIZED, StateReason.PREEMPTED)]
    first_train = next(i for i, (j, _) in enumerate(mine) if j == train.job_id)
    first_svc = next(i for i, (j, _) in enumerate(mine) if j == svc.job_id)
    assert first_train < first_svc  # the training tenant gave up its share before the service took it
    hist = await store.demand_history([svc.job_id], 0.0)
    assert [r.source for r in hist[svc.job_id]] == ["node:n1"]
    from prometheus_client import REGISTRY

    def sample(name):
        return REGISTRY.get_sample_value(name, {"job_id": svc.job_id})

    assert sample("elastico_allocator_service_share_pct") == svc.placement.slices[0].compute_share_pct
    assert (sample("elastico_allocator_service_forecast_rps"), sample("elastico_allocator_service_p99_latency_ms"),
            sample("elastico_allocator_service_latency_slo_ms")) == (5.0, 400.0, 1000.0)
    await store.release_job(epoch, svc, JobState.CANCELLED, StateReason.CANCELLED_BY_CLIENT)
    await sch.round(epoch)
    assert sample("elastico_allocator_service_share_pct") is None  # an ended service's series go


async def test_forecast_from_live_reports_equals_the_simulators():
    """Forecast parity: per-bin reports of a looped profile give the simulator's forecast at every bin."""
    rng = np.random.default_rng(3)
    profile = rng.random(90) * ISO_RPS
    W = window_bins(1800.0)
    sim = looped_forecast(profile, W)
    scale = 60.0  # accelerated, as in the demo: a report's wall time x scale is policy time
    # measured on the wall clock: window ends and rates per wall second (scale x the policy's)
    reports = [DemandReport("s", ((b + 0.5) * BIN_S) / scale, 1.0, float(profile[b % 90]) * scale) for b in range(-90, 90)]
    for b in range(90):
        now_wall = (b + 0.9) * BIN_S / scale
        seen = [r for r in reports if r.window_end_s <= now_wall]
        assert demand.forecast(seen, now_wall, 1800.0, scale) == pytest.approx(sim[b])


@pytest.mark.parametrize("field,value,why", [
    ("window_s", 0.0, "report.window_s"), ("window_s", 7200.0, "report.window_s"),
    ("request_rate_rps", -1.0, "report.request_rate_rps"), ("request_rate_rps", float("nan"), "report.request_rate_rps"),
    ("request_rate_rps", 1e300, "report.request_rate_rps"), ("request_rate_rps", 1e-300, "report.request_rate_rps"),
    ("p99_latency_ms", 1.0, "report.p99_latency_ms"), ("queue_length", float("inf"), "report.queue_length"),
    ("job_id", "", "report.job_id"),
])
async def test_report_demand_rejects_bad_reports_naming_the_field(api, field, value, why):
    stub, store = api
    svc, _ = await store.create_job(make_job(spec=service_spec(2.0)))
    r = DemandReport(svc.job_id, time.time(), 10.0, 3.0, 5.0, 9.0, 0.0)
    msg = convert.demand_to_pb(r)
    setattr(msg, field, value)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.ReportDemand(apb.ReportDemandRequest(report=msg))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and why in e.value.details()


async def test_report_demand_is_idempotent_and_answers_the_forecast(api):
    stub, store = api
    svc, _ = await store.create_job(make_job(spec=service_spec(2.0)))
    train, _ = await store.create_job(make_job())
    now = time.time()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.ReportDemand(apb.ReportDemandRequest())
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "report" in e.value.details()
    future = convert.demand_to_pb(DemandReport(svc.job_id, now + 3600, 10.0, 3.0))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.ReportDemand(apb.ReportDemandRequest(report=future))
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "report.window_end" in e.value.details()
    # two windows a minute apart (two forecast bins): the forecast is the peak of the bins
    first = await stub.ReportDemand(apb.ReportDemandRequest(report=convert.demand_to_pb(DemandReport(svc.job_id, now - 80, 10.0, 3.0))))
    assert first.accepted and first.forecast_rps == pytest.approx(3.0) and first.reports_in_window == 1
    again = await stub.ReportDemand(apb.ReportDemandRequest(report=convert.demand_to_pb(DemandReport(svc.job_id, now - 80, 10.0, 7.0))))
    assert not again.accepted and again.forecast_rps == pytest.approx(3.0)  # the retried window counts once
    peak = await stub.ReportDemand(apb.ReportDemandRequest(report=convert.demand_to_pb(DemandReport(svc.job_id, now - 10, 10.0, 4.5))))
    assert peak.accepted and peak.forecast_rps == pytest.approx(4.5) and peak.reports_in_window == 2
    for job_id, code in (("j-nope", grpc.StatusCode.NOT_FOUND), (train.job_id, grpc.StatusCode.FAILED_PRECONDITION)):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.ReportDemand(apb.ReportDemandRequest(report=convert.demand_to_pb(DemandReport(job_id, now, 10.0, 1.0))))
        assert e.value.code() is code


@pytest.fixture
async def api(store):
    from elastico.rpc.server import ServiceBinding, create_server
    from elastico.v1 import allocator_pb2_grpc
    from services.allocator.servicer import AllocatorServicer

    s = settings(port=0)
    server, port = await create_server(s, [ServiceBinding("elastico.v1.Allocator", AllocatorServicer(store, s),
                                                          allocator_pb2_grpc.add_AllocatorServicer_to_server)])
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield allocator_pb2_grpc.AllocatorStub(ch), store
    await server.stop(0)


def test_spec_metrics_endpoint_round_trips_and_is_validated():
    from elastico.domain import MetricsEndpoint, validate_job_spec
    from elastico.errors import InvalidSpec

    spec = service_spec(2.0, inference=InferenceWork(2.0, 100.0, MetricsEndpoint(8000, "/metrics", "triton", 2.0, "m")))
    assert convert.job_spec_from_pb(convert.job_spec_to_pb(spec)) == spec
    validate_job_spec(spec)
    for bad, name in ((MetricsEndpoint(port=70000), "port"), (MetricsEndpoint(path="metrics"), "path"),
                      (MetricsEndpoint(format="statsd"), "format"), (MetricsEndpoint(scrape_interval_s=0.01), "scrape_interval_s")):
        with pytest.raises(InvalidSpec) as e:
            validate_job_spec(service_spec(2.0, inference=InferenceWork(2.0, 100.0, bad)))
        assert e.value.field == f"spec.inference.metrics.{name}"
    assert tpb.MetricsEndpoint(port=1).port == 1


class _MoveOnce:
    """A policy that moves the first running service to the first GPU of node ``to`` once, and else does nothing."""

    name = "move-once"
    needs_periodic_rounds = False

    def __init__(self, to_node_rows):
        self.rows, self.done = to_node_rows, False

    def decide(self, view):
        from services.allocator.policy import INFERENCE, Decision

        d = Decision()
        svc = [int(r) for r in view.running if view.jobs.kind[r] == INFERENCE]
        if svc and not self.done:
            self.done = True
            d.preempt.append(svc[0])
            d.place.append((svc[0], np.array([self.rows[0]]), 40.0))
        return d


async def test_a_service_moves_make_before_break(store):
    from elastico.domain import drain_key

    sch, epoch, svc = await placed_service(store)
    await heartbeat(store, "n2", gpus=1)
    await sch.round(epoch)
    svc = await store.get_job(svc.job_id)
    assert svc.state is JobState.RUNNING and svc.placement.slices[0].node_id == "n1"
    old = placement_id(svc.placement)
    mover = _MoveOnce([1])  # GPU row 1 = n2:0
    sch._policy = lambda matrix: mover  # noqa: SLF001 - the test's policy
    await sch.round(epoch)
    moving = await store.get_job(svc.job_id)
    assert moving.state is JobState.PLACED and placement_id(moving.draining) == old
    assert moving.placement.slices[0].node_id == "n2" and "current replica serves" in moving.message
    # the old replica stays desired (so its agent keeps it serving) until the new one runs
    for _ in range(2):
        await sch.round(epoch)
        assert placement_id((await store.get_desired("n1"))[1][drain_key(svc.job_id)]) == old
        assert (await store.get_job(svc.job_id)).state is JobState.PLACED
    await agent_reports(store, "n2", "running")
    await sch.round(epoch)
    done = await store.get_job(svc.job_id)
    assert done.state is JobState.RUNNING and done.draining is None and done.placement.slices[0].node_id == "n2"
    assert (await store.get_desired("n1"))[1] == {}
    assert [(await store.get_node(n)).gpus[0].allocated_share_pct for n in ("n1", "n2")] == [0.0, 40.0]


async def test_committed_usage_stays_the_sum_of_placements_under_random_demand(store):
    """Conservation under resizes: rounds with services' demand jumping at random (in-place growths and shrinks,
    co-tenants relaunched) never book more than a GPU has, and each GPU's usage is what its placements hold."""
    rng = np.random.default_rng(11)
    await heartbeat(store, "n1", "n2", gpus=2)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(time_scale=50.0), lease)  # 50 policy s a wall s: shrinks become due too
    services = [(await store.create_job(make_job(spec=service_spec(float(rng.uniform(0.5, 4.0))))))[0] for _ in range(3)]
    for i in range(8):
        await store.create_job(make_job(spec=make_spec(model_family=("ResNet-18", "ResNet-50", "LM")[i % 3], batch_size=32)))
    resized = 0
    for k in range(25):
        rep = await sch.round(epoch)
        resized += rep.resized
        for n in ("n1", "n2"):
            await agent_reports(store, n, "running")
            gen, ws = await store.get_workloads(n)
            now = time.time()
            for s in services:
                if s.job_id in ws and rng.random() < 0.5:
                    w = ws[s.job_id]
                    ws[s.job_id] = Workload(**{**w.__dict__, "demand": DemandReport(
                        s.job_id, now, 1.0, 50.0 * float(rng.uniform(0.2, 6.0)))})  # per wall second
            await store.report_workloads(n, gen, list(ws.values()))
        jobs = await store.list_active_jobs()
        held: dict[tuple[str, int], float] = {}
        for j in jobs:
            for p in (j.placement, j.draining):
                for sl in (p.slices if p else ()):
                    held[(sl.node_id, sl.gpu_index)] = held.get((sl.node_id, sl.gpu_index), 0.0) + sl.compute_share_pct
        for n in ("n1", "n2"):
            for g in (await store.get_node(n)).gpus:
                assert g.allocated_share_pct <= 100.0 + 1e-9
                assert g.allocated_share_pct == pytest.approx(held.get((n, g.index), 0.0)), (k, n, g.index)
        await asyncio.sleep(0.02)
    assert resized > 0  # the demand moved the services


async def test_every_scraped_window_reaches_the_history_however_seldom_rounds_run(store):
    sch, epoch, svc = await placed_service(store)
    await sch.round(epoch)
    gen, ws = await store.get_workloads("n1")
    now = time.time()
    # five one-minute windows (five forecast bins), the burst in the second
    windows = tuple(DemandReport(svc.job_id, now - 60.0 * (4 - i), 60.0, rate) for i, rate in enumerate((1.0, 9.0, 2.0, 1.5, 1.0)))
    w = ws[svc.job_id]
    ws[svc.job_id] = Workload(**{**w.__dict__, "demand": windows[-1], "recent_demand": windows})
    await store.report_workloads("n1", gen, list(ws.values()))
    await sch.round(epoch)
    await sch.round(epoch)  # the same windows again: stored once
    hist = (await store.demand_history([svc.job_id], 0.0))[svc.job_id]
    assert [r.request_rate_rps for r in hist] == [1.0, 9.0, 2.0, 1.5, 1.0]  # the burst between rounds is kept
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("elastico_allocator_service_forecast_rps", {"job_id": svc.job_id}) == 9.0
    # within one bin, reports are averaged by window length: a short noisy window is no peak
    b0 = (now // 60) * 60  # the current bin's start
    one_bin = [DemandReport("s", b0 + 10, 1.0, 30.0), DemandReport("s", b0 + 20, 9.0, 10.0)]
    assert demand.forecast(one_bin, b0 + 30, 3600.0, 1.0) == pytest.approx((30.0 * 1 + 10.0 * 9) / 10)


async def test_a_service_boxed_in_by_another_service_moves_make_before_break_with_the_elastico_policy(store):
    """Two services placed at their declared demand share a GPU; when both demands rise past what one GPU holds,
    ElastiCo moves one (make-before-break) to a GPU where it fits and grows the other in place; no GPU is ever
    booked past 100 %."""
    await heartbeat(store, "n1", gpus=1)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(), lease)
    svcs = [(await store.create_job(make_job(spec=service_spec(1.0))))[0] for _ in range(2)]
    await sch.round(epoch)
    await agent_reports(store, "n1", "running")
    await sch.round(epoch)
    assert [(await store.get_job(s.job_id)).state for s in svcs] == [JobState.RUNNING] * 2  # both on n1's one GPU
    await heartbeat(store, "n2", gpus=1)

    async def booked_within_capacity():
        for n in ("n1", "n2"):
            assert all(g.allocated_share_pct <= 100.0 + 1e-9 for g in (await store.get_node(n)).gpus)

    gen, ws = await store.get_workloads("n1")
    now = time.time()
    for s in svcs:  # both scraped at load 0.5 of a GPU: 60 % or more each
        w = ws[s.job_id]
        ws[s.job_id] = Workload(**{**w.__dict__, "demand": DemandReport(s.job_id, now, 5.0, 5.0, 80.0, 400.0, 3.0)})
    await store.report_workloads("n1", gen, list(ws.values()))
    await sch.round(epoch)
    await booked_within_capacity()
    jobs = [await store.get_job(s.job_id) for s in svcs]
    moving = [j for j in jobs if j.draining is not None]
    assert len(moving) == 1 and moving[0].placement.slices[0].node_id == "n2"
    assert moving[0].draining.slices[0].node_id == "n1"  # the old replica serves until the new one runs
    await agent_reports(store, "n2", "running")
    for _ in range(2):
        await sch.round(epoch)
        await booked_within_capacity()
        for n in ("n1", "n2"):
            await agent_reports(store, n, "running")
    jobs = [await store.get_job(s.job_id) for s in svcs]
    assert all(j.state is JobState.RUNNING and j.draining is None for j in jobs)
    assert sorted(j.placement.slices[0].node_id for j in jobs) == ["n1", "n2"]
    assert all(j.placement.slices[0].compute_share_pct >= 60.0 for j in jobs)  # load 0.5 + SLO margin 0.1



@pytest.mark.parametrize("quota", ["", "greedy=2"])
async def test_a_tenant_reporting_absurd_demand_takes_no_more_gpus_than_its_service_quota(store, quota):
    """ELASTICO_SERVICE_QUOTA_GPUS: a tenant reporting 1e6 req/s for each of its three services takes three whole GPUs
    without a quota, two with a quota of 2 (the third waits, saying why); another tenant's training keeps running."""
    await heartbeat(store, "n1", gpus=4)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(service_quota_gpus=quota), lease)
    train, _ = await store.create_job(make_job(spec=make_spec(tenant="team-b", model_family="ResNet-18", batch_size=64)))
    svcs = [(await store.create_job(make_job(spec=service_spec(1.0, tenant="greedy"))))[0] for _ in range(3)]
    await sch.round(epoch)
    await agent_reports(store, "n1", "running")
    await store.record_demand([DemandReport(s.job_id, time.time(), 10.0, 1e6) for s in svcs], 7200.0)
    for _ in range(4):
        await sch.round(epoch)
        await agent_reports(store, "n1", "running")
    svcs = [await store.get_job(s.job_id) for s in svcs]
    shares = sum(s.placement.slices[0].compute_share_pct for s in svcs if s.placement is not None)
    assert all(g.allocated_share_pct <= 100.0 for g in (await store.get_node("n1")).gpus)
    if not quota:
        assert shares == 300.0 and all(s.state is JobState.RUNNING for s in svcs)
        return
    assert shares == 200.0 and [s.state for s in svcs] == [JobState.RUNNING, JobState.RUNNING, JobState.PENDING]
    assert svcs[2].reason is StateReason.UNSCHEDULABLE_NOW
    assert svcs[2].message == ("the services of tenant greedy take 2 of its 2 GPUs of service quota "
                               "(ELASTICO_SERVICE_QUOTA_GPUS); this one needs 1 more")
    assert (await store.get_job(train.job_id)).state is JobState.RUNNING


async def test_a_service_held_by_its_tenants_quota_starts_when_another_ends(store):
    await heartbeat(store, "n1", gpus=4)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(service_quota_gpus="team-b=3,*=1"), lease)
    first, second = [(await store.create_job(make_job(spec=service_spec(0.5, tenant="greedy"))))[0] for _ in range(2)]
    others = [(await store.create_job(make_job(spec=service_spec(0.5, tenant="team-b"))))[0] for _ in range(3)]
    await sch.round(epoch)
    assert (await store.get_job(first.job_id)).state is JobState.PLACED
    assert (await store.get_job(second.job_id)).state is JobState.PENDING
    assert [(await store.get_job(o.job_id)).state for o in others] == [JobState.PLACED] * 3  # team-b's own quota
    await store.release_job(epoch, await store.get_job(first.job_id), JobState.CANCELLED, StateReason.CANCELLED_BY_CLIENT)
    await sch.round(epoch)
    assert (await store.get_job(second.job_id)).state is JobState.PLACED


async def test_a_service_that_can_never_fit_neither_counts_against_the_quota_nor_flips_its_reason(store):
    await heartbeat(store, "n1", gpus=2)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(service_quota_gpus="*=1"), lease)
    huge = service_spec(0.5, tenant="greedy")
    huge = replace(huge, shapes=tuple(replace(s, mem_mib=10**9) for s in huge.shapes))  # no GPU has that memory
    never, _ = await store.create_job(make_job(spec=huge))
    fits, _ = await store.create_job(make_job(spec=service_spec(0.5, tenant="greedy")))
    for _ in range(3):
        await sch.round(epoch)
        assert (await store.get_job(never.job_id)).reason is StateReason.NEVER_SCHEDULABLE
    assert (await store.get_job(fits.job_id)).state is JobState.PLACED


async def test_cluster_state_shows_each_tenants_services_against_its_quota(store):
    from services.allocator.servicer import AllocatorServicer

    await heartbeat(store, "n1", gpus=2)
    lease, epoch = await leader(store, "a")
    s = settings(service_quota_gpus="greedy=2")
    await store.create_job(make_job(spec=service_spec(0.5, tenant="greedy")))
    await store.create_job(make_job(spec=make_spec(tenant="team-b")))
    await Scheduler(store, s, lease).round(epoch)
    cs = await AllocatorServicer(store, s).GetClusterState(apb.GetClusterStateRequest(), None)
    got = {t.tenant: (t.running_jobs, t.service_gpus, t.service_quota_gpus if t.HasField("service_quota_gpus") else None)
           for t in cs.tenants}
    assert got == {"greedy": (1, 1, 2), "team-b": (1, 0, None)}
