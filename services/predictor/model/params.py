"""Hyper-parameters of the interference model (:class:`TrainParams`).

Defaults were chosen by grouped cross-validation on Gavel's measured pairs; the measurements behind each
choice, and the variants tried and not adopted, are in docs/results.md ("Interference predictor: measurement history"). The field order is
the order of ``params`` in the saved artifact.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainParams:
    """Hyper-parameters of :func:`~services.predictor.model.train_model`."""

    n_bags: int = 2  # XGBoost boosters averaged, seeds seed..seed+n_bags-1; more bags cost prediction time
    # boosting rounds per booster; prediction cost grows with n_bags * rounds, accuracy stops gaining at 250
    rounds: int = 250
    max_depth: int = 6  # tree depth
    min_child_weight: float = 3.0  # minimum hessian per leaf
    eta: float = 0.2  # learning rate
    subsample: float = 0.8  # row subsampling per tree
    colsample_bytree: float = 0.8  # column subsampling per tree
    # pseudo-Huber transition, in normalised-throughput units: 0.4 is close to squared error on this [0, 1]
    # target, which measured better than a sharper transition
    huber_slope: float = 0.4
    objective: str = "reg:pseudohubererror"  # XGBoost objective (absolute error measured worse)
    env_min_examples: int = 200  # an environment with this many examples gets boosters of its own
    mf_rank: int = 4  # matrix-factorisation embedding size
    mf_lambda: float = 0.1  # L2 penalty of embeddings
    mf_bias_lambda: float = 0.1  # L2 penalty of row/column biases
    mf_iters: int = 25  # alternating-least-squares sweeps
    mf_weight: float = 0.3  # blend weight of the factorisation where it applies
    # boosters fit the residual from the job-type additive prior (``JobPrior``), which they never see as a
    # feature: offered as features, its leave-own-pair-out means leak the row's own target
    prior_margin: bool = True
    prior_n: float = 2.0  # shrinkage of the prior's job-type means towards the domain mean, in rows
    # Cap classifiers (:mod:`.training`): where a domain has a mass of values at exactly 1, predict 1
    # when P(1) >= cap_threshold. MAE is minimised by the conditional median, and a value that is 1 with
    # probability >= 1/2 has median 1: 0.5 is that rule, not a tuned number.
    cap_model: bool = True
    cap_threshold: float = 0.5
    cap_min_frac: float = 0.05  # share of a domain's training values at 1 for it to get a classifier
    cap_min_rows: int = 20  # and at least this many
    # classifier boosting rounds, depth and learning rate, fixed before measuring; 50 rounds at 0.2 match
    # 100 at 0.1 at half the prediction cost
    cap_rounds: int = 50
    cap_max_depth: int = 4
    cap_eta: float = 0.2
    nthread: int = 1  # CPU threads; more than one is slower on a busy machine (OpenMP spin-waits)
    # regressors' output non-decreasing in ``enc_pair_mean``: a training row's encoding leaves its own pair
    # out, so within one family pair it falls as the row's target rises and free trees learn that backwards
    # slope; on an unseen pair the encoding is the plain mean and the true slope is positive
    monotone_enc: bool = True
