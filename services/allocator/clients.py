"""gRPC clients the allocator uses for the pricer and the predictor.

Each returns the same pure result types the in-process cores return, so the policy code that the
simulator runs in-process runs unchanged in the live allocator. Every call carries a deadline; a
failed or late call raises ``Unavailable`` and the caller degrades explicitly (last good prices, no
new co-location) instead of guessing.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import numpy as np

from elastico.errors import Unavailable
from elastico.v1 import pricer_pb2 as ppb
from elastico.v1 import pricer_pb2_grpc
from services.pricer.core import PricingProblem, PricingResult, SolveStatus, relative_gap

_STATUS = {
    ppb.SOLVER_STATUS_OPTIMAL: SolveStatus.OPTIMAL,
    ppb.SOLVER_STATUS_FEASIBLE: SolveStatus.FEASIBLE,
    ppb.SOLVER_STATUS_INFEASIBLE_INPUT: SolveStatus.INFEASIBLE_INPUT,
}


def problem_to_pb(problem: PricingProblem, pool_names: Sequence[str], job_ids: Sequence[str],
                  warm_prices: np.ndarray | None = None, gap_tolerance: float = 0.0) -> ppb.ComputeAllocationRequest:
    """Serialise a padded problem (masked shapes dropped; shape indexes keep their order)."""
    req = ppb.ComputeAllocationRequest(
        pools=[ppb.ResourcePool(name=n, capacity=float(c)) for n, c in zip(pool_names, problem.capacity, strict=True)],
        gap_tolerance=gap_tolerance,
    )
    if warm_prices is not None:
        req.warm_start_prices.extend(float(p) for p in warm_prices)
    u, d, m = np.asarray(problem.utility), np.asarray(problem.demand), np.asarray(problem.mask)
    for j, job_id in enumerate(job_ids):
        job = req.jobs.add(job_id=job_id)
        valid = np.flatnonzero(m[j])
        if len(valid) and valid[-1] != len(valid) - 1:
            raise ValueError("masked shapes must be trailing padding so shape indexes survive serialisation")
        for s in valid:
            job.shapes.add(utility=float(u[j, s]), demand=d[j, s].tolist())
    return req


class PricerClient:
    """ComputeAllocation over gRPC, returning a ``PricingResult``."""

    def __init__(self, address: str, timeout_s: float = 1.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = pricer_pb2_grpc.PricerStub(self._channel)

    async def solve(self, problem: PricingProblem, pool_names: Sequence[str], job_ids: Sequence[str],
                    warm_prices: np.ndarray | None = None, timeout_s: float | None = None) -> PricingResult:
        req = problem_to_pb(problem, pool_names, job_ids, warm_prices)
        try:
            resp = await self._stub.ComputeAllocation(req, timeout=timeout_s or self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"pricer at {self.address}: {exc.code().name}: {exc.details()}") from exc
        return PricingResult(
            choice=np.array([a.shape_index for a in resp.assignments], dtype=np.int64),
            prices=np.array(resp.prices, dtype=np.float64), primal_value=resp.primal_value, dual_bound=resp.dual_bound,
            gap=relative_gap(resp.primal_value, resp.dual_bound), iterations=resp.iterations,
            wall_time_s=resp.wall_time_s, status=_STATUS.get(resp.status, SolveStatus.FEASIBLE),
        )

    async def close(self) -> None:
        await self._channel.close()
