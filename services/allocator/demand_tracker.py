"""The services' demand as a round reads it: the windows the node agents scraped, stored; every active service
forecast from its history (the pure rules: ``demand.py``). Store-facing, so it lives beside ``rounds.py``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from elastico.domain import Job, JobKind, Workload, validate_demand_report
from elastico.errors import InvalidSpec
from elastico.logging import get_logger
from elastico.state.store import Store
from services.allocator import demand
from services.allocator import metrics as m

log = get_logger(component="rounds")


class DemandTracker:
    """What the leader remembers of the services' demand between rounds (rebuilt from the store when it changes)."""

    def __init__(self, store: Store, forecast_window_s: float, time_scale: float) -> None:
        self.store, self.window_s, self.time_scale = store, forecast_window_s, time_scale
        self._seen: dict[str, float] = {}  # inference job id -> newest window end taken from its agents
        self._history = demand.History()  # active services' recent demand reports (read incrementally)
        self.p99: dict[str, float] = {}  # inference job id -> p99 latency of its newest report, ms

    async def forecasts(self, jobs: Sequence[Job], workloads: Mapping[str, Mapping[str, Workload]],
                        now: float) -> dict[str, float]:
        """Store the demand windows the agents scraped since the last round, then forecast every active service
        from its history (``demand.History``): two round trips, none without services."""
        services = [j for j in jobs if j.spec.kind is JobKind.INFERENCE]
        if not services:
            self._seen.clear()
            return {}
        keep = demand.keep_s(self.window_s, self.time_scale)
        fresh = []
        for r in demand.from_workloads(services, workloads, self._seen):
            try:
                validate_demand_report(r, now)
            except InvalidSpec as exc:  # an agent's bad window is its bug, not a reason to stop scheduling
                log.warning("node agent demand report ignored", job_id=r.job_id, source=r.source, error=str(exc))
                continue
            fresh.append(r)
        if fresh:
            await self.store.record_demand(fresh, keep)
            for r in fresh:
                self._seen[r.job_id] = max(self._seen.get(r.job_id, 0.0), r.window_end_s)
            m.DEMAND_REPORTS.labels("node").inc(len(fresh))
        ids = [j.job_id for j in services]
        hist = self._history
        if hist.due_full(now):
            hist.replace_all(await self.store.demand_history(ids, now - keep), now)
        else:
            hist.extend(await self.store.demand_after(hist.after(ids)))
        live = set(ids)
        hist.keep_only(live, now - keep)
        self._seen = {k: v for k, v in self._seen.items() if k in live}
        self.p99 = {j: h[-1].p99_latency_ms for j, h in hist.reports.items() if h and h[-1].p99_latency_ms > 0}
        return hist.forecasts(services, now, self.window_s, self.time_scale)

    def series(self, jobs: Sequence[Job], forecasts: Mapping[str, float]) -> dict[str, tuple[float, float, float, float]]:
        """What the per-service metrics show (:meth:`RoundMetrics._record_services`): share, forecast, p99, SLO."""
        nan = float("nan")
        return {j.job_id: (j.placement.slices[0].compute_share_pct if j.placement else 0.0, forecasts.get(j.job_id, nan),
                           self.p99.get(j.job_id, nan), j.spec.inference.latency_slo_ms if j.spec.inference else nan)
                for j in jobs if j.spec.kind is JobKind.INFERENCE}
