"""Domain model of ElastiCo: frozen dataclasses shared by every service and the simulator.

These types carry no protobuf, gRPC or Redis dependency. Protobuf <-> domain conversion happens once,
at the servicer edge (``elastico.rpc.convert``); storage encoding lives in ``elastico.state.codec``.
Times are float seconds since the Unix epoch (``*_s``) unless named otherwise.
"""

from __future__ import annotations

import enum
import math
import re
import shlex
from dataclasses import dataclass, field

from elastico import limits as L
from elastico.errors import InvalidSpec
from elastico.limits import field_key, too_long


class JobKind(enum.Enum):
    """Training runs a fixed number of steps; inference serves a rate until cancelled."""

    TRAINING = "training"
    INFERENCE = "inference"


class JobState(enum.Enum):
    """Job lifecycle; see ``JobState`` in ``types.proto`` for the transitions."""

    PENDING = "pending"
    PLACED = "placed"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        """True when no further transition is possible."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class StateReason(enum.Enum):
    """Why a job is in its state; "unschedulable now" and "never schedulable" stay distinct."""

    SUBMITTED = "submitted"
    UNSCHEDULABLE_NOW = "unschedulable_now"
    NEVER_SCHEDULABLE = "never_schedulable"
    PLACED = "placed"
    STARTED = "started"
    COMPLETED = "completed"
    OWN_FAILURE = "own_failure"
    COTENANT_FAULT = "cotenant_fault"
    PREEMPTED = "preempted"
    RESIZED = "resized"
    NODE_LOST = "node_lost"
    CANCELLED_BY_CLIENT = "cancelled_by_client"
    # a Kubernetes pod's job the policy preempted or resized: still PLACED/RUNNING with its slices booked until
    # its pod is gone (the kube controller evicts it; its owner recreates it as a new job)
    EVICTION_REQUESTED = "eviction_requested"


@dataclass(frozen=True)
class Shape:
    """One feasible resource configuration of a job."""

    num_gpus: int  # GPUs of one type, gang-placed
    compute_share_pct: float  # MPS active-thread percentage on each GPU, (0, 100]
    mem_mib: int  # pinned device memory limit on each GPU, MiB
    batch_size: int = 0  # per-GPU batch size in this shape; 0 = the job's own
    gpu_type: str = ""  # GPU type; "" = any
    throughput: float = 0.0  # isolated throughput in this shape, steps/s or requests/s


@dataclass(frozen=True)
class TrainingWork:
    """Work of a training job."""

    total_steps: int  # steps to completion
    max_slowdown: float = 0.0  # co-location floor 1/max_slowdown of isolated speed; 0 = policy default


METRICS_FORMATS = ("vllm", "triton")  # metric-name families the node agent's scrape reads (MetricsEndpoint.format)


@dataclass(frozen=True)
class MetricsEndpoint:
    """Where an inference service publishes Prometheus metrics on its own node (loopback only)."""

    port: int = 0  # 1-65535; 0 = the agent picks a free port and passes it as $ELASTICO_SERVE_PORT
    path: str = ""  # "" = /metrics
    format: str = ""  # one of METRICS_FORMATS; "" = vllm
    scrape_interval_s: float = 0.0  # 0 = the agent's default
    model: str = ""  # only series with this model label; "" = all


@dataclass(frozen=True)
class InferenceWork:
    """Work of an inference service."""

    demand_rps: float  # offered request rate at submission, requests/s (measured demand replaces it)
    latency_slo_ms: float  # latency objective, milliseconds
    metrics: MetricsEndpoint | None = None  # its Prometheus endpoint; None = no scrape


@dataclass(frozen=True)
class DemandReport:
    """An inference service's measured load over one window (Allocator.ReportDemand, or a node agent's scrape)."""

    job_id: str
    window_end_s: float  # end of the window, Unix seconds
    window_s: float  # length of the window, s
    request_rate_rps: float  # arrivals in the window / window_s
    p50_latency_ms: float = 0.0  # 0 = unknown
    p99_latency_ms: float = 0.0  # 0 = unknown
    queue_length: float = 0.0  # requests waiting at window end
    source: str = ""  # "api:<identity>" or "node:<node id>", set by the allocator


@dataclass(frozen=True)
class JobSpec:
    """What a client asks for."""

    kind: JobKind
    name: str = ""  # human-readable, not unique
    tenant: str = "default"  # owner, for fairness and quotas
    priority: int = 0  # higher is more important
    model_family: str = ""  # e.g. "ResNet-50"; drives interference prediction
    batch_size: int = 0  # per-GPU batch size
    precision: str = "fp32"  # "fp32", "amp", "bf16"...
    shapes: tuple[Shape, ...] = ()  # explicit shape family; () = derive from profiles
    training: TrainingWork | None = None  # set iff kind is TRAINING
    inference: InferenceWork | None = None  # set iff kind is INFERENCE
    command: str = ""  # command line for the node agent; "" = built-in synthetic workload
    labels: tuple[tuple[str, str], ...] = ()  # sorted (key, value) pairs
    allowed_nodes: tuple[str, ...] = ()  # node ids the job may be placed on; () = any (the Kubernetes extender pins a pod to its node)


@dataclass(frozen=True)
class GpuSlice:
    """A compute share and a memory limit on one GPU, granted to one job."""

    node_id: str
    gpu_index: int  # index on the node (CUDA_VISIBLE_DEVICES order)
    compute_share_pct: float  # (0, 100]
    mem_mib: int  # MiB


@dataclass(frozen=True)
class Placement:
    """Where and in which shape a job runs."""

    job_id: str
    shape_index: int  # index into the job's shape family
    shape: Shape
    slices: tuple[GpuSlice, ...]  # one per GPU of the shape
    epoch: int = 0  # leader epoch (fencing token) of the committing allocator
    committed_at_s: float = 0.0
    resized_at_s: float = 0.0  # last in-place resize (Store.resize_in_place), 0 = none; not part of its identity


@dataclass(frozen=True)
class Job:
    """A job as the allocator knows it."""

    job_id: str
    request_id: str  # idempotency key of its SubmitJob
    spec: JobSpec
    state: JobState = JobState.PENDING
    reason: StateReason = StateReason.SUBMITTED
    message: str = ""  # human-readable detail of the reason
    placement: Placement | None = None  # set while PLACED or RUNNING
    progress_steps: float = 0.0  # training steps done
    restarts: int = 0  # restarts after preemption, resize or faults
    version: int = 0  # optimistic-concurrency version; the store sets it
    submitted_at_s: float = 0.0
    updated_at_s: float = 0.0
    queued_at_s: float = 0.0  # when it last entered the queue (submitted or requeued); 0 = unknown, use updated_at_s
    # a service moving to other GPUs: its previous replica's placement, serving (its slices booked) until the new
    # placement runs, then released (make-before-break); None otherwise
    draining: Placement | None = None


@dataclass(frozen=True)
class GpuCounters:
    """Hardware counters; None = unknown."""

    sm_util_pct: float | None = None  # GPU or SM-occupancy utilisation, percent
    mem_bw_util_pct: float | None = None  # memory-bandwidth utilisation, percent
    mem_used_mib: float | None = None  # device memory in use, MiB
    tensor_util_pct: float | None = None  # tensor-pipe activity, percent


@dataclass(frozen=True)
class GpuInfo:
    """One GPU of a node."""

    index: int
    uuid: str
    gpu_type: str  # e.g. "v100"
    mem_total_mib: int  # MiB
    allocated_share_pct: float = 0.0  # MPS shares committed to it, percent
    allocated_mem_mib: int = 0  # memory limits committed to it, MiB
    counters: GpuCounters = field(default_factory=GpuCounters)
    healthy: bool = True  # False while drained


@dataclass(frozen=True)
class NodeInfo:
    """A node as its agent reports it."""

    node_id: str
    address: str  # host:port of its NodeAgent endpoint
    gpu_backend: str  # "nvml" or "simulated"
    gpus: tuple[GpuInfo, ...]
    last_heartbeat_s: float = 0.0
    ready: bool = True


WORKLOAD_STATUSES = ("starting", "running", "succeeded", "failed", "killed")
WORKLOAD_ENDED = ("succeeded", "failed", "killed")


@dataclass(frozen=True)
class Workload:
    """One job's process on a node, as its node agent observes it (the node's *actual* state).

    An ended workload (status succeeded/failed/killed) stays in the actual state, with ``reason`` saying
    why it ended, until the allocator removes the job from the node's desired state: that is how the
    allocator learns the outcome, and why the agent never starts the same placement twice.
    """

    job_id: str
    gpu_indices: tuple[int, ...]
    compute_share_pct: float  # MPS active-thread percentage at launch
    mem_mib: int  # MPS pinned memory limit at launch, MiB
    status: str = "starting"  # starting, running, succeeded, failed, killed
    pid: int = 0  # OS pid of the workload's supervisor (its process group leader); 0 when not running
    progress_steps: float = 0.0  # steps (training) or requests (inference) done, as last reported
    throughput: float = 0.0  # observed steps/s or requests/s over the last measurement window
    started_at_s: float = 0.0
    placement_id: str = ""  # which placement incarnation it runs ("<epoch>:<committed_at_s>"), see placement_id()
    reason: StateReason | None = None  # why it ended: COMPLETED, OWN_FAILURE, COTENANT_FAULT, or PREEMPTED (stopped)
    exit_code: int | None = None  # exit status; negative = killed by that signal; None = unknown/running
    message: str = ""  # human-readable detail of the end (e.g. "exit 3", "CUDA out of memory", "MPS server fault")
    cotenants: tuple[str, ...] = ()  # job ids sharing at least one of its GPUs at the last measurement
    norm_throughput: float | None = None  # throughput / isolated throughput in its shape, when both are known
    counters: GpuCounters = field(default_factory=GpuCounters)  # per-process counters (NVML), unknown if None
    log_path: str = ""  # the workload's log file on its node
    ended_at_s: float = 0.0  # when it was seen ended; 0 while running
    endpoint: str = ""  # inference: host:port the service listens on (requests and /metrics); "" = none
    demand: DemandReport | None = None  # inference: the last window its metrics scrape measured
    recent_demand: tuple[DemandReport, ...] = ()  # inference: its last scraped windows, newest last (bounded)


#: MPS compute shares offered as shapes, percent of one GPU (ascending: ties pick the smaller share): the policy's
#: training shapes and a Kubernetes pod's shape family.
SHARES_PCT: tuple[int, ...] = (25, 50, 75, 100)

# Labels of a Kubernetes pod's job (JobSpec.labels; set by services/kube). A pod job's workload is the pod's own
# containers: its slices are released only once the pod is gone, and only a pod with an owner is ever preempted.
POD_LABEL = "elastico.io/pod"  # "<namespace>/<name>"
POD_UID_LABEL = "elastico.io/pod-uid"
POD_OWNER_LABEL = "elastico.io/pod-owner"  # "<kind>/<name>" of its controller (ownerReferences); absent = bare pod
GANG_LABEL = "elastico.io/gang"  # "<namespace>/<gang name>": the pods of one all-or-nothing gang
GANG_SIZE_LABEL = "elastico.io/gang-size"  # members of the gang


def label(spec: JobSpec, key: str) -> str:
    """The value of label ``key`` of a job ("" when absent)."""
    return next((v for k, v in spec.labels if k == key), "")


def is_pod_job(spec: JobSpec) -> bool:
    """The job is a Kubernetes pod's: its workload is the pod's containers."""
    return bool(label(spec, POD_UID_LABEL))


def pod_evictable(spec: JobSpec) -> bool:
    """A pod job whose pod has an owner that recreates it: preemption evicts it. A bare pod is never preempted."""
    return is_pod_job(spec) and bool(label(spec, POD_OWNER_LABEL))


DRAIN_SUFFIX = "~drain"  # desired-state key of a moving service's previous replica: "<job id>~drain"


def drain_key(job_id: str) -> str:
    """Desired-state key under which a node keeps a moving service's previous replica (never started anew)."""
    return job_id + DRAIN_SUFFIX


