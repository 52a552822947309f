"""Protobuf <-> domain conversion, done once at the servicer edge.

Conversion from protobuf also validates what the wire format cannot express (enum values that are
UNSPECIFIED, missing oneofs) and raises ``InvalidSpec`` naming the field; deeper semantic checks live
in ``elastico.domain.validate_*`` so the simulator and tests share them. Repeated fields are counted
against ``elastico.limits`` *before* they are converted, and a JobSpec's serialized size after, so an
oversized spec is refused before anything is built from it or stored.
"""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from elastico import domain as d
from elastico import limits as L
from elastico.errors import InvalidSpec
from elastico.v1 import types_pb2 as pb

_KIND_TO_PB = {d.JobKind.TRAINING: pb.JOB_KIND_TRAINING, d.JobKind.INFERENCE: pb.JOB_KIND_INFERENCE}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}
_STATE_TO_PB = {s: pb.JobState.Value(f"JOB_STATE_{s.name}") for s in d.JobState}
_STATE_FROM_PB = {v: k for k, v in _STATE_TO_PB.items()}
_REASON_TO_PB = {r: pb.StateReason.Value(f"STATE_REASON_{r.name}") for r in d.StateReason}


def ts(seconds: float) -> Timestamp:
    t = Timestamp()
    if seconds:
        t.FromNanoseconds(int(seconds * 1e9))
    return t


def kind_from_pb(value: int, path: str) -> d.JobKind:
    try:
        return _KIND_FROM_PB[value]
    except KeyError:
        raise InvalidSpec(path, "must be JOB_KIND_TRAINING or JOB_KIND_INFERENCE") from None


def state_from_pb(value: int, path: str) -> d.JobState:
    try:
        return _STATE_FROM_PB[value]
    except KeyError:
        raise InvalidSpec(path, f"unknown job state {value}") from None


def state_to_pb(state: d.JobState) -> int:
    return _STATE_TO_PB[state]


def reason_to_pb(reason: d.StateReason) -> int:
    return _REASON_TO_PB[reason]


def shape_from_pb(m: pb.Shape) -> d.Shape:
    return d.Shape(num_gpus=m.num_gpus, compute_share_pct=m.compute_share_pct, mem_mib=m.mem_mib,
                   batch_size=m.batch_size, gpu_type=m.gpu_type, throughput=m.throughput)


def shape_to_pb(s: d.Shape) -> pb.Shape:
    return pb.Shape(num_gpus=s.num_gpus, compute_share_pct=s.compute_share_pct, mem_mib=s.mem_mib,
                    batch_size=s.batch_size, gpu_type=s.gpu_type, throughput=s.throughput)


def _check_spec_counts(m: pb.JobSpec, path: str) -> None:
    """Repeated fields within ``elastico.limits`` (O(1) each): checked before anything is converted."""
    for name, limit in (("shapes", L.SHAPES_PER_JOB_MAX), ("labels", L.LABELS_MAX_COUNT),
                        ("allowed_nodes", L.ALLOWED_NODES_MAX_COUNT)):
        n = len(getattr(m, name))
        if n > limit:
            raise InvalidSpec(f"{path}.{name}", f"at most {limit} entries, got {n}")


def job_spec_from_pb(m: pb.JobSpec, path: str = "spec") -> d.JobSpec:
    """Convert and validate a JobSpec; raises InvalidSpec naming the field.

    Order: counts of repeated fields (before conversion), then every field (``domain.validate_job_spec``:
    lengths name the field, e.g. ``spec.labels["team"]``), then the whole spec's serialized size
    (``limits.JOB_SPEC_MAX_BYTES``, named ``spec``) for specs whose fields are each within limits.
    """
    _check_spec_counts(m, path)
    kind = kind_from_pb(m.kind, f"{path}.kind")
    work = m.WhichOneof("work")
    training = d.TrainingWork(m.training.total_steps, m.training.max_slowdown) if work == "training" else None
    inference = (d.InferenceWork(m.inference.demand_rps, m.inference.latency_slo_ms,
                                 metrics_from_pb(m.inference.metrics) if m.inference.HasField("metrics") else None)
                 if work == "inference" else None)
    spec = d.JobSpec(
        kind=kind, name=m.name, tenant=m.tenant or "default", priority=m.priority, model_family=m.model_family,
        batch_size=m.batch_size, precision=m.precision or "fp32", shapes=tuple(shape_from_pb(s) for s in m.shapes),
        training=training, inference=inference, command=m.command, labels=tuple(sorted(m.labels.items())),
        allowed_nodes=tuple(m.allowed_nodes),
    )
    d.validate_job_spec(spec, path)
    size = m.ByteSize()
    if size > L.JOB_SPEC_MAX_BYTES:
        raise InvalidSpec(path, f"serialized size must be at most {L.JOB_SPEC_MAX_BYTES} bytes, got {size}")
    return spec


def job_spec_to_pb(s: d.JobSpec) -> pb.JobSpec:
    m = pb.JobSpec(name=s.name, tenant=s.tenant, priority=s.priority, kind=_KIND_TO_PB[s.kind],
                   model_family=s.model_family, batch_size=s.batch_size, precision=s.precision,
                   shapes=[shape_to_pb(x) for x in s.shapes], command=s.command, labels=dict(s.labels),
                   allowed_nodes=list(s.allowed_nodes))
    if s.training is not None:
        m.training.CopyFrom(pb.TrainingWork(total_steps=s.training.total_steps, max_slowdown=s.training.max_slowdown))
    if s.inference is not None:
        m.inference.CopyFrom(pb.InferenceWork(demand_rps=s.inference.demand_rps, latency_slo_ms=s.inference.latency_slo_ms))
        if s.inference.metrics is not None:
            m.inference.metrics.CopyFrom(metrics_to_pb(s.inference.metrics))
    return m


