"""Elastic Shadow Pricing: the pure solver of ElastiCo (numpy/scipy only).

The problem
-----------
Each job ``j`` offers up to ``S`` shapes; shape ``s`` demands ``d[j, s, r] >= 0`` units of resource pool
``r`` (GPUs of a type, MPS compute share of that type in percent-of-a-GPU, GPU memory in MiB, ...) and
yields utility ``u[j, s]``; a job may also wait (utility 0, demand 0). We maximise total utility subject
to ``sum_j d[j, s_j, r] <= capacity[r]`` for every pool, one shape (or wait) per job. This is a
multi-choice multi-dimensional knapsack: NP-hard in general, but with many small jobs and a handful of
pools its LP relaxation is almost integral (a basic LP optimum has at most ``R`` fractional jobs), so
prices that clear the LP market are nearly optimal for the integer problem as well.

Why dual decomposition
----------------------
A price ``p[r] >= 0`` per unit of every pool splits the coupled problem into independent per-job
choices: given prices, job ``j`` takes ``argmax_s u[j, s] - d[j, s] . p``, or waits if that is negative.
This *best response* is one matrix-vector product and one max over all jobs and shapes at once. For
any ``p >= 0`` the Lagrangian

    L(p) = sum_j max(0, max_s u[j, s] - d[j, s] . p) + p . capacity

bounds the optimum from above (weak duality); its minimum equals the LP-relaxation bound. Every answer
therefore carries a certificate: ``gap = (min L seen - value of the returned allocation) / min L``.

Why "elastic" price steps
-------------------------
Prices move along excess demand, but a plain subgradient step is blind to *how strongly demand reacts*:
pools live in different units (GPUs vs MiB), some are contested and some slack, and pools interact (a
job priced out of V100s moves to P100s). We work in normalised prices ``q[r] = p[r] * capacity[r]`` and
measure the reaction directly. With a small temperature ``tau`` every job's choice is made soft
(``pi[j, s] ~ exp(margin / tau)``, the wait option included), which turns the piecewise-linear dual into
a smooth one, ``L_tau >= L``, whose gradient is ``1 - load`` (minus the excess demand) and whose Hessian
is the price elasticity of demand,

    E = -d load / d q = (1 / tau) * sum_j Cov_{s ~ pi_j}[ demand of j ],

an ``R x R`` matrix built from the jobs that are at the margin (the others do not react). The price step
is the excess demand divided by that elasticity, ``dq = E^-1 (load - 1)``: a projected gradient step on
excess demand whose per-pool step sizes (and cross-pool corrections) adapt to how demand reacts. It is
taken inside a trust region, ``(E + mu I) dq = load - 1`` with the smallest ``mu`` that keeps ``|dq|``
within a radius that grows after good steps and shrinks after poor ones: where pools are redundant
(GPUs and compute share of one type move together) or barely react, ``E`` is singular and ``mu`` turns
the step into a short plain gradient step instead of a jump. Pools that are free and slack stay at
price 0 (projection), and ``tau`` shrinks geometrically once a level has converged -- judged against
the smoothing bias ``L_tau - L``, which also bounds how much the dual can still fall, so primal recovery
waits until the bound is worth certifying. Every evaluated price vector yields a valid bound ``L(q)``;
the smallest is reported. A dozen to two dozen best responses reach the LP-optimal prices within a
fraction of a permille on the trace-built rounds.

Warm starts: a round's previous prices start the smoothing two levels lower. Rounds of 8,192 jobs or more
first clear the market of an evenly strided sample of 4,096 jobs facing the same fraction of every
pool (the dual is an average over jobs, so the sample's prices are nearly right) and start from those.

``SolverOptions(method="subgradient")`` runs the classic alternative for comparison: a per-pool
sign-adaptive step (grow while the sign of the excess stays, shrink and interpolate on a flip). It is
simple and robust but stalls in the valleys that interacting pools create; the benchmark shows both.

Why the primal recovery looks the way it does
---------------------------------------------
For any feasible allocation ``x`` and prices ``q``, ``value(x) = L(q) - sum_j rc_j(x_j) - q . slack(x)``,
where ``rc`` is the reduced-cost loss of a job's option against its best response. A good allocation is
thus near the best response at the final prices, wastes little priced capacity, and never exceeds any
pool. Recovery is vectorised throughout:

1. *repair*: start from the best response; while a pool is over capacity, move the admitted jobs of the
   most over-subscribed pool to their cheapest alternative (smaller shape, other GPU type or wait),
   cheapest per unit of relieved capacity first, the shortest sorted prefix that removes the excess
   (``np.cumsum`` + ``np.searchsorted``) -- the order a price rise on that pool would produce;
2. *fill*: among all (job, shape) moves that raise utility and fit the remaining capacity, take the best
   per job, sort, and accept the longest prefix whose cumulative demand fits; repeat until nothing fits;
3. *exchange*: among the jobs cheapest to move at the current prices, evaluate pairs (improve one job,
   downgrade or park another) best net gain first, apply the first pair that fits, refill; repeat;
4. only if the gap is still open once the dual has converged: restart 1-2 from a fixed list of slightly
   perturbed prices (which changes which near-tied jobs get in) and run 3 on the best result;
5. a final guard recomputes the load in raw units and drops jobs if float rounding ever pushed a pool
   over its capacity.

Where the LP relaxation is loose (tens of jobs over several pools) the integer optimum can lie well
below the bound; the gap then reports that honestly and the status is ``FEASIBLE``.

Determinism: no randomness; ties are broken by the lowest index (``argmax``, stable sorts). Only a
time limit that cuts a solve short can make two runs differ (the iteration limit never does).
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


def _as_array(name: str, value) -> np.ndarray:
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as err:  # ragged nested lists and the like
        raise PricingInputError(name, f"not a rectangular array ({err})") from None


def _check_real(name: str, arr: np.ndarray) -> None:
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.number) or np.issubdtype(
        arr.dtype, np.complexfloating
    ):
        raise PricingInputError(name, f"must hold real numbers, got dtype {arr.dtype}")


@dataclass(frozen=True)
class PricingProblem:
    """One pricing round: jobs x shapes x pools, padded to a rectangle.

    Entries where ``mask`` is False are padding: their values are never read.
    """

    utility: np.ndarray  # [J, S] float, utility of running job j in shape s (>= 0; any unit, e.g. normalised throughput x weight)
    demand: np.ndarray  # [J, S, R] float, units of pool r that shape s of job j needs (>= 0; the pool's unit: GPUs, %, MiB)
    mask: np.ndarray  # [J, S] bool, True where shape s of job j exists
    capacity: np.ndarray  # [R] float, units available in each pool (>= 0, at least one > 0)

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
            PricingInputError: naming the offending field (``capacity``, ``utility``, ``mask`` or
                ``demand``) for wrong dimensions or dtypes, NaN, infinite or negative values in a valid
                shape, no pools at all, or every pool empty.
        """
        c = _as_array("capacity", self.capacity)
        u = _as_array("utility", self.utility)
        m = _as_array("mask", self.mask)
        d = _as_array("demand", self.demand)
        if c.ndim != 1:
            raise PricingInputError("capacity", f"must be a 1-D array [R], got shape {c.shape}")
        if c.shape[0] == 0:
            raise PricingInputError("capacity", "no resource pools (R == 0)")
        _check_real("capacity", c)
        if np.isnan(c).any():
            raise PricingInputError("capacity", f"NaN in pool {int(np.argmax(np.isnan(c)))}")
        if np.isinf(c).any():
            raise PricingInputError("capacity", f"infinite value in pool {int(np.argmax(np.isinf(c)))}")
        if (c < 0).any():
            raise PricingInputError("capacity", f"negative value in pool {int(np.argmax(c < 0))}")
        if not (c > 0).any():
            raise PricingInputError("capacity", "every pool is empty (all capacities are 0)")
        if u.ndim != 2:
            raise PricingInputError("utility", f"must be a 2-D array [J, S], got shape {u.shape}")
        _check_real("utility", u)
        if m.shape != u.shape:
            raise PricingInputError("mask", f"shape {m.shape} does not match utility {u.shape}")
        if m.dtype != np.bool_:
            raise PricingInputError("mask", f"must be boolean, got dtype {m.dtype}")
        if d.shape != (*u.shape, c.shape[0]):
            raise PricingInputError("demand", f"shape {d.shape} is not [J, S, R] = {(*u.shape, c.shape[0])}")
        _check_real("demand", d)
        for name, arr, where in (("utility", u, m), ("demand", d, m[:, :, None])):
            # one fast pass; only a failure pays for finding out what is wrong
            with np.errstate(invalid="ignore"):
                good = np.isfinite(arr) & (arr >= 0)
            if np.all(good | ~where):
                continue
            vals = arr[np.broadcast_to(where, arr.shape) & ~good]
            if np.isnan(vals).any():
                raise PricingInputError(name, "NaN in a valid shape")
            if np.isinf(vals).any():
                raise PricingInputError(name, "infinite value in a valid shape")
            raise PricingInputError(name, "negative value in a valid shape")


