"""Learned encodings of the interference model: the pair encoding and the job-type prior.

The *pair encoding* (``features.ENCODING_FEATURES``) is the mean normalised throughput of A's family next
to B's family on this GPU type, backing off to the family pair on any GPU type, then to the
architecture-class pair. It is what carries over to *unseen pairs of known job types*: a pair never
measured still has relatives (same families, other batch sizes). A training row's encoding leaves out
every row of its own job-type pair (on all GPU types), exactly as for a pair the model has never seen.

The *job-type prior* (:class:`JobPrior`) is the boosters' base margin: per domain, ``row(A) + column(B) -
mean``, where ``row(A)`` is the mean throughput A keeps next to all its measured co-tenants (how sensitive A
is) and ``column(B)`` the mean its co-tenants keep next to B (how aggressive B is), shrunk towards the
domain mean. It too leaves out the pair's own rows; the trees never see it as a feature, since such
leave-out means leak the row's own target into the splits.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from services.predictor.features import JobProfile


def job_key_str(key: tuple) -> str:
    """A job key as a stable string (JSON keys)."""
    fam, bs, prec, training = key
    return f"{fam}|{bs}|{prec}|{int(training)}"


def enc_keys(domain: str, env: str, fam_a: str, fam_b: str, arch_a: str, arch_b: str) -> tuple[tuple, ...]:
    """Keys of the six encoding levels, most specific first (see ``features.ENCODING_FEATURES``).

    ``domain`` is GPU type plus environment; levels 1 and 3 stay within the environment, 4 and 5 pool all.
    """
    return ((domain, fam_a, fam_b), (env, fam_a, fam_b), (domain, arch_a, arch_b), (env, arch_a, arch_b),
            ("*", fam_a, fam_b), ("*", arch_a, arch_b))


def _profile_enc_keys(a: JobProfile, b: JobProfile) -> tuple[tuple, ...]:
    return enc_keys(a.domain, a.env, a.model_family, b.model_family, a.arch_class or "?", b.arch_class or "?")


_N_LEVELS = 6


def _backoff(levels: np.ndarray) -> np.ndarray:
    """``[n, levels]`` means (NaN = no data) -> ``[n, 2]`` (first finite mean, its level)."""
    out = np.full((levels.shape[0], 2), np.nan)
    for lvl in range(levels.shape[1] - 1, -1, -1):
        ok = np.isfinite(levels[:, lvl])
        out[ok, 0] = levels[ok, lvl]
        out[ok, 1] = lvl
    return out


class Encoder:
    """Means of the target over groups of training rows, backed off by level (see ``ENCODING_FEATURES``)."""

    def __init__(self, tables: list[dict[tuple, tuple[float, float]]] | None = None) -> None:
        self.tables = tables or [{} for _ in range(_N_LEVELS)]

    @classmethod
    def fit(cls, pairs: Sequence[tuple[JobProfile, JobProfile]], y: np.ndarray,
            groups: Sequence[tuple]) -> tuple[Encoder, np.ndarray]:
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
    def from_json(cls, data: list[list]) -> Encoder:
        if len(data) != _N_LEVELS:
            raise ValueError(f"encoder: {len(data)} tables, expected {_N_LEVELS}")
        return cls([{tuple(k): (float(s), float(n)) for k, s, n in tab} for tab in data])


#: the cluster's own environment (a domain without "@env": only observations reported by its nodes) starts from
#: the shipped environments' mean and moves towards its own as rows accumulate; this many rows weigh as much as
#: that start. Unshrunk, the first few observations set the domain mean of every request the cluster makes: one
#: row of 0.3 moved an unrelated pair from 0.60 to 0.18
CLUSTER_DOMAIN_N = 200.0


def _prior_value(sr: np.ndarray, nr: np.ndarray, sc: np.ndarray, nc: np.ndarray, sd: np.ndarray, nd: np.ndarray,
                 prior_n: float, fallback: float, domain_n: np.ndarray | float = 0.0) -> np.ndarray:
    """``row + column - domain`` from sums and counts (the pair's own rows already removed), clipped to [0, 1].

    Row and column means are shrunk towards the domain mean with weight ``prior_n`` rows, and the domain mean
    towards ``fallback`` with weight ``domain_n`` rows; where the domain has no other rows the value is
    ``fallback``.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        dom = np.where(nd > 0, (sd + domain_n * fallback) / (nd + domain_n), np.nan)
        row = (sr + prior_n * dom) / (nr + prior_n)
        col = (sc + prior_n * dom) / (nc + prior_n)
    out = row + col - dom
    return np.clip(np.where(np.isfinite(out), out, fallback), 0.0, 1.0)


class JobPrior:
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
    def fit(cls, pairs: Sequence[tuple[JobProfile, JobProfile]], y: np.ndarray,
            prior_n: float) -> tuple[JobPrior, np.ndarray]:
        """Fit the tables; return them and the training rows' priors (:meth:`values`)."""
        y = np.asarray(y, float)
        ja = [job_key_str(a.job_key) for a, _ in pairs]
        jb = [job_key_str(b.job_key) for _, b in pairs]
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
        own = np.array([CLUSTER_DOMAIN_N if "@" not in d else 0.0 for d in domains])
        return _prior_value(out[:, 0], out[:, 1], out[:, 2], out[:, 3], out[:, 4] - out[:, 6], out[:, 5] - out[:, 7],
                            self.prior_n, self.global_mean, own)

    def to_json(self) -> dict:
        return {"prior_n": self.prior_n,
                "tables": {name: [[list(k), v[0], v[1]] for k, v in tab.items()] for name, tab in self.tables.items()}}

    @classmethod
    def from_json(cls, data: dict) -> JobPrior:
        tables = {name: {tuple(k): (float(s), float(n)) for k, s, n in tab} for name, tab in data["tables"].items()}
        if set(tables) != set(cls.TABLES):
            raise ValueError(f"job prior: tables {sorted(tables)}, expected {list(cls.TABLES)}")
        return cls(tables, float(data["prior_n"]))
