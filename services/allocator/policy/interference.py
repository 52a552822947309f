"""Interference estimates as the policies see them, behind one small protocol.

Why a protocol: the simulator must inject *estimates* (the predictor's, or a simple rule in tests) while
its ground truth comes from measurements; the live allocator injects the predictor service. Policies
only ever call :meth:`InterferenceEstimator.pair_matrix` once per run/type table (job types are few, so
an all-pairs matrix makes every placement decision a vectorised lookup instead of a model call).

Conventions: ``M[a, b]`` = normalised throughput (co-located / isolated, in [0, 1]) of a job of type ``a``
sharing one GPU with one job of type ``b``. ``NaN`` means "no estimate: use the utilisation rule"
(this is how the inference pseudo-type, whose utilisation changes with demand, is handled). The rules
that compose and fill these values are :mod:`elastico.coloc.rates`. The predictor's adapter
(``services.predictor.estimator.PredictorEstimator``) is injected by the front ends, never imported here.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from elastico.coloc.profiles import TypeTable
from elastico.coloc.rates import utilisation_rule


@runtime_checkable
class InterferenceEstimator(Protocol):
    """Anything that can estimate pairwise normalised throughput between job types."""

    def pair_matrix(self, types: TypeTable) -> np.ndarray:
        """``[T, T]`` normalised throughput of row type next to column type; NaN = use the rule."""
        ...


class RuleEstimator:
    """Estimates every pair with the utilisation rule (no learned model). Used in tests and as a fallback."""

    def __init__(self, kappa: float = 0.85) -> None:
        self.kappa = kappa  # contention factor of the rule, (0, 1]

    def pair_matrix(self, types: TypeTable) -> np.ndarray:
        u = types.solo_util
        m = utilisation_rule(u[:, None], u[None, :], self.kappa)
        m[types.inference_index, :] = np.nan
        m[:, types.inference_index] = np.nan
        return m


class MatrixEstimator:
    """A fixed matrix (e.g. a test table, or ground truth when measuring an oracle policy)."""

    def __init__(self, matrix: np.ndarray) -> None:
        self.matrix = np.asarray(matrix, float)  # [T, T] normalised throughputs

    def pair_matrix(self, types: TypeTable) -> np.ndarray:
        return self.matrix.copy()