def placement_id(p: Placement) -> str:
    """Identity of one placement incarnation: a job re-placed (requeue, resize) gets a new one.

    The allocator commits every placement with its leader epoch and commit time, so the pair
    distinguishes two placements of the same job even when shape and GPUs are identical.
    """
    return f"{p.epoch}:{p.committed_at_s:.6f}"


@dataclass(frozen=True)
class JobEvent:
    """A change of a job's state, as appended to the event stream."""

    event_id: str  # assigned by the store; monotonically increasing
    job_id: str
    state: JobState
    reason: StateReason
    message: str = ""
    version: int = 0  # job record version after the change
    time_s: float = 0.0


# ---------------------------------------------------------------------------------------------------
# Validation: every check names the offending field with a dotted path, so the gRPC layer can answer
# INVALID_ARGUMENT with it.

# Size limits (lengths, counts) are the table of ``elastico.limits``; messages never quote long user input.
REQUEST_ID_RE = re.compile(rf"^[A-Za-z0-9._:-]{{1,{L.REQUEST_ID_MAX_CHARS}}}$")
TENANT_RE = re.compile(rf"^[A-Za-z0-9._-]{{1,{L.TENANT_MAX_CHARS}}}$")
#: a node id (a host or Kubernetes node name): it names the agent's certificate (node/<id>) and its Redis keys
NODE_ID_RE = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9._-]{{0,{L.NODE_ID_MAX_CHARS - 1}}}$")
MAX_GPUS_PER_JOB = 1024


