"""``solve``: validate a round, iterate prices, recover the allocation, report it with its certificate."""

from __future__ import annotations

import time

import numpy as np

from services.pricer.core.dual import (
    COARSE_JOBS,
    COARSE_LEVELS,
    coarse_prices,
    elastic_steps,
    subgradient_steps,
)
from services.pricer.core.evaluate import allocation_value, relative_gap
from services.pricer.core.prepared import Incumbent, Prepared
from services.pricer.core.problem import (
    PricingInputError,
    PricingProblem,
    PricingResult,
    SolverOptions,
    SolveStatus,
    invalid_result,
)
from services.pricer.core.recovery import guard

__all__ = ["solve"]


def solve(
    problem: PricingProblem,
    options: SolverOptions | None = None,
    warm_prices: np.ndarray | None = None,
) -> PricingResult:
    """Allocate shapes by elastic shadow pricing, with an optimality certificate.

    Args:
        problem: the round's jobs, shapes and pools. It is validated first; an invalid problem yields
            status ``INFEASIBLE_INPUT`` (everyone waits) with the field in ``error_field``. Call
            ``problem.validate()`` to get the :class:`PricingInputError` instead.
        options: solver knobs (tolerance, limits, method).
        warm_prices: [R] per-unit prices to start from, typically the previous round's ``prices``.

    Returns:
        A :class:`PricingResult`; its ``choice`` never exceeds any capacity.
    """
    t0 = time.perf_counter()
    opts = options or SolverOptions()
    try:
        problem.validate()
        if warm_prices is not None:
            wp = np.asarray(warm_prices, dtype=np.float64)
            if wp.shape != (problem.num_pools,) or not np.all(np.isfinite(wp)) or (wp < 0).any():
                raise PricingInputError("warm_prices", f"must be [R] finite and >= 0, got shape {wp.shape}")
    except PricingInputError as err:
        return invalid_result(problem, err, t0)
    deadline = t0 + opts.time_limit_s
    P = Prepared(problem)
    inc = Incumbent(P)
    iterations = 0

    if P.Rp == 0 or not P.valid.any():
        # nothing is contested (or nothing usable): every job takes its best usable shape
        choice = np.full(P.J, -1, dtype=np.int64)
        if P.valid.any():
            choice = np.where(P.valid.any(axis=0), np.argmax(np.where(P.valid, P.uz, -1.0), axis=0), -1)
        inc.offer_choice(choice)
        inc.offer_bound(inc.value, np.zeros(P.Rp))
    else:
        q0 = np.zeros(P.Rp)
        tau0 = opts.smoothing * P.top_mean
        tau = tau0
        if warm_prices is not None:
            q0 = np.asarray(warm_prices, dtype=np.float64)[P.pools] * P.cap[P.pools] / P.u_scale
            tau = tau0 * opts.smoothing_decay**2
        elif opts.method == "elastic" and P.J >= 2 * COARSE_JOBS:
            q0 = coarse_prices(problem, P, opts, deadline)
            tau = tau0 * opts.smoothing_decay**COARSE_LEVELS
        if opts.method == "elastic":
            iterations = elastic_steps(P, inc, q0, tau, opts, deadline)
        else:
            iterations = subgradient_steps(P, inc, q0, opts, deadline)

    choice = guard(problem, P, inc.choice)
    value = allocation_value(problem, choice)
    bound = max(inc.bound * P.u_scale, value)  # a feasible value is a lower bound on the optimum
    gap = relative_gap(value, bound)
    prices = np.zeros(P.R)
    prices[P.pools] = inc.q * P.u_scale / P.cap[P.pools]
    return PricingResult(
        choice=choice,
        prices=prices,
        primal_value=value,
        dual_bound=bound,
        gap=gap,
        iterations=iterations,
        wall_time_s=time.perf_counter() - t0,
        status=SolveStatus.OPTIMAL if gap <= opts.gap_tolerance else SolveStatus.FEASIBLE,
        never_fits=P.never_fits.copy(),
    )

