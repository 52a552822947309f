"""Pure halves of a scheduling round: agent reports -> job transitions, Redis state -> ``ClusterView``,
``Decision`` -> store operations. No I/O here (``rounds.py`` does the reading and writing), so every
mapping is unit-tested with plain domain objects.

Row conventions: the view's job rows are the round's pending and placed jobs (``ViewIndex.jobs``), its
GPU rows the usable GPUs sorted by (node id, index) (``ViewIndex.gpus``), grouped into the view's
``Topology`` by node. A GPU is usable when its node's heartbeat is fresh, the node is ready and the GPU is
healthy; jobs on other GPUs still occupy their slots on the usable ones but the policy never places next to
a GPU it cannot see. Whatever constrains a placement is in the view (topology, the GPUs of a job pinned to
nodes, the gang sizes and shapes a job allows) and every policy honours it; :func:`translate` applies only
what the decision contract (:func:`services.allocator.policy.contract.check`) accepts, never rewriting it.

Time: the policy's clock is ``wall x time_scale`` (1 in production; a demo replays a trace faster and
scales the node agents' simulated GPUs by the same factor), applied to every time it sees.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np

from elastico.coloc.profiles import TypeTable
from elastico.coloc.rates import share_speed
from elastico.domain import (
    GpuSlice,
    Job,
    JobKind,
    JobSpec,
    JobState,
    NodeInfo,
    Placement,
    Shape,
    StateReason,
    Workload,
    is_pod_job,
    placement_id,
    pod_evictable,
)
from elastico.state.store import FULL_GPU_SHARE_UNITS, share_units
from services.allocator.fit import (
    allowed_gang_sizes,
    gpu_type_matches,
    shape_fits,
    shapes_within,
    spec_num_gpus,
)
from services.allocator.policy import INFERENCE, TRAINING, ClusterView, Decision, JobTable
from services.allocator.policy.contract import check
from services.allocator.policy.inference import slo_margin
from services.allocator.policy.placement import pick_gang
from services.allocator.policy.shapes import SHARES_PCT, DeclaredJobTable, declared_matches, declared_util_cap
from services.allocator.policy.view import Topology, gpu_mask

# --------------------------------------------------------------------------------------------------
# 1. Agent reports -> job transitions


@dataclass(frozen=True)
class Transition:
    """What the round must write for one placed job, learned from its node agents' reports or heartbeats."""

    job: Job  # as read (its version is the compare-and-set guard); progress already set from the report
    state: JobState  # RUNNING (mark started) or the state release_job moves it to
    reason: StateReason
    message: str = ""

    @property
    def release(self) -> bool:
        """True when the job leaves its GPUs (anything but PLACED -> RUNNING)."""
        return self.state is not JobState.RUNNING


_END_TO_STATE = {
    StateReason.COMPLETED: JobState.SUCCEEDED,
    StateReason.OWN_FAILURE: JobState.FAILED,
    StateReason.COTENANT_FAULT: JobState.PENDING,  # requeue without penalty
}
# A pod job's every end is terminal: its pod is bound to its node for life and its owner (never ElastiCo) makes a
# new pod, which is a new job. A co-tenant's fault fails it (the reason says whose fault); a pod evicted or deleted
# is cancelled.
_POD_END_TO_STATE = {
    StateReason.COMPLETED: JobState.SUCCEEDED,
    StateReason.OWN_FAILURE: JobState.FAILED,
    StateReason.COTENANT_FAULT: JobState.FAILED,
}
POD_GONE_MESSAGE = "pod evicted or deleted; its owner recreates it"
BARE_POD_GONE_MESSAGE = "pod evicted or deleted; a bare pod: nothing recreates it"


def node_fresh(node: NodeInfo, now_s: float, stale_s: float) -> bool:
    """Heartbeat fresh and agent ready: the node may receive new placements."""
    return node.ready and now_s - node.last_heartbeat_s <= stale_s


def current_reports(job: Job, workloads: Mapping[str, Mapping[str, Workload]]) -> list[Workload]:
    """The agents' reports of ``job``'s *current* placement, one per node of it (an agent keeps reporting an
    older placement's ended workload until the job leaves its desired state; those are left out)."""
    pid = placement_id(job.placement)
    reports = (workloads.get(n, {}).get(job.job_id) for n in sorted({s.node_id for s in job.placement.slices}))
    return [w for w in reports if w is not None and w.placement_id == pid]


def node_lost(node: NodeInfo | None, now_s: float, lost_after_s: float, watched_since_s: float = -math.inf) -> bool:
    """A node is lost when it is unknown or its heartbeat is older than ``lost_after_s``, counted from no earlier
    than ``watched_since_s``: the allocator only holds silence it could have seen against a node (since it took
    the lead, or since the store answered again after an outage, in which no heartbeat could land)."""
    return node is None or now_s - max(node.last_heartbeat_s, watched_since_s) > lost_after_s


