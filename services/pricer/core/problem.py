"""The pricing problem, the solver's knobs and its result, with input validation.

A round is a rectangle of jobs x shapes x pools (padding masked out); ``validate`` rejects anything the
solver cannot price, naming the offending field so the gRPC edge can answer INVALID_ARGUMENT precisely.
Solver status is data (``SolveStatus``) so every caller picks its own fallback.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "PricingInputError",
    "PricingProblem",
    "PricingResult",
    "SolveStatus",
    "SolverOptions",
    "invalid_result",
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


def _as_array(name: str, value: object) -> np.ndarray:
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
