"""Pod JSON -> the allocator job it asks for (pure: no HTTP, no gRPC, no Kubernetes client).

A pod opts in with the label ``elastico.io/enabled: "true"``; its ``elastico.io/*`` annotations are *hints and
limits* (table in docs/kubernetes.md). Every malformed value raises ``InvalidSpec`` whose ``field`` is the
annotation's name, so the webhook's rejection and the extender's answer tell the user which annotation to fix.

ElastiCo chooses the shape: the job declares a family (the pod's GPU count, its memory need on each GPU, and
every share of :data:`SHARES_PCT` at or above ``elastico.io/min-share-pct``, or only the fixed
``elastico.io/gpu-share-pct``); the policy picks one, and the extender's bind writes the chosen share and memory
limit as annotations (:func:`slice_annotations`) that the containers read through the downward API at start.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elastico import limits as L
from elastico.domain import (
    GANG_LABEL,
    GANG_SIZE_LABEL,
    POD_LABEL,
    POD_OWNER_LABEL,
    POD_UID_LABEL,
    PRECISIONS,
    SHARES_PCT,
    InferenceWork,
    JobKind,
    JobSpec,
    MetricsEndpoint,
    Placement,
    Shape,
    TrainingWork,
    validate_job_spec,
    validate_metrics_endpoint,
)
from elastico.errors import InvalidSpec
from elastico.limits import clip

OPT_IN_LABEL = "elastico.io/enabled"  # value "true" opts the pod in; anything else (or absent) leaves it alone

# --- hints and limits (written by the pod's owner) ---
KIND = "elastico.io/kind"  # training | inference (default training)
GPUS = "elastico.io/gpus"  # GPUs of the pod, all on one node (default 1)
SHARE = "elastico.io/gpu-share-pct"  # a fixed MPS active-thread percentage on each GPU, (0, 100]; absent = the policy picks
MIN_SHARE = "elastico.io/min-share-pct"  # floor of the shares the policy may pick, (0, 100] (default: any)
MEM = "elastico.io/gpu-mem-mib"  # the model's memory need on each GPU, MiB: its pinned limit (required)
GPU_TYPE = "elastico.io/gpu-type"  # e.g. v100; "" = any
MODEL = "elastico.io/model-family"  # e.g. ResNet-50: drives interference prediction
BATCH = "elastico.io/batch-size"  # per-GPU batch size
PRECISION = "elastico.io/precision"  # fp32, amp, bf16...
PRIORITY = "elastico.io/priority"  # integer; higher is more important
TOTAL_STEPS = "elastico.io/total-steps"  # training: steps to completion (default 1: unknown)
MAX_SLOWDOWN = "elastico.io/max-slowdown"  # training: co-location floor 1/max_slowdown (0 = policy default)
SLO_MS = "elastico.io/inference-slo-ms"  # inference: latency objective, ms (required for inference)
RPS = "elastico.io/inference-rps"  # inference: offered request rate, requests/s (required for inference)
METRICS_PORT = "elastico.io/metrics-port"  # inference: the pod's Prometheus port (the node agent scrapes the pod IP)
METRICS_PATH = "elastico.io/metrics-path"  # inference: its path (default /metrics)
METRICS_FORMAT = "elastico.io/metrics-format"  # inference: vllm | triton (default vllm)
GANG_SIZE = "elastico.io/gang-size"  # members of the pod's gang, 2-64 (with a gang name label)

INPUT_ANNOTATIONS = (KIND, GPUS, SHARE, MIN_SHARE, MEM, GPU_TYPE, MODEL, BATCH, PRECISION, PRIORITY, TOTAL_STEPS,
                     MAX_SLOWDOWN, SLO_MS, RPS, METRICS_PORT, METRICS_PATH, METRICS_FORMAT, GANG_SIZE)

# the pod labels that name its gang, first present wins: ElastiCo's own, a PyTorchJob's, a JobSet's
GANG_NAME_LABELS = ("elastico.io/gang", "training.kubeflow.org/job-name", "jobset.sigs.k8s.io/jobset-name")

# --- written by the extender's bind (before the Binding, so the kubelet sees them when it starts the containers) ---
JOB_ID = "elastico.io/job-id"  # the allocator job holding the slice
NODE = "elastico.io/node"  # node of the slice
GPU_INDICES = "elastico.io/gpu-indices"  # "0,2": the GPUs' indices on the node (NVIDIA_VISIBLE_DEVICES)
SLICE = "elastico.io/slice"  # JSON {"node", "gpus", "compute_share_pct", "mem_mib", "job_id"}
MPS_THREAD_PCT = "elastico.io/mps-active-thread-pct"  # "50": the share the policy picked (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)
MPS_MEM_LIMIT = "elastico.io/mps-pinned-mem-limit"  # "0=8192M,1=8192M" (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT)
GANG_NODE = "elastico.io/gang-node"  # a gang member's node, written when its bind arrives (the gang barrier)
GANG_ARRIVAL = "elastico.io/gang-arrival"  # token of that arrival: part of the member's job request id

# every annotation the extender writes: a pod created with one would carry a slice nobody committed
BIND_ANNOTATIONS = (JOB_ID, NODE, GPU_INDICES, SLICE, MPS_THREAD_PCT, MPS_MEM_LIMIT, GANG_NODE, GANG_ARRIVAL)

# container environment -> the annotation it is resolved from (downward API, at container start)
DOWNWARD_ENV = {"NVIDIA_VISIBLE_DEVICES": GPU_INDICES, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": MPS_THREAD_PCT,
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": MPS_MEM_LIMIT}

DEVICE_PLUGIN_RESOURCE = "nvidia.com/gpu"
GANG_SIZE_MAX = 64
_MODEL_RE = re.compile(r"^[A-Za-z0-9._+-]{0,64}$")
_INT_RE = re.compile(r"[+-]?[0-9]{1,19}", re.ASCII)
_TERMINAL_PHASES = ("Succeeded", "Failed")


@dataclass(frozen=True)
class Gang:
    """The all-or-nothing group a pod belongs to."""

    name: str  # "<namespace>/<gang name>"
    label_key: str  # the pod label that names it (GANG_NAME_LABELS)
    size: int

    @property
    def selector(self) -> str:
        """The label selector of its members (within the pod's namespace)."""
        return f"{self.label_key}={self.name.split('/', 1)[1]}"


@dataclass(frozen=True)
class PodRequest:
    """What an opted-in pod asks for."""

    namespace: str
    name: str
    uid: str
    spec: JobSpec  # the allocator job (declared shape family; tenant = namespace)
    gang: Gang | None = None

    @property
    def shape(self) -> Shape:
        """The smallest shape of the family (smallest share): what filter and prioritize check a node against."""
        return self.spec.shapes[0]


def opted_in(pod: Mapping[str, Any]) -> bool:
    """True when the pod carries the opt-in label with value "true"."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return str(labels.get(OPT_IN_LABEL, "")).lower() == "true"


def pod_ref(pod: Mapping[str, Any]) -> tuple[str, str, str]:
    """(namespace, name, uid) of a pod."""
    meta = pod.get("metadata") or {}
    return meta.get("namespace") or "default", meta.get("name") or "", meta.get("uid") or ""


def finished(pod: Mapping[str, Any]) -> bool:
    """The pod's phase is Succeeded or Failed."""
    return (pod.get("status") or {}).get("phase") in _TERMINAL_PHASES


def going(pod: Mapping[str, Any]) -> bool:
    """The pod is being deleted or evicted (deletionTimestamp, or the DisruptionTarget condition)."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return True
    return any(c.get("type") == "DisruptionTarget" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def owner(pod: Mapping[str, Any]) -> str:
    """"<kind>/<name>" of the pod's controller ownerReference; "" for a bare pod (never preempted)."""
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") is True and ref.get("kind") and ref.get("name"):
            return f"{ref['kind']}/{ref['name']}"
    return ""


def _int(ann: Mapping[str, str], key: str, default: int, lo: int, hi: int | None = None) -> int:
    """An integer annotation as Kubernetes tools read one: ASCII digits with an optional sign, nothing else (Python's
    ``int`` would also take "2_0", surrounding spaces and non-ASCII digits)."""
    raw = ann.get(key)
    if raw is None:
        return default
    if not isinstance(raw, str) or not _INT_RE.fullmatch(raw):
        raise InvalidSpec(key, f"must be an integer (ASCII digits, optional sign), got {clip(str(raw))!r}")
    value = int(raw)
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


def shares(ann: Mapping[str, str]) -> tuple[float, ...]:
    """The compute shares the pod's family offers, ascending: the fixed one, or the grid at or above the floor."""
    if SHARE in ann:
        if MIN_SHARE in ann:
            raise InvalidSpec(MIN_SHARE, f"cannot be combined with {SHARE} (a fixed share has no floor)")
        return (_float(ann, SHARE, None, 0.0, 100.0),)
    floor = _float(ann, MIN_SHARE, None, 0.0, 100.0) if MIN_SHARE in ann else 0.0
    return tuple(float(s) for s in SHARES_PCT if s >= floor - 1e-9)


def gang_of(pod: Mapping[str, Any]) -> Gang | None:
    """The pod's gang (a gang name label and ``elastico.io/gang-size``), None when it is no gang member."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    ann = meta.get("annotations") or {}
    key = next((k for k in GANG_NAME_LABELS if labels.get(k)), "")
    if GANG_SIZE not in ann:
        if key == GANG_NAME_LABELS[0]:
            raise InvalidSpec(GANG_SIZE, f"is required with the label {key} (the number of member pods, 2-{GANG_SIZE_MAX})")
        return None  # e.g. a PyTorchJob's pod that does not ask for a gang
    if not key:
        raise InvalidSpec(GANG_SIZE, "needs a gang name: the label " + " (or ".join(GANG_NAME_LABELS[:2]) + ", or "
                          f"{GANG_NAME_LABELS[2]})")
    size = _int(ann, GANG_SIZE, 0, 2, GANG_SIZE_MAX)
    return Gang(name=f"{meta.get('namespace') or 'default'}/{labels[key]}", label_key=key, size=size)


def _metrics(ann: Mapping[str, str]) -> MetricsEndpoint | None:
    if not any(k in ann for k in (METRICS_PORT, METRICS_PATH, METRICS_FORMAT)):
        return None
    if METRICS_PORT not in ann:
        raise InvalidSpec(METRICS_PORT, f"is required with {METRICS_PATH} or {METRICS_FORMAT} (the pod's metrics port)")
    m = MetricsEndpoint(port=_int(ann, METRICS_PORT, 0, 1, 65535), path=str(ann.get(METRICS_PATH, "")).strip(),
                        format=str(ann.get(METRICS_FORMAT, "")).strip().lower())
    try:
        validate_metrics_endpoint(m, "metrics")
    except InvalidSpec as exc:
        raise InvalidSpec(METRICS_PATH if exc.field == "metrics.path" else METRICS_FORMAT, exc.message) from None
    return m


def pod_request(pod: Mapping[str, Any]) -> PodRequest:
    """Validate an opted-in pod's annotations and build its allocator job (its shape family, pod/owner/gang labels).

    Raises:
        InvalidSpec: ``field`` is the offending annotation (or ``elastico.io/enabled`` for a pod-level conflict).
    """
    meta = pod.get("metadata") or {}
    ann: Mapping[str, str] = meta.get("annotations") or {}
    namespace, name, uid = pod_ref(pod)
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
    family_shares = shares(ann)
    if MEM not in ann:
        raise InvalidSpec(MEM, "is required (the model's memory need on each GPU, MiB: its pinned limit)")
    mem = _int(ann, MEM, 0, 1, L.GPU_MEM_MIB_MAX)
    model = str(ann.get(MODEL, "")).strip()
    if not _MODEL_RE.match(model):
        raise InvalidSpec(MODEL, f"must be at most 64 characters of [A-Za-z0-9._+-], got {model!r}")
    precision = str(ann.get(PRECISION, "fp32")).strip() or "fp32"
    if precision.lower() not in PRECISIONS:
        raise InvalidSpec(PRECISION, f"must be one of {', '.join(PRECISIONS)}, got {clip(precision)!r}")
    training = inference = None
    if kind is JobKind.TRAINING:
        for key in (SLO_MS, RPS, METRICS_PORT, METRICS_PATH, METRICS_FORMAT):
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
        inference = InferenceWork(demand_rps=_float(ann, RPS, None, 0.0), latency_slo_ms=_float(ann, SLO_MS, None, 0.0),
                                  metrics=_metrics(ann))
    gang = gang_of(pod)
    labels = {POD_LABEL: f"{namespace}/{name}", POD_UID_LABEL: uid}
    if owner(pod):
        labels[POD_OWNER_LABEL] = owner(pod)
    if gang is not None:
        labels[GANG_LABEL] = gang.name
        labels[GANG_SIZE_LABEL] = str(gang.size)
    batch = _int(ann, BATCH, 0, 0)
    gpu_type = str(ann.get(GPU_TYPE, "")).strip().lower()
    spec = JobSpec(
        kind=kind, name=f"{namespace}/{name}"[:253], tenant=namespace, priority=_int(ann, PRIORITY, 0, -1000, 1000),
        model_family=model, batch_size=batch, precision=precision,
        shapes=tuple(Shape(num_gpus=num_gpus, compute_share_pct=s, mem_mib=mem, batch_size=batch, gpu_type=gpu_type)
                     for s in family_shares),
        training=training, inference=inference, labels=tuple(sorted(labels.items())),
    )
    try:
        validate_job_spec(spec)
    except InvalidSpec as exc:  # left: tenant (the namespace), label lengths; name the object, not a JobSpec path
        raise InvalidSpec("metadata.namespace" if exc.field.endswith("tenant") else "metadata", exc.message) from None
    return PodRequest(namespace=namespace, name=name, uid=uid, spec=spec, gang=gang)


def mps_limits(placement: Placement) -> tuple[str, str]:
    """(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT) of a committed slice; device ordinals
    are the container's own (0..n-1: it sees only its GPUs)."""
    first = placement.slices[0]
    return (f"{first.compute_share_pct:g}", ",".join(f"{i}={s.mem_mib}M" for i, s in enumerate(placement.slices)))


def slice_annotations(placement: Placement) -> dict[str, str]:
    """Annotations recording the GPU slice the allocator committed for a pod, MPS limits included."""
    gpus = [s.gpu_index for s in placement.slices]
    first = placement.slices[0]
    record = {"job_id": placement.job_id, "node": first.node_id, "gpus": gpus,
              "compute_share_pct": first.compute_share_pct, "mem_mib": first.mem_mib}
    thread_pct, mem_limit = mps_limits(placement)
    return {JOB_ID: placement.job_id, NODE: first.node_id, GPU_INDICES: ",".join(str(g) for g in gpus),
            SLICE: json.dumps(record, sort_keys=True, separators=(",", ":")),
            MPS_THREAD_PCT: thread_pct, MPS_MEM_LIMIT: mem_limit}
