"""Step 6 of reconciliation (``reconcile.py``): measure what runs on the node and report it.

Emulated rates on simulated GPUs (a service's capacity from its full-GPU speed, its speed next to its
co-tenants and its share), progress and throughput from each workload's progress file (measured afresh
whenever its co-tenants or rate change), per-process counters, and the node's actual state as domain
``Workload`` objects. A mixin of :class:`~services.node_agent.reconcile.Reconciler`, which owns the state it
reads.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from elastico.domain import GpuCounters, JobKind, Placement, Workload
from services.node_agent.coloc import DEFAULT_ISOLATED_STEPS_PER_S, ColocationTruth
from services.node_agent.gpu import GpuBackend, Tenant
from services.node_agent.pairs import Samples
from services.node_agent.pods import PodProcess, sum_counters
from services.node_agent.runner import LedgerEntry, LedgerFile, Runner
from services.node_agent.service_demand import ServiceScrapes


class MeasureStep:
    """The reconciler's measurements (step 6) and its speed references; the attributes are the reconciler's."""

    backend: GpuBackend
    ledger: LedgerFile
    runner: Runner
    scrapes: ServiceScrapes
    _truth: ColocationTruth | None
    _samples: dict[str, Samples]
    _child_pids: dict[str, int]
    _pod_procs: dict[str, list[PodProcess]]

    def _isolated(self, p: Placement, model: str, batch_size: int, num_gpus: int) -> float:
        # per wall second: a simulated backend running accelerated time scales the reference speed too,
        # so normalised throughput stays a fraction of isolated speed
        scale = float(getattr(self.backend, "time_scale", 1.0))
        if p.shape.throughput > 0:
            return p.shape.throughput * scale
        gpu_type = getattr(self.backend, "gpu_type", "") or next((g.gpu_type for g in self.backend.gpus()), "")
        truth = self._truth or ColocationTruth.default()
        return (truth.isolated(model, batch_size, gpu_type, num_gpus) or 0.0) * scale

    def _full_gpu_rps(self, e: LedgerEntry) -> float:
        """A service's isolated requests per wall second on whole GPUs: its shape's isolated throughput scaled
        from the shape's share to 100 % when the allocator gave one, else the measured isolated speed."""
        scale = float(getattr(self.backend, "time_scale", 1.0))
        shape = e.placement.shape
        if shape is not None and shape.throughput > 0 and shape.compute_share_pct > 0:
            return shape.throughput * 100.0 / shape.compute_share_pct * scale
        gpu_type = getattr(self.backend, "gpu_type", "") or next((g.gpu_type for g in self.backend.gpus()), "")
        truth = self._truth or ColocationTruth.default()
        iso = truth.isolated(e.model, e.batch_size, gpu_type, max(1, len(e.gpu_indices)))
        return (iso if iso is not None else DEFAULT_ISOLATED_STEPS_PER_S) * scale

    def _child_pid(self, e: LedgerEntry) -> int | None:
        if e.is_pod:
            return e.pid or None  # a container's main process
        if e.job_id not in self._child_pids:
            child = self.runner.child_pid(e)
            if child is None:
                return None
            self._child_pids[e.job_id] = child
        return self._child_pids[e.job_id]

    def _load(self, e: LedgerEntry) -> float | None:
        """A service's measured load (its last window's request rate / its full-GPU rate); None = not measured."""
        report = self.scrapes.report(e) if e.kind == JobKind.INFERENCE.value else None
        if report is None:
            return None
        full = self._full_gpu_rps(e)
        return report.request_rate_rps / full if full > 0 else None

    def _cotenants(self, e: LedgerEntry) -> tuple[str, ...]:
        return tuple(sorted(o.job_id for o in self.ledger.entries.values()
                            if o.running and o.job_id != e.job_id and set(o.gpu_indices) & set(e.gpu_indices)))

    async def _measure(self, now: float) -> None:
        running = [e for e in self.ledger.entries.values() if e.running]
        tenants = [Tenant(e.job_id, e.model, e.batch_size, e.gpu_indices, e.mps_limit_pct, e.kind, self._load(e))
                   for e in running]
        rates = self.backend.emulated_rates(tenants, {e.job_id: e.mem_mib for e in running})
        for e in running:
            if e.job_id in rates and e.kind == JobKind.INFERENCE.value:
                # capacity of a service = full-GPU speed x its speed next to its co-tenants x its share
                rates[e.job_id] = (self._full_gpu_rps(e) * rates[e.job_id][1] * e.compute_share_pct / 100.0,
                                   rates[e.job_id][1])
            if e.job_id in rates and not e.is_pod:  # a pod's real program sets its own pace
                await asyncio.to_thread(self.runner.write_rate, e, rates[e.job_id][0])
            progress = self.runner.read_progress(e.progress_file) if e.progress_file else None
            s = self._samples.setdefault(e.job_id, Samples())
            key = (self._cotenants(e), rates.get(e.job_id, (None,))[0])
            if key != s.key:  # co-tenants (hence speed) changed: measure afresh from here
                s.key, s.first, s.last = key, None, None
            throughput = e.throughput
            if progress is not None:
                if s.first is None or progress[1] < s.first[0]:
                    s.first = (progress[1], progress[0])
                s.last = (progress[1], progress[0])
                span = s.last[0] - s.first[0]
                if span >= 0.5:
                    throughput = (s.last[1] - s.first[1]) / span
            norm = throughput / e.isolated_throughput if e.isolated_throughput > 0 and throughput > 0 else None
            self.ledger.entries[e.job_id] = replace(e, progress_steps=progress[0] if progress else e.progress_steps,
                                                    throughput=throughput, norm_throughput=norm)

    def workloads(self) -> list[Workload]:
        """The node's actual state (every ledger entry) as domain objects."""
        counters = self.backend.process_counters()
        out = []
        for e in sorted(self.ledger.entries.values(), key=lambda x: x.job_id):
            out.append(Workload(
                job_id=e.job_id, gpu_indices=e.gpu_indices, compute_share_pct=e.compute_share_pct, mem_mib=e.mem_mib,
                status=self._status(e), pid=e.pid if e.running else 0, progress_steps=e.progress_steps,
                throughput=e.throughput if e.running else 0.0, started_at_s=e.started_at_s,
                placement_id=e.placement_id, reason=e.reason, exit_code=e.exit_code, message=e.message,
                cotenants=self._cotenants(e) if e.running else (), norm_throughput=e.norm_throughput if e.running else None,
                counters=self._counters(e, counters) if e.running else GpuCounters(), log_path=e.log_path,
                ended_at_s=e.ended_at_s, endpoint=e.endpoint if e.running else "", demand=self.scrapes.report(e),
                recent_demand=self.scrapes.recent(e)))
        return out

    def _counters(self, e: LedgerEntry, counters: dict[int, GpuCounters]) -> GpuCounters:
        """Per-process counters of a workload: its command's process, or summed over every process of its pod."""
        if e.is_pod:
            return sum_counters(counters[p.pid] for p in self._pod_procs.get(e.pod_uid, []) if p.pid in counters)
        child = self._child_pid(e)
        return counters.get(child, GpuCounters()) if child else GpuCounters()

    def _status(self, e: LedgerEntry) -> str:
        """A service with a metrics endpoint is "starting" until its endpoint first answers: the allocator marks it
        RUNNING (and finishes a make-before-break move, stopping the previous replica) only once it serves."""
        if e.running and e.metrics is not None and not e.draining and not self.scrapes.answered(e):
            return "starting"
        return e.status

