"""The solver's working form of a round: normalised, shape-major arrays, and the incumbent it improves.

Column ``k = s * J + j`` holds shape ``s`` of job ``j``; demand is divided by capacity (a full pool is
1.0) and utility by its maximum, so prices and temperatures are scale-free. ``Prepared`` is built once
per solve and answers the hot-loop questions (margins, hard and soft responses, elasticity, load,
value) with preallocated workspaces; ``Incumbent`` keeps the best bound and allocation seen.
"""

from __future__ import annotations

import numpy as np

from services.pricer.core.evaluate import relative_gap
from services.pricer.core.problem import PricingProblem

__all__ = ["Incumbent", "Prepared", "argmax0", "flush", "take_cols"]

# jobs used at most to estimate the elasticity matrix (see Prepared.elasticity)
_HESSIAN_JOBS = 4096
_BIG = 1 << 16  # (shape, job) columns from which the big matvecs avoid BLAS (see Prepared._qd)
_EXP_FLOOR = -600.0  # smallest exponent in the soft response (exp(-600) ~ 1e-261, far from subnormal)
_TINY = 1e-200  # normalised demands and prices below this are zero (subnormal arithmetic is very slow)


class Prepared:
    """Normalised, flattened arrays the iterations work on (built once per solve)."""

    def __init__(self, problem: PricingProblem) -> None:
        c = np.asarray(problem.capacity, dtype=np.float64)
        # the one big copy: demand in pool-major, shape-major layout [R, S, J]; every pass below is
        # then a contiguous sweep, and the normalised demand is computed in place
        dT = np.array(np.asarray(problem.demand).transpose(2, 1, 0), dtype=np.float64, order="C", copy=True)
        uT = np.ascontiguousarray(np.asarray(problem.utility, dtype=np.float64).T)  # [S, J]
        maskT = np.ascontiguousarray(np.asarray(problem.mask, dtype=bool).T)
        S, J = uT.shape
        self.J, self.S, self.R = J, S, c.shape[0]
        self.cap = c
        fits = maskT.copy()
        with np.errstate(invalid="ignore"):  # padding may hold NaN; it is masked out
            for r in range(self.R):
                fits &= dT[r] <= c[r]
            self.never_fits = ~np.any(fits, axis=0)
            # a shape is usable when it exists, beats waiting and fits an empty cluster
            valid = fits & (uT > 0.0)
            # pools no usable shape touches never bind: their price stays 0 and they are left out
            touched = np.array([c[r] > 0.0 and bool(np.any((dT[r] > 0.0) & valid)) for r in range(self.R)], bool)
        self.pools = np.flatnonzero(touched)
        Rp = self.pools.size
        self.Rp = Rp
        self.valid = valid  # [S, J]
        uv = np.where(valid, uT, 0.0)
        self.u_scale = float(uv.max()) if valid.any() else 1.0
        self.uz = uv / self.u_scale  # [S, J], 0 where unusable
        self.un = np.where(valid, self.uz, -np.inf).reshape(S * J)  # [S*J], -inf where unusable
        dn = dT if Rp == self.R else dT[self.pools]
        invalid = ~valid
        for k, pool in enumerate(self.pools):
            dn[k] /= c[pool]  # demand as a fraction of the pool
            np.copyto(dn[k], 0.0, where=invalid | (dn[k] < _TINY))  # no subnormal numbers downstream
        self.dnT = dn.reshape(Rp, S * J)  # [Rp, S*J]
        self.dn3 = self.dnT.reshape(Rp, S, J)
        self.ar = np.arange(J)
        top = self.uz.max(axis=0) if S else np.zeros(J)
        self.top_mean = float(top[top > 0].mean()) if (top > 0).any() else 1.0
        self._big = S * J >= _BIG
        # workspaces for the hot loop: fresh multi-megabyte temporaries cost page faults every call
        self._w1 = np.empty(S * J)
        self._w2 = np.empty(S * J)
        hn = S * min(J, _HESSIAN_JOBS)
        self._h1 = np.empty((Rp, hn))
        self._h2 = np.empty((Rp, hn))

    # -- dual -----------------------------------------------------------------------------------------
    def _qd(self, q: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``q @ dnT`` [S*J]. Above ``_BIG`` columns numpy's own loop (einsum) beats BLAS gemv here: the
        product is memory-bound, and a multi-threaded BLAS call stalls whenever another process holds
        the second core."""
        if self._big:
            return np.einsum("r,rk->k", q, self.dnT, out=out)
        return np.matmul(q, self.dnT, out=out)

    def margins(self, q: np.ndarray) -> np.ndarray:
        """Reduced utility ``u - dn . q`` per (shape, job), -inf where unusable, [S, J]."""
        return (self.un - self._qd(q)).reshape(self.S, self.J)

    def respond(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
        """Hard best response at q: (choice [J], normalised load [Rp], L(q) normalised)."""
        m = self.margins(q)
        mx = m.max(axis=0)
        choice = argmax0(m, mx)
        act = mx > 0.0
        choice[~act] = -1
        load = self.load(choice)
        return choice, load, float(mx[act].sum() + q.sum())

    def smooth(self, q: np.ndarray, tau: float) -> tuple[float, float, np.ndarray, np.ndarray, np.ndarray]:
        """Soft response at temperature tau.

        Returns (L(q), L_tau(q), soft load [Rp], choice probabilities [S, J], wait probability [J]).
        The probabilities live in a workspace buffer: they are valid until the next call.
        """
        S, J = self.S, self.J
        m = self._qd(q, out=self._w1)
        np.subtract(self.un, m, out=m)
        m2 = m.reshape(S, J)
        mx = np.maximum(m2.max(axis=0), 0.0)
        e = np.subtract(m2, mx, out=self._w2.reshape(S, J))
        e *= 1.0 / tau
        # below exp(-600) a choice is irrelevant; flooring keeps subnormal numbers out of every later
        # product (they make arithmetic far slower). Unusable shapes get weight e^-600 on zero demand.
        np.maximum(e, _EXP_FLOOR, out=e)
        np.exp(e, out=e)
        e0 = np.exp(np.maximum(mx * (-1.0 / tau), _EXP_FLOOR))
        Z = e.sum(axis=0)
        Z += e0
        logZ = np.log(Z)
        np.divide(e, Z, out=e)  # now the choice probabilities
        qs = float(q.sum())
        L = float(mx.sum()) + qs
        Lt = float(mx.sum() + tau * logZ.sum()) + qs
        load = np.einsum("rk,k->r", self.dnT, self._w2) if self._big else self.dnT @ self._w2
        return L, Lt, load, e, e0 / Z

    def elasticity(self, pi: np.ndarray, wait: np.ndarray, tau: float) -> np.ndarray:
        """Price elasticity of the soft demand, ``-d load / d q`` = sum_j Cov_pi_j[demand] / tau, [Rp, Rp].

        Only jobs whose soft choice is spread react (the others contribute ~0). Up to
        ``_HESSIAN_JOBS`` of them are used exactly; beyond that an evenly strided, deterministic sample
        of all jobs is used and scaled up: the trust-region step only needs a good direction.
        """
        spread = (pi.max(axis=0) < 1.0 - 1e-7) & (wait < 1.0 - 1e-7)
        n_spread = int(np.count_nonzero(spread))
        if n_spread == 0:
            return np.zeros((self.Rp, self.Rp))
        if n_spread <= _HESSIAN_JOBS:
            jobs = np.flatnonzero(spread)
            X = take_cols(self.dn3, jobs)  # [Rp, S, n]
            W = take_cols(pi, jobs)
            scale = 1.0
        else:
            k = -(-self.J // _HESSIAN_JOBS)
            X = self.dn3[:, :, ::k]
            W = pi[:, ::k]
            scale = self.J / W.shape[1]
        n = W.shape[1]
        Xw = np.multiply(X, W, out=self._h1[:, : self.S * n].reshape(self.Rp, self.S, n))
        if not X.flags.c_contiguous:  # the strided sample: copy once so the product below is one GEMM
            buf = self._h2[:, : self.S * n].reshape(self.Rp, self.S, n)
            np.copyto(buf, X)
            X = buf
        mu = Xw.sum(axis=1)  # [Rp, n] expected demand per job
        H = Xw.reshape(self.Rp, -1) @ X.reshape(self.Rp, -1).T - mu @ mu.T
        return H * (scale / tau)

    # -- primal ---------------------------------------------------------------------------------------
    def load(self, choice: np.ndarray) -> np.ndarray:
        """Normalised load [Rp] of an allocation."""
        jobs = np.flatnonzero(choice >= 0)
        if jobs.size == 0:
            return np.zeros(self.Rp)
        return np.take(self.dnT, choice[jobs] * self.J + jobs, axis=1).sum(axis=1)

    def value(self, choice: np.ndarray) -> float:
        """Normalised utility of an allocation."""
        jobs = np.flatnonzero(choice >= 0)
        return float(self.uz[choice[jobs], jobs].sum()) if jobs.size else 0.0


def flush(q: np.ndarray) -> np.ndarray:
    """Prices that have decayed to nothing become exactly 0 (no subnormal numbers in the matvecs)."""
    q[q < _TINY] = 0.0
    return q


def take_cols(a: np.ndarray, idx: np.ndarray | None) -> np.ndarray:
    """``a[..., idx]`` as a C-contiguous array, or ``a`` itself for ``idx=None`` (every column).

    Fancy indexing on the last axis returns a strided layout that slows every later reduction down.
    """
    if idx is None:
        return a
    return np.take(a, idx, axis=-1)


def argmax0(m: np.ndarray, mx: np.ndarray) -> np.ndarray:
    """First index of the maximum along axis 0 (faster than ``argmax(axis=0)`` for short axes)."""
    b = np.zeros(m.shape[1], dtype=np.int64)
    for s in range(m.shape[0] - 1, 0, -1):
        b[m[s] == mx] = s
    first = m[0] == mx
    b[first] = 0
    return b


class Incumbent:
    """Best dual bound (with its prices) and best feasible allocation seen so far."""

    def __init__(self, P: Prepared) -> None:
        self.P = P
        self.bound = np.inf
        self.q = np.zeros(P.Rp)
        self.choice = np.full(P.J, -1, dtype=np.int64)
        self.value = 0.0

    def offer_bound(self, L: float, q: np.ndarray) -> None:
        """Keep ``L`` (a valid bound, the Lagrangian at ``q``) if it is the smallest so far."""
        if L < self.bound:
            self.bound, self.q = L, q.copy()

    def offer_choice(self, choice: np.ndarray) -> None:
        """Keep a feasible ``choice`` if it is worth more than the best so far."""
        v = self.P.value(choice)
        if v > self.value:
            self.value, self.choice = v, choice

    def gap(self) -> float:
        """Relative gap between the best allocation and the best bound."""
        return relative_gap(self.value, self.bound)
