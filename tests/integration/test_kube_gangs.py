"""Gangs through the extender: the real allocator servicer with scheduling rounds on the test redis-server, two
Extender instances sharing one faithful fake API server (tests/kubefake.py). 4 member pods bind all or none under
concurrent bind calls; a timeout cancels every member's job; the share the policy picked is what a container's
environment resolves to (downward API, as a kubelet resolves it)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest

from elastico.domain import GANG_LABEL, POD_UID_LABEL, JobState, label
from elastico.state.redis_store import RedisStore
from elastico.v1 import allocator_pb2_grpc
from services.allocator.settings import AllocatorSettings
from services.kube import annotations as a
from services.kube import webhook
from services.kube.extender import Extender
from services.kube.kubeapi import KubeApi
from services.kube.settings import KubeSettings
from services.node_agent.servicer import NodeAgent
from services.node_agent.simulated import SimulatedBackend
from tests.integration._allocator import leading_allocator
from tests.kubefake import FakeKube, resolve_env

GPU_NODES = ("gpu-node-1", "gpu-node-2")  # two simulated V100s each, 16384 MiB
NS = "team-a"


def member(name: str, gang: str = "bert", size: int = 4, ann: dict | None = None, owner: str = "PyTorchJob") -> dict:
    """A gang member pod as the webhook admitted it (its containers' env reads the bind's annotations)."""
    settings = KubeSettings.from_env({}, insecure=True, role="both", allocator_address="x:1")
    containers = [{"name": "main", "command": ["python", "-c", "import time; time.sleep(60)"],
                   "env": webhook.container_env(settings.mps_pipe_dir)}]
    return {"metadata": {"name": name, "namespace": NS, "uid": str(uuid.uuid4()),
                         "labels": {a.OPT_IN_LABEL: "true", "training.kubeflow.org/job-name": gang},
                         "annotations": {a.MEM: "4096", a.MODEL: "ResNet-50", a.BATCH: "64", a.GANG_SIZE: str(size), **(ann or {})},
                         "ownerReferences": [{"apiVersion": "kubeflow.org/v1", "kind": owner, "name": gang, "uid": "o-1",
                                              "controller": True}]},
            "spec": {"containers": containers, "restartPolicy": "Never", "schedulerName": "elastico-scheduler"},
            "status": {"phase": "Pending"}}


@pytest.fixture
async def kube_cluster(redis_server) -> AsyncIterator[dict]:
    """Allocator (job API + rounds as leader) on the test redis, two heartbeating GPU nodes, the fake API server and
    two Extender instances (two replicas) on it."""
    ns = f"gang-{uuid.uuid4().hex[:8]}"
    store = RedisStore.from_url(redis_server.url, namespace=ns)
    for n in GPU_NODES:
        await NodeAgent(store, SimulatedBackend(n, "v100", 2, 16384), n, "127.0.0.1:1").heartbeat()
    alloc_settings = AllocatorSettings.from_env({}, insecure=True, redis_url=redis_server.url, port=0, estimator="rule",
                                                decide_worker="thread", round_interval_s=0.3)
    async with leading_allocator(store, alloc_settings, "gang-test") as alloc:
        fake = FakeKube()
        url = await fake.start()
        settings = KubeSettings.from_env({}, insecure=True, role="extender", port=0, allocator_address=f"127.0.0.1:{alloc.port}",
                                         kube_api_url=url, bind_timeout_s=5.0, bind_poll_s=0.05, gang_timeout_s=8.0,
                                         reap_interval_s=0, evict_interval_s=0)
        channel = grpc.aio.insecure_channel(settings.allocator_address)
        kubes = [KubeApi(settings), KubeApi(settings)]
        extenders = [Extender(settings, allocator_pb2_grpc.AllocatorStub(channel), None, k) for k in kubes]
        yield {"fake": fake, "ext": extenders, "store": store, "lease": alloc.lease, "settings": settings, "channel": channel}
        for k in kubes:
            k.close()
        await channel.close()
        await fake.stop()
    await store.close()


async def bind(ext: Extender, pod: dict, node: str) -> dict:
    return await ext.bind({"PodName": pod["metadata"]["name"], "PodNamespace": NS, "PodUID": pod["metadata"]["uid"],
                           "Node": node})


async def pod_jobs(ext: Extender) -> dict[str, object]:
    """Every job of a pod, by pod uid (the last one when a pod has several)."""
    return {label(j.spec, POD_UID_LABEL): j async for j in ext.allocator.list()}


async def test_four_member_gang_binds_all_together_under_concurrent_binds_on_two_extenders(kube_cluster):
    fake, (e1, e2) = kube_cluster["fake"], kube_cluster["ext"]
    pods = [await fake.create_pod(member(f"bert-{i}")) for i in range(4)]
    nodes = [GPU_NODES[i % 2] for i in range(4)]
    # arrivals spread over time and over both replicas; the first ones wait at the barrier
    calls = []
    for i, (p, n) in enumerate(zip(pods, nodes, strict=True)):
        calls.append(asyncio.create_task(bind((e1, e2)[i % 2], p, n)))
        await asyncio.sleep(0.2)
        if i < 3:
            assert fake.bindings == [], "no member binds before every member arrived"
    answers = await asyncio.gather(*calls)
    assert answers == [{"Error": ""}] * 4
    assert sorted(fake.bindings) == sorted((NS, p["metadata"]["name"], n) for p, n in zip(pods, nodes, strict=True))
    jobs = await pod_jobs(e1)
    for p, n in zip(pods, nodes, strict=True):
        stored = fake.pod(NS, p["metadata"]["name"])
        ann = stored["metadata"]["annotations"]
        job = jobs[p["metadata"]["uid"]]
        assert job.job_id == ann[a.JOB_ID] and job.state in (JobState.PLACED, JobState.RUNNING)
        assert label(job.spec, GANG_LABEL) == f"{NS}/bert" and job.spec.allowed_nodes == (n,) and job.spec.command == ""
        # the share the policy picked from the family is what the container's environment resolves to
        sl = job.placement.slices
        env = resolve_env(stored, stored["spec"]["containers"][0])
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == f"{sl[0].compute_share_pct:g}"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M" and env["NVIDIA_VISIBLE_DEVICES"] == str(sl[0].gpu_index)
        assert sl[0].compute_share_pct in (25.0, 50.0, 75.0, 100.0) and sl[0].node_id == n
    assert len([j for j in jobs.values() if label(j.spec, GANG_LABEL)]) == 4, "concurrent coordinators made one job each"


async def test_gang_binds_none_and_cancels_every_member_job_when_one_cannot_get_a_slice(kube_cluster):
    fake, (e1, e2) = kube_cluster["fake"], kube_cluster["ext"]
    settings = KubeSettings.from_env({}, **{**kube_cluster["settings"].__dict__, "gang_timeout_s": 2.0})
    e1.s = e2.s = settings
    # three fit; the fourth asks for more memory than its node's GPUs have
    pods = [await fake.create_pod(member(f"big-{i}", gang="big", ann={a.MEM: "20000"} if i == 3 else None))
            for i in range(4)]
    answers = await asyncio.gather(*(bind((e1, e2)[i % 2], p, GPU_NODES[i % 2]) for i, p in enumerate(pods)))
    assert all(r["Error"].startswith("elastico: gang team-a/big") for r in answers), answers
    assert any("no GPU slice for member(s) big-3" in r["Error"] for r in answers), answers
    assert fake.bindings == []
    jobs = await pod_jobs(e1)
    mine = [jobs[p["metadata"]["uid"]] for p in pods if p["metadata"]["uid"] in jobs]
    assert len(mine) == 4 and all(j.state is JobState.CANCELLED for j in mine), [(j.spec.name, j.state) for j in mine]
    # nothing is held: the GPUs are empty again
    for n in GPU_NODES:
        node = await kube_cluster["store"].get_node(n)
        assert all(g.allocated_share_pct == 0 for g in node.gpus)


async def test_gang_member_times_out_and_withdraws_when_the_others_never_arrive(kube_cluster):
    fake, (e1, _) = kube_cluster["fake"], kube_cluster["ext"]
    e1.s = KubeSettings.from_env({}, **{**kube_cluster["settings"].__dict__, "gang_timeout_s": 0.5})
    p = await fake.create_pod(member("lonely-0", gang="lonely", size=2))
    out = await bind(e1, p, GPU_NODES[0])
    assert out["Error"] == "elastico: gang team-a/lonely: 1 of 2 member pods arrived within 0.5s; nothing is held, " \
                           "kube-scheduler will retry"
    ann = fake.pod(NS, "lonely-0")["metadata"]["annotations"]
    assert a.GANG_NODE not in ann and a.GANG_ARRIVAL not in ann and fake.bindings == []
    assert p["metadata"]["uid"] not in await pod_jobs(e1)
