"""The one adapter between the policy and the shadow-price solver (``services.pricer.core``).

Kept to one function so a change of the pricer's API touches one place. Solver status is data: if the
solver reports invalid input we fall back explicitly to "best shape for everyone, by utility order" and
say so in the returned info.
"""

from __future__ import annotations

import numpy as np

from services.pricer import core as pricer


def choose_shapes(utility: np.ndarray, demand: np.ndarray, mask: np.ndarray, capacity: np.ndarray,
                  warm_prices: np.ndarray | None = None, time_limit_s: float = 1.0,
                  max_iterations: int = 20, solver=None) -> tuple[np.ndarray, np.ndarray, dict]:
    """Pick one shape (or wait) per job so total utility is maximal within pool capacities.

    Args:
        utility: [J, S] utility of job j in shape s.
        demand: [J, S, R] units of pool r each shape needs.
        mask: [J, S] valid shapes.
        capacity: [R] free units per pool.
        warm_prices: previous round's prices (warm start), or None.
        time_limit_s: wall budget of one solve; a safety net only -- the iteration limit is what binds,
            so decisions do not depend on machine speed (determinism under a seed).
        max_iterations: price updates at most.
        solver: callable with the signature and result of ``services.pricer.core.solve`` (default: that
            function, in-process). The live allocator injects a pricer-service client here.

    Returns:
        (choice [J] int, -1 = wait; prices [R]; info dict with status, gap, iterations).
    """
    J = utility.shape[0]
    if J == 0:
        return np.zeros(0, np.int64), np.zeros(len(capacity)), {"status": "empty"}
    cap = np.maximum(np.asarray(capacity, float), 0.0)
    if not (cap > 0).any():
        return np.full(J, -1, np.int64), np.zeros(len(cap)), {"status": "no_capacity"}
    problem = pricer.PricingProblem(utility=np.asarray(utility, float), demand=np.asarray(demand, float),
                                    mask=np.asarray(mask, bool), capacity=cap)
    opts = pricer.SolverOptions(time_limit_s=time_limit_s, max_iterations=max_iterations, gap_tolerance=1e-2)
    res = (solver or pricer.solve)(problem, opts, warm_prices=warm_prices)
    info = {"status": res.status.value, "gap": res.gap, "iterations": res.iterations,
            "dual_bound": res.dual_bound, "primal": res.primal_value}
    if res.status == pricer.SolveStatus.INFEASIBLE_INPUT:
        info["fallback"] = f"greedy ({res.error_field}: {res.message})"
        return np.where(mask.any(axis=1), np.argmax(np.where(mask, utility, -1), axis=1), -1), np.zeros(len(cap)), info
    return np.asarray(res.choice, np.int64), np.asarray(res.prices, float), info
