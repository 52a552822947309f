"""Pod JSON -> the allocator job it asks for (pure: no HTTP, no gRPC, no Kubernetes client).

A pod opts in with the label ``elastico.io/enabled: "true"`` and describes its GPU slice with
``elastico.io/*`` annotations (table in docs/kubernetes.md). Every malformed value raises ``InvalidSpec`` whose
``field`` is the annotation's name, so the webhook's rejection and the extender's answer tell the user
exactly which annotation to fix.

Why one shape per pod and no shape hints: a container's CUDA MPS limits (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``,
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``) are environment variables fixed at admission by the webhook, so the
allocator must place exactly the slice the pod was admitted with; a resize means a new pod.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elastico.domain import InferenceWork, JobKind, JobSpec, Placement, Shape, TrainingWork, validate_job_spec
from elastico.errors import InvalidSpec

OPT_IN_LABEL = "elastico.io/enabled"  # value "true" opts the pod in; anything else (or absent) leaves it alone
KIND = "elastico.io/kind"  # training | inference (default training)
GPUS = "elastico.io/gpus"  # GPUs of the gang, all on one node (default 1)
SHARE = "elastico.io/gpu-share-pct"  # MPS active-thread percentage on each GPU, (0, 100] (default 100)
MEM = "elastico.io/gpu-mem-mib"  # pinned device memory limit on each GPU, MiB (required)
GPU_TYPE = "elastico.io/gpu-type"  # e.g. v100; "" = any
MODEL = "elastico.io/model-family"  # e.g. ResNet-50: drives interference prediction
BATCH = "elastico.io/batch-size"  # per-GPU batch size
PRECISION = "elastico.io/precision"  # fp32, amp, bf16...
PRIORITY = "elastico.io/priority"  # integer; higher is more important
TOTAL_STEPS = "elastico.io/total-steps"  # training: steps to completion (default 1: unknown)
MAX_SLOWDOWN = "elastico.io/max-slowdown"  # training: co-location floor 1/max_slowdown (0 = policy default)
SLO_MS = "elastico.io/inference-slo-ms"  # inference: latency objective, ms (required for inference)
RPS = "elastico.io/inference-rps"  # inference: offered request rate, requests/s (required for inference)

INPUT_ANNOTATIONS = (KIND, GPUS, SHARE, MEM, GPU_TYPE, MODEL, BATCH, PRECISION, PRIORITY, TOTAL_STEPS, MAX_SLOWDOWN,
                     SLO_MS, RPS)

# Written by the extender's bind (before the Binding, so the kubelet sees them when it starts the containers):
JOB_ID = "elastico.io/job-id"  # the allocator job holding the slice
NODE = "elastico.io/node"  # node of the slice
GPU_INDICES = "elastico.io/gpu-indices"  # "0,2": the GPUs' indices on the node (NVIDIA_VISIBLE_DEVICES, via the downward API)
SLICE = "elastico.io/slice"  # JSON {"node", "gpus", "compute_share_pct", "mem_mib", "job_id"}

DEVICE_PLUGIN_RESOURCE = "nvidia.com/gpu"
_MODEL_RE = re.compile(r"^[A-Za-z0-9._+-]{0,64}$")


@dataclass(frozen=True)
class PodRequest:
    """What an opted-in pod asks for."""

    namespace: str
    name: str
    uid: str
    spec: JobSpec  # the allocator job (one explicit shape; tenant = namespace)

    @property
    def shape(self) -> Shape:
        return self.spec.shapes[0]


def opted_in(pod: Mapping[str, Any]) -> bool:
    """True when the pod carries the opt-in label with value "true"."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return str(labels.get(OPT_IN_LABEL, "")).lower() == "true"


def _int(ann: Mapping[str, str], key: str, default: int, lo: int, hi: int | None = None) -> int:
    raw = ann.get(key)
    if raw is None:
        return default
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise InvalidSpec(key, f"must be an integer, got {raw!r}") from None
    if value < lo or (hi is not None and value > hi):
        raise InvalidSpec(key, f"must be in [{lo}, {hi if hi is not None else 'inf'}], got {value}")
    return value


def _float(ann: Mapping[str, str], key: str, default: float | None, lo_exclusive: float, hi: float | None = None) -> float:
    raw = ann.get(key)
    if raw is None:
        if default is None:
            raise InvalidSpec(key, "is required")
        return default
    try:
        value = float(str(raw).strip())
    except ValueError:
        raise InvalidSpec(key, f"must be a number, got {raw!r}") from None
    if not math.isfinite(value) or value <= lo_exclusive or (hi is not None and value > hi):
        bound = f"({lo_exclusive:g}, {hi:g}]" if hi is not None else f"> {lo_exclusive:g}"
        raise InvalidSpec(key, f"must be a finite number {bound}, got {raw!r}")
    return value


