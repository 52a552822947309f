"""Services in-process on port 0 against a real redis-server: validation, error mapping, job API."""

from __future__ import annotations

import asyncio
import math
import urllib.request
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from elastico.config import Settings
from elastico.healthcheck import STORE_SERVICE, health_status
from elastico.rpc.server import ServiceBinding, create_server
from elastico.state.redis_store import RedisStore
from elastico.v1 import (
    allocator_pb2,
    allocator_pb2_grpc,
    node_agent_pb2,
    node_agent_pb2_grpc,
    pricer_pb2_grpc,
    types_pb2,
)
from services.allocator.servicer import AllocatorServicer
from services.allocator.settings import AllocatorSettings
from services.node_agent.servicer import NodeAgent, NodeAgentServicer
from services.node_agent.simulated import SimulatedBackend
from services.pricer.servicer import PricerServicer
from services.pricer.settings import PricerSettings


@pytest.fixture
async def suite(redis_server) -> AsyncIterator[dict]:
    """Allocator, node agent and pricer servicers in one in-process server on port 0."""
    store = RedisStore.from_url(redis_server.url, namespace=f"api-{uuid.uuid4().hex[:8]}")
    agent = NodeAgent(store, SimulatedBackend("n1", "v100", 2, 16384), "n1", "127.0.0.1:0")
    await agent.heartbeat()
    settings = AllocatorSettings.from_env({}, insecure=True, redis_url=redis_server.url, port=0, metrics_port=0, watch_poll_s=0.2)
    bindings = [
        ServiceBinding("elastico.v1.Allocator", AllocatorServicer(store, settings), allocator_pb2_grpc.add_AllocatorServicer_to_server),
        ServiceBinding("elastico.v1.NodeAgent", NodeAgentServicer(agent), node_agent_pb2_grpc.add_NodeAgentServicer_to_server),
        ServiceBinding("elastico.v1.Pricer", PricerServicer(PricerSettings.from_env({}, insecure=True)), pricer_pb2_grpc.add_PricerServicer_to_server),
    ]
    server, port = await create_server(settings, bindings)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield {"channel": channel, "server": server, "store": store, "alloc": allocator_pb2_grpc.AllocatorStub(channel),
           "agent": node_agent_pb2_grpc.NodeAgentStub(channel), "pricer": pricer_pb2_grpc.PricerStub(channel),
           "metrics_port": server.metrics_port}
    await channel.close()
    await server.stop(0)
    await store.close()


def training_spec(**kw) -> types_pb2.JobSpec:
    spec = types_pb2.JobSpec(name="t", tenant="team-a", kind=types_pb2.JOB_KIND_TRAINING, model_family="ResNet-50",
                             batch_size=32, training=types_pb2.TrainingWork(total_steps=100))
    for k, v in kw.items():
        if isinstance(v, (types_pb2.TrainingWork, types_pb2.InferenceWork)):
            getattr(spec, k).CopyFrom(v)
        elif k == "shapes":
            spec.shapes.extend(v)
        else:
            setattr(spec, k, v)
    return spec


async def expect_code(call, code: grpc.StatusCode, field: str | None = None) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call
    assert exc.value.code() == code, exc.value.details()
    if field is not None:
        assert exc.value.details().startswith(field + ":"), exc.value.details()
        assert ("field", field) in tuple(exc.value.trailing_metadata() or ())
    return exc.value


