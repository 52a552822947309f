"""Kubernetes pods' jobs on the allocator side: real Scheduler rounds on a real redis-server, node agents played by
the test (their reports), the Allocator API over gRPC with bearer tokens.

A pod job keeps its slices until its pod is gone: the policy preempting or resizing one requests its eviction
(reason EVICTION_REQUESTED, nothing released); the agent's report of the pod's end releases it, terminally. A bare
pod (no owner) is never preempted. Label keys ``elastico.io/...`` are the extender's; a tenant deletes a pod
rather than cancelling its job.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
from prometheus_client import REGISTRY

from elastico import auth
from elastico.domain import (
    POD_LABEL,
    POD_OWNER_LABEL,
    POD_UID_LABEL,
    Job,
    JobState,
    Shape,
    StateReason,
    TrainingWork,
    placement_id,
)
from elastico.rpc import convert
from elastico.rpc.security import ClientTLS
from elastico.rpc.server import ServiceBinding, create_server
from elastico.state.redis_store import RedisStore
from elastico.v1 import allocator_pb2 as apb
from elastico.v1 import allocator_pb2_grpc
from elastico.v1 import types_pb2 as tpb
from services.allocator.plan import POD_GONE_MESSAGE
from services.allocator.policy import POLICY_NAMES
from services.allocator.rounds import Scheduler
from services.allocator.servicer import AllocatorServicer, api_access
from tests.conftest import make_job, make_spec
from tests.integration.test_allocator_rounds import agent_reports, heartbeat, leader, settings
from tests.integration.test_demand import service_spec

LONG = TrainingWork(total_steps=10**9)  # nothing finishes during a test
GRID = tuple(Shape(1, float(s), 4096) for s in (25, 50, 75, 100))  # the extender's family: every share, one memory
FAST = 1e5  # policy seconds per wall second: the policy's minimum run time before a preemption passes in ms


@pytest.fixture
async def rstore(redis_server) -> AsyncIterator[RedisStore]:
    s = RedisStore.from_url(redis_server.url, namespace=f"pod-{uuid.uuid4().hex[:8]}")
    yield s
    await s.close()


def pod_labels(name: str, owner: bool = True, ns: str = "team-a") -> tuple[tuple[str, str], ...]:
    labels = [(POD_LABEL, f"{ns}/{name}"), (POD_UID_LABEL, f"uid-{name}")]
    return tuple(sorted(labels + ([(POD_OWNER_LABEL, f"ReplicaSet/{name}-rs")] if owner else [])))


def pod_spec(name: str, owner: bool = True, node: str = "n1", **kw):
    """A pod's job as the extender submits it: the share grid at one GPU, pinned to the pod's node, no command."""
    kw.setdefault("model_family", "ResNet-50")
    kw.setdefault("batch_size", 64)
    return make_spec(shapes=GRID, allowed_nodes=(node,), labels=pod_labels(name, owner), training=LONG, **kw)


def evictions(reason: str) -> float:
    return REGISTRY.get_sample_value("elastico_allocator_evictions_requested_total", {"reason": reason}) or 0.0


async def reason_events(store, job_id: str, reason: StateReason) -> int:
    return sum(1 for e in await store.read_events("0", limit=10_000) if e.job_id == job_id and e.reason is reason)


async def running_pod(store, owner: bool, policy: str = "elastico") -> tuple[Scheduler, int, Job]:
    """A scheduler leading one-GPU node ``n1`` with a pod job there at 100 %, reported running by its agent."""
    await heartbeat(store, "n1", gpus=1)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(policy=policy, time_scale=FAST), lease)
    pod, _ = await store.create_job(make_job(spec=pod_spec("p-1", owner)))
    await sch.round(epoch)
    await agent_reports(store, "n1", "running")
    await sch.round(epoch)
    pod = await store.get_job(pod.job_id)
    assert pod.state is JobState.RUNNING and pod.placement.slices[0].compute_share_pct == 100.0
    return sch, epoch, pod


async def urgent_job(store) -> Job:
    """A high-priority job that would preempt a normal one on the only GPU; the policy's minimum run time passes."""
    job, _ = await store.create_job(make_job(spec=make_spec(model_family="ResNet-50", batch_size=64, priority=100, training=LONG)))
    await asyncio.sleep(0.05)  # 5000 policy seconds
    return job


