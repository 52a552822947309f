"""Measured inference demand -> the forecast a round sizes each service to (pure: no I/O).

Reports arrive two ways (``Allocator.ReportDemand``; a node agent's scrape, carried in its workload report) and
are kept per job in the store; :func:`forecasts` turns each service's recent reports into its forecast with the
simulator's forecaster (:func:`services.allocator.policy.forecast.forecast_rps`) on the policy clock
(wall x ``time_scale``, rates per policy second), so the live allocator and the simulator size services by the
same rule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from elastico.domain import DemandReport, Job, JobKind, Workload, placement_id
from services.allocator.policy.forecast import BIN_S, forecast_rps


def keep_s(window_s: float, time_scale: float) -> float:
    """Wall seconds of history a forecast reads (its window plus one bin, on the policy clock)."""
    return (window_s + BIN_S) / time_scale


def forecast(reports: Sequence[DemandReport], now_s: float, window_s: float, time_scale: float) -> float:
    """Forecast request rate at wall time ``now_s`` from ``reports``, per *policy* second (the unit of a service's
    declared throughput); NaN without a report in the window. Reports measure wall time (window ends, rates per
    wall second): on an accelerated clock a rate is ``time_scale`` times the policy's."""
    return forecast_rps([r.window_end_s * time_scale for r in reports], [r.request_rate_rps / time_scale for r in reports],
                        now_s * time_scale, window_s, weights=[r.window_s for r in reports])


def forecasts(jobs: Sequence[Job], history: Mapping[str, Sequence[DemandReport]], now_s: float, window_s: float,
              time_scale: float) -> dict[str, float]:
    """job id -> forecast req/s of every inference job with reports in the window (others: absent; the view
    then uses the rate declared at submission)."""
    out = {}
    for j in jobs:
        if j.spec.kind is JobKind.INFERENCE and j.job_id in history:
            f = forecast(history[j.job_id], now_s, window_s, time_scale)
            if math.isfinite(f):
                out[j.job_id] = f
    return out


def from_workloads(jobs: Sequence[Job], workloads: Mapping[str, Mapping[str, Workload]],
                   seen: Mapping[str, float]) -> list[DemandReport]:
    """Reports the node agents scraped for the inference jobs they run *now* (the workload of the job's current
    placement on one of its nodes: a node can report only for what it runs), newer than ``seen[job]`` (the last
    window end taken from agents), tagged with their node as source."""
    out = []
    for j in jobs:
        if j.spec.kind is not JobKind.INFERENCE or j.placement is None:
            continue
        pid = placement_id(j.placement)
        for node in sorted({s.node_id for s in j.placement.slices}):
            w = workloads.get(node, {}).get(j.job_id)
            if w is None or w.placement_id != pid:
                continue
            last = seen.get(j.job_id, -math.inf)
            out += [replace(r, job_id=j.job_id, source=f"node:{node}") for r in (w.recent_demand or (w.demand,))
                    if r is not None and r.window_end_s > last]
    return out
