"""Kubernetes end to end: pods are the workloads, ElastiCo chooses their shape, preemption goes through eviction.

Every component is the real one except the Kubernetes control plane: the webhook's AdmissionReview answer (its
JSONPatch applied), a kube-scheduler loop calling the extender's filter and bind, the allocator servicer and its
scheduling rounds (ElastiCo policy) on the test redis-server, the extender's eviction controller and reaper, and a
node agent in Kubernetes mode (simulated GPU) following the pods through the API server. The API server, the
kubelet (real processes in a pod's cgroup, the downward-API environment) and a ReplicaSet controller are
tests/kubefake.py's.

The scenario: an owned training pod runs at the share the policy picked (what its process's environment says);
an urgent job makes the policy preempt it; the pod is evicted (an Event says why), the urgent job starts only
after the pod's processes are gone (sampled every 20 ms), the pod's job ends CANCELLED/PREEMPTED; the
ReplicaSet's replacement is a new pod, placed when capacity returns, and its completion reaches its job.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from elastico.domain import POD_UID_LABEL, JobState, StateReason, label
from elastico.rpc import convert
from elastico.state.redis_store import RedisStore
from elastico.tasks import cancel_until_done
from elastico.v1 import allocator_pb2 as apb
from elastico.v1 import allocator_pb2_grpc
from elastico.v1 import types_pb2 as tpb
from services.kube import annotations as a
from services.kube import webhook
from services.kube.evictions import PREEMPTED, EvictionController
from services.kube.extender import Extender
from services.kube.kubeapi import KubeApi
from services.kube.settings import KubeSettings
from services.node_agent.mps import SimulatedMps
from services.node_agent.podwatch import KubePods, PodWatcher, core_api
from services.node_agent.reconcile import Reconciler
from services.node_agent.runner import kill_tagged
from services.node_agent.servicer import NodeAgent
from services.node_agent.settings import NodeAgentSettings
from services.node_agent.simulated import SimulatedBackend
from tests.conftest import reachable_dir
from tests.integration._allocator import leading_allocator
from tests.integration.test_allocator_rounds import settings as allocator_settings
from tests.integration.test_kube_middleware import admission_review, apply_json_patch
from tests.integration.test_node_agent_process import synthetic_workload_env
from tests.kubefake import FakeKube, FakeKubelet, FakeReplicaSet

NODE = "gpu-node-1"  # one simulated V100
NS = "team-a"
FAST = 1e5  # policy seconds per wall second: the policy's minimum run time before a preemption passes in ms


def admitted_template(done: Path) -> dict:
    """A training pod template as the webhook admits it: its container waits for ``done`` and exits 0."""
    script = f"import os, time\nwhile not os.path.exists({str(done)!r}):\n    time.sleep(0.02)\n"
    pod = {"metadata": {"name": "trainer", "namespace": NS, "uid": str(uuid.uuid4()),
                        "labels": {a.OPT_IN_LABEL: "true", "app": "trainer"},
                        "annotations": {a.MEM: "4096", a.MODEL: "ResNet-50", a.BATCH: "64", a.TOTAL_STEPS: str(10**9)}},
           "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "main", "image": "trainer:1", "command": ["python", "-c", script]}]},
           "status": {"phase": "Pending"}}
    settings = KubeSettings.from_env({}, insecure=True, role="both", allocator_address="x:1")
    resp = webhook.review(admission_review(pod), settings)["response"]
    assert resp["allowed"], resp
    admitted = apply_json_patch(pod, json.loads(base64.b64decode(resp["patch"])))
    assert admitted["spec"]["schedulerName"] == "elastico-scheduler"
    return admitted


class KubeScheduler:
    """kube-scheduler's part: every unbound pod of the ElastiCo scheduler goes through filter, then bind (retried)."""

    def __init__(self, kube: FakeKube, ext: Extender) -> None:
        self.kube, self.ext = kube, ext
        self.inflight: dict[str, asyncio.Task] = {}

    async def run(self) -> None:
        while True:
            for p in list(self.kube.pods.values()):
                meta = p["metadata"]
                if (p["spec"].get("schedulerName") == "elastico-scheduler" and not p["spec"].get("nodeName")
                        and not meta.get("deletionTimestamp") and meta["uid"] not in self.inflight):
                    self.inflight[meta["uid"]] = asyncio.create_task(self.schedule(p))
            self.inflight = {k: t for k, t in self.inflight.items() if not t.done()}
            await asyncio.sleep(0.1)

    async def schedule(self, pod: dict) -> None:
        kept = await self.ext.filter({"Pod": pod, "NodeNames": [NODE]})
        if NODE in (kept.get("NodeNames") or []):
            m = pod["metadata"]
            await self.ext.bind({"PodName": m["name"], "PodNamespace": m["namespace"], "PodUID": m["uid"], "Node": NODE})
        await asyncio.sleep(0.2)  # kube-scheduler's backoff before the pod is tried again


