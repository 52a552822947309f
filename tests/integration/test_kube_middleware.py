"""Kubernetes middleware in-process: real-shaped AdmissionReview and ExtenderArgs posted over HTTP(S) to the running
webhook and extender; the extender talks to the real allocator (with scheduling rounds) and predictor servicers on a
free port against the test redis-server, and to a fake Kubernetes API server (aiohttp) that records Binding and PATCH.
Client certificates (services/kube/app.py): real TLS handshakes with certificates of ``elastico.pki.throwaway`` CAs.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import ipaddress
import json
import random
import ssl
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace

import aiohttp
import grpc
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from elastico import pki
from elastico.errors import ConfigError
from elastico.rpc.server import ServiceBinding, create_server
from elastico.state.redis_store import RedisStore
from elastico.v1 import allocator_pb2, allocator_pb2_grpc, predictor_pb2_grpc, types_pb2
from services.allocator.leader import LeaderLease
from services.allocator.rounds import Scheduler
from services.allocator.servicer import AllocatorServicer
from services.allocator.settings import AllocatorSettings
from services.kube import annotations as a
from services.kube import app as kube_app
from services.kube.extender import Extender
from services.kube.kubeapi import KubeApi
from services.kube.settings import KubeSettings
from services.node_agent.servicer import NodeAgent
from services.node_agent.simulated import SimulatedBackend
from services.predictor.model import InterferenceModel, train_model
from services.predictor.observations import RedisObservationLog
from services.predictor.servicer import PredictorServicer
from services.predictor.settings import PredictorSettings
from services.predictor.train import training_rows

GPU_NODES = ("gpu-node-1", "gpu-node-2")  # two simulated V100s each, 16384 MiB
CPU_NODE = "cpu-node-1"  # a Kubernetes node without an ElastiCo agent


# ------------------------------------------------------------------------------------------- payloads

def pod(name: str = "train-1", *, opted: bool = True, ann: dict | None = None, ns: str = "team-a", uid: str | None = None,
        gpu_limit: bool = False) -> dict:
    """A pod as the API server sends it (admission object / kube-scheduler's ExtenderArgs.Pod)."""
    annotations = {a.KIND: "training", a.SHARE: "50", a.MEM: "8192", a.MODEL: "ResNet-50", a.BATCH: "64"} if opted else {}
    annotations.update(ann or {})
    limits = {"cpu": "2", "memory": "4Gi", **({"nvidia.com/gpu": "1"} if gpu_limit else {})}
    return {
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {"name": name, "namespace": ns, "uid": uid or str(uuid.uuid4()), "resourceVersion": "4711",
                     "creationTimestamp": "2026-01-01T00:00:00Z",
                     "labels": {"app": "trainer", **({a.OPT_IN_LABEL: "true"} if opted else {})},
                     "annotations": annotations},
        "spec": {
            "containers": [{"name": "main", "image": "registry.example/trainer:1", "command": ["python", "train.py"],
                            "env": [{"name": "EPOCHS", "value": "3"}],
                            "resources": {"limits": limits, "requests": {"cpu": "1", "memory": "2Gi"}},
                            "volumeMounts": [{"name": "kube-api-access-x", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                                              "readOnly": True}],
                            "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
                            "imagePullPolicy": "IfNotPresent"},
                           {"name": "sidecar", "image": "busybox:1.36", "resources": {}}],
            "restartPolicy": "Never", "schedulerName": "default-scheduler", "serviceAccountName": "default",
            "volumes": [{"name": "kube-api-access-x", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}}],
            "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
                             "tolerationSeconds": 300}],
        },
        "status": {"phase": "Pending", "qosClass": "Burstable"},
    }


def admission_review(obj: dict, operation: str = "CREATE") -> dict:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
                        "resource": {"group": "", "version": "v1", "resource": "pods"},
                        "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                        "requestResource": {"group": "", "version": "v1", "resource": "pods"},
                        "namespace": obj["metadata"]["namespace"], "operation": operation,
                        "userInfo": {"username": "system:serviceaccount:kube-system:job-controller"},
                        "object": obj, "oldObject": None, "dryRun": False,
                        "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}}}


def node_obj(name: str) -> dict:
    return {"kind": "Node", "apiVersion": "v1", "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
            "status": {"capacity": {"cpu": "16", "memory": "64Gi"}, "allocatable": {"cpu": "16", "memory": "64Gi"}}}


def apply_json_patch(doc: dict, ops: list[dict]) -> dict:
    """RFC 6902 add/replace, enough to check what the API server would make of the webhook's patch."""
    doc = copy.deepcopy(doc)
    for op in ops:
        assert op["op"] in ("add", "replace"), op
        *parents, last = op["path"].lstrip("/").split("/")
        target = doc
        for p in parents:
            target = target[int(p)] if isinstance(target, list) else target[p]
        if isinstance(target, list):
            if last == "-":
                target.append(op["value"])
            elif op["op"] == "add":
                target.insert(int(last), op["value"])
            else:
                target[int(last)] = op["value"]
        else:
            assert op["op"] == "add" or last in target, op
            target[last] = op["value"]
    return doc