INVALID_SUBMITS = [
    ("", training_spec(), "request_id"),
    ("r1", None, "spec"),
    ("r1", training_spec(kind=types_pb2.JOB_KIND_UNSPECIFIED), "spec.kind"),
    ("r1", training_spec(tenant="bad tenant"), "spec.tenant"),
    ("r1", training_spec(training=types_pb2.TrainingWork(total_steps=0)), "spec.training.total_steps"),
    ("r1", training_spec(kind=types_pb2.JOB_KIND_INFERENCE), "spec.inference"),
    ("r1", training_spec(kind=types_pb2.JOB_KIND_INFERENCE, inference=types_pb2.InferenceWork(demand_rps=math.nan, latency_slo_ms=5)),
     "spec.inference.demand_rps"),
    ("r1", training_spec(shapes=[types_pb2.Shape(num_gpus=1, compute_share_pct=math.nan, mem_mib=10)]), "spec.shapes[0].compute_share_pct"),
    ("r1", training_spec(shapes=[types_pb2.Shape(num_gpus=1, compute_share_pct=101, mem_mib=10)]), "spec.shapes[0].compute_share_pct"),
    ("r1", training_spec(shapes=[types_pb2.Shape(num_gpus=0, compute_share_pct=50, mem_mib=10)]), "spec.shapes[0].num_gpus"),
]


@pytest.mark.parametrize(("rid", "spec", "field"), INVALID_SUBMITS, ids=[f"{f}-{i}" for i, (_, _, f) in enumerate(INVALID_SUBMITS)])
async def test_submit_rejects_malformed_input_naming_the_field(suite, rid, spec, field):
    req = allocator_pb2.SubmitJobRequest(request_id=rid)
    if spec is not None:
        req.spec.CopyFrom(spec)
    await expect_code(suite["alloc"].SubmitJob(req, timeout=5), grpc.StatusCode.INVALID_ARGUMENT, field)
    jobs = await suite["alloc"].ListJobs(allocator_pb2.ListJobsRequest(), timeout=5)
    assert len(jobs.jobs) == 0  # nothing was stored


async def test_other_methods_validate(suite):
    a = suite["alloc"]
    await expect_code(a.GetJob(allocator_pb2.GetJobRequest(job_id=""), timeout=5), grpc.StatusCode.INVALID_ARGUMENT, "job_id")
    await expect_code(a.CancelJob(allocator_pb2.CancelJobRequest(job_id=""), timeout=5), grpc.StatusCode.INVALID_ARGUMENT, "job_id")
    await expect_code(a.ListJobs(allocator_pb2.ListJobsRequest(page_size=5000), timeout=5), grpc.StatusCode.INVALID_ARGUMENT, "page_size")
    for token in ("zz", "0", "007", "-1", "1" * 21):  # never returned: a job's sequence counts from 1
        await expect_code(a.ListJobs(allocator_pb2.ListJobsRequest(page_token=token), timeout=5), grpc.StatusCode.INVALID_ARGUMENT,
                          "page_token")
    await expect_code(a.ListJobs(allocator_pb2.ListJobsRequest(states=[0]), timeout=5), grpc.StatusCode.INVALID_ARGUMENT, "states[0]")
    stream = a.WatchJobs(allocator_pb2.WatchJobsRequest(after_event_id="not-an-id"), timeout=5)
    await expect_code(stream.read(), grpc.StatusCode.INVALID_ARGUMENT, "after_event_id")
    await expect_code(a.GetJob(allocator_pb2.GetJobRequest(job_id="missing"), timeout=5), grpc.StatusCode.NOT_FOUND)


async def test_submit_is_idempotent_and_cancel_works(suite):
    a = suite["alloc"]
    req = allocator_pb2.SubmitJobRequest(request_id="req-42", spec=training_spec())
    first, again = await asyncio.gather(a.SubmitJob(req, timeout=5), a.SubmitJob(req, timeout=5))
    assert {first.created, again.created} == {True, False}
    assert first.job.job_id == again.job.job_id
    listed = await a.ListJobs(allocator_pb2.ListJobsRequest(), timeout=5)
    assert [j.job_id for j in listed.jobs] == [first.job.job_id]
    cancelled = await a.CancelJob(allocator_pb2.CancelJobRequest(job_id=first.job.job_id), timeout=5)
    assert cancelled.job.state == types_pb2.JOB_STATE_CANCELLED
    assert cancelled.job.reason == types_pb2.STATE_REASON_CANCELLED_BY_CLIENT
    await expect_code(a.CancelJob(allocator_pb2.CancelJobRequest(job_id=first.job.job_id), timeout=5), grpc.StatusCode.FAILED_PRECONDITION)