async def forever(fn, interval_s: float) -> None:
    while True:
        with contextlib.suppress(Exception):
            await fn()
        await asyncio.sleep(interval_s)


@pytest.fixture
async def suite(redis_server) -> AsyncIterator[dict]:
    with reachable_dir() as root:
        store = RedisStore.from_url(redis_server.url, namespace=f"kpods-{uuid.uuid4().hex[:8]}")
        fake = FakeKube()
        url = await fake.start()
        kubelet = FakeKubelet(fake, NODE, root / "kubelet")
        await kubelet.start()
        # the node agent in Kubernetes mode
        state = (root / "state").resolve()
        policy = NodeAgentSettings.from_env({**synthetic_workload_env(), "ELASTICO_INSECURE": "1", "ELASTICO_STATE_DIR": str(state),
                                             "ELASTICO_REDIS_URL": "redis://127.0.0.1:6379/0"}).workload_policy
        backend = SimulatedBackend(NODE, "v100", 1, 16384)
        pods = KubePods(PodWatcher(core_api(url), NODE, request_timeout_s=2.0, watch_timeout_s=1), Path(kubelet.proc_root))
        reconciler = Reconciler(store, backend, SimulatedMps(state / "mps" / "pipe", state / "mps" / "log"), NODE, state,
                                stop_grace_s=1.0, policy=policy, pods=pods)
        await reconciler.recover()
        agent = NodeAgent(store, backend, NODE, "127.0.0.1:1", reconciler)
        await agent.heartbeat()
        # the allocator: job API + rounds as leader
        alloc = allocator_settings(policy="elastico", time_scale=FAST, round_interval_s=0.2, redis_url=redis_server.url, port=0)
        async with leading_allocator(store, alloc, "kpods") as leading:
            # the extender, its eviction controller and reaper, and kube-scheduler
            ks = KubeSettings.from_env({}, insecure=True, role="extender", port=0, allocator_address=f"127.0.0.1:{leading.port}",
                                       kube_api_url=url, bind_timeout_s=3.0, bind_poll_s=0.05, reap_interval_s=0, evict_interval_s=0)
            channel = grpc.aio.insecure_channel(ks.allocator_address)
            kube_api = KubeApi(ks)
            ext = Extender(ks, allocator_pb2_grpc.AllocatorStub(channel), None, kube_api)
            tasks = [asyncio.create_task(t) for t in (
                agent.heartbeat_forever(0.5), reconciler.run_forever(0.1), KubeScheduler(fake, ext).run(),
                forever(EvictionController(ext).evict_once, 0.2), forever(ext.reap_once, 0.5))]
            try:
                yield {"fake": fake, "kubelet": kubelet, "store": store, "reconciler": reconciler, "root": root,
                       "stub": allocator_pb2_grpc.AllocatorStub(channel)}
            finally:
                await cancel_until_done(tasks)
                await reconciler.aclose()
                await channel.close()
                kube_api.close()
        await kubelet.stop()
        await fake.stop()
        kill_tagged(str(state))
        await store.close()


async def pod_job(store, uid: str):
    for j in await store.list_active_jobs(for_round=False):
        if label(j.spec, POD_UID_LABEL) == uid:
            return j
    return None


