"""services/kube/annotations.py and webhook.py pure halves: a pod's hints and limits -> the allocator job (its shape
family, pod/owner/gang labels, metrics endpoint), the bind's MPS annotations, the webhook's downward-API env."""

from __future__ import annotations

import json

import pytest

from elastico.domain import (
    GANG_LABEL,
    GANG_SIZE_LABEL,
    POD_LABEL,
    POD_OWNER_LABEL,
    POD_UID_LABEL,
    GpuSlice,
    Placement,
    Shape,
)
from elastico.errors import InvalidSpec
from services.kube import annotations as a
from services.kube import webhook
from services.kube.settings import KubeSettings


def pod(ann: dict | None = None, labels: dict | None = None, owner: list | None = None, name: str = "p") -> dict:
    meta = {"name": name, "namespace": "team-a", "uid": "u-1", "labels": {a.OPT_IN_LABEL: "true", **(labels or {})},
            "annotations": {a.MEM: "8192", **(ann or {})}}
    if owner is not None:
        meta["ownerReferences"] = owner
    return {"metadata": meta, "spec": {"containers": [{"name": "main"}]}}


def test_family_offers_every_grid_share_with_the_memory_need_and_gpu_count_fixed():
    req = a.pod_request(pod({a.GPUS: "2", a.BATCH: "64", a.GPU_TYPE: "V100"}))
    assert req.spec.shapes == tuple(Shape(num_gpus=2, compute_share_pct=float(s), mem_mib=8192, batch_size=64, gpu_type="v100")
                                    for s in (25, 50, 75, 100))
    assert req.shape.compute_share_pct == 25.0 and req.spec.command == ""


def test_a_fixed_share_or_a_floor_narrows_the_family():
    assert [s.compute_share_pct for s in a.pod_request(pod({a.SHARE: "30"})).spec.shapes] == [30.0]
    assert [s.compute_share_pct for s in a.pod_request(pod({a.MIN_SHARE: "50"})).spec.shapes] == [50.0, 75.0, 100.0]
    assert [s.compute_share_pct for s in a.pod_request(pod({a.MIN_SHARE: "60"})).spec.shapes] == [75.0, 100.0]
    assert [s.compute_share_pct for s in a.pod_request(pod({a.MIN_SHARE: "100"})).spec.shapes] == [100.0]


@pytest.mark.parametrize(("ann", "labels", "field"), [
    ({a.SHARE: "50", a.MIN_SHARE: "25"}, {}, a.MIN_SHARE),
    ({a.MIN_SHARE: "0"}, {}, a.MIN_SHARE),
    ({a.MIN_SHARE: "101"}, {}, a.MIN_SHARE),
    ({a.GANG_SIZE: "4"}, {}, a.GANG_SIZE),
    ({}, {"elastico.io/gang": "g"}, a.GANG_SIZE),
    ({a.GANG_SIZE: "1"}, {"elastico.io/gang": "g"}, a.GANG_SIZE),
    ({a.GANG_SIZE: "65"}, {"elastico.io/gang": "g"}, a.GANG_SIZE),
    ({a.METRICS_PORT: "8000"}, {}, a.METRICS_PORT),
    ({a.KIND: "inference", a.SLO_MS: "50", a.RPS: "10", a.METRICS_PATH: "/m"}, {}, a.METRICS_PORT),
    ({a.KIND: "inference", a.SLO_MS: "50", a.RPS: "10", a.METRICS_PORT: "0"}, {}, a.METRICS_PORT),
    ({a.KIND: "inference", a.SLO_MS: "50", a.RPS: "10", a.METRICS_PORT: "80", a.METRICS_FORMAT: "tgi"}, {}, a.METRICS_FORMAT),
    ({a.KIND: "inference", a.SLO_MS: "50", a.RPS: "10", a.METRICS_PORT: "80", a.METRICS_PATH: "metrics"}, {}, a.METRICS_PATH),
], ids=["share-and-floor", "floor-zero", "floor-over-100", "size-without-name", "name-without-size", "size-1", "size-65",
        "metrics-on-training", "path-without-port", "port-0", "unknown-format", "relative-path"])
def test_malformed_hints_name_the_annotation(ann, labels, field):
    with pytest.raises(InvalidSpec) as exc:
        a.pod_request(pod(ann, labels))
    assert exc.value.field == field, exc.value


@pytest.mark.parametrize("value", ["2_0", "+ 2", " 2 ", "2 ", "\uff11", "\u0663", "2.0", "0x2", "", "1" * 20])
def test_integer_annotations_are_ascii_digits_only(value):
    with pytest.raises(InvalidSpec) as exc:
        a.pod_request(pod({a.GPUS: value}))
    assert exc.value.field == a.GPUS
    with pytest.raises(InvalidSpec) as exc:
        a.pod_request(pod({a.PRIORITY: value}))
    assert exc.value.field == a.PRIORITY


def test_integer_annotations_take_a_sign_and_the_memory_need_is_bounded():
    assert a.pod_request(pod({a.GPUS: "+2", a.PRIORITY: "-5"})).spec.priority == -5
    assert a.pod_request(pod({a.MEM: str(1 << 24)})).spec.shapes[0].mem_mib == 1 << 24
    for mem in (str((1 << 24) + 1), "9" * 19):
        with pytest.raises(InvalidSpec) as exc:
            a.pod_request(pod({a.MEM: mem}))
        assert exc.value.field == a.MEM