async def test_a_preempted_pod_keeps_its_slices_until_its_agent_reports_it_ended(rstore):
    store = rstore
    sch, epoch, pod = await running_pod(store, owner=True)
    before = evictions("preempted")
    hi = await urgent_job(store)
    rep = await sch.round(epoch)
    asked = await store.get_job(pod.job_id)
    assert rep.evictions == {"preempted": 1} and rep.preempted == 0 and rep.placed == []
    assert (asked.state, asked.reason, asked.message) == (JobState.RUNNING, StateReason.EVICTION_REQUESTED, "preempted by the policy")
    assert asked.placement == pod.placement  # placement and booked slices unchanged
    gpu = (await store.get_node("n1")).gpus[0]
    assert (gpu.allocated_share_pct, gpu.allocated_mem_mib) == (100.0, 4096)
    assert placement_id((await store.get_desired("n1"))[1][pod.job_id]) == placement_id(pod.placement)
    assert evictions("preempted") == before + 1
    for _ in range(2):  # the pod is still there (its eviction pending, e.g. a PDB refusing): nothing else is placed
        await agent_reports(store, "n1", "running")
        rep = await sch.round(epoch)
        assert rep.placed == [] and rep.evictions == {}  # no second request
        assert (await store.get_job(hi.job_id)).state is JobState.PENDING
        assert (await store.get_job(pod.job_id)).reason is StateReason.EVICTION_REQUESTED
    assert await reason_events(store, pod.job_id, StateReason.EVICTION_REQUESTED) == 1
    assert evictions("preempted") == before + 1

    await agent_reports(store, "n1", "killed", StateReason.PREEMPTED)  # the pod evicted: its containers are gone
    rep = await sch.round(epoch)
    gone = await store.get_job(pod.job_id)
    assert (gone.state, gone.reason, gone.message) == (JobState.CANCELLED, StateReason.PREEMPTED, POD_GONE_MESSAGE)
    assert rep.released == {"preempted": 1} and rep.placed == [hi.job_id]  # the waiting job gets the GPU
    placed = await store.get_job(hi.job_id)
    assert placed.state is JobState.PLACED and placed.placement.slices[0].node_id == "n1"
    assert set((await store.get_desired("n1"))[1]) == {hi.job_id}


async def test_a_bare_pod_is_never_preempted(rstore):
    store = rstore
    sch, epoch, pod = await running_pod(store, owner=False)
    before = evictions("preempted")
    hi = await urgent_job(store)
    for i in range(3):
        rep = await sch.round(epoch)
        await agent_reports(store, "n1", "running")
        assert rep.placed == [] and rep.evictions == {} and rep.preempted == 0
        if i == 0:  # the policy preempted it, as it does an evictable pod (above): dropped, "bare pod: never preempted"
            assert rep.dropped >= 1
    kept = await store.get_job(pod.job_id)
    assert (kept.state, kept.reason, kept.placement) == (JobState.RUNNING, StateReason.STARTED, pod.placement)
    assert (await store.get_job(hi.job_id)).state is JobState.PENDING
    assert evictions("preempted") == before


