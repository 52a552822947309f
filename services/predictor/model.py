"""The interference model: how much of its isolated throughput each job keeps when sharing a GPU.

``InterferenceModel`` predicts, for an ordered pair (A, B) on one GPU type, A's normalised throughput
(co-located / isolated). It is an ensemble of two learners that see the same training pairs:

* **XGBoost** (pseudo-Huber loss, two bagged boosters with different seeds) on the feature schema of
  :mod:`services.predictor.features`: both solo profiles, their symmetric combinations, and a learned
  pair encoding (mean normalised throughput of A's family next to B's family on this GPU type, backing
  off to the family pair on any GPU type, then to the architecture-class pair). The encoding is what
  carries over to *unseen pairs of known job types*: a pair never measured still has relatives (same
  families, other batch sizes). When training, each row's encoding leaves out every row of its own
  job-type pair (on all GPU types), exactly as for a pair the model has never seen; the boosters are
  constrained to rise with the encoding (``monotone_enc``), since within one family pair those leave-out
  values fall as the row's own target rises and would otherwise teach the trees a backwards slope.
  The boosters start from a **job-type prior** (their base margin) and fit only the residual: per GPU type,
  ``row(A) + column(B) - mean``, where ``row(A)`` is the mean throughput A keeps next to all its measured
  co-tenants (how sensitive A is) and ``column(B)`` the mean its co-tenants keep next to B (how aggressive
  B is), shrunk towards the GPU type's mean. A training row's prior leaves out its own job-type pair, and
  the trees never see it as a feature (offered as features, such leave-out means leak the row's own target
  into the splits and measured worse). Grouped-CV on Gavel: MAE 0.0324 -> 0.031, MAPE 6.23% -> ~5.9%.
* **Biased matrix factorisation** per GPU type over job types (row = the job whose throughput is
  measured, column = its co-tenant): ``mu_g + r[g,A] + c[g,B] + U[A]·V[B]``, three variants (embeddings
  per GPU type, row embeddings shared across GPU types, column embeddings shared). It captures "how
  sensitive is A" and "how aggressive is B" from every other pair either took part in, which a tree on
  per-job features learns only indirectly. It contributes (weight ``mf_weight``) only when both job types
  were seen on that GPU type. Blending it in cut grouped-CV MAE on Gavel from 0.037 to 0.033.

* **Cap classifiers** (MAE is minimised by the conditional *median*, and the two learners above fit
  something close to the mean): where a domain has a mass of values at exactly 1 (the job kept all its
  isolated throughput: 12% of Gavel's measured V100 values, mostly ResNet-18 as the measured job; 19% of
  the second campaign's P100 values; Lucid's values at or above 1), a logistic XGBoost per domain on the
  same features estimates P(value = 1), and where it is at least 1/2 the answer is 1.0, the median of such
  a value. Threshold and classifier settings were fixed in advance, not tuned. Grouped-CV, Gavel measured
  V100 MAE over split seeds 0/1/2 (eta 0.2): 0.0510/0.0512/0.0548 -> 0.0496/0.0514/0.0549, so the V100
  gain is not uniform; with eta 0.13, seed 0: Gavel's second campaign P100 0.0325 -> 0.0304 (seeds 1 and 2
  alike), Lucid 0.0402 -> 0.0399.

Symmetry: every learner models the *ordered* row (A next to B); training uses both orderings of every
measured pair and a pair is predicted as ``[f(A|B), f(B|A)]``, so ``predict(B, A)`` is exactly
``predict(A, B)`` with its two outputs swapped.

Outputs are clipped to [0, 1]: co-location cannot make a job faster than alone (Lucid's values above 1 are
measurement noise).

Confidence: a prediction is *low-confidence* when either model family, the GPU type or the measurement
environment was never seen in training; the model still answers (from task features, counters and
architecture class).

Environments: rows carry the environment they were measured in (``JobProfile.env``: "" = this cluster,
"gavel", "gavel-oracle", "lucid"). Measurements from different environments disagree (Gavel's two
campaigns of the same pairs correlate 0.33 on V100) and sharing one set of trees cost accuracy (Gavel
grouped-CV MAE 0.032 alone, 0.035 trained together with Lucid). So encodings and factorisation are kept
per (GPU type, environment) "domain", every environment with enough rows gets boosters of its own, and a
*general* booster set trained on all rows answers for environments with too few rows for their own (this
cluster's first observations). A request from an environment without any training rows (a live request
before this cluster has reported observations) is answered as the *reference* environment (this cluster
once it has rows, else Gavel's measured campaign): same GPU type, same job types, best available data.

MPS shares: ``mps_share_pct`` is a feature, but every shipped measurement ran without MPS limits (100%),
so the trained model cannot yet tell 30% from 100%; observations with limits fix that through retraining.

Speed: request profiles get integer ids in a per-model table (solo vector completed from the catalogue,
factorisation indices, job-type prior), so a batch is assembled with numpy gathers; encodings are looked
up once per distinct family pair, each distinct ordered pair is predicted once (by the cap classifiers only
where its domain has one), and results are memoised per ordered pair of ids (the model is immutable; a
refresh builds a new one). The boosters are most of a cold batch's cost; on batches of 64 ordered rows or
more they run on two threads (the two bagged regressors in parallel, the cap classifier beside the first;
XGBoost predicts outside the GIL). With 150 rounds per booster, a cold 256-pair batch took a minimum of
6.1-6.5 ms (7.4-7.7 ms one booster after the other) on the shared 2-core development machine on 2026-11-30,
a day when that machine ran about 2.3x slower than the figure first measured here (3-4 ms); with 250 rounds,
on a quiet machine, p50 4.15 ms and p99 5.93 ms; well under 1 ms when the pairs were asked before.

This module is pure (numpy + xgboost): no gRPC, Redis or protobuf.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import tempfile
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path

import numpy as np
import xgboost as xgb

from elastico.coloc.rates import compose_k_way
from services.predictor import features as F
from services.predictor.features import JobProfile, Observation, ProfileCatalog

#: Format tag of the saved artifact. /3 added the cap classifiers (``cap_boosters``); /2 added the job-type
#: prior (``job_prior``, the boosters' base margin). /1 and /2 artifacts still load and predict as they were
#: trained (no margin for /1, no cap classifiers for /1 and /2).
ARTIFACT_FORMAT = "elastico-interference-model/3"
_READABLE_FORMATS = ("elastico-interference-model/1", "elastico-interference-model/2", ARTIFACT_FORMAT)

#: Default artifact path (relative to the repository root); the service's ``ELASTICO_MODEL_PATH`` default.
DEFAULT_MODEL_PATH = Path(__file__).resolve().parents[2] / "models" / "interference.json"

#: Name of the booster set trained on every environment (used for environments without a set of their own).
GENERAL_SET = "*"

#: A training value at or above this level counts as "kept all of its isolated throughput" for the cap
#: classifiers (Gavel writes exactly 1.0 where the co-located throughput equals the isolated one; Lucid's
#: noise above 1 counts too, since outputs are clipped to 1 anyway).
_CAP_LEVEL = 0.999

#: XGBoost objectives whose prediction is ``base margin + sum of trees`` (no link function).
_IDENTITY_OBJECTIVES = frozenset({"reg:squarederror", "reg:pseudohubererror", "reg:absoluteerror"})


def _base_score(booster: xgb.Booster) -> float:
    """The booster's ``base_score`` (XGBoost >= 2 stores it as ``"[5.77E-1]"``)."""
    raw = json.loads(booster.save_config())["learner"]["learner_model_param"]["base_score"]
    return float(str(raw).strip("[]").split(",")[0])


#: Batches of at least this many ordered rows split their booster predictions over two threads: below it the
#: hand-off (~0.1 ms) costs more than the second core saves.
_PARALLEL_MIN_ROWS = 64
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _run_calls(calls: Sequence[Callable[[], np.ndarray]], rows: int) -> list[np.ndarray]:
    """Make the boosters' prediction calls, half of them on a second thread when the batch is large.

    XGBoost predicts outside the GIL and its boosters are thread-safe for prediction, so the two bagged
    regressors (and the cap classifier) of a cold 256-pair batch run on two cores at once: the boosters
    are most of its cost. Each booster keeps ``nthread`` = 1 (OpenMP inside a call spin-waits on a busy
    machine); the parallelism is across boosters. One process-wide worker thread, created on first use.
    """
    if len(calls) < 2 or rows < _PARALLEL_MIN_ROWS or (os.cpu_count() or 1) < 2:
        return [call() for call in calls]
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastico-xgb")
    futures = [_pool.submit(call) for call in calls[1::2]]
    out: list = [None] * len(calls)
    out[0::2] = [call() for call in calls[0::2]]
    out[1::2] = [f.result() for f in futures]
    return out


class ArtifactError(ValueError):
    """A model artifact is missing, malformed, or was written under another feature schema."""


