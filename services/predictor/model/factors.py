"""Biased matrix factorisation of ordered-pair throughput, the ensemble's second learner.

Per GPU type over job types (row = the job whose throughput is measured, column = its co-tenant):
``mu_g + r[g,A] + c[g,B] + U[A]·V[B]``, three variants (embeddings per GPU type, row embeddings shared
across GPU types, column embeddings shared). It captures "how sensitive is A" and "how aggressive is B"
from every other pair either took part in, which a tree on per-job features learns only indirectly. The
model blends it in (weight ``TrainParams.mf_weight``) only when both job types were seen in the domain.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.predictor.features import JobProfile
from services.predictor.model.encoders import job_key_str
from services.predictor.model.params import TrainParams


class MatrixFactors:
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
        jk = job_key_str(job_key)
        gk = f"{domain}#{jk}"
        ek = f"{env}#{jk}"
        pos = self.pos
        return (pos["g"].get(domain, -1), pos["r"].get(gk, -1), pos["c"].get(gk, -1),
                pos["u"].get(ek if self.share_u else gk, -1), pos["v"].get(ek if self.share_v else gk, -1))

    @classmethod
    def fit(cls, pairs: Sequence[tuple[JobProfile, JobProfile]], y: np.ndarray, p: TrainParams,
            share_u: bool, share_v: bool, seed: int) -> MatrixFactors:
        ja = [f"{a.env}#{job_key_str(a.job_key)}" for a, _ in pairs]  # shared embeddings: one per job type and env
        jb = [f"{b.env}#{job_key_str(b.job_key)}" for _, b in pairs]
        gpu = [a.domain for a, _ in pairs]
        ra = [f"{a.domain}#{job_key_str(a.job_key)}" for a, _ in pairs]
        cb_keys = [f"{b.domain}#{job_key_str(b.job_key)}" for _, b in pairs]

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
    def from_json(cls, d: dict) -> MatrixFactors:
        r = len(d["u"][0]) if d["u"] else 0
        return cls(bool(d["share_u"]), bool(d["share_v"]), {k: list(v) for k, v in d["names"].items()},
                   np.asarray(d["mu"], float), np.asarray(d["rb"], float), np.asarray(d["cb"], float),
                   np.asarray(d["u"], float).reshape(-1, r), np.asarray(d["v"], float).reshape(-1, r))


MF_VARIANTS = ((False, False), (True, False), (False, True))
