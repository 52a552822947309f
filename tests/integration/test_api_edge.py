"""The API edge under hostile input and shutdown: undecodable bytes, Health.Watch, draining streams, Sync waits."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from elastico.rpc.server import ServiceBinding, create_server
from elastico.state.redis_store import RedisStore
from elastico.v1 import allocator_pb2, allocator_pb2_grpc, node_agent_pb2, node_agent_pb2_grpc, pricer_pb2_grpc, types_pb2
from services.allocator.servicer import AllocatorServicer
from services.allocator.settings import AllocatorSettings
from services.node_agent.mps import make_mps
from services.node_agent.reconcile import Reconciler
from services.node_agent.servicer import NodeAgent, NodeAgentServicer
from services.node_agent.simulated import SimulatedBackend
from services.pricer.servicer import PricerServicer
from services.pricer.settings import PricerSettings

METHODS = ["/elastico.v1.Allocator/SubmitJob", "/elastico.v1.Allocator/GetJob", "/elastico.v1.Allocator/ListJobs",
           "/elastico.v1.Allocator/GetClusterState", "/elastico.v1.Allocator/ReportDemand", "/elastico.v1.Pricer/ComputeAllocation", "/grpc.health.v1.Health/Check"]


@contextlib.asynccontextmanager
async def edge_server(redis_server, **settings):
    """The Allocator and Pricer APIs, insecure on a free port, over a fresh Redis namespace; ``settings`` override
    the allocator's. Yields the server and its address."""
    store = RedisStore.from_url(redis_server.url, namespace=f"edge-{uuid.uuid4().hex[:8]}")
    allocator = AllocatorSettings.from_env({}, insecure=True, redis_url=redis_server.url, port=0, watch_poll_s=0.2,
                                           **settings)
    bindings = [
        ServiceBinding("elastico.v1.Allocator", AllocatorServicer(store, allocator), allocator_pb2_grpc.add_AllocatorServicer_to_server),
        ServiceBinding("elastico.v1.Pricer", PricerServicer(PricerSettings.from_env({}, insecure=True)), pricer_pb2_grpc.add_PricerServicer_to_server),
    ]
    srv, port = await create_server(allocator, bindings)
    await srv.start()
    try:
        yield srv, f"127.0.0.1:{port}"
    finally:
        await srv.stop(0)
        await store.close()


@pytest.fixture
async def server(redis_server):
    async with edge_server(redis_server) as s:
        yield s


def training_spec(tenant: str = "t", **kw) -> types_pb2.JobSpec:
    return types_pb2.JobSpec(name="n", tenant=tenant, kind=types_pb2.JOB_KIND_TRAINING, model_family="ResNet-50",
                             batch_size=32, training=types_pb2.TrainingWork(total_steps=10), **kw)


async def test_undecodable_requests_are_invalid_argument_never_unknown(server):
    _, addr = server
    rng = random.Random(3)
    payloads = [b"\xff", b"\x0a\xff\xff\xff\xff\xff", b"\x08" * 9, bytes(rng.randrange(256) for _ in range(300))]
    payloads += [bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))) for _ in range(40)]
    codes: dict[str, int] = {}
    async with grpc.aio.insecure_channel(addr) as ch:
        for method in METHODS:
            call = ch.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            for p in payloads:
                try:
                    await call(p, timeout=5)
                    code = "OK"
                except grpc.aio.AioRpcError as exc:
                    code = exc.code().name
                codes[code] = codes.get(code, 0) + 1
        reflection = ch.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                      request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for _ in reflection(iter([b"\xff\xff"]), timeout=5):
                pass
        assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "UNKNOWN" not in codes and "INTERNAL" not in codes, codes
    assert codes.get("INVALID_ARGUMENT", 0) > 0


async def test_health_watch_streams_serving_then_not_serving_before_the_port_closes(redis_server):
    settings = PricerSettings.from_env({}, insecure=True, port=0)
    srv, port = await create_server(settings, [ServiceBinding(
        "elastico.v1.Pricer", PricerServicer(settings), pricer_pb2_grpc.add_PricerServicer_to_server)])
    await srv.start()
    seen: list[str] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)

        async def read() -> None:
            async for resp in watch:
                seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))

        reader = asyncio.create_task(read())
        while not seen:
            await asyncio.sleep(0.05)
        stopping = asyncio.create_task(srv.stop(1.0, drain_s=0.5))
        await asyncio.sleep(0.2)
        assert seen[-1] == "NOT_SERVING"  # told while the port still answers (the drain period)
        check = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
        await stopping
        reader.cancel()
    assert seen[0] == "SERVING"


