"""elastico.v1.Pricer over gRPC: a thin edge around ``services.pricer.core.solve``.

The servicer converts the request to a padded ``PricingProblem`` (validating what the arrays cannot:
pool names, job ids, demand-vector lengths), runs the solver off the event loop with a time limit
derived from the caller's deadline, and converts the result back. Solver status is returned as data;
input errors become INVALID_ARGUMENT naming the field (``jobs[3].shapes[1].demand[0]``).

Size first: the padded arrays hold ``jobs x longest shape list x pools`` cells whatever the wire size, so
``check_request_size`` bounds pools, jobs, shapes per job and that product (``elastico.limits``,
``PricerSettings.max_jobs``/``max_cells``) before anything is allocated; the conversion itself (Python
work proportional to the shapes sent: ~2 us per shape) runs in a worker thread, as the solve does.
"""

from __future__ import annotations

import array
import asyncio

import grpc
import numpy as np

from elastico import limits as L
from elastico.errors import InvalidSpec
from elastico.limits import clip
from elastico.v1 import pricer_pb2 as ppb
from elastico.v1 import pricer_pb2_grpc
from services.pricer.core import PricingInputError, PricingProblem, PricingResult, SolverOptions, SolveStatus, solve
from services.pricer.settings import PricerSettings

_STATUS = {
    SolveStatus.OPTIMAL: ppb.SOLVER_STATUS_OPTIMAL,
    SolveStatus.FEASIBLE: ppb.SOLVER_STATUS_FEASIBLE,
    SolveStatus.INFEASIBLE_INPUT: ppb.SOLVER_STATUS_INFEASIBLE_INPUT,
}
MAX_SHAPES_PER_JOB = L.SHAPES_PER_JOB_MAX
DEFAULT_TIME_LIMIT_S = 10.0


def check_request_size(request: ppb.ComputeAllocationRequest, max_jobs: int, max_cells: int = L.PRICER_MAX_CELLS) -> int:
    """Bound the request's dimensions before anything is built; returns the padded shape count ``S``.

    O(pools + jobs), no allocation: counts pools, jobs and each job's shapes (first offender named:
    ``pools``, ``jobs``, ``jobs[3].shapes``), and the padded size ``jobs x max shapes x pools`` against
    ``max_cells``, stopping at the first job that pushes it over.
    """
    R, J = len(request.pools), len(request.jobs)
    if R > L.PRICER_POOLS_MAX:
        raise InvalidSpec("pools", f"at most {L.PRICER_POOLS_MAX} pools per request, got {R}")
    if J > max_jobs:
        raise InvalidSpec("jobs", f"at most {max_jobs} jobs per request, got {J}")
    row = J * max(R, 1)  # cells per padded shape slot
    if row > max_cells:
        raise InvalidSpec("jobs", f"{J} jobs x {R} pools exceeds the limit of {max_cells} cells per request")
    S = 1
    for j, job in enumerate(request.jobs):
        n = len(job.shapes)
        if n > S:
            if n > L.SHAPES_PER_JOB_MAX:
                raise InvalidSpec(f"jobs[{j}].shapes", f"at most {L.SHAPES_PER_JOB_MAX} shapes per job, got {n}")
            if n * row > max_cells:
                raise InvalidSpec(f"jobs[{j}].shapes", f"{n} shapes pad all {J} jobs x {R} pools to {n * row} cells, "
                                  f"over the limit of {max_cells} per request")
            S = n
    return S


