"""Training of the interference model (:func:`train_model`) and the training rows' helpers.

Every learner models the *ordered* row (A next to B): training uses both orderings of every measured pair
(:func:`ordered_examples`). Boosters are trained per environment with enough rows plus a general set on
all rows; the factorisation variants and the cap classifiers per domain (GPU type + environment).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
from collections.abc import Sequence

import numpy as np
import xgboost as xgb

from services.predictor import features as F
from services.predictor.datasets import ProfileCatalog
from services.predictor.features import JobProfile, Observation
from services.predictor.model.artifact import profile_to_json
from services.predictor.model.encoders import Encoder, JobPrior
from services.predictor.model.ensemble import GENERAL_SET, InterferenceModel
from services.predictor.model.factors import MF_VARIANTS, MatrixFactors
from services.predictor.model.params import TrainParams

#: A training value at or above this level counts as "kept all of its isolated throughput" for the cap
#: classifiers (Gavel writes exactly 1.0 where the co-located throughput equals the isolated one; Lucid's
#: noise above 1 counts too, since outputs are clipped to 1 anyway).
_CAP_LEVEL = 0.999


def _nan_none(x: float) -> float | None:
    return None if math.isnan(x) else round(float(x), 12)


def data_digest(rows: Sequence[Observation]) -> str:
    """sha256 (hex) over the training rows in order: both profiles and both targets."""
    h = hashlib.sha256()
    for r in rows:
        rec = [profile_to_json(r.a), profile_to_json(r.b), _nan_none(r.norm_tput_a), _nan_none(r.norm_tput_b),
               r.failed]
        h.update(json.dumps(rec, sort_keys=True, default=_nan_none).encode())
        h.update(b"\n")
    return h.hexdigest()


def ordered_examples(
        rows: Sequence[Observation]) -> tuple[list[tuple[JobProfile, JobProfile]], np.ndarray, list[tuple]]:
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
    (Lucid's values at or above 1 are noise around 1). Same features as the boosters (leave-own-pair-out
    encodings included), logistic loss, hyper-parameters fixed in advance.
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
    encoder, loo = Encoder.fit(pairs, y, groups)
    prior = None
    margin = None
    if p.prior_margin:
        # Boosters fit the residual from the job-type additive prior. A training row's prior leaves out its
        # own job-type pair, like a pair never seen; the trees never see the prior as a feature, so the
        # leave-out cannot leak the row's own target into a split (as it did when offered as features).
        prior, margin = JobPrior.fit(pairs, y, p.prior_n)
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
    factors = ([MatrixFactors.fit(pairs, y, p, su, sv, seed + 17 * (k + 1)) for k, (su, sv) in enumerate(MF_VARIANTS)]
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
