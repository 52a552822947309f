"""The trained interference model (:class:`InterferenceModel`): prediction, metadata, persistence.

Prediction of an ordered pair (A, B): the mean of the bagged boosters of the row's booster set (the
environment's own, else the general set :data:`GENERAL_SET`) on top of the job-type prior margin, blended
with the factorisation where both job types were seen in the domain, then set to 1 where the domain's cap
classifier gives P(value kept at 1) >= 1/2, and clipped to [0, 1].

Speed: request profiles get integer ids in a per-model table (:mod:`.table`), so a batch is assembled with
numpy gathers; encodings are looked up once per distinct family pair, each distinct ordered pair is
predicted once (by the cap classifiers only where its domain has one), and results are memoised per
ordered pair of ids (the model is immutable; a refresh builds a new one). The boosters are most of a cold
batch's cost; on batches of :data:`_PARALLEL_MIN_ROWS` ordered rows or more they run on two threads (the
two bagged regressors in parallel, the cap classifier beside the first; XGBoost predicts outside the GIL).
Latency figures: docs/results.md ("Interference predictor: measurement history").
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import xgboost as xgb

from elastico.coloc.rates import compose_k_way
from services.predictor import features as F
from services.predictor.datasets import ProfileCatalog
from services.predictor.features import JobProfile
from services.predictor.model import artifact
from services.predictor.model.artifact import DEFAULT_MODEL_PATH
from services.predictor.model.encoders import Encoder, JobPrior, enc_keys
from services.predictor.model.factors import MatrixFactors
from services.predictor.model.params import TrainParams
from services.predictor.model.table import CACHE_MAX, ProfileTable

#: Name of the booster set trained on every environment (used for environments without a set of their own).
GENERAL_SET = "*"

#: XGBoost objectives whose prediction is ``base margin + sum of trees`` (no link function).
_IDENTITY_OBJECTIVES = frozenset({"reg:squarederror", "reg:pseudohubererror", "reg:absoluteerror"})


def booster_base_score(booster: xgb.Booster) -> float:
    """The booster's ``base_score`` (XGBoost >= 2 stores it as ``"[5.77E-1]"``)."""
    raw = json.loads(booster.save_config())["learner"]["learner_model_param"]["base_score"]
    return float(str(raw).strip("[]").split(",")[0])


#: Batches of at least this many ordered rows split their booster predictions over two threads: below it the
#: hand-off (~0.1 ms) costs more than the second core saves.
_PARALLEL_MIN_ROWS = 64
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def run_calls(calls: Sequence[Callable[[], np.ndarray]], rows: int) -> list[np.ndarray]:
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


@dataclass(frozen=True)
class Prediction:
    """Batched answer of :meth:`InterferenceModel.predict`."""

    norm_tput: np.ndarray  # [n, 2] float64: fraction of isolated throughput kept by A and by B, [0, 1]
    low_confidence: np.ndarray  # [n] bool: a model family or the GPU type was unseen in training
    model_version: str  # version of the model that produced every value


class InterferenceModel:
    """A trained interference model. Build with :func:`train_model` or :meth:`load`; immutable afterwards."""

    def __init__(self, booster_sets: dict[str, list[xgb.Booster]], encoder: Encoder,
                 factors: list[MatrixFactors], catalog: ProfileCatalog, meta: dict, params: TrainParams,
                 prior: JobPrior | None = None, cap_boosters: dict[str, xgb.Booster] | None = None) -> None:
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
        self._table = ProfileTable(catalog, factors, self._families, self._gpus, self._envs,
                                   meta["reference_env"], lambda env: index.get(env, general), prior,
                                   lambda domain: cap_index.get(domain, -1))
        self._lock = threading.Lock()
        for boosters in self._set_list + [self._cap_list]:
            for b in boosters:
                b.set_param({"nthread": params.nthread})
        # Identity-link objectives predict ``margin + trees``; passing base_margin to inplace_predict costs
        # ~5 ms per call (XGBoost builds its meta info), so the margin is added here instead:
        # ``inplace_predict(X) - base_score + margin``, exact for these objectives.
        self._base_scores = [[booster_base_score(b) for b in boosters] for boosters in self._set_list]
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
                hit = memo[code] = self._encoder.lookup_one(enc_keys(da, ea, fa, fb, aa, ab))
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
        None for every row. Making the calls is :func:`run_calls`' job (two cores when it pays).
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
        outs = run_calls(calls, len(ia))
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
                if len(cache) + len(uniq) > CACHE_MAX:
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
        """The artifact as a JSON-serialisable dict (see :mod:`.artifact`)."""
        return artifact.to_json_dict(self.meta, self._params, self._booster_sets, self._encoder, self._factors,
                                     self._prior, self._cap_boosters, self._catalog)

    @classmethod
    def from_json_dict(cls, d: dict) -> InterferenceModel:
        """Inverse of :meth:`to_json_dict`.

        Raises:
            ArtifactError: wrong format tag, other feature schema, or missing fields.
        """
        return artifact.from_json_dict(d, cls)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the artifact atomically (temporary file in the same folder, fsync, rename).

        Readers never see a half-written file; a crash leaves at most a ``*.json.tmp`` file behind.
        """
        return artifact.write_atomic(path, self.to_json_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> InterferenceModel:
        """Read an artifact written by :meth:`save`.

        Raises:
            ArtifactError: missing file, invalid JSON, or incompatible artifact.
        """
        return cls.from_json_dict(artifact.read_json(path))


def save_model(model: InterferenceModel, path: str | os.PathLike = DEFAULT_MODEL_PATH) -> Path:
    """Atomically write ``model`` to ``path`` (see :meth:`InterferenceModel.save`)."""
    return model.save(path)


def load_model(path: str | os.PathLike = DEFAULT_MODEL_PATH) -> InterferenceModel:
    """Read the artifact at ``path`` (see :meth:`InterferenceModel.load`)."""
    return InterferenceModel.load(path)