async def test_pod_job_ends_are_terminal_and_a_lost_node_keeps_them_placed(rstore):
    """Four pods on a 4-GPU node end four ways (each reported by its agent): succeeded, failed, a co-tenant's fault,
    evicted; none is requeued, every slice is released. A fifth on a node that goes silent stays placed."""
    store = rstore
    await heartbeat(store, "n1", gpus=4)
    await heartbeat(store, "n2", gpus=1)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(), lease)
    pods = [(await store.create_job(make_job(spec=pod_spec(f"p-{i}"))))[0] for i in range(4)]
    lost, _ = await store.create_job(make_job(spec=pod_spec("p-lost", node="n2")))
    rep = await sch.round(epoch)
    assert sorted(rep.placed) == sorted(j.job_id for j in [*pods, lost])
    for n in ("n1", "n2"):
        await agent_reports(store, n, "running")
    await sch.round(epoch)
    ends = [("succeeded", StateReason.COMPLETED), ("failed", StateReason.OWN_FAILURE), ("failed", StateReason.COTENANT_FAULT),
            ("killed", StateReason.PREEMPTED)]
    for job, (status, reason) in zip(pods, ends, strict=True):
        await agent_reports(store, "n1", status, reason, only={job.job_id})
    await heartbeat(store, "n2", gpus=1, age_s=60)  # n2 silent past node_stale_s + node_grace_s
    rep = await sch.round(epoch)
    got = [await store.get_job(j.job_id) for j in pods]
    assert [(j.state, j.reason) for j in got] == [
        (JobState.SUCCEEDED, StateReason.COMPLETED), (JobState.FAILED, StateReason.OWN_FAILURE),
        (JobState.FAILED, StateReason.COTENANT_FAULT), (JobState.CANCELLED, StateReason.PREEMPTED)]
    assert got[3].message == POD_GONE_MESSAGE and all(j.placement is None for j in got)
    assert all(g.allocated_share_pct == 0 and g.allocated_mem_mib == 0 for g in (await store.get_node("n1")).gpus)
    assert (await store.get_desired("n1"))[1] == {}
    for _ in range(2):
        await sch.round(epoch)
        kept = await store.get_job(lost.job_id)
        assert kept.state is JobState.RUNNING and kept.reason is StateReason.STARTED  # no NODE_LOST requeue
        assert (await store.get_node("n2")).gpus[0].allocated_share_pct == kept.placement.slices[0].compute_share_pct


@pytest.mark.parametrize("policy", POLICY_NAMES)
async def test_every_policy_picks_a_pods_share_among_its_declared_grid(redis_server, policy):
    """The extender declares one shape per share of the grid: every policy chooses among them exactly as it chooses
    its own share for the same job declaring nothing, next to a running service (ElastiCo: the complement)."""

    async def share_next_to_service(declared: bool) -> float | None:
        store = RedisStore.from_url(redis_server.url, namespace=f"pod-{uuid.uuid4().hex[:8]}")
        try:
            await heartbeat(store, "n1", gpus=1)
            lease, epoch = await leader(store, "a")
            sch = Scheduler(store, settings(policy=policy), lease)
            svc, _ = await store.create_job(make_job(spec=service_spec(3.0)))
            await sch.round(epoch)
            await agent_reports(store, "n1", "running")
            await sch.round(epoch)
            kw = {"shapes": GRID, "labels": pod_labels("p-1")} if declared else {}
            job, _ = await store.create_job(make_job(spec=make_spec(model_family="ResNet-18", batch_size=64, training=LONG,
                                                                    allowed_nodes=("n1",), **kw)))
            await sch.round(epoch)
            got, svc = await store.get_job(job.job_id), await store.get_job(svc.job_id)
        finally:
            await store.close()
        if got.placement is None:
            return None
        assert got.placement.slices[0].compute_share_pct + svc.placement.slices[0].compute_share_pct <= 100.0
        if declared:
            assert got.placement.shape == GRID[got.placement.shape_index] and got.placement.slices[0].mem_mib == 4096
        return got.placement.slices[0].compute_share_pct

    own, declared = await share_next_to_service(False), await share_next_to_service(True)
    assert declared == own
    want = {"elastico": 25.0, "mps-equal-share": 50.0}  # ElastiCo: the grid's largest share in what the service left
    if policy in want:
        assert declared == want[policy]


# --- the Allocator API: reserved labels, cancelling a pod's job ------------------------------------------------
@pytest.fixture
async def api(rstore, tmp_path) -> AsyncIterator[dict]:
    """The Allocator API with bearer tokens (plaintext loopback): a tenant of team-a and the kube extender."""
    tokens_file = tmp_path / "tokens.json"
    tok = {"tenant": auth.issue(tokens_file, "alice", "tenant", tenant="team-a"),
           "kube": auth.issue(tokens_file, "kube-extender", "scheduler"),
           "op": auth.issue(tokens_file, "ops", "operator")}
    s = settings(port=0, auth_tokens_file=str(tokens_file))
    server, port = await create_server(s, [ServiceBinding("elastico.v1.Allocator", AllocatorServicer(rstore, s),
                                                          allocator_pb2_grpc.add_AllocatorServicer_to_server, api_access(s))])
    await server.start()
    channels = {k: ClientTLS(None, t).aio_channel(f"127.0.0.1:{port}") for k, t in tok.items()}
    yield {k: allocator_pb2_grpc.AllocatorStub(c) for k, c in channels.items()}
    for c in channels.values():
        await c.close()
    await server.stop(0)


