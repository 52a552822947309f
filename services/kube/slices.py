"""Which nodes can host a pod's GPU slice, and how good each is (pure: domain objects in, plain values out).

The extender's filter and prioritize answer from these; the allocator re-checks everything atomically when it
commits the slice at bind time, so a stale view here can cost a retry, never an oversubscribed GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from elastico.domain import GpuInfo, NodeInfo, Shape

MAX_SCORE = 10  # kube-scheduler's MaxExtenderPriority


@dataclass(frozen=True)
class Tenant:
    """A job already holding a slice of a GPU, as the predictor needs it."""

    model_family: str
    batch_size: int
    kind: int  # elastico.v1.JobKind value
    share_pct: float


def gpu_fits(g: GpuInfo, shape: Shape) -> bool:
    """The GPU is healthy, of the asked type, and has the shape's share and memory free."""
    return (g.healthy and (not shape.gpu_type or g.gpu_type == shape.gpu_type)
            and 100.0 - g.allocated_share_pct >= shape.compute_share_pct - 1e-9
            and g.mem_total_mib - g.allocated_mem_mib >= shape.mem_mib)


def feasible(nodes: Mapping[str, NodeInfo], shape: Shape, candidates: Iterable[str]
             ) -> tuple[dict[str, list[GpuInfo]], dict[str, str]]:
    """Split kube-scheduler's candidate nodes into (node -> GPUs that fit, node -> why not)."""
    ok: dict[str, list[GpuInfo]] = {}
    failed: dict[str, str] = {}
    for name in candidates:
        n = nodes.get(name)
        if n is None:
            failed[name] = "elastico: no ElastiCo node agent registered under this node name"
        elif not n.ready:
            failed[name] = "elastico: node agent not ready (stale heartbeat or MPS down)"
        else:
            gpus = [g for g in n.gpus if gpu_fits(g, shape)]
            if len(gpus) >= shape.num_gpus:
                ok[name] = gpus
            else:
                kind = f" {shape.gpu_type}" if shape.gpu_type else ""
                failed[name] = (f"elastico: {len(gpus)}{kind} GPU(s) with {shape.compute_share_pct:g}% compute and "
                                f"{shape.mem_mib} MiB free, the pod needs {shape.num_gpus}")
    return ok, failed


def gpu_score(pod_norm: float, tenants_norm: float, allocated_share_pct: float, shape: Shape) -> float:
    """Score in [0, 1] of putting the pod on one GPU.

    Half is the worst predicted normalised throughput of the pod and of the GPU's tenants next to each other
    (1 on an empty GPU): co-locate only where it hurts little. Half is how full the GPU gets: among harmless
    choices, pack (what frees whole GPUs for the jobs that need them).
    """
    fill = min(1.0, (allocated_share_pct + shape.compute_share_pct) / 100.0)
    return 0.5 * max(0.0, min(1.0, pod_norm, tenants_norm)) + 0.5 * fill


def node_score(gpu_scores: Sequence[float], num_gpus: int) -> int:
    """0..MAX_SCORE: the mean of the node's best ``num_gpus`` GPU scores (the gang the allocator would pick)."""
    best = sorted(gpu_scores, reverse=True)[:num_gpus]
    if len(best) < num_gpus or not best:
        return 0
    return int(round(MAX_SCORE * sum(best) / len(best)))
