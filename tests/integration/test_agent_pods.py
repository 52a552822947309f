"""A node agent in Kubernetes mode follows pods as the workloads of pod jobs (memory store, simulated GPUs).

The API server is tests/kubefake.py's ``FakeKube`` (list/watch with resourceVersion, 410, graceful deletion,
Eviction), reached through the official client exactly as in a cluster; its ``FakeKubelet`` runs each container as a
real process in a cgroup named like a pod's (or the equivalent /proc overlay the agent reads the same way). The tests
play the allocator with the store's primitives (commit a placement, release a job) and drive ``reconcile()``.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from kubernetes import client
from structlog.testing import capture_logs

from elastico.domain import (
    POD_LABEL,
    POD_OWNER_LABEL,
    POD_UID_LABEL,
    GpuCounters,
    GpuSlice,
    InferenceWork,
    JobKind,
    JobState,
    MetricsEndpoint,
    Placement,
    Shape,
    StateReason,
    Workload,
)
from elastico.state.memory import MemoryStore
from services.node_agent.mps import SimulatedMps
from services.node_agent.podwatch import KubePods, PodWatcher, core_api
from services.node_agent.reconcile import Reconciler
from services.node_agent.runner import kill_tagged
from services.node_agent.settings import NodeAgentSettings
from services.node_agent.simulated import SimulatedBackend
from tests.conftest import make_job, make_node, make_spec, reachable_dir
from tests.integration.test_node_agent_process import synthetic_workload_env
from tests.kubefake import FakeKube, FakeKubelet

NODE = "gpu-node-1"
NS = "team-a"
POD_IP = "127.0.0.2"  # loopback, but not 127.0.0.1: a scrape there used the pod IP from the watch


class CountingBackend(SimulatedBackend):
    """Simulated GPUs whose NVML-like per-process counters report every pod process plus one unrelated process."""

    def __init__(self, kubelet: FakeKubelet) -> None:
        super().__init__(NODE, "v100", 2, 16384)
        self.kubelet = kubelet

    def process_counters(self) -> dict[int, GpuCounters]:
        pids = [p for uid in self.kubelet.running for p in self.kubelet.pids(uid)]
        return {1: GpuCounters(sm_util_pct=99.0), **{p: GpuCounters(sm_util_pct=10.0, mem_used_mib=100.0) for p in pids}}


@pytest.fixture
async def kube() -> AsyncIterator[dict]:
    with reachable_dir() as root:
        state = (root / "state").resolve()
        fake = FakeKube()
        url = await fake.start()
        kubelet = FakeKubelet(fake, NODE, root / "kubelet", pod_ip=POD_IP)
        await kubelet.start()
        store = MemoryStore()
        await store.put_node(make_node(NODE, gpus=2))
        policy = NodeAgentSettings.from_env({**synthetic_workload_env(), "ELASTICO_INSECURE": "1", "ELASTICO_STATE_DIR": str(state),
                                             "ELASTICO_REDIS_URL": "redis://127.0.0.1:6379/0"}).workload_policy
        c = {"fake": fake, "url": url, "kubelet": kubelet, "store": store, "state": state, "policy": policy, "root": root,
             "epoch": await store.acquire_leadership("alloc", 60), "agents": []}
        c["agent"] = await new_agent(c)
        try:
            yield c
        finally:
            for r in c["agents"]:
                await r.aclose()
            await kubelet.stop()
            await fake.stop()
            kill_tagged(str(state))
            await store.close()


async def new_agent(c: dict) -> Reconciler:
    """An agent on ``NODE`` following its pods (a fresh watch: as after an agent restart)."""
    # short watch calls: the fake server's stop waits for open watches to time out
    watcher = PodWatcher(core_api(c["url"]), NODE, request_timeout_s=2.0, watch_timeout_s=1)
    state = c["state"]
    r = Reconciler(c["store"], CountingBackend(c["kubelet"]), SimulatedMps(state / "mps" / "pipe", state / "mps" / "log"), NODE,
                   state, stop_grace_s=1.0, fault_holddown_s=0.2, policy=c["policy"],
                   pods=KubePods(watcher, Path(c["kubelet"].proc_root)))
    await r.recover()
    c["agents"].append(r)
    return r


def container(name: str, code: int = 0, *, until: Path | None = None, on_term: Path | None = None,
              env: dict[str, str] | None = None) -> dict:
    """A container running this interpreter: waits for ``until`` to exist (forever without it), then exits ``code``;
    with ``on_term`` it survives SIGTERM until that file exists, then exits 0 (``<on_term>.ready`` says it is armed)."""
    script = f"""
