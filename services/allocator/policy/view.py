"""What a policy sees in one scheduling round, and what it answers. Plain arrays, no I/O.

Why arrays and not one dataclass per job: a round at 512 GPUs may look at thousands of queued jobs and
the simulator runs tens of thousands of rounds; struct-of-arrays keeps every policy vectorised. The live
allocator builds the same view from its domain objects (``elastico.domain.Job``) once per round.

Every array of a view is read-only (both front ends set ``writeable=False``); policies plan on their own
copies (:meth:`ClusterView.scratch`).

Whatever constrains a decision is in the view, and every policy honours it: the node topology
(:class:`Topology`), the GPUs a job may use (``JobTable.allowed_gpus``), the GPU counts it may run at
(``JobTable.gang_sizes``) and the shapes it declares (:class:`services.allocator.policy.shapes.DeclaredJobTable`).
Topology: a gang that fits one node runs inside one node; a larger gang takes whole nodes plus at most one
partial node, as Philly-era schedulers place them. Every policy picks gangs through
:func:`services.allocator.policy.placement.pick_gang`, which keeps that rule and a job's allowed GPUs, and both
front ends apply a decision only as far as :func:`services.allocator.policy.contract.check` accepts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from elastico.coloc.profiles import TypeTable
from elastico.coloc.rates import slot_sum

TRAINING = 0  # value of ``JobTable.kind`` for training jobs
INFERENCE = 1  # value of ``JobTable.kind`` for inference services


@dataclass(frozen=True)
class JobTable:
    """Every job the round may touch, indexed by an integer job id (row)."""

    kind: np.ndarray  # [N] int8, TRAINING or INFERENCE
    type_idx: np.ndarray  # [N] int, row of TypeTable (inference services: TypeTable.inference_index)
    num_gpus: np.ndarray  # [N] int, gang size (inference: 1)
    arrival_s: np.ndarray  # [N] float, submission time, s
    priority: np.ndarray  # [N] float, operator priority weight (>= 0; 1 = normal)
    attained_gpu_s: np.ndarray  # [N] float, GPU-seconds of service received so far (GPUs x wall seconds)
    share_pct: np.ndarray  # [N] float, current MPS share per GPU while running, percent (0 otherwise)
    solo_util: np.ndarray  # [N] float, solo utilisation (training: of its type; inference: current load)
    load_forecast: np.ndarray  # [N] float, inference: forecast load (fraction of a full GPU); NaN for training
    gpus: list  # [N] np.ndarray of GPU indices while running, else None
    restarts: np.ndarray  # [N] int, restarts so far
    queued_since_s: np.ndarray  # [N] float, when the job last entered the queue, s
    remaining_est_s: np.ndarray  # [N] float, estimated remaining isolated run time, s (NaN = unknown)
    last_change_s: np.ndarray  # [N] float, when the job was last placed or resized, s
    # [N] float, interference factor a running job is observed to run at next to its co-tenants: its pace against
    # its isolated speed (the simulator's; live, the node agents' ``norm_throughput``, measured against its shape,
    # times its share's cap where the cap binds: ``plan._observed_pace``), NaN = alone or unknown
    observed_norm: np.ndarray | None = None
    # [N] the GPUs each job may run on, as a read-only [G] bool mask over the view's GPU rows, or None where it
    # may use any (a pod kube-scheduler bound to a node: that node's GPUs); None = no job is restricted (the
    # simulator). Per job rather than [N, G]: pinned jobs are few, and an unrestricted one costs nothing.
    allowed_gpus: tuple | None = None
    # [N] the GPU counts each job may run at, always including its request ``num_gpus`` (a job declaring shapes:
    # its declared counts; the live allocator's others: their request); None = every job may run at the
    # policy's own GPU-count shapes (training: ``shapes.allowed_counts`` of its type; a service: 1), the simulator
    gang_sizes: tuple[tuple[int, ...], ...] | None = None
    # [N] each row's job identity, stable across rounds: the live allocator's job ids (its rows are positions,
    # which move as jobs come and go); None = the row is the identity (the simulator)
    job_ids: tuple[str, ...] | None = None
    # [N] float, a training job's type's solo utilisation where ``solo_util`` is lowered to what its declared shapes
    # let it reach (the live allocator): what its share's cap on its activity is measured against, so a job at 1 %
    # of a GPU steals 1 % of its type's time (``rates.compose_capped``); None = ``solo_util`` (the simulator)
    type_util: np.ndarray | None = None
    # [N] bool, read for running training jobs only: the job's share is the MPS compute limit it launched with
    # (next to a service, or every share where training is never unlimited), which stays when the service leaves;
    # None = not known: a share is read as a limit next to a service only (the simulator and the live allocator
    # both give it)
    limited: np.ndarray | None = None

    def activity_util(self, j: int) -> float:
        """Solo utilisation job ``j``'s activity under a share is measured against (``type_util``)."""
        return float((self.solo_util if self.type_util is None else self.type_util)[j])