async def test_an_open_watch_ends_cleanly_when_the_server_drains(server):
    srv, addr = server
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = allocator_pb2_grpc.AllocatorStub(ch)
        stream = stub.WatchJobs(allocator_pb2.WatchJobsRequest(), timeout=10)
        await asyncio.sleep(0.3)
        await stub.SubmitJob(allocator_pb2.SubmitJobRequest(request_id="drain-1", spec=training_spec()), timeout=5)
        await stream.read()  # the server's handler is serving the stream (on a busy machine it may start late)
        started = time.monotonic()
        stop = asyncio.create_task(srv.stop(2.0, drain_s=0.3))
        while await stream.read() != grpc.aio.EOF:
            pass
        assert await stream.code() is grpc.StatusCode.OK
        assert time.monotonic() - started < 1.0  # ended at the drain, not cut when the grace ran out
        await stop


async def test_a_stream_step_that_loses_a_cancel_still_ends_at_the_drain():
    """The drain cancels a stream's pending step; a library can lose that cancel (a redis-py blocking read that
    returns as it arrives), so the step is cancelled again until it ends (elastico.tasks.cancel_until_done)."""
    from elastico.rpc.interceptors import _until

    stop, cancels = asyncio.Event(), []

    async def source():
        yield 1
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancels.append(time.monotonic())
                if len(cancels) > 1:
                    raise  # the first cancel is lost, as in the library

    async def consume():
        return [x async for x in _until(source(), stop)]

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    started = time.monotonic()
    stop.set()
    async with asyncio.timeout(2.0):
        assert await task == [1]
    assert len(cancels) == 2 and time.monotonic() - started < 0.5


def _internal_errors() -> float:
    from prometheus_client import REGISTRY

    return sum(s.value for m in REGISTRY.collect() if m.name == "elastico_grpc_requests"
               for s in m.samples if s.name.endswith("_total") and s.labels.get("code") == "INTERNAL")


async def test_a_watch_its_client_gives_up_on_is_no_server_error(server):
    """A client deadline passing or a cancel while the watch waits for events ends the call on the server
    without an INTERNAL error (the stream's pending step is cancelled before it is closed)."""
    _, addr = server
    before = _internal_errors()
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = allocator_pb2_grpc.AllocatorStub(ch)
        timed = stub.WatchJobs(allocator_pb2.WatchJobsRequest(), timeout=0.5)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for _ in timed:
                pass
        assert exc.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        cancelled = stub.WatchJobs(allocator_pb2.WatchJobsRequest(), timeout=10)
        await asyncio.sleep(0.5)
        cancelled.cancel()
        await asyncio.sleep(0.5)  # the server handles both ends
    assert _internal_errors() == before


