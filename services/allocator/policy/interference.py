"""Interference estimates as the policies see them, behind one small protocol.

Why a protocol: the simulator must inject *estimates* (the predictor's, or a simple rule in tests) while
its ground truth comes from measurements; the live allocator injects the predictor service. Policies
only ever call :meth:`InterferenceEstimator.pair_matrix` once per run/type table (job types are few, so
an all-pairs matrix makes every placement decision a vectorised lookup instead of a model call).

Conventions: ``M[a, b]`` = normalised throughput (co-located / isolated, in [0, 1]) of a job of type ``a``
sharing one GPU with one job of type ``b``. ``NaN`` means "no estimate: use the utilisation rule"
(this is how the inference pseudo-type, whose utilisation changes with demand, is handled).

k tenants: :func:`compose_additive` (the predictor's k-way rule: each co-tenant adds the extra time it
steals, ``norm_i = 1 / (1 + sum_j (1/p_ij - 1))``; k saturating jobs get 1/k each).

Conservative rule for pairs without an estimate or measurement (:func:`utilisation_rule`):
processor sharing on solo utilisations -- both keep 1.0 if ``u_a + u_b <= 1``, otherwise both run at
``1 / (u_a + u_b)`` -- times a contention factor ``kappa <= 1`` (memory bandwidth, caches). ``kappa`` is
calibrated on the measured pairs as a low quantile (default 25th percentile) of measured / rule, so the
rule is pessimistic for most measured pairs (:func:`calibrate_kappa`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from services.allocator.policy.profiles import TypeTable
from services.allocator.policy.view import slot_sum

_MIN_NORM = 1e-3


@runtime_checkable
class InterferenceEstimator(Protocol):
    """Anything that can estimate pairwise normalised throughput between job types."""

    def pair_matrix(self, types: TypeTable) -> np.ndarray:
        """``[T, T]`` normalised throughput of row type next to column type; NaN = use the rule."""
        ...


def utilisation_rule(u_self: np.ndarray, u_other: np.ndarray, kappa: float) -> np.ndarray:
    """Conservative pairwise normalised throughput from solo utilisations (see module docstring).

    Args:
        u_self, u_other: solo utilisations (fractions of a GPU), broadcastable.
        kappa: contention factor in (0, 1] applied to any actually shared GPU (both utilisations > 0).

    Returns:
        Normalised throughput of ``self`` next to ``other`` in (0, 1].
    """
    return np.where(np.asarray(u_other) > 0, _shared_speed(u_self, u_other, kappa), 1.0)


def utilisation_rule_both(u_a: np.ndarray, u_b: np.ndarray, kappa: float) -> tuple[np.ndarray, np.ndarray]:
    """``(utilisation_rule(u_a, u_b, kappa), utilisation_rule(u_b, u_a, kappa))``, their common part once."""
    k = _shared_speed(u_a, u_b, kappa)
    return np.where(np.asarray(u_b) > 0, k, 1.0), np.where(np.asarray(u_a) > 0, k, 1.0)


def _shared_speed(u_a, u_b, kappa: float) -> np.ndarray:
    """kappa x processor-sharing speed of two tenants (symmetric in ``u_a``, ``u_b``)."""
    s = np.asarray(u_a, float) + np.asarray(u_b, float)
    return kappa * np.minimum(1.0, 1.0 / np.maximum(s, 1e-9))


def compose_additive(pairwise: np.ndarray, axis: int = -1) -> np.ndarray:
    """k-way normalised throughput from pairwise values along ``axis`` (1.0 entries = no co-tenant).

    ``norm = 1 / (1 + sum (1/p - 1))``; identical to ``services.predictor.model.compose_k_way`` row-wise.
    """
    extra = 1.0 / np.minimum(np.maximum(pairwise, _MIN_NORM), 1.0) - 1.0  # = clip, without its call overhead
    return 1.0 / (1.0 + (slot_sum(extra) if axis in (-1, extra.ndim - 1) else extra.sum(axis=axis)))


def calibrate_kappa(measured: list[tuple[str, str, float, float]], types: TypeTable, quantile: float = 0.25) -> float:
    """Contention factor of the conservative rule: a low quantile of measured / processor-sharing.

    Args:
        measured: (type_a, type_b, norm_a, norm_b) of successfully co-located measured pairs.
        types: gives the solo utilisations.
        quantile: which quantile of the ratios to take (lower = more pessimistic).

    Returns:
        kappa in (0, 1].
    """
    u = types.solo_util
    ratios = []
    for a, b, na, nb in measured:
        try:
            ia, ib = types.index(a), types.index(b)
        except KeyError:
            continue
        ps = utilisation_rule(u[ia], u[ib], 1.0)
        ratios += [na / ps, nb / ps]
    if not ratios:
        return 0.8
    return float(np.clip(np.quantile(ratios, quantile), 0.05, 1.0))


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


class PredictorEstimator:
    """Adapter over the interference predictor core (``services.predictor.model.InterferenceModel``).

    The predictor is queried once for every ordered pair of training types on the table's GPU type;
    inference rows stay NaN (utilisation rule) because the predictor's training data holds no inference
    pairs. Kept in this one adapter so a change of the predictor's API touches one place.
    """

    def __init__(self, model) -> None:  # model: services.predictor.model.InterferenceModel
        self.model = model

    @classmethod
    def from_artifact(cls, path=None) -> PredictorEstimator:
        """Load the trained artifact (``python -m services.predictor.train`` builds it).

        Raises:
            FileNotFoundError / ValueError: the artifact is missing or malformed.
        """
        from services.predictor import model as pm

        return cls(pm.load_model(path) if path else pm.load_model())

    def pair_matrix(self, types: TypeTable) -> np.ndarray:
        from services.predictor.features import ProfileCatalog

        cat = getattr(self.model, "catalog", None) or ProfileCatalog.default()
        train = [n for n in types.names if n != types.names[types.inference_index]]
        profs = [cat.gavel(n, types.gpu_type) for n in train]
        idx = [(i, j) for i in range(len(train)) for j in range(i, len(train))]
        pred = np.asarray(self.model.predict_pairs([(profs[i], profs[j]) for i, j in idx]), float)
        T = len(types.names)
        m = np.full((T, T), np.nan)
        for (i, j), (pi, pj) in zip(idx, pred):
            m[i, j] = pi
            m[j, i] = pj
        return np.clip(m, 0.0, 1.0)
