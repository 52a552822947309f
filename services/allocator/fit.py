"""What hardware a job's spec can run on: its gang sizes, the declared shapes a GPU fits (memory per GPU and
GPU type), and why a job can never be placed on the healthy GPUs as they are (NEVER_SCHEDULABLE). Pure: read
by :mod:`services.allocator.plan` (the view's masks, a placement's shape) and the rounds (the reasons)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from elastico.domain import JobSpec, NodeInfo, Shape


def allowed_gang_sizes(spec: JobSpec) -> set[int]:
    """GPU counts a live job may run at: its explicit shapes' counts, else 1."""
    return {s.num_gpus for s in spec.shapes} or {1}


#: a GPU as a declared shape sees it: (memory, MiB; GPU type)
GpuKind = tuple[int, str]


def gpu_type_matches(shape_type: str, gpu_type: str) -> bool:
    """A shape naming a GPU type runs only on GPUs of that type (letter case and surrounding spaces aside); a
    shape naming none runs on any."""
    want = shape_type.strip().lower()
    return not want or want == gpu_type.strip().lower()


def shape_fits(shape: Shape, gpu: GpuKind) -> bool:
    """True when a GPU ``(MiB, type)`` has the shape's memory per GPU and its GPU type."""
    return shape.mem_mib <= gpu[0] and gpu_type_matches(shape.gpu_type, gpu[1])


def shapes_within(spec: JobSpec, gpus: Iterable[GpuKind]) -> tuple[Shape, ...]:
    """The declared shapes of ``spec`` that fit some GPU of ``gpus`` (:func:`shape_fits`; all of them when it
    declares none: the policy's own shapes take a share of whatever GPU they get)."""
    kinds = set(gpus)
    return tuple(s for s in spec.shapes if any(shape_fits(s, g) for g in kinds))


def hardware_misfit(spec: JobSpec, gpus: Iterable[GpuKind]) -> str:
    """Why none of ``gpus`` (the cluster's healthy GPUs) can host any declared shape of ``spec`` -- memory or GPU
    type; "" when one can (or the job declares none)."""
    kinds = set(gpus)
    if not spec.shapes or shapes_within(spec, kinds):
        return ""
    biggest = max((m for m, _ in kinds), default=0)
    if all(s.mem_mib > biggest for s in spec.shapes):
        return (f"every declared shape needs at least {min(s.mem_mib for s in spec.shapes)} MiB per GPU; the largest "
                f"healthy GPU has {biggest} MiB")
    named = sorted({s.gpu_type.strip().lower() for s in spec.shapes})
    have = sorted({t.strip().lower() or "unknown" for _, t in kinds})
    return (f"no healthy GPU has both the memory and the GPU type of a declared shape (declared types: "
            f"{', '.join(t or 'any' for t in named)}; the cluster's: {', '.join(have) or 'none'})")


def healthy_gpus(nodes: Sequence[NodeInfo]) -> dict[str, list[GpuKind]]:
    """Node id -> (memory, type) of each of its healthy GPUs: what :func:`placement_misfit` reads."""
    return {n.node_id: [(g.mem_total_mib, g.gpu_type) for g in n.gpus if g.healthy] for n in nodes}


def placement_misfit(spec: JobSpec, healthy: Mapping[str, Sequence[GpuKind]]) -> str:
    """Why ``spec`` can never be placed on the ``healthy`` GPUs (:func:`healthy_gpus`) as they are; "" when
    some shape can.

    A declared shape (a job declaring none: one GPU) needs ``num_gpus`` healthy GPUs with its memory and GPU type
    on the job's allowed nodes, on one node when the gang fits the largest node (the allocator never splits such
    a gang), else that many in all."""
    total = sum(map(len, healthy.values()))
    if (n_req := spec_num_gpus(spec)) > total:
        return f"needs {n_req} GPUs; the cluster has {total}"
    if why := hardware_misfit(spec, (g for gpus in healthy.values() for g in gpus)):
        return why
    node_max = max(map(len, healthy.values()), default=0)
    allowed = [gpus for node, gpus in healthy.items() if not spec.allowed_nodes or node in spec.allowed_nodes]
    for shape in spec.shapes or (None,):
        n = shape.num_gpus if shape is not None else 1
        fit = [sum(1 for g in gpus if shape is None or shape_fits(shape, g)) for gpus in allowed]
        if max(fit, default=0) >= n or (n > node_max and sum(fit) >= n):
            return ""
    where = f"its allowed nodes ({', '.join(spec.allowed_nodes)})" if spec.allowed_nodes else "the cluster"
    return (f"no declared shape finds enough healthy GPUs with its memory and GPU type on {where} (a gang of up to "
            f"{node_max} GPUs runs inside one node)")


def spec_num_gpus(spec: JobSpec) -> int:
    """Gang size: the explicit shapes' GPU count (the largest), else 1."""
    return max((s.num_gpus for s in spec.shapes), default=1)