def transitions(jobs: Sequence[Job], nodes: Mapping[str, NodeInfo], workloads: Mapping[str, Mapping[str, Workload]],
                now_s: float, stale_s: float, grace_s: float, watched_since_s: float = -math.inf) -> list[Transition]:
    """Transitions of placed jobs (PLACED/RUNNING) from the agents' actual state and the nodes' heartbeats.

    * a workload of the job's *current* placement (same ``placement_id``) running -> PLACED becomes RUNNING;
    * ended -> COMPLETED: SUCCEEDED; OWN_FAILURE: FAILED; COTENANT_FAULT or stopped: back to PENDING;
    * a node of the placement missing, or silent for more than ``stale_s + grace_s`` -> PENDING (NODE_LOST)
      (:func:`node_lost`: silence counts from ``watched_since_s`` at the earliest).

    A Kubernetes pod's job (``domain.is_pod_job``) never goes back to PENDING: its pod is bound to its node and
    only its owner makes a new one (a new job). Its ends are terminal: COMPLETED -> SUCCEEDED, OWN_FAILURE and
    COTENANT_FAULT -> FAILED (reason kept), stopped (the pod evicted or deleted) -> CANCELLED with PREEMPTED. A
    lost node does not release it: kubelet may still run the pod there, and its slices stay booked until the
    pod is gone (its agent reports the end once it is back, or the pod object disappears and the kube
    extender's reaper cancels the job) -- releasing earlier could put a second tenant on a GPU it still uses.

    Reports of an older placement of the same job are ignored (the agent reports an ended workload until
    the job leaves its desired state; a requeued job gets a new placement id).
    """
    out: list[Transition] = []
    for job in jobs:
        p = job.placement
        if p is None or job.state not in (JobState.PLACED, JobState.RUNNING):
            continue
        node_ids = sorted({s.node_id for s in p.slices})
        lost = [n for n in node_ids if node_lost(nodes.get(n), now_s, stale_s + grace_s, watched_since_s)]
        reports = current_reports(job, workloads)
        ended = [w for w in reports if w.status in ("succeeded", "failed", "killed")]
        progress = max((w.progress_steps for w in reports), default=job.progress_steps)
        seen = replace(job, progress_steps=max(job.progress_steps, progress))
        pod = is_pod_job(job.spec)
        if ended:
            # a gang ends with its first ended member; a failure outranks a success of another member
            w = next((e for e in ended if e.reason is not StateReason.COMPLETED), ended[0])
            reason = w.reason or StateReason.OWN_FAILURE
            if pod:
                out.append(_pod_end(seen, w, reason))
                continue
            state = _END_TO_STATE.get(reason, JobState.PENDING)
            if state is JobState.PENDING and reason not in (StateReason.COTENANT_FAULT, StateReason.NODE_LOST):
                reason = StateReason.PREEMPTED  # NODE_LOST: its supervisor stopped it for a silent agent (fence)
            out.append(Transition(seen, state, reason, w.message))
        elif lost and pod:
            continue  # kept placed until its pod is gone (see above)
        elif lost:
            out.append(Transition(seen, JobState.PENDING, StateReason.NODE_LOST,
                                  f"node {', '.join(lost)} silent for more than {stale_s + grace_s:.0f}s"))
        elif job.state is JobState.PLACED and len(reports) == len(node_ids) and all(w.status == "running" for w in reports):
            out.append(Transition(seen, JobState.RUNNING, StateReason.STARTED))
    return out


def _pod_end(job: Job, w: Workload, reason: StateReason) -> Transition:
    """A pod job's end ``w`` (its ``reason``, OWN_FAILURE when unsaid): terminal (see :func:`transitions`); a
    stopped pod (status "killed": evicted or deleted) is CANCELLED."""
    state = None if w.status == "killed" else _POD_END_TO_STATE.get(reason)
    if state is None:
        return Transition(job, JobState.CANCELLED, StateReason.PREEMPTED,
                          POD_GONE_MESSAGE if pod_evictable(job.spec) else BARE_POD_GONE_MESSAGE)
    return Transition(job, state, reason, w.message)


# --------------------------------------------------------------------------------------------------
# 2. State -> ClusterView


@dataclass
class ViewIndex:
    """Maps the view's integer rows back to the domain."""

    jobs: list[Job]  # job row -> Job
    gpus: list[tuple[str, int]]  # GPU row -> (node id, GPU index)
    gpu_mem_mib: np.ndarray  # [G] memory of each GPU row, MiB
    gpu_type: list[str]  # [G]
    iso_rate: np.ndarray  # [N] isolated steps/s of each job row at its gang size (NaN unknown)
    free: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # (share units, MiB) left per known GPU


def isolated_rate(spec: JobSpec, types: TypeTable, type_idx: int) -> float:
    """Isolated steps/s at the job's gang size: its full-share shape's throughput, else the type's x GPUs."""
    full = [s for s in spec.shapes if s.compute_share_pct >= 100.0 and s.throughput > 0]
    if full:
        return max(s.throughput for s in full)
    best = [s.throughput * 100.0 / s.compute_share_pct for s in spec.shapes if s.throughput > 0]
    if best:
        return max(best)
    if spec.kind is JobKind.INFERENCE:
        return math.nan
    return float(types.iso_tput_steps_s[type_idx]) * spec_num_gpus(spec)


