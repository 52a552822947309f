"""Elastic Shadow Pricing: the pure solver (numpy/scipy only).

The problem
-----------
Each job ``j`` offers up to ``S`` shapes; shape ``s`` demands ``d[j, s, r] >= 0`` units of resource pool
``r`` (GPUs of a type, MPS compute share of that type in percent-of-a-GPU, GPU memory in MiB, ...) and
yields utility ``u[j, s]``; a job may also wait (utility 0, demand 0). We maximise the total utility
subject to ``sum_j d[j, s_j, r] <= capacity[r]`` for every pool and one shape (or wait) per job. This
is a multi-choice multi-dimensional knapsack: NP-hard in general, but with thousands of small jobs and
a handful of pools its LP relaxation is almost integral (a basic LP optimum has at most ``R``
fractional jobs), so prices that clear the LP market are nearly optimal for the integer problem too.

Why dual decomposition
----------------------
Pricing each pool (``p[r] >= 0`` per unit) splits the coupled problem into independent per-job choices:
given prices, job ``j`` picks ``argmax_s u[j, s] - d[j, s] . p`` or waits if that is negative. That
*best response* is one matrix-vector product and one ``argmax`` over all jobs and shapes at once, so a
round costs microseconds per thousand jobs. For any ``p >= 0`` the Lagrangian

    L(p) = sum_j max(0, max_s u[j, s] - d[j, s] . p) + p . capacity

is an upper bound on the optimum (weak duality), and its minimum equals the LP-relaxation bound.
Every answer therefore carries a certificate: ``gap = (best L - primal) / best L``.

Why "elastic" step sizes
------------------------
Pools live in very different units (GPUs vs MiB) and react to prices very differently (a memory pool
is often slack while a GPU pool is contested), so one global subgradient step size is wrong for all of
them. We work in *normalised* prices ``q[r] = p[r] * capacity[r]`` (the price of a whole pool) and give
every pool its own step ``delta[r]``:

* the price moves by ``delta[r]`` in the direction of its excess demand (projected onto ``q >= 0``);
* while the sign of the excess stays the same the market has not reacted yet, so ``delta[r]`` grows
  (x ``step_grow``); when the sign flips the price has crossed the clearing point, so ``delta[r]``
  shrinks (x ``step_shrink``) and, because both sides of the crossing are known, the new price is
  placed by *secant interpolation* of the observed demand response (the pool's measured demand
  elasticity) instead of a blind step.

This is a per-pool sign-based adaptive method (in the spirit of Rprop) plus a secant step on excess
demand: robust to units, no hand-tuned global step schedule, and it settles within a few dozen
iterations on realistic instances. Warm-starting from the previous round's prices (and step sizes)
makes consecutive rounds, whose demand changes little, converge in a handful of iterations.

Why the primal recovery looks the way it does
---------------------------------------------
The best response at the final prices can over-subscribe a pool (jobs tied at the clearing price all
say "yes") or leave capacity idle. Recovery is three vectorised passes, so the returned allocation
**never** exceeds any capacity:

1. *repair*: in every over-subscribed pool drop the admitted jobs whose margin per unit of overloaded
   capacity is smallest, the smallest prefix (sorted once, cumulative sums) that removes the excess;
2. *fill / improve*: repeatedly take, among all (job, shape) moves that strictly increase utility and
   fit into the remaining capacity, the best one per job, sort by utility gained per priced unit of
   extra demand, and accept the longest prefix whose cumulative demand fits (``np.cumsum``);
3. a final guard recomputes the load exactly and drops jobs if rounding ever pushed a pool over.

Determinism: no randomness anywhere; ties are broken by the lowest index (``argmax`` and stable sorts).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "PricingInputError",
    "SolveStatus",
    "PricingProblem",
    "SolverOptions",
    "PricingResult",
    "solve",
    "best_response",
    "dual_bound",
    "allocation_load",
    "allocation_value",
    "relative_gap",
]


class PricingInputError(ValueError):
    """The problem is malformed; ``field`` names the offending input (``utility``, ``demand``, ...)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class SolveStatus(enum.Enum):
    """What the returned allocation is worth, as data the caller can act on."""

    OPTIMAL = "optimal"  # relative gap to the dual bound within the requested tolerance
    FEASIBLE = "feasible"  # capacity-feasible, but the gap is above tolerance (time/iteration limit)
    INFEASIBLE_INPUT = "infeasible_input"  # the input failed validation; nothing was allocated


