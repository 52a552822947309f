"""Dual price iterations: elasticity-scaled (trust-region Newton) steps, and the subgradient baseline.

Prices move along excess demand in normalised units ``q[r] = p[r] * capacity[r]``. A plain subgradient
step is blind to how strongly demand reacts (pools differ in units, some are contested, and they
interact: a job priced out of V100s moves to P100s), so the elastic method measures the reaction. With
a temperature ``tau`` every job's choice is made soft (``pi[j, s] ~ exp(margin / tau)``, waiting
included); the smoothed dual ``L_tau >= L`` has gradient ``1 - load`` and, as Hessian, the price
elasticity of demand

    E = -d load / d q = (1 / tau) * sum_j Cov_{s ~ pi_j}[ demand of j ],

built from the jobs at the margin. The step ``(E + mu I) dq = load - 1`` uses the smallest ``mu`` that
keeps ``|dq|`` inside a trust radius (grown after good steps, shrunk after poor ones): where pools are
redundant or barely react ``E`` is singular and ``mu`` makes it a short gradient step. Free, slack pools
stay at price 0 (projection); ``tau`` shrinks geometrically once a level has converged against the
smoothing bias ``L_tau - L``, which also bounds how far the dual can still fall, so primal recovery
waits until the bound is worth certifying. Every evaluated price vector offers its bound ``L(q)``.

Warm starts: a round's previous prices start the smoothing two levels lower; rounds of
``2 * COARSE_JOBS`` jobs or more first clear the market of an evenly strided sample (the dual is an
average over jobs, so the sample's prices are nearly right). The subgradient method (per-pool
sign-adaptive steps, interpolating on a sign flip) is the simple, robust comparison; it stalls in the
valleys that interacting pools create.
"""

from __future__ import annotations

import time

import numpy as np

from services.pricer.core.prepared import Incumbent, Prepared, flush
from services.pricer.core.problem import PricingProblem, SolverOptions
from services.pricer.core.recovery import recover_into

__all__ = ["COARSE_JOBS", "COARSE_LEVELS", "coarse_prices", "elastic_steps", "subgradient_steps"]

# rounds of at least 2x this many jobs first clear the market of a sample this size (see coarse_prices)
COARSE_JOBS = 4096
_MU_GRID = 2.0 ** -np.arange(0.0, 80.0, 0.125)  # trust-region multipliers tried, relative to |g| / trust
_WARM_TRUST = 0.02  # first step of a warm start, as a fraction of the largest price
COARSE_LEVELS = 2  # temperature levels solved on the sample; the full round starts at the next one