def inference_load(spec: JobSpec, iso_rps: float, forecast_rps: float | None = None) -> float:
    """Demand as a fraction of one full GPU's service rate: the forecast from measured demand when there is one,
    else the rate declared at submission; unknown service rate -> the load that needs a whole GPU."""
    if spec.inference is None:
        return math.nan
    if iso_rps > 0 and math.isfinite(iso_rps):
        rps = forecast_rps if forecast_rps is not None and math.isfinite(forecast_rps) else spec.inference.demand_rps
        return float(rps) / float(iso_rps)  # (Python floats: a job stored before the rate bounds overflows to inf, no warning)
    return 1.0 - slo_margin(10.0)


def priority_weight(priority: int) -> float:
    """API priority (0 = normal, higher = more important) -> the policy's weight (1 = normal, >= 0)."""
    return float(1 + priority) if priority >= 0 else 1.0 / (1 - priority)


def build_view(jobs: Sequence[Job], nodes: Sequence[NodeInfo], types: TypeTable, resolve: Callable[[JobSpec], int],
               now_s: float, stale_s: float, time_scale: float = 1.0, max_tenants: int = 4,
               observed: Mapping[str, tuple[float, Sequence[str]]] | None = None,
               demand_rps: Mapping[str, float] | None = None) -> tuple[ClusterView, ViewIndex]:
    """The round's ``ClusterView`` from active jobs and nodes (with their committed usage).

    Args:
        jobs: non-terminal jobs (PENDING, PLACED, RUNNING).
        nodes: every registered node, GPUs carrying committed usage (``Store.list_nodes``).
        types: the policy's type table; ``resolve`` maps a spec to its row.
        now_s: wall-clock time of the round, s.
        stale_s: heartbeat age beyond which a node gets no new placements.
        time_scale: policy clock = wall x this.
        max_tenants: tenant slots per GPU ``K``.
        observed: job id -> (normalised throughput its node agents last reported for its current placement,
            vs its isolated speed in its shape; the co-tenant job ids at that measurement). It becomes
            ``JobTable.observed_norm`` of the placed job when those co-tenants are the ones it has now (a
            reading taken before a tenant came or went describes another situation); else NaN.
        demand_rps: inference job id -> its demand forecast from measured reports, req/s (``demand.History``);
            a service without one is sized to the rate its spec declares.
    """
    ts = time_scale
    usable = sorted((n for n in nodes if node_fresh(n, now_s, stale_s)), key=lambda n: n.node_id)
    gpu_keys: list[tuple[str, int]] = []
    mem, gtype = [], []
    for n in usable:
        for g in sorted(n.gpus, key=lambda g: g.index):
            if g.healthy:
                gpu_keys.append((n.node_id, g.index))
                mem.append(g.mem_total_mib)
                gtype.append(g.gpu_type)
    free: dict[tuple[str, int], list[int]] = {}
    for n in nodes:
        for g in n.gpus:
            cap_share, cap_mem = (FULL_GPU_SHARE_UNITS, g.mem_total_mib) if g.healthy else (0, 0)
            free[(n.node_id, g.index)] = [cap_share - share_units(g.allocated_share_pct), cap_mem - g.allocated_mem_mib]
    row_of_gpu = {k: i for i, k in enumerate(gpu_keys)}
    placed = [j for j in jobs if j.state in (JobState.PLACED, JobState.RUNNING) and j.placement is not None]
    # a queued job none of whose declared shapes fits any GPU (memory, type) stays out of the round: planned anyway,
    # it would hold GPUs on paper that its placement then cannot get, every round, and keep other jobs off them
    kinds = sorted(set(zip(mem, gtype)))
    within = {j.job_id: shapes_within(j.spec, kinds) for j in jobs if j.state is JobState.PENDING}
    pending = sorted((j for j in jobs if j.state is JobState.PENDING and (within[j.job_id] or not j.spec.shapes)),
                     key=lambda j: (j.submitted_at_s, j.job_id))
    rows = placed + pending
    N, G, K = len(rows), len(gpu_keys), max_tenants
    kind = np.array([INFERENCE if j.spec.kind is JobKind.INFERENCE else TRAINING for j in rows], np.int8)
    type_idx = np.array([resolve(j.spec) for j in rows], np.int64)
    num_gpus = np.array([spec_num_gpus(j.spec) for j in rows], np.int64)
    iso = np.array([isolated_rate(j.spec, types, int(t)) for j, t in zip(rows, type_idx, strict=True)], float)
    solo = types.solo_util[type_idx].astype(float) if N else np.zeros(0)
    load = np.full(N, np.nan)
    lowered = False  # a declaring job's utilisation lowered below its type's (JobTable.type_util)
    for r, j in enumerate(rows):
        if kind[r] == INFERENCE:
            load[r] = inference_load(j.spec, iso[r], (demand_rps or {}).get(j.job_id))
            solo[r] = load[r]
        elif j.spec.shapes:  # MPS caps a declaring job at its shares: its speed is read relative to its best one
            cap = declared_util_cap(j.spec.shapes)
            lowered |= cap < solo[r]
            solo[r] = min(solo[r], cap)
    type_util = np.where(kind == TRAINING, types.solo_util[type_idx], solo) if lowered else None
    share = np.zeros(N)
    limit = np.zeros(N)  # a placed job's MPS limit: its shape's share (100 % for training its share limits nothing)
    gpus: list = [None] * N
    gpu_job = np.full((G, K), -1, np.int64)
    gpu_share = np.zeros((G, K))
    attained = np.zeros(N)
    last_change = np.zeros(N)
    queued_since = np.zeros(N)
    remaining = np.full(N, np.nan)
    for r, j in enumerate(rows):
        done_s = j.progress_steps / float(iso[r]) if iso[r] > 0 else 0.0  # isolated-equivalent seconds already served
        attained[r] = num_gpus[r] * done_s
        if kind[r] == TRAINING and j.spec.training is not None and iso[r] > 0:
            remaining[r] = max(0.0, j.spec.training.total_steps - j.progress_steps) / float(iso[r])
        p = j.placement
        if p is None:
            queued_since[r] = (j.queued_at_s or j.updated_at_s or j.submitted_at_s) * ts  # a reason update is no requeue
            continue
        since = p.committed_at_s * ts
        last_change[r] = max(since, p.resized_at_s * ts)  # an in-place resize is a change, not a restart
        attained[r] += num_gpus[r] * max(0.0, now_s * ts - since)
        mine = []
        for s in p.slices:
            g = row_of_gpu.get((s.node_id, s.gpu_index))
            if g is None:
                continue
            slots = np.flatnonzero(gpu_job[g] < 0)
            if len(slots) == 0:
                raise ValueError(f"GPU {s.node_id}:{s.gpu_index} holds more than {K} tenants")
            gpu_job[g, slots[0]] = r
            gpu_share[g, slots[0]] = s.compute_share_pct
            mine.append(g)
        share[r] = p.slices[0].compute_share_pct if p.slices else 0.0
        limit[r] = p.shape.compute_share_pct if kind[r] == TRAINING else share[r]  # its MPS limit (make_placement)
        gpus[r] = np.array(mine, np.int64)
    running = np.array([r for r in range(len(placed)) if gpus[r] is not None and len(gpus[r])], np.int64)
    # the jobs' constraints travel with the view, and every policy honours them: declared shapes (a declaring
    # job is planned in them only), the gang sizes each job allows, the GPUs of the nodes a job is pinned to
    # a queued job is planned in the declared shapes some GPU has the memory for, on the GPUs with that memory
    declared = tuple(tuple(j.spec.shapes) if r < len(placed) else within[j.job_id] for r, j in enumerate(rows))
    kind_of_gpu = np.array([kinds.index(k) for k in zip(mem, gtype)], np.int64)  # (few kinds: list lookups are cheap)
    pinned = {}
    for r, j in enumerate(rows):
        mask = np.array([n in j.spec.allowed_nodes for n, _ in gpu_keys], bool) if j.spec.allowed_nodes else None
        if r >= len(placed) and declared[r]:  # a queued declaring job: only the GPUs some declared shape fits
            hosts = np.array([any(shape_fits(s, k) for s in declared[r]) for k in kinds], bool)[kind_of_gpu]
            if not hosts.all():
                mask = hosts if mask is None else mask & hosts
        if mask is not None:
            pinned[r] = mask
    table = DeclaredJobTable(kind=kind, type_idx=type_idx, num_gpus=num_gpus,
                     arrival_s=np.array([j.submitted_at_s * ts for j in rows], float),
                     priority=np.array([priority_weight(j.spec.priority) for j in rows], float),
                     attained_gpu_s=attained, share_pct=share, solo_util=solo, load_forecast=load, gpus=gpus,
                     restarts=np.array([j.restarts for j in rows], np.int64), queued_since_s=queued_since,
                     remaining_est_s=remaining, last_change_s=last_change,
                     observed_norm=_observed_pace(_observed_norm(rows, gpus, gpu_job, observed or {}), kind, limit,
                                                  solo if type_util is None else type_util),
                     allowed_gpus=tuple(pinned.get(r) for r in range(N)) if pinned else None,
                     gang_sizes=tuple(tuple(sorted(allowed_gang_sizes(j.spec))) for j in rows),
                     job_ids=tuple(j.job_id for j in rows), declared=declared, any_declared=any(declared),
                     type_util=type_util, limited=(kind == TRAINING) & (limit > 0) & (limit < 100.0))
    view = ClusterView(now_s=now_s * ts, gpu_job=gpu_job, gpu_share=gpu_share, jobs=table,
                       pending=np.arange(len(placed), N, dtype=np.int64), running=running, types=types,
                       topology=Topology.from_gpu_node([n for n, _ in gpu_keys]))
    _freeze(view)
    return view, ViewIndex(rows, gpu_keys, np.array(mem, np.int64), gtype, iso, free)