def test_labels_pod_owner_and_gang():
    bare = a.pod_request(pod())
    assert dict(bare.spec.labels) == {POD_LABEL: "team-a/p", POD_UID_LABEL: "u-1"} and bare.gang is None
    owned = a.pod_request(pod({a.GANG_SIZE: "4"}, {"training.kubeflow.org/job-name": "bert"}, owner=[
        {"kind": "Node", "name": "n", "controller": False}, {"kind": "PyTorchJob", "name": "bert", "controller": True}]))
    assert dict(owned.spec.labels) == {POD_LABEL: "team-a/p", POD_UID_LABEL: "u-1", POD_OWNER_LABEL: "PyTorchJob/bert",
                                       GANG_LABEL: "team-a/bert", GANG_SIZE_LABEL: "4"}
    assert list(owned.spec.labels) == sorted(owned.spec.labels)
    assert owned.gang == a.Gang("team-a/bert", "training.kubeflow.org/job-name", 4)
    assert owned.gang.selector == "training.kubeflow.org/job-name=bert"
    # a non-controller owner is no owner: the pod stays bare (never preempted)
    assert POD_OWNER_LABEL not in dict(a.pod_request(pod(owner=[{"kind": "X", "name": "y"}])).spec.labels)
    # ElastiCo's own label wins over a JobSet's; a PyTorchJob pod without gang-size is no gang member
    both = a.pod_request(pod({a.GANG_SIZE: "2"}, {"elastico.io/gang": "mine", "jobset.sigs.k8s.io/jobset-name": "js"}))
    assert both.gang is not None and both.gang.name == "team-a/mine"
    assert a.pod_request(pod(labels={"training.kubeflow.org/job-name": "bert"})).gang is None


def test_inference_metrics_endpoint():
    req = a.pod_request(pod({a.KIND: "inference", a.SLO_MS: "50", a.RPS: "10", a.METRICS_PORT: "8000",
                             a.METRICS_PATH: "/stats", a.METRICS_FORMAT: "Triton"}))
    m = req.spec.inference.metrics
    assert (m.port, m.path, m.format) == (8000, "/stats", "triton")
    assert a.pod_request(pod({a.KIND: "inference", a.SLO_MS: "50", a.RPS: "10"})).spec.inference.metrics is None


def test_slice_annotations_carry_the_chosen_mps_limits():
    p = Placement("j-1", 1, Shape(2, 50.0, 8192), (GpuSlice("n1", 2, 50.0, 8192), GpuSlice("n1", 3, 50.0, 8192)))
    ann = a.slice_annotations(p)
    assert ann[a.MPS_THREAD_PCT] == "50" and ann[a.MPS_MEM_LIMIT] == "0=8192M,1=8192M" and ann[a.GPU_INDICES] == "2,3"
    assert json.loads(ann[a.SLICE]) == {"job_id": "j-1", "node": "n1", "gpus": [2, 3], "compute_share_pct": 50.0, "mem_mib": 8192}
    assert a.mps_limits(Placement("j", 0, Shape(1, 37.5, 100), (GpuSlice("n", 0, 37.5, 100),))) == ("37.5", "0=100M")


def test_webhook_env_reads_the_bind_s_annotations_through_the_downward_api():
    settings = KubeSettings.from_env({}, insecure=True, role="both", allocator_address="x:1")
    ops = webhook.pod_patch(pod(), settings)
    (env_op,) = [o for o in ops if o["path"] == "/spec/containers/0/env"]
    env = {e["name"]: e for e in env_op["value"]}
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == {"name": "CUDA_MPS_PIPE_DIRECTORY", "value": "/tmp/nvidia-mps"}
    assert {k: v["valueFrom"]["fieldRef"]["fieldPath"] for k, v in env.items() if "valueFrom" in v} == {
        "NVIDIA_VISIBLE_DEVICES": "metadata.annotations['elastico.io/gpu-indices']",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "metadata.annotations['elastico.io/mps-active-thread-pct']",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "metadata.annotations['elastico.io/mps-pinned-mem-limit']"}


def _review(p: dict) -> dict:
    settings = KubeSettings.from_env({}, insecure=True, role="both", allocator_address="x:1")
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "r-1", "kind": {"kind": "Pod"}, "operation": "CREATE", "object": p}}
    return webhook.review(body, settings)["response"]


@pytest.mark.parametrize("key", a.BIND_ANNOTATIONS)
def test_a_pod_cannot_be_created_with_the_extenders_slice_annotations(key):
    assert _review(pod())["allowed"] is True
    r = _review(pod({key: "0,1,2,3"}))
    assert r["allowed"] is False and "patch" not in r and key in r["status"]["message"]


def test_a_pod_cannot_be_created_on_a_node():
    p = pod()
    p["spec"]["nodeName"] = "gpu-node-1"
    r = _review(p)
    assert r["allowed"] is False and "spec.nodeName" in r["status"]["message"]


def test_pod_state_helpers():
    assert a.going({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}})
    assert a.going({"metadata": {}, "status": {"conditions": [{"type": "DisruptionTarget", "status": "True"}]}})
    assert not a.going({"metadata": {}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    assert a.finished({"status": {"phase": "Failed"}}) and not a.finished({"status": {"phase": "Running"}})


def test_one_precision_vocabulary_for_submissions_pods_and_the_predictor():
    from elastico.domain import PRECISIONS, JobKind, JobSpec, TrainingWork, validate_job_spec
    from services.predictor.features import canonical_precision
    for name, reduced in PRECISIONS.items():
        for spelled in (name, name.upper()):
            assert a.pod_request(pod({a.PRECISION: spelled})).spec.precision == spelled
            validate_job_spec(JobSpec(kind=JobKind.TRAINING, tenant="t", model_family="ResNet-50", precision=spelled,
                                      training=TrainingWork(total_steps=1)))
            assert canonical_precision(spelled) == ("amp" if reduced else "fp32")
    with pytest.raises(InvalidSpec) as exc:
        a.pod_request(pod({a.PRECISION: "fp64"}))
    assert exc.value.field == a.PRECISION