@dataclass(frozen=True)
class TrainParams:
    """Hyper-parameters of :func:`train_model` (defaults chosen by grouped cross-validation on Gavel)."""

    n_bags: int = 2  # XGBoost boosters averaged, seeds seed..seed+n_bags-1
    # boosting rounds per booster (prediction cost grows with n_bags * rounds). 150 -> 200 / 250 / 300, with the
    # monotone encoding and cap classifiers (grouped 10-fold CV, Gavel measured pairs, split seeds 0/1/2, v100
    # MAE): 0.0503/0.0504/0.0520 -> 0.0499/0.0501/0.0519, 0.0498/0.0499/0.0517, 0.0497/0.0499/0.0518 (MAE mean
    # 0.0302 -> 0.0301 / 0.0300 / 0.0300): the gain stops at 250. Cold 256-pair batch, in process, measured
    # side by side: p50 3.27 -> 4.14 ms, p99 4.91 -> 6.23 ms (150 -> 250). Not better at equal or higher cost:
    # n_bags 1 x 300 rounds (v100 mean 0.0511), 3 x 100 at eta 0.25 (0.0511), 4 x 75 at eta 0.3 (0.0515),
    # 4 x 100 (0.0511); n_bags 3 / 4 x 150: 0.0508 / 0.0505 at 1.46x / 1.72x the p99 (250 rounds: 1.30x, same
    # run).
    rounds: int = 250
    max_depth: int = 6  # tree depth
    min_child_weight: float = 3.0  # minimum hessian per leaf
    eta: float = 0.2  # learning rate (0.13 before the margin; re-measured with it, see the log below)
    subsample: float = 0.8  # row subsampling per tree
    colsample_bytree: float = 0.8  # column subsampling per tree
    # pseudo-Huber transition, in normalised-throughput units. 0.4 (nearly squared error on this [0, 1]
    # target) measured better than 0.1 on grouped 10-fold CV, Gavel measured pairs, seed 0: MAE 0.0335 ->
    # 0.0321, MAPE 6.41% -> 6.16%, V100 MAE 0.0537 -> 0.0540 (flat); 0.2: 0.0326 / 6.27%; 1.0: 0.0320 /
    # 6.16%. Not helpful, measured: sample weights 1/y (6.96%), a log target (6.23-6.31%), shallower trees.
    huber_slope: float = 0.4
    # Variants measured after the 0.4 slope (grouped 10-fold CV, all shipped rows, scored on Gavel's measured
    # pairs; mean over split seeds 0/1/2: MAE / MAPE / k80 / p100 / v100 MAE):
    #   reference (no margin):                             0.0324 / 6.23% / 0.0200 / 0.0219 / 0.0550
    #   objective reg:absoluteerror:                       0.0344 / 6.70% / 0.0201 / 0.0229 / 0.0597
    #   job-type priors (row/column means, additive, env-pooled deviations) as 5 extra *features*,
    #     leave-own-pair-out: 0.0349 / 6.76% / v100 0.0618; same with 5-fold out-of-fold encodings:
    #     0.0343 / 6.58% / 0.0602. Worse because it leaks: among one job type's rows a leave-out mean is a
    #     decreasing function of the row's own target, and trees that can tell the job type split on it.
    #   pair encoder 5-fold out-of-fold instead of leave-own-pair-out: 0.0325 / 6.22% / v100 0.0544 (flat)
    #   min_child_weight 10: 0.0328 / 6.28% / 0.0553; n_bags 1: 0.0338 / 6.48% / 0.0565; n_bags 4:
    #     0.0323 / 6.20% / 0.0549 (not worth twice the prediction cost)
    #   ADOPTED: the additive job-type prior as the boosters' base margin (trees fit the residual and never
    #     see the prior, so no leak): 0.0310 / 5.90% / 0.0184 / 0.0208 / 0.0533 (seeds 0/1/2: 0.0306/5.85%,
    #     0.0309/5.87%, 0.0315/5.97%; v100 0.0523/0.0526/0.0549: the 0.05 target still FAILS)
    #   out-of-fold (5 inner folds) factorisation as the base margin instead: seed 0/1 0.0348/6.84%,
    #     0.0359/7.05%, v100 0.062-0.063 (mf_weight 0: 0.0374 / 7.33%)
    #   with the margin, mf_weight 0.1/0.2/0.3/0.4/0.5 (offline on the CV predictions): MAE 0.0313/0.0310/
    #     0.0310/0.0313/0.0319, MAPE 5.93/5.88/5.90/5.97/6.11%: 0.3 kept; per-GPU-type stacking weights (fit
    #     on one split seed, scored on the others) gained ~0.001 MAE before the margin: not adopted
    #   the general booster set (all environments) instead of the environment's own: v100 0.059-0.062
    # Variants measured with the margin (same CV; MAE / MAPE / k80 / p100 / v100 on seed 0 unless noted;
    # reference seed 0: 0.0306 / 5.85% / 0.0181 / 0.0209 / 0.0523, seeds 1/2 v100 0.0526/0.0549):
    #   huber_slope 0.1: 0.0299 / 5.69% / 0.0173 / 0.0201 / 0.0519 (seeds 1/2: 0.0304/5.77%/v100 0.0518,
    #     0.0311/5.93%/0.0544); 0.05: 0.0306 / 5.83% / v100 0.0526; 0.2: 0.0305 / 5.81% / 0.0518
    #   per-domain pseudo-Huber slope (custom objective, slope = c * the domain's median |y - prior| on the
    #     training rows; V100 0.10, K80 0.034 for c = 1): c = 1/2/4: v100 0.0521/0.0521/0.0524 (flat)
    #   reg:absoluteerror with the margin: 0.0329 / 6.38% / v100 0.0584
    #   prior_n 1/5/10: v100 0.0532/0.0514/0.0516 (MAE 0.0309/0.0302/0.0303); 5 or 10 with huber 0.1 or
    #     eta 0.2: v100 0.0512-0.0523; the prior alone (row + column - mean) has V100 MAE 0.116 (log- or
    #     logit-additive priors: 0.122 / 0.115, measured offline on the same folds)
    #   mf_lambda 1.0: 0.0339 / 6.57% / v100 0.0596; 0.03: v100 0.0526; mf_rank 8: v100 0.0524
    #   max_depth 4: 0.0324 / v100 0.0559; 8: v100 0.0524; min_child_weight 6: v100 0.0522;
    #     colsample_bytree 0.5: v100 0.0527
    #   eta 0.08: v100 0.0533; eta 0.3: 0.0307 / 5.92% / v100 0.0521; eta 0.2 with 250 rounds: 0.0300 /
    #     5.73% / v100 0.0507 (and 1.7x the boosters' prediction cost)
    #   ADOPTED eta 0.2: 0.0301 / 5.74% / 0.0183 / 0.0207 / 0.0510 (seeds 1/2: 0.0306/5.80%/v100 0.0512,
    #     0.0312/5.93%/0.0548)
    #   booster set per domain (GPU type + environment) instead of per environment: v100 0.0534 for V100
    #     alone or every domain (V100 gains from the trees shared with K80/P100)
    #   the Gavel set also trained on gavel-oracle rows (weight 1.0 / 0.3): v100 0.0542 / 0.0531
    #   sample weight of Gavel V100 rows 0.5 / 2.0: v100 0.0532 / 0.0530
    #   stacking or calibration offline on the CV predictions (fitted on the scored rows themselves, i.e. an
    #     optimistic bound): best linear a + b * prediction gives v100 0.0521, best xgb/mf stack 0.0520;
    #     snapping predictions above t to 1 at best 0.0516 (t = 0.93): the cap classifier below does better
    #   ADOPTED cap classifiers (``cap_model``), with eta 0.2: 0.0297 / 5.70% / 0.0183 / 0.0207 / 0.0495
    #     (seeds 1/2: 0.0307/5.84%/v100 0.0514, 0.0313/5.97%/0.0552; mean v100 0.0520 against 0.0523 for eta
    #     0.2 alone and 0.0533 for the reference). Without eta 0.2 (0.13): v100 0.0510/0.0527/0.0552. The
    #     gain on V100 is not uniform over split seeds (about 31 values flipped to 1 per seed, 2/3 of them
    #     really at 1); on the second campaign's P100 it is (0.0325 -> 0.0304, seeds 1/2 similar).
    #     cap + eta 0.2 + huber_slope 0.1: 0.0300 / 5.83% / v100 0.0505 (not adopted)
    objective: str = "reg:pseudohubererror"  # XGBoost objective (reg:absoluteerror measured worse, above)
    env_min_examples: int = 200  # an environment with this many examples gets boosters of its own
    mf_rank: int = 4  # matrix-factorisation embedding size
    mf_lambda: float = 0.1  # L2 penalty of embeddings
    mf_bias_lambda: float = 0.1  # L2 penalty of row/column biases
    mf_iters: int = 25  # alternating-least-squares sweeps
    mf_weight: float = 0.3  # blend weight of the factorisation where it applies
    prior_margin: bool = True  # boosters fit the residual from the job-type additive prior (``_JobPrior``)
    prior_n: float = 2.0  # shrinkage of the prior's job-type means towards the domain mean, in rows
    # Cap classifiers (``_fit_cap_classifiers``): where a domain has a mass of values at exactly 1 (the job
    # kept all its isolated throughput), predict 1 when P(1) >= cap_threshold. 0.5 is the median rule (MAE
    # is minimised by the conditional median, and a value that is 1 with probability >= 1/2 has median 1),
    # not a tuned number; the classifier's hyper-parameters below were fixed before measuring.
    cap_model: bool = True
    cap_threshold: float = 0.5
    cap_min_frac: float = 0.05  # share of a domain's training values at 1 for it to get a classifier
    cap_min_rows: int = 20  # and at least this many
    # 100 rounds at eta 0.1 as first fixed gave v100 0.0495/0.0514/0.0552 (seeds 0/1/2); 50 at 0.2 the same
    # within noise (0.0496/0.0514/0.0549, MAE 0.0297/0.0307/0.0313, MAPE 5.70/5.84/5.96%) at half the
    # prediction cost (the classifier was ~0.9 ms of a 7.6 ms cold 256-pair batch): adopted for latency.
    cap_rounds: int = 50
    cap_max_depth: int = 4
    cap_eta: float = 0.2
    nthread: int = 1  # CPU threads; more than one is slower on a busy machine (OpenMP spin-waits)
    # Regressors' output non-decreasing in ``enc_pair_mean`` (XGBoost monotone constraint). A training row's
    # encoding leaves its own job-type pair out, so among one family pair's rows it *falls* as the row's
    # own target rises, and unconstrained trees learn that backwards slope; on an unseen pair the encoding
    # is the plain mean and the true slope is positive. Measured (grouped 10-fold CV, Gavel measured pairs,
    # split seeds 0/1/2): v100 0.0496/0.0514/0.0549 -> 0.0503/0.0504/0.0520 (mean 0.0520 -> 0.0509, spread
    # 0.0053 -> 0.0017), MAE mean 0.0305 -> 0.0302, MAPE 5.83 -> 5.79 %, K80 +0.0001, P100 -0.0002. The
    # same constraint on counter features changes nothing (Gavel rows have no counters); also measured, not
    # adopted: the prior as a monotone cap-classifier feature (v100 mean 0.0506, one more artifact column),
    # colsample_bynode 0.8 (0.0510), lossguide with 24 leaves (0.0519), max_bin 64 (0.0509),
    # reg:quantileerror at 0.5 with the margin (0.0567).
    monotone_enc: bool = True


