"""elastico.v1.Pricer over gRPC: a thin edge around ``services.pricer.core.solve``.

The servicer converts the request to a padded ``PricingProblem`` (validating what the arrays cannot:
pool names, job ids, demand-vector lengths), runs the solver off the event loop with a time limit
derived from the caller's deadline, and converts the result back. Solver status is returned as data;
input errors become INVALID_ARGUMENT naming the field (``jobs[3].shapes[1].demand[0]``).
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np

from elastico.errors import InvalidSpec
from elastico.v1 import pricer_pb2 as ppb
from elastico.v1 import pricer_pb2_grpc
from services.pricer.core import PricingInputError, PricingProblem, PricingResult, SolverOptions, SolveStatus, solve
from services.pricer.settings import PricerSettings

_STATUS = {
    SolveStatus.OPTIMAL: ppb.SOLVER_STATUS_OPTIMAL,
    SolveStatus.FEASIBLE: ppb.SOLVER_STATUS_FEASIBLE,
    SolveStatus.INFEASIBLE_INPUT: ppb.SOLVER_STATUS_INFEASIBLE_INPUT,
}
MAX_SHAPES_PER_JOB = 64
DEFAULT_TIME_LIMIT_S = 10.0


def problem_from_pb(request: ppb.ComputeAllocationRequest, max_jobs: int) -> PricingProblem:
    """Build and validate the padded problem; raises InvalidSpec naming the request field."""
    pools = request.pools
    if not pools:
        raise InvalidSpec("pools", "at least one resource pool is required")
    names: set[str] = set()
    for i, p in enumerate(pools):
        if not p.name:
            raise InvalidSpec(f"pools[{i}].name", "must not be empty")
        if p.name in names:
            raise InvalidSpec(f"pools[{i}].name", f"duplicate pool {p.name!r}")
        names.add(p.name)
    if len(request.jobs) > max_jobs:
        raise InvalidSpec("jobs", f"at most {max_jobs} jobs per request, got {len(request.jobs)}")
    R, J = len(pools), len(request.jobs)
    S = max((len(j.shapes) for j in request.jobs), default=0)
    if S > MAX_SHAPES_PER_JOB:
        raise InvalidSpec("jobs", f"at most {MAX_SHAPES_PER_JOB} shapes per job")
    S = max(S, 1)
    utility = np.zeros((J, S))
    demand = np.zeros((J, S, R))
    mask = np.zeros((J, S), dtype=bool)
    seen: set[str] = set()
    for j, job in enumerate(request.jobs):
        if not job.job_id:
            raise InvalidSpec(f"jobs[{j}].job_id", "must not be empty")
        if job.job_id in seen:
            raise InvalidSpec(f"jobs[{j}].job_id", f"duplicate job id {job.job_id!r}")
        seen.add(job.job_id)
        for s, shape in enumerate(job.shapes):
            if len(shape.demand) != R:
                raise InvalidSpec(f"jobs[{j}].shapes[{s}].demand", f"has {len(shape.demand)} entries, expected one per pool ({R})")
            utility[j, s] = shape.utility
            demand[j, s] = shape.demand
            mask[j, s] = True
    capacity = np.array([p.capacity for p in pools], dtype=np.float64)
    _first_bad(capacity, lambda idx: f"pools[{idx[0]}].capacity")
    _first_bad(np.where(mask, utility, 0.0), lambda idx: f"jobs[{idx[0]}].shapes[{idx[1]}].utility")
    _first_bad(np.where(mask[..., None], demand, 0.0), lambda idx: f"jobs[{idx[0]}].shapes[{idx[1]}].demand[{idx[2]}]")
    if not (capacity > 0).any():
        raise InvalidSpec("pools", "every pool has capacity 0")
    problem = PricingProblem(utility=utility, demand=demand, mask=mask, capacity=capacity)
    try:
        problem.validate()
    except PricingInputError as exc:  # anything the checks above missed still names a field
        raise InvalidSpec(exc.field, exc.message) from exc
    return problem


def _first_bad(values: np.ndarray, path) -> None:
    bad = ~np.isfinite(values) | (values < 0)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise InvalidSpec(path(idx), f"must be a finite number >= 0, got {values[idx]!r}")


def result_to_pb(request: ppb.ComputeAllocationRequest, result: PricingResult) -> ppb.ComputeAllocationResponse:
    return ppb.ComputeAllocationResponse(
        assignments=[ppb.Assignment(job_id=job.job_id, shape_index=int(c)) for job, c in zip(request.jobs, result.choice, strict=True)],
        prices=[float(p) for p in result.prices], primal_value=result.primal_value, dual_bound=result.dual_bound,
        relative_gap=result.gap, iterations=result.iterations, wall_time_s=result.wall_time_s, status=_STATUS[result.status],
    )


class PricerServicer(pricer_pb2_grpc.PricerServicer):
    def __init__(self, settings: PricerSettings) -> None:
        self._settings = settings

    async def ComputeAllocation(self, request: ppb.ComputeAllocationRequest, context: grpc.aio.ServicerContext) -> ppb.ComputeAllocationResponse:
        problem = problem_from_pb(request, self._settings.max_jobs)
        warm = None
        if request.warm_start_prices:
            if len(request.warm_start_prices) != len(request.pools):
                raise InvalidSpec("warm_start_prices", f"has {len(request.warm_start_prices)} entries, expected one per pool ({len(request.pools)})")
            warm = np.array(request.warm_start_prices, dtype=np.float64)
            _first_bad(warm, lambda idx: f"warm_start_prices[{idx[0]}]")
        if not (np.isfinite(request.gap_tolerance) and 0 <= request.gap_tolerance < 1):
            raise InvalidSpec("gap_tolerance", f"must be in [0, 1), got {request.gap_tolerance!r}")
        remaining = context.time_remaining()
        time_limit = DEFAULT_TIME_LIMIT_S if remaining is None else max(0.01, min(DEFAULT_TIME_LIMIT_S, 0.8 * remaining))
        options = SolverOptions(
            gap_tolerance=request.gap_tolerance or self._settings.default_gap_tolerance,
            max_iterations=request.max_iterations or SolverOptions().max_iterations,
            time_limit_s=time_limit,
        )
        if not request.jobs:
            return ppb.ComputeAllocationResponse(prices=[0.0] * len(request.pools), status=ppb.SOLVER_STATUS_OPTIMAL)
        # CPU-bound: keep the event loop free for health checks and other calls
        result = await asyncio.to_thread(solve, problem, options, warm)
        return result_to_pb(request, result)
