"""Declared shapes end to end: the real allocator Scheduler places a job that declares its shapes in exactly one of
them, and a node agent (in process: real reconciler, simulated GPUs and MPS, real workload processes, real
redis-server) launches it with exactly that share and memory in its environment.

The outside probe this answers: a job declaring ``Shape(1, 10 %, 12000 MiB)`` ran at 50 % with
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M`` and ``shape_index`` 1 of a one-shape list, and 32 jobs declaring
10 %/1 GiB ran 8 at a time on a 4-GPU node.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from elastico.domain import Job, JobState, Shape, TrainingWork
from elastico.state.redis_store import RedisStore
from services.allocator.policy import POLICY_NAMES
from services.allocator.rounds import Scheduler
from services.node_agent.mps import SimulatedMps, read_environ
from services.node_agent.reconcile import Reconciler
from services.node_agent.runner import kill_tagged
from services.node_agent.servicer import NodeAgent
from services.node_agent.settings import NodeAgentSettings
from services.node_agent.simulated import SimulatedBackend
from tests.conftest import make_job, make_spec
from tests.integration.test_allocator_rounds import agent_reports, heartbeat, leader, settings
from tests.integration.test_node_agent_process import child_of, reachable_dir, synthetic_workload_env

NODE = "declared-node"
PROBE = Shape(num_gpus=1, compute_share_pct=10, mem_mib=12000)  # the probe's job: 10 %, 12,000 MiB
TWO = (Shape(1, 30.0, 3000), Shape(1, 100.0, 15000))  # a job declaring two shapes
LONG = TrainingWork(total_steps=10**9)  # nothing finishes during a test
#: what a workload's environment carries: its GPU, MPS share and memory limit (read once the exec has written them all)
MPS_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")


def _assert_declared(job: Job) -> Shape:
    """The job's committed placement is exactly one of its declared shapes; returns it."""
    p = job.placement
    assert p is not None and 0 <= p.shape_index < len(job.spec.shapes)
    want = job.spec.shapes[p.shape_index]
    assert p.shape == want and len(p.slices) == want.num_gpus
    assert all((s.compute_share_pct, s.mem_mib) == (want.compute_share_pct, want.mem_mib) for s in p.slices)
    return want


@pytest.fixture
async def agent_node(redis_server) -> AsyncIterator[dict]:
    """A node agent in process on 4 simulated V100s (16,384 MiB each) with simulated MPS, on a fresh namespace."""
    store = RedisStore.from_url(redis_server.url, namespace=f"decl-{uuid.uuid4().hex[:8]}")
    with reachable_dir() as root:  # workloads run as `nobody` when the tests run as root: it must reach their files
        state = (Path(root) / "state").resolve()
        backend = SimulatedBackend(NODE, "v100", 4, 16384)
        mps = SimulatedMps(state / "mps" / "pipe", state / "mps" / "log")
        policy = NodeAgentSettings.from_env({**synthetic_workload_env(), "ELASTICO_INSECURE": "1", "ELASTICO_REDIS_URL":
                                             redis_server.url, "ELASTICO_STATE_DIR": str(state)}).workload_policy
        reconciler = Reconciler(store, backend, mps, NODE, state, stop_grace_s=2, observation_interval_s=0, policy=policy)
        await reconciler.recover()
        agent = NodeAgent(store, backend, NODE, "127.0.0.1:0", reconciler)
        await agent.heartbeat()
        try:
            yield {"store": store, "reconciler": reconciler, "agent": agent, "state": state}
        finally:
            await reconciler.stop_all()
            kill_tagged(str(state))
            await store.close()


@pytest.mark.parametrize("policy", POLICY_NAMES)
async def test_declared_share_and_memory_reach_the_workloads_environment(agent_node, policy):
    """Under every policy: the probe's job and a two-shape job are committed in declared shapes (shape_index into
    their own lists), the node's committed memory counts the declared MiB, and the node agent launches each real
    workload with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE / CUDA_MPS_PINNED_DEVICE_MEM_LIMIT of its declared shape."""
    store, reconciler = agent_node["store"], agent_node["reconciler"]
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(policy=policy), lease)
    probe, _ = await store.create_job(make_job(spec=make_spec(model_family="ResNet-18", batch_size=32, shapes=(PROBE,),
                                                                 training=LONG)))
    two, _ = await store.create_job(make_job(spec=make_spec(model_family="ResNet-18", batch_size=32, shapes=TWO,
                                                               training=LONG)))
    rep = await sch.round(epoch)
    assert sorted(rep.placed) == sorted([probe.job_id, two.job_id]) and rep.dropped == 0
    jobs = {j: await store.get_job(j) for j in (probe.job_id, two.job_id)}
    shapes = {j: _assert_declared(job) for j, job in jobs.items()}
    assert jobs[probe.job_id].placement.shape_index == 0 and shapes[probe.job_id] == PROBE
    [n] = await store.list_nodes()
    by_gpu = {g.index: g for g in n.gpus}
    for job in jobs.values():  # committed usage counts exactly the declared shape
        s = job.placement.slices[0]
        others = [o.placement.slices[0] for o in jobs.values() if o is not job and o.placement.slices[0].gpu_index == s.gpu_index]
        assert by_gpu[s.gpu_index].allocated_mem_mib == s.mem_mib + sum(o.mem_mib for o in others)

    result = await reconciler.reconcile()
    assert result.started == 2
    ran = {w.job_id: w for w in reconciler.workloads()}
    envs = {}
    for job_id, shape in shapes.items():
        w = ran[job_id]
        assert (w.compute_share_pct, w.mem_mib) == (shape.compute_share_pct, shape.mem_mib)
        envs[job_id] = env = read_environ(child_of(w.pid, need=MPS_ENV))
        assert env is not None
        gpu = jobs[job_id].placement.slices[0].gpu_index
        assert env["CUDA_VISIBLE_DEVICES"] == str(gpu)
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == f"{shape.compute_share_pct:g}"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={shape.mem_mib}M"
    assert envs[probe.job_id]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=12000M"
    assert envs[probe.job_id]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"

    rep = await sch.round(epoch)  # the agent's report: running, still in the declared shapes
    assert rep.started == 2
    for j in jobs:
        got = await store.get_job(j)
        assert got.state is JobState.RUNNING and _assert_declared(got) == shapes[j]