# ------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1/localhost (what cert-manager or the install script provides)."""
    d = tmp_path_factory.mktemp("tls")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "elastico-kube.elastico.svc")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    (d / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return str(d / "tls.crt"), str(d / "tls.key")


@pytest.fixture
async def webhook(tls_files) -> AsyncIterator[tuple[str, ssl.SSLContext]]:
    cert, key = tls_files
    settings = KubeSettings.from_env({}, insecure=True, role="webhook", port=0, tls_cert_file=cert, tls_key_file=key)
    runner, port = await kube_app.start(settings, None)
    yield f"https://127.0.0.1:{port}", ssl.create_default_context(cafile=cert)
    await runner.cleanup()


class FakeKubeApi:
    """The pods, pods/binding endpoints of an API server, recording every write."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict] = {}
        self.bindings: list[dict] = []
        self.patches: list[tuple[str, dict]] = []  # (content type, body)
        self.writes: list[str] = []  # "patch" / "binding", in order

    def app(self) -> web.Application:
        async def get(req: web.Request) -> web.Response:
            p = self.pods.get((req.match_info["ns"], req.match_info["name"]))
            if p is None:
                return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                                          "code": 404, "message": "pods not found"}, status=404)
            return web.json_response(p)

        async def patch(req: web.Request) -> web.Response:
            p = self.pods[(req.match_info["ns"], req.match_info["name"])]
            body = await req.json()
            self.patches.append((req.content_type, body))
            self.writes.append("patch")
            p["metadata"].setdefault("annotations", {}).update(body["metadata"]["annotations"])
            return web.json_response(p)

        async def binding(req: web.Request) -> web.Response:
            body = await req.json()
            self.bindings.append(body)
            self.writes.append("binding")
            self.pods[(req.match_info["ns"], req.match_info["name"])]["spec"]["nodeName"] = body["target"]["name"]
            return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201},
                                     status=201)

        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}", get)
        app.router.add_patch("/api/v1/namespaces/{ns}/pods/{name}", patch)
        app.router.add_post("/api/v1/namespaces/{ns}/pods/{name}/binding", binding)
        return app


@pytest.fixture(scope="module")
def model() -> InterferenceModel:
    """Trained from the shipped data (seconds), not read from models/: the artifact may lag the feature schema."""
    return train_model(training_rows(include_lucid=False), seed=0)


@pytest.fixture
async def cluster(redis_server, model) -> AsyncIterator[dict]:
    """Allocator (job API + scheduling rounds as leader) and predictor on one gRPC port, two GPU nodes heartbeating,
    the fake API server, and the extender (HTTP) wired to them."""
    ns = f"kube-{uuid.uuid4().hex[:8]}"
    store = RedisStore.from_url(redis_server.url, namespace=ns)
    for n in GPU_NODES:
        await NodeAgent(store, SimulatedBackend(n, "v100", 2, 16384), n, "127.0.0.1:1").heartbeat()
    alloc_settings = AllocatorSettings.from_env({}, insecure=True, redis_url=redis_server.url, port=0, estimator="rule",
                                                decide_worker="thread", round_interval_s=0.5)
    lease = LeaderLease(store, "kube-test", ttl_s=30)
    scheduler = Scheduler(store, alloc_settings, lease)
    lease.start()
    scheduler.start()
    obs = RedisObservationLog(redis_server.url, namespace=ns)
    pred_settings = PredictorSettings.from_env({}, insecure=True, port=0, redis_url=redis_server.url, refresh_interval_s=0)
    bindings = [ServiceBinding("elastico.v1.Allocator", AllocatorServicer(store, alloc_settings, on_change=scheduler.wake),
                               allocator_pb2_grpc.add_AllocatorServicer_to_server),
                ServiceBinding("elastico.v1.Predictor", PredictorServicer(pred_settings, model, obs),
                               predictor_pb2_grpc.add_PredictorServicer_to_server)]
    server, grpc_port = await create_server(alloc_settings, bindings)
    await server.start()
    fake = FakeKubeApi()
    fake_runner = web.AppRunner(fake.app())
    await fake_runner.setup()
    site = web.TCPSite(fake_runner, "127.0.0.1", 0)
    await site.start()
    api_port = site._server.sockets[0].getsockname()[1]
    settings = KubeSettings.from_env({}, insecure=True, role="extender", port=0, allocator_address=f"127.0.0.1:{grpc_port}",
                                     predictor_address=f"127.0.0.1:{grpc_port}", kube_api_url=f"http://127.0.0.1:{api_port}",
                                     bind_timeout_s=5.0, bind_poll_s=0.05, reap_interval_s=0)
    channel = grpc.aio.insecure_channel(settings.allocator_address)
    alloc = allocator_pb2_grpc.AllocatorStub(channel)
    kube = KubeApi(settings)
    extender = Extender(settings, alloc, predictor_pb2_grpc.PredictorStub(channel), kube)
    runner, port = await kube_app.start(settings, extender)
    async with aiohttp.ClientSession() as http:
        yield {"url": f"http://127.0.0.1:{port}", "http": http, "fake": fake, "alloc": alloc, "extender": extender,
               "settings": settings, "kube": kube, "store": store}
    await runner.cleanup()
    kube.close()
    await channel.close()
    await fake_runner.cleanup()
    await server.stop(0)
    await scheduler.close()
    await lease.stop()
    await obs.close()
    await store.close()


async def post(c: dict, verb: str, body: dict):
    async with c["http"].post(f"{c['url']}/{verb}", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


# ------------------------------------------------------------------------------------------- webhook

async def review_over_https(webhook, body: dict) -> dict:
    url, ctx = webhook
    async with aiohttp.ClientSession() as http, http.post(f"{url}/mutate", json=body, ssl=ctx) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_webhook_injects_scheduler_mps_env_and_pipe_mount_over_tls(webhook):
    p = pod(ann={a.SHARE: "30", a.MEM: "4096", a.GPUS: "2"})
    body = admission_review(p)
    out = await review_over_https(webhook, body)
    assert out["apiVersion"] == "admission.k8s.io/v1" and out["kind"] == "AdmissionReview"
    resp = out["response"]
    assert resp["uid"] == body["request"]["uid"] and resp["allowed"] is True and resp["patchType"] == "JSONPatch"
    mutated = apply_json_patch(p, json.loads(base64.b64decode(resp["patch"])))
    spec = mutated["spec"]
    assert spec["schedulerName"] == "elastico-scheduler" and spec["runtimeClassName"] == "nvidia"
    assert {"name": "elastico-mps-pipe", "hostPath": {"path": "/tmp/nvidia-mps", "type": "Directory"}} in spec["volumes"]
    assert spec["volumes"][0]["name"] == "kube-api-access-x"  # existing volumes kept
    for c in spec["containers"]:
        env = {e["name"]: e for e in c["env"]}
        assert env["CUDA_MPS_PIPE_DIRECTORY"]["value"] == "/tmp/nvidia-mps"
        # the slice is the policy's choice at bind: the containers read it through the downward API at start
        for var, key in (("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "mps-active-thread-pct"),
                         ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "mps-pinned-mem-limit"), ("NVIDIA_VISIBLE_DEVICES", "gpu-indices")):
            assert env[var] == {"name": var, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['elastico.io/{key}']"}}}
        assert {"name": "elastico-mps-pipe", "mountPath": "/tmp/nvidia-mps"} in c["volumeMounts"]
    assert {e["name"] for e in spec["containers"][0]["env"]} >= {"EPOCHS"}  # the user's env stays


async def test_webhook_replaces_user_set_mps_variables_instead_of_duplicating_them(webhook):
    p = pod()
    p["spec"]["containers"][0]["env"].append({"name": "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "value": "100"})
    out = await review_over_https(webhook, admission_review(p))
    mutated = apply_json_patch(p, json.loads(base64.b64decode(out["response"]["patch"])))
    env = [e for e in mutated["spec"]["containers"][0]["env"] if e["name"] == "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]
    assert env == [{"name": "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['elastico.io/mps-active-thread-pct']"}}}]


@pytest.mark.parametrize(("obj", "operation"), [
    (pod(opted=False), "CREATE"),
    (pod(), "UPDATE"),
], ids=["not-opted-in", "update"])
async def test_webhook_passes_other_pods_through_unchanged(webhook, obj, operation):
    out = await review_over_https(webhook, admission_review(obj, operation))
    assert out["response"]["allowed"] is True and "patch" not in out["response"]


@pytest.mark.parametrize(("ann", "gpu_limit", "named"), [
    ({a.SHARE: "150"}, False, a.SHARE),
    ({a.SHARE: "half"}, False, a.SHARE),
    ({a.MEM: "-1"}, False, a.MEM),
    ({a.KIND: "batch"}, False, a.KIND),
    ({a.KIND: "inference", a.RPS: "100"}, False, a.SLO_MS),
    ({a.GPUS: "0"}, False, a.GPUS),
    ({a.SLO_MS: "50"}, False, a.SLO_MS),
    ({}, True, a.OPT_IN_LABEL),
], ids=["share-over-100", "share-not-a-number", "negative-mem", "unknown-kind", "inference-without-slo", "zero-gpus",
        "slo-on-training", "device-plugin-gpu"])
async def test_webhook_rejects_malformed_opt_in_naming_the_annotation(webhook, ann, gpu_limit, named):
    out = await review_over_https(webhook, admission_review(pod(ann=ann, gpu_limit=gpu_limit)))
    resp = out["response"]
    assert resp["allowed"] is False and "patch" not in resp and resp["status"]["code"] == 400
    assert resp["status"]["message"].startswith(f"ElastiCo rejected the pod: {named}:"), resp["status"]["message"]


async def test_webhook_rejects_missing_memory_annotation():
    p = pod()
    del p["metadata"]["annotations"][a.MEM]
    from services.kube.webhook import review
    resp = review(admission_review(p), KubeSettings.from_env({}, insecure=True, role="both", allocator_address="x:1"))["response"]
    assert resp["allowed"] is False and resp["status"]["message"].endswith(f"{a.MEM}: is required (the model's memory need on each GPU, MiB: its pinned limit)")


async def test_webhook_answers_400_to_a_body_that_is_not_an_admission_review(webhook):
    url, ctx = webhook
    async with aiohttp.ClientSession() as http, http.post(f"{url}/mutate", json={"kind": "Pod"}, ssl=ctx) as r:
        assert r.status == 400 and "AdmissionReview" in (await r.json())["error"]


# ------------------------------------------------------------------------------------------- extender

async def test_filter_passes_non_opted_pods_through_untouched(cluster):
    names = [*GPU_NODES, CPU_NODE]
    out = await post(cluster, "filter", {"Pod": pod(opted=False), "Nodes": None, "NodeNames": names})
    assert out["NodeNames"] == names and out["FailedNodes"] == {} and out["Error"] == ""


async def test_filter_keeps_nodes_with_a_fitting_slice_in_both_request_forms(cluster):
    names = [*GPU_NODES, CPU_NODE]
    out = await post(cluster, "filter", {"Pod": pod(), "NodeNames": names})
    assert out["NodeNames"] == list(GPU_NODES) and out["Error"] == ""
    assert "no ElastiCo node agent" in out["FailedNodes"][CPU_NODE]
    out = await post(cluster, "filter", {"Pod": pod(), "Nodes": {"kind": "NodeList", "apiVersion": "v1",
                                                                   "items": [node_obj(n) for n in names]}})
    assert [n["metadata"]["name"] for n in out["Nodes"]["items"]] == list(GPU_NODES) and out["NodeNames"] is None
    big = await post(cluster, "filter", {"Pod": pod(ann={a.GPUS: "3"}), "NodeNames": names})
    assert big["NodeNames"] == [] and "the pod needs 3" in big["FailedNodes"]["gpu-node-1"]


async def test_filter_marks_every_node_unresolvable_for_malformed_annotations(cluster):
    out = await post(cluster, "filter", {"Pod": pod(ann={a.MEM: "lots"}), "NodeNames": list(GPU_NODES)})
    assert out["NodeNames"] == [] and set(out["FailedAndUnresolvableNodes"]) == set(GPU_NODES)
    assert out["FailedAndUnresolvableNodes"]["gpu-node-1"].startswith(f"elastico: {a.MEM}: must be an integer")


async def test_filter_fails_closed_for_opted_pods_when_the_allocator_is_unreachable(cluster):
    settings = KubeSettings.from_env({}, insecure=True, role="extender", allocator_address="127.0.0.1:1", allocator_timeout_s=0.5)
    async with grpc.aio.insecure_channel(settings.allocator_address) as ch:
        ext = Extender(settings, allocator_pb2_grpc.AllocatorStub(ch))
        out = await ext.filter({"Pod": pod(), "NodeNames": list(GPU_NODES)})
        assert out["NodeNames"] == [] and out["Error"].startswith("elastico: allocator unavailable (")
        passthrough = await ext.filter({"Pod": pod(opted=False), "NodeNames": list(GPU_NODES)})
        assert passthrough["NodeNames"] == list(GPU_NODES) and passthrough["Error"] == ""
        assert await ext.prioritize({"Pod": pod(), "NodeNames": list(GPU_NODES)}) == [
            {"Host": n, "Score": 0} for n in GPU_NODES]


async def test_prioritize_scores_feasible_nodes_and_zero_elsewhere(cluster):
    names = [*GPU_NODES, CPU_NODE]
    out = await post(cluster, "prioritize", {"Pod": pod(), "NodeNames": names})
    scores = {h["Host"]: h["Score"] for h in out}
    assert set(scores) == set(names) and scores[CPU_NODE] == 0
    assert all(1 <= scores[n] <= 10 for n in GPU_NODES)
    assert await post(cluster, "prioritize", {"Pod": pod(opted=False), "NodeNames": names}) == [
        {"Host": n, "Score": 0} for n in names]


async def test_bind_commits_a_slice_on_the_chosen_node_records_it_then_creates_the_binding(cluster):
    fake, p = cluster["fake"], pod("train-bind")
    fake.pods[("team-a", "train-bind")] = p
    uid = p["metadata"]["uid"]
    out = await post(cluster, "bind", {"PodName": "train-bind", "PodNamespace": "team-a", "PodUID": uid, "Node": "gpu-node-2"})
    assert out == {"Error": ""}
    assert fake.writes == ["patch", "binding"]  # annotations first: the kubelet resolves NVIDIA_VISIBLE_DEVICES from them
    assert fake.bindings == [{"apiVersion": "v1", "kind": "Binding",
                              "metadata": {"name": "train-bind", "namespace": "team-a", "uid": uid},
                              "target": {"apiVersion": "v1", "kind": "Node", "name": "gpu-node-2"}}]
    content_type, patch = fake.patches[0]
    assert content_type == "application/merge-patch+json"
    ann = patch["metadata"]["annotations"]
    job = (await cluster["alloc"].GetJob(allocator_pb2.GetJobRequest(job_id=ann[a.JOB_ID]))).job
    assert job.state in (types_pb2.JOB_STATE_PLACED, types_pb2.JOB_STATE_RUNNING)
    assert list(job.spec.allowed_nodes) == ["gpu-node-2"] and job.spec.labels["elastico.io/pod-uid"] == uid
    committed = [(s.node_id, s.gpu_index, s.compute_share_pct, s.mem_mib) for s in job.placement.slices]
    recorded = json.loads(ann[a.SLICE])
    assert [("gpu-node-2", g, recorded["compute_share_pct"], recorded["mem_mib"]) for g in recorded["gpus"]] == committed
    assert committed[0][2:] == (50.0, 8192) and ann[a.NODE] == "gpu-node-2"
    assert ann[a.GPU_INDICES] == ",".join(str(c[1]) for c in committed)
    assert (ann[a.MPS_THREAD_PCT], ann[a.MPS_MEM_LIMIT]) == ("50", "0=8192M") and job.spec.command == ""
    # the allocator's own view counts the slice: capacity of that GPU is committed
    state = await cluster["alloc"].GetClusterState(allocator_pb2.GetClusterStateRequest())
    gpu = next(g for n in state.nodes if n.node_id == "gpu-node-2" for g in n.gpus if g.index == committed[0][1])
    assert gpu.allocated_share_pct == 50.0 and gpu.allocated_mem_mib == 8192
    # a retried bind (same pod, same node) finds the same job, not a second slice
    again = await cluster["extender"]._place(a.pod_request(p), "gpu-node-2")
    assert again.job_id == ann[a.JOB_ID]


async def test_bind_of_a_non_opted_pod_only_creates_the_binding(cluster):
    fake, p = cluster["fake"], pod("web", opted=False)
    fake.pods[("team-a", "web")] = p
    out = await post(cluster, "bind", {"PodName": "web", "PodNamespace": "team-a", "PodUID": p["metadata"]["uid"],
                                       "Node": CPU_NODE})
    assert out == {"Error": ""} and fake.writes == ["binding"] and fake.bindings[0]["target"]["name"] == CPU_NODE


async def test_bind_times_out_with_error_cancels_the_job_and_does_not_bind(cluster):
    fake = cluster["fake"]
    settings = KubeSettings.from_env({}, **{**cluster["settings"].__dict__, "bind_timeout_s": 0.6})
    ext = Extender(settings, cluster["alloc"], None, cluster["kube"])
    p = pod("too-big", ann={a.GPUS: "2", a.SHARE: "100", a.MEM: "16384"})
    fake.pods[("team-a", "too-big")] = p
    # fill gpu-node-1's GPU 0 so a 2-GPU whole-GPU gang cannot fit there
    first = pod("filler", ann={a.SHARE: "60", a.MEM: "1024"})
    fake.pods[("team-a", "filler")] = first
    assert (await ext.bind({"PodName": "filler", "PodNamespace": "team-a", "PodUID": first["metadata"]["uid"],
                            "Node": "gpu-node-1"}))["Error"] == ""
    out = await ext.bind({"PodName": "too-big", "PodNamespace": "team-a", "PodUID": p["metadata"]["uid"], "Node": "gpu-node-1"})
    assert out["Error"].startswith("elastico: no GPU slice on node gpu-node-1 within 0.6s") and "cancelled" in out["Error"]
    assert [b["metadata"]["name"] for b in fake.bindings] == ["filler"]
    jobs = (await cluster["alloc"].ListJobs(allocator_pb2.ListJobsRequest())).jobs
    mine = [j for j in jobs if j.spec.labels.get("elastico.io/pod-uid") == p["metadata"]["uid"]]
    assert [j.state for j in mine] == [types_pb2.JOB_STATE_CANCELLED]


async def test_bind_reports_a_vanished_pod(cluster):
    out = await post(cluster, "bind", {"PodName": "ghost", "PodNamespace": "team-a", "PodUID": "u-1", "Node": "gpu-node-1"})
    assert out["Error"] == "elastico: pod team-a/ghost with uid u-1 no longer exists"


async def test_reaper_cancels_the_job_of_a_deleted_pod_and_keeps_live_ones(cluster):
    fake, ext = cluster["fake"], cluster["extender"]
    keep, gone = pod("keep"), pod("gone")
    for p in (keep, gone):
        fake.pods[("team-a", p["metadata"]["name"])] = p
        assert (await ext.bind({"PodName": p["metadata"]["name"], "PodNamespace": "team-a",
                                "PodUID": p["metadata"]["uid"], "Node": "gpu-node-1"}))["Error"] == ""
    del fake.pods[("team-a", "gone")]
    cancelled = await ext.reap_once()
    jobs = {j.spec.labels["elastico.io/pod-uid"]: j for j in (await cluster["alloc"].ListJobs(allocator_pb2.ListJobsRequest())).jobs}
    assert cancelled == [jobs[gone["metadata"]["uid"]].job_id]
    assert jobs[gone["metadata"]["uid"]].state == types_pb2.JOB_STATE_CANCELLED
    assert jobs[keep["metadata"]["uid"]].state in (types_pb2.JOB_STATE_PLACED, types_pb2.JOB_STATE_RUNNING)


async def test_reaper_leaves_a_finished_pods_job_to_its_node_agent_for_the_grace(cluster):
    """A pass between a pod's end and its node agent's SUCCEEDED report must not turn the job CANCELLED."""
    fake, ext = cluster["fake"], cluster["extender"]
    p = pod("ends")
    fake.pods[("team-a", "ends")] = p
    assert (await ext.bind({"PodName": "ends", "PodNamespace": "team-a", "PodUID": p["metadata"]["uid"],
                            "Node": "gpu-node-1"}))["Error"] == ""
    p["status"] = {"phase": "Succeeded"}
    ext.s = KubeSettings.from_env({}, **{**cluster["settings"].__dict__, "reap_finished_grace_s": 0.5})
    assert await ext.reap_once() == [] and await ext.reap_once() == []
    (job,) = (await cluster["alloc"].ListJobs(allocator_pb2.ListJobsRequest())).jobs
    assert job.state in (types_pb2.JOB_STATE_PLACED, types_pb2.JOB_STATE_RUNNING)
    await asyncio.sleep(0.6)  # no report within the grace: the node agent is gone, the slice is freed
    assert await ext.reap_once() == [job.job_id]
    (job,) = (await cluster["alloc"].ListJobs(allocator_pb2.ListJobsRequest())).jobs
    assert job.state == types_pb2.JOB_STATE_CANCELLED


async def test_extender_answers_400_to_a_body_that_is_not_json(cluster):
    async with cluster["http"].post(f"{cluster['url']}/filter", data=b"{nope") as r:
        assert r.status == 400


@pytest.mark.parametrize("verb", ["filter", "bind"])
async def test_json_nested_past_the_decoders_stack_is_400_not_a_server_error(cluster, verb):
    deep = b"[" * 100_000 + b"]" * 100_000
    async with cluster["http"].post(f"{cluster['url']}/{verb}", data=deep,
                                    headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400 and "nested too deeply" in (await r.json())["error"]


def test_settings_fail_fast():
    from elastico.errors import ConfigError
    with pytest.raises(ConfigError, match="ELASTICO_ALLOCATOR_ADDRESS"):
        KubeSettings.from_env({"ELASTICO_ROLE": "extender"})
    with pytest.raises(ConfigError, match="ELASTICO_ROLE"):
        KubeSettings.from_env({"ELASTICO_ROLE": "scheduler"})
    with pytest.raises(ConfigError, match="ELASTICO_BIND_TIMEOUT_S"):
        KubeSettings.from_env({"ELASTICO_ALLOCATOR_ADDRESS": "a:1", "ELASTICO_BIND_TIMEOUT_S": "0"})
    with pytest.raises(ConfigError, match="ELASTICO_REAP_FINISHED_GRACE_S"):
        KubeSettings.from_env({"ELASTICO_ALLOCATOR_ADDRESS": "a:1", "ELASTICO_REAP_FINISHED_GRACE_S": "-1"})
    assert asyncio.iscoroutinefunction(Extender.bind)


# ------------------------------------------------------------------------------------------- client certificates
# Policy (services/kube/app.py): the handshake verifies any client certificate against ELASTICO_HTTP_CLIENT_CA_FILE
# (default the cluster CA) but demands none; the extender verbs need kube-scheduler's (or an operator's), /mutate
# any certificate of that CA unless ELASTICO_HTTP_REQUIRE_CLIENT_CERT=0 (role webhook only); /healthz is open.

VERBS = ("filter", "prioritize", "bind")


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict:
    """The cluster CA with the server's and every caller's certificate, and a second CA that knows the same names."""
    ours = pki.throwaway(tmp_path_factory.mktemp("pki"), ["kube", "kube-scheduler", "operator", "kube-apiserver",
                                                           "node/gpu-node-1"])
    other = pki.throwaway(tmp_path_factory.mktemp("pki-other"), ["kube-scheduler", "kube-apiserver"])
    token = tmp_path_factory.mktemp("token") / "token"
    token.write_text("not-a-real-token\n")
    return {"ours": ours, "other": other, "token": str(token)}


@contextlib.asynccontextmanager
async def mtls_server(certs: dict, role: str, **overrides):
    """``services.kube`` as deployed (mTLS settings, no ELASTICO_INSECURE) with a recording stand-in extender;
    yields (port, the verbs that reached the extender)."""
    settings = KubeSettings.from_env({}, role=role, port=0, allocator_address="127.0.0.1:1",
                                     client_token_file=certs["token"], **pki.tls_settings(certs["ours"]["kube"]), **overrides)
    calls: list[str] = []

    def verb(name: str, answer):
        async def handler(_body):
            calls.append(name)
            return answer
        return handler

    spy = SimpleNamespace(filter=verb("filter", {"NodeNames": ["gpu-node-1"], "FailedNodes": {}, "Error": ""}),
                          prioritize=verb("prioritize", [{"Host": "gpu-node-1", "Score": 5}]),
                          bind=verb("bind", {"Error": ""}))
    runner, port = await kube_app.start(settings, None if role == "webhook" else spy)
    try:
        yield port, calls
    finally:
        await runner.cleanup()


def client_ctx(certs: dict, issued: pki.Issued | None = None, tls: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    """A caller that verifies the server against the cluster CA and presents ``issued`` (None: no certificate)."""
    ctx = ssl.create_default_context(cafile=certs["ours"]["kube"].ca_file)
    if issued is not None:
        ctx.load_cert_chain(issued.cert_file, issued.key_file)
    if tls is not None:
        ctx.minimum_version = ctx.maximum_version = tls
    return ctx


async def call(port: int, path: str, ctx: ssl.SSLContext, body: dict | None = None) -> tuple[int, object]:
    async with aiohttp.ClientSession() as http:
        if path == "/healthz":
            async with http.get(f"https://127.0.0.1:{port}{path}", ssl=ctx) as r:
                return r.status, await r.text()
        async with http.post(f"https://127.0.0.1:{port}{path}", json={"Pod": pod(), "NodeNames": ["gpu-node-1"]}
                             if body is None else body, ssl=ctx) as r:
            return r.status, await r.json()


async def assert_refused_at_handshake(port: int, certs: dict, issued: pki.Issued) -> None:
    """TLS 1.2: the handshake fails; TLS 1.3 (the client's side of it ends first): the server aborts its side, so the
    connection closes before any HTTP answer; and the way kube-scheduler would call (aiohttp) gets no answer."""
    with pytest.raises((ssl.SSLError, ConnectionError)):
        await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx(certs, issued, ssl.TLSVersion.TLSv1_2))
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx(certs, issued, ssl.TLSVersion.TLSv1_3))
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        await writer.drain()
        answer = await reader.read()
    except (ssl.SSLError, ConnectionError):
        answer = b""
    finally:
        writer.close()
    assert answer == b"", answer[:40]
    with pytest.raises(aiohttp.ClientError):
        await call(port, "/healthz", client_ctx(certs, issued))


async def test_extender_refuses_a_call_without_a_client_certificate(certs):
    async with mtls_server(certs, "extender") as (port, calls):
        for verb in VERBS:
            status, body = await call(port, f"/{verb}", client_ctx(certs))
            assert status == 403, (verb, body)
            assert body["Error"].startswith("elastico: a client certificate is required") and "kube-scheduler" in body["error"]
        assert calls == []
        # kubelet's HTTPS probes present no certificate: /healthz stays open
        assert await call(port, "/healthz", client_ctx(certs)) == (200, "ok")


async def test_extender_refuses_a_certificate_of_another_ca_at_the_handshake(certs):
    async with mtls_server(certs, "extender") as (port, calls):
        await assert_refused_at_handshake(port, certs, certs["other"]["kube-scheduler"])  # the right name, the wrong CA
        assert calls == []


async def test_extender_serves_kube_scheduler_and_refuses_other_identities_of_the_ca(certs):
    async with mtls_server(certs, "extender") as (port, calls):
        for verb in VERBS:
            status, _ = await call(port, f"/{verb}", client_ctx(certs, certs["ours"]["kube-scheduler"]))
            assert status == 200, verb
        assert calls == list(VERBS)
        assert (await call(port, "/filter", client_ctx(certs, certs["ours"]["operator"])))[0] == 200
        for name in ("node/gpu-node-1", "kube-apiserver", "kube"):
            status, body = await call(port, "/bind", client_ctx(certs, certs["ours"][name]))
            assert status == 403 and body["Error"] == f"elastico: client certificate {name!r} may not call the extender " \
                                                      "(allowed: kube-scheduler, operator)", body
        assert calls == [*VERBS, "filter"]


async def test_webhook_requires_the_api_server_s_client_certificate_by_default(certs):
    review = admission_review(pod())
    async with mtls_server(certs, "webhook") as (port, _):
        status, body = await call(port, "/mutate", client_ctx(certs), review)
        assert status == 403 and body["kind"] == "Status" and body["code"] == 403 and "AdmissionConfiguration" in body["message"]
        status, body = await call(port, "/mutate", client_ctx(certs, certs["ours"]["kube-apiserver"]), review)
        assert status == 200 and body["response"]["uid"] == review["request"]["uid"] and body["response"]["allowed"] is True
        assert await call(port, "/healthz", client_ctx(certs)) == (200, "ok")
        await assert_refused_at_handshake(port, certs, certs["other"]["kube-apiserver"])


async def test_webhook_without_required_client_certificates_still_refuses_another_ca(certs):
    """ELASTICO_HTTP_REQUIRE_CLIENT_CERT=0 (an API server that cannot present one): certificate-less calls are served,
    a presented certificate must still chain to the CA."""
    review = admission_review(pod())
    async with mtls_server(certs, "webhook", http_require_client_cert=False) as (port, _):
        status, body = await call(port, "/mutate", client_ctx(certs), review)
        assert status == 200 and body["response"]["allowed"] is True and body["response"]["patchType"] == "JSONPatch"
        assert (await call(port, "/mutate", client_ctx(certs, certs["ours"]["kube-apiserver"]), review))[0] == 200
        await assert_refused_at_handshake(port, certs, certs["other"]["kube-apiserver"])


async def test_both_roles_on_one_port_apply_each_route_s_rule(certs):
    review = admission_review(pod(opted=False))
    async with mtls_server(certs, "both") as (port, calls):
        assert (await call(port, "/mutate", client_ctx(certs), review))[0] == 403
        assert (await call(port, "/filter", client_ctx(certs)))[0] == 403
        assert (await call(port, "/mutate", client_ctx(certs, certs["ours"]["kube-apiserver"]), review))[0] == 200
        assert (await call(port, "/filter", client_ctx(certs, certs["ours"]["kube-apiserver"])))[0] == 403
        assert (await call(port, "/filter", client_ctx(certs, certs["ours"]["kube-scheduler"])))[0] == 200
        assert calls == ["filter"]


async def test_http_client_ca_file_replaces_the_cluster_ca_for_callers(certs):
    """Callers' certificates chain to ELASTICO_HTTP_CLIENT_CA_FILE, the server's own to the cluster CA."""
    async with mtls_server(certs, "extender", http_client_ca_file=certs["other"]["kube-scheduler"].ca_file) as (port, calls):
        assert (await call(port, "/filter", client_ctx(certs, certs["other"]["kube-scheduler"])))[0] == 200
        await assert_refused_at_handshake(port, certs, certs["ours"]["kube-scheduler"])
        assert calls == ["filter"]


def test_client_certificate_settings_fail_fast(certs, tmp_path):
    mtls = {"allocator_address": "a:1", "client_token_file": certs["token"], **pki.tls_settings(certs["ours"]["kube"])}
    for role in ("extender", "both"):
        with pytest.raises(ConfigError, match="ELASTICO_HTTP_REQUIRE_CLIENT_CERT=0: only role webhook"):
            KubeSettings.from_env({"ELASTICO_HTTP_REQUIRE_CLIENT_CERT": "0"}, role=role, **mtls)
    assert not KubeSettings.from_env({"ELASTICO_HTTP_REQUIRE_CLIENT_CERT": "0"}, role="webhook", **mtls).http_require_client_cert
    assert KubeSettings.from_env({}, insecure=True, role="extender", allocator_address="a:1", http_require_client_cert=False)
    with pytest.raises(ConfigError, match="ELASTICO_HTTP_CLIENT_CA_FILE"):
        KubeSettings.from_env({"ELASTICO_HTTP_CLIENT_CA_FILE": str(tmp_path / "missing.crt")}, role="webhook", **mtls)
    settings = KubeSettings.from_env({}, role="webhook", **mtls)
    assert settings.http_require_client_cert and kube_app.client_ca_file(settings) == certs["ours"]["kube"].ca_file
    assert kube_app.ssl_context(settings).verify_mode == ssl.CERT_OPTIONAL
    # plaintext and ELASTICO_INSECURE=1 check nothing (the fixtures above): no client verification configured
    insecure = KubeSettings.from_env({}, insecure=True, role="webhook", tls_cert_file=certs["ours"]["kube"].cert_file,
                                     tls_key_file=certs["ours"]["kube"].key_file)
    assert kube_app.ssl_context(insecure).verify_mode == ssl.CERT_NONE and not kube_app.client_auth(insecure)


async def test_https_certificate_rotation_needs_no_restart(tmp_path):
    """A renewed certificate (a Secret update) is served from the next handshake on."""
    import shutil
    import ssl

    from elastico import pki
    from services.kube import app

    old, new = pki.throwaway(tmp_path / "a", ["kube"])["kube"], pki.throwaway(tmp_path / "b", ["kube"])["kube"]
    live = tmp_path / "live"
    live.mkdir()
    files = {"k.crt": "cert_file", "k.key": "key_file", "ca.crt": "ca_file"}
    for name, attr in files.items():
        shutil.copy(getattr(old, attr), live / name)
    settings = KubeSettings.from_env({}, role="webhook", port=0, tls_cert_file=str(live / "k.crt"),
                                     tls_key_file=str(live / "k.key"), tls_ca_file=str(live / "ca.crt"),
                                     http_require_client_cert=False)
    runner, port = await app.start(settings, None)

    async def health(ca_file: str):
        try:
            async with aiohttp.ClientSession() as s, s.get(f"https://127.0.0.1:{port}/healthz",
                                                           ssl=ssl.create_default_context(cafile=ca_file)) as r:
                return r.status
        except aiohttp.ClientConnectorCertificateError:
            return "untrusted"

    try:
        assert (await health(old.ca_file), await health(new.ca_file)) == (200, "untrusted")
        for name, attr in files.items():
            shutil.copy(getattr(new, attr), live / f"{name}.tmp")
            (live / f"{name}.tmp").replace(live / name)
        assert (await health(old.ca_file), await health(new.ca_file)) == ("untrusted", 200)
    finally:
        await runner.cleanup()


# ------------------------------------------------------------------------------------------- hostile bodies
# a field of the wrong JSON type is HTTP 400 naming it (services/kube/schema.py); seeded random mutations of
# real-shaped requests never get a 5xx

# values a broken or hostile client might put anywhere
JUNK = [None, 0, -1, 2**63, 1e308, "", "x" * 5000, "ü", [], {}, [1, 2], {"a": 1}, True, "1e309"]


def _paths(o, pre=()):
    yield pre
    if isinstance(o, dict):
        for k, v in o.items():
            yield from _paths(v, (*pre, k))
    elif isinstance(o, list):
        for i, v in enumerate(o):
            yield from _paths(v, (*pre, i))


def mutated(o, rnd: random.Random):
    """``o`` with one to three values (or the whole body) replaced by junk, or dict keys deleted."""
    o = copy.deepcopy(o)
    where = list(_paths(o))
    for _ in range(rnd.choice([1, 1, 2, 3])):
        path = rnd.choice(where)
        if not path:
            return copy.deepcopy(rnd.choice(JUNK))
        parent = o
        try:
            for k in path[:-1]:
                parent = parent[k]
            if isinstance(parent, dict) and rnd.random() < 0.15:
                del parent[path[-1]]
            else:
                parent[path[-1]] = copy.deepcopy(rnd.choice(JUNK))
        except (KeyError, IndexError, TypeError):
            pass  # an earlier replacement removed this path
    return o


@pytest.mark.parametrize("verb,body,named", [
    ("bind", -1, "(body): must be object"),
    ("bind", {"PodName": 3, "PodNamespace": "a", "PodUID": "u", "Node": "n"}, "PodName: must be string"),
    ("filter", {"Pod": {"metadata": {"labels": "x"}}, "NodeNames": ["n"]}, "Pod.metadata.labels: must be object"),
    ("filter", {"Pod": None, "NodeNames": [1]}, "NodeNames[0]: must be string"),
    ("prioritize", {"Pod": {"spec": {"containers": [{"resources": "big"}]}}}, "Pod.spec.containers[0].resources"),
])
async def test_a_field_of_the_wrong_type_is_400_naming_it(cluster, verb, body, named):
    async with cluster["http"].post(f"{cluster['url']}/{verb}", json=body) as r:
        assert r.status == 400 and named in (await r.json())["error"]


async def test_mutated_extender_requests_never_get_a_server_error(cluster):
    rnd = random.Random(1)
    names = [*GPU_NODES, CPU_NODE]
    bases = {"filter": [{"Pod": pod(), "NodeNames": names},
                        {"Pod": pod(), "Nodes": {"kind": "NodeList", "apiVersion": "v1", "items": [node_obj(n) for n in names]}}],
             "prioritize": [{"Pod": pod(), "NodeNames": names}],
             "bind": [{"PodName": "train-1", "PodNamespace": "team-a", "PodUID": "u-1", "Node": "gpu-node-1"}]}
    failed = []
    for _ in range(300):
        verb = rnd.choice(sorted(bases))
        body = mutated(rnd.choice(bases[verb]), rnd)
        async with cluster["http"].post(f"{cluster['url']}/{verb}", json=body) as r:
            if r.status >= 500:
                failed.append((verb, r.status, str(body)[:200]))
    assert not failed, failed[:3]


async def test_mutated_admission_reviews_never_get_a_server_error(webhook):
    url, ctx = webhook
    rnd = random.Random(2)
    base = admission_review(pod())
    failed = []
    async with aiohttp.ClientSession() as http:
        for _ in range(300):
            body = mutated(base, rnd)
            async with http.post(f"{url}/mutate", json=body, ssl=ctx) as r:
                if r.status >= 500:
                    failed.append((r.status, str(body)[:200]))
    assert not failed, failed[:3]