def _finite_positive(value: float, path: str, *, upper: float | None = None, lower: float | None = None) -> None:
    if not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        raise InvalidSpec(path, f"must be a finite number, got {value!r}")
    if value <= 0:
        raise InvalidSpec(path, f"must be > 0, got {value!r}")
    if lower is not None and value < lower:
        raise InvalidSpec(path, f"must be >= {lower:g}, got {value!r}")
    if upper is not None and value > upper:
        raise InvalidSpec(path, f"must be <= {upper:g}, got {value!r}")


def _rate_or_zero(value: float, path: str) -> None:
    """A rate that may be 0 (unknown, or nothing measured); otherwise within [RATE_MIN, RATE_MAX]."""
    if isinstance(value, (int, float)) and value == 0:
        return
    if not isinstance(value, (int, float)) or not math.isfinite(value) or not L.RATE_MIN <= value <= L.RATE_MAX:
        raise InvalidSpec(path, f"must be 0 or a number in [{L.RATE_MIN:g}, {L.RATE_MAX:g}], got {value!r}")


def validate_request_id(request_id: str, path: str = "request_id") -> None:
    """Raise InvalidSpec unless ``request_id`` is a usable idempotency key."""
    if not REQUEST_ID_RE.fullmatch(request_id or ""):
        raise InvalidSpec(path, f"must be 1-{L.REQUEST_ID_MAX_CHARS} characters of [A-Za-z0-9._:-]")