@dataclass(frozen=True)
class SolverOptions:
    """Knobs of :func:`solve`; the defaults suit rounds of 10^2..10^5 jobs."""

    gap_tolerance: float = 1e-3  # stop once (dual bound - primal) / dual bound <= this (fraction)
    max_iterations: int = 200  # price updates at most (Newton steps, or subgradient steps)
    time_limit_s: float = 10.0  # wall-clock budget in seconds; the best allocation so far is returned
    method: str = "elastic"  # "elastic" (elasticity-scaled steps) or "subgradient" (sign-adaptive steps)
    smoothing: float = 0.05  # first temperature, as a fraction of the mean best utility per job
    smoothing_decay: float = 0.125  # temperature multiplier once a level has converged
    step_grow: float = 1.3  # subgradient: per-pool step multiplier while the sign of excess persists
    step_shrink: float = 0.5  # subgradient: per-pool step multiplier when the sign flips
    initial_step: float = 0.1  # subgradient: first step, fraction of the estimated price scale
    recover_every: int = 25  # subgradient: run primal recovery every this many iterations
    exchange_rounds: int = 30  # pair-exchange improvement rounds at most per recovery

    def __post_init__(self) -> None:
        if not (self.gap_tolerance >= 0):
            raise PricingInputError("options.gap_tolerance", "must be >= 0")
        if self.max_iterations < 0:
            raise PricingInputError("options.max_iterations", "must be >= 0")
        if not (self.time_limit_s > 0):
            raise PricingInputError("options.time_limit_s", "must be > 0")
        if self.method not in ("elastic", "subgradient"):
            raise PricingInputError("options.method", "must be 'elastic' or 'subgradient'")
        if not (self.smoothing > 0):
            raise PricingInputError("options.smoothing", "must be > 0")
        if not (0.0 < self.smoothing_decay < 1.0):
            raise PricingInputError("options.smoothing_decay", "must be in (0, 1)")
        if not (self.step_grow >= 1.0):
            raise PricingInputError("options.step_grow", "must be >= 1")
        if not (0.0 < self.step_shrink < 1.0):
            raise PricingInputError("options.step_shrink", "must be in (0, 1)")
        if not (self.initial_step > 0):
            raise PricingInputError("options.initial_step", "must be > 0")
        if self.recover_every < 1:
            raise PricingInputError("options.recover_every", "must be >= 1")
        if self.exchange_rounds < 0:
            raise PricingInputError("options.exchange_rounds", "must be >= 0")