def _freeze(view: ClusterView) -> None:
    """Make every array of ``view`` read-only: a policy writing into what it sees fails instead of corrupting
    the round's own state."""
    jobs, topo = view.jobs, view.topology
    arrays = [view.gpu_job, view.gpu_share, view.pending, view.running, topo.gpu_node, topo.node_start,
              topo.node_size, *(g for g in jobs.gpus if g is not None),
              *(m for m in jobs.allowed_gpus or () if m is not None)]
    arrays += [getattr(jobs, f.name) for f in fields(JobTable) if isinstance(getattr(jobs, f.name), np.ndarray)]
    for a in arrays:
        a.setflags(write=False)


def _observed_norm(rows: Sequence[Job], gpus: list, gpu_job: np.ndarray,
                   observed: Mapping[str, tuple[float, Sequence[str]]]) -> np.ndarray:
    """[N] ``JobTable.observed_norm``: each placed job's reading where its co-tenants are still those it was
    measured with (see :func:`build_view`)."""
    out = np.full(len(rows), np.nan)
    for r, job in enumerate(rows):
        seen = observed.get(job.job_id)
        if seen is None or gpus[r] is None or not len(gpus[r]):
            continue
        now = {rows[int(o)].job_id for o in gpu_job[gpus[r]].ravel() if o >= 0 and o != r}
        if now == set(seen[1]):
            out[r] = float(seen[0])
    return out


