"""Scrape state of this node's running inference services: the demand each one measures.

One :class:`_Scrape` per service's current placement. :meth:`ServiceScrapes.scrape_due` scrapes, concurrently,
every running service whose scrape is due (each bounded by the scraper's timeout); two consecutive scrapes make
one window of demand (:func:`scrape.demand_between`), kept as the service's last report and in a short history
that every workload report carries, so no window is lost however seldom the allocator's rounds read them. A
failed scrape keeps the last report and is logged at most once per job per ``SCRAPE_ERROR_LOG_S``. A previous
replica still serving during a move is not scraped: a job's demand is its current replica's.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from elastico.domain import MAX_DEMAND_WINDOW_S, DemandReport
from elastico.logging import get_logger
from services.node_agent.runner import LedgerEntry
from services.node_agent.scrape import ScrapeError, Scraper, Snapshot, demand_between, parse_snapshot

log = get_logger(component="reconcile")
RECENT_DEMAND_WINDOWS = 64  # scraped windows a workload report carries (Workload.recent_demand)
SCRAPE_ERROR_LOG_S = 60.0  # at most one logged scrape failure per job per this many seconds
SCRAPE_STARTUP_GRACE_S = 10.0  # a service that has not answered yet this soon after its start is still starting
SCRAPE_FIRST_RETRY_S = 1.0  # until its first answer, a service is scraped at least this often


@dataclass
class _Scrape:
    """Metrics scrape state of one running inference workload (one placement)."""

    placement_id: str
    due_at: float = 0.0  # time.monotonic() of the next scrape
    prev: Snapshot | None = None  # the last successful scrape
    report: DemandReport | None = None  # the last window measured; kept when a scrape fails
    # the last windows, newest last: every one reaches the allocator however seldom its rounds read the reports
    recent: deque[DemandReport] = field(default_factory=lambda: deque(maxlen=RECENT_DEMAND_WINDOWS))
    failures: int = 0  # failures since the last logged one
    logged_at: float = -math.inf  # time.monotonic() of the last logged failure


class ServiceScrapes:
    """The scrape state of a node's services, keyed by job id, and what it measured."""

    def __init__(self, node_id: str, interval_s: float) -> None:
        self.node_id = node_id
        self.interval_s = interval_s  # services whose endpoint names no interval
        self.scraper = Scraper()
        self.states: dict[str, _Scrape] = {}

    def forget(self, job_id: str) -> None:
        """The job's workload ended or moved: its next replica is measured afresh."""
        self.states.pop(job_id, None)

    def _current(self, e: LedgerEntry) -> _Scrape | None:
        st = self.states.get(e.job_id)
        return st if e.running and st is not None and st.placement_id == e.placement_id else None

    def report(self, e: LedgerEntry) -> DemandReport | None:
        """The last window measured of running workload ``e`` (None: none yet)."""
        st = self._current(e)
        return st.report if st is not None else None

    def recent(self, e: LedgerEntry) -> tuple[DemandReport, ...]:
        st = self._current(e)
        return tuple(st.recent) if st is not None else ()

    def answered(self, e: LedgerEntry) -> bool:
        """Running workload ``e``'s endpoint has answered a scrape (it serves)."""
        st = self._current(e)
        return st is not None and st.prev is not None

    async def scrape_due(self, entries: Iterable[LedgerEntry]) -> None:
        """Scrape every running service of ``entries`` whose scrape is due, concurrently; forget ended ones."""
        live = {e.job_id: e for e in entries
                if e.running and not e.draining and e.endpoint}  # a pod's endpoint needs its IP from the watch
        for job_id in [j for j, st in self.states.items() if j not in live or st.placement_id != live[j].placement_id]:
            del self.states[job_id]
        mono = time.monotonic()
        due = []
        for e in live.values():
            st = self.states.setdefault(e.job_id, _Scrape(e.placement_id))
            if mono >= st.due_at:
                due.append(e)
        results = await asyncio.gather(*(self._scrape_one(e, self.states[e.job_id]) for e in due), return_exceptions=True)
        for e, res in zip(due, results, strict=True):
            if isinstance(res, Exception):  # a bug in one scrape must not fail the pass: demand is best effort
                log.error("metrics scrape crashed", job_id=e.job_id, error=f"{type(res).__name__}: {res}")

    async def _scrape_one(self, e: LedgerEntry, st: _Scrape) -> None:
        m = e.metrics
        assert m is not None
        interval = m.scrape_interval_s or self.interval_s
        st.due_at = time.monotonic() + (interval if st.prev is not None else min(interval, SCRAPE_FIRST_RETRY_S))
        try:
            text = await self.scraper.fetch(m.port, m.path, e.pod_ip if e.is_pod else "127.0.0.1")
            t = time.time()
            snap = await asyncio.to_thread(parse_snapshot, text, t, m.format, m.model)
        except ScrapeError as exc:
            self._failed(e, st, str(exc))
            return
        if st.prev is not None and 0 < snap.t - st.prev.t <= MAX_DEMAND_WINDOW_S:
            st.report = replace(demand_between(st.prev, snap, e.job_id, m.format), source=f"node:{self.node_id}")
            st.recent.append(st.report)
        st.prev = snap  # a longer gap (agent paused) is no window: measure afresh from here

    def _failed(self, e: LedgerEntry, st: _Scrape, error: str) -> None:
        """Log a failed scrape, at most once per job per ``SCRAPE_ERROR_LOG_S``; the last report stays."""
        if st.prev is None and time.time() - e.started_at_s < SCRAPE_STARTUP_GRACE_S:
            log.debug("service not answering metrics scrapes yet", job_id=e.job_id, error=error)
            return
        st.failures += 1
        mono = time.monotonic()
        if mono - st.logged_at >= SCRAPE_ERROR_LOG_S:
            log.warning("metrics scrape failed; keeping the last demand report", job_id=e.job_id, endpoint=e.endpoint,
                        error=error, failures=st.failures)
            st.logged_at, st.failures = mono, 0

    async def close(self) -> None:
        await self.scraper.close()