import os, signal, sys, time
term = {str(on_term)!r} if {on_term is not None} else None
if term:
    signal.signal(signal.SIGTERM, lambda *_: None)
    open(term + ".ready", "w").close()
until = {str(until)!r} if {until is not None} else None
while not (until and os.path.exists(until)) and not (term and os.path.exists(term)):
    time.sleep(0.02)
sys.exit(0 if term and os.path.exists(term) else {code})
"""
    return {"name": name, "image": "python", "command": ["python", "-c", script],
            "env": [{"name": k, "value": v} for k, v in (env or {}).items()]}


async def place_pod(c: dict, name: str, containers: list[dict], *, gpu: int = 0, share: float = 50.0,
                    owner: str = "ReplicaSet/train", inference: InferenceWork | None = None) -> tuple[str, str]:
    """A pod, its job placed on ``NODE`` (as the extender submits it and the allocator commits it), then bound.
    Returns (job id, pod uid)."""
    pod = await c["fake"].create_pod({"metadata": {"name": name, "namespace": NS},
                                      "spec": {"restartPolicy": "Never", "containers": containers,
                                               "terminationGracePeriodSeconds": 30}})
    uid = pod["metadata"]["uid"]
    labels = tuple(sorted({POD_LABEL: f"{NS}/{name}", POD_UID_LABEL: uid, POD_OWNER_LABEL: owner}.items()))
    kind = JobKind.INFERENCE if inference else JobKind.TRAINING
    spec = make_spec(kind, labels=labels, **({"inference": inference} if inference else {}))
    job, _ = await c["store"].create_job(make_job(spec=spec))
    shape = Shape(num_gpus=1, compute_share_pct=share, mem_mib=1024)
    await c["store"].commit_placements(c["epoch"], [(job, Placement("", 0, shape, (GpuSlice(NODE, gpu, share, 1024),)))])
    await c["fake"].update(NS, name, lambda p: p["spec"].__setitem__("nodeName", NODE))  # the Binding
    return job.job_id, uid


async def wait_report(r: Reconciler, job_id: str, cond: Callable[[Workload], bool], timeout_s: float = 10.0) -> Workload:
    """Reconcile until the job's reported workload satisfies ``cond``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    last = None
    while asyncio.get_running_loop().time() < deadline:
        await r.reconcile()
        last = (await r.store.get_workloads(NODE))[1].get(job_id)
        if last is not None and cond(last):
            return last
        await asyncio.sleep(0.05)
    raise AssertionError(f"workload of {job_id} never matched; last report: {last}")


async def file_appears(path: Path, timeout_s: float = 10.0) -> None:
    """Polls for ``path`` (a container's file: no API write announces it, so ``FakeKube.wait_for`` would not
    look again)."""
    async with asyncio.timeout(timeout_s):
        while not path.exists():
            await asyncio.sleep(0.02)


def ended(w: Workload) -> bool:
    return w.status in ("succeeded", "failed", "killed")


async def test_pod_job_runs_as_its_pods_processes_and_completes(kube: dict) -> None:
    r, done = kube["agent"], kube["root"] / "done"
    job_id, uid = await place_pod(kube, "train-0", [container("main", until=done), container("side", until=done)])
    w = await wait_report(r, job_id, lambda w: w.status == "running")
    pids = kube["kubelet"].pids(uid)
    assert len(pids) == 2 and w.pid in pids  # a container's main process
    assert w.counters == GpuCounters(sm_util_pct=20.0, mem_used_mib=200.0)  # summed over exactly the pod's processes
    assert w.gpu_indices == (0,) and w.compute_share_pct == 50.0 and w.log_path == ""
    assert not (kube["state"] / "workloads").exists()  # the agent started nothing
    done.touch()
    w = await wait_report(r, job_id, ended)
    assert (w.status, w.reason, w.exit_code) == ("succeeded", StateReason.COMPLETED, 0)
    assert kube["kubelet"].pids(uid) == []


