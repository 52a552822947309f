"""Measured inference demand -> the forecast a round sizes each service to (pure: no I/O).

Reports arrive two ways (``Allocator.ReportDemand``; a node agent's scrape, carried in its workload report) and
are kept per job in the store; :class:`History` turns each service's recent reports into its forecast with the
simulator's forecaster (:func:`services.allocator.policy.forecast.forecast_rps`) on the policy clock
(wall x ``time_scale``, rates per policy second), so the live allocator and the simulator size services by the
same rule.
"""

from __future__ import annotations

import bisect
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
    declared throughput), each report's ``source`` binned on its own; NaN without a report in the window. Reports
    measure wall time (window ends, rates per wall second): on an accelerated clock a rate is ``time_scale`` times
    the policy's."""
    return forecast_rps([r.window_end_s * time_scale for r in reports], [r.request_rate_rps / time_scale for r in reports],
                        now_s * time_scale, window_s, weights=[r.window_s for r in reports],
                        sources=[r.source for r in reports])


def _end(r: DemandReport) -> float:
    return r.window_end_s


class History:
    """The leader's copy of every active service's recent reports: each round reads only the windows newer than
    the ones it holds (``Store.demand_after``), a full re-read every ``REFRESH_S`` picks up reports that arrived
    out of order; forecasts are recomputed only for a service whose history or current bin changed."""

    REFRESH_S = 60.0

    def __init__(self) -> None:
        self.reports: dict[str, list[DemandReport]] = {}
        self.full_at = -math.inf  # wall time of the last full read
        self._memo: dict[str, tuple[tuple, float]] = {}

    def due_full(self, now_s: float) -> bool:
        return now_s - self.full_at >= self.REFRESH_S

    def replace_all(self, history: Mapping[str, Sequence[DemandReport]], now_s: float) -> None:
        self.reports = {j: list(h) for j, h in history.items()}
        self.full_at = now_s

    def extend(self, fresh: Mapping[str, Sequence[DemandReport]]) -> None:
        for j, h in fresh.items():
            self.reports.setdefault(j, []).extend(h)

    def after(self, job_ids: Sequence[str]) -> dict[str, float]:
        """Per job, the newest window end held (``-inf`` = none): where the next incremental read starts."""
        return {j: self.reports[j][-1].window_end_s if self.reports.get(j) else -math.inf for j in job_ids}

    def keep_only(self, job_ids: set[str], since_s: float) -> None:
        """Forget ended services and windows older than ``since_s``."""
        self.reports = {j: h[bisect.bisect_left(h, since_s, key=_end):] if h and h[0].window_end_s < since_s else h
                        for j, h in self.reports.items() if j in job_ids}
        self._memo = {j: v for j, v in self._memo.items() if j in job_ids}

    def forecasts(self, jobs: Sequence[Job], now_s: float, window_s: float, time_scale: float) -> dict[str, float]:
        """job id -> forecast req/s (:func:`forecast`) of every inference job with reports in the window (others:
        absent; the view then uses the rate declared at submission), memoised per (history, current bin)."""
        out = {}
        now_bin = math.floor(now_s * time_scale / BIN_S)
        for j in jobs:
            h = self.reports.get(j.job_id)
            if j.spec.kind is not JobKind.INFERENCE or not h:
                continue
            key = (len(h), h[-1].window_end_s, now_bin)
            got = self._memo.get(j.job_id)
            if got is None or got[0] != key:
                got = (key, forecast(h, now_s, window_s, time_scale))
                self._memo[j.job_id] = got
            if math.isfinite(got[1]):
                out[j.job_id] = got[1]
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
