"""NodeAgent gRPC API in-process (port 0) with a real reconciler, simulated GPUs and a real redis-server."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from elastico.config import Settings
from elastico.domain import GpuSlice, JobState, Placement, Shape, StateReason
from elastico.rpc.server import ServiceBinding, create_server
from elastico.state.redis_store import RedisStore
from elastico.v1 import node_agent_pb2, node_agent_pb2_grpc, predictor_pb2, predictor_pb2_grpc
from services.node_agent.mps import SimulatedMps
from services.node_agent.observations import PredictorReporter
from services.node_agent.reconcile import Reconciler
from services.node_agent.runner import find_tagged, kill_tagged
from services.node_agent.servicer import NodeAgent, NodeAgentServicer
from services.node_agent.settings import NodeAgentSettings
from services.node_agent.simulated import SimulatedBackend
from tests.conftest import make_job, make_spec, reachable_dir
from tests.integration.test_node_agent_process import synthetic_workload_env
from tests.integration.test_services_api import expect_code

NODE = "api-node"


class FakePredictor(predictor_pb2_grpc.PredictorServicer):
    def __init__(self, implemented: bool) -> None:
        self.implemented = implemented
        self.received: list[predictor_pb2.Observation] = []

    async def ReportObservation(self, request, context):
        if not self.implemented:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not yet")
        self.received.extend(request.observations)
        return predictor_pb2.ReportObservationResponse(accepted=len(request.observations))


@pytest.fixture
def state_root() -> Iterator[Path]:
    with reachable_dir() as d:  # workloads run as `nobody` when the tests run as root: it must reach their files
        yield d


@pytest.fixture(params=[True, False], ids=["predictor-accepts", "predictor-unimplemented"])
async def node(request, redis_server, state_root: Path) -> AsyncIterator[dict]:
    store = RedisStore.from_url(redis_server.url, namespace=f"napi-{uuid.uuid4().hex[:8]}")
    predictor = FakePredictor(implemented=request.param)
    pserver, pport = await create_server(Settings(service_name="predictor", insecure=True), [ServiceBinding(
        "elastico.v1.Predictor", predictor, predictor_pb2_grpc.add_PredictorServicer_to_server)])
    await pserver.start()
    backend = SimulatedBackend(NODE, "v100", 2, 16384)
    state = (state_root / "state").resolve()
    mps = SimulatedMps(state / "mps" / "pipe", state / "mps" / "log")
    reporter = PredictorReporter(f"127.0.0.1:{pport}", "v100", timeout_s=2)
    policy = NodeAgentSettings.from_env({**synthetic_workload_env(), "ELASTICO_INSECURE": "1", "ELASTICO_REDIS_URL":
                                         redis_server.url, "ELASTICO_STATE_DIR": str(state)}).workload_policy
    reconciler = Reconciler(store, backend, mps, NODE, state, stop_grace_s=2, observation_interval_s=0,
                            observation_sink=reporter, policy=policy)
    await reconciler.recover()
    agent = NodeAgent(store, backend, NODE, "127.0.0.1:0", reconciler)
    await agent.heartbeat()
    server, port = await create_server(Settings(service_name="node_agent", insecure=True), [ServiceBinding(
        "elastico.v1.NodeAgent", NodeAgentServicer(agent), node_agent_pb2_grpc.add_NodeAgentServicer_to_server)])
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield {"stub": node_agent_pb2_grpc.NodeAgentStub(channel), "store": store, "reconciler": reconciler,
               "predictor": predictor, "reporter": reporter, "mps": mps}
    finally:
        await channel.close()
        await server.stop(0)
        await pserver.stop(0)
        await reporter.close()
        kill_tagged(str(state))
        await store.close()


async def place(store, epoch: int, gpu: int, share: float, model: str = "ResNet-18", batch: int = 32) -> str:
    job, _ = await store.create_job(make_job(spec=make_spec(model_family=model, batch_size=batch)))
    shape = Shape(num_gpus=1, compute_share_pct=share, mem_mib=1024, batch_size=batch)
    await store.commit_placements(epoch, [(job, Placement("", 0, shape, (GpuSlice(NODE, gpu, share, 1024),)))])
    return job.job_id


async def test_sync_starts_and_stops_and_list_filters(node):
    stub, store = node["stub"], node["store"]
    epoch = await store.acquire_leadership("alloc", 60)
    a = await place(store, epoch, 0, 60.0)
    b = await place(store, epoch, 0, 40.0, "ResNet-50", 64)
    gen, _ = await store.get_desired(NODE)
    resp = await stub.Sync(node_agent_pb2.SyncRequest(min_generation=gen), timeout=10)
    assert (resp.applied_generation, resp.started, resp.stopped) == (gen, 2, 0)
    assert sorted(w.job_id for w in resp.workloads) == sorted([a, b])
    again = await stub.Sync(node_agent_pb2.SyncRequest(), timeout=10)  # level-triggered: nothing to do twice
    assert (again.started, again.stopped) == (0, 0)
    listed = await stub.ListWorkloads(node_agent_pb2.ListWorkloadsRequest(job_ids=[a]), timeout=5)
    assert [w.job_id for w in listed.workloads] == [a]
    w = listed.workloads[0]
    assert (w.status, list(w.gpu_indices), w.compute_share_pct, w.mem_mib, list(w.cotenants)) == ("running", [0], 60.0, 1024, [b])
    assert w.pid > 0 and w.placement_id and w.log_path.endswith("workload.log")
    status = await stub.GetNodeStatus(node_agent_pb2.GetNodeStatusRequest(), timeout=5)
    assert status.desired_generation == gen and sorted(x.job_id for x in status.workloads) == sorted([a, b])
    assert status.node.gpus[0].allocated_share_pct == 100.0

    # observations of the co-located pair reach the predictor (or are dropped quietly if UNIMPLEMENTED)
    for _ in range(40):
        await stub.Sync(node_agent_pb2.SyncRequest(), timeout=10)
        if node["predictor"].received or (not node["predictor"].implemented and node["reconciler"].pairs.last):
            break
        await asyncio.sleep(0.1)
    if node["predictor"].implemented:
        obs = node["predictor"].received[0]
        assert {obs.a.job_id, obs.b.job_id} == {a, b} and obs.node_id == NODE and obs.a.gpu_type == "v100"
        assert 0 < obs.norm_tput_a <= 1.5 and {obs.a.mps_share_pct, obs.b.mps_share_pct} == {60.0, 40.0}
    else:
        assert node["reconciler"].pairs.last and node["reporter"].sent == 0

    job = await store.get_job(b)
    await store.release_job(epoch, job, JobState.PENDING, StateReason.PREEMPTED)
    resp = await stub.Sync(node_agent_pb2.SyncRequest(), timeout=10)
    assert (resp.started, resp.stopped) == (0, 1)
    assert [w.job_id for w in resp.workloads] == [a]
    assert len(find_tagged(str(node["reconciler"].state_dir))) == 1
    running = await stub.ListWorkloads(node_agent_pb2.ListWorkloadsRequest(statuses=["succeeded"]), timeout=5)
    assert list(running.workloads) == []


INVALID = [
    (node_agent_pb2.ListWorkloadsRequest(statuses=["running", "bogus"]), "statuses[1]"),
    (node_agent_pb2.ListWorkloadsRequest(job_ids=["ok", "bad id"]), "job_ids[1]"),
    (node_agent_pb2.ListWorkloadsRequest(job_ids=["x"] * 1001), "job_ids"),
]


@pytest.mark.parametrize(("req", "field"), INVALID, ids=[f for _, f in INVALID])
async def test_list_rejects_malformed_filters_naming_the_field(node, req, field):
    await expect_code(node["stub"].ListWorkloads(req, timeout=5), grpc.StatusCode.INVALID_ARGUMENT, field)


async def test_sync_to_an_unreached_generation_is_unavailable_within_the_deadline(node):
    gen, _ = await node["store"].get_desired(NODE)
    err = await expect_code(node["stub"].Sync(node_agent_pb2.SyncRequest(min_generation=gen + 5), timeout=1.0),
                            grpc.StatusCode.UNAVAILABLE)
    assert "not visible yet" in err.details()


async def test_no_workload_starts_while_mps_is_stuck(node):
    store, mps = node["store"], node["mps"]
    epoch = await store.acquire_leadership("alloc", 60)
    mps.inject_stuck()
    await place(store, epoch, 1, 50.0)
    resp = await node["stub"].Sync(node_agent_pb2.SyncRequest(), timeout=10)
    assert resp.started == 0
    status = await node["stub"].GetNodeStatus(node_agent_pb2.GetNodeStatusRequest(), timeout=5)
    assert not status.node.ready
    mps.inject_stuck(False)
    resp = await node["stub"].Sync(node_agent_pb2.SyncRequest(), timeout=10)
    assert resp.started == 1  # started once MPS answers again