@dataclass(frozen=True)
class PricingResult:
    """Outcome of one pricing round. Solver status is data: callers choose their fallback."""

    choice: np.ndarray  # [J] int64, chosen shape index per job, -1 = wait
    prices: np.ndarray  # [R] float, shadow price per unit of each pool (utility per pool unit)
    primal_value: float  # total utility of ``choice`` (utility units)
    dual_bound: float  # smallest Lagrangian upper bound on the optimum seen (utility units)
    gap: float  # relative gap (dual_bound - primal_value) / dual_bound, >= 0 (fraction)
    iterations: int  # price updates performed
    wall_time_s: float  # seconds spent in solve()
    status: SolveStatus  # OPTIMAL / FEASIBLE / INFEASIBLE_INPUT
    never_fits: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # [J] bool, no shape fits even an empty cluster
    error_field: str = ""  # the offending input field when status is INFEASIBLE_INPUT
    message: str = ""  # human-readable detail


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


# ----------------------------------------------------------------------------------------------------
# internals: everything below works on normalised, shape-major arrays
#   column k = s * J + j holds shape s of job j; demand is divided by capacity (a full pool is 1.0)
#   and utility by its maximum (so prices and temperatures are scale-free).


class _Prepared:
    """Normalised, flattened arrays the iterations work on (built once per solve)."""

    def __init__(self, problem: PricingProblem) -> None:
        c = np.asarray(problem.capacity, dtype=np.float64)
        # the one big copy: demand in pool-major, shape-major layout [R, S, J]; every pass below is
        # then a contiguous sweep, and the normalised demand is computed in place
        dT = np.array(np.asarray(problem.demand).transpose(2, 1, 0), dtype=np.float64, order="C", copy=True)
        uT = np.ascontiguousarray(np.asarray(problem.utility, dtype=np.float64).T)  # [S, J]
        maskT = np.ascontiguousarray(np.asarray(problem.mask, dtype=bool).T)
        S, J = uT.shape
        self.J, self.S, self.R = J, S, c.shape[0]
        self.cap = c
        fits = maskT.copy()
        with np.errstate(invalid="ignore"):  # padding may hold NaN; it is masked out
            for r in range(self.R):
                fits &= dT[r] <= c[r]
            self.never_fits = ~np.any(fits, axis=0)
            # a shape is usable when it exists, beats waiting and fits an empty cluster
            valid = fits & (uT > 0.0)
            # pools no usable shape touches never bind: their price stays 0 and they are left out
            touched = np.array([c[r] > 0.0 and bool(np.any((dT[r] > 0.0) & valid)) for r in range(self.R)], bool)
        self.pools = np.flatnonzero(touched)
        Rp = self.pools.size
        self.Rp = Rp
        self.valid = valid  # [S, J]
        uv = np.where(valid, uT, 0.0)
        self.u_scale = float(uv.max()) if valid.any() else 1.0
        self.uz = uv / self.u_scale  # [S, J], 0 where unusable
        self.un = np.where(valid, self.uz, -np.inf).reshape(S * J)  # [S*J], -inf where unusable
        dn = dT if Rp == self.R else dT[self.pools]
        invalid = ~valid
        for k, r in enumerate(self.pools):
            dn[k] /= c[r]  # demand as a fraction of the pool
            np.copyto(dn[k], 0.0, where=invalid | (dn[k] < _TINY))  # no subnormal numbers downstream
        self.dnT = dn.reshape(Rp, S * J)  # [Rp, S*J]
        self.dn3 = self.dnT.reshape(Rp, S, J)
        self.ar = np.arange(J)
        top = self.uz.max(axis=0) if S else np.zeros(J)
        self.top_mean = float(top[top > 0].mean()) if (top > 0).any() else 1.0
        self._big = S * J >= _BIG
        # workspaces for the hot loop: fresh multi-megabyte temporaries cost page faults every call
        self._w1 = np.empty(S * J)
        self._w2 = np.empty(S * J)
        hn = S * min(J, _HESSIAN_JOBS)
        self._h1 = np.empty((Rp, hn))
        self._h2 = np.empty((Rp, hn))

    # -- dual -----------------------------------------------------------------------------------------
    def _qd(self, q: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``q @ dnT`` [S*J]. Above ``_BIG`` columns numpy's own loop (einsum) beats BLAS gemv here: the
        product is memory-bound, and a multi-threaded BLAS call stalls whenever another process holds
        the second core."""
        if self._big:
            return np.einsum("r,rk->k", q, self.dnT, out=out)
        return np.matmul(q, self.dnT, out=out)

    def margins(self, q: np.ndarray) -> np.ndarray:
        """Reduced utility ``u - dn . q`` per (shape, job), -inf where unusable, [S, J]."""
        return (self.un - self._qd(q)).reshape(self.S, self.J)

    def respond(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
        """Hard best response at q: (choice [J], normalised load [Rp], L(q) normalised)."""
        m = self.margins(q)
        mx = m.max(axis=0)
        choice = _argmax0(m, mx)
        act = mx > 0.0
        choice[~act] = -1
        load = self.load(choice)
        return choice, load, float(mx[act].sum() + q.sum())

    def smooth(self, q: np.ndarray, tau: float) -> tuple[float, float, np.ndarray, np.ndarray, np.ndarray]:
        """Soft response at temperature tau.

        Returns (L(q), L_tau(q), soft load [Rp], choice probabilities [S, J], wait probability [J]).
        The probabilities live in a workspace buffer: they are valid until the next call.
        """
        S, J = self.S, self.J
        m = self._qd(q, out=self._w1)
        np.subtract(self.un, m, out=m)
        m2 = m.reshape(S, J)
        mx = np.maximum(m2.max(axis=0), 0.0)
        e = np.subtract(m2, mx, out=self._w2.reshape(S, J))
        e *= 1.0 / tau
        # below exp(-600) a choice is irrelevant; flooring keeps subnormal numbers out of every later
        # product (they make arithmetic ~100x slower). Unusable shapes get weight e^-600 on zero demand.
        np.maximum(e, _EXP_FLOOR, out=e)
        np.exp(e, out=e)
        e0 = np.exp(np.maximum(mx * (-1.0 / tau), _EXP_FLOOR))
        Z = e.sum(axis=0)
        Z += e0
        logZ = np.log(Z)
        np.divide(e, Z, out=e)  # now the choice probabilities
        qs = float(q.sum())
        L = float(mx.sum()) + qs
        Lt = float(mx.sum() + tau * logZ.sum()) + qs
        load = np.einsum("rk,k->r", self.dnT, self._w2) if self._big else self.dnT @ self._w2
        return L, Lt, load, e, e0 / Z

    def elasticity(self, pi: np.ndarray, wait: np.ndarray, tau: float) -> np.ndarray:
        """Price elasticity of the soft demand, ``-d load / d q`` = sum_j Cov_pi_j[demand] / tau, [Rp, Rp].

        Only jobs whose soft choice is spread react (the others contribute ~0). Up to
        ``_HESSIAN_JOBS`` of them are used exactly; beyond that an evenly strided, deterministic sample
        of all jobs is used and scaled up: the trust-region step only needs a good direction.
        """
        spread = (pi.max(axis=0) < 1.0 - 1e-7) & (wait < 1.0 - 1e-7)
        n_spread = int(np.count_nonzero(spread))
        if n_spread == 0:
            return np.zeros((self.Rp, self.Rp))
        if n_spread <= _HESSIAN_JOBS:
            jobs = np.flatnonzero(spread)
            X = _cols(self.dn3, jobs)  # [Rp, S, n]
            W = _cols(pi, jobs)
            scale = 1.0
        else:
            k = -(-self.J // _HESSIAN_JOBS)
            X = self.dn3[:, :, ::k]
            W = pi[:, ::k]
            scale = self.J / W.shape[1]
        n = W.shape[1]
        Xw = np.multiply(X, W, out=self._h1[:, : self.S * n].reshape(self.Rp, self.S, n))
        if not X.flags.c_contiguous:  # the strided sample: copy once so the product below is one GEMM
            buf = self._h2[:, : self.S * n].reshape(self.Rp, self.S, n)
            np.copyto(buf, X)
            X = buf
        mu = Xw.sum(axis=1)  # [Rp, n] expected demand per job
        H = Xw.reshape(self.Rp, -1) @ X.reshape(self.Rp, -1).T - mu @ mu.T
        return H * (scale / tau)

    # -- primal ---------------------------------------------------------------------------------------
    def load(self, choice: np.ndarray) -> np.ndarray:
        """Normalised load [Rp] of an allocation."""
        jobs = np.flatnonzero(choice >= 0)
        if jobs.size == 0:
            return np.zeros(self.Rp)
        return np.take(self.dnT, choice[jobs] * self.J + jobs, axis=1).sum(axis=1)

    def value(self, choice: np.ndarray) -> float:
        """Normalised utility of an allocation."""
        jobs = np.flatnonzero(choice >= 0)
        return float(self.uz[choice[jobs], jobs].sum()) if jobs.size else 0.0


# jobs used at most to estimate the elasticity matrix (see _Prepared.elasticity)
_HESSIAN_JOBS = 4096
# rounds of at least 2x this many jobs first clear the market of a sample this size (see _coarse_prices)
_COARSE_JOBS = 4096
_MU_GRID = 2.0 ** -np.arange(0.0, 80.0, 0.125)  # trust-region multipliers tried, relative to |g| / trust
_WARM_TRUST = 0.02  # first step of a warm start, as a fraction of the largest price
_COARSE_LEVELS = 2  # temperature levels solved on the sample; the full round starts at the next one


_BIG = 1 << 16  # (shape, job) columns from which the big matvecs avoid BLAS (see _Prepared._qd)
_EXP_FLOOR = -600.0  # smallest exponent in the soft response (exp(-600) ~ 1e-261, far from subnormal)
_TINY = 1e-200  # normalised demands and prices below this are zero (subnormal arithmetic is ~100x slower)


def _flush(q: np.ndarray) -> np.ndarray:
    """Prices that have decayed to nothing become exactly 0 (no subnormal numbers in the matvecs)."""
    q[q < _TINY] = 0.0
    return q


def _cols(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``a[..., idx]`` as a C-contiguous array (fancy indexing on the last axis returns a strided
    layout that makes every later reduction several times slower)."""
    if idx is None:
        return a
    return np.take(a, idx, axis=-1)


def _argmax0(m: np.ndarray, mx: np.ndarray) -> np.ndarray:
    """First index of the maximum along axis 0 (faster than ``argmax(axis=0)`` for short axes)."""
    b = np.zeros(m.shape[1], dtype=np.int64)
    for s in range(m.shape[0] - 1, 0, -1):
        b[m[s] == mx] = s
    first = m[0] == mx
    b[first] = 0
    return b


def invalid_result(problem: PricingProblem, err: PricingInputError, t0: float) -> PricingResult:
    """The INFEASIBLE_INPUT result for ``err``: everyone waits, the field is named (shared with the MILP)."""
    try:
        J = int(np.shape(problem.utility)[0]) if np.ndim(problem.utility) >= 1 else 0
    except (ValueError, TypeError):
        J = 0
    try:
        R = int(np.shape(problem.capacity)[0]) if np.ndim(problem.capacity) == 1 else 0
    except (ValueError, TypeError):
        R = 0
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
        error_field=err.field,
        message=str(err),
    )