async def test_concurrent_submits_are_batched_yet_idempotent_each(suite):
    """Concurrent SubmitJobs share Store writes (SubmitBatcher) but each request id yields exactly one job."""
    a = suite["alloc"]
    reqs = [allocator_pb2.SubmitJobRequest(request_id=f"burst-{i % 20}", spec=training_spec()) for i in range(60)]
    answers = await asyncio.gather(*(a.SubmitJob(r, timeout=10) for r in reqs))
    by_request: dict[str, set[str]] = {}
    created: dict[str, int] = {}
    for r, ans in zip(reqs, answers, strict=True):
        by_request.setdefault(r.request_id, set()).add(ans.job.job_id)
        created[r.request_id] = created.get(r.request_id, 0) + int(ans.created)
    assert all(len(ids) == 1 for ids in by_request.values()) and set(created.values()) == {1}
    listed = await a.ListJobs(allocator_pb2.ListJobsRequest(page_size=100), timeout=5)
    assert sorted(j.job_id for j in listed.jobs if j.request_id.startswith("burst-")) == \
        sorted(next(iter(ids)) for ids in by_request.values())


async def test_watch_streams_events_and_resumes(suite):
    a = suite["alloc"]
    stream = a.WatchJobs(allocator_pb2.WatchJobsRequest(after_event_id="0"), timeout=10)
    job = (await a.SubmitJob(allocator_pb2.SubmitJobRequest(request_id="w1", spec=training_spec()), timeout=5)).job
    await a.CancelJob(allocator_pb2.CancelJobRequest(job_id=job.job_id), timeout=5)
    first = await stream.read()
    second = await stream.read()
    stream.cancel()
    assert [first.state, second.state] == [types_pb2.JOB_STATE_PENDING, types_pb2.JOB_STATE_CANCELLED]
    resumed = a.WatchJobs(allocator_pb2.WatchJobsRequest(after_event_id=first.event_id, job_ids=[job.job_id]), timeout=10)
    again = await resumed.read()
    resumed.cancel()
    assert again.event_id == second.event_id


async def test_cluster_state_and_node_status(suite):
    await suite["alloc"].SubmitJob(allocator_pb2.SubmitJobRequest(request_id="cs1", spec=training_spec()), timeout=5)
    cs = await suite["alloc"].GetClusterState(allocator_pb2.GetClusterStateRequest(), timeout=5)
    assert [n.node_id for n in cs.nodes] == ["n1"] and len(cs.nodes[0].gpus) == 2 and cs.nodes[0].ready
    assert [(t.tenant, t.pending_jobs) for t in cs.tenants] == [("team-a", 1)]
    assert cs.degraded  # no leader yet, said explicitly
    status = await suite["agent"].GetNodeStatus(node_agent_pb2.GetNodeStatusRequest(), timeout=5)
    assert status.node.gpu_backend == "simulated" and [g.index for g in status.node.gpus] == [0, 1]
    assert status.node.gpus[0].mem_total_mib == 16384


async def test_unexpected_exception_is_internal_with_incident_id(redis_server):
    class Broken(allocator_pb2_grpc.AllocatorServicer):
        async def GetJob(self, request, context):
            raise KeyError("boom")

    server, port = await create_server(Settings(service_name="t", insecure=True), [ServiceBinding("elastico.v1.Allocator", Broken(), allocator_pb2_grpc.add_AllocatorServicer_to_server)])
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        err = await expect_code(allocator_pb2_grpc.AllocatorStub(ch).GetJob(allocator_pb2.GetJobRequest(job_id="x"), timeout=5), grpc.StatusCode.INTERNAL)
        assert "incident" in err.details() and "boom" not in err.details()
    await server.stop(0)