def _observed_pace(reading: np.ndarray, kind: np.ndarray, share: np.ndarray, util: np.ndarray) -> np.ndarray:
    """Agents' readings (speed against the job's own shape) as the pace ``JobTable.observed_norm`` means, the
    simulator's: a training job its MPS limit (``share``: the placement's shape) caps (``share_speed(share, its
    type's utilisation) < 1``) runs at its pace below the cap, so ``pace = reading x cap``; a reading at its full
    shape speed says only that its pace is at least the cap, so it is left out (NaN)."""
    cap = np.where(kind == TRAINING, share_speed(share, np.maximum(util, 1e-6)), 1.0)
    capped = cap < 1.0 - 1e-9
    if not (capped & np.isfinite(reading)).any():
        return reading
    return np.where(capped, np.where(reading < 1.0 - 1e-9, reading * cap, np.nan), reading)


# --------------------------------------------------------------------------------------------------
# 3. Decision -> store operations


@dataclass
class Plan:
    """Store operations of one round, in the order they are applied."""

    preempt: list[Job] = field(default_factory=list)  # release_job(PENDING, PREEMPTED)
    resize: list[tuple[Job, Placement]] = field(default_factory=list)  # release_job(PENDING, RESIZED), then re-place
    # inference services given a new share on the same GPUs while they keep serving (Store.resize_in_place), after
    # the releases (a co-tenant relaunched smaller frees the share a growing service takes) and before the commit
    in_place: list[tuple[Job, Placement]] = field(default_factory=list)
    # running services moving to other GPUs, make-before-break (Store.move_services): the old slices stay booked
    # and serving until the new replica runs; a move that does not fit is dropped and the service stays put
    move: list[tuple[Job, Placement]] = field(default_factory=list)
    place: list[tuple[Job, Placement]] = field(default_factory=list)  # one commit_placements
    dropped: list[tuple[str, str]] = field(default_factory=list)  # (job id, why) decisions not applied
    # (job id, why) placements on GPUs a pod being evicted still holds: not applied this round, expected to wait
    waiting: list[tuple[str, str]] = field(default_factory=list)
    # Kubernetes pod jobs the decision preempts, resizes or moves, with an owner that recreates the pod:
    # (job, PREEMPTED or RESIZED: what the policy meant, why). Each gets reason EVICTION_REQUESTED (one fenced
    # Store.update_jobs batch) and keeps its placement and slices until its pod is gone
    evict: list[tuple[Job, StateReason, str]] = field(default_factory=list)


BARE_POD_WHY = "bare pod: never preempted"  # why a decision to preempt, resize or move a pod without owner is dropped


