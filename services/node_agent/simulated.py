"""The simulated GPU backend: ``count`` GPUs of one type whose co-located speeds follow measured data.

Selected by ``ELASTICO_GPU_BACKEND=simulated`` (or ``auto`` without a driver); the rates come from
:class:`services.node_agent.coloc.ColocationTruth`, i.e. the same ground truth as the trace simulator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from elastico.domain import GpuCounters, GpuInfo
from services.node_agent.coloc import ColocationTruth
from services.node_agent.gpu import Tenant


class SimulatedBackend:
    """``count`` identical GPUs of ``gpu_type`` whose co-located throughput follows measured data.

    Device counters are derived from what runs: SM utilisation is the sum of the tenants' MPS shares
    scaled by the fraction of speed they keep, memory used the sum of their pinned limits.
    """

    name = "simulated"

    def __init__(self, node_id: str, gpu_type: str, count: int, mem_mib: int, truth: ColocationTruth | None = None,
                 time_scale: float = 1.0) -> None:
        if not time_scale > 0:
            raise ValueError("time_scale must be > 0")
        self.gpu_type = gpu_type
        self.time_scale = time_scale  # simulated seconds per wall second (trace replays); 1 = real time
        self._truth = truth
        self._gpus = [
            GpuInfo(index=i, uuid=f"GPU-SIM-{node_id}-{i}", gpu_type=gpu_type, mem_total_mib=mem_mib,
                    counters=GpuCounters(sm_util_pct=0.0, mem_bw_util_pct=0.0, mem_used_mib=0.0))
            for i in range(count)
        ]
        self._counters: dict[int, GpuCounters] = {}

    @property
    def truth(self) -> ColocationTruth:
        if self._truth is None:
            self._truth = ColocationTruth.default()
        return self._truth

    def gpus(self) -> list[GpuInfo]:
        return [replace(g, counters=self._counters.get(g.index, g.counters)) for g in self._gpus]

    def process_counters(self) -> dict[int, GpuCounters]:
        return {}

    def emulated_rates(self, tenants: Sequence[Tenant], mem_mib: dict[str, int] | None = None) -> dict[str, tuple[float, float]]:
        rates = self.truth.rates(tenants, self.gpu_type)
        if self.time_scale != 1.0:  # accelerated time: every workload runs time_scale x faster, norms unchanged
            rates = {j: (r * self.time_scale, n) for j, (r, n) in rates.items()}
        counters: dict[int, GpuCounters] = {}
        for g in self._gpus:
            on = [t for t in tenants if g.index in t.gpu_indices]
            sm = min(100.0, sum(t.compute_share_pct * rates[t.job_id][1] for t in on))
            mem = float(sum((mem_mib or {}).get(t.job_id, 0) for t in on))
            counters[g.index] = GpuCounters(sm_util_pct=sm, mem_bw_util_pct=sm * 0.6, mem_used_mib=mem)
        self._counters = counters
        return rates

    def close(self) -> None:
        return None