def validate_shape(shape: Shape, path: str) -> None:
    """Raise InvalidSpec naming the first malformed field of ``shape``."""
    if not 1 <= shape.num_gpus <= MAX_GPUS_PER_JOB:
        raise InvalidSpec(f"{path}.num_gpus", f"must be in [1, {MAX_GPUS_PER_JOB}], got {shape.num_gpus}")
    _finite_positive(shape.compute_share_pct, f"{path}.compute_share_pct", lower=L.SHARE_PCT_MIN, upper=100.0)
    if not 0 < shape.mem_mib <= L.GPU_MEM_MIB_MAX:
        raise InvalidSpec(f"{path}.mem_mib", f"must be in [1, {L.GPU_MEM_MIB_MAX}] MiB, got {shape.mem_mib}")
    _batch_size(shape.batch_size, f"{path}.batch_size")
    _rate_or_zero(shape.throughput, f"{path}.throughput")
    _max_chars(shape.gpu_type, L.GPU_TYPE_MAX_CHARS, f"{path}.gpu_type")


def validate_metrics_endpoint(m: MetricsEndpoint, path: str) -> None:
    """Raise InvalidSpec naming the field unless ``m`` is a scrapeable loopback endpoint description."""
    if not 0 <= m.port <= 65535:
        raise InvalidSpec(f"{path}.port", f"must be 0 (the agent picks one) or 1-65535, got {m.port}")
    if m.path and (not m.path.startswith("/") or len(m.path) > 256 or not m.path.isprintable()
                   or any(c.isspace() or c in "?#" for c in m.path)):
        raise InvalidSpec(f"{path}.path", "must be an HTTP path starting with '/' (at most 256 printable characters, "
                                          f"no whitespace, query or fragment), got {m.path[:64]!r}")
    if m.format and m.format not in METRICS_FORMATS:
        raise InvalidSpec(f"{path}.format", f"must be one of {', '.join(METRICS_FORMATS)} (or empty: vllm), got {m.format[:64]!r}")
    si = m.scrape_interval_s
    if not math.isfinite(si) or (si != 0 and not 0.1 <= si <= 3600):
        raise InvalidSpec(f"{path}.scrape_interval_s", f"must be 0 (the agent's default) or 0.1-3600 s, got {si!r}")
    _max_chars(m.model, L.MODEL_FAMILY_MAX_CHARS, f"{path}.model")