@pytest.mark.parametrize("max_tenants", [4, 8])
async def test_32_jobs_declaring_10pct_are_placed_up_to_the_tenant_limit(store, max_tenants):
    """32 jobs declaring 10 %/1 GiB on one 4-GPU node: placed max_tenants per GPU (16 or 32), each at 10 %/1024 MiB.
    Before, the policy substituted its own shapes: here 25 %/4 GiB, so at most 4 per GPU (16) whatever the tenant
    limit; the probe's cluster got 50 %/8 GiB, 8 at once.

    The policy (ElastiCo, the default) still co-locates only where its interference estimate keeps every tenant
    above the training floor: with the calibrated utilisation rule a third tenant of even the lightest training type
    is predicted at 0.63 of its speed (pair 0.775, additive composition), below the default floor 0.7, so at the
    default floor two per GPU -- 8 -- is the policy's interference decision, not the shapes. This test lowers the
    floor to 0.3 so that share and tenant slots are what bind, and lets one round try all 32 (the per-round
    placement bound, ``policy_max_attempts``, defaults to 8).
    """
    await heartbeat(store, "n1", gpus=4)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(max_tenants=max_tenants, train_floor=0.3, policy_max_attempts=32), lease)
    spec = make_spec(model_family="ResNet-18", batch_size=32, shapes=(Shape(1, 10.0, 1024),), training=LONG)
    jobs = [(await store.create_job(make_job(spec=spec)))[0] for _ in range(32)]
    rep = await sch.round(epoch)
    assert len(rep.placed) == 4 * max_tenants and rep.dropped == 0
    await agent_reports(store, "n1", "running")
    for _ in range(3):  # later rounds: nothing more fits, nothing is moved
        rep = await sch.round(epoch)
        assert rep.placed == [] and rep.preempted == 0 and rep.resized == 0
    got = [await store.get_job(j.job_id) for j in jobs]
    placed = [j for j in got if j.placement is not None]
    assert len(placed) == 4 * max_tenants
    for j in placed:
        assert _assert_declared(j) == Shape(1, 10.0, 1024) and j.placement.shape_index == 0
    [n] = await store.list_nodes()
    assert [(g.allocated_share_pct, g.allocated_mem_mib) for g in n.gpus] == [(10.0 * max_tenants, 1024 * max_tenants)] * 4
    assert all(j.state is JobState.PENDING for j in got if j.placement is None)


@pytest.mark.parametrize("unlimited", [True, False])
async def test_a_plain_training_job_without_a_service_launches_without_a_compute_limit(agent_node, unlimited):
    """ELASTICO_UNLIMITED_TRAINING (on by default): ElastiCo places a job without declared shapes on a GPU without a
    service; its slice books its share and memory, and the node agent launches it with the placement shape's MPS
    limit -- 100 % (unlimited), or its share when the setting is off."""
    store, reconciler = agent_node["store"], agent_node["reconciler"]
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(policy="elastico", unlimited_training=unlimited), lease)
    job, _ = await store.create_job(make_job(spec=make_spec(model_family="ResNet-18", batch_size=32, training=LONG)))
    rep = await sch.round(epoch)
    assert rep.placed == [job.job_id]
    p = (await store.get_job(job.job_id)).placement
    share, mem = p.slices[0].compute_share_pct, p.slices[0].mem_mib
    assert p.shape.compute_share_pct == (100.0 if unlimited else share) and share <= 100.0
    assert (await reconciler.reconcile()).started == 1
    [w] = reconciler.workloads()
    env = read_environ(child_of(w.pid, need=MPS_ENV))
    assert env is not None and (w.compute_share_pct, w.mem_mib) == (share, mem)  # the booked slice is reported
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == f"{p.shape.compute_share_pct:g}"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={mem}M"