def make_placement(job: Job, slices_on: Sequence[tuple[str, int, int, str]], share_pct: float, iso_rate: float,
                   solo_util: float = 1.0, shape_index: int | None = None, limited: bool = True) -> Placement | None:
    """A placement of ``job`` with ``share_pct`` on ``slices_on`` = [(node id, GPU index, GPU MiB, GPU type)].

    A job that declares shapes (``JobSpec.shapes``) runs in one of them exactly: the declared shape
    ``shape_index`` (default: the first declared on ``len(slices_on)`` GPUs with ``share_pct``), whose share
    and memory every slice gets and whose index the placement names (an index into the *declared* list).
    None when it declares no such shape (the decision must not be applied), or when ``shape_index`` is not
    one. Memory is the declared MiB exactly, never more: it is the pinned limit the node agent sets
    (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``) and what the GPU's committed memory counts, so a declared shape
    leaves the other tenants exactly the room it says it does.

    A job without declared shapes runs in the policy's own shape: memory per GPU is the share of the GPU's
    memory (``share x memory``, as the policy's shapes define it) and the shape's throughput is the policy's
    model of isolated speed under that share (``share_speed``), which the node agent measures against. The
    shape's compute share is the MPS limit the node agent launches it with: its share where it is ``limited``
    (next to a service: :func:`elastico.coloc.rates.limited_slots`); 100 % for a training job that is not (its
    slices still book its share).
    """
    n = len(slices_on)
    if job.spec.shapes:
        fit = declared_matches(job.spec.shapes, n, share_pct)
        idx = fit[0] if shape_index is None and fit else shape_index
        if idx is None or idx not in fit:
            return None
        shape = job.spec.shapes[idx]
        slices = tuple(GpuSlice(node, gpu, float(shape.compute_share_pct), int(shape.mem_mib)) for node, gpu, _, _ in slices_on)
        return Placement(job_id=job.job_id, shape_index=idx, shape=shape, slices=slices)
    idx = SHARES_PCT.index(int(share_pct)) if share_pct in SHARES_PCT else 0
    mem = [int(m * share_pct // 100) for _, _, m, _ in slices_on]
    limit = 100.0 if not limited and job.spec.kind is JobKind.TRAINING else float(share_pct)
    speed = float(share_speed(limit, max(solo_util, 1e-6))) if math.isfinite(iso_rate) else 0.0
    shape = Shape(num_gpus=n, compute_share_pct=limit, mem_mib=min(mem), batch_size=job.spec.batch_size,
                  gpu_type=slices_on[0][3] if slices_on else "", throughput=iso_rate * speed if iso_rate > 0 else 0.0)
    slices = tuple(GpuSlice(node, gpu, float(share_pct), int(m)) for (node, gpu, _, _), m in zip(slices_on, mem, strict=True))
    return Placement(job_id=job.job_id, shape_index=idx, shape=shape, slices=slices)


def _candidates(job: Job, slices_on: Sequence[tuple[str, int, int, str]], share_pct: float, iso_rate: float,
                solo_util: float, limited: bool = True) -> list[Placement]:
    """The placements ``job`` may get for one decision, preferred first: its declared shapes on these GPUs with
    this share, in declared order (several may differ in memory only), or the policy's own shape; ``[]`` when
    it declares shapes and none of them is this one."""
    if not job.spec.shapes:
        return [make_placement(job, slices_on, share_pct, iso_rate, solo_util, limited=limited)]
    return [make_placement(job, slices_on, share_pct, iso_rate, solo_util, i)
            for i in declared_matches(job.spec.shapes, len(slices_on), share_pct)
            if all(gpu_type_matches(job.spec.shapes[i].gpu_type, t) for *_, t in slices_on)]


def translate(decision: Decision, view: ClusterView, index: ViewIndex, unlimited_training: bool = False) -> Plan:
    """Turn the policy's rows into store operations: what the decision contract accepts, re-checked against
    committed usage.

    The decision first goes through :func:`contract.check` (rows, pending, GPUs allowed for the job, gang
    sizes, topology, tenant slots, shares, declared shapes); what it rejects is dropped with its reason. Then
    preemptions free their slices; resizes follow, shrinks first: a training job's is a release plus a new
    placement on the same GPUs (its MPS limit is fixed at launch: it restarts from its checkpoint), an inference
    service's is in place (``Plan.in_place``: same process, same memory; its co-tenants' limits protect it), and
    a running service preempted and placed elsewhere moves make-before-break (``Plan.move``: its slices stay
    booked, and its replica serving, until the new one runs; a move that does not fit leaves it where it is);
    placements are kept only if every slice fits what is left of its GPU's committed share
    and memory (the store checks again atomically, all or nothing: a decision that cannot fit is dropped here
    so that it cannot veto the rest of the round). A placement of a job the decision also preempts is a
    resize (a relaunch on other GPUs) when it stays on the job's nodes; one onto another node is a preemption
    now and a placement once the current run is reported stopped (``Plan.waiting`` says so).

    A Kubernetes pod's job is never released by a decision (its slices are freed only once its pod is gone,
    :func:`transitions`): preempting, resizing or moving one requests its eviction instead (``Plan.evict``, once:
    a job already EVICTION_REQUESTED is left alone) when its pod has an owner that recreates it, and is dropped
    (:data:`BARE_POD_WHY`) for a bare pod. Either way its slices stay booked here, so what the decision planned
    on them fails the fit re-check and is dropped, and its own placement in the decision is not applied (its
    owner's new pod is a new job).

    With ``unlimited_training`` (the ElastiCo policy's), a training job placed on GPUs that host no service once
    the decision applies runs with no compute limit (:func:`make_placement`); else every share is a limit.

    A job that declares shapes gets exactly one of them (:func:`make_placement`). The policies plan compute
    share and tenant slots, not memory: a declared shape whose memory does not fit the GPUs the policy chose
    goes to GPUs that are empty (nothing committed there, no placement of this decision aimed at them), among
    the job's allowed ones, where it fits, if there are any, else it waits -- it is never shrunk to what is
    left.
    """
    plan = Plan()
    decision, rejected = check(decision, view)
    plan.dropped.extend((index.jobs[r].job_id if isinstance(r, int) and 0 <= r < len(index.jobs) else f"row {r!r}", why)
                        for r, why in rejected)
    free = {k: list(v) for k, v in index.free.items()}

    def release(job: Job) -> None:
        for s in job.placement.slices if job.placement else ():
            f = free.setdefault((s.node_id, s.gpu_index), [0, 0])
            f[0] += share_units(s.compute_share_pct)
            f[1] += s.mem_mib

    def fits(p: Placement) -> bool:
        need: dict[tuple[str, int], list[int]] = {}
        for s in p.slices:
            n = need.setdefault((s.node_id, s.gpu_index), [0, 0])
            n[0] += share_units(s.compute_share_pct)
            n[1] += s.mem_mib
        return all(k in free and free[k][0] >= v[0] and free[k][1] >= v[1] for k, v in need.items())

    def take(p: Placement) -> None:
        for s in p.slices:
            free[(s.node_id, s.gpu_index)][0] -= share_units(s.compute_share_pct)
            free[(s.node_id, s.gpu_index)][1] -= s.mem_mib

    held: set[int] = set()  # pod jobs' rows: their slices stay booked and no placement of theirs is applied

    def hold(r: int, meant: StateReason, why: str) -> None:
        """Pod job row ``r`` preempted/resized/moved: an eviction request (or a drop for a bare pod); slices kept."""
        job = index.jobs[r]
        held.add(r)
        if not pod_evictable(job.spec):
            plan.dropped.append((job.job_id, BARE_POD_WHY))
        elif job.reason is not StateReason.EVICTION_REQUESTED:
            plan.evict.append((job, meant, why))

    gone: set[int] = set()
    replaced = {int(r): float(sh) for r, _, sh in decision.place}
    # GPU rows that host a service once the decision applies: a training job launched there runs under its share
    # as its MPS limit (make_placement); a moving service keeps its old slices until its new replica runs
    kinds = view.jobs.kind
    stopped = {int(r) for r in decision.preempt} - {int(r) for r, _, _ in decision.place if kinds[int(r)] == INFERENCE}
    occ = view.gpu_job >= 0
    svc_slot = occ & (kinds[np.where(occ, view.gpu_job, 0)] == INFERENCE) & ~np.isin(view.gpu_job, list(stopped))
    service_rows = set(np.flatnonzero(svc_slot.any(axis=1)).tolist())
    service_rows |= {int(g) for r, g_rows, _ in decision.place if kinds[int(r)] == INFERENCE for g in np.atleast_1d(g_rows)}
    moving: set[int] = set()  # services preempted and placed again: they move, keeping their slices meanwhile
    for r in decision.preempt:
        job = index.jobs[r]
        if is_pod_job(job.spec):
            sh = replaced.get(r)
            if sh is None:
                hold(r, StateReason.PREEMPTED, "preempted by the policy")
            elif job.placement is not None and abs(sh - job.placement.slices[0].compute_share_pct) > 1e-9:
                hold(r, StateReason.RESIZED, f"resized to {sh:g}%")
            else:
                hold(r, StateReason.PREEMPTED, "moved by the policy to other GPUs")
            continue
        gone.add(r)
        if job.spec.kind is JobKind.INFERENCE and job.state is JobState.RUNNING and job.draining is None and r in replaced:
            moving.add(r)
            continue
        plan.preempt.append(job)
        release(job)
    # shrinks before growths: what a shrinking job frees, a growing one on the same GPU may take
    for r, sh in sorted(decision.resize, key=lambda rs: rs[1] - index.jobs[rs[0]].placement.slices[0].compute_share_pct):
        job = index.jobs[r]
        if is_pod_job(job.spec):
            hold(r, StateReason.RESIZED, f"resized to {sh:g}%")
            continue
        options = _candidates(job, [(s.node_id, s.gpu_index, _mem_of(index, s.node_id, s.gpu_index, s.mem_mib, s.compute_share_pct), _type_of(index, s.node_id, s.gpu_index))
                                    for s in job.placement.slices], sh, float(index.iso_rate[r]), float(view.jobs.solo_util[r]),
                              limited=not unlimited_training or bool(set(np.atleast_1d(view.jobs.gpus[r]).tolist()) & service_rows))
        if not options:
            plan.dropped.append((job.job_id, f"resize to {sh}% is not among the job's declared shapes"))
            continue
        service = job.spec.kind is JobKind.INFERENCE
        if service:  # resized in place: the memory it launched with stays its memory (and its pinned limit)
            options = [_keep_memory(o, job.placement) for o in options]
        release(job)
        p = next((o for o in options if fits(o)), None)
        if p is not None:
            take(p)
            (plan.in_place if service else plan.resize).append((job, p))
        else:
            plan.dropped.append((job.job_id, f"resize to {sh}% does not fit"))
            for sl in job.placement.slices:  # it keeps its slices
                free[(sl.node_id, sl.gpu_index)][0] -= share_units(sl.compute_share_pct)
                free[(sl.node_id, sl.gpu_index)][1] -= sl.mem_mib
    planned = {int(g) for _, g_rows, _ in decision.place for g in np.atleast_1d(g_rows)}  # GPUs the decision aims at
    for r, g_rows, sh in decision.place:
        r = int(r)
        if r in held:  # a pod job is placed again only as its owner's new pod, a new job
            continue
        job = index.jobs[r]
        g_rows = [int(g) for g in np.atleast_1d(g_rows)]
        n_gpus = len(g_rows)

        def on(rows: Sequence[int], job: Job = job, r: int = r, sh: float = float(sh)) -> list[Placement]:
            return _candidates(job, [(*index.gpus[g], int(index.gpu_mem_mib[g]), index.gpu_type[g]) for g in rows], sh,
                               float(index.iso_rate[r]), float(view.jobs.solo_util[r]),
                               limited=not unlimited_training or bool(set(rows) & service_rows))

        p = next((o for o in on(g_rows) if fits(o)), None)
        if p is not None and r in gone and r not in moving and _nodes(p) != _nodes(job.placement):
            # a relaunch on another node waits until its current run is reported stopped (:func:`still_running`):
            # that node's agent stops it, this one's would start it, and nothing orders the two
            plan.waiting.append((job.job_id, "relaunches on another node once its current run has stopped"))
            continue
        if p is None and job.spec.shapes:  # e.g. its declared memory does not fit there: empty GPUs where it does
            g_rows = _empty_gpus_for(job, r, n_gpus, float(sh), view, index, free, planned)
            p = next((o for o in on(g_rows) if fits(o)), None) if g_rows else None
        if p is None:
            aimed = {index.gpus[g] for g in g_rows}
            evicting = sorted({index.jobs[h].job_id for h in held if pod_evictable(index.jobs[h].spec)
                               for s in index.jobs[h].placement.slices if (s.node_id, s.gpu_index) in aimed})
            if evicting:
                plan.waiting.append((job.job_id, f"waits for the eviction of pod job {', '.join(evicting)}"))
            else:
                plan.dropped.append((job.job_id, f"{n_gpus} x {sh}% does not fit committed capacity"))
            continue
        take(p)
        if r in moving:
            plan.move.append((job, p))
        elif r in gone:  # preempted and re-placed in one round: a resize
            plan.preempt = [j for j in plan.preempt if j.job_id != job.job_id]
            plan.resize.append((job, p))
        else:
            plan.place.append((job, p))
    return plan


def _nodes(p: Placement | None) -> set[str]:
    return {s.node_id for s in p.slices} if p is not None else set()


def still_running(jobs: Sequence[Job], nodes: Mapping[str, NodeInfo], workloads: Mapping[str, Mapping[str, Workload]],
                  now_s: float, lost_after_s: float, watched_since_s: float = -math.inf) -> set[str]:
    """Ids of PENDING jobs that an agent of a node not lost (:func:`node_lost`) still reports starting or running:
    an earlier placement whose stop is not done yet. They are kept out of the round's view, so that no job is
    placed while it runs elsewhere; a same-node relaunch needs no wait (the agent stops before it starts), a
    relaunch on another node does (:func:`translate`)."""
    pending = {j.job_id for j in jobs if j.state is JobState.PENDING}
    return {job_id for node_id, ws in workloads.items()
            if not node_lost(nodes.get(node_id), now_s, lost_after_s, watched_since_s)
            for job_id, w in ws.items() if job_id in pending and w.status in ("starting", "running")}


def _keep_memory(p: Placement, current: Placement) -> Placement:
    """``p`` with each slice's memory (and the shape's) as in ``current``, the placement the job runs in now."""
    mem = {(s.node_id, s.gpu_index): s.mem_mib for s in current.slices}
    slices = tuple(replace(s, mem_mib=mem.get((s.node_id, s.gpu_index), s.mem_mib)) for s in p.slices)
    return replace(p, slices=slices, shape=replace(p.shape, mem_mib=min(s.mem_mib for s in slices)))


def _empty_gpus_for(job: Job, row: int, n: int, share_pct: float, view: ClusterView, index: ViewIndex,
                    free: Mapping[tuple[str, int], list[int]], planned: set[int]) -> list[int]:
    """GPU rows for ``job`` (view row ``row``)'s declared shape on ``n`` GPUs at ``share_pct`` among its allowed
    GPUs that are empty -- no tenant committed or in the view, none of the decision's placements aimed at them
    -- and have its memory and GPU type (the first node with room, lowest GPUs first, keeping the topology); ``[]`` when
    there are not enough."""
    shapes = [s for s in job.spec.shapes if s.num_gpus == n and abs(s.compute_share_pct - share_pct) < 1e-6]
    if not shapes:
        return []
    ok = np.array([g not in planned and bool((view.gpu_job[g] < 0).all())
                   and any(shape_fits(s, (int(index.gpu_mem_mib[g]), index.gpu_type[g])) for s in shapes)
                   and free.get(k) == [FULL_GPU_SHARE_UNITS, int(index.gpu_mem_mib[g])] for g, k in enumerate(index.gpus)], bool)
    g = pick_gang(np.zeros(len(ok)), ok, n, view.topo, allowed=gpu_mask(view.jobs, row)) if len(ok) else None
    return [] if g is None else [int(x) for x in g]


def _mem_of(index: ViewIndex, node: str, gpu: int, slice_mem: int, share_pct: float) -> int:
    for k, m in zip(index.gpus, index.gpu_mem_mib, strict=True):
        if k == (node, gpu):
            return int(m)
    return int(slice_mem * 100 / max(share_pct, 1e-9))


def _type_of(index: ViewIndex, node: str, gpu: int) -> str:
    for k, t in zip(index.gpus, index.gpu_type, strict=True):
        if k == (node, gpu):
            return t
    return ""