def problem_from_pb(request: ppb.ComputeAllocationRequest, max_jobs: int, max_cells: int = L.PRICER_MAX_CELLS) -> PricingProblem:
    """Build and validate the padded problem; raises InvalidSpec naming the request field.

    CPU-bound for large requests (one Python step per shape sent): call it off the event loop.
    """
    pools = request.pools
    if not pools:
        raise InvalidSpec("pools", "at least one resource pool is required")
    S = check_request_size(request, max_jobs, max_cells)
    names: set[str] = set()
    for i, p in enumerate(pools):
        if not p.name:
            raise InvalidSpec(f"pools[{i}].name", "must not be empty")
        problem = L.text_problem(p.name, L.POOL_NAME_MAX_CHARS)
        if problem:
            raise InvalidSpec(f"pools[{i}].name", problem)
        if p.name in names:
            raise InvalidSpec(f"pools[{i}].name", f"duplicate pool {clip(p.name)!r}")
        names.add(p.name)
    R, J = len(pools), len(request.jobs)
    # one pass over the shapes sent, into flat float64 buffers (no Python float objects kept, no padding yet)
    counts = np.zeros(J, dtype=np.int64)
    util = array.array("d")
    dem = array.array("d")
    seen: set[str] = set()
    for j, job in enumerate(request.jobs):
        job_id = job.job_id
        if not job_id:
            raise InvalidSpec(f"jobs[{j}].job_id", "must not be empty")
        problem = L.text_problem(job_id, L.JOB_ID_MAX_CHARS)
        if problem:
            raise InvalidSpec(f"jobs[{j}].job_id", problem)
        if job_id in seen:
            raise InvalidSpec(f"jobs[{j}].job_id", f"duplicate job id {clip(job_id)!r}")
        seen.add(job_id)
        shapes = job.shapes
        counts[j] = len(shapes)
        for s, shape in enumerate(shapes):
            d = shape.demand
            if len(d) != R:
                raise InvalidSpec(f"jobs[{j}].shapes[{s}].demand", f"has {len(d)} entries, expected one per pool ({R})")
            util.append(shape.utility)
            dem.extend(d)
    capacity = np.array([p.capacity for p in pools], dtype=np.float64)
    _first_bad(capacity, lambda idx: f"pools[{idx[0]}].capacity")
    u_flat = np.frombuffer(util, dtype=np.float64) if len(util) else np.zeros(0)
    d_flat = (np.frombuffer(dem, dtype=np.float64) if len(dem) else np.zeros(0)).reshape(-1, R)
    offsets = np.concatenate(([0], np.cumsum(counts)))

    def at(k: int) -> tuple[int, int]:  # flat shape index -> (job, shape)
        j = int(np.searchsorted(offsets, k, side="right")) - 1
        return j, k - int(offsets[j])

    _first_bad(u_flat, lambda idx: "jobs[{}].shapes[{}].utility".format(*at(idx[0])))
    _first_bad(d_flat, lambda idx: "jobs[{}].shapes[{}].demand[{}]".format(*at(idx[0]), idx[1]))
    if not (capacity > 0).any():
        raise InvalidSpec("pools", "every pool has capacity 0")
    mask = np.arange(S)[None, :] < counts[:, None]
    utility = np.zeros((J, S))
    demand = np.zeros((J, S, R))
    utility[mask] = u_flat  # row-major: job by job, shapes in order, exactly as sent
    demand[mask] = d_flat
    problem = PricingProblem(utility=utility, demand=demand, mask=mask, capacity=capacity)
    try:
        problem.validate()
    except PricingInputError as exc:  # anything the checks above missed still names a field
        raise InvalidSpec(exc.field, exc.message) from exc
    return problem


def _first_bad(values: np.ndarray, path) -> None:
    bad = ~np.isfinite(values) | (values < 0) | (values > L.PRICER_VALUE_MAX)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise InvalidSpec(path(idx), f"must be a number in [0, {L.PRICER_VALUE_MAX:g}], got {float(values[idx])!r}")


def result_to_pb(request: ppb.ComputeAllocationRequest, result: PricingResult) -> ppb.ComputeAllocationResponse:
    return ppb.ComputeAllocationResponse(
        assignments=[ppb.Assignment(job_id=job.job_id, shape_index=int(c)) for job, c in zip(request.jobs, result.choice, strict=True)],
        prices=[float(p) for p in result.prices], primal_value=result.primal_value, dual_bound=result.dual_bound,
        relative_gap=result.gap, iterations=result.iterations, wall_time_s=result.wall_time_s, status=_STATUS[result.status],
    )


def _solve_to_pb(request: ppb.ComputeAllocationRequest, problem: PricingProblem, options: SolverOptions,
                 warm: np.ndarray | None) -> ppb.ComputeAllocationResponse:
    return result_to_pb(request, solve(problem, options, warm))


class PricerServicer(pricer_pb2_grpc.PricerServicer):
    def __init__(self, settings: PricerSettings) -> None:
        self._settings = settings
        self._slots = asyncio.Semaphore(settings.max_concurrent)  # binds to the serving loop at its first use

    async def ComputeAllocation(self, request: ppb.ComputeAllocationRequest, context: grpc.aio.ServicerContext) -> ppb.ComputeAllocationResponse:
        async with self._slots:  # bounds the memory of the requests in conversion or solve at once
            return await self._compute(request, context)

    async def _compute(self, request: ppb.ComputeAllocationRequest, context: grpc.aio.ServicerContext) -> ppb.ComputeAllocationResponse:
        # sizes are bounded before any array exists; the conversion (and later the solve) is CPU-bound, so both
        # run in a worker thread: the event loop keeps answering health checks and other calls meanwhile
        problem = await asyncio.to_thread(problem_from_pb, request, self._settings.max_jobs, self._settings.max_cells)
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
        # CPU-bound, and so is building the reply (~8 us per job): keep the event loop free for health checks
        return await asyncio.to_thread(_solve_to_pb, request, problem, options, warm)