MAX_DEMAND_FUTURE_S = 60.0  # a demand window may end at most this far after the allocator's clock (clock skew)
MAX_DEMAND_WINDOW_S = 3600.0


def validate_demand_report(r: DemandReport, now_s: float, path: str = "report") -> None:
    """Raise InvalidSpec naming the field unless ``r`` is a plausible measurement (see ``DemandReport`` in the proto)."""
    if not r.job_id:
        raise InvalidSpec(f"{path}.job_id", "is required")
    _max_chars(r.job_id, 128, f"{path}.job_id")
    if not math.isfinite(r.window_end_s) or r.window_end_s <= 0:
        raise InvalidSpec(f"{path}.window_end", "is required (a time after the Unix epoch)")
    if r.window_end_s > now_s + MAX_DEMAND_FUTURE_S:
        raise InvalidSpec(f"{path}.window_end", f"is {r.window_end_s - now_s:.0f} s in the future (at most "
                                                f"{MAX_DEMAND_FUTURE_S:.0f} s of clock skew)")
    _finite_positive(r.window_s, f"{path}.window_s", upper=MAX_DEMAND_WINDOW_S)
    _rate_or_zero(r.request_rate_rps, f"{path}.request_rate_rps")
    for name in ("p50_latency_ms", "p99_latency_ms", "queue_length"):
        v = getattr(r, name)
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise InvalidSpec(f"{path}.{name}", f"must be a finite number >= 0, got {v!r}")
    if r.p99_latency_ms and r.p99_latency_ms < r.p50_latency_ms:
        raise InvalidSpec(f"{path}.p99_latency_ms", f"must be >= p50_latency_ms ({r.p50_latency_ms:g}), got {r.p99_latency_ms:g}")


def _max_chars(value: str, limit: int, path: str) -> None:
    """At most ``limit`` characters, all printable (no control character reaches a log or a terminal)."""
    problem = L.text_problem(value, limit)
    if problem:
        raise InvalidSpec(path, problem)


def _batch_size(value: int, path: str) -> None:
    if not 0 <= value <= L.BATCH_SIZE_MAX:
        raise InvalidSpec(path, f"must be in [0, {L.BATCH_SIZE_MAX}], got {value}")


def validate_labels(labels: tuple[tuple[str, str], ...], path: str) -> None:
    """Raise InvalidSpec unless ``labels`` is within the count and length limits (``path["key"]`` names one)."""
    if len(labels) > L.LABELS_MAX_COUNT:
        raise InvalidSpec(path, f"at most {L.LABELS_MAX_COUNT} labels, got {len(labels)}")
    for key, value in labels:
        if len(key) > L.LABEL_KEY_MAX_CHARS:
            raise InvalidSpec(f"{path}{field_key(key)}", f"key {too_long(len(key), L.LABEL_KEY_MAX_CHARS)}")
        if len(value) > L.LABEL_VALUE_MAX_CHARS:
            raise InvalidSpec(f"{path}{field_key(key)}", f"value {too_long(len(value), L.LABEL_VALUE_MAX_CHARS)}")
        if not (key.isprintable() and value.isprintable()):
            raise InvalidSpec(f"{path}{field_key(key)}", "key and value must not contain control or other non-printable characters")


#: the numeric precisions a job may declare (``JobSpec.precision``, the kube annotation, the predictor's profiles),
#: each with whether it computes in reduced precision (the predictor's one precision feature); spellings are
#: compared lower-cased
PRECISIONS: dict[str, bool] = {"fp32": False, "float32": False, "tf32": False, "amp": True, "mixed": True,
                               "fp16": True, "bf16": True, "int8": True}


def _precision(value: str, path: str) -> None:
    if value.strip().lower() not in PRECISIONS:
        raise InvalidSpec(path, f"must be one of {', '.join(PRECISIONS)}, got {value[:L.PRECISION_MAX_CHARS]!r}")


def _command(command: str, path: str) -> None:
    """A command (empty: none) must split into argv as the node agent splits it (``shlex``), into at least one word:
    a blank line or an unterminated quote would be accepted and then fail at start."""
    if not command:
        return
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise InvalidSpec(path, f"must split into words as a shell line does ({exc})") from None
    if not argv:
        raise InvalidSpec(path, "is blank (leave it empty for a job without a command)")


