"""The suite's gRPC answers as domain objects (``elastico.domain``), for the clients: jobs, events, nodes, workloads
and the cluster state. What a server sends was validated when it was stored, so these read it without checking
it again (requests are checked by ``elastico.rpc.convert``)."""

from __future__ import annotations

from dataclasses import dataclass

from elastico import domain as d
from elastico.rpc import convert
from elastico.v1 import allocator_pb2 as apb
from elastico.v1 import types_pb2 as pb

_REASON_FROM_PB = {pb.StateReason.Value(f"STATE_REASON_{r.name}"): r for r in d.StateReason}


def _seconds(t) -> float:
    return t.seconds + t.nanos * 1e-9


def reason_from_pb(value: int) -> d.StateReason | None:
    return _REASON_FROM_PB.get(value)


def placement_from_pb(m: pb.Placement) -> d.Placement:
    return d.Placement(job_id=m.job_id, shape_index=m.shape_index, shape=convert.shape_from_pb(m.shape),
                       slices=tuple(d.GpuSlice(s.node_id, s.gpu_index, s.compute_share_pct, s.mem_mib) for s in m.slices),
                       epoch=m.epoch, committed_at_s=_seconds(m.committed_at),
                       resized_at_s=_seconds(m.resized_at))


def spec_from_pb(m: pb.JobSpec) -> d.JobSpec:
    """A received spec (stored by the allocator, so already valid) without re-validating it."""
    work = m.WhichOneof("work")
    inference = None
    if work == "inference":
        metrics = convert.metrics_from_pb(m.inference.metrics) if m.inference.HasField("metrics") else None
        inference = d.InferenceWork(m.inference.demand_rps, m.inference.latency_slo_ms, metrics)
    return d.JobSpec(kind=convert.kind_from_pb(m.kind, "spec.kind"), name=m.name, tenant=m.tenant or "default",
                     priority=m.priority, model_family=m.model_family, batch_size=m.batch_size,
                     precision=m.precision or "fp32", shapes=tuple(convert.shape_from_pb(s) for s in m.shapes),
                     training=d.TrainingWork(m.training.total_steps, m.training.max_slowdown) if work == "training" else None,
                     inference=inference, command=m.command, labels=tuple(sorted(m.labels.items())),
                     allowed_nodes=tuple(m.allowed_nodes))


def job_from_pb(m: pb.Job) -> d.Job:
    return d.Job(job_id=m.job_id, request_id=m.request_id, spec=spec_from_pb(m.spec),
                 state=convert.state_from_pb(m.state, "job.state"), reason=reason_from_pb(m.reason) or d.StateReason.SUBMITTED,
                 message=m.message, placement=placement_from_pb(m.placement) if m.HasField("placement") else None,
                 progress_steps=m.progress_steps, restarts=m.restarts, version=m.version,
                 submitted_at_s=_seconds(m.submitted_at), updated_at_s=_seconds(m.updated_at),
                 draining=placement_from_pb(m.draining) if m.HasField("draining") else None)


def event_from_pb(m: apb.JobEvent) -> d.JobEvent:
    return d.JobEvent(event_id=m.event_id, job_id=m.job_id, state=convert.state_from_pb(m.state, "event.state"),
                      reason=reason_from_pb(m.reason) or d.StateReason.SUBMITTED, message=m.message, version=m.version,
                      time_s=m.time_unix_s)


def node_from_pb(m: pb.NodeInfo) -> d.NodeInfo:
    return d.NodeInfo(node_id=m.node_id, address=m.address, gpu_backend=m.gpu_backend, ready=m.ready,
                      last_heartbeat_s=_seconds(m.last_heartbeat),
                      gpus=tuple(d.GpuInfo(index=g.index, uuid=g.uuid, gpu_type=g.gpu_type, mem_total_mib=g.mem_total_mib,
                                           allocated_share_pct=g.allocated_share_pct, allocated_mem_mib=g.allocated_mem_mib,
                                           counters=convert.counters_from_pb(g.counters), healthy=g.healthy)
                                 for g in m.gpus))


def workload_from_pb(m: pb.Workload) -> d.Workload:
    return d.Workload(job_id=m.job_id, gpu_indices=tuple(m.gpu_indices), compute_share_pct=m.compute_share_pct,
                      mem_mib=m.mem_mib, status=m.status, pid=m.pid, progress_steps=m.progress_steps,
                      throughput=m.throughput, started_at_s=_seconds(m.started_at), placement_id=m.placement_id,
                      reason=reason_from_pb(m.reason), exit_code=m.exit_code if m.HasField("exit_code") else None,
                      message=m.message, cotenants=tuple(m.cotenants),
                      norm_throughput=m.norm_throughput if m.HasField("norm_throughput") else None,
                      counters=convert.counters_from_pb(m.counters), log_path=m.log_path, ended_at_s=_seconds(m.ended_at),
                      endpoint=m.endpoint, demand=convert.demand_from_pb(m.demand) if m.HasField("demand") else None)


@dataclass(frozen=True)
class TenantUsage:
    tenant: str
    running_jobs: int
    pending_jobs: int
    allocated_gpus: float
    service_gpus: int = 0  # GPUs its placed services count against its service quota
    service_quota_gpus: int | None = None  # None = no quota


@dataclass(frozen=True)
class ClusterState:
    """``GetClusterState``: nodes and GPUs, usage per tenant, shadow prices, the last round, the leader."""

    nodes: tuple[d.NodeInfo, ...]
    tenants: tuple[TenantUsage, ...]
    prices: tuple[tuple[str, float, float], ...]  # (pool, price, capacity)
    last_round_gap: float
    last_round_time_s: float
    leader_epoch: int
    leader_id: str
    degraded: tuple[str, ...]


@dataclass(frozen=True)
class DemandAck:
    """``ReportDemand``'s answer: whether the window was new, the forecast after it, the reports it is made of."""

    accepted: bool
    forecast_rps: float
    reports_in_window: int


@dataclass(frozen=True)
class Submitted:
    job: d.Job
    created: bool  # False: the request id was seen before and this is the job it created


def cluster_state_from_pb(m: apb.GetClusterStateResponse) -> ClusterState:
    return ClusterState(nodes=tuple(node_from_pb(n) for n in m.nodes),
                        tenants=tuple(TenantUsage(t.tenant, t.running_jobs, t.pending_jobs, t.allocated_gpus, t.service_gpus,
                                                    t.service_quota_gpus if t.HasField("service_quota_gpus") else None)
                                        for t in m.tenants),
                        prices=tuple((p.pool, p.price, p.capacity) for p in m.prices), last_round_gap=m.last_round_gap,
                        last_round_time_s=m.last_round_time_unix_s, leader_epoch=m.leader_epoch, leader_id=m.leader_id,
                        degraded=tuple(m.degraded))