@dataclass(frozen=True)
class Prediction:
    """Batched answer of :meth:`InterferenceModel.predict`."""

    norm_tput: np.ndarray  # [n, 2] float64: fraction of isolated throughput kept by A and by B, [0, 1]
    low_confidence: np.ndarray  # [n] bool: a model family or the GPU type was unseen in training
    model_version: str  # version of the model that produced every value


# --------------------------------------------------------------------------------------------------
# Learned encodings
# --------------------------------------------------------------------------------------------------


def _enc_keys(domain: str, env: str, fam_a: str, fam_b: str, arch_a: str, arch_b: str) -> tuple[tuple, ...]:
    """Keys of the six encoding levels, most specific first (see ``features.ENCODING_FEATURES``).

    ``domain`` is GPU type plus environment; levels 1 and 3 stay within the environment, 4 and 5 pool all.
    """
    return ((domain, fam_a, fam_b), (env, fam_a, fam_b), (domain, arch_a, arch_b), (env, arch_a, arch_b),
            ("*", fam_a, fam_b), ("*", arch_a, arch_b))


def _profile_enc_keys(a: JobProfile, b: JobProfile) -> tuple[tuple, ...]:
    return _enc_keys(a.domain, a.env, a.model_family, b.model_family, a.arch_class or "?", b.arch_class or "?")


_N_LEVELS = 6


def _backoff(levels: np.ndarray) -> np.ndarray:
    """``[n, levels]`` means (NaN = no data) -> ``[n, 2]`` (first finite mean, its level)."""
    out = np.full((levels.shape[0], 2), np.nan)
    for lvl in range(levels.shape[1] - 1, -1, -1):
        ok = np.isfinite(levels[:, lvl])
        out[ok, 0] = levels[ok, lvl]
        out[ok, 1] = lvl
    return out


class _Encoder:
    """Means of the target over groups of training rows, backed off by level (see ``ENCODING_FEATURES``)."""

    def __init__(self, tables: list[dict[tuple, tuple[float, float]]] | None = None) -> None:
        self.tables = tables or [{} for _ in range(_N_LEVELS)]

    @classmethod
    def fit(cls, pairs: Sequence[tuple[JobProfile, JobProfile]], y: np.ndarray,
            groups: Sequence[tuple]) -> tuple[_Encoder, np.ndarray]:
        """Fit the tables; return them and the leave-own-pair-out encodings of the training rows.

        Leaving out every row of the row's own job-type pair (all GPU types) makes a training row's
        encoding look exactly like that of a pair the model has never seen.
        """
        totals: list[dict] = [defaultdict(lambda: [0.0, 0.0]) for _ in range(_N_LEVELS)]
        per_group: list[dict] = [defaultdict(lambda: [0.0, 0.0]) for _ in range(_N_LEVELS)]
        keys = [_profile_enc_keys(a, b) for a, b in pairs]
        for ks, yi, g in zip(keys, y, groups):
            for t in range(_N_LEVELS):
                s = totals[t][ks[t]]
                s[0] += yi
                s[1] += 1.0
                s = per_group[t][(ks[t], g)]
                s[0] += yi
                s[1] += 1.0
        loo = np.full((len(pairs), _N_LEVELS), np.nan)
        for i, (ks, g) in enumerate(zip(keys, groups)):
            for t in range(_N_LEVELS):
                tot = totals[t][ks[t]]
                own = per_group[t][(ks[t], g)]
                n = tot[1] - own[1]
                if n > 0:
                    loo[i, t] = (tot[0] - own[0]) / n
        enc = cls([{k: (v[0], v[1]) for k, v in tab.items()} for tab in totals])
        return enc, _backoff(loo)

    def lookup_one(self, keys: tuple[tuple, ...]) -> tuple[float, float]:
        """(mean, level) of the most specific level with data for one row; (NaN, NaN) when none."""
        for t, tab in enumerate(self.tables):
            hit = tab.get(keys[t])
            if hit is not None and hit[1] > 0:
                return hit[0] / hit[1], float(t)
        return math.nan, math.nan

    def to_json(self) -> list[list]:
        return [[[list(k), v[0], v[1]] for k, v in tab.items()] for tab in self.tables]

    @classmethod
    def from_json(cls, data: list[list]) -> _Encoder:
        if len(data) != _N_LEVELS:
            raise ValueError(f"encoder: {len(data)} tables, expected {_N_LEVELS}")
        return cls([{tuple(k): (float(s), float(n)) for k, s, n in tab} for tab in data])