async def test_redis_outage_is_unavailable(redis_server):
    store = RedisStore.from_url("redis://127.0.0.1:1/0", timeout_s=0.5)
    settings = AllocatorSettings.from_env({}, insecure=True, redis_url="redis://127.0.0.1:1/0", port=0)
    server, port = await create_server(settings, [ServiceBinding("elastico.v1.Allocator", AllocatorServicer(store, settings), allocator_pb2_grpc.add_AllocatorServicer_to_server)])
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        await expect_code(allocator_pb2_grpc.AllocatorStub(ch).GetJob(allocator_pb2.GetJobRequest(job_id="x"), timeout=5), grpc.StatusCode.UNAVAILABLE)
    await server.stop(0)
    await store.close()


async def test_a_health_probe_name_follows_its_probe_and_a_broken_probe_reads_not_serving():
    """What a scheduling allocator reports of the store (STORE_SERVICE): SERVING while the probe says so."""
    seen = {"store": True}

    def probe() -> bool:
        if seen["store"] is None:
            raise RuntimeError("probe broke")
        return seen["store"]

    binding = ServiceBinding("elastico.v1.Pricer", PricerServicer(PricerSettings.from_env({}, insecure=True)),
                             pricer_pb2_grpc.add_PricerServicer_to_server, health_probes={STORE_SERVICE: probe})
    server, port = await create_server(Settings(service_name="t", insecure=True), [binding])

    async def status() -> str:
        return await asyncio.to_thread(health_status, f"127.0.0.1:{port}", STORE_SERVICE, 2.0)

    await server.start()
    try:
        assert await status() == "SERVING"  # set before the port is announced, not a poll later
        for value, want in ((False, "NOT_SERVING"), (True, "SERVING"), (None, "NOT_SERVING")):
            seen["store"] = value
            for _ in range(40):
                if await status() == want:
                    break
                await asyncio.sleep(0.05)
            assert await status() == want, value
    finally:
        await server.stop(0)


async def test_a_burst_of_concurrent_calls_is_served_not_refused():
    """More calls at once than gRPC's default pending-call limit (1,000): every one is answered (that default
    refused ~1.5 % of them as CANCELLED; Settings.max_pending_rpcs raises it)."""
    binding = ServiceBinding("elastico.v1.Pricer", PricerServicer(PricerSettings.from_env({}, insecure=True)),
                             pricer_pb2_grpc.add_PricerServicer_to_server)
    server, port = await create_server(Settings(service_name="t", insecure=True), [binding])
    await server.start()
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(2)]
    try:
        stubs = [health_pb2_grpc.HealthStub(c) for c in channels]
        for c in channels:
            await c.channel_ready()
        for _ in range(2):
            got = await asyncio.gather(*(stubs[i % 2].Check(health_pb2.HealthCheckRequest(service=""), timeout=60)
                                         for i in range(3000)), return_exceptions=True)
            failed = [g.code().name for g in got if isinstance(g, grpc.aio.AioRpcError)]
            assert not failed, f"{len(failed)} of {len(got)} refused: {sorted(set(failed))}"
    finally:
        for c in channels:
            await c.close()
        await server.stop(0)


async def test_health_reflection_metrics_and_graceful_stop(suite):
    ch = suite["channel"]
    health = health_pb2_grpc.HealthStub(ch)
    for name in ("", "elastico.v1.Allocator", "elastico.v1.NodeAgent"):
        assert (await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)).status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    responses = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    names = {s.name async for r in responses for s in r.list_services_response.service}
    assert {"elastico.v1.Allocator", "elastico.v1.Pricer", "grpc.health.v1.Health"} <= names
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{suite['metrics_port']}/metrics", timeout=5).read().decode())
    assert "elastico_grpc_requests_total" in body
    await suite["server"].set_serving(False)
    assert (await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)).status == health_pb2.HealthCheckResponse.NOT_SERVING