async def submit(stub, spec):
    return (await stub.SubmitJob(apb.SubmitJobRequest(request_id=uuid.uuid4().hex, spec=convert.job_spec_to_pb(spec)),
                                 timeout=5)).job


async def test_reserved_labels_are_the_extenders_and_a_tenant_deletes_the_pod_instead_of_cancelling(api, rstore):
    for labels in (pod_labels("p-1"), (("elastico.io/anything", "x"),), (("app", "web"), (POD_OWNER_LABEL, "Job/j"))):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await submit(api["tenant"], make_spec(labels=labels))
        assert e.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert e.value.details().startswith("spec.labels:") and labels[-1][0] in e.value.details()
    assert await rstore.list_active_jobs() == []  # nothing was written
    plain = await submit(api["tenant"], make_spec(labels=(("app", "web"),)))  # other labels are the tenant's own
    assert plain.spec.labels == {"app": "web"}
    pods = [await submit(api[who], pod_spec(f"p-{who}")) for who in ("kube", "op")]  # the extender's identities
    assert [dict(p.spec.labels)[POD_LABEL] for p in pods] == ["team-a/p-kube", "team-a/p-op"]

    got = await api["tenant"].GetJob(apb.GetJobRequest(job_id=pods[0].job_id), timeout=5)  # the tenant sees it...
    assert got.job.job_id == pods[0].job_id
    with pytest.raises(grpc.aio.AioRpcError) as e:  # ... and deletes the pod instead of cancelling its job
        await api["tenant"].CancelJob(apb.CancelJobRequest(job_id=pods[0].job_id), timeout=5)
    assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "job of pod team-a/p-kube: delete the pod" in e.value.details()
    assert (await rstore.get_job(pods[0].job_id)).state is JobState.PENDING
    done = await api["tenant"].CancelJob(apb.CancelJobRequest(job_id=plain.job_id), timeout=5)  # its own jobs: yes
    assert done.job.state == tpb.JOB_STATE_CANCELLED
    done = await api["kube"].CancelJob(apb.CancelJobRequest(job_id=pods[0].job_id), timeout=5)  # the reaper may
    assert done.job.state == tpb.JOB_STATE_CANCELLED


class _Chaos:
    """A policy of random decisions within the view's constraints (the decision contract drops the rest): it
    preempts, resizes and relaunches running jobs, pods among them, and places pending ones on random GPUs."""

    name = "chaos"
    needs_periodic_rounds = False

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def decide(self, view):
        from services.allocator.policy import Decision

        rng, d = self.rng, Decision()
        shares = [float(sh.compute_share_pct) for sh in GRID]
        for r in view.running.tolist():
            x = rng.random()
            if x < 0.25:
                d.preempt.append(r)
                if rng.random() < 0.3:  # a relaunch elsewhere / at another share
                    d.place.append((r, np.array([int(rng.integers(0, view.num_gpus))]), float(rng.choice(shares))))
            elif x < 0.4:
                d.resize.append((r, float(rng.choice(shares))))
        for r in view.pending.tolist():
            if rng.random() < 0.6:
                d.place.append((r, np.array([int(rng.integers(0, view.num_gpus))]), float(rng.choice(shares))))
        return d