@dataclass(frozen=True)
class PricingProblem:
    """One pricing round: jobs x shapes x pools, padded to a rectangle.

    Entries where ``mask`` is False are padding and are ignored (their values are never read).
    """

    utility: np.ndarray  # [J, S] float, utility of running job j in shape s (>= 0, any unit)
    demand: np.ndarray  # [J, S, R] float, units of pool r that shape s of job j needs (>= 0)
    mask: np.ndarray  # [J, S] bool, True where shape s of job j exists
    capacity: np.ndarray  # [R] float, units available in each pool (>= 0)

    @property
    def num_jobs(self) -> int:
        """Number of jobs ``J``."""
        return int(np.shape(self.utility)[0]) if np.ndim(self.utility) >= 1 else 0

    @property
    def num_shapes(self) -> int:
        """Padded number of shapes per job ``S``."""
        return int(np.shape(self.utility)[1]) if np.ndim(self.utility) >= 2 else 0

    @property
    def num_pools(self) -> int:
        """Number of resource pools ``R``."""
        return int(np.shape(self.capacity)[0]) if np.ndim(self.capacity) >= 1 else 0

    def validate(self) -> None:
        """Check dimensions and values.

        Raises:
            PricingInputError: naming the first offending field (``utility``, ``demand``, ``mask`` or
                ``capacity``) for wrong dimensions, NaN, infinite or negative values, or no pools.
        """
        u = np.asarray(self.utility)
        d = np.asarray(self.demand)
        m = np.asarray(self.mask)
        c = np.asarray(self.capacity)
        if c.ndim != 1:
            raise PricingInputError("capacity", f"must be a 1-D array [R], got shape {c.shape}")
        if c.shape[0] == 0:
            raise PricingInputError("capacity", "no resource pools (R == 0)")
        if not np.issubdtype(c.dtype, np.number) or np.issubdtype(c.dtype, np.complexfloating):
            raise PricingInputError("capacity", f"must be real numbers, got dtype {c.dtype}")
        if np.isnan(c).any():
            raise PricingInputError("capacity", "contains NaN")
        if np.isinf(c).any():
            raise PricingInputError("capacity", "contains an infinite value")
        if (c < 0).any():
            raise PricingInputError("capacity", f"negative capacity in pool {int(np.argmax(c < 0))}")
        if not (c > 0).any():
            raise PricingInputError("capacity", "every pool is empty (all capacities are 0)")
        if u.ndim != 2:
            raise PricingInputError("utility", f"must be a 2-D array [J, S], got shape {u.shape}")
        if m.shape != u.shape:
            raise PricingInputError("mask", f"shape {m.shape} does not match utility {u.shape}")
        if m.dtype != np.bool_:
            raise PricingInputError("mask", f"must be boolean, got dtype {m.dtype}")
        if d.shape != (*u.shape, c.shape[0]):
            raise PricingInputError(
                "demand", f"shape {d.shape} does not match [J, S, R] = {(*u.shape, c.shape[0])}"
            )
        for name, arr, vals in (("utility", u, u[m]), ("demand", d, d[m])):
            if not np.issubdtype(arr.dtype, np.number) or np.issubdtype(arr.dtype, np.complexfloating):
                raise PricingInputError(name, f"must be real numbers, got dtype {arr.dtype}")
            if np.isnan(vals).any():
                raise PricingInputError(name, "contains NaN in a valid shape")
            if np.isinf(vals).any():
                raise PricingInputError(name, "contains an infinite value in a valid shape")
            if (vals < 0).any():
                raise PricingInputError(name, "contains a negative value in a valid shape")


