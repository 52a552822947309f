"""The allocator's round metrics: what a scheduling round did and saw, onto the Prometheus objects of
:mod:`services.allocator.metrics`.

Kept out of :meth:`Scheduler.round` so that a round reads as its steps; every update a round makes goes
through :class:`RoundMetrics`. The counters of store writes (:meth:`RoundMetrics.writes`) count what the
store accepted even when a later step of the round fails; the gauges and histograms of a round
(:meth:`RoundMetrics.record`) describe completed rounds only.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from elastico.domain import Job, JobState, NodeInfo, StateReason, Workload
from services.allocator import metrics as m
from services.allocator.plan import ViewIndex
from services.allocator.policy import ClusterView
from services.allocator.policy.view import TRAINING

# elastico_allocator_degraded{component} -> how its degradation notes (RoundReport.degraded) begin
DEGRADED_PREFIXES = {"pricer": ("pricer",), "predictor": ("predictor",), "nodes": ("nodes", "node ")}
# how the round's note on one node that is not fresh begins (Scheduler._degradations: "node <id>: <why>: ...")
STALE_NODE_PREFIX = "node "
# predictor drift (elastico_allocator_norm_throughput_error_mean*): the last ERROR_WINDOW errors of co-located
# jobs, none older than ERROR_WINDOW_S seconds of the view's clock, so that the gauges follow the model's
# current accuracy and go NaN (no alert) once no co-located job has been observed for a while
ERROR_WINDOW = 512
ERROR_WINDOW_S = 600.0


@dataclass
class RoundReport:
    """What one round did (returned for tests and the benchmark; also logged and published)."""

    epoch: int
    pending: int = 0
    placed_jobs: int = 0
    placed: list[str] = field(default_factory=list)
    started: int = 0
    released: dict[str, int] = field(default_factory=dict)
    preempted: int = 0
    resized: int = 0
    evictions: dict[str, int] = field(default_factory=dict)  # pod evictions requested, by what the policy meant
    dropped: int = 0
    unschedulable: int = 0  # pending jobs newly marked UNSCHEDULABLE_NOW by this round
    conflict: str = ""
    seconds: float = 0.0
    decide_seconds: float = 0.0
    gap: float | None = None
    degraded: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RoundOutcome:
    """A completed round, as its metrics need it."""

    report: RoundReport
    view: ClusterView  # what the round decided on (before its own placements)
    fresh_nodes: Sequence[NodeInfo]  # nodes with a fresh heartbeat and a ready agent
    observed: Mapping[int, float]  # running view row -> reported normalised throughput (:func:`observed_speeds`)
    predicted: Mapping[int, float]  # those of them sharing a GPU -> predicted (the policy's DecisionReport)
    # inference job id -> (committed share % or 0, forecast req/s or NaN, last p99 ms or NaN, SLO ms)
    services: Mapping[str, tuple[float, float, float, float]] = field(default_factory=dict)
    # StateReason value -> pending jobs with it (:func:`pending_reasons`); None: not known, the gauges are kept
    pending_reasons: Mapping[str, int] | None = None


def pending_reasons(jobs: Iterable[Job]) -> dict[str, int]:
    """StateReason value -> number of PENDING jobs with that reason: why the queue waits (submitted, unschedulable
    now, never schedulable, requeued after a preemption or a lost node, ...)."""
    out: dict[str, int] = {}
    for j in jobs:
        if j.state is JobState.PENDING:
            out[j.reason.value] = out.get(j.reason.value, 0) + 1
    return out


def allocated_ratio(view: ClusterView) -> float:
    """Compute handed out over the view's GPUs (0-1), as the simulator's ``alloc_util`` counts it: each tenant's
    share, but a whole GPU for a training job its share does not limit (``JobTable.limited``: it runs unlimited,
    its share is the slice it books, not what it may use); at most one GPU per GPU."""
    if view.num_gpus == 0:
        return 0.0
    jobs, share = view.gpu_job, view.gpu_share
    limited, used = view.jobs.limited, jobs >= 0
    if limited is not None and used.any():
        rows = np.where(used, jobs, 0)
        unlimited = used & (view.jobs.kind[rows] == TRAINING) & ~limited[rows]
        share = np.where(unlimited, 100.0, share)
    return float(np.minimum(share.sum(axis=1), 100.0).sum() / 100.0 / view.num_gpus)


def effective_utilisation(view: ClusterView, observed: Mapping[int, float], predicted: Mapping[int, float]) -> float:
    """Committed MPS share weighted by each tenant's normalised speed, over the view's GPUs (0-1): the share that
    does isolated-speed work. A tenant's speed is the one its agent reports, else the policy's prediction, else
    1 (its isolated speed in its shape: what a tenant that is alone or not yet measured is counted at)."""
    if view.num_gpus == 0:
        return 0.0
    jobs, share = view.gpu_job, view.gpu_share
    used = jobs >= 0
    speed_of = {j: observed.get(j, predicted.get(j, 1.0)) for j in map(int, np.unique(jobs[used]))}
    speed = np.zeros(share.shape)
    speed[used] = [speed_of[int(j)] for j in jobs[used]]
    per_gpu = np.minimum((share * speed).sum(axis=1), 100.0)
    return float(per_gpu.sum() / 100.0 / view.num_gpus)


def observed_speeds(view: ClusterView, index: ViewIndex, workloads: Mapping[str, Mapping[str, Workload]]) -> dict[int, float]:
    """Running view row -> normalised throughput the agent of the job's first node reports, relative to the
    job's isolated speed *in its shape*: what the predicted-vs-observed metrics compare (the policy predicts
    those of them that share their GPU, :class:`services.allocator.decider.DecisionReport`)."""
    out: dict[int, float] = {}
    for r in view.running:
        job = index.jobs[r]
        slices = job.placement.slices if job.placement is not None else ()
        w = next((workloads.get(s.node_id, {}).get(job.job_id) for s in slices), None)
        if w is not None and w.norm_throughput is not None:
            out[int(r)] = float(w.norm_throughput)
    return out


class RoundMetrics:
    """Updates the allocator's Prometheus metrics from rounds (see module docstring)."""

    def __init__(self) -> None:
        self._services: set[str] = set()  # job ids with per-service series
        self._last: dict[str, tuple[float, float, float, float]] = {}  # what those series were last set to
        self._reasons: set[str] = set()  # reasons with a pending-jobs series
        self._errors: deque[tuple[float, float]] = deque(maxlen=ERROR_WINDOW)  # (view time s, observed - predicted)

    @staticmethod
    def leading(epoch: int | None) -> None:
        """This replica leads with ``epoch`` (None: it does not)."""
        m.IS_LEADER.set(1 if epoch is not None else 0)

    @staticmethod
    def started(epoch: int) -> None:
        """A round with fencing token ``epoch`` starts."""
        m.EPOCH.set(epoch)

    @staticmethod
    def failed(outcome: str) -> None:
        """A round raised: ``stale_epoch`` (a newer leader rejected its writes), ``unavailable`` or ``error``."""
        if outcome == "stale_epoch":
            m.STALE_WRITES.inc()
        m.ROUNDS.labels(outcome).inc()

    @staticmethod
    def writes(rep: RoundReport) -> None:
        """The round's writes the store accepted: releases by reason, pod eviction requests, placements, a
        rejected commit."""
        for reason, n in rep.released.items():
            m.RELEASES.labels(reason).inc(n)
        for reason, n in rep.evictions.items():
            m.EVICTIONS.labels(reason).inc(n)
        if rep.preempted:
            m.RELEASES.labels(StateReason.PREEMPTED.value).inc(rep.preempted)
        if rep.resized:
            m.RELEASES.labels(StateReason.RESIZED.value).inc(rep.resized)
        if rep.placed_jobs:
            m.PLACEMENTS.inc(rep.placed_jobs)
        if rep.conflict:
            m.CONFLICTS.inc()

    def record(self, outcome: RoundOutcome) -> None:
        """Queue (and its reasons), decide time, pricing gap, degradations, node freshness, predicted vs observed
        speeds and their recent error, GPU allocation, effective and SM utilisation, placed jobs, per-service
        series, round time and the round's outcome."""
        rep, view = outcome.report, outcome.view
        m.QUEUE_LENGTH.set(rep.pending)
        if outcome.pending_reasons is not None:
            self._record_reasons(outcome.pending_reasons)
        m.DECIDE_SECONDS.observe(rep.decide_seconds)
        if rep.gap is not None:
            m.PRICING_GAP.set(rep.gap)
        for comp, prefixes in DEGRADED_PREFIXES.items():
            m.DEGRADED.labels(comp).set(1 if any(d.startswith(prefixes) for d in rep.degraded) else 0)
        m.NODES.labels("fresh").set(len(outcome.fresh_nodes))
        m.NODES.labels("stale").set(sum(d.startswith(STALE_NODE_PREFIX) for d in rep.degraded))
        for r, observed in outcome.observed.items():
            predicted = outcome.predicted.get(r)
            if predicted is not None:
                m.PREDICTED_NORM.observe(predicted)
                m.OBSERVED_NORM.observe(observed)
                m.SLOWDOWN_ERROR.observe(observed - predicted)
                self._errors.append((view.now_s, observed - predicted))
        self._record_drift(view.now_s)
        m.GPU_ALLOCATED.set(allocated_ratio(view))
        m.GPU_EFFECTIVE.set(effective_utilisation(view, outcome.observed, outcome.predicted))
        sm = [g.counters.sm_util_pct for n in outcome.fresh_nodes for g in n.gpus if g.counters.sm_util_pct is not None]
        if sm:
            m.GPU_UTILISATION.set(float(np.mean(sm)) / 100.0)
        m.RUNNING_JOBS.set(len(view.running) + rep.placed_jobs)
        self._record_services(outcome.services)
        m.ROUND_SECONDS.observe(rep.seconds)
        m.ROUNDS.labels("conflict" if rep.conflict else "ok").inc()

    def _record_reasons(self, reasons: Mapping[str, int]) -> None:
        """Pending jobs per reason; a reason no pending job has any more reads 0 (its series stays)."""
        for reason in self._reasons | set(reasons):
            m.PENDING_BY_REASON.labels(reason).set(reasons.get(reason, 0))
        self._reasons |= set(reasons)

    def _record_drift(self, now_s: float) -> None:
        """Mean and mean absolute error of the window's samples (older ones dropped first); NaN when none."""
        while self._errors and self._errors[0][0] < now_s - ERROR_WINDOW_S:
            self._errors.popleft()
        errs = np.array([e for _, e in self._errors])
        m.ERROR_MEAN.set(float(errs.mean()) if len(errs) else math.nan)
        m.ERROR_MEAN_ABS.set(float(np.abs(errs).mean()) if len(errs) else math.nan)

    def _record_services(self, services: Mapping[str, tuple[float, float, float, float]]) -> None:
        """Per-service share, forecast, p99 and SLO; the series of services that ended are removed."""
        for job_id in self._services - set(services):
            for g in (m.SERVICE_SHARE, m.SERVICE_FORECAST, m.SERVICE_P99, m.SERVICE_SLO):
                with contextlib.suppress(KeyError):
                    g.remove(job_id)
        for job_id, values in services.items():
            if self._last.get(job_id) == values:
                continue  # unchanged since the last round (most rounds): no label lookups
            self._last[job_id] = values
            share, forecast, p99, slo = values
            m.SERVICE_SHARE.labels(job_id).set(share)
            m.SERVICE_SLO.labels(job_id).set(slo)
            for g, v in ((m.SERVICE_FORECAST, forecast), (m.SERVICE_P99, p99)):
                if np.isfinite(v):
                    g.labels(job_id).set(v)
        self._services = set(services)
        self._last = {j: v for j, v in self._last.items() if j in self._services}