@pytest.mark.parametrize(("policy", "seed"), [("chaos", 1), ("chaos", 2), ("elastico", 1)])
async def test_random_pods_never_oversubscribe_and_keep_their_slices_until_they_end(rstore, policy, seed):
    """Random arrivals (pods with and without owners, plain jobs, some urgent), evictions played out by the agents
    at random later, random ends, decided by ElastiCo or by random decisions: after every round each GPU's
    committed share and memory are what its active placements hold and within the GPU; a placed pod job keeps its
    one placement until its end is reported, is never requeued, has its eviction requested at most once, and only
    when it has an owner."""
    store, rng = rstore, np.random.default_rng(seed)
    nodes = ("n1", "n2")
    await heartbeat(store, *nodes, gpus=2)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(time_scale=FAST), lease)
    if policy == "chaos":
        chaos = _Chaos(seed)
        sch._policy = lambda matrix: chaos  # noqa: SLF001 - the test's policy
    pods: dict[str, bool] = {}  # pod job id -> has an owner
    placed_as: dict[str, str] = {}  # pod job id -> placement id of its one placement
    ended: dict[str, JobState] = {}  # pod job id -> the state its reported end must give
    requested = 0
    for k in range(90):  # 30 rounds; the chaos policy runs on until it has requested an eviction and one was played out
        if k >= 30 and (policy != "chaos" or (requested > 0 and JobState.CANCELLED in ended.values())):
            break
        for _ in range(int(rng.integers(0, 3))):
            urgent = int(rng.random() < 0.3) * 100
            if rng.random() < 0.8:
                owner = bool(rng.random() < 0.7)
                job, _ = await store.create_job(make_job(spec=pod_spec(f"p{k}-{len(pods)}", owner, str(rng.choice(nodes)),
                                                                       priority=urgent)))
                pods[job.job_id] = owner
            else:
                await store.create_job(make_job(spec=make_spec(model_family=str(rng.choice(["ResNet-18", "ResNet-50"])),
                                                               batch_size=64, priority=urgent, training=LONG)))
        rep = await sch.round(epoch)
        requested += sum(rep.evictions.values())
        active = {j.job_id: j for j in await store.list_active_jobs()}
        held: dict[tuple[str, int], list[float]] = {}
        for j in active.values():
            for p in (j.placement, j.draining):
                for sl in (p.slices if p else ()):
                    h = held.setdefault((sl.node_id, sl.gpu_index), [0.0, 0.0])
                    h[0] += sl.compute_share_pct
                    h[1] += sl.mem_mib
        for n in nodes:
            for g in (await store.get_node(n)).gpus:
                share, mem = held.get((n, g.index), [0.0, 0.0])
                assert g.allocated_share_pct == pytest.approx(share) and g.allocated_mem_mib == mem, (k, n, g.index)
                assert share <= 100.0 + 1e-6 and mem <= g.mem_total_mib, (k, n, g.index)
        for job_id, owner in pods.items():
            job = active.get(job_id) or await store.get_job(job_id)
            if job_id in ended:
                assert job.state is ended[job_id], (k, job_id)
                continue
            assert not job.state.terminal, (k, job_id)  # nobody reported its end: never released
            if job_id in placed_as:
                assert job.state is not JobState.PENDING and placement_id(job.placement) == placed_as[job_id], (k, job_id)
            elif job.placement is not None:
                placed_as[job_id] = placement_id(job.placement)
            asked = await reason_events(store, job_id, StateReason.EVICTION_REQUESTED)
            assert asked <= (1 if owner else 0), (k, job_id)
        # the agents: pods asked to leave are evicted (at random, later), some jobs end; the rest run
        ends: dict[str, tuple[str, StateReason, JobState]] = {}
        for job in active.values():
            if job.placement is None:
                continue
            if job.reason is StateReason.EVICTION_REQUESTED and rng.random() < 0.5:
                ends[job.job_id] = ("killed", StateReason.PREEMPTED, JobState.CANCELLED)
            elif rng.random() < 0.1:
                ends[job.job_id] = [("succeeded", StateReason.COMPLETED, JobState.SUCCEEDED),
                                    ("failed", StateReason.COTENANT_FAULT, JobState.FAILED)][int(rng.integers(0, 2))]
        for n in nodes:
            desired = set((await store.get_desired(n))[1])
            await agent_reports(store, n, "running", only=desired - set(ends))
            for job_id in desired & set(ends):
                status, reason, state = ends[job_id]
                await agent_reports(store, n, status, reason, only={job_id})
                if job_id in pods:
                    ended[job_id] = state
        await asyncio.sleep(0.02)  # >= min_run_s of policy time: ElastiCo may preempt any placed job next round
    assert any(not owner and job_id in placed_as for job_id, owner in pods.items())  # bare pods ran
    if policy == "chaos":  # its random decisions preempt and resize pods every few rounds
        assert requested > 0 and any(s is JobState.CANCELLED for s in ended.values())
