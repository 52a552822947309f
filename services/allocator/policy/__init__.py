"""Pure placement-policy library of the allocator (no gRPC, no Redis): shapes, pricing, placement, baselines.

The live allocator and the simulator call the same entry points:

* :func:`make_policy` (name, estimate matrix, kappa, **options) -> a policy with ``decide(view) -> Decision``;
  each policy's options are one validated frozen dataclass (``Policy.Params``), an option it does not accept
  is an error, and :func:`options_for` picks a policy's part of one shared option set;
* :class:`ClusterView` / :class:`JobTable` (what a round sees) and :class:`Decision` (what it answers);
* :class:`InterferenceEstimator` implementations (:class:`RuleEstimator`, :class:`MatrixEstimator`; the
  predictor's adapter lives with the predictor and is injected by the front ends);
* :func:`training_shapes` (a job's shape family as ``elastico.domain.Shape``), :func:`required_share_pct`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from services.allocator.policy.baselines import (
    ExclusiveBackfill,
    ExclusiveFifo,
    LucidPacking,
    LucidParams,
    MpsEqualShare,
    MpsEqualShareParams,
    OptionError,
    Policy,
    PolicyParams,
    Tiresias,
    TiresiasParams,
)
from services.allocator.policy.elastico import ElastiCo, ElastiCoParams
from services.allocator.policy.inference import required_share_pct, within_slo
from services.allocator.policy.interference import (
    InterferenceEstimator,
    MatrixEstimator,
    RuleEstimator,
)
from services.allocator.policy.shapes import SHARES_PCT, training_shapes
from services.allocator.policy.view import (
    INFERENCE,
    TRAINING,
    ClusterView,
    Decision,
    JobTable,
)

_CLASSES: dict[str, type[Policy]] = {"elastico": ElastiCo, "exclusive-fifo": ExclusiveFifo,
                                     "exclusive-backfill": ExclusiveBackfill, "tiresias": Tiresias,
                                     "mps-equal-share": MpsEqualShare, "lucid": LucidPacking}

#: Policy names accepted by :func:`make_policy`, in report order.
POLICY_NAMES: tuple[str, ...] = tuple(_CLASSES)


def _policy_class(name: str) -> type[Policy]:
    if name not in _CLASSES:
        raise ValueError(f"policy: unknown {name!r}; choose from {', '.join(POLICY_NAMES)}")
    return _CLASSES[name]


def accepted_options(name: str) -> frozenset[str]:
    """The options policy ``name`` accepts: the fields of its params dataclass (``Policy.Params``).

    Raises:
        ValueError: unknown name.
    """
    return frozenset(f.name for f in dataclasses.fields(_policy_class(name).Params))


def options_for(name: str, options: Mapping[str, object]) -> dict:
    """The part of ``options`` that policy ``name`` accepts: for callers that configure a whole comparison
    (or a configurable policy) with one option set.

    Raises:
        ValueError: unknown name, or an option that no policy accepts (a misspelt one must not vanish).
    """
    known = frozenset().union(*(accepted_options(n) for n in POLICY_NAMES))
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"policy options {', '.join(unknown)}: accepted by no policy")
    mine = accepted_options(name)
    return {k: v for k, v in options.items() if k in mine}


def make_policy(name: str, estimate: np.ndarray, kappa: float, solver=None, **options) -> Policy:
    """Build a policy by name.

    Args:
        name: one of :data:`POLICY_NAMES`.
        estimate: ``[T, T]`` estimated pair matrix (from an :class:`InterferenceEstimator`).
        kappa: contention factor of the utilisation rule for pairs without an estimate.
        solver: pricing solver with the signature of ``services.pricer.core.solve`` for a policy that
            prices (ElastiCo; None = in-process); like ``estimate``, unused by the policies that do not.
        **options: the policy's options, the fields of its params dataclass (:func:`accepted_options`;
            ``train_floor``, ``slo_factor`` ...). To configure several policies with one option set, pass
            each :func:`options_for` its name.

    Raises:
        ValueError: unknown name, an option the policy does not accept (named), or a bad option value
            (the params dataclass names the field).
    """
    cls = _policy_class(name)
    accepted = accepted_options(name)
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(f"policy {name!r}: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                         f"it accepts {', '.join(sorted(accepted)) or 'none'}")
    return cls.build(cls.Params(**options), estimate, kappa, solver)


__all__ = [
    "POLICY_NAMES", "make_policy", "accepted_options", "options_for", "Policy", "PolicyParams", "ElastiCo",
    "ElastiCoParams", "ExclusiveFifo", "ExclusiveBackfill", "Tiresias", "TiresiasParams", "MpsEqualShare",
    "MpsEqualShareParams", "LucidPacking", "LucidParams", "OptionError", "ClusterView", "JobTable", "Decision", "TRAINING",
    "INFERENCE", "InterferenceEstimator", "RuleEstimator", "MatrixEstimator", "SHARES_PCT", "training_shapes",
    "required_share_pct", "within_slo",
]