class _Incumbent:
    """Best dual bound (with its prices) and best feasible allocation seen so far."""

    def __init__(self, P: _Prepared) -> None:
        self.P = P
        self.bound = np.inf
        self.q = np.zeros(P.Rp)
        self.choice = np.full(P.J, -1, dtype=np.int64)
        self.value = 0.0

    def offer_bound(self, L: float, q: np.ndarray) -> None:
        if L < self.bound:
            self.bound, self.q = L, q.copy()

    def offer_choice(self, choice: np.ndarray) -> None:
        v = self.P.value(choice)
        if v > self.value:
            self.value, self.choice = v, choice

    def gap(self) -> float:
        return relative_gap(self.value, self.bound)


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
    P = _Prepared(problem)
    inc = _Incumbent(P)
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
        elif opts.method == "elastic" and P.J >= 2 * _COARSE_JOBS:
            q0 = _coarse_prices(problem, P, opts, deadline)
            tau = tau0 * opts.smoothing_decay**_COARSE_LEVELS
        if opts.method == "elastic":
            iterations = _elastic(P, inc, q0, tau, opts, deadline)
        else:
            iterations = _subgradient(P, inc, q0, opts, deadline)

    choice = _guard(problem, P, inc.choice)
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


# ----------------------------------------------------------------------------------------------------
# dual: elasticity-scaled steps on smoothed excess demand