def validate_job_spec(spec: JobSpec, path: str = "spec") -> None:
    """Raise InvalidSpec naming the first malformed field of ``spec``.

    Checks structure only; whether any GPU of the cluster can host the job is the allocator's
    business (``Infeasible`` / NEVER_SCHEDULABLE), not a malformed request.
    """
    if not TENANT_RE.fullmatch(spec.tenant or ""):
        raise InvalidSpec(f"{path}.tenant", f"must be 1-{L.TENANT_MAX_CHARS} characters of [A-Za-z0-9._-]")
    _max_chars(spec.name, L.NAME_MAX_CHARS, f"{path}.name")
    _max_chars(spec.model_family, L.MODEL_FAMILY_MAX_CHARS, f"{path}.model_family")
    _max_chars(spec.precision, L.PRECISION_MAX_CHARS, f"{path}.precision")
    _precision(spec.precision, f"{path}.precision")
    _max_chars(spec.command, L.COMMAND_MAX_CHARS, f"{path}.command")
    _command(spec.command, f"{path}.command")
    validate_labels(spec.labels, f"{path}.labels")
    _batch_size(spec.batch_size, f"{path}.batch_size")
    if not -L.PRIORITY_MAX <= spec.priority <= L.PRIORITY_MAX:
        raise InvalidSpec(f"{path}.priority", f"must be in [-{L.PRIORITY_MAX}, {L.PRIORITY_MAX}], got {spec.priority}")
    if spec.kind is JobKind.TRAINING:
        if spec.training is None:
            raise InvalidSpec(f"{path}.training", "is required for a training job")
        if spec.inference is not None:
            raise InvalidSpec(f"{path}.inference", "must be unset for a training job")
        if not 0 < spec.training.total_steps <= L.TOTAL_STEPS_MAX:
            raise InvalidSpec(f"{path}.training.total_steps", f"must be in [1, {L.TOTAL_STEPS_MAX:g}], got {spec.training.total_steps}")
        ms = spec.training.max_slowdown
        if math.isnan(ms) or math.isinf(ms) or (ms != 0 and not 1 <= ms <= L.MAX_SLOWDOWN_MAX):
            raise InvalidSpec(f"{path}.training.max_slowdown", f"must be 0 (default) or in [1, {L.MAX_SLOWDOWN_MAX:g}], got {ms!r}")
    elif spec.kind is JobKind.INFERENCE:
        if spec.inference is None:
            raise InvalidSpec(f"{path}.inference", "is required for an inference job")
        if spec.training is not None:
            raise InvalidSpec(f"{path}.training", "must be unset for an inference job")
        _finite_positive(spec.inference.demand_rps, f"{path}.inference.demand_rps", lower=L.RATE_MIN, upper=L.RATE_MAX)
        _finite_positive(spec.inference.latency_slo_ms, f"{path}.inference.latency_slo_ms", lower=L.LATENCY_SLO_MS_MIN,
                         upper=L.LATENCY_SLO_MS_MAX)
        if spec.inference.metrics is not None:
            validate_metrics_endpoint(spec.inference.metrics, f"{path}.inference.metrics")
    else:  # pragma: no cover - enum exhausts the cases
        raise InvalidSpec(f"{path}.kind", f"unknown kind {spec.kind!r}")
    if len(spec.shapes) > L.SHAPES_PER_JOB_MAX:
        raise InvalidSpec(f"{path}.shapes", f"at most {L.SHAPES_PER_JOB_MAX} shapes, got {len(spec.shapes)}")
    for i, shape in enumerate(spec.shapes):
        validate_shape(shape, f"{path}.shapes[{i}]")
    if len(spec.allowed_nodes) > L.ALLOWED_NODES_MAX_COUNT:
        raise InvalidSpec(f"{path}.allowed_nodes", f"at most {L.ALLOWED_NODES_MAX_COUNT} node ids, got {len(spec.allowed_nodes)}")
    for i, node in enumerate(spec.allowed_nodes):
        _max_chars(node, L.NODE_ID_MAX_CHARS, f"{path}.allowed_nodes[{i}]")
        if not NODE_ID_RE.fullmatch(node):
            raise InvalidSpec(f"{path}.allowed_nodes[{i}]", "must be a node id: letters, digits, '.', '_' or '-', "
                              "starting with a letter or digit")
    if not spec.shapes and not spec.model_family:
        raise InvalidSpec(f"{path}.model_family", "is required when no shapes are given (shapes are derived from it)")
