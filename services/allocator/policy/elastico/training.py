"""ElastiCo's training pass: the queue head priced over its shape family, then placed where it gains most
(steps 2 and 3 of the package docstring)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from elastico.coloc.rates import share_speed, slot_sum
from services.allocator.policy.elastico.cache import PolicyMemo
from services.allocator.policy.elastico.counts import (
    count_shapes_on,
    min_gpus,
    shrink_row,
)
from services.allocator.policy.elastico.params import ElastiCoParams
from services.allocator.policy.placement import pick_gang, tenant_weights, weighted_loss
from services.allocator.policy.pricing import choose_shapes
from services.allocator.policy.shapes import (
    UNLIMITED_MIN_SHARE_PCT,
    any_declared,
    count_speed,
    declared_options,
    shape_speed_table,
    shapes_of,
)
from services.allocator.policy.view import (
    INFERENCE,
    ClusterView,
    Decision,
    gpu_mask,
    occupy,
    slot_any,
)

if TYPE_CHECKING:
    from services.allocator.policy.elastico.core import ElastiCo


def waiting_training(queued: np.ndarray, d: Decision) -> np.ndarray:
    """Queued training jobs (``queued``: those that fit the cluster) left unplaced by this round so far."""
    if d.place and len(queued):
        placed = np.zeros(int(max(queued.max(), max(p[0] for p in d.place))) + 1, bool)
        placed[[p[0] for p in d.place]] = True
        return queued[~placed[queued]]
    return queued


def place_training(pol: ElastiCo, view: ClusterView, gj, gs, W, d: Decision, queued: np.ndarray) -> None:
    """Price the head of the training queue and place it, heaviest first (steps 2 and 3)."""
    p, memo = pol.params, pol.memo
    jobs = view.jobs
    pend = waiting_training(queued, d)
    if len(pend) == 0:
        return
    # nothing changed since a round that could place nobody (same tenants, same queue): skip even the
    # filters below -- most rounds of a busy cluster are such repeats
    tenants = (gj.tobytes(), gs.tobytes())
    early = (*tenants, pend.tobytes())
    if memo.idle is not None and early == memo.idle[0]:
        return  # (a reading taken meanwhile is learnt when something changes: only a placement needs it)
    if pol.learn_due:
        pol.learn_due = False
        pol.learn(view)
    unused = 100.0 - slot_sum(gs)  # [G] unallocated share, percent
    slot_open = slot_any(gj < 0)  # [G] GPUs with a free tenant slot
    gfree = np.maximum(unused, 0.0)
    # smallest share any queued job may take: the menu's, or a declared one below it
    decl = any_declared(jobs)
    dmin = declared_min_share(jobs, pend) if decl else None
    min_sh = min(p.shares_pct) if dmin is None else min(min(p.shares_pct), dmin)
    open_gpu = (gfree >= min_sh - 1e-9) & slot_open
    free_share = float(gfree[open_gpu].sum())
    free_slots = int((gj < 0).sum())
    n_open = int(open_gpu.sum())
    if n_open == 0 or free_slots == 0:
        return
    nmin = min_gpus(p, view, pend)
    keep = nmin <= n_open  # a gang larger than the GPUs with room cannot start now
    pend, nmin = pend[keep], nmin[keep]
    if len(pend) == 0:
        return
    # a job fits only if enough GPUs have a free slot and room for its smallest feasible share (shares
    # ascend, so no larger share fits either): drops, cheaply, every job that cannot start this round
    sh = np.asarray(p.shares_pct, float)
    room = np.where(slot_open, gfree, 0.0)
    n_room = (room[None, :] >= sh[:, None] - 1e-9).sum(axis=1)  # [S] GPUs with room for each share
    _, okp = shape_speed_table(jobs.solo_util[pend], p.train_floor, p.shares_pct, p.unlimited_training)
    fits_now = n_room[np.argmax(okp, axis=1)] >= nmin
    if decl:  # a declaring job: room for its smallest declared share on as many GPUs as its smallest count
        for i, j in enumerate(pend.tolist()):
            if shapes_of(jobs, j):
                smallest = min(s.compute_share_pct for s in shapes_of(jobs, j))
                fits_now[i] = int((room >= smallest - 1e-9).sum()) >= nmin[i]
    pend = pend[fits_now]
    if len(pend) == 0:
        return
    # nothing changed since a round that could place nobody: the same attempt would fail again
    sig = (*tenants, pend.tobytes())
    if memo.idle is not None and sig == memo.idle[1]:
        return
    placed_before = len(d.place)
    w = W[pend]
    top = np.argsort(-w, kind="stable")[: p.max_candidates]
    # price only the head of the queue: candidates whose minimal demand covers price_depth x the free
    # share (the rest cannot win capacity this round)
    sh_all = np.asarray(p.shares_pct, float)
    fs = sh_all[np.minimum(np.searchsorted(sh_all / 100.0 + 1e-9, jobs.solo_util[pend[top]]), len(sh_all) - 1)]
    unlimited = sh_all[sh_all >= UNLIMITED_MIN_SHARE_PCT]
    if len(unlimited) and p.unlimited_training:  # full speed on a GPU without a service from the smallest slice there
        fs = np.minimum(fs, unlimited[0])
    if decl:  # a declaring job's minimal demand: its smallest declared share
        for i, j in enumerate(pend[top].tolist()):
            if shapes_of(jobs, j):
                fs[i] = min(s.compute_share_pct for s in shapes_of(jobs, j))
    need = np.cumsum(min_gpus(p, view, pend[top]) * fs)
    top = top[: max(1, int(np.searchsorted(need, p.price_depth * free_share)) + 1)]
    cand = pend[top]
    wc = w[top]
    n, sh, speed, ok, cnt_sp = shape_family(p, memo, view, cand)  # [J, S'] over (GPU count, share)
    utility = wc[:, None] * speed
    demand = np.stack([n * sh[None, :], n], axis=2)
    cap = np.array([free_share, float(free_slots)])
    best = np.argmax(np.where(ok, utility, -1.0), axis=1)  # ties -> smallest share (shares ascending)
    if not p.pricing or (demand[np.arange(len(cand)), best].sum(axis=0) <= cap + 1e-9).all():
        # uncontested: every job's best shape fits, so all prices are 0 and the solver would agree (without
        # pricing, each job simply offers its best shape, in weight order: the greedy ablation)
        choice = best
    elif pol.prices is not None and view.now_s - pol.priced_at_s < p.reprice_interval_s:
        # posted prices still fresh: each job best-responds to them (the market's decentralised step);
        # jobs priced out keep their best shape but queue behind every job with positive surplus, so
        # stale prices never leave capacity idle
        surplus = np.where(ok, utility - demand @ pol.prices, -np.inf)
        pick = np.argmax(surplus, axis=1)
        pos = surplus[np.arange(len(cand)), pick] > 0
        choice = np.where(pos, pick, best)
        order = np.concatenate([np.flatnonzero(pos), np.flatnonzero(~pos)])
        cand, wc, n, speed, ok, choice = cand[order], wc[order], n[order], speed[order], ok[order], choice[order]
        cnt_sp = cnt_sp[order]
        d.info["pricing"] = {"status": "posted_prices", "age_s": view.now_s - pol.priced_at_s}
    else:
        choice, prices, info = choose_shapes(utility, demand, ok, cap, warm_prices=pol.prices, solver=pol.solver)
        if prices is not None and len(prices) == 2 and np.all(np.isfinite(prices)):
            pol.prices = prices
            pol.priced_at_s = view.now_s
        d.info["pricing"] = info
    # a service's slowdown is bounded by its SLO check (tenant_ok), not weighed as lost utility
    Wt = np.where(jobs.kind == INFERENCE, 0.0, W)
    attempts = 0
    failed: set = set()
    state = None  # built on the first prediction (most rounds fail the capacity precheck first)
    room = unused.copy()  # the tenants have not changed since (pricing only)
    open_ = slot_open.copy()
    col_shares = set(p.shares_pct) | set(sh.tolist())  # the menu's shares and any declared ones
    room_cnt = {float(x): int(((room >= x - 1e-9) & open_).sum()) for x in col_shares}
    # predictions are made on the GPUs with room for the smallest share only (under contention a
    # handful of 512): same decisions, a fraction of the work
    rows = np.flatnonzero((room >= float(min_sh) - 1e-9) & open_)
    topo = view.topo
    shrunk_shapes = speed.shape[1] > len(p.shares_pct)
    # the loop reads a candidate's shapes one by one, as Python lists (no numpy scalar per read); only the
    # few candidates it visits are converted, not the whole [J, S'] tables
    cand_l, type_l, choice_l, sh_l = cand.tolist(), jobs.type_idx[cand].tolist(), choice.tolist(), sh.tolist()
    # capacity only shrinks in the loop: a candidate none of whose shapes passes the precheck now never will
    fits = (n * sh[None, :] <= free_share + 1e-9) & (np.array([room_cnt[x] for x in sh_l]) >= n)
    first_fits = fits[np.arange(len(cand)), choice]
    for c in np.flatnonzero((choice >= 0) & (first_fits | (fits & ok).any(axis=1))).tolist():
        if attempts >= p.max_attempts or free_slots == 0 or free_share < min_sh:
            break
        j, t, first, n_c, ok_c = cand_l[c], type_l[c], choice_l[c], n[c].tolist(), ok[c].tolist()
        mask = gpu_mask(jobs, j)  # a job pinned to nodes: its own failures say nothing of other jobs
        declared = bool(shapes_of(jobs, j))  # its declared shares are limits wherever it runs
        tries = [first] + [s for s in np.argsort(-speed[c], kind="stable").tolist() if ok_c[s] and s != first]
        if shrunk_shapes:  # a shrunk gang only when no full-gang shape fits
            full = [x == n_c[0] for x in n_c]
            tries = [s for s in tries if full[s]] + [s for s in tries if not full[s]]
        for s in tries:
            share = sh_l[s]
            nj = int(n_c[s])
            key = (t, nj, share) if mask is None else (t, nj, share, j)
            # capacity precheck (no prediction needed): enough GPUs with a free slot and this share?
            if key in failed or nj * share > free_share + 1e-9 or room_cnt[share] < nj:
                continue
            attempts += 1
            if state is None:
                gj_rows = gj[rows]
                state = memo.tenant_state(pol.M, pol.kappa, jobs, rows, gj_rows, gs[rows], p.unlimited_training)
                tw = tenant_weights(gj_rows, Wt)
            pred = state.join(t, float(jobs.solo_util[j]), share, p.train_floor, p.slo_factor, jobs.activity_util(j),
                              declared=declared)
            feas = (pred.slot_free & (pred.share_free >= share - 1e-9) & pred.tenant_ok
                    & (pred.new_norm >= p.train_floor - 1e-9))
            if share < UNLIMITED_MIN_SHARE_PCT and not declared and p.unlimited_training:  # a limit: next to a service
                feas &= state.has_inf
            gain = wc[c] * pred.new_norm * cnt_sp[c, s] - weighted_loss(pred, tw)
            feas &= gain > 0
            # ties (e.g. many empty GPUs) go to the fullest GPU: keeps whole GPUs free for gangs
            gl = pick_gang(gain - 1e-6 * pred.share_free, feas, nj, topo, rows, allowed=mask)
            if gl is None:
                failed.add(key)
                continue
            g = rows[gl]
            occupy(gj, gs, j, g, share)
            gj_rows = gj[rows]
            memo.state_changed()  # changed below: no longer what its key says
            state.refresh(gl, gj_rows, gs[rows])
            tw[gl] = tenant_weights(gj_rows[gl], Wt)
            d.place.append((j, g, share))
            free_share -= nj * share
            free_slots -= nj
            room[g] -= share
            open_[g] = (gj[g] < 0).any(axis=1)
            room_cnt = {float(x): int(((room >= x - 1e-9) & open_).sum()) for x in col_shares}
            break
    memo.idle = (early, sig) if len(d.place) == placed_before else None


def declared_min_share(jobs, idx: np.ndarray) -> float | None:
    """Smallest share any declaring job of ``idx`` declares; None when none of them declares shapes."""
    return min((s.compute_share_pct for j in idx.tolist() for s in shapes_of(jobs, j)), default=None)


def shape_family(p: ElastiCoParams, memo: PolicyMemo, view: ClusterView, cand: np.ndarray):
    """Shapes of the candidates, flattened over (GPU count, MPS share): counts first (requested, then
    halvings), shares ascending within a count, so ties prefer the full gang and the smaller share.

    Returns:
        (gpus [J, S'], share pct [S'], speed [J, S'], feasible [J, S'], GPU-count speed [J, S']) with
        speed = share speed x GPU-count speed (:func:`shapes.count_speed`); a shrunk shape is feasible
        when its share is and its count keeps at least ``min_count_speed``.
    """
    jobs = view.jobs
    sp, okp = shape_speed_table(jobs.solo_util[cand], p.train_floor, p.shares_pct, p.unlimited_training)  # [J, S]
    req = jobs.num_gpus[cand].astype(np.int64)
    S = len(p.shares_pct)
    C = 4 if count_shapes_on(p, view) and p.shrink_gpus else 1
    if C > 1:  # one row per distinct (type, requested count), read by each candidate
        (cnt_s, valid_s, cspeed_s), at = memo.shrinks.lookup(
            jobs.type_idx[cand], req, lambda t, n: shrink_row(memo, view, t, n, p.min_count_speed))
        cnt, valid, cspeed = cnt_s[at], valid_s[at], cspeed_s[at]
    else:
        cnt, valid, cspeed = req[:, None], np.ones((len(cand), 1), bool), np.ones((len(cand), 1))
    speed = (cspeed[:, :, None] * sp[:, None, :]).reshape(len(cand), C * S)
    ok = (valid[:, :, None] & okp[:, None, :]).reshape(len(cand), C * S)
    gpus = np.repeat(cnt, S, axis=1).astype(float)
    share = np.tile(np.asarray(p.shares_pct, float), C)
    cnt_sp = np.repeat(cspeed, S, axis=1)
    out = (declared_columns(p, view, cand, gpus, share, speed, ok, cnt_sp) if any_declared(jobs)
           else (gpus, share, speed, ok, cnt_sp))
    if jobs.gang_sizes is not None:  # only the GPU counts each job allows
        sizes = [jobs.gang_sizes[j] for j in cand.tolist()]
        out[3][:] &= np.array([[c in s for c in row] for s, row in zip(sizes, out[0].astype(np.int64).tolist())], bool)
    return out


def declared_columns(p: ElastiCoParams, view: ClusterView, cand: np.ndarray, gpus, share, speed, ok, cnt_sp):
    """:func:`shape_family` with the declaring candidates' declared shapes as their only ones: a column per
    declared (GPU count, share) of any candidate (counts descending, shares ascending), feasible for the
    jobs that declare it only; a declaring job's menu columns are infeasible. A declared shape is feasible
    when its share keeps ``train_floor`` of the job's speed, or it is the job's largest declared share on
    that count (as the 100 % shape always is for the menu). Its speed is the share speed x the GPU-count
    speed of the declared count (measured curve, pessimistic; linear without one)."""
    jobs = view.jobs
    mine = {i: set(declared_options(jobs, j)) for i, j in enumerate(cand.tolist()) if shapes_of(jobs, j)}
    if not mine:
        return gpus, share, speed, ok, cnt_sp
    cols = sorted(set().union(*mine.values()), key=lambda o: (-o[0], o[1]))
    J, E = len(cand), len(cols)
    g_x = np.tile(np.array([c for c, _ in cols], float), (J, 1))
    s_x = np.array([s for _, s in cols], float)
    sp_x, ok_x, c_x = np.zeros((J, E)), np.zeros((J, E), bool), np.ones((J, E))
    scale = view.types.scale_tput
    for i, opts in mine.items():
        j = int(cand[i])
        u, req = max(float(jobs.solo_util[j]), 1e-6), int(jobs.num_gpus[j])
        top: dict[int, float] = {}  # GPU count -> its largest declared share
        for c, s in opts:
            top[c] = max(top.get(c, 0.0), s)
        for e, (c, s) in enumerate(cols):
            if (c, s) not in opts:
                continue
            if c == req:
                cs = 1.0
            elif scale is not None:
                cs = float(count_speed(scale[int(jobs.type_idx[j])], c, req))
            else:
                cs = c / max(req, 1)
            ssp = float(share_speed(s, u))
            sp_x[i, e], c_x[i, e] = ssp * cs, cs
            ok_x[i, e] = ssp + 1e-9 >= p.train_floor or s == top[c]
        ok[i, :] = False  # none of the menu's shapes for a job that declares its own
    return (np.concatenate([gpus, g_x], axis=1), np.concatenate([share, s_x]),
            np.concatenate([speed, sp_x], axis=1), np.concatenate([ok, ok_x], axis=1),
            np.concatenate([cnt_sp, c_x], axis=1))