def _coarse_prices(problem: PricingProblem, P: _Prepared, opts: SolverOptions, deadline: float) -> np.ndarray:
    """Warm start for very large rounds: clear the market of an evenly strided sample of the jobs.

    A sample of ``_COARSE_JOBS`` jobs facing the same fraction of every pool has nearly the same
    clearing prices (the dual is an average over jobs), and costs a fraction of a full iteration.
    Returns normalised prices for ``P``.
    """
    k = -(-P.J // _COARSE_JOBS)
    sub = PricingProblem(
        utility=np.asarray(problem.utility)[::k],
        demand=np.asarray(problem.demand)[::k],
        mask=np.asarray(problem.mask)[::k],
        capacity=np.asarray(problem.capacity, dtype=np.float64) / k,
    )
    Ps = _Prepared(sub)
    q = np.zeros(P.Rp)
    if Ps.Rp == 0:
        return q
    inc = _Incumbent(Ps)
    tau_stop = opts.smoothing * Ps.top_mean * opts.smoothing_decay**_COARSE_LEVELS
    _elastic(Ps, inc, np.zeros(Ps.Rp), opts.smoothing * Ps.top_mean, opts, deadline, tau_stop=tau_stop)
    p = np.zeros(P.R)
    p[Ps.pools] = inc.q * Ps.u_scale / Ps.cap[Ps.pools]  # per-unit prices carry over unchanged
    return p[P.pools] * P.cap[P.pools] / P.u_scale


def _elastic(
    P: _Prepared, inc: _Incumbent, q: np.ndarray, tau: float, opts: SolverOptions, deadline: float, tau_stop: float = 0.0
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
            qn = _flush(np.maximum(q + step, 0.0))
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
            _recover_into(P, inc, opts, deadline, final=tau <= tau_min)
            if inc.gap() <= opts.gap_tolerance or tau <= tau_min:
                return it
        tau = max(tau * opts.smoothing_decay, tau_min)
        trust = 2.0 * last_step
        L, Lt, load, pi, wait = P.smooth(q, tau)
        H = P.elasticity(pi, wait, tau)
        inc.offer_bound(L, q)
    if tau_stop <= 0.0:
        _recover_into(P, inc, opts, deadline, final=True)
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


def _subgradient(P: _Prepared, inc: _Incumbent, q: np.ndarray, opts: SolverOptions, deadline: float) -> int:
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
        q = _flush(np.maximum(q + step, 0.0))
        _, load, L = P.respond(q)
        inc.offer_bound(L, q)
        if it % opts.recover_every == 0:
            _recover_into(P, inc, opts, deadline)
            if inc.gap() <= opts.gap_tolerance:
                return it
        if time.perf_counter() > deadline:
            break
    _recover_into(P, inc, opts, deadline, final=True)
    return it


# ----------------------------------------------------------------------------------------------------
# primal recovery


def _recover_into(P: _Prepared, inc: _Incumbent, opts: SolverOptions, deadline: float, final: bool = False) -> None:
    """Build feasible allocations from the best prices so far and keep the best one.

    With ``final`` (the dual has converged but the gap is still open) it also restarts the
    repair/fill passes from slightly perturbed prices -- each pool 2% up and down, all pools 1% and
    3% up and down -- which changes which of the near-tied jobs get in, and runs the exchange pass
    on the best of them. The list is fixed, so the result stays deterministic.
    """
    q = inc.q
    inc.offer_choice(_fill(P, _repair_from(P, q), q))
    if inc.gap() <= opts.gap_tolerance:
        return
    rounds = opts.exchange_rounds if final else min(opts.exchange_rounds, 4)
    inc.offer_choice(_exchange(P, inc.choice, q, rounds, deadline))
    if not final or inc.gap() <= opts.gap_tolerance:
        return
    best, best_v, best_q = None, -np.inf, q
    for qq in _perturbed(q):
        if time.perf_counter() > deadline:
            break
        choice = _fill(P, _repair_from(P, qq), qq)
        v = P.value(choice)
        if v > best_v:
            best, best_v, best_q = choice, v, qq
    if best is not None:
        inc.offer_choice(best)
        inc.offer_choice(_exchange(P, best, best_q, opts.exchange_rounds, deadline))


def _perturbed(q: np.ndarray) -> list[np.ndarray]:
    out = []
    for r in range(q.size):
        for f in (1.02, 0.98):
            qq = q.copy()
            qq[r] *= f
            out.append(qq)
    for f in (1.01, 0.99, 1.03, 0.97):
        out.append(q * f)
    return out


def _repair_from(P: _Prepared, q: np.ndarray) -> np.ndarray:
    """Best response at q, repaired to fit."""
    m = P.margins(q)
    mx = m.max(axis=0)
    choice = _argmax0(m, mx)
    choice[mx <= 0.0] = -1
    return _repair(P, choice, m)


def _option_table(P: _Prepared, choice: np.ndarray, jobs: np.ndarray):
    """Utility and normalised demand of the current option of ``jobs``: ([n], [Rp, n])."""
    cur = choice[jobs]
    on = cur >= 0
    cs = np.where(on, cur, 0)
    flat = cs * P.J + jobs
    cu = np.where(on, np.take(P.uz.reshape(-1), flat), 0.0)
    cd = np.where(on, np.take(P.dnT, flat, axis=1), 0.0)
    return cu, cd


# normalised loads are sums of d / capacity: allow their rounding noise; _guard re-checks in raw units
_EPS = 1e-12


def _repair(P: _Prepared, choice: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Move admitted jobs off over-subscribed pools until every pool fits (normalised units).

    ``m`` are the margins ``u - dn . q`` [S, J] at the prices the allocation came from. Moving a job
    from its option ``c`` to ``a`` frees ``fr`` of the over-subscribed pool ``r`` at a priced cost of
    ``(m_c - m_a) / fr`` per unit: the order in which a price rise on ``r`` would move jobs.
    """
    choice = choice.copy()
    S = P.S
    closed = np.zeros(P.Rp, dtype=bool)  # pools already repaired: no move may add to them again
    for _ in range(P.Rp + 1):
        excess = P.load(choice) - 1.0 - _EPS
        if not (excess > 0.0).any():
            return choice
        r = int(np.argmax(excess))
        room = np.where(closed, 0.0, np.maximum(-excess, 0.0))  # what other pools may still absorb
        jobs = np.flatnonzero(choice >= 0)
        jobs = jobs[P.dn3[r, choice[jobs], jobs] > 0.0]
        n = jobs.size
        cur = choice[jobs]
        _, cd = _option_table(P, choice, jobs)
        mj = _cols(m, jobs)  # [S, n]
        m_cur = mj[cur, np.arange(n)]
        ok = _cols(P.valid, jobs)
        for rr in range(P.Rp):  # an alternative may not overflow another pool on its own
            if rr != r:
                ok &= _cols(P.dn3[rr], jobs) - cd[rr] <= room[rr]
        fr = cd[r] - _cols(P.dn3[r], jobs)  # [S, n] freed on pool r
        ok &= fr > 0.0
        ratio = np.where(ok, (m_cur - mj) / np.where(ok, fr, 1.0), np.inf)
        # waiting: frees the whole demand, loses the whole margin
        ratio = np.concatenate([ratio, (m_cur / cd[r])[None, :]])
        fr = np.concatenate([fr, cd[r][None, :]])
        best = np.argmin(ratio, axis=0)
        cols = np.arange(n)
        rb, frb = ratio[best, cols], fr[best, cols]
        order = np.argsort(rb, kind="stable")
        cum = np.cumsum(frb[order])
        k = min(int(np.searchsorted(cum, excess[r], side="left")) + 1, n)
        sel = order[:k]
        choice[jobs[sel]] = np.where(best[sel] == S, -1, best[sel])
        closed[r] = True
    # last resort (not reached in practice): park jobs of over-subscribed pools, least utility first
    while True:
        excess = P.load(choice) - 1.0 - _EPS
        if not (excess > 0.0).any():
            return choice
        r = int(np.argmax(excess))
        jobs = np.flatnonzero(choice >= 0)
        jobs = jobs[P.dn3[r, choice[jobs], jobs] > 0.0]
        choice[jobs[np.argmin(P.uz[choice[jobs], jobs])]] = -1


def _fill(
    P: _Prepared,
    choice: np.ndarray,
    q: np.ndarray,
    jobs: np.ndarray | None = None,
    max_rounds: int = 100,
    widen: bool = True,
) -> np.ndarray:
    """Admit waiting jobs and upgrade shapes while capacity allows.

    Each round scores every job's best improving move that fits (utility gained per priced unit of
    extra demand), sorts the moves, and accepts them greedily in that order: the longest prefix whose
    cumulative demand fits is taken at once (``np.cumsum``), the first move that does not fit is
    skipped together with every move that no longer fits alone, and the scan continues. ``jobs``
    restricts the rounds to a subset; with ``widen`` the last round then looks at every job.
    """
    choice = choice.copy()
    load = P.load(choice)
    w = q + 1e-6 * (float(q.max()) if q.size and q.max() > 0 else 1.0)
    subset = jobs  # None: all jobs
    for _ in range(max_rounds):
        resid = 1.0 + _EPS - load
        js = P.ar if subset is None else subset
        idx = subset  # None: every job, read without a gather
        cu, cd = _option_table(P, choice, js)
        gain = _cols(P.uz, idx) - cu  # [S, n]
        ok = _cols(P.valid, idx) & (gain > 1e-12)
        # Pool by pool, tightest first (a [Rp, S, n] temporary would be tens of megabytes at 10^5
        # jobs): the tight pools rule out most moves, so the survivors are compacted as we go.
        for r in np.argsort(resid, kind="stable"):
            ok &= _cols(P.dn3[r], idx) - cd[r] <= resid[r]
            alive = ok.any(axis=0)
            if alive.sum() < 0.5 * alive.size:
                keep = np.flatnonzero(alive)
                js, ok, gain, cd = js[keep], ok[:, keep], gain[:, keep], cd[:, keep]
                idx = js
        if not ok.any():
            if subset is None or not widen:
                break
            subset = None
            continue
        sub = np.flatnonzero(ok.any(axis=0))
        js, ok, gain, cd = js[sub], ok[:, sub], gain[:, sub], cd[:, sub]
        cost = np.full(gain.shape, 1e-15)
        for r in range(P.Rp):
            extra = _cols(P.dn3[r], js) - cd[r]
            np.maximum(extra, 0.0, out=extra)
            extra *= w[r]
            cost += extra
        score = np.where(ok, gain / cost, -np.inf)
        n = js.size
        best = np.argmax(score, axis=0)
        sb = score[best, np.arange(n)]
        db = np.take(P.dnT, best * P.J + js, axis=1) - cd  # [Rp, n] change of demand
        dp = np.maximum(db, 0.0)
        order = np.argsort(-sb, kind="stable")
        room = np.maximum(resid, 0.0)
        take = []
        while order.size:
            cum = np.cumsum(np.take(dp, order, axis=1), axis=1)
            fits = np.all(cum <= room[:, None], axis=0)
            k = order.size if fits.all() else int(np.argmin(fits))
            if k:
                take.append(order[:k])
                room = room - cum[:, k - 1]
            rest = order[k + 1 :]
            order = rest[np.all(np.take(dp, rest, axis=1) <= room[:, None], axis=0)]
        sel = np.concatenate(take)
        choice[js[sel]] = best[sel]
        load = load + db[:, sel].sum(axis=1)
        subset = js
    return choice


def _exchange(
    P: _Prepared, choice: np.ndarray, q: np.ndarray, rounds: int, deadline: float, k: int = 96, core: int = 2048
) -> np.ndarray:
    """Pair exchanges: improve one job while downgrading or parking another, when the pair fits.

    Only the ``core`` jobs that are cheapest to move in reduced-cost terms (their best alternative is
    nearly as good at the current prices) are considered: far from the margin a move can only lose.
    """
    choice = choice.copy()
    S = P.S
    m = P.margins(q)
    top = np.maximum(m.max(axis=0), 0.0)
    rc = np.concatenate([np.where(P.valid, top - m, np.inf), top[None, :]])  # [S+1, J], wait last
    cur = np.where(choice >= 0, choice, S)
    rc_cur = rc[cur, P.ar]
    rc_other = rc.copy()
    rc_other[cur, P.ar] = np.inf
    ease = rc_other.min(axis=0) - rc_cur  # cost of the cheapest switch (negative: off its best response)
    if P.J > core:
        cj = np.sort(np.argpartition(ease, core)[:core])
    else:
        cj = P.ar
    n = cj.size
    for _ in range(rounds):
        if time.perf_counter() > deadline:
            break
        resid = 1.0 + _EPS - P.load(choice)
        cu, cd = _option_table(P, choice, cj)
        gain = np.concatenate([np.where(_cols(P.valid, cj), _cols(P.uz, cj) - cu, -np.inf), -cu[None, :]])  # [S+1, n]
        delta = np.concatenate([_cols(P.dn3, cj) - cd[:, None, :], -cd[:, None, :]], axis=1)  # [Rp, S+1, n]
        c = np.where(choice[cj] >= 0, choice[cj], S)
        gain[c, np.arange(n)] = -np.inf  # staying put is not a move
        rcg = gain - np.tensordot(q, delta, axes=1)  # gain in reduced-cost terms
        flat_g, flat_rc = gain.reshape(-1), rcg.reshape(-1)
        up = np.flatnonzero(flat_g > 1e-12)
        down = np.flatnonzero(np.isfinite(flat_g) & (flat_g <= 1e-12))
        if up.size == 0 or down.size == 0:
            break
        a = _top(up, flat_g[up], flat_rc[up], k)
        b = _top(down, flat_g[down], flat_rc[down], 2 * k)
        D = delta.reshape(P.Rp, -1)
        Da, Db = np.take(D, a, axis=1), np.take(D, b, axis=1)
        net = flat_g[a][:, None] + flat_g[b][None, :]  # [ka, kb]
        net[(a % n)[:, None] == (b % n)[None, :]] = -np.inf  # two moves of one job are not a pair
        cand = np.flatnonzero(net.reshape(-1) > 1e-12)
        if cand.size == 0:
            break
        cand = cand[np.argsort(-net.reshape(-1)[cand], kind="stable")]
        pick = -1
        for lo in range(0, cand.size, 4096):  # best net gain first; stop at the first pair that fits
            chunk = cand[lo : lo + 4096]
            ia, ib = np.divmod(chunk, b.size)
            fits = np.all(np.take(Da, ia, axis=1) + np.take(Db, ib, axis=1) <= resid[:, None], axis=0)
            if fits.any():
                pick = int(chunk[int(np.argmax(fits))])
                break
        if pick < 0:
            break
        ia, ib = divmod(pick, b.size)
        for opt in (a[ia], b[ib]):
            s, jj = divmod(int(opt), n)
            choice[cj[jj]] = -1 if s == S else s
        choice = _fill(P, choice, q, jobs=cj, widen=False)
    return _fill(P, choice, q)


def _top(idx: np.ndarray, gain: np.ndarray, rc: np.ndarray, k: int) -> np.ndarray:
    """Union of the k best candidates by utility gain and the k best by reduced-cost change."""
    if idx.size <= 2 * k:
        return idx
    g = np.argpartition(-gain, k)[:k]
    r = np.argpartition(-rc, k)[:k]
    return np.unique(idx[np.concatenate([g, r])])


def _guard(problem: PricingProblem, P: _Prepared, choice: np.ndarray) -> np.ndarray:
    """Final check in raw units: drop the least valuable jobs of any pool that rounding pushed over."""
    choice = choice.astype(np.int64).copy()
    d = np.asarray(problem.demand)
    u = np.asarray(problem.utility)
    while True:
        jobs = np.flatnonzero(choice >= 0)
        if jobs.size == 0:
            return choice
        dj = np.asarray(d[jobs, choice[jobs]], dtype=np.float64)
        over = dj.sum(axis=0) > P.cap
        if not over.any():
            return choice
        users = jobs[np.any(dj[:, over] > 0.0, axis=1)]
        choice[users[np.argmin(u[users, choice[users]])]] = -1
