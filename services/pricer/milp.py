"""Exact reference for the pricer: the same problem as a MILP, solved by HiGHS (``scipy.optimize.milp``).

Why it exists: the shadow-pricing solver certifies its own answers with a dual bound, but that bound is
the LP relaxation's, so it cannot say how much of the remaining gap is integrality. Tests and the
benchmark compare against this exact optimum on instances small enough for branch and bound. It is
not meant for production rounds: branch and bound slows down steeply with the number of jobs.

Formulation: one binary ``x[j, s]`` per usable shape (it exists, has positive utility and fits an
empty cluster; the others can never improve an optimal solution), ``sum_s x[j, s] <= 1`` per job
(0 = wait) and ``sum_{j,s} (d[j, s, r] / capacity[r]) x[j, s] <= 1`` per pool, rows normalised so
HiGHS' absolute feasibility tolerance means the same in every pool.
"""

from __future__ import annotations

import time

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, milp

from services.pricer.core import (
    PricingInputError,
    PricingProblem,
    PricingResult,
    SolveStatus,
    allocation_value,
    invalid_result,
    relative_gap,
)

__all__ = ["solve_milp"]


def solve_milp(problem: PricingProblem, time_limit_s: float = 60.0, mip_rel_gap: float = 1e-6) -> PricingResult:
    """Solve the pricing problem exactly (up to ``mip_rel_gap``) with HiGHS branch and bound.

    Args:
        problem: the round's jobs, shapes and pools.
        time_limit_s: wall-clock limit handed to HiGHS, in seconds.
        mip_rel_gap: relative gap at which HiGHS stops (1e-6 = optimal for all practical purposes).

    Returns:
        A :class:`PricingResult`: status ``OPTIMAL`` when HiGHS proved ``gap <= mip_rel_gap``,
        ``FEASIBLE`` when it stopped at the time limit with an incumbent (gap and dual bound are
        HiGHS'), ``INFEASIBLE_INPUT`` when validation failed. ``prices`` are zeros (a MILP has no
        shadow prices) and ``iterations`` is the branch-and-bound node count.
    """
    t0 = time.perf_counter()
    J = int(np.shape(problem.utility)[0]) if np.ndim(problem.utility) >= 1 else 0
    R = int(np.shape(problem.capacity)[0]) if np.ndim(problem.capacity) == 1 else 0
    try:
        problem.validate()
        if not (time_limit_s > 0):
            raise PricingInputError("time_limit_s", "must be > 0")
    except PricingInputError as err:
        return invalid_result(problem, err, t0)
    u = np.asarray(problem.utility, dtype=np.float64)
    d = np.asarray(problem.demand, dtype=np.float64)
    c = np.asarray(problem.capacity, dtype=np.float64)
    mask = np.asarray(problem.mask, dtype=bool)
    S = u.shape[1]
    with np.errstate(invalid="ignore"):
        fits = mask & np.all(np.where(mask[:, :, None], d, 0.0) <= c, axis=2)
    never_fits = ~fits.any(axis=1)
    usable = fits & (np.where(mask, u, 0.0) > 0.0)
    idx = np.flatnonzero(usable.reshape(-1))  # flat (j, s) of every variable
    choice = np.full(J, -1, dtype=np.int64)
    if idx.size == 0:
        return PricingResult(
            choice=choice,
            prices=np.zeros(R),
            primal_value=0.0,
            dual_bound=0.0,
            gap=0.0,
            iterations=0,
            wall_time_s=time.perf_counter() - t0,
            status=SolveStatus.OPTIMAL,
            never_fits=never_fits,
        )
    jobs = idx // S
    pools = np.flatnonzero(c > 0)  # a zero-capacity pool only constrains unusable shapes
    dn = d.reshape(-1, R)[idx][:, pools] / c[pools]  # [n, R'] normalised demand
    a_pool = sp.csr_matrix(dn.T)
    a_job = sp.csr_matrix((np.ones(idx.size), (jobs, np.arange(idx.size))), shape=(J, idx.size))
    a = sp.vstack([a_pool, a_job]).tocsr()
    ub = np.concatenate([np.ones(pools.size), np.ones(J)])
    res = milp(
        -u.reshape(-1)[idx],
        constraints=LinearConstraint(a, -np.inf, ub),
        integrality=np.ones(idx.size),
        bounds=Bounds(0.0, 1.0),
        options={"time_limit": float(time_limit_s), "mip_rel_gap": float(mip_rel_gap)},
    )
    nodes = int(getattr(res, "mip_node_count", 0) or 0)
    # HiGHS' bound, or (None: stopped before it had one) the trivial one, every job in its best shape
    highs_bound = getattr(res, "mip_dual_bound", None)
    trivial = float(np.where(usable, u, 0.0).max(axis=1).sum())
    if res.x is None:  # time limit before any incumbent: waiting is feasible
        bound = -float(highs_bound) if highs_bound is not None else trivial
        return PricingResult(
            choice=choice,
            prices=np.zeros(R),
            primal_value=0.0,
            dual_bound=bound,
            gap=relative_gap(0.0, bound) if np.isfinite(bound) else float("nan"),
            iterations=nodes,
            wall_time_s=time.perf_counter() - t0,
            status=SolveStatus.FEASIBLE,
            never_fits=never_fits,
            message=str(res.message),
        )
    on = res.x > 0.5
    choice[jobs[on]] = (idx[on] % S).astype(np.int64)
    # HiGHS meets constraints up to its feasibility tolerance; the contract is exact capacity
    load = d[jobs[on], idx[on] % S].sum(axis=0) if on.any() else np.zeros(R)
    repaired = bool((load > c).any())  # then the allocation is no longer the one HiGHS proved optimal
    while (load > c).any():
        r = int(np.argmax(load - c))
        users = np.flatnonzero((choice >= 0) & (d[np.arange(J), np.maximum(choice, 0), r] > 0))
        victim = users[np.argmin(u[users, choice[users]])]
        load = load - d[victim, choice[victim]]
        choice[victim] = -1
    value = allocation_value(problem, choice)
    bound = -float(highs_bound) if highs_bound is not None else trivial
    if not np.isfinite(bound):
        bound = value
    bound = max(bound, value)
    gap = relative_gap(value, bound)
    proved = res.status == 0 and not repaired
    return PricingResult(
        choice=choice,
        prices=np.zeros(R),
        primal_value=value,
        dual_bound=bound,
        gap=gap,
        iterations=nodes,
        wall_time_s=time.perf_counter() - t0,
        status=SolveStatus.OPTIMAL if proved else SolveStatus.FEASIBLE,
        never_fits=never_fits,
        message=str(res.message),
    )