def _prior_value(sr: np.ndarray, nr: np.ndarray, sc: np.ndarray, nc: np.ndarray, sd: np.ndarray, nd: np.ndarray,
                 prior_n: float, fallback: float) -> np.ndarray:
    """``row + column - domain`` from sums and counts (the pair's own rows already removed), clipped to [0, 1].

    Row and column means are shrunk towards the domain mean with weight ``prior_n`` rows; where the domain
    has no other rows the value is ``fallback``.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        dom = np.where(nd > 0, sd / nd, np.nan)
        row = (sr + prior_n * dom) / (nr + prior_n)
        col = (sc + prior_n * dom) / (nc + prior_n)
    out = row + col - dom
    return np.clip(np.where(np.isfinite(out), out, fallback), 0.0, 1.0)


class _JobPrior:
    """Job-type-level additive prior: the boosters' base margin (see :func:`train_model`).

    Per domain (GPU type + environment): the mean normalised throughput of every row in which job type A
    is the measured job (how *sensitive* A is), of every row in which B is the co-tenant (how *aggressive*
    B is), and of the domain. The prior of (A next to B) is ``row(A) + column(B) - domain``; row and column
    means are shrunk towards the domain mean with weight ``prior_n`` rows, so a job type unseen in the
    domain contributes the domain mean.

    The prior of a pair always leaves out the rows of the pair itself (both orderings, in its domain): in
    training that makes a row's prior look like the prior of a pair never seen, and at prediction a pair
    that *was* in training (or observed since) gets the same prior its rows were fitted with, so the trees'
    residual for it is not counted twice.
    """

    TABLES = ("r", "c", "d", "p")

    def __init__(self, tables: dict[str, dict[tuple, tuple[float, float]]], prior_n: float) -> None:
        self.tables = tables  # "r", "c", "d", "p" (ordered pair cell) -> key -> (sum, count)
        self.prior_n = prior_n
        d = tables["d"].values()
        self.global_mean = sum(v for v, _ in d) / max(sum(n for _, n in d), 1.0)  # fallback: unknown domain

    @staticmethod
    def _sums(keys: Sequence[tuple], y: np.ndarray) -> dict[tuple, tuple[float, float]]:
        acc: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for k, v in zip(keys, y.tolist()):
            a = acc[k]
            a[0] += v
            a[1] += 1.0
        return {k: (v[0], v[1]) for k, v in acc.items()}

    @classmethod
    def fit(cls, pairs: Sequence[tuple[JobProfile, JobProfile]], y: np.ndarray, prior_n: float) -> tuple[_JobPrior, np.ndarray]:
        """Fit the tables; return them and the training rows' priors (:meth:`values`)."""
        y = np.asarray(y, float)
        ja = [_jk(a.job_key) for a, _ in pairs]
        jb = [_jk(b.job_key) for _, b in pairs]
        dom = [a.domain for a, _ in pairs]
        tables = {"r": cls._sums(list(zip(dom, ja)), y), "c": cls._sums(list(zip(dom, jb)), y),
                  "d": cls._sums([(d,) for d in dom], y), "p": cls._sums(list(zip(dom, ja, jb)), y)}
        prior = cls(tables, prior_n)
        return prior, prior.values(dom, ja, jb)

    def values(self, domains: Sequence[str], ja: Sequence[str], jb: Sequence[str]) -> np.ndarray:
        """Priors of ordered pairs (domain, job key string of A, of B), each leaving out the pair's own rows."""
        t = self.tables
        zero = (0.0, 0.0)
        out = np.empty((len(domains), 8))
        for i, (d, a, b) in enumerate(zip(domains, ja, jb)):
            ab = t["p"].get((d, a, b), zero)
            ba = t["p"].get((d, b, a), zero) if a != b else zero
            out[i] = (*t["r"].get((d, a), zero), *t["c"].get((d, b), zero), *t["d"].get((d,), zero),
                      ab[0] + ba[0], ab[1] + ba[1])
            out[i, 0] -= ab[0]
            out[i, 1] -= ab[1]
            out[i, 2] -= ab[0]
            out[i, 3] -= ab[1]
        return _prior_value(out[:, 0], out[:, 1], out[:, 2], out[:, 3], out[:, 4] - out[:, 6], out[:, 5] - out[:, 7],
                            self.prior_n, self.global_mean)

    def to_json(self) -> dict:
        return {"prior_n": self.prior_n,
                "tables": {name: [[list(k), v[0], v[1]] for k, v in tab.items()] for name, tab in self.tables.items()}}

    @classmethod
    def from_json(cls, data: dict) -> _JobPrior:
        tables = {name: {tuple(k): (float(s), float(n)) for k, s, n in tab} for name, tab in data["tables"].items()}
        if set(tables) != set(cls.TABLES):
            raise ValueError(f"job prior: tables {sorted(tables)}, expected {list(cls.TABLES)}")
        return cls(tables, float(data["prior_n"]))


# --------------------------------------------------------------------------------------------------
# Matrix factorisation
# --------------------------------------------------------------------------------------------------


def _jk(key: tuple) -> str:
    """A job key as a stable string (JSON keys)."""
    fam, bs, prec, training = key
    return f"{fam}|{bs}|{prec}|{int(training)}"


class _MatrixFactors:
    """Biased matrix factorisation of ordered-pair throughput per domain (one variant).

    A domain is a GPU type plus measurement environment. Row/column biases are per (domain, job type);
    embeddings are per (domain, job type) or, when ``share_u`` / ``share_v``, per job type across the GPU
    types of one environment.
    """

    def __init__(self, share_u: bool, share_v: bool, names: dict[str, list[str]], mu: np.ndarray,
                 rb: np.ndarray, cb: np.ndarray, u: np.ndarray, v: np.ndarray) -> None:
        self.share_u, self.share_v = share_u, share_v
        self.names = names  # "g", "r", "c", "u", "v" -> key names, index order of the arrays
        self.pos = {k: {name: i for i, name in enumerate(lst)} for k, lst in names.items()}
        self.mu, self.rb, self.cb, self.u, self.v = mu, rb, cb, u, v

    def keys_of(self, job_key: tuple, domain: str, env: str) -> tuple[int, int, int, int, int]:
        """Indices (domain, row bias, column bias, row embedding, column embedding) of a job type in a
        domain (GPU type plus environment, ``JobProfile.domain``); -1 when unseen."""
        jk = _jk(job_key)
        gk = f"{domain}#{jk}"
        ek = f"{env}#{jk}"
        pos = self.pos
        return (pos["g"].get(domain, -1), pos["r"].get(gk, -1), pos["c"].get(gk, -1),
                pos["u"].get(ek if self.share_u else gk, -1), pos["v"].get(ek if self.share_v else gk, -1))

    @classmethod
    def fit(cls, pairs: Sequence[tuple[JobProfile, JobProfile]], y: np.ndarray, p: TrainParams,
            share_u: bool, share_v: bool, seed: int) -> _MatrixFactors:
        ja = [f"{a.env}#{_jk(a.job_key)}" for a, _ in pairs]  # shared embeddings: one per job type and env
        jb = [f"{b.env}#{_jk(b.job_key)}" for _, b in pairs]
        gpu = [a.domain for a, _ in pairs]
        ra = [f"{a.domain}#{_jk(a.job_key)}" for a, _ in pairs]
        cb_keys = [f"{b.domain}#{_jk(b.job_key)}" for _, b in pairs]

        def index(items: list[str]) -> tuple[np.ndarray, list[str]]:
            names = sorted(set(items))
            pos = {k: i for i, k in enumerate(names)}
            return np.array([pos[k] for k in items], dtype=np.int64), names

        gi, gnames = index(gpu)
        ri, rnames = index(ra)
        ci, cnames = index(cb_keys)
        ui, unames = index(ja if share_u else ra)
        vi, vnames = index(jb if share_v else cb_keys)
        yy = np.asarray(y, float)
        mu = np.bincount(gi, yy, len(gnames)) / np.bincount(gi, None, len(gnames))
        rng = np.random.default_rng(seed)
        r = p.mf_rank
        U = rng.normal(0.0, 0.1, (len(unames), r))
        V = rng.normal(0.0, 0.1, (len(vnames), r))
        rb = np.zeros(len(rnames))
        cb = np.zeros(len(cnames))
        reg = p.mf_lambda * np.eye(r)
        u_rows = [np.flatnonzero(ui == k) for k in range(len(unames))]
        v_rows = [np.flatnonzero(vi == k) for k in range(len(vnames))]
        n_r = np.bincount(ri, None, len(rnames))
        n_c = np.bincount(ci, None, len(cnames))
        for _ in range(p.mf_iters):
            inter = (U[ui] * V[vi]).sum(1)
            rb = np.bincount(ri, yy - mu[gi] - cb[ci] - inter, len(rnames)) / (n_r + p.mf_bias_lambda)
            cb = np.bincount(ci, yy - mu[gi] - rb[ri] - inter, len(cnames)) / (n_c + p.mf_bias_lambda)
            res = yy - mu[gi] - rb[ri] - cb[ci]
            for k, rows in enumerate(u_rows):
                z = V[vi[rows]]
                U[k] = np.linalg.solve(z.T @ z + reg, z.T @ res[rows])
            for k, rows in enumerate(v_rows):
                z = U[ui[rows]]
                V[k] = np.linalg.solve(z.T @ z + reg, z.T @ res[rows])
        names = {"g": gnames, "r": rnames, "c": cnames, "u": unames, "v": vnames}
        return cls(share_u, share_v, names, mu, rb, cb, U, V)

    def predict_idx(self, ka: np.ndarray, kb: np.ndarray) -> np.ndarray:
        """Predictions from index rows (``keys_of`` of A and of B, ``[n, 5]`` each); NaN where unseen."""
        g, r, u = ka[:, 0], ka[:, 1], ka[:, 3]
        c, v = kb[:, 2], kb[:, 4]
        ok = (g >= 0) & (r >= 0) & (c >= 0)
        out = np.full(len(ka), np.nan)
        if ok.any():
            inter = np.zeros(len(ka))
            emb = ok & (u >= 0) & (v >= 0)
            inter[emb] = (self.u[u[emb]] * self.v[v[emb]]).sum(1)
            out[ok] = self.mu[g[ok]] + self.rb[r[ok]] + self.cb[c[ok]] + inter[ok]
        return out

    def to_json(self) -> dict:
        return {"share_u": self.share_u, "share_v": self.share_v, "names": self.names, "mu": self.mu.tolist(),
                "rb": self.rb.tolist(), "cb": self.cb.tolist(), "u": self.u.tolist(), "v": self.v.tolist()}

    @classmethod
    def from_json(cls, d: dict) -> _MatrixFactors:
        r = len(d["u"][0]) if d["u"] else 0
        return cls(bool(d["share_u"]), bool(d["share_v"]), {k: list(v) for k, v in d["names"].items()},
                   np.asarray(d["mu"], float), np.asarray(d["rb"], float), np.asarray(d["cb"], float),
                   np.asarray(d["u"], float).reshape(-1, r), np.asarray(d["v"], float).reshape(-1, r))