@dataclass(frozen=True)
class SolverOptions:
    """Knobs of :func:`solve`; the defaults suit rounds of 10^2..10^5 jobs."""

    gap_tolerance: float = 1e-3  # stop once (dual bound - primal) / dual bound <= this (relative)
    max_iterations: int = 2000  # price-update iterations at most
    time_limit_s: float = 5.0  # wall-clock budget in seconds; the best allocation so far is returned
    step_grow: float = 1.3  # per-pool step multiplier while the sign of excess demand is unchanged
    step_shrink: float = 0.5  # per-pool step multiplier when the sign flips (price crossed clearing)
    initial_step: float = 0.1  # first step, as a fraction of the price scale estimated from the input
    recover_every: int = 8  # run primal recovery every this many iterations (and at the end)

    def __post_init__(self) -> None:
        if not (self.gap_tolerance >= 0):
            raise PricingInputError("options.gap_tolerance", "must be >= 0")
        if self.max_iterations < 0:
            raise PricingInputError("options.max_iterations", "must be >= 0")
        if not (self.time_limit_s > 0):
            raise PricingInputError("options.time_limit_s", "must be > 0")
        if not (self.step_grow >= 1.0):
            raise PricingInputError("options.step_grow", "must be >= 1")
        if not (0.0 < self.step_shrink < 1.0):
            raise PricingInputError("options.step_shrink", "must be in (0, 1)")
        if not (self.initial_step > 0):
            raise PricingInputError("options.initial_step", "must be > 0")
        if self.recover_every < 1:
            raise PricingInputError("options.recover_every", "must be >= 1")


@dataclass(frozen=True)
class PricingResult:
    """Outcome of one pricing round. Solver status is data: callers choose their fallback."""

    choice: np.ndarray  # [J] int, chosen shape index per job, -1 = wait
    prices: np.ndarray  # [R] float, shadow price per unit of each pool (utility per unit)
    primal_value: float  # total utility of ``choice`` (utility units)
    dual_bound: float  # best Lagrangian upper bound on the optimum found (utility units)
    gap: float  # relative gap (dual_bound - primal_value) / dual_bound, >= 0; 0 when both are 0
    iterations: int  # price-update iterations performed
    wall_time_s: float  # seconds spent in solve()
    status: SolveStatus  # OPTIMAL / FEASIBLE / INFEASIBLE_INPUT
    never_fits: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # [J] bool, no shape fits the empty cluster
    step_sizes: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [R] normalised steps, for warm starts
    error_field: str = ""  # offending field when status is INFEASIBLE_INPUT
    message: str = ""  # human-readable detail


def relative_gap(primal: float, dual: float) -> float:
    """Relative optimality gap ``(dual - primal) / dual``, clipped at 0; 0 when both are 0.

    Args:
        primal: value of a feasible allocation.
        dual: a valid upper bound on the optimum.

    Returns:
        The gap as a fraction (0.001 = 0.1%).
    """
    if dual <= 0.0:
        return 0.0 if primal >= dual else float("inf")
    return max(0.0, (dual - primal) / dual)


def allocation_load(problem: PricingProblem, choice: np.ndarray) -> np.ndarray:
    """Total demand per pool of an allocation, summed in a fixed order.

    Args:
        problem: the problem.
        choice: [J] shape index per job, -1 = wait.

    Returns:
        [R] float64 demand per pool.
    """
    choice = np.asarray(choice)
    jobs = np.flatnonzero(choice >= 0)
    d = np.asarray(problem.demand, dtype=np.float64)
    if jobs.size == 0:
        return np.zeros(problem.num_pools)
    return d[jobs, choice[jobs]].sum(axis=0)


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
    u = np.asarray(problem.utility, dtype=np.float64)
    return float(u[jobs, choice[jobs]].sum()) if jobs.size else 0.0


