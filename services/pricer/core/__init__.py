"""Elastic Shadow Pricing: the pure solver of ElastiCo (numpy/scipy only).

Each job ``j`` offers up to ``S`` shapes; shape ``s`` demands ``d[j, s, r] >= 0`` units of resource pool
``r`` (GPUs of a type, MPS compute share in percent-of-a-GPU, GPU memory in MiB, ...) and yields utility
``u[j, s]``; a job may also wait (utility 0, demand 0). We maximise total utility subject to
``sum_j d[j, s_j, r] <= capacity[r]`` for every pool, one shape (or wait) per job: a multi-choice
multi-dimensional knapsack, NP-hard in general, but with many small jobs and a handful of pools its LP
relaxation is almost integral (a basic LP optimum has at most ``R`` fractional jobs), so prices that
clear the LP market are nearly optimal for the integer problem too.

Prices ``p[r] >= 0`` decouple the jobs: each takes ``argmax_s u[j, s] - d[j, s] . p`` or waits (one
matrix-vector product for all jobs), and the Lagrangian ``L(p)`` bounds the optimum from above, so every
answer carries a certificate ``gap = (min L seen - value of the returned allocation) / min L``.

Modules, in the order a solve uses them:

* ``problem``: ``PricingProblem`` (with validation), ``SolverOptions``, ``PricingResult``, ``SolveStatus``;
* ``evaluate``: best response, dual bound, load, value and gap in raw units (the certificate pieces);
* ``prepared``: the normalised, shape-major working form of a round and the incumbent;
* ``dual``: the elasticity-scaled price iteration (and the subgradient baseline);
* ``recovery``: repair / fill / exchange from prices to a feasible allocation, and the raw-unit guard;
* ``solver``: ``solve``, tying them together.

Determinism: no randomness; ties go to the lowest index (``argmax``, stable sorts). Only a time limit
that cuts a solve short can make two runs differ (the iteration limit never does).
"""

from __future__ import annotations

from services.pricer.core.evaluate import (
    allocation_load,
    allocation_value,
    best_response,
    dual_bound,
    relative_gap,
)
from services.pricer.core.problem import (
    PricingInputError,
    PricingProblem,
    PricingResult,
    SolverOptions,
    SolveStatus,
    invalid_result,
)
from services.pricer.core.solver import solve

__all__ = [
    "PricingInputError",
    "PricingProblem",
    "PricingResult",
    "SolveStatus",
    "SolverOptions",
    "allocation_load",
    "allocation_value",
    "best_response",
    "dual_bound",
    "invalid_result",
    "relative_gap",
    "solve",
]