async def test_failed_pod_reports_its_exit_code(kube: dict) -> None:
    r, done = kube["agent"], kube["root"] / "done"
    job_id, _ = await place_pod(kube, "train-3", [container("main", 3, until=done)])
    await wait_report(r, job_id, lambda w: w.status == "running")
    done.touch()
    w = await wait_report(r, job_id, ended)
    assert (w.status, w.reason, w.exit_code) == ("failed", StateReason.OWN_FAILURE, 3)
    assert "container main" in w.message


async def test_oom_killed_container_is_own_failure_naming_oomkilled(kube: dict) -> None:
    r = kube["agent"]
    job_id, uid = await place_pod(kube, "train-oom", [container("main")])
    await wait_report(r, job_id, lambda w: w.status == "running")
    kube["kubelet"].oom_kill(uid)
    w = await wait_report(r, job_id, ended)
    assert (w.status, w.reason) == ("failed", StateReason.OWN_FAILURE) and "OOMKilled" in w.message
    assert w.exit_code == 137


async def test_evicted_pod_is_preempted_only_after_its_processes_exit(kube: dict) -> None:
    r, release = kube["agent"], kube["root"] / "release"
    job_id, uid = await place_pod(kube, "train-ev", [container("main", on_term=release)])
    await wait_report(r, job_id, lambda w: w.status == "running")
    await file_appears(Path(f"{release}.ready"))  # its SIGTERM handler is armed
    body = client.V1Eviction(metadata=client.V1ObjectMeta(name="train-ev", namespace=NS))
    await asyncio.to_thread(core_api(kube["url"]).create_namespaced_pod_eviction, "train-ev", NS, body)
    await kube["fake"].wait_for(lambda: (kube["fake"].pod(NS, "train-ev") or {}).get("metadata", {}).get("deletionTimestamp"))
    for _ in range(10):  # SIGTERM ignored: the containers still run, so the job keeps its slices
        w = (await r.reconcile()).workloads
        (mine,) = [x for x in w if x.job_id == job_id]
        assert mine.status == "running" and "waiting for its containers to exit" in mine.message, mine
        await asyncio.sleep(0.05)
    assert kube["kubelet"].pids(uid)
    release.touch()  # the container exits 0 on its own terms: still an eviction, not a completion
    w = await wait_report(r, job_id, ended)
    assert (w.status, w.reason) == ("killed", StateReason.PREEMPTED) and "evicted" in w.message
    assert kube["kubelet"].pids(uid) == []


async def test_mps_fault_on_its_gpu_is_cotenant_fault(kube: dict) -> None:
    r, state = kube["agent"], kube["state"]
    pipe = state / "mps" / "pipe"
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_VISIBLE_DEVICES": "1"}  # an MPS client of GPU 1
    job_id, uid = await place_pod(kube, "train-mps", [container("main", env=env)], gpu=1)
    await wait_report(r, job_id, lambda w: w.status == "running")
    SimulatedMps(pipe, state / "mps" / "log").inject_fault(1)  # the server's fatal exception ends its clients
    w = await wait_report(r, job_id, ended)
    assert (w.status, w.reason) == ("failed", StateReason.COTENANT_FAULT) and "MPS server fault on GPU 1" in w.message


async def test_inference_pod_is_scraped_at_its_pod_ip(kube: dict) -> None:
    site = kube["root"] / "site"
    site.mkdir()
    (site / "metrics").write_text("vllm:request_success_total 10\nvllm:num_requests_waiting 2\nvllm:num_requests_running 1\n")
    with socket.socket() as sock:  # a free port on the pod's IP
        sock.bind((POD_IP, 0))
        port = sock.getsockname()[1]
    server = {"name": "vllm", "image": "python",
              "command": ["python", "-m", "http.server", str(port), "--bind", POD_IP, "--directory", str(site)]}
    inference = InferenceWork(demand_rps=5.0, latency_slo_ms=100.0, metrics=MetricsEndpoint(port=port, scrape_interval_s=0.2))
    job_id, _ = await place_pod(kube, "serve-0", [server], inference=inference)
    r = kube["agent"]
    w = await wait_report(r, job_id, lambda w: w.status == "running")  # "starting" until its endpoint first answers
    assert w.endpoint == f"{POD_IP}:{port}"
    (site / "metrics").write_text("vllm:request_success_total 30\nvllm:num_requests_waiting 2\nvllm:num_requests_running 1\n")
    w = await wait_report(r, job_id, lambda w: w.demand is not None and w.demand.request_rate_rps > 0)
    assert w.demand.queue_length == 2.0