def coarse_prices(problem: PricingProblem, P: Prepared, opts: SolverOptions, deadline: float) -> np.ndarray:
    """Warm start for very large rounds: clear the market of an evenly strided sample of the jobs.

    A sample of ``COARSE_JOBS`` jobs facing the same fraction of every pool has nearly the same
    clearing prices (the dual is an average over jobs), and costs a fraction of a full iteration.
    Returns normalised prices for ``P``.
    """
    k = -(-P.J // COARSE_JOBS)
    sub = PricingProblem(
        utility=np.asarray(problem.utility)[::k],
        demand=np.asarray(problem.demand)[::k],
        mask=np.asarray(problem.mask)[::k],
        capacity=np.asarray(problem.capacity, dtype=np.float64) / k,
    )
    Ps = Prepared(sub)
    q = np.zeros(P.Rp)
    if Ps.Rp == 0:
        return q
    inc = Incumbent(Ps)
    tau_stop = opts.smoothing * Ps.top_mean * opts.smoothing_decay**COARSE_LEVELS
    elastic_steps(Ps, inc, np.zeros(Ps.Rp), opts.smoothing * Ps.top_mean, opts, deadline, tau_stop=tau_stop)
    p = np.zeros(P.R)
    p[Ps.pools] = inc.q * Ps.u_scale / Ps.cap[Ps.pools]  # per-unit prices carry over unchanged
    return p[P.pools] * P.cap[P.pools] / P.u_scale


def elastic_steps(
    P: Prepared, inc: Incumbent, q: np.ndarray, tau: float, opts: SolverOptions, deadline: float, tau_stop: float = 0.0
) -> int:
    """Minimise the dual by projected elasticity-scaled (Newton) steps; returns the iteration count.

    Each temperature level is minimised until the predicted further decrease is small against the
    smoothing bias ``L_tau - L``; then the temperature drops. The bias also bounds how far the dual
    can still fall, so primal recovery runs only once it is below the gap tolerance (or at the end).
    With ``tau_stop > 0`` only the dual is solved, down to that temperature (no primal recovery).
    """
    tau_min = 1e-9 * P.top_mean
    L, Lt, load, pi, wait = P.smooth(q, tau)
    H = P.elasticity(pi, wait, tau)
    inc.offer_bound(L, q)
    if q.any():  # warm start: the prices are roughly right already
        trust = _WARM_TRUST * float(q.max())
    else:
        trust = 0.1 * P.top_mean * P.J / max(P.Rp, 1)
    last_step = trust
    it = 0
    while it < opts.max_iterations:
        it += 1
        g = 1.0 - load  # gradient of L_tau: minus the (soft) excess demand
        free = ~((q <= 0.0) & (g > 0.0))  # projection: a free pool with spare capacity stays at 0
        # Trust-region Newton step (H + mu I) dq = -g with the smallest mu >= 0 that keeps |dq| <= trust.
        # Pools can be (nearly) redundant -- GPUs and compute share of one type move together -- or
        # barely react; there H is (nearly) singular and mu turns the step into a short gradient step.
        lam, vec = np.linalg.eigh(H[np.ix_(free, free)]) if free.any() else (np.zeros(0), np.zeros((0, 0)))
        lam = np.maximum(lam, 0.0)
        gv = vec.T @ -g[free]
        decrease = 0.0
        accepted = False
        for _ in range(30 if float(np.abs(gv).max(initial=0.0)) > 1e-12 else 0):  # else: market cleared
            mu = _trust_mu(lam, gv, trust)
            step = np.zeros(P.Rp)
            den = lam + mu
            step[free] = vec @ np.divide(gv, den, out=np.zeros_like(gv), where=den > 0.0)
            qn = flush(np.maximum(q + step, 0.0))
            dq = qn - q
            pred = -(float(g @ dq) + 0.5 * float(dq @ H @ dq))  # model decrease (after projection)
            Ln, Ltn, loadn, pin, waitn = P.smooth(qn, tau)
            inc.offer_bound(Ln, qn)
            actual = Lt - Ltn
            size = float(np.sqrt(dq @ dq))
            if pred > 0.0 and actual > 1e-4 * pred:
                accepted = True
                if actual > 0.75 * pred and size >= 0.9 * trust:
                    trust *= 2.0
                elif actual < 0.25 * pred:
                    trust = 0.5 * size
                break
            trust = 0.25 * max(size, 1e-300)
            if trust < 1e-14 * (1.0 + float(q.max())):
                break
        if accepted:
            decrease = actual
            last_step = size
            q, L, Lt, load = qn, Ln, Ltn, loadn
            H = P.elasticity(pin, waitn, tau)  # pin is only valid until the next smooth() call
        bias = Lt - L  # smoothing bias: also an estimate of how far the dual can still fall
        if time.perf_counter() > deadline:
            break
        if accepted and decrease > 0.05 * bias + 1e-12 * abs(Lt):
            continue
        # this temperature level has converged
        if tau_stop > 0.0:
            if tau <= tau_stop * (1.0 + 1e-9):
                return it
        elif bias <= 0.5 * opts.gap_tolerance * abs(L) or tau <= tau_min:
            recover_into(P, inc, opts, deadline, final=tau <= tau_min)
            if inc.gap() <= opts.gap_tolerance or tau <= tau_min:
                return it
        tau = max(tau * opts.smoothing_decay, tau_min)
        trust = 2.0 * last_step
        L, Lt, load, pi, wait = P.smooth(q, tau)
        H = P.elasticity(pi, wait, tau)
        inc.offer_bound(L, q)
    if tau_stop <= 0.0:
        recover_into(P, inc, opts, deadline, final=True)
    return it


def _trust_mu(lam: np.ndarray, gv: np.ndarray, trust: float) -> float:
    """Smallest mu >= 0 (to a factor 2**(1/8)) with |gv / (lam + mu)| <= trust.

    The step length falls monotonically in mu and ``mu = |gv| / trust`` always satisfies the bound, so
    one broadcast over a geometric grid below it finds mu without a scalar loop.
    """
    if lam.size == 0:
        return 0.0
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # inf/nan norms just mean "too long"
        if lam.min() > 0.0 and float(np.sqrt(np.sum((gv / lam) ** 2))) <= trust:
            return 0.0
        hi = float(np.sqrt(gv @ gv)) / max(trust, 1e-300)
        mus = hi * _MU_GRID
        norms = np.sqrt(np.sum((gv / (lam + mus[:, None])) ** 2, axis=1))
    ok = norms <= trust  # True for a prefix of the grid (large mu), then False
    k = int(np.argmin(ok)) if not ok.all() else ok.size
    return float(mus[max(k - 1, 0)])


def subgradient_steps(P: Prepared, inc: Incumbent, q: np.ndarray, opts: SolverOptions, deadline: float) -> int:
    """Minimise the dual by projected subgradient steps with per-pool sign-adaptive sizes."""
    scale = P.top_mean * P.J / max(P.Rp, 1)
    delta = np.full(P.Rp, opts.initial_step * scale)
    _, load, L = P.respond(q)
    inc.offer_bound(L, q)
    prev_sign = np.zeros(P.Rp)
    prev_q, prev_g = q.copy(), load - 1.0
    it = 0
    while it < opts.max_iterations:
        it += 1
        g = load - 1.0  # excess demand as a fraction of capacity
        sign = np.sign(g)
        sign[(q <= 0.0) & (g <= 0.0)] = 0.0  # a free pool with spare capacity is where it should be
        same = (sign == prev_sign) & (sign != 0)
        flip = (sign == -prev_sign) & (sign != 0)
        delta = np.where(same, delta * opts.step_grow, np.where(flip, delta * opts.step_shrink, delta))
        step = sign * delta
        # on a flip the clearing price lies between the last two prices: interpolate the demand response
        dq, dg = q - prev_q, g - prev_g
        sec = flip & (dg * dq < 0) & (np.abs(dg) > 1e-12)
        if sec.any():
            step = np.where(sec, -g * dq / np.where(sec, dg, 1.0), step)
        prev_q, prev_g = q, g
        prev_sign = np.where(sign != 0, sign, prev_sign)
        q = flush(np.maximum(q + step, 0.0))
        _, load, L = P.respond(q)
        inc.offer_bound(L, q)
        if it % opts.recover_every == 0:
            recover_into(P, inc, opts, deadline)
            if inc.gap() <= opts.gap_tolerance:
                return it
        if time.perf_counter() > deadline:
            break
    recover_into(P, inc, opts, deadline, final=True)
    return it

