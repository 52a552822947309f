"""Primal recovery: feasible allocations from prices, and the final raw-unit capacity guard.

For a feasible allocation ``x`` at prices ``q``, ``value(x) = L(q) - sum_j rc_j(x_j) - q . slack(x)``
(``rc``: a job's reduced-cost loss against its best response), so a good allocation stays near the best
response, wastes little priced capacity and never exceeds a pool. Every pass is vectorised:

1. *repair*: from the best response, while a pool is over capacity move the admitted jobs of the most
   over-subscribed pool to their cheapest alternative (smaller shape, other GPU type or wait), cheapest
   per unit of relieved capacity first, the shortest sorted prefix that removes the excess -- the order
   a price rise on that pool would produce;
2. *fill*: take every job's best improving move that fits, sort, accept the longest fitting prefix
   (``np.cumsum``); repeat until nothing fits;
3. *exchange*: among the jobs cheapest to move, try pairs (improve one, downgrade or park another) best
   net gain first, apply the first pair that fits, refill; repeat;
4. only once the dual has converged with the gap still open: restart 1-2 from a fixed list of slightly
   perturbed prices (changing which near-tied jobs get in) and run 3 on the best;
5. ``guard`` recomputes the load in raw units and drops jobs if float rounding ever pushed a pool over.

Where the LP relaxation is loose (tens of jobs over several pools) the integer optimum can lie well
below the bound; the gap then says so and the status is ``FEASIBLE``.
"""

from __future__ import annotations

import time

import numpy as np

from services.pricer.core.prepared import Incumbent, Prepared, argmax0, take_cols
from services.pricer.core.problem import PricingProblem, SolverOptions

__all__ = ["guard", "recover_into"]


def recover_into(P: Prepared, inc: Incumbent, opts: SolverOptions, deadline: float, final: bool = False) -> None:
    """Build feasible allocations from the best prices so far and keep the best one.

    With ``final`` (the dual has converged but the gap is still open) it also restarts the
    repair/fill passes from slightly perturbed prices -- each pool 2% up and down, all pools 1% and
    3% up and down -- which changes which of the near-tied jobs get in, and runs the exchange pass
    on the best of them. The list is fixed, so the result stays deterministic.
    """
    q = inc.q
    inc.offer_choice(_fill(P, _repair_from(P, q), q))
    if inc.gap() <= opts.gap_tolerance:
        return
    rounds = opts.exchange_rounds if final else min(opts.exchange_rounds, 4)
    inc.offer_choice(_exchange(P, inc.choice, q, rounds, deadline))
    if not final or inc.gap() <= opts.gap_tolerance:
        return
    best, best_v, best_q = None, -np.inf, q
    for qq in _perturbed(q):
        if time.perf_counter() > deadline:
            break
        choice = _fill(P, _repair_from(P, qq), qq)
        v = P.value(choice)
        if v > best_v:
            best, best_v, best_q = choice, v, qq
    if best is not None:
        inc.offer_choice(best)
        inc.offer_choice(_exchange(P, best, best_q, opts.exchange_rounds, deadline))


def _perturbed(q: np.ndarray) -> list[np.ndarray]:
    """The fixed restart prices of a final recovery: each pool 2% up and down, then all pools +-1% and +-3%."""
    out = []
    for r in range(q.size):
        for f in (1.02, 0.98):
            qq = q.copy()
            qq[r] *= f
            out.append(qq)
    for f in (1.01, 0.99, 1.03, 0.97):
        out.append(q * f)
    return out


def _repair_from(P: Prepared, q: np.ndarray) -> np.ndarray:
    """Best response at q, repaired to fit."""
    m = P.margins(q)
    mx = m.max(axis=0)
    choice = argmax0(m, mx)
    choice[mx <= 0.0] = -1
    return _repair(P, choice, m)


