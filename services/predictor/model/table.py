"""Per-model table of request profiles: integer ids with their precomputed parts in arrays.

Request profiles get integer ids (solo vector completed from the catalogue, factorisation indices,
job-type prior keys), so a batch is assembled with numpy gathers; job-type-level parts and ordered-pair
results are memoised, bounded by :data:`CACHE_MAX`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.predictor import features as F
from services.predictor.datasets import ProfileCatalog
from services.predictor.features import JobProfile
from services.predictor.model.encoders import JobPrior, job_key_str
from services.predictor.model.factors import MatrixFactors

CACHE_MAX = 65_536


class ProfileTable:
    """Integer ids for the profiles a model has seen, with their precomputed parts in arrays.

    A profile is completed from the catalogue *at the vector level*: its solo vector's NaN entries take
    the catalogued job type's values (every solo feature depends on one profile field plus the job type,
    so this equals completing the fields first). Prediction then works on id arrays with numpy gathers.
    Not thread-safe on its own: the model holds a lock around it.
    """

    _UNKNOWN_ARCH = "?"

    def __init__(self, catalog: ProfileCatalog, factors: list[MatrixFactors], families: frozenset[str],
                 gpus: frozenset[str], envs: frozenset[str], reference_env: str, booster_set_of_env,
                 prior: JobPrior | None = None, cap_of_domain=None) -> None:
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
               low, (domain, env, p.model_family, arch), self._set_of_env(env), job_key_str(job_key),
               self._cap_of_domain(domain))
        if len(self._types) < CACHE_MAX:
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
        if (len(self._interned) > 4 * CACHE_MAX or len(self.enc_memo) > 4 * CACHE_MAX
                or len(self.prior_memo) > 4 * CACHE_MAX):
            self.hard_reset()
            return self.ids_of(profiles)
        new: dict[JobProfile, int] = {}
        slot = [new.setdefault(profiles[i], len(new)) for i in missing]  # one lookup per missing profile
        if self.n and self.n + len(new) > CACHE_MAX:
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