_MF_VARIANTS = ((False, False), (True, False), (False, True))


# --------------------------------------------------------------------------------------------------
# k-way composition
# --------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


def _profile_to_json(p: JobProfile) -> dict:
    d = asdict(p)
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def _profile_from_json(d: dict) -> JobProfile:
    kw = {}
    for f in fields(JobProfile):
        if f.name not in d:
            continue
        v = d[f.name]
        kw[f.name] = float("nan") if v is None and isinstance(f.default, float) else v
    return JobProfile(**kw)


_CACHE_MAX = 65_536


class _ProfileTable:
    """Integer ids for the profiles a model has seen, with their precomputed parts in arrays.

    A profile is completed from the catalogue *at the vector level*: its solo vector's NaN entries take
    the catalogued job type's values (every solo feature depends on one profile field plus the job type,
    so this equals completing the fields first). Prediction then works on id arrays with numpy gathers.
    Not thread-safe on its own: the model holds a lock around it.
    """

    _UNKNOWN_ARCH = "?"

    def __init__(self, catalog: ProfileCatalog, factors: list[_MatrixFactors], families: frozenset[str],
                 gpus: frozenset[str], envs: frozenset[str], reference_env: str, booster_set_of_env,
                 prior: _JobPrior | None = None, cap_of_domain=None) -> None:
        self._catalog = catalog
        self._factors = factors
        self._prior = prior
        self._families = families
        self._gpus = gpus
        self._envs = envs
        self._reference_env = reference_env
        self._set_of_env = booster_set_of_env
        self._cap_of_domain = cap_of_domain or (lambda domain: -1)
        self.hard_reset()

    def hard_reset(self) -> None:
        """Forget everything, including the job-type-level memos (bounds memory under arbitrary input)."""
        self._interned: dict[object, int] = {}
        self._types: dict[tuple, tuple] = {}
        # encodings per (GPU type, family A, family B) on interned ids; type-level like the catalogue
        self.enc_memo: dict[int, tuple[float, float]] = {}
        self.prior_memo: dict[int, float] = {}  # job-type prior per (domain, job A, job B) on interned ids
        self.reset()

    def reset(self) -> None:
        """Forget the per-profile rows (job-type-level memos stay)."""
        cap = 256
        self.ids: dict[JobProfile, int] = {}
        self.n = 0
        self.solo = np.empty((cap, len(F.SOLO_FEATURES)))
        self.gpu_vec = np.empty((cap, len(F.GPU_FEATURES)))
        self.mf = np.empty((cap, len(self._factors), 5), dtype=np.int64)
        self.fam = np.empty(cap, dtype=np.int64)
        self.arch = np.empty(cap, dtype=np.int64)
        self.key = np.empty(cap, dtype=np.int64)
        self.gpu = np.empty(cap, dtype=np.int64)
        self.low = np.empty(cap, dtype=bool)
        self.bset = np.empty(cap, dtype=np.int64)
        self.cap = np.empty(cap, dtype=np.int64)  # index of the domain's cap classifier, -1 = none
        self.strings: list[tuple[str, str, str, str]] = []  # id -> (domain, env, family, arch): encoder keys
        self.jks: list[str] = []  # id -> job key string (job-type prior keys)
        # Ordered-pair results keyed by ``id_a << 32 | id_b``: the allocator asks about the same candidate
        # pairs every round, and the model is immutable (a refresh builds a new instance), so a bounded memo
        # is always valid; it is forgotten with the ids.
        self.pair_cache: dict[int, float] = {}

    def _intern(self, value: object) -> int:
        got = self._interned.get(value)
        if got is None:
            got = self._interned[value] = len(self._interned)
        return got

    def _type_parts(self, p: JobProfile, env: str) -> tuple:
        """Parts shared by every profile of one job type on one GPU type in environment ``env`` (memoised
        across resets).

        Returns (catalogued solo vector or None, completed job key, factorisation indices, family id,
        arch id, job-key id, domain id, GPU vector, low confidence, (domain, env, family, arch), booster-set
        index, job key string, cap-classifier index).
        """
        tkey = p.job_key + (p.gpu_type, env)
        got = self._types.get(tkey)
        if got is not None:
            return got
        found = self._catalog.get(p.model_family, p.batch_size, p.gpu_type, p.precision, p.training)
        vec = None if found is None else F.solo_vector(found)
        precision = p.precision or (found.precision if found is not None else "")
        job_key = (p.model_family, p.batch_size or 0, precision, p.training)
        arch = p.arch_class or self._UNKNOWN_ARCH
        domain = f"{p.gpu_type}@{env}" if env else p.gpu_type  # JobProfile.domain, with the effective env
        mf = np.array([f.keys_of(job_key, domain, env) for f in self._factors], dtype=np.int64).reshape(-1, 5)
        low = p.model_family not in self._families or p.gpu_type not in self._gpus
        got = (vec, job_key, mf, self._intern(("f", p.model_family)),
               self._intern(("a", arch)) if arch != self._UNKNOWN_ARCH else -1, self._intern(("k", job_key)),
               self._intern(("g", domain)), np.asarray(F.gpu_vector(p.gpu_type, env), float),
               low, (domain, env, p.model_family, arch), self._set_of_env(env), _jk(job_key),
               self._cap_of_domain(domain))
        if len(self._types) < _CACHE_MAX:
            self._types[tkey] = got
        return got

    def _grow(self, need: int) -> None:
        cap = self.solo.shape[0]
        while cap < need:
            cap *= 2
        for name in ("solo", "gpu_vec", "mf", "fam", "arch", "key", "gpu", "low", "bset", "cap"):
            arr = getattr(self, name)
            new = np.empty((cap,) + arr.shape[1:], dtype=arr.dtype)
            new[: self.n] = arr[: self.n]
            setattr(self, name, new)

    def ids_of(self, profiles: Sequence[JobProfile]) -> np.ndarray:
        """Table ids of ``profiles`` (adding the new ones), as an int array."""
        ids = self.ids
        out = [ids.get(p, -1) for p in profiles]
        missing = [i for i, v in enumerate(out) if v < 0]
        if not missing:
            return np.asarray(out, dtype=np.int64)
        if (len(self._interned) > 4 * _CACHE_MAX or len(self.enc_memo) > 4 * _CACHE_MAX
                or len(self.prior_memo) > 4 * _CACHE_MAX):
            self.hard_reset()
            return self.ids_of(profiles)
        new: dict[JobProfile, int] = {}
        slot = [new.setdefault(profiles[i], len(new)) for i in missing]  # one lookup per missing profile
        if self.n and self.n + len(new) > _CACHE_MAX:
            self.reset()  # then n == 0: one batch may exceed the cap, it never loops
            return self.ids_of(profiles)
        if self.n + len(new) > self.solo.shape[0]:
            self._grow(self.n + len(new))
        fresh = list(new)
        base, k = self.n, len(fresh)
        # an environment the model has no rows of is answered as the reference environment
        parts = [self._type_parts(p, p.env if p.env in self._envs else self._reference_env) for p in fresh]
        solo = F.solo_matrix(fresh)
        unknown = np.full(len(F.SOLO_FEATURES), np.nan)
        catalogued = np.array([unknown if pt[0] is None else pt[0] for pt in parts])
        gap = np.isnan(solo)
        solo[gap] = catalogued[gap]  # complete from the catalogue (NaN stays NaN for an uncatalogued type)
        rows = slice(base, base + k)
        self.solo[rows] = solo
        self.mf[rows] = np.stack([pt[2] for pt in parts])
        self.fam[rows], self.arch[rows], self.key[rows], self.gpu[rows] = np.array([pt[3:7] for pt in parts]).T
        self.gpu_vec[rows] = np.stack([pt[7] for pt in parts])
        self.low[rows] = [pt[8] for pt in parts]
        self.bset[rows] = [pt[10] for pt in parts]
        self.cap[rows] = [pt[12] for pt in parts]
        self.strings.extend(pt[9] for pt in parts)
        self.jks.extend(pt[11] for pt in parts)
        for j, p in enumerate(fresh):
            ids[p] = base + j
        self.n += k
        for i, j in zip(missing, slot):
            out[i] = base + j
        return np.asarray(out, dtype=np.int64)


