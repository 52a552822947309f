"""Prices and allocations evaluated in the pools' raw units: best response, dual bound, load, value, gap.

These are the public certificate pieces: for any prices ``p >= 0`` the Lagrangian
``L(p) = sum_j max(0, max_s u[j, s] - d[j, s] . p) + p . capacity`` bounds the optimum from above, so a
feasible allocation's value and the smallest ``L`` seen give a relative gap callers can trust.
"""

from __future__ import annotations

import numpy as np

from services.pricer.core.problem import PricingProblem

__all__ = ["allocation_load", "allocation_value", "best_response", "dual_bound", "relative_gap"]


def relative_gap(primal: float, dual: float) -> float:
    """Relative optimality gap ``(dual - primal) / dual``, clipped at 0; 0 when the bound is 0.

    Args:
        primal: value of a feasible allocation.
        dual: a valid upper bound on the optimum.

    Returns:
        The gap as a fraction (0.001 = 0.1%).
    """
    if dual <= 0.0:
        return 0.0
    return max(0.0, (dual - primal) / dual)


def allocation_load(problem: PricingProblem, choice: np.ndarray) -> np.ndarray:
    """Total demand per pool of an allocation, in the pools' units.

    Args:
        problem: the problem.
        choice: [J] shape index per job, -1 = wait.

    Returns:
        [R] float64 demand per pool.
    """
    choice = np.asarray(choice)
    jobs = np.flatnonzero(choice >= 0)
    if jobs.size == 0:
        return np.zeros(problem.num_pools)
    d = np.asarray(problem.demand)
    return np.asarray(d[jobs, choice[jobs]], dtype=np.float64).sum(axis=0)


def allocation_value(problem: PricingProblem, choice: np.ndarray) -> float:
    """Total utility of an allocation (waiting jobs contribute 0).

    Args:
        problem: the problem.
        choice: [J] shape index per job, -1 = wait.

    Returns:
        Sum of ``utility[j, choice[j]]`` over admitted jobs.
    """
    choice = np.asarray(choice)
    jobs = np.flatnonzero(choice >= 0)
    if jobs.size == 0:
        return 0.0
    return float(np.asarray(np.asarray(problem.utility)[jobs, choice[jobs]], dtype=np.float64).sum())


def _margins(problem: PricingProblem, prices: np.ndarray) -> np.ndarray:
    """u - d . p per (job, shape); -inf for padding and for shapes that do not fit an empty cluster."""
    p = np.maximum(np.asarray(prices, dtype=np.float64), 0.0)
    mask = np.asarray(problem.mask, dtype=bool)
    d = np.where(mask[:, :, None], np.asarray(problem.demand, dtype=np.float64), 0.0)
    usable = mask & np.all(d <= np.asarray(problem.capacity, dtype=np.float64), axis=2)
    u = np.where(usable, np.asarray(problem.utility, dtype=np.float64), -np.inf)
    return u - d @ p


def best_response(problem: PricingProblem, prices: np.ndarray) -> np.ndarray:
    """Every job's utility-maximising choice at the given per-unit prices.

    Ties go to the lowest shape index; a job waits when no shape has a positive margin. Shapes that
    do not fit even an empty cluster are never chosen.

    Args:
        problem: a valid problem.
        prices: [R] per-unit prices (negative entries are treated as 0).

    Returns:
        [J] int64 shape index per job, -1 = wait.
    """
    m = _margins(problem, prices)
    if m.shape[1] == 0:
        return np.full(m.shape[0], -1, dtype=np.int64)
    b = np.argmax(m, axis=1)
    best = np.take_along_axis(m, b[:, None], axis=1)[:, 0]
    return np.where(best > 0.0, b, -1).astype(np.int64)


def dual_bound(problem: PricingProblem, prices: np.ndarray) -> float:
    """Lagrangian bound ``sum_j max(0, max_s u - d . p) + p . capacity``; valid for every ``p >= 0``.

    The max runs over the shapes that fit an empty cluster (no feasible allocation uses the others).

    Args:
        problem: a valid problem.
        prices: [R] per-unit prices (negative entries are treated as 0).

    Returns:
        An upper bound on the optimal total utility.
    """
    p = np.maximum(np.asarray(prices, dtype=np.float64), 0.0)
    m = _margins(problem, p)
    best = np.max(m, axis=1, initial=0.0)
    return float(best.sum() + p @ np.asarray(problem.capacity, dtype=np.float64))

