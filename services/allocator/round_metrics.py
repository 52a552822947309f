"""The allocator's round metrics: what a scheduling round did and saw, onto the Prometheus objects of
:mod:`services.allocator.metrics`.

Kept out of :meth:`Scheduler.round` so that a round reads as its steps; every update a round makes goes
through :class:`RoundMetrics`. The counters of store writes (:meth:`RoundMetrics.writes`) count what the
store accepted even when a later step of the round fails; the gauges and histograms of a round
(:meth:`RoundMetrics.record`) describe completed rounds only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from elastico.domain import NodeInfo, StateReason, Workload
from services.allocator import metrics as m
from services.allocator.plan import ViewIndex
from services.allocator.policy import ClusterView

if TYPE_CHECKING:
    from services.allocator.rounds import RoundReport

# elastico_allocator_degraded{component} -> how its degradation notes (RoundReport.degraded) begin
DEGRADED_PREFIXES = {"pricer": ("pricer",), "predictor": ("predictor",), "nodes": ("nodes", "node ")}


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
        """The round's writes the store accepted: releases by reason, placements, a rejected commit."""
        for reason, n in rep.released.items():
            m.RELEASES.labels(reason).inc(n)
        if rep.preempted:
            m.RELEASES.labels(StateReason.PREEMPTED.value).inc(rep.preempted)
        if rep.resized:
            m.RELEASES.labels(StateReason.RESIZED.value).inc(rep.resized)
        if rep.placed_jobs:
            m.PLACEMENTS.inc(rep.placed_jobs)
        if rep.conflict:
            m.CONFLICTS.inc()

    def record(self, outcome: RoundOutcome) -> None:
        """Queue, decide time, pricing gap, degradations, predicted vs observed speeds, GPU allocation and
        utilisation, placed jobs, round time and the round's outcome."""
        rep, view = outcome.report, outcome.view
        m.QUEUE_LENGTH.set(rep.pending)
        m.DECIDE_SECONDS.observe(rep.decide_seconds)
        if rep.gap is not None:
            m.PRICING_GAP.set(rep.gap)
        for comp, prefixes in DEGRADED_PREFIXES.items():
            m.DEGRADED.labels(comp).set(1 if any(d.startswith(prefixes) for d in rep.degraded) else 0)
        for r, observed in outcome.observed.items():
            predicted = outcome.predicted.get(r)
            if predicted is not None:
                m.PREDICTED_NORM.observe(predicted)
                m.OBSERVED_NORM.observe(observed)
                m.SLOWDOWN_ERROR.observe(observed - predicted)
        m.GPU_ALLOCATED.set(float(np.minimum(view.gpu_share.sum(axis=1), 100).sum() / 100 / max(view.num_gpus, 1)))
        sm = [g.counters.sm_util_pct for n in outcome.fresh_nodes for g in n.gpus if g.counters.sm_util_pct is not None]
        if sm:
            m.GPU_UTILISATION.set(float(np.mean(sm)) / 100.0)
        m.RUNNING_JOBS.set(len(view.running) + rep.placed_jobs)
        self._record_services(outcome.services)
        m.ROUND_SECONDS.observe(rep.seconds)
        m.ROUNDS.labels("conflict" if rep.conflict else "ok").inc()

    def _record_services(self, services: Mapping[str, tuple[float, float, float, float]]) -> None:
        """Per-service share, forecast, p99 and SLO; the series of services that ended are removed."""
        for job_id in self._services - set(services):
            for g in (m.SERVICE_SHARE, m.SERVICE_FORECAST, m.SERVICE_P99, m.SERVICE_SLO):
                with contextlib.suppress(KeyError):
                    g.remove(job_id)
        for job_id, (share, forecast, p99, slo) in services.items():
            m.SERVICE_SHARE.labels(job_id).set(share)
            m.SERVICE_SLO.labels(job_id).set(slo)
            for g, v in ((m.SERVICE_FORECAST, forecast), (m.SERVICE_P99, p99)):
                if np.isfinite(v):
                    g.labels(job_id).set(v)
        self._services = set(services)