def best_response(problem: PricingProblem, prices: np.ndarray) -> np.ndarray:
    """Every job's utility-maximising choice at the given per-unit prices (ties: lowest index; wait wins ties at 0).

    Args:
        problem: a valid problem.
        prices: [R] per-unit prices, >= 0.

    Returns:
        [J] int shape index per job, -1 = wait.
    """
    u = np.where(problem.mask, np.asarray(problem.utility, dtype=np.float64), -np.inf)
    m = u - np.asarray(problem.demand, dtype=np.float64) @ np.asarray(prices, dtype=np.float64)
    b = np.argmax(m, axis=1)
    best = np.take_along_axis(m, b[:, None], axis=1)[:, 0]
    return np.where(best > 0.0, b, -1)


def dual_bound(problem: PricingProblem, prices: np.ndarray) -> float:
    """Lagrangian upper bound ``sum_j max(0, max_s u - d . p) + p . capacity`` (valid for any p >= 0).

    Args:
        problem: a valid problem.
        prices: [R] per-unit prices; negative entries are clipped to 0.

    Returns:
        An upper bound on the optimal total utility.
    """
    p = np.maximum(np.asarray(prices, dtype=np.float64), 0.0)
    u = np.where(problem.mask, np.asarray(problem.utility, dtype=np.float64), -np.inf)
    m = u - np.asarray(problem.demand, dtype=np.float64) @ p
    best = np.max(m, axis=1, initial=0.0) if m.shape[1] else np.zeros(m.shape[0])
    return float(np.maximum(best, 0.0).sum() + p @ np.asarray(problem.capacity, dtype=np.float64))


# ----------------------------------------------------------------------------------------------------
# internals


class _Prepared:
    """Normalised, flattened arrays the iterations work on (built once per solve)."""

    def __init__(self, problem: PricingProblem) -> None:
        u = np.asarray(problem.utility, dtype=np.float64)
        d = np.asarray(problem.demand, dtype=np.float64)
        c = np.asarray(problem.capacity, dtype=np.float64)
        J, S = u.shape
        R = c.shape[0]
        self.J, self.S, self.R = J, S, R
        # a shape is usable if it exists, is worth more than waiting and fits the empty cluster
        fits = np.all(d <= c, axis=2)
        valid = np.asarray(problem.mask, dtype=bool) & fits & (u > 0.0)
        self.never_fits = ~np.any(np.asarray(problem.mask, dtype=bool) & fits, axis=1)
        self.valid = valid
        self.u = np.where(valid, u, 0.0)
        self.d = np.where(valid[:, :, None], d, 0.0)  # raw units, for exact feasibility
        self.cap = c
        # pools that no usable shape touches never bind: keep their price at 0 and leave them out
        used = np.any(self.d > 0.0, axis=(0, 1)) & (c > 0.0)
        self.pools = np.flatnonzero(used)
        scale = np.where(c > 0.0, c, 1.0)
        dn = self.d[:, :, self.pools] / scale[self.pools]
        self.dn = np.ascontiguousarray(dn.reshape(J * S, len(self.pools)))
        self.u_scale = float(self.u.max()) if valid.any() else 1.0
        self.un = np.where(valid, self.u / self.u_scale, -np.inf).reshape(J * S)
        # float32 copies for the price iterations (memory-bound matvec); bounds are recomputed in float64
        self.dn32 = self.dn.astype(np.float32)
        self.un32 = self.un.astype(np.float32)
        self.rows = np.arange(J) * S

    # -- dual ---------------------------------------------------------------------------------------
    def respond(self, q: np.ndarray, exact: bool = False) -> tuple[np.ndarray, np.ndarray, float]:
        """Best response at normalised prices q: (choice [J], normalised load [R'], L(q) normalised)."""
        if exact:
            m = (self.un - self.dn @ q).reshape(self.J, self.S)
        else:
            m = (self.un32 - self.dn32 @ q.astype(np.float32)).reshape(self.J, self.S)
        b = np.argmax(m, axis=1)
        best = m[np.arange(self.J), b]
        act = best > 0.0
        choice = np.where(act, b, -1)
        idx = self.rows[act] + b[act]
        load = self.dn[idx].sum(axis=0)
        bound = float(best[act].sum(dtype=np.float64)) + float(q.sum())
        return choice, load, bound

    def margins(self, q: np.ndarray) -> np.ndarray:
        """Reduced utility u - dn . q per (job, shape), -inf where unusable, float64, [J, S]."""
        return (self.un - self.dn @ q).reshape(self.J, self.S)