class InterferenceModel:
    """A trained interference model. Build with :func:`train_model` or :meth:`load`; immutable afterwards."""

    def __init__(self, booster_sets: dict[str, list[xgb.Booster]], encoder: _Encoder,
                 factors: list[_MatrixFactors], catalog: ProfileCatalog, meta: dict, params: TrainParams,
                 prior: _JobPrior | None = None, cap_boosters: dict[str, xgb.Booster] | None = None) -> None:
        if GENERAL_SET not in booster_sets:
            raise ValueError(f"booster_sets: the general set {GENERAL_SET!r} is required")
        self._booster_sets = booster_sets
        self._set_names = sorted(booster_sets)
        self._set_list = [booster_sets[k] for k in self._set_names]
        self._encoder = encoder
        self._factors = factors
        self._prior = prior
        self._cap_boosters = dict(cap_boosters or {})  # domain -> classifier of P(value kept at 1)
        self._cap_names = sorted(self._cap_boosters)
        self._cap_list = [self._cap_boosters[k] for k in self._cap_names]
        self._catalog = catalog
        self._params = params
        self.meta = dict(meta)
        self._families = frozenset(meta["families_seen"])
        self._gpus = frozenset(meta["gpus_seen"])
        self._envs = frozenset(meta["envs_seen"])
        general = self._set_names.index(GENERAL_SET)
        index = {name: i for i, name in enumerate(self._set_names)}
        cap_index = {name: i for i, name in enumerate(self._cap_names)}
        self._table = _ProfileTable(catalog, factors, self._families, self._gpus, self._envs,
                                    meta["reference_env"], lambda env: index.get(env, general), prior,
                                    lambda domain: cap_index.get(domain, -1))
        self._lock = threading.Lock()
        for boosters in self._set_list + [self._cap_list]:
            for b in boosters:
                b.set_param({"nthread": params.nthread})
        # Identity-link objectives predict ``margin + trees``; passing base_margin to inplace_predict costs
        # ~5 ms per call (XGBoost builds its meta info), so the margin is added here instead:
        # ``inplace_predict(X) - base_score + margin``, exact for these objectives.
        self._base_scores = [[_base_score(b) for b in boosters] for boosters in self._set_list]
        self._add_margin = params.objective in _IDENTITY_OBJECTIVES

    # ---- metadata ---------------------------------------------------------------------------------

    @property
    def version(self) -> str:
        """Model version string, e.g. ``"20250101T120000Z-1a2b3c4d"`` (creation time + data digest)."""
        return self.meta["version"]

    @property
    def schema_version(self) -> str:
        return self.meta["schema_version"]

    @property
    def data_digest(self) -> str:
        """sha256 (hex) of the training rows."""
        return self.meta["training_data_sha256"]

    @property
    def metrics(self) -> dict[str, float]:
        return dict(self.meta.get("metrics", {}))

    @property
    def params(self) -> TrainParams:
        return self._params

    @property
    def catalog(self) -> ProfileCatalog:
        """The solo profiles known to the model (used to complete request profiles)."""
        return self._catalog

    def with_metrics(self, metrics: dict[str, float]) -> InterferenceModel:
        """A copy whose metadata carries ``metrics`` (merged over existing ones)."""
        meta = dict(self.meta)
        meta["metrics"] = {**self.meta.get("metrics", {}), **{k: float(v) for k, v in metrics.items()}}
        return InterferenceModel(self._booster_sets, self._encoder, self._factors, self._catalog, meta, self._params,
                                 self._prior, self._cap_boosters)

    # ---- prediction -------------------------------------------------------------------------------

    def complete(self, p: JobProfile) -> JobProfile:
        """``p`` with unknown solo fields filled from the model's catalogue (see ``ProfileCatalog``)."""
        return self._catalog.complete(p)

    def _pair_x(self, ia: np.ndarray, ib: np.ndarray) -> np.ndarray:
        """Feature rows (``F.PAIR_FEATURES``) of ordered pairs given by profile-table ids."""
        T = self._table
        n = len(ia)
        bad = np.flatnonzero(T.gpu[ia] != T.gpu[ib])
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"pairs[{i}]: gpu_type/env differs between a ({T.strings[ia[i]][0]}) "
                             f"and b ({T.strings[ib[i]][0]})")
        same = np.column_stack([T.fam[ia] == T.fam[ib], T.key[ia] == T.key[ib],
                                (T.arch[ia] == T.arch[ib]) & (T.arch[ia] >= 0)]).astype(float)
        # Encodings depend only on (domain, family of A, family of B): memoised on interned ids.
        enc = np.empty((n, len(F.ENCODING_FEATURES)))
        memo = T.enc_memo
        codes = (T.gpu[ia] << 40) | (T.fam[ia] << 20) | T.fam[ib]
        uniq, first, inv = np.unique(codes, return_index=True, return_inverse=True)
        got = []
        for code, r in zip(uniq.tolist(), first.tolist()):
            hit = memo.get(code)
            if hit is None:
                da, ea, fa, aa = T.strings[ia[r]]
                _, _, fb, ab = T.strings[ib[r]]
                hit = memo[code] = self._encoder.lookup_one(_enc_keys(da, ea, fa, fb, aa, ab))
            got.append(hit)
        enc[:] = np.asarray(got, float).reshape(-1, 2)[inv.reshape(-1)]
        return F.pair_rows(T.gpu_vec[ia], T.solo[ia], T.solo[ib], same, enc)

    def _margin(self, ia: np.ndarray, ib: np.ndarray) -> np.ndarray | None:
        """The boosters' base margin (job-type additive prior), or None when the model has none."""
        if not self._params.prior_margin or self._prior is None:
            return None
        T = self._table
        memo = T.prior_memo
        codes = (T.gpu[ia] << 40) | (T.key[ia] << 20) | T.key[ib]
        uniq, first, inv = np.unique(codes, return_index=True, return_inverse=True)
        todo = [(c, r) for c, r in zip(uniq.tolist(), first.tolist()) if c not in memo]
        if todo:
            rows = [r for _, r in todo]
            vals = self._prior.values([T.strings[ia[r]][0] for r in rows], [T.jks[ia[r]] for r in rows],
                                      [T.jks[ib[r]] for r in rows])
            memo.update(zip([c for c, _ in todo], vals.tolist()))
        return np.array([memo[c] for c in uniq.tolist()])[inv.reshape(-1)]

    def _booster_calls(self, X: np.ndarray, ia: np.ndarray, margin: np.ndarray | None) -> tuple[list, list]:
        """The boosters' predictions this batch needs, as calls not yet made, and how to combine them.

        Returns ``(calls, plan)``: ``calls[i]()`` gives one booster's output on some rows; ``plan[i]`` is
        ``(kind, rows, extra)`` with kind ``"reg"`` (a bagged regressor of the rows' booster set; ``extra``
        = (bags in the set, value to add)) or ``"cap"`` (the rows' domain cap classifier). ``rows`` is
        None for every row. Making the calls is :func:`_run_calls`' job (two cores when it pays).
        """
        calls: list = []
        plan: list = []
        T = self._table
        sets = T.bset[ia]
        for k in np.unique(sets).tolist():
            m = sets == k
            rows = None if m.all() else np.flatnonzero(m)
            Xk = X if rows is None else X[rows]
            mk = None if margin is None else (margin if rows is None else margin[rows])
            boosters = self._set_list[k]
            for booster, base in zip(boosters, self._base_scores[k]):
                if mk is not None and self._add_margin:
                    calls.append(partial(booster.inplace_predict, Xk))
                    plan.append(("reg", rows, (len(boosters), mk - base)))
                else:
                    calls.append(partial(booster.inplace_predict, Xk) if mk is None
                                 else partial(booster.inplace_predict, Xk, base_margin=mk))
                    plan.append(("reg", rows, (len(boosters), 0.0)))
        if self._cap_list:
            ci = T.cap[ia]
            for k in np.unique(ci[ci >= 0]).tolist():
                rows = np.flatnonzero(ci == k)
                calls.append(partial(self._cap_list[k].inplace_predict, X[rows]))
                plan.append(("cap", rows, None))
        return calls, plan

    def _mf(self, ia: np.ndarray, ib: np.ndarray) -> np.ndarray:
        """Mean of the factorisation variants; NaN where a job type is unseen in the domain."""
        T = self._table
        pm = np.zeros(len(ia))
        for k, f in enumerate(self._factors):
            pm += f.predict_idx(T.mf[ia, k], T.mf[ib, k])
        return pm / len(self._factors)

    def _predict_ids(self, ia: np.ndarray, ib: np.ndarray) -> np.ndarray:
        """Normalised throughput of the first job of each ordered pair, from profile-table ids.

        XGBoost part: the mean of the bagged boosters of each row's booster set (plus the job-type prior
        margin); then the factorisation blend; then rows whose domain's cap classifier gives P(value kept
        at 1) >= ``cap_threshold`` are set to 1, the median of a value that is 1 with probability >= 1/2.
        """
        X = self._pair_x(ia, ib)
        calls, plan = self._booster_calls(X, ia, self._margin(ia, ib))
        outs = _run_calls(calls, len(ia))
        px = np.zeros(len(ia))
        capped = np.zeros(len(ia), dtype=bool)
        for (kind, rows, extra), out in zip(plan, outs):
            sel = slice(None) if rows is None else rows
            if kind == "reg":
                bags, add = extra
                px[sel] += (out + add) / bags
            else:
                capped[sel] |= out >= self._params.cap_threshold
        w = self._params.mf_weight
        if w > 0 and self._factors:
            pm = self._mf(ia, ib)
            ok = np.isfinite(pm)
            px[ok] = (1.0 - w) * px[ok] + w * np.clip(pm[ok], 0.0, 1.0)
        px[capped] = 1.0
        return np.clip(px, 0.0, 1.0)

    def _predict_ordered(self, pairs: Sequence[tuple[JobProfile, JobProfile]]) -> np.ndarray:
        with self._lock:
            ids = self._table.ids_of([p for pair in pairs for p in pair])  # one call: ids stay valid
            return self._predict_ids(ids[0::2], ids[1::2])

    def predict(self, pairs: Sequence[tuple[JobProfile, JobProfile]]) -> Prediction:
        """Both tenants' normalised throughput for each pair, with confidence flags.

        Args:
            pairs: (A, B) profiles sharing one GPU type. Unknown solo fields are completed from the
                model's catalogue first; known fields (live counters, MPS share) are kept.

        Returns:
            :class:`Prediction`; ``norm_tput[i] = [A keeps, B keeps]``; an empty input gives empty arrays.
            Results are memoised per ordered pair of profiles (the model is immutable).

        Raises:
            ValueError: when the two profiles of a pair name different GPU types.
        """
        n = len(pairs)
        if n == 0:
            return Prediction(np.zeros((0, 2)), np.zeros(0, bool), self.version)
        with self._lock:
            T = self._table
            ids = T.ids_of([p for pair in pairs for p in pair])
            ia, ib = ids[0::2], ids[1::2]
            low = T.low[ia] | T.low[ib]
            both_a = np.concatenate([ia, ib])
            both_b = np.concatenate([ib, ia])
            # ordered pairs as one integer each (table ids are < 2**31; the memo dies with the ids)
            codes = (both_a << 32) | both_b
            cache = T.pair_cache
            get = cache.get
            found = [get(c) for c in codes.tolist()]
            if None in found:
                values = np.array([math.nan if v is None else v for v in found])
                m = np.flatnonzero(np.isnan(values))
                uniq, first, inv = np.unique(codes[m], return_index=True, return_inverse=True)
                fresh = self._predict_ids(both_a[m[first]], both_b[m[first]])
                values[m] = fresh[inv.reshape(-1)]
                if len(cache) + len(uniq) > _CACHE_MAX:
                    cache.clear()
                cache.update(zip(uniq.tolist(), fresh.tolist()))
            else:
                values = np.array(found)
        return Prediction(np.column_stack([values[:n], values[n:]]), low, self.version)

    def clear_cache(self) -> None:
        """Forget memoised per-profile and per-pair results (for cold-latency measurements)."""
        with self._lock:
            self._table.reset()

    def predict_pairs(self, pairs: Sequence[tuple[JobProfile, JobProfile]]) -> np.ndarray:
        """``[n, 2]`` normalised throughputs of (A, B) for each pair (see :meth:`predict`)."""
        return self.predict(pairs).norm_tput

    def low_confidence(self, pairs: Sequence[tuple[JobProfile, JobProfile]]) -> np.ndarray:
        """``[n]`` bool: the pair involves a model family or GPU type unseen in training."""
        return self.predict(pairs).low_confidence

    def predict_k_way(self, profiles: Sequence[JobProfile]) -> np.ndarray:
        """Normalised throughput of each of k tenants sharing one GPU, composed from pairwise predictions.

        See :func:`compose_k_way` for the rule and its reasoning. ``k = 1`` gives ``[1.0]``.

        Raises:
            ValueError: empty input, or tenants on different GPU types / environments.
        """
        k = len(profiles)
        if k == 0:
            raise ValueError("profiles: at least one tenant is required")
        if len({p.domain for p in profiles}) != 1:
            raise ValueError("profiles: all tenants must share one GPU type (and environment)")
        idx = [(i, j) for i in range(k) for j in range(i + 1, k)]
        pw = np.ones((k, k))
        if idx:
            pred = self.predict_pairs([(profiles[i], profiles[j]) for i, j in idx])
            for (i, j), (pi, pj) in zip(idx, pred):
                pw[i, j], pw[j, i] = pi, pj
        return compose_k_way(pw)

    # ---- persistence --------------------------------------------------------------------------------

    def to_json_dict(self) -> dict:
        """The artifact as a JSON-serialisable dict."""
        return {
            "format": ARTIFACT_FORMAT,
            **self.meta,
            "params": asdict(self._params),
            "feature_names": list(F.PAIR_FEATURES),
            "boosters": {name: [json.loads(bytes(b.save_raw("json"))) for b in boosters]
                         for name, boosters in self._booster_sets.items()},
            "encoder": self._encoder.to_json(),
            "factors": [f.to_json() for f in self._factors],
            "job_prior": self._prior.to_json() if self._prior is not None else None,
            "cap_boosters": {name: json.loads(bytes(b.save_raw("json"))) for name, b in self._cap_boosters.items()},
            "catalog": [_profile_to_json(p) for p in self._catalog],
        }

    @classmethod
    def from_json_dict(cls, d: dict) -> InterferenceModel:
        """Inverse of :meth:`to_json_dict`.

        Raises:
            ArtifactError: wrong format tag, other feature schema, or missing fields.
        """
        if d.get("format") not in _READABLE_FORMATS:
            raise ArtifactError(f"format {d.get('format')!r} is not one of {_READABLE_FORMATS}: retrain")
        if d.get("schema_version") != F.SCHEMA_VERSION:
            raise ArtifactError(f"feature schema {d.get('schema_version')!r} != {F.SCHEMA_VERSION!r}: retrain")
        if d.get("feature_names") != list(F.PAIR_FEATURES):
            raise ArtifactError("feature_names differ from this build's schema: retrain")
        try:
            params = TrainParams(**d["params"])
            def booster(bj: dict) -> xgb.Booster:
                b = xgb.Booster()
                b.load_model(bytearray(json.dumps(bj).encode()))
                return b

            boosters = {name: [booster(bj) for bj in items] for name, items in d["boosters"].items()}
            cap_boosters = {name: booster(bj) for name, bj in (d.get("cap_boosters") or {}).items()}
            meta_keys = ("version", "schema_version", "created_at", "created_at_unix_s", "training_data_sha256",
                         "training_rows", "metrics", "seed", "families_seen", "gpus_seen", "envs_seen", "reference_env")
            meta = {k: d[k] for k in meta_keys}
            return cls(boosters, _Encoder.from_json(d["encoder"]),
                       [_MatrixFactors.from_json(f) for f in d["factors"]],
                       ProfileCatalog(_profile_from_json(p) for p in d["catalog"]), meta, params,
                       _JobPrior.from_json(d["job_prior"]) if d.get("job_prior") is not None else None,
                       cap_boosters)
        except (KeyError, TypeError, ValueError, xgb.core.XGBoostError) as exc:
            raise ArtifactError(f"malformed model artifact: {exc}") from exc

    def save(self, path: str | os.PathLike) -> Path:
        """Write the artifact atomically (temporary file in the same folder, fsync, rename).

        Readers never see a half-written file; a crash leaves at most a ``*.json.tmp`` file behind.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps(self.to_json_dict(), separators=(",", ":"), allow_nan=False).encode()
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem + ".", suffix=".json.tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> InterferenceModel:
        """Read an artifact written by :meth:`save`.

        Raises:
            ArtifactError: missing file, invalid JSON, or incompatible artifact.
        """
        try:
            with open(path, "rb") as fh:
                d = json.loads(fh.read())
        except FileNotFoundError as exc:
            raise ArtifactError(f"{path}: no model artifact (train one: python -m services.predictor.train)") from exc
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"{path}: not JSON: {exc}") from exc
        return cls.from_json_dict(d)


def save_model(model: InterferenceModel, path: str | os.PathLike = DEFAULT_MODEL_PATH) -> Path:
    """Atomically write ``model`` to ``path`` (see :meth:`InterferenceModel.save`)."""
    return model.save(path)


def load_model(path: str | os.PathLike = DEFAULT_MODEL_PATH) -> InterferenceModel:
    """Read the artifact at ``path`` (see :meth:`InterferenceModel.load`)."""
    return InterferenceModel.load(path)


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


def _nan_none(x: float) -> float | None:
    return None if math.isnan(x) else round(float(x), 12)


def data_digest(rows: Sequence[Observation]) -> str:
    """sha256 (hex) over the training rows in order: both profiles and both targets."""
    h = hashlib.sha256()
    for r in rows:
        rec = [_profile_to_json(r.a), _profile_to_json(r.b), _nan_none(r.norm_tput_a), _nan_none(r.norm_tput_b),
               r.failed]
        h.update(json.dumps(rec, sort_keys=True, default=_nan_none).encode())
        h.update(b"\n")
    return h.hexdigest()


def ordered_examples(rows: Sequence[Observation]) -> tuple[list[tuple[JobProfile, JobProfile]], np.ndarray, list[tuple]]:
    """Both orderings of every usable row: (pairs, targets, groups).

    Failed rows (the pair could not run together) have no throughput and are skipped: feasibility is a
    memory-capacity question the placement answers from ``mem_used_mib``, and a target of 0 would drag the
    predictions of feasible neighbours down.
    """
    pairs: list[tuple[JobProfile, JobProfile]] = []
    ys: list[float] = []
    groups: list[tuple] = []
    for r in rows:
        if r.failed or not (math.isfinite(r.norm_tput_a) and math.isfinite(r.norm_tput_b)):
            continue
        g = r.group
        pairs += [(r.a, r.b), (r.b, r.a)]
        ys += [float(r.norm_tput_a), float(r.norm_tput_b)]
        groups += [g, g]
    return pairs, np.asarray(ys, float), groups


#: Preferred reference environments, in order: requests from an environment without training rows (this
#: cluster, before its node agents reported observations) are answered as if measured in the first of
#: these that has rows; failing all, the environment with the most rows.
REFERENCE_ENVS = ("", "gavel")


def _reference_env(env: np.ndarray) -> str:
    names, counts = np.unique(env, return_counts=True)
    present = dict(zip(names.tolist(), counts.tolist()))
    for e in REFERENCE_ENVS:
        if present.get(e, 0) > 0:
            return e
    return max(present, key=lambda e: (present[e], e))


def _fit_cap_classifiers(X: np.ndarray, y: np.ndarray, domain: np.ndarray, p: TrainParams,
                         seed: int) -> dict[str, xgb.Booster]:
    """One classifier of P(value >= ``_CAP_LEVEL``) per domain where enough training values sit at 1.

    A domain qualifies with at least ``cap_min_frac`` of its values and ``cap_min_rows`` values at the cap
    (Gavel's measured V100 campaign: 12%, mostly ResNet-18 as the measured job; Gavel's second P100
    campaign: 19%; Lucid: values at or above 1 are noise around 1). Same features as the boosters
    (leave-own-pair-out encodings included), logistic loss, hyper-parameters fixed in advance.
    """
    out: dict[str, xgb.Booster] = {}
    xparams = {"objective": "binary:logistic", "max_depth": p.cap_max_depth, "eta": p.cap_eta,
               "min_child_weight": 1.0, "subsample": 0.8, "colsample_bytree": 0.8, "tree_method": "hist",
               "nthread": p.nthread, "verbosity": 0, "seed": seed}
    for name in sorted(set(domain.tolist())):
        m = domain == name
        label = (y[m] >= _CAP_LEVEL).astype(float)
        if label.sum() >= p.cap_min_rows and label.mean() >= p.cap_min_frac:
            d = xgb.DMatrix(X[m], label=label, feature_names=list(F.PAIR_FEATURES), nthread=p.nthread)
            out[name] = xgb.train(xparams, d, p.cap_rounds)
    return out


def train_model(rows: Sequence[Observation], seed: int = 0, params: TrainParams | None = None,
                catalog: ProfileCatalog | None = None) -> InterferenceModel:
    """Train an :class:`InterferenceModel` on co-location observations.

    The service's online refresh calls this with the shipped rows plus observations reported by node
    agents. Deterministic for a given seed, rows and thread count.

    Args:
        rows: observations; failed rows are skipped (see :func:`ordered_examples`).
        seed: seed of the XGBoost bags and of the factorisation initialisation.
        params: hyper-parameters (defaults: :class:`TrainParams`).
        catalog: solo profiles that complete training and request profiles (copied, never modified); job
            types it lacks are added from ``rows``. Default: the profiles appearing in ``rows``.

    Returns:
        The trained model; ``meta["metrics"]`` holds in-sample MAE/MAPE (cross-validated figures come from
        ``services.predictor.evaluate --cv``).

    Raises:
        ValueError: when no usable row remains.
    """
    p = params or TrainParams()
    pairs, y, groups = ordered_examples(rows)
    if len(pairs) == 0:
        raise ValueError("rows: no usable observation (all failed or empty)")
    # Request profiles are completed from the catalogue, so training rows must see the same completion.
    # The catalogue is complete *before* any row is completed: a job type known only from the rows (an
    # observation naming no precision, next to shipped fp32 rows) must be completed in training exactly as
    # a request for it is completed at prediction, or its job-type keys (factorisation, prior) differ.
    catalog = ProfileCatalog(catalog if catalog is not None else ())
    for a, b in pairs:  # job types known only from observations become completable too
        for prof in (a, b):
            if catalog.get(prof.model_family, prof.batch_size, prof.gpu_type, prof.precision, prof.training) is None:
                catalog.add(prof)
    pairs = [(catalog.complete(a), catalog.complete(b)) for a, b in pairs]
    encoder, loo = _Encoder.fit(pairs, y, groups)
    prior = None
    margin = None
    if p.prior_margin:
        # Boosters fit the residual from the job-type additive prior. A training row's prior leaves out its
        # own job-type pair, like a pair never seen; the trees never see the prior as a feature, so the
        # leave-out cannot leak the row's own target into a split (as it did when offered as features).
        prior, margin = _JobPrior.fit(pairs, y, p.prior_n)
    X = F.pair_matrix(pairs, loo)
    base_score = float(np.clip(np.median(y), 0.05, 0.95))
    xparams = {
        "objective": p.objective, "huber_slope": p.huber_slope, "base_score": base_score,
        "max_depth": p.max_depth, "min_child_weight": p.min_child_weight, "eta": p.eta,
        "subsample": p.subsample, "colsample_bytree": p.colsample_bytree, "tree_method": "hist",
        "nthread": p.nthread, "verbosity": 0,
    }
    if p.monotone_enc:
        xparams["monotone_constraints"] = "(" + ",".join("1" if n == "enc_pair_mean" else "0"
                                                         for n in F.PAIR_FEATURES) + ")"
    env = np.array([a.env for a, _ in pairs])

    def fit_set(mask: np.ndarray) -> list[xgb.Booster]:
        d = xgb.DMatrix(X[mask], label=y[mask], feature_names=list(F.PAIR_FEATURES), nthread=p.nthread,
                        base_margin=None if margin is None else margin[mask])
        return [xgb.train({**xparams, "seed": seed + k}, d, p.rounds) for k in range(p.n_bags)]

    envs, counts = np.unique(env, return_counts=True)
    booster_sets = {GENERAL_SET: fit_set(np.ones(len(y), dtype=bool))}
    if len(envs) > 1:
        for e, c in zip(envs.tolist(), counts.tolist()):
            if c >= p.env_min_examples:
                booster_sets[e] = fit_set(env == e)
    factors = ([_MatrixFactors.fit(pairs, y, p, su, sv, seed + 17 * (k + 1)) for k, (su, sv) in enumerate(_MF_VARIANTS)]
               if p.mf_weight > 0 else [])
    cap_boosters = _fit_cap_classifiers(X, y, np.array([a.domain for a, _ in pairs]), p, seed) if p.cap_model else {}
    now = _dt.datetime.now(_dt.timezone.utc)
    digest = data_digest(rows)
    meta = {
        "version": f"{now:%Y%m%dT%H%M%SZ}-{digest[:8]}",
        "schema_version": F.SCHEMA_VERSION,
        "created_at": now.isoformat(timespec="seconds"),
        "created_at_unix_s": now.timestamp(),
        "training_data_sha256": digest,
        "training_rows": len(rows),
        "metrics": {},
        "seed": seed,
        "families_seen": sorted({a.model_family for a, _ in pairs}),
        "gpus_seen": sorted({a.gpu_type for a, _ in pairs}),
        "envs_seen": sorted(set(env.tolist())),
        "reference_env": _reference_env(env),
    }
    model = InterferenceModel(booster_sets, encoder, factors, catalog, meta, p, prior, cap_boosters)
    fit_pred = model._predict_ordered(pairs)
    err = np.abs(fit_pred - y)
    return model.with_metrics({"train_mae": float(err.mean()),
                               "train_mape_pct": float(100 * np.mean(err / np.maximum(y, 1e-3))),
                               "train_examples": float(len(y))})