async def test_pod_no_longer_desired_is_forgotten_but_keeps_its_gpu_from_process_workloads(kube: dict) -> None:
    r, store, release = kube["agent"], kube["store"], kube["root"] / "release"
    job_id, uid = await place_pod(kube, "train-gone", [container("main", until=release)], gpu=1)
    await wait_report(r, job_id, lambda w: w.status == "running")
    await store.release_job(kube["epoch"], await store.get_job(job_id), JobState.CANCELLED, StateReason.CANCELLED_BY_CLIENT)
    proc_job, _ = await store.create_job(make_job(spec=make_spec(JobKind.TRAINING)))
    shape = Shape(num_gpus=1, compute_share_pct=50.0, mem_mib=1024)
    await store.commit_placements(kube["epoch"], [(proc_job, Placement("", 0, shape, (GpuSlice(NODE, 1, 50.0, 1024),)))])
    with capture_logs() as logs:
        for _ in range(3):
            res = await r.reconcile()
            assert [w.job_id for w in res.workloads] == []  # the pod entry is forgotten, the process workload waits
    assert kube["kubelet"].pids(uid)  # never signalled: kubelet owns its containers
    waits = [e for e in logs if "waiting for the processes of pods no longer desired" in e["event"]]
    assert len(waits) == 1 and waits[0]["pod_uids"] == [uid]  # logged once
    assert uid in r.ledger.lingering
    release.touch()
    w = await wait_report(r, proc_job.job_id, lambda w: w.status == "running")
    assert w.pid > 0 and not r.ledger.lingering


async def test_restarted_agent_readopts_pods_and_sees_ends_that_happened_while_it_was_down(kube: dict) -> None:
    r, done = kube["agent"], kube["root"] / "done"
    finished, _ = await place_pod(kube, "train-a", [container("main", until=done)])
    deleted, _ = await place_pod(kube, "train-b", [container("main")], gpu=1)
    for j in (finished, deleted):
        await wait_report(r, j, lambda w: w.status == "running")
    await r.aclose()  # agent down: its watch ends
    done.touch()
    await kube["fake"].wait_for(lambda: (kube["fake"].pod(NS, "train-a") or {}).get("status", {}).get("phase") == "Succeeded")
    await kube["fake"].delete(NS, "train-b", grace_s=0)
    r2 = await new_agent(kube)
    w = await wait_report(r2, finished, ended)
    assert (w.status, w.reason) == ("succeeded", StateReason.COMPLETED)
    w = await wait_report(r2, deleted, ended)
    assert (w.status, w.reason, w.message) == ("killed", StateReason.PREEMPTED, "pod deleted")


async def test_watch_resumes_from_its_version_and_relists_after_410(kube: dict) -> None:
    r, watcher = kube["agent"], kube["agent"].pods.watcher
    first, second = kube["root"] / "first", kube["root"] / "second"
    a, _ = await place_pod(kube, "train-a", [container("main", until=first)])
    b, _ = await place_pod(kube, "train-b", [container("main", until=second)], gpu=1)
    for j in (a, b):
        await wait_report(r, j, lambda w: w.status == "running")
    assert watcher.lists == 1
    # a dropped watch: the end happens while the watch is down; the next one resumes from its version
    watches = watcher.watches
    watcher.interrupt()
    first.touch()
    w = await wait_report(r, a, ended)
    assert w.status == "succeeded" and watcher.lists == 1 and watcher.watches > watches
    # the version is compacted away while the watch is down: 410 Expired, then a fresh list
    kube["fake"].compact()
    watcher.interrupt()
    second.touch()
    w = await wait_report(r, b, ended)
    assert w.status == "succeeded"
    assert watcher.lists == 2


async def test_pod_job_on_an_agent_not_following_pods_fails_clearly(kube: dict) -> None:
    state = kube["state"]
    plain = Reconciler(kube["store"], SimulatedBackend(NODE, "v100", 2, 16384),
                       SimulatedMps(state / "mps" / "pipe", state / "mps" / "log"), NODE, state / "plain", policy=kube["policy"])
    await plain.recover()
    kube["agents"].append(plain)
    job_id, _ = await place_pod(kube, "train-x", [container("main", until=kube["root"] / "x")])
    w = await wait_report(plain, job_id, ended)
    assert (w.status, w.reason) == ("failed", StateReason.OWN_FAILURE) and "ELASTICO_KUBE_PODS" in w.message
    assert not (state / "plain" / "workloads").exists()
