"""Accuracy of the interference model on a pair file, side by side with baselines.

``python -m services.predictor.evaluate [--model PATH] --pairs CSV [--cv [--folds K]]``

``--pairs`` accepts files in the exact schema of ``coloc_gavel_pairs.csv`` or ``coloc_lucid_pairs.csv``
(detected from the header), so pairs never seen in training can be scored. Without ``--cv`` the saved
model (default: the artifact the service loads) predicts every row; with ``--cv`` the file itself is
split by *grouped* k-fold cross-validation and a fresh model is trained per fold.

Grouping: a group is an unordered job-type pair, across GPU types. All rows of a held-out pair (both
orderings, every GPU type) leave training together, because the reviewers withheld the same pairs on every
GPU type of the Gavel data (281 identical pairs on K80, P100 and V100). ``--group-by gpu-pair`` groups per
(GPU type, pair) instead, which lets the model see the held-out pair on the other GPU types.

Metrics are over normalised-throughput values (two per pair: A's and B's): MAE, MAPE (%, relative to the
measured value) and the 90th percentile of the absolute error, overall and per GPU type, labelled
``gpu@environment`` (``v100@gavel``: Gavel's measured campaign; ``v100@gavel-oracle``: its older campaign,
recognised from the isolated throughputs in the file; ``rtx3090@lucid``). Gavel rows with
``coloc_failed = 1`` have no throughput target and are excluded (counted in the header).

Baselines (fitted on the training rows: the shipped data for a saved model, the training folds in CV):

* ``mean``: the mean normalised throughput of the GPU type (a constant per GPU type).
* ``util-sum``: time-slicing heuristic ``s * min(1, 100 / (util_a + util_b))`` with a least-squares scale
  ``s`` per GPU type. Solo GPU utilisation comes from counters when known (Lucid); Gavel has no counters,
  so a job's utilisation is inferred from its self-pair in the training rows (two copies each keeping
  ``x`` means each asks for ``50 / x`` % of the GPU), and 100% when that is unknown too.
* ``onehot-xgb`` (CV only): plain XGBoost on one-hot job types of A and B, one-hot GPU type and batch
  sizes, trained on both orderings: what the features and the model must beat.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xgboost as xgb

from services.predictor import features as F
from services.predictor.datasets import ProfileCatalog, detect_pair_schema, read_pair_file, shipped_observations
from services.predictor.features import JobProfile, Observation
from services.predictor.model import (
    DEFAULT_MODEL_PATH,
    ArtifactError,
    InterferenceModel,
    TrainParams,
    ordered_examples,
    train_model,
)

#: Accuracy targets of the issue (Gavel, grouped CV).
TARGET_MAE = 0.035
TARGET_MAPE_PCT = 6.0
TARGET_GPU_MAE = 0.05


# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------


def error_metrics(y: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    """MAE, MAPE (%) and p90 absolute error; ``n`` values."""
    y = np.asarray(y, float)
    err = np.abs(np.asarray(pred, float) - y)
    if len(err) == 0:
        return {"n": 0, "mae": math.nan, "mape_pct": math.nan, "p90": math.nan}
    return {"n": int(len(err)), "mae": float(err.mean()),
            "mape_pct": float(100.0 * np.mean(err / np.maximum(y, 1e-3))), "p90": float(np.percentile(err, 90))}


def metrics_by_gpu(y: np.ndarray, pred: np.ndarray, gpu: Sequence[str]) -> dict[str, dict[str, float]]:
    """:func:`error_metrics` overall (key ``"all"``) and per GPU type."""
    gpu = np.asarray(gpu)
    out = {"all": error_metrics(y, pred)}
    for g in sorted(set(gpu.tolist())):
        m = gpu == g
        out[g] = error_metrics(y[m], pred[m])
    return out


# --------------------------------------------------------------------------------------------------
# Baselines
# --------------------------------------------------------------------------------------------------


class MeanBaseline:
    """Mean normalised throughput per GPU type (global mean for an unseen GPU type)."""

    def __init__(self, rows: Sequence[Observation]) -> None:
        pairs, y, _ = ordered_examples(rows)
        self.global_mean = float(y.mean()) if len(y) else 0.5
        acc: dict[str, list[float]] = defaultdict(list)
        for (a, _), yi in zip(pairs, y):
            acc[a.domain].append(yi)
        self.by_gpu = {g: float(np.mean(v)) for g, v in acc.items()}

    def predict(self, pairs: Sequence[tuple[JobProfile, JobProfile]]) -> np.ndarray:
        return np.array([self.by_gpu.get(a.domain, self.global_mean) for a, _ in pairs])


class UtilSumBaseline:
    """``s_gpu * min(1, 100 / (util_a + util_b))`` (see the module docstring for the utilisation source)."""

    def __init__(self, rows: Sequence[Observation]) -> None:
        pairs, y, _ = ordered_examples(rows)
        self_pair: dict[tuple, list[float]] = defaultdict(list)
        for (a, b), yi in zip(pairs, y):
            if a.job_key == b.job_key:
                self_pair[(a.domain,) + a.job_key].append(yi)
        self.util_proxy = {k: min(100.0, 50.0 / max(float(np.mean(v)), 1e-3)) for k, v in self_pair.items()}
        h = self._heuristic(pairs)
        num: dict[str, float] = defaultdict(float)
        den: dict[str, float] = defaultdict(float)
        for (a, _), hi, yi in zip(pairs, h, y):
            num[a.domain] += hi * yi
            den[a.domain] += hi * hi
        self.scale = {g: num[g] / den[g] for g in num if den[g] > 0}
        self.global_scale = sum(num.values()) / max(sum(den.values()), 1e-12) if num else 1.0

    def util(self, p: JobProfile) -> float:
        if not math.isnan(p.gpu_util_pct):
            return p.gpu_util_pct
        return self.util_proxy.get((p.domain,) + p.job_key, 100.0)

    def _heuristic(self, pairs: Sequence[tuple[JobProfile, JobProfile]]) -> np.ndarray:
        ua = np.array([self.util(a) for a, _ in pairs], float)
        ub = np.array([self.util(b) for _, b in pairs], float)
        return F.util_heuristic(ua, ub)

    def predict(self, pairs: Sequence[tuple[JobProfile, JobProfile]]) -> np.ndarray:
        h = self._heuristic(pairs)
        s = np.array([self.scale.get(a.domain, self.global_scale) for a, _ in pairs])
        return np.clip(s * h, 0.0, 1.0)


class OneHotXGBBaseline:
    """Plain XGBoost on one-hot job types (A, B), one-hot GPU type and log2 batch sizes.

    One booster per measurement environment, like the model (so the comparison isolates the features and
    the learners, not the environment handling); environments unseen in training use the largest one.
    """

    def __init__(self, rows: Sequence[Observation], seed: int = 0, nthread: int = 1) -> None:
        pairs, y, _ = ordered_examples(rows)
        self.jobs = {k: i for i, k in enumerate(sorted({a.job_key for a, _ in pairs}, key=repr))}
        self.gpus = {g: i for i, g in enumerate(sorted({a.domain for a, _ in pairs}))}
        params = {"objective": "reg:squarederror", "max_depth": 6, "eta": 0.05, "subsample": 0.8,
                  "colsample_bytree": 0.8, "seed": seed, "nthread": nthread, "verbosity": 0}
        X = self._matrix(pairs)
        env = np.array([a.env for a, _ in pairs])
        self.boosters: dict[str, xgb.Booster] = {}
        for e in sorted(set(env.tolist())):
            m = env == e
            self.boosters[e] = xgb.train(params, xgb.DMatrix(X[m], label=y[m], nthread=nthread), 300)
        self.default_env = max(self.boosters, key=lambda e: int((env == e).sum())) if self.boosters else ""

    def _matrix(self, pairs: Sequence[tuple[JobProfile, JobProfile]]) -> np.ndarray:
        nj, ng = len(self.jobs), len(self.gpus)
        X = np.zeros((len(pairs), 2 * nj + ng + 2))
        for i, (a, b) in enumerate(pairs):
            if a.job_key in self.jobs:
                X[i, self.jobs[a.job_key]] = 1.0
            if b.job_key in self.jobs:
                X[i, nj + self.jobs[b.job_key]] = 1.0
            if a.domain in self.gpus:
                X[i, 2 * nj + self.gpus[a.domain]] = 1.0
            X[i, -2] = math.log2(a.batch_size) if a.batch_size else np.nan
            X[i, -1] = math.log2(b.batch_size) if b.batch_size else np.nan
        return X

    def predict(self, pairs: Sequence[tuple[JobProfile, JobProfile]]) -> np.ndarray:
        X = self._matrix(pairs)
        env = np.array([a.env if a.env in self.boosters else self.default_env for a, _ in pairs])
        out = np.zeros(len(pairs))
        for e in sorted(set(env.tolist())):
            m = env == e
            out[m] = self.boosters[e].inplace_predict(X[m])
        return np.clip(out, 0.0, 1.0)


# --------------------------------------------------------------------------------------------------
# Scoring and cross-validation
# --------------------------------------------------------------------------------------------------


@dataclass
class Scored:
    """Per-value predictions of several predictors on the same ordered examples."""

    y: np.ndarray  # measured normalised throughput, one per tenant per pair
    gpu: np.ndarray  # GPU type of each value
    preds: dict[str, np.ndarray] = field(default_factory=dict)  # predictor name -> predictions
    n_pairs: int = 0  # scored pairs
    n_failed: int = 0  # pairs excluded because they could not run together
    n_in_training: int = 0  # scored pairs whose job-type pair was in the model's training data
    low_confidence: int = 0  # scored pairs flagged low-confidence by the model

    def subset(self, mask: np.ndarray) -> Scored:
        """The values selected by ``mask`` (counts of pairs are not recomputed)."""
        mask = np.asarray(mask, dtype=bool)
        return Scored(self.y[mask], self.gpu[mask], {k: v[mask] for k, v in self.preds.items()},
                      self.n_pairs, self.n_failed, self.n_in_training, self.low_confidence)

    def table(self) -> dict[str, dict[str, dict[str, float]]]:
        """predictor -> scope ("all" or GPU type) -> metrics."""
        return {name: metrics_by_gpu(self.y, p, self.gpu) for name, p in self.preds.items()}


def _ordered(rows: Sequence[Observation]) -> tuple[list[tuple[JobProfile, JobProfile]], np.ndarray, np.ndarray]:
    pairs, y, _ = ordered_examples(rows)
    return pairs, y, np.array([a.domain for a, _ in pairs])


def score_model(model: InterferenceModel, rows: Sequence[Observation],
                training_rows: Sequence[Observation]) -> Scored:
    """Score a saved model and the baselines (fitted on ``training_rows``) on ``rows``."""
    usable = [r for r in rows if not r.failed]
    pairs, y, gpu = _ordered(usable)
    res = Scored(y, gpu, n_pairs=len(usable), n_failed=len(rows) - len(usable))
    if not usable:
        return res
    pred = model.predict([(r.a, r.b) for r in usable])
    # ordered_examples lists (a, b), (b, a) per row: interleave the two columns the same way
    res.preds["model"] = pred.norm_tput.reshape(-1)
    res.low_confidence = int(pred.low_confidence.sum())
    res.preds["mean"] = MeanBaseline(training_rows).predict(pairs)
    res.preds["util-sum"] = UtilSumBaseline(training_rows).predict(pairs)
    seen = {(r.a.domain, r.group) for r in training_rows}
    res.n_in_training = sum((r.a.domain, r.group) in seen for r in usable)
    return res


def cv_folds(rows: Sequence[Observation], k: int, seed: int = 0, group_by: str = "pair") -> np.ndarray:
    """Fold index of every row: groups (see module docstring) are spread over ``k`` folds at random."""
    if group_by not in ("pair", "gpu-pair"):
        raise ValueError(f"group_by: {group_by!r} must be 'pair' or 'gpu-pair'")
    keys = [r.group if group_by == "pair" else (r.a.domain, r.group) for r in rows]
    uniq = sorted(set(keys), key=repr)
    if k < 2 or k > len(uniq):
        raise ValueError(f"folds: {k} must be in [2, {len(uniq)}] (number of groups)")
    perm = np.random.default_rng(seed).permutation(len(uniq))
    fold_of = {uniq[i]: j % k for j, i in enumerate(perm)}
    return np.array([fold_of[key] for key in keys])


def cross_validate(rows: Sequence[Observation], k: int = 10, seed: int = 0, group_by: str = "pair",
                   params: TrainParams | None = None, baselines: bool = True,
                   catalog: ProfileCatalog | None = None) -> Scored:
    """Grouped k-fold cross-validation of :func:`train_model` and the baselines on ``rows``.

    Each fold trains a fresh model on the other folds' rows only; no row of a held-out group is ever seen.
    """
    folds = cv_folds(rows, k, seed, group_by)
    usable_idx = [i for i, r in enumerate(rows) if not r.failed]
    usable = [rows[i] for i in usable_idx]
    pairs, y, gpu = _ordered(usable)
    fold_of_value = np.repeat(folds[usable_idx], 2)
    names = ["model"] + (["mean", "util-sum", "onehot-xgb"] if baselines else [])
    res = Scored(y, gpu, {n: np.full(len(y), np.nan) for n in names},
                 n_pairs=len(usable), n_failed=len(rows) - len(usable))
    for f in range(k):
        train = [r for r, fo in zip(rows, folds) if fo != f]
        test_rows = [r for r, fo in zip(usable, folds[usable_idx]) if fo == f]
        if not test_rows:
            continue
        mask = fold_of_value == f
        test_pairs = [p for p, m in zip(pairs, mask) if m]
        model = train_model(train, seed=seed, params=params, catalog=catalog)
        res.preds["model"][mask] = model.predict([(r.a, r.b) for r in test_rows]).norm_tput.reshape(-1)
        if baselines:
            res.preds["mean"][mask] = MeanBaseline(train).predict(test_pairs)
            res.preds["util-sum"][mask] = UtilSumBaseline(train).predict(test_pairs)
            res.preds["onehot-xgb"][mask] = OneHotXGBBaseline(train, seed=seed).predict(test_pairs)
    return res


# --------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------


def format_table(scored: Scored) -> str:
    """Side-by-side table: one line per scope, MAE / MAPE% / p90 per predictor."""
    table = scored.table()
    names = list(table)
    scopes = list(next(iter(table.values())).keys()) if table else []
    w = max([8] + [len(s) + 1 for s in scopes])
    head = f"{'scope':<{w}}{'n':>6} " + " ".join(f"| {n + ' MAE  MAPE%  p90':<28}" for n in names)
    lines = [head, "-" * len(head)]
    for s in scopes:
        cells = []
        for n in names:
            m = table[n][s]
            cells.append(f"| {m['mae']:>7.4f} {m['mape_pct']:>6.2f} {m['p90']:>6.3f}{'':<7}")
        lines.append(f"{s:<{w}}{table[names[0]][s]['n']:>6} " + " ".join(cells))
    return "\n".join(lines)


def check_targets(scored: Scored, absolute: bool = True) -> list[tuple[str, bool]]:
    """The issue's accuracy targets, each with PASS (True) / FAIL (False).

    ``absolute`` adds the Gavel thresholds (overall MAE/MAPE, MAE per GPU type); the relative targets
    (the model beats every baseline's MAE on every GPU type) are always checked.
    """
    t = scored.table()
    model = t["model"]
    scopes = [g for g in model if g != "all"]
    out: list[tuple[str, bool]] = []
    if absolute:
        out += [(f"overall MAE {model['all']['mae']:.4f} <= {TARGET_MAE}", model["all"]["mae"] <= TARGET_MAE),
                (f"overall MAPE {model['all']['mape_pct']:.2f}% <= {TARGET_MAPE_PCT}%",
                 model["all"]["mape_pct"] <= TARGET_MAPE_PCT)]
        for g in scopes:
            out.append((f"{g} MAE {model[g]['mae']:.4f} <= {TARGET_GPU_MAE}", model[g]["mae"] <= TARGET_GPU_MAE))
    for name in t:
        if name == "model":
            continue
        worse = [g for g in scopes if not model[g]["mae"] < t[name][g]["mae"]]
        out.append((f"beats {name} (MAE) on every GPU type" + (f" (not on {', '.join(worse)})" if worse else ""),
                    not worse))
    return out


def _describe(path: Path, rows: Sequence[Observation]) -> str:
    schema = detect_pair_schema(path)
    return f"{path.name} ({schema} schema): {len(rows)} pairs"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m services.predictor.evaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_PATH, help="model artifact (default: %(default)s)")
    ap.add_argument("--pairs", type=Path, required=True, help="pair CSV in the Gavel or Lucid schema")
    ap.add_argument("--cv", action="store_true", help="grouped k-fold cross-validation on the file instead")
    ap.add_argument("--folds", type=int, default=10, help="CV folds (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="CV split and training seed (default: %(default)s)")
    ap.add_argument("--group-by", choices=("pair", "gpu-pair"), default="pair",
                    help="CV group: job-type pair on all GPU types (default) or per GPU type")
    args = ap.parse_args(argv)
    try:
        catalog = ProfileCatalog.default()
        rows = read_pair_file(args.pairs, catalog)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(_describe(args.pairs, rows))
    if args.cv:
        scored = cross_validate(rows, k=args.folds, seed=args.seed, group_by=args.group_by, catalog=catalog)
        print(f"grouped {args.folds}-fold CV (group = job-type pair{' per GPU type' if args.group_by == 'gpu-pair' else ' on every GPU type'}), "
              f"{scored.n_pairs} pairs scored, {scored.n_failed} failed pairs excluded")
    else:
        try:
            model = InterferenceModel.load(args.model)
        except ArtifactError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        scored = score_model(model, rows, shipped_observations(catalog))
        print(f"model {model.version} ({args.model}); {scored.n_pairs} pairs scored, {scored.n_failed} failed "
              f"pairs excluded, {scored.low_confidence} low-confidence")
        if scored.n_in_training:
            print(f"note: {scored.n_in_training} of {scored.n_pairs} pairs were in the shipped training data "
                  f"(in-sample for the model and the baselines)")
    if scored.n_pairs == 0:
        print("no scorable pairs")
        return 1
    print(format_table(scored))
    if args.cv:
        gavel = detect_pair_schema(args.pairs) == "gavel"
        if not gavel:
            print("(the absolute targets are defined for Gavel; only the comparisons with baselines apply)")
        for text, ok in check_targets(scored, absolute=gavel):
            print(f"{'PASS' if ok else 'FAIL'}  {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