def _invalid_result(problem: PricingProblem, err: PricingInputError, t0: float) -> PricingResult:
    J = problem.num_jobs if np.ndim(problem.utility) == 2 else 0
    R = problem.num_pools if np.ndim(problem.capacity) == 1 else 0
    return PricingResult(
        choice=np.full(J, -1, dtype=np.int64),
        prices=np.zeros(R),
        primal_value=0.0,
        dual_bound=float("nan"),
        gap=float("nan"),
        iterations=0,
        wall_time_s=time.perf_counter() - t0,
        status=SolveStatus.INFEASIBLE_INPUT,
        never_fits=np.zeros(J, dtype=bool),
        step_sizes=np.zeros(R),
        error_field=err.field,
        message=str(err),
    )


def solve(
    problem: PricingProblem,
    options: SolverOptions | None = None,
    warm_prices: np.ndarray | None = None,
    warm_steps: np.ndarray | None = None,
) -> PricingResult:
    """Allocate shapes by elastic shadow pricing, with an optimality certificate.

    Args:
        problem: the round's jobs, shapes and pools. It is validated first; an invalid problem yields
            a result with status ``INFEASIBLE_INPUT`` (everyone waits) naming the field in
            ``error_field`` (call ``problem.validate()`` yourself to get the exception instead).
        options: solver knobs (tolerance, limits, step adaptation).
        warm_prices: [R] per-unit prices to start from, typically the previous round's ``prices``.
        warm_steps: [R] normalised step sizes to start from, typically the previous round's
            ``step_sizes``; ignored without ``warm_prices``.

    Returns:
        A :class:`PricingResult` whose ``choice`` never exceeds any capacity.
    """
    t0 = time.perf_counter()
    opts = options or SolverOptions()
    try:
        problem.validate()
        if warm_prices is not None:
            wp = np.asarray(warm_prices, dtype=np.float64)
            if wp.shape != (problem.num_pools,) or not np.all(np.isfinite(wp)) or (wp < 0).any():
                raise PricingInputError("warm_prices", f"must be [R] finite and >= 0, got {wp.shape}")
    except PricingInputError as err:
        return _invalid_result(problem, err, t0)
    deadline = t0 + opts.time_limit_s
    P = _Prepared(problem)
    J, R = P.J, P.R
    Rp = len(P.pools)

    def result(choice, qn, bound_n, iters, steps):
        value = allocation_value(problem, choice)
        bound = bound_n * P.u_scale
        prices = np.zeros(R)
        if Rp:
            prices[P.pools] = qn * P.u_scale / P.cap[P.pools]
        bound = max(bound, value)  # float noise only: a feasible value is a lower bound on the optimum
        gap = relative_gap(value, bound)
        full_steps = np.zeros(R)
        if Rp:
            full_steps[P.pools] = steps
        return PricingResult(
            choice=choice.astype(np.int64),
            prices=prices,
            primal_value=value,
            dual_bound=bound,
            gap=gap,
            iterations=iters,
            wall_time_s=time.perf_counter() - t0,
            status=SolveStatus.OPTIMAL if gap <= opts.gap_tolerance else SolveStatus.FEASIBLE,
            never_fits=P.never_fits.copy(),
            step_sizes=full_steps,
        )

    if Rp == 0 or not P.valid.any():
        # nothing is contested: every job takes its best usable shape (all fit together trivially
        # only when no pool is touched; otherwise there is nothing usable)
        choice = np.full(J, -1, dtype=np.int64)
        if P.valid.any():
            b = np.argmax(np.where(P.valid, P.u, -np.inf), axis=1)
            choice = np.where(P.valid.any(axis=1), b, -1)
        value = allocation_value(problem, choice) / P.u_scale
        return result(choice, np.zeros(Rp), value, 0, np.zeros(Rp))

    # ---- initial prices and steps ---------------------------------------------------------------
    if warm_prices is not None:
        q = np.asarray(warm_prices, dtype=np.float64)[P.pools] * P.cap[P.pools] / P.u_scale
    else:
        q = np.zeros(Rp)
    choice, load, bound = P.respond(q)
    # price scale: the whole pool is worth at most the utility that wants it
    top = P.un.reshape(J, P.S).max(axis=1)
    top = top[np.isfinite(top)]
    scale = float(top.sum()) / max(Rp, 1)
    if warm_steps is not None and warm_prices is not None:
        delta = np.asarray(warm_steps, dtype=np.float64)[P.pools].copy()
        delta = np.where(delta > 0, delta, opts.initial_step * scale)
    else:
        delta = np.full(Rp, opts.initial_step * scale)
    best_bound, best_q = bound, q.copy()
    prev_sign = np.zeros(Rp)
    prev_q, prev_g = q.copy(), load - 1.0
    best_choice = None
    best_value = -np.inf
    it = 0
    for it in range(1, opts.max_iterations + 1):
        g = load - 1.0  # normalised excess demand (fraction of capacity)
        sign = np.sign(g)
        # complementary slackness: a free pool with spare capacity is where it should be
        at_floor = (q <= 0.0) & (g <= 0.0)
        sign = np.where(at_floor, 0.0, sign)
        same = (sign == prev_sign) & (sign != 0)
        flip = (sign == -prev_sign) & (sign != 0)
        delta = np.where(same, delta * opts.step_grow, np.where(flip, delta * opts.step_shrink, delta))
        step = sign * delta
        # secant on flips: the clearing price lies between prev_q and q; interpolate
        dq = q - prev_q
        dg = g - prev_g
        sec_ok = flip & (dg * dq < 0) & (np.abs(dg) > 1e-12)
        if sec_ok.any():
            target = q - g * dq / np.where(sec_ok, dg, 1.0)
            step = np.where(sec_ok, target - q, step)
        prev_q, prev_g = q, g
        prev_sign = np.where(sign != 0, sign, prev_sign)
        q = np.maximum(q + step, 0.0)
        choice, load, bound = P.respond(q)
        if bound < best_bound:
            best_bound, best_q = bound, q.copy()
        if it % opts.recover_every == 0 or time.perf_counter() > deadline:
            cand = _recover(P, best_q)
            v = float(P.u[np.arange(J), np.maximum(cand, 0)][cand >= 0].sum()) / P.u_scale
            if v > best_value:
                best_value, best_choice = v, cand
            if relative_gap(best_value, best_bound) <= opts.gap_tolerance:
                break
            if time.perf_counter() > deadline:
                break
    # certify the bound in float64
    _, _, exact = P.respond(best_q, exact=True)
    best_bound_exact = exact
    if best_choice is None:
        best_choice = _recover(P, best_q)
    best_choice = _guard(P, best_choice)
    return result(best_choice, best_q, best_bound_exact, it, delta)