@pytest.mark.parametrize("bad", ["9" * 25, "١٢٣", "1-2-3", "-1"])
async def test_watch_rejects_event_ids_redis_would_refuse(server, bad):
    _, addr = server
    async with grpc.aio.insecure_channel(addr) as ch:
        stream = allocator_pb2_grpc.AllocatorStub(ch).WatchJobs(allocator_pb2.WatchJobsRequest(after_event_id=bad), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for _ in stream:
                pass
    assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "after_event_id" in exc.value.details()


async def test_a_sync_for_a_generation_that_never_comes_blocks_nobody(redis_server, tmp_path):
    store = RedisStore.from_url(redis_server.url, namespace=f"sync-{uuid.uuid4().hex[:8]}")
    backend = SimulatedBackend("n1", "v100", 1, 16384)
    reconciler = Reconciler(store, backend, make_mps("off", backend.name, tmp_path / "p", tmp_path / "l"), "n1", tmp_path / "state")
    agent = NodeAgent(store, backend, "n1", "127.0.0.1:0", reconciler)
    await agent.heartbeat()
    settings = AllocatorSettings.from_env({}, insecure=True, redis_url=redis_server.url, port=0)
    srv, port = await create_server(settings, [ServiceBinding(
        "elastico.v1.NodeAgent", NodeAgentServicer(agent), node_agent_pb2_grpc.add_NodeAgentServicer_to_server)])
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = node_agent_pb2_grpc.NodeAgentStub(ch)
            hostile = asyncio.ensure_future(stub.Sync(node_agent_pb2.SyncRequest(min_generation=2**64 - 1), timeout=60))
            await asyncio.sleep(0.2)
            t = time.monotonic()
            await stub.Sync(node_agent_pb2.SyncRequest(), timeout=5)
            assert time.monotonic() - t < 1.0  # the waiting call holds no lock
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await hostile
            assert exc.value.code() is grpc.StatusCode.UNAVAILABLE  # bounded: MAX_SYNC_WAIT_S, not the 60 s deadline
    finally:
        await srv.stop(0)
        await store.close()


async def test_list_pages_stay_receivable_by_a_default_client(server):
    """Pages are cut by size (under the 4 MiB a default client accepts), and paging still returns every job."""
    from elastico.v1 import types_pb2

    _, addr = server
    labels = {f"k{i}": "v" * 480 for i in range(60)}  # ~30 KiB per spec, under the 32 KiB limit
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = allocator_pb2_grpc.AllocatorStub(ch)
        ids = set()
        for i in range(140):
            spec = types_pb2.JobSpec(name="big", tenant="t", kind=types_pb2.JOB_KIND_TRAINING, model_family="ResNet-50",
                                     batch_size=32, training=types_pb2.TrainingWork(total_steps=10), labels=labels)
            ids.add((await stub.SubmitJob(allocator_pb2.SubmitJobRequest(request_id=f"big-{i}", spec=spec), timeout=5)).job.job_id)
        seen, token, pages = [], "", 0
        while True:
            resp = await stub.ListJobs(allocator_pb2.ListJobsRequest(page_size=1000, page_token=token), timeout=10)
            assert resp.ByteSize() <= 4 << 20
            seen += [j.job_id for j in resp.jobs]
            pages += 1
            token = resp.next_page_token
            if not token:
                break
    assert pages >= 2 and len(seen) == len(set(seen)) and set(seen) == ids


async def test_a_tenant_at_its_live_job_limit_gets_resource_exhausted_and_others_still_submit(redis_server):
    """Concurrent submissions (one batched store write) past ELASTICO_MAX_LIVE_JOBS_PER_TENANT: exactly the
    limit is created, the rest answer RESOURCE_EXHAUSTED naming the setting, another tenant is unaffected."""
    def request(tenant: str, rid: str) -> allocator_pb2.SubmitJobRequest:
        return allocator_pb2.SubmitJobRequest(request_id=rid, spec=training_spec(tenant))

    async with edge_server(redis_server, max_live_jobs_per_tenant=3) as (_, addr), grpc.aio.insecure_channel(addr) as ch:
        stub = allocator_pb2_grpc.AllocatorStub(ch)
        calls = [stub.SubmitJob(request("t", f"r{i}"), timeout=10) for i in range(6)]
        calls.append(stub.SubmitJob(request("u", "r0"), timeout=10))
        results = await asyncio.gather(*calls, return_exceptions=True)
    refused = [r for r in results[:6] if isinstance(r, grpc.aio.AioRpcError)]
    assert len(refused) == 3 and all(r.code() is grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
    assert "ELASTICO_MAX_LIVE_JOBS_PER_TENANT" in refused[0].details()
    assert not isinstance(results[6], Exception) and results[6].created


async def test_watch_streams_are_bounded_per_caller_and_freed_when_closed(redis_server):
    """Each WatchJobs stream holds a Redis connection while it waits: a caller past
    ELASTICO_MAX_WATCHES_PER_CALLER gets RESOURCE_EXHAUSTED; closing a stream frees its place."""
    reads = []

    async def opened(stub) -> grpc.aio.Call:
        call = stub.WatchJobs(allocator_pb2.WatchJobsRequest(), timeout=30)
        reads.append(asyncio.ensure_future(call.read()))  # waits for an event that never comes
        await asyncio.sleep(0.5)  # the server has taken the stream up
        assert not call.done()
        return call

    async with edge_server(redis_server, max_watches_per_caller=2) as (_, addr), grpc.aio.insecure_channel(addr) as ch:
        stub = allocator_pb2_grpc.AllocatorStub(ch)
        first, second = await opened(stub), await opened(stub)
        third = stub.WatchJobs(allocator_pb2.WatchJobsRequest(), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await third.read()
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "ELASTICO_MAX_WATCHES_PER_CALLER" in err.value.details()
        first.cancel()
        await asyncio.sleep(0.5)
        again = await opened(stub)
        assert again.done() is False  # taken up: the closed stream's place was freed
        second.cancel()
        again.cancel()
        await asyncio.gather(*reads, return_exceptions=True)