def placement_to_pb(p: d.Placement) -> pb.Placement:
    return pb.Placement(
        job_id=p.job_id, shape_index=p.shape_index, shape=shape_to_pb(p.shape), epoch=p.epoch,
        slices=[pb.GpuSlice(node_id=s.node_id, gpu_index=s.gpu_index, compute_share_pct=s.compute_share_pct, mem_mib=s.mem_mib)
                for s in p.slices],
        committed_at=ts(p.committed_at_s), resized_at=ts(p.resized_at_s),
    )


def job_to_pb(j: d.Job) -> pb.Job:
    m = pb.Job(job_id=j.job_id, request_id=j.request_id, spec=job_spec_to_pb(j.spec), state=_STATE_TO_PB[j.state],
               reason=_REASON_TO_PB[j.reason], message=j.message, progress_steps=j.progress_steps,
               restarts=j.restarts, version=j.version, submitted_at=ts(j.submitted_at_s), updated_at=ts(j.updated_at_s))
    if j.placement is not None:
        m.placement.CopyFrom(placement_to_pb(j.placement))
    if j.draining is not None:
        m.draining.CopyFrom(placement_to_pb(j.draining))
    return m


def counters_to_pb(c: d.GpuCounters) -> pb.GpuCounters:
    m = pb.GpuCounters()
    for name in ("sm_util_pct", "mem_bw_util_pct", "mem_used_mib", "tensor_util_pct"):
        value = getattr(c, name)
        if value is not None:
            setattr(m, name, value)
    return m


def counters_from_pb(m: pb.GpuCounters) -> d.GpuCounters:
    return d.GpuCounters(**{n: (getattr(m, n) if m.HasField(n) else None)
                            for n in ("sm_util_pct", "mem_bw_util_pct", "mem_used_mib", "tensor_util_pct")})


def node_to_pb(n: d.NodeInfo) -> pb.NodeInfo:
    return pb.NodeInfo(
        node_id=n.node_id, address=n.address, gpu_backend=n.gpu_backend, ready=n.ready,
        last_heartbeat=ts(n.last_heartbeat_s),
        gpus=[pb.GpuInfo(index=g.index, uuid=g.uuid, gpu_type=g.gpu_type, mem_total_mib=g.mem_total_mib,
                         allocated_share_pct=g.allocated_share_pct, allocated_mem_mib=g.allocated_mem_mib,
                         counters=counters_to_pb(g.counters), healthy=g.healthy) for g in n.gpus],
    )


def workload_to_pb(w: d.Workload) -> pb.Workload:
    m = pb.Workload(job_id=w.job_id, gpu_indices=list(w.gpu_indices), compute_share_pct=w.compute_share_pct,
                    mem_mib=w.mem_mib, status=w.status, pid=w.pid, progress_steps=w.progress_steps,
                    throughput=w.throughput, started_at=ts(w.started_at_s), placement_id=w.placement_id,
                    reason=_REASON_TO_PB[w.reason] if w.reason is not None else pb.STATE_REASON_UNSPECIFIED,
                    message=w.message, cotenants=list(w.cotenants), counters=counters_to_pb(w.counters),
                    log_path=w.log_path, ended_at=ts(w.ended_at_s))
    if w.exit_code is not None:
        m.exit_code = w.exit_code
    if w.norm_throughput is not None:
        m.norm_throughput = w.norm_throughput
    if w.endpoint:
        m.endpoint = w.endpoint
    if w.demand is not None:
        m.demand.CopyFrom(demand_to_pb(w.demand))
    return m


def metrics_from_pb(m: pb.MetricsEndpoint) -> d.MetricsEndpoint:
    return d.MetricsEndpoint(port=m.port, path=m.path, format=m.format, scrape_interval_s=m.scrape_interval_s, model=m.model)


def metrics_to_pb(m: d.MetricsEndpoint) -> pb.MetricsEndpoint:
    return pb.MetricsEndpoint(port=m.port, path=m.path, format=m.format, scrape_interval_s=m.scrape_interval_s, model=m.model)


def demand_from_pb(m: pb.DemandReport) -> d.DemandReport:
    """The report as sent (``source`` is the allocator's to set, so it is dropped)."""
    if m.HasField("window_end") and not 0 <= m.window_end.nanos < 1_000_000_000:
        raise InvalidSpec("report.window_end.nanos", f"must be in [0, 999999999], got {m.window_end.nanos}")
    end = m.window_end.seconds + m.window_end.nanos * 1e-9 if m.HasField("window_end") else 0.0
    return d.DemandReport(job_id=m.job_id, window_end_s=end, window_s=m.window_s, request_rate_rps=m.request_rate_rps,
                          p50_latency_ms=m.p50_latency_ms, p99_latency_ms=m.p99_latency_ms, queue_length=m.queue_length)


def demand_to_pb(r: d.DemandReport) -> pb.DemandReport:
    return pb.DemandReport(job_id=r.job_id, window_end=ts(r.window_end_s), window_s=r.window_s,
                           request_rate_rps=r.request_rate_rps, p50_latency_ms=r.p50_latency_ms,
                           p99_latency_ms=r.p99_latency_ms, queue_length=r.queue_length, source=r.source)