def _recover(P: _Prepared, q: np.ndarray) -> np.ndarray:
    """Feasible allocation from prices q: best response, vectorised repair, vectorised greedy fill."""
    J, S = P.J, P.S
    m = P.margins(q)
    b = np.argmax(m, axis=1)
    best = m[np.arange(J), b]
    choice = np.where(best > 0.0, b, -1)
    choice = _repair(P, choice, np.maximum(best, 0.0), q)
    choice = _fill(P, choice, q)
    return choice


def _load(P: _Prepared, choice: np.ndarray) -> np.ndarray:
    jobs = np.flatnonzero(choice >= 0)
    if jobs.size == 0:
        return np.zeros(P.R)
    return P.d[jobs, choice[jobs]].sum(axis=0)


def _repair(P: _Prepared, choice: np.ndarray, margin: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Drop admitted jobs until no pool is over capacity (raw units, exact comparisons)."""
    choice = choice.copy()
    for _ in range(P.R + 1):
        load = _load(P, choice)
        over = load > P.cap
        if not over.any():
            return choice
        jobs = np.flatnonzero(choice >= 0)
        dj = P.d[jobs, choice[jobs]][:, over]  # [n, O] raw demand on overloaded pools
        excess = load[over] - P.cap[over]
        # fraction of each pool's excess that dropping the job removes
        rel = dj / excess
        use = rel.sum(axis=1)
        touch = use > 0
        jobs, dj, use = jobs[touch], dj[touch], use[touch]
        eff = margin[jobs] / use  # margin lost per unit of relieved overload
        order = np.argsort(eff, kind="stable")
        cum = np.cumsum(dj[order], axis=0)
        done = np.all(cum >= excess, axis=1)
        k = int(np.argmax(done)) + 1 if done.any() else len(order)
        choice[jobs[order[:k]]] = -1
    return choice


def _fill(P: _Prepared, choice: np.ndarray, q: np.ndarray, max_rounds: int = 64) -> np.ndarray:
    """Greedy vectorised improvement: admit waiting jobs / upgrade shapes while capacity allows."""
    J, S = P.J, P.S
    choice = choice.copy()
    load = _load(P, choice)
    ar = np.arange(J)
    w = np.zeros(P.R)
    w[P.pools] = (q + 1e-3 * (q.max() if q.size else 1.0) + 1e-12) / P.cap[P.pools]
    for _ in range(max_rounds):
        resid = P.cap - load
        cur = np.maximum(choice, 0)
        cur_u = np.where(choice >= 0, P.u[ar, cur], 0.0)
        cur_d = np.where((choice >= 0)[:, None], P.d[ar, cur], 0.0)  # [J, R]
        delta = P.d - cur_d[:, None, :]  # [J, S, R]
        gain = P.u - cur_u[:, None]
        ok = P.valid & (gain > 0) & np.all(delta <= resid, axis=2)
        if not ok.any():
            break
        cost = np.maximum(delta, 0.0) @ w + 1e-12
        score = np.where(ok, gain / cost, -np.inf)
        s = np.argmax(score, axis=1)
        jobs = np.flatnonzero(np.isfinite(score[ar, s]))
        s = s[jobs]
        sc = score[jobs, s]
        order = np.argsort(-sc, kind="stable")
        jobs, s = jobs[order], s[order]
        dl = delta[jobs, s]
        cum = np.cumsum(np.maximum(dl, 0.0), axis=0)
        fits = np.all(cum <= resid, axis=1)
        k = int(np.argmin(fits)) if not fits.all() else len(fits)
        k = max(k, 1)
        choice[jobs[:k]] = s[:k]
        load = load + dl[:k].sum(axis=0)
    return choice


def _guard(P: _Prepared, choice: np.ndarray) -> np.ndarray:
    """Final exact check: drop the lowest-utility jobs of any pool that float rounding pushed over."""
    choice = choice.copy()
    while True:
        jobs = np.flatnonzero(choice >= 0)
        if jobs.size == 0:
            return choice
        load = P.d[jobs, choice[jobs]].sum(axis=0)
        over = load > P.cap
        if not over.any():
            return choice
        users = jobs[np.any(P.d[jobs, choice[jobs]][:, over] > 0, axis=1)]
        victim = users[np.argmin(P.u[users, choice[users]], kind="stable")]
        choice[victim] = -1