def _option_table(P: Prepared, choice: np.ndarray, jobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Utility and normalised demand of the current option of ``jobs``: ([n], [Rp, n])."""
    cur = choice[jobs]
    on = cur >= 0
    cs = np.where(on, cur, 0)
    flat = cs * P.J + jobs
    cu = np.where(on, np.take(P.uz.reshape(-1), flat), 0.0)
    cd = np.where(on, np.take(P.dnT, flat, axis=1), 0.0)
    return cu, cd


# normalised loads are sums of d / capacity: allow their rounding noise; guard re-checks in raw units
_EPS = 1e-12


def _repair(P: Prepared, choice: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Move admitted jobs off over-subscribed pools until every pool fits (normalised units).

    ``m`` are the margins ``u - dn . q`` [S, J] at the prices the allocation came from. Moving a job
    from its option ``c`` to ``a`` frees ``fr`` of the over-subscribed pool ``r`` at a priced cost of
    ``(m_c - m_a) / fr`` per unit: the order in which a price rise on ``r`` would move jobs.
    """
    choice = choice.copy()
    S = P.S
    closed = np.zeros(P.Rp, dtype=bool)  # pools already repaired: no move may add to them again
    for _ in range(P.Rp + 1):
        excess = P.load(choice) - 1.0 - _EPS
        if not (excess > 0.0).any():
            return choice
        r = int(np.argmax(excess))
        room = np.where(closed, 0.0, np.maximum(-excess, 0.0))  # what other pools may still absorb
        jobs = np.flatnonzero(choice >= 0)
        jobs = jobs[P.dn3[r, choice[jobs], jobs] > 0.0]
        n = jobs.size
        cur = choice[jobs]
        _, cd = _option_table(P, choice, jobs)
        mj = take_cols(m, jobs)  # [S, n]
        m_cur = mj[cur, np.arange(n)]
        ok = take_cols(P.valid, jobs)
        for rr in range(P.Rp):  # an alternative may not overflow another pool on its own
            if rr != r:
                ok &= take_cols(P.dn3[rr], jobs) - cd[rr] <= room[rr]
        fr = cd[r] - take_cols(P.dn3[r], jobs)  # [S, n] freed on pool r
        ok &= fr > 0.0
        ratio = np.where(ok, (m_cur - mj) / np.where(ok, fr, 1.0), np.inf)
        # waiting: frees the whole demand, loses the whole margin
        ratio = np.concatenate([ratio, (m_cur / cd[r])[None, :]])
        fr = np.concatenate([fr, cd[r][None, :]])
        best = np.argmin(ratio, axis=0)
        cols = np.arange(n)
        rb, frb = ratio[best, cols], fr[best, cols]
        order = np.argsort(rb, kind="stable")
        cum = np.cumsum(frb[order])
        k = min(int(np.searchsorted(cum, excess[r], side="left")) + 1, n)
        sel = order[:k]
        choice[jobs[sel]] = np.where(best[sel] == S, -1, best[sel])
        closed[r] = True
    # last resort (a safety net; the sorted moves above normally suffice): park jobs of over-subscribed pools, least utility first
    while True:
        excess = P.load(choice) - 1.0 - _EPS
        if not (excess > 0.0).any():
            return choice
        r = int(np.argmax(excess))
        jobs = np.flatnonzero(choice >= 0)
        jobs = jobs[P.dn3[r, choice[jobs], jobs] > 0.0]
        choice[jobs[np.argmin(P.uz[choice[jobs], jobs])]] = -1


def _fill(
    P: Prepared,
    choice: np.ndarray,
    q: np.ndarray,
    jobs: np.ndarray | None = None,
    max_rounds: int = 100,
    widen: bool = True,
) -> np.ndarray:
    """Admit waiting jobs and upgrade shapes while capacity allows.

    Each round scores every job's best improving move that fits (utility gained per priced unit of
    extra demand), sorts the moves, and accepts them greedily in that order: the longest prefix whose
    cumulative demand fits is taken at once (``np.cumsum``), the first move that does not fit is
    skipped together with every move that no longer fits alone, and the scan continues. ``jobs``
    restricts the rounds to a subset; with ``widen`` the last round then looks at every job.
    """
    choice = choice.copy()
    load = P.load(choice)
    w = q + 1e-6 * (float(q.max()) if q.size and q.max() > 0 else 1.0)
    subset = jobs  # None: all jobs
    for _ in range(max_rounds):
        resid = 1.0 + _EPS - load
        js = P.ar if subset is None else subset
        idx = subset  # None: every job, read without a gather
        cu, cd = _option_table(P, choice, js)
        gain = take_cols(P.uz, idx) - cu  # [S, n]
        ok = take_cols(P.valid, idx) & (gain > 1e-12)
        # Pool by pool, tightest first (a [Rp, S, n] temporary would be tens of megabytes at 10^5
        # jobs): the tight pools rule out most moves, so the survivors are compacted as we go.
        for r in np.argsort(resid, kind="stable"):
            ok &= take_cols(P.dn3[r], idx) - cd[r] <= resid[r]
            alive = ok.any(axis=0)
            if alive.sum() < 0.5 * alive.size:
                keep = np.flatnonzero(alive)
                js, ok, gain, cd = js[keep], ok[:, keep], gain[:, keep], cd[:, keep]
                idx = js
        if not ok.any():
            if subset is None or not widen:
                break
            subset = None
            continue
        sub = np.flatnonzero(ok.any(axis=0))
        js, ok, gain, cd = js[sub], ok[:, sub], gain[:, sub], cd[:, sub]
        cost = np.full(gain.shape, 1e-15)
        for r in range(P.Rp):
            extra = take_cols(P.dn3[r], js) - cd[r]
            np.maximum(extra, 0.0, out=extra)
            extra *= w[r]
            cost += extra
        score = np.where(ok, gain / cost, -np.inf)
        n = js.size
        best = np.argmax(score, axis=0)
        sb = score[best, np.arange(n)]
        db = np.take(P.dnT, best * P.J + js, axis=1) - cd  # [Rp, n] change of demand
        dp = np.maximum(db, 0.0)
        order = np.argsort(-sb, kind="stable")
        room = np.maximum(resid, 0.0)
        take = []
        while order.size:
            cum = np.cumsum(np.take(dp, order, axis=1), axis=1)
            fits = np.all(cum <= room[:, None], axis=0)
            k = order.size if fits.all() else int(np.argmin(fits))
            if k:
                take.append(order[:k])
                room = room - cum[:, k - 1]
            rest = order[k + 1 :]
            order = rest[np.all(np.take(dp, rest, axis=1) <= room[:, None], axis=0)]
        sel = np.concatenate(take)
        choice[js[sel]] = best[sel]
        load = load + db[:, sel].sum(axis=1)
        subset = js
    return choice


def _exchange(
    P: Prepared, choice: np.ndarray, q: np.ndarray, rounds: int, deadline: float, k: int = 96, core: int = 2048
) -> np.ndarray:
    """Pair exchanges: improve one job while downgrading or parking another, when the pair fits.

    Only the ``core`` jobs that are cheapest to move in reduced-cost terms (their best alternative is
    nearly as good at the current prices) are considered: far from the margin a move can only lose.
    """
    choice = choice.copy()
    S = P.S
    m = P.margins(q)
    top = np.maximum(m.max(axis=0), 0.0)
    rc = np.concatenate([np.where(P.valid, top - m, np.inf), top[None, :]])  # [S+1, J], wait last
    cur = np.where(choice >= 0, choice, S)
    rc_cur = rc[cur, P.ar]
    rc_other = rc.copy()
    rc_other[cur, P.ar] = np.inf
    ease = rc_other.min(axis=0) - rc_cur  # cost of the cheapest switch (negative: off its best response)
    if P.J > core:
        cj = np.sort(np.argpartition(ease, core)[:core])
    else:
        cj = P.ar
    n = cj.size
    for _ in range(rounds):
        if time.perf_counter() > deadline:
            break
        resid = 1.0 + _EPS - P.load(choice)
        cu, cd = _option_table(P, choice, cj)
        gain = np.concatenate([np.where(take_cols(P.valid, cj), take_cols(P.uz, cj) - cu, -np.inf), -cu[None, :]])  # [S+1, n]
        delta = np.concatenate([take_cols(P.dn3, cj) - cd[:, None, :], -cd[:, None, :]], axis=1)  # [Rp, S+1, n]
        c = np.where(choice[cj] >= 0, choice[cj], S)
        gain[c, np.arange(n)] = -np.inf  # staying put is not a move
        rcg = gain - np.tensordot(q, delta, axes=1)  # gain in reduced-cost terms
        flat_g, flat_rc = gain.reshape(-1), rcg.reshape(-1)
        up = np.flatnonzero(flat_g > 1e-12)
        down = np.flatnonzero(np.isfinite(flat_g) & (flat_g <= 1e-12))
        if up.size == 0 or down.size == 0:
            break
        a = _top(up, flat_g[up], flat_rc[up], k)
        b = _top(down, flat_g[down], flat_rc[down], 2 * k)
        D = delta.reshape(P.Rp, -1)
        Da, Db = np.take(D, a, axis=1), np.take(D, b, axis=1)
        net = flat_g[a][:, None] + flat_g[b][None, :]  # [ka, kb]
        net[(a % n)[:, None] == (b % n)[None, :]] = -np.inf  # two moves of one job are not a pair
        cand = np.flatnonzero(net.reshape(-1) > 1e-12)
        if cand.size == 0:
            break
        cand = cand[np.argsort(-net.reshape(-1)[cand], kind="stable")]
        pick = -1
        for lo in range(0, cand.size, 4096):  # best net gain first; stop at the first pair that fits
            chunk = cand[lo : lo + 4096]
            ia, ib = np.divmod(chunk, b.size)
            fits = np.all(np.take(Da, ia, axis=1) + np.take(Db, ib, axis=1) <= resid[:, None], axis=0)
            if fits.any():
                pick = int(chunk[int(np.argmax(fits))])
                break
        if pick < 0:
            break
        pa, pb = divmod(pick, b.size)
        for opt in (a[pa], b[pb]):
            s, jj = divmod(int(opt), n)
            choice[cj[jj]] = -1 if s == S else s
        choice = _fill(P, choice, q, jobs=cj, widen=False)
    return _fill(P, choice, q)


def _top(idx: np.ndarray, gain: np.ndarray, rc: np.ndarray, k: int) -> np.ndarray:
    """Union of the k best candidates by utility gain and the k best by reduced-cost change."""
    if idx.size <= 2 * k:
        return idx
    g = np.argpartition(-gain, k)[:k]
    r = np.argpartition(-rc, k)[:k]
    return np.unique(idx[np.concatenate([g, r])])


def guard(problem: PricingProblem, P: Prepared, choice: np.ndarray) -> np.ndarray:
    """Final check in raw units: drop the least valuable jobs of any pool that rounding pushed over."""
    choice = choice.astype(np.int64).copy()
    d = np.asarray(problem.demand)
    u = np.asarray(problem.utility)
    while True:
        jobs = np.flatnonzero(choice >= 0)
        if jobs.size == 0:
            return choice
        dj = np.asarray(d[jobs, choice[jobs]], dtype=np.float64)
        over = dj.sum(axis=0) > P.cap
        if not over.any():
            return choice
        users = jobs[np.any(dj[:, over] > 0.0, axis=1)]
        choice[users[np.argmin(u[users, choice[users]])]] = -1