@dataclass(frozen=True, eq=False)
class Topology:
    """Which node each GPU belongs to; a node's GPUs are contiguous rows, nodes in ascending order."""

    gpu_node: np.ndarray  # [G] int, node of each GPU (non-decreasing)
    node_start: np.ndarray  # [Nn] int, first GPU row of each node
    node_size: np.ndarray  # [Nn] int, GPUs of each node

    @classmethod
    def from_gpu_node(cls, gpu_node) -> Topology:
        """Topology from each GPU's node label (labels of one node must be contiguous rows).

        Raises:
            ValueError: a node's GPUs are not contiguous.
        """
        lab = np.asarray(gpu_node)
        if len(lab) == 0:
            z = np.zeros(0, np.int64)
            return cls(z, z, z)
        change = np.flatnonzero(lab[1:] != lab[:-1]) + 1
        start = np.concatenate([[0], change]).astype(np.int64)
        if len(set(lab[start].tolist())) != len(start):
            raise ValueError("topology: the GPUs of a node must be contiguous rows")
        size = np.diff(np.concatenate([start, [len(lab)]])).astype(np.int64)
        return cls(np.repeat(np.arange(len(start), dtype=np.int64), size), start, size)

    @classmethod
    def uniform(cls, gpus: int, node_gpus: int) -> Topology:
        """``gpus`` GPUs in nodes of ``node_gpus`` (the last node smaller when it does not divide)."""
        return cls.from_gpu_node(np.arange(gpus) // max(1, int(node_gpus)))

    @cached_property
    def num_nodes(self) -> int:
        return int(len(self.node_size))

    @cached_property
    def max_node(self) -> int:
        """GPUs of the largest node: a gang up to this size must stay inside one node."""
        return int(self.node_size.max()) if len(self.node_size) else 0

    @cached_property
    def flat(self) -> bool:
        """One node holds every GPU: the topology constrains nothing."""
        return len(self.node_size) <= 1

    def gang_ok(self, gpus) -> bool:
        """True when a gang on ``gpus`` keeps the rule: inside one node if it fits one, else whole nodes plus
        at most one partial node."""
        g = np.asarray(gpus, np.int64)
        if len(g) <= 1 or self.flat:
            return True
        nodes, counts = np.unique(self.gpu_node[g], return_counts=True)
        if len(g) <= self.max_node:
            return len(nodes) == 1
        return int((counts < self.node_size[nodes]).sum()) <= 1


@dataclass(frozen=True)
class ClusterView:
    """The cluster at one instant, as a scheduling round sees it."""

    now_s: float  # current time, s (virtual in the simulator, wall clock live)
    gpu_job: np.ndarray  # [G, K] int, job id of each tenant slot, -1 = empty
    gpu_share: np.ndarray  # [G, K] float, MPS share of each tenant slot, percent (0 = empty)
    jobs: JobTable  # all jobs, see JobTable
    pending: np.ndarray  # [P] int, queued job ids in submission order
    running: np.ndarray  # [R] int, running job ids
    types: TypeTable  # job-type profiles
    topology: Topology | None = None  # GPUs' nodes; None = a flat pool (one node)

    @cached_property
    def topo(self) -> Topology:
        """The view's topology (a flat one-node pool when none was given)."""
        return self.topology if self.topology is not None else Topology.uniform(self.num_gpus, max(1, self.num_gpus))

    @cached_property
    def held(self) -> np.ndarray:
        """[N] GPUs each job holds in this view (0 when not running); computed once, as the view is a snapshot."""
        held = self.gpu_job[self.gpu_job >= 0]
        return np.bincount(held, minlength=len(self.jobs.kind)) if len(held) else np.zeros(len(self.jobs.kind), np.int64)

    @property
    def num_gpus(self) -> int:
        """Number of GPUs ``G``."""
        return int(self.gpu_job.shape[0])

    @property
    def max_tenants(self) -> int:
        """Tenant slots per GPU ``K``."""
        return int(self.gpu_job.shape[1])

    def scratch(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of (gpu_job, gpu_share) a policy may modify while planning a round."""
        return self.gpu_job.copy(), self.gpu_share.copy()


@dataclass
class Decision:
    """A round's answer; the caller applies preemptions, then resizes, then placements, as far as
    :func:`services.allocator.policy.contract.check` accepts them."""

    preempt: list[int] = field(default_factory=list)  # job ids to stop (training: requeued, progress kept)
    resize: list[tuple[int, float]] = field(default_factory=list)  # (job id, new share percent) in place
    place: list[tuple[int, np.ndarray, float]] = field(default_factory=list)  # (job id, GPU indices, share %)
    info: dict = field(default_factory=dict)  # diagnostics (solver status, prices, gap)


def gpu_mask(jobs: JobTable, j: int) -> np.ndarray | None:
    """[G] bool mask of the GPUs job ``j`` may run on; None when it may use any (``JobTable.allowed_gpus``)."""
    allowed = jobs.allowed_gpus
    return None if allowed is None else allowed[j]


def read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a`` (its owner keeps writing through ``a``; the view sees every change)."""
    v = a.view()
    v.setflags(write=False)
    return v


#: unsigned integer of K bytes: a GPU's K boolean slots read as one word
_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _slot_fold(mask: np.ndarray, op, empty: bool) -> np.ndarray:
    """[G] ``op`` (``np.logical_or`` / ``np.logical_and``) folded over the slots of a boolean ``[G, K]``
    array, slot by slot (see :func:`slot_sum`); ``empty`` for K = 0. A contiguous row of 1, 2, 4 or 8 slots is
    compared as one word (any: not 0; all: every byte 1)."""
    K = mask.shape[1]
    if K == 0:
        return np.full(mask.shape[0], empty)
    word = _WORD.get(K)
    if word is not None and mask.dtype == np.bool_ and mask.flags.c_contiguous:
        w = mask.view(word)[:, 0]
        return w != 0 if op is np.logical_or else w == word(int.from_bytes(b"\x01" * K, "little"))
    out = mask[:, 0].copy()
    for k in range(1, mask.shape[1]):
        op(out, mask[:, k], out=out)
    return out


def slot_any(mask: np.ndarray) -> np.ndarray:
    """[G] ``mask.any(axis=1)`` of a boolean ``[G, K]`` array, slot by slot (see :func:`slot_sum`)."""
    return _slot_fold(mask, np.logical_or, False)


def slot_all(mask: np.ndarray) -> np.ndarray:
    """[G] ``mask.all(axis=1)`` of a boolean ``[G, K]`` array, slot by slot (see :func:`slot_sum`)."""
    return _slot_fold(mask, np.logical_and, True)


def slot_max(a: np.ndarray) -> np.ndarray:
    """[G] ``a.max(axis=1)`` of a numeric ``[G, K]`` array (K >= 1), slot by slot (see :func:`slot_sum`)."""
    out = a[:, 0].copy()
    for k in range(1, a.shape[1]):
        np.maximum(out, a[:, k], out=out)
    return out


def free_share(gpu_share: np.ndarray) -> np.ndarray:
    """[G] unallocated MPS share per GPU, percent."""
    return 100.0 - slot_sum(gpu_share)


def free_slots(gpu_job: np.ndarray) -> np.ndarray:
    """[G] empty tenant slots per GPU."""
    return (gpu_job < 0).sum(axis=1)


def occupy(gpu_job: np.ndarray, gpu_share: np.ndarray, job: int, gpus: np.ndarray, share_pct: float) -> None:
    """Put ``job`` with ``share_pct`` on each GPU of ``gpus`` (first empty slot) in a planning copy.

    Raises:
        ValueError: a GPU has no empty slot or not enough free share (a policy bug).
    """
    for g in np.atleast_1d(gpus):
        slots = np.flatnonzero(gpu_job[g] < 0)
        if len(slots) == 0 or gpu_share[g].sum() + share_pct > 100.0 + 1e-6:
            raise ValueError(f"GPU {g} cannot take job {job} with share {share_pct}%")
        gpu_job[g, slots[0]] = job
        gpu_share[g, slots[0]] = share_pct


def vacate(gpu_job: np.ndarray, gpu_share: np.ndarray, job: int, gpus: np.ndarray | None = None) -> None:
    """Remove ``job`` from its GPUs in a planning copy."""
    rows = np.atleast_1d(gpus) if gpus is not None else np.flatnonzero((gpu_job == job).any(axis=1))
    sub = gpu_job[rows] == job
    gj = gpu_job[rows]
    gs = gpu_share[rows]
    gj[sub] = -1
    gs[sub] = 0.0
    gpu_job[rows] = gj
    gpu_share[rows] = gs