def pod_request(pod: Mapping[str, Any]) -> PodRequest:
    """Validate an opted-in pod's annotations and build its allocator job.

    Raises:
        InvalidSpec: ``field`` is the offending annotation (or ``elastico.io/enabled`` for a pod-level conflict).
    """
    meta = pod.get("metadata") or {}
    ann: Mapping[str, str] = meta.get("annotations") or {}
    namespace = meta.get("namespace") or "default"
    kind_raw = str(ann.get(KIND, "training")).strip().lower()
    if kind_raw not in ("training", "inference"):
        raise InvalidSpec(KIND, f"must be 'training' or 'inference', got {ann.get(KIND)!r}")
    kind = JobKind(kind_raw)
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        if DEVICE_PLUGIN_RESOURCE in (res.get("limits") or {}) or DEVICE_PLUGIN_RESOURCE in (res.get("requests") or {}):
            raise InvalidSpec(OPT_IN_LABEL, f"container {c.get('name')!r} requests {DEVICE_PLUGIN_RESOURCE}: the device "
                              f"plugin would give it whole GPUs; ask for GPUs with the {GPUS} annotation instead")
    num_gpus = _int(ann, GPUS, 1, 1, 64)
    share = _float(ann, SHARE, 100.0, 0.0, 100.0)
    mem = _int(ann, MEM, 0, 1)
    if MEM not in ann:
        raise InvalidSpec(MEM, "is required (the pinned GPU memory limit of each GPU, MiB)")
    model = str(ann.get(MODEL, "")).strip()
    if not _MODEL_RE.match(model):
        raise InvalidSpec(MODEL, f"must be at most 64 characters of [A-Za-z0-9._+-], got {model!r}")
    precision = str(ann.get(PRECISION, "fp32")).strip() or "fp32"
    if precision not in ("fp32", "fp16", "amp", "bf16", "tf32", "int8"):
        raise InvalidSpec(PRECISION, f"must be one of fp32, fp16, amp, bf16, tf32, int8, got {precision!r}")
    training = inference = None
    if kind is JobKind.TRAINING:
        for key in (SLO_MS, RPS):
            if key in ann:
                raise InvalidSpec(key, "is for inference pods only (elastico.io/kind is training)")
        max_slowdown = _float(ann, MAX_SLOWDOWN, 0.0, -1.0) if MAX_SLOWDOWN in ann else 0.0
        if max_slowdown != 0 and max_slowdown < 1:
            raise InvalidSpec(MAX_SLOWDOWN, f"must be 0 (policy default) or >= 1, got {ann[MAX_SLOWDOWN]!r}")
        training = TrainingWork(total_steps=_int(ann, TOTAL_STEPS, 1, 1), max_slowdown=max_slowdown)
    else:
        for key in (TOTAL_STEPS, MAX_SLOWDOWN):
            if key in ann:
                raise InvalidSpec(key, "is for training pods only (elastico.io/kind is inference)")
        inference = InferenceWork(demand_rps=_float(ann, RPS, None, 0.0), latency_slo_ms=_float(ann, SLO_MS, None, 0.0))
    spec = JobSpec(
        kind=kind, name=f"{namespace}/{meta.get('name', '')}"[:253], tenant=namespace,
        priority=_int(ann, PRIORITY, 0, -1000, 1000), model_family=model, batch_size=_int(ann, BATCH, 0, 0),
        precision=precision,
        shapes=(Shape(num_gpus=num_gpus, compute_share_pct=share, mem_mib=mem, batch_size=_int(ann, BATCH, 0, 0),
                      gpu_type=str(ann.get(GPU_TYPE, "")).strip().lower()),),
        training=training, inference=inference,
        labels=(("elastico.io/pod", f"{namespace}/{meta.get('name', '')}"), ("elastico.io/pod-uid", meta.get("uid", ""))),
    )
    try:
        validate_job_spec(spec)
    except InvalidSpec as exc:  # left: tenant (the namespace); name the object, not a JobSpec path
        raise InvalidSpec("metadata.namespace", exc.message) from None
    return PodRequest(namespace=namespace, name=meta.get("name", ""), uid=meta.get("uid", ""), spec=spec)


def mps_env(req: PodRequest, pipe_dir: str) -> dict[str, str]:
    """The CUDA MPS client environment of the pod's containers (device ordinals are the container's own)."""
    s = req.shape
    return {
        "CUDA_MPS_PIPE_DIRECTORY": pipe_dir,
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": f"{s.compute_share_pct:g}",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": ",".join(f"{i}={s.mem_mib}M" for i in range(s.num_gpus)),
    }


def slice_annotations(placement: Placement) -> dict[str, str]:
    """Annotations recording the GPU slice the allocator committed for a pod."""
    gpus = [s.gpu_index for s in placement.slices]
    first = placement.slices[0]
    record = {"job_id": placement.job_id, "node": first.node_id, "gpus": gpus,
              "compute_share_pct": first.compute_share_pct, "mem_mib": first.mem_mib}
    return {JOB_ID: placement.job_id, NODE: first.node_id, GPU_INDICES: ",".join(str(g) for g in gpus),
            SLICE: json.dumps(record, sort_keys=True, separators=(",", ":"))}
