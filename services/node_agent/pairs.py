"""Co-located pairs measured on this node, handed to an observation sink (the predictor's reporter).

A pair is two single-GPU tenants sharing one GPU, neither a moving service's previous replica, both with a
normalised throughput measured over at least ``MIN_WINDOW_S`` of unchanged co-tenants (:class:`Samples`). Each
pair is handed on at most once per ``interval_s``; a pair that stops running together is forgotten. The sink is
best effort: its failure is logged, never raised into the reconcile pass.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from elastico.logging import get_logger
from services.node_agent.runner import LedgerEntry

log = get_logger(component="reconcile")
MIN_WINDOW_S = 2.0  # a shorter sampling window is no measurement

# receives measured co-located pairs (a, b, node_id); services/node_agent/observations.PredictorReporter is one
ObservationSink = Callable[[list[tuple[LedgerEntry, LedgerEntry, str]]], Awaitable[None]]


@dataclass
class Samples:
    """Progress samples since the workload's co-tenants last changed (throughput = their slope)."""

    key: tuple = ()
    first: tuple[float, float] | None = None  # (time, steps)
    last: tuple[float, float] | None = None

    def span_s(self) -> float:
        return self.last[0] - self.first[0] if self.first and self.last else 0.0


class PairObserver:
    """Which co-located pairs of a node to report, and when each was last reported."""

    def __init__(self, node_id: str, interval_s: float, sink: ObservationSink | None) -> None:
        self.node_id = node_id
        self.interval_s = interval_s
        self.sink = sink
        self.last: dict[tuple[str, str], float] = {}  # (a@placement, b@placement) -> when last handed on

    async def observe(self, entries: Iterable[LedgerEntry], samples: Mapping[str, Samples], now: float) -> None:
        if self.sink is None:
            return
        by_gpu: dict[int, list[LedgerEntry]] = {}
        for e in entries:
            if e.running and len(e.gpu_indices) == 1:
                by_gpu.setdefault(e.gpu_indices[0], []).append(e)
        pairs = []
        seen: set[tuple[str, str]] = set()
        for tenants in by_gpu.values():
            if len(tenants) != 2 or any(e.draining for e in tenants):
                continue  # a previous replica of a moving service runs only for the move: no steady pair
            a, b = sorted(tenants, key=lambda x: x.job_id)
            if a.norm_throughput is None or b.norm_throughput is None:
                continue
            sa, sb = samples.get(a.job_id), samples.get(b.job_id)
            if sa is None or sb is None or min(sa.span_s(), sb.span_s()) < MIN_WINDOW_S:
                continue
            key = (f"{a.job_id}@{a.placement_id}", f"{b.job_id}@{b.placement_id}")
            seen.add(key)
            if now - self.last.get(key, 0.0) < self.interval_s:
                continue
            self.last[key] = now
            pairs.append((a, b, self.node_id))
        for key in [k for k in self.last if k not in seen]:
            del self.last[key]  # the pair no longer runs together
        if pairs:
            try:
                await self.sink(pairs)
            except Exception as exc:  # noqa: BLE001 - observations are best effort
                log.warning("reporting observations failed", error=str(exc))
