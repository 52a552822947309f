"""Pure placement-policy library of the allocator (no gRPC, no Redis): shapes, pricing, placement, baselines.

The live allocator and the simulator call the same entry points:

* :func:`make_policy` (name, estimate matrix, kappa, **options) -> a policy with ``decide(view) -> Decision``;
* :class:`ClusterView` / :class:`JobTable` (what a round sees) and :class:`Decision` (what it answers);
* :class:`InterferenceEstimator` implementations (:class:`RuleEstimator`, :class:`MatrixEstimator`; the
  predictor's adapter lives with the predictor and is injected by the front ends);
* :func:`training_shapes` (a job's shape family as ``elastico.domain.Shape``), :func:`required_share_pct`.
"""

from __future__ import annotations

import numpy as np

from services.allocator.policy.baselines import (
    ExclusiveBackfill,
    ExclusiveFifo,
    LucidPacking,
    MpsEqualShare,
    Policy,
    Tiresias,
)
from services.allocator.policy.elastico import ElastiCo
from services.allocator.policy.inference import required_share_pct, within_slo
from services.allocator.policy.interference import InterferenceEstimator, MatrixEstimator, RuleEstimator
from services.allocator.policy.shapes import SHARES_PCT, training_shapes
from services.allocator.policy.view import INFERENCE, TRAINING, ClusterView, Decision, JobTable

#: Policy names accepted by :func:`make_policy`, in report order.
POLICY_NAMES: tuple[str, ...] = ("elastico", "exclusive-fifo", "exclusive-backfill", "tiresias",
                                 "mps-equal-share", "lucid")


def make_policy(name: str, estimate: np.ndarray, kappa: float, **options) -> Policy:
    """Build a policy by name.

    Args:
        name: one of :data:`POLICY_NAMES`.
        estimate: ``[T, T]`` estimated pair matrix (from an :class:`InterferenceEstimator`).
        kappa: contention factor of the utilisation rule for pairs without an estimate.
        **options: policy-specific keyword options (``train_floor``, ``slo_factor`` ...); unknown ones
            for a given policy are ignored so one option set can configure a whole comparison.

    Raises:
        ValueError: unknown name.
    """
    import inspect

    classes = {"elastico": ElastiCo, "exclusive-fifo": ExclusiveFifo, "exclusive-backfill": ExclusiveBackfill,
               "tiresias": Tiresias, "mps-equal-share": MpsEqualShare, "lucid": LucidPacking}
    if name not in classes:
        raise ValueError(f"policy: unknown {name!r}; choose from {', '.join(POLICY_NAMES)}")
    cls = classes[name]
    params = inspect.signature(cls.__init__).parameters
    kw = {k: v for k, v in options.items() if k in params}
    if "estimate" in params:
        kw["estimate"] = estimate
    if "kappa" in params:
        kw["kappa"] = kappa
    return cls(**kw)


__all__ = [
    "POLICY_NAMES", "make_policy", "Policy", "ElastiCo", "ExclusiveFifo", "ExclusiveBackfill", "Tiresias",
    "MpsEqualShare", "LucidPacking", "ClusterView", "JobTable", "Decision", "TRAINING", "INFERENCE",
    "InterferenceEstimator", "RuleEstimator", "MatrixEstimator", "SHARES_PCT", "training_shapes",
    "required_share_pct", "within_slo",
]