async def until(cond, timeout_s: float = 30.0, what: str = ""):  # generous: a loaded CI box runs the chain slowly
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = await cond()
        if v:
            return v
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def environ(proc_root: str, pid: int) -> dict[str, str]:
    raw = Path(f"{proc_root}/{pid}/environ").read_bytes().decode()
    return dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)


async def test_pod_runs_at_the_policys_share_is_evicted_for_an_urgent_job_and_its_replacement_completes(suite):
    fake, kubelet, store, stub = suite["fake"], suite["kubelet"], suite["store"], suite["stub"]
    done = suite["root"] / "done"
    rs = FakeReplicaSet(fake, NS, "trainer", admitted_template(done), replicas=1)
    await rs.start()
    try:
        (first,) = rs.owned()
        uid = first["metadata"]["uid"]
        # bound, running, and the container's MPS environment is the share the policy committed
        job = await until(lambda: _running_job(store, uid), what="the pod's job RUNNING")
        share = job.placement.slices[0].compute_share_pct
        [pid] = kubelet.pids(uid)
        env = environ(kubelet.proc_root, pid)
        assert float(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]) == share
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={job.placement.slices[0].mem_mib}M"
        assert env["NVIDIA_VISIBLE_DEVICES"] == str(job.placement.slices[0].gpu_index)

        # an urgent job: the policy preempts the pod, which is evicted; the urgent job never runs beside it
        overlap: list[float] = []
        urgent_id: list[str] = []

        async def sample() -> None:
            while True:
                e = suite["reconciler"].ledger.entries.get(urgent_id[0]) if urgent_id else None
                if kubelet.pids(uid) and e is not None and e.running and e.pid and suite["reconciler"].runner.alive(e):
                    overlap.append(time.time())
                await asyncio.sleep(0.02)
        sampler = asyncio.create_task(sample())
        spec = apb.SubmitJobRequest(request_id="urgent-1", spec=tpb.JobSpec(
            kind=tpb.JOB_KIND_TRAINING, name="urgent", priority=100, model_family="ResNet-50", batch_size=64,
            training=tpb.TrainingWork(total_steps=10**9)))
        urgent = (await stub.SubmitJob(spec, timeout=5)).job
        urgent_id.append(urgent.job_id)
        await until(lambda: _state(store, urgent.job_id, JobState.RUNNING), what="the urgent job RUNNING")
        sampler.cancel()
        assert overlap == [], "the urgent job's process ran while the evicted pod's container still lived"
        assert (NS, first["metadata"]["name"], 201) in fake.evictions
        assert PREEMPTED in [e["reason"] for e in fake.events(NS, first["metadata"]["name"])]
        gone = await store.get_job(job.job_id)
        assert (gone.state, gone.reason) == (JobState.CANCELLED, StateReason.PREEMPTED)

        # the replacement: a new pod, placed once the urgent job is gone, completes
        (second,) = await until(lambda: _replacement(rs, uid), what="the ReplicaSet's replacement pod")
        await stub.CancelJob(apb.CancelJobRequest(job_id=urgent.job_id), timeout=5)
        uid2 = second["metadata"]["uid"]
        job2 = await until(lambda: _running_job(store, uid2), what="the replacement's job RUNNING")
        assert float(environ(kubelet.proc_root, kubelet.pids(uid2)[0])["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]) == \
            job2.placement.slices[0].compute_share_pct
        done.touch()
        await until(lambda: _state(store, job2.job_id, JobState.SUCCEEDED), what="the replacement's job SUCCEEDED")
        assert convert.reason_to_pb((await store.get_job(job2.job_id)).reason) == tpb.STATE_REASON_COMPLETED
    finally:
        await rs.stop()


async def _running_job(store, uid: str):
    j = await pod_job(store, uid)
    return j if j is not None and j.state is JobState.RUNNING else None


async def _state(store, job_id: str, state: JobState) -> bool:
    return (await store.get_job(job_id)).state is state


async def _replacement(rs: FakeReplicaSet, old_uid: str):
    owned = rs.owned()
    return owned if len(owned) == 1 and owned[0]["metadata"]["uid"] != old_uid else None
