"""ElastiCo's preemption by value, with hysteresis (step 4 of the package docstring)."""

from __future__ import annotations

import numpy as np

from elastico.coloc.rates import share_speed, slot_sum
from services.allocator.policy.elastico.params import ElastiCoParams
from services.allocator.policy.placement import pick_gang
from services.allocator.policy.shapes import declared_share
from services.allocator.policy.view import (
    TRAINING,
    ClusterView,
    Decision,
    gpu_mask,
    occupy,
    slot_all,
    slot_max,
    vacate,
)


def full_speed_share(shares_pct: tuple[int, ...], util: float) -> float:
    """Smallest offered share at which a job of solo utilisation ``util`` runs at full speed."""
    for s in shares_pct:
        if float(share_speed(s, max(util, 1e-6))) >= 1.0 - 1e-9:
            return float(s)
    return float(max(shares_pct))


def preempt(p: ElastiCoParams, view: ClusterView, gj, gs, W, d: Decision, waiting: np.ndarray) -> bool:
    """Serve the heaviest waiting jobs by preempting much lighter running ones; True when any was served.

    A waiting job takes the ``n`` cheapest GPUs (in the topology) whose tenants all ran ``min_run_s`` since
    their last change and each weigh less than its weight / ``preempt_ratio``, when those victims together
    also do; at most ``max_preempt_jobs`` waiting jobs per pass, heaviest first.
    """
    jobs = view.jobs
    if p.max_preempt_jobs <= 0 or p.preempt_ratio <= 0:
        return False
    run = view.running[jobs.kind[view.running] == TRAINING]
    if len(run) == 0:
        return False
    gone = set(d.preempt)
    run = run[(view.now_s - jobs.last_change_s[run] >= p.min_run_s)]
    if gone:
        run = run[~np.isin(run, np.fromiter(gone, np.int64, len(gone)))]
    if len(run) == 0:
        return False
    wv = W[run]
    wq = W[waiting]
    if wq.max() <= p.preempt_ratio * wv.min():  # cheap exit: nobody outweighs anybody enough
        return False
    any_done = False
    served = 0
    # per GPU: can it be emptied (every tenant an eligible victim) and at what weight
    elig_job = np.zeros(len(jobs.kind), bool)
    elig_job[run] = True
    occ = gj >= 0
    tj = np.maximum(gj, 0)
    ten_ok = ~occ | elig_job[tj]
    wt = np.where(occ, W[tj], 0.0)
    gpu_max = np.where(slot_all(ten_ok), slot_max(wt), np.inf)  # heaviest tenant (inf: not emptiable)
    gpu_cost = slot_sum(wt)
    order_q = waiting[np.argsort(-wq, kind="stable")][: 4 * p.max_preempt_jobs]
    # waiting jobs come in decreasing weight, so a gang size that failed fails for every later job (not one that
    # failed for a job pinned to nodes: the GPUs it may use are not every job's)
    fail_n = np.inf
    for c in order_q:
        if served >= p.max_preempt_jobs:
            break
        c = int(c)
        n = int(jobs.num_gpus[c])
        pinned = gpu_mask(jobs, c)
        if n >= fail_n and pinned is None:
            continue
        ok = gpu_max * p.preempt_ratio < W[c]
        if pinned is not None:
            ok &= pinned
        if int(ok.sum()) < n:
            fail_n = n if pinned is None else fail_n
            continue
        target = pick_gang(-gpu_cost, ok, n, view.topo)  # the n cheapest of them, kept in the topology
        if target is None:
            fail_n = n if pinned is None else fail_n
            continue
        if (gpu_max[target] <= 0).all():
            continue  # enough empty GPUs already: placement's concern, not preemption's
        if gpu_cost[target].max() * p.preempt_ratio >= W[c]:
            fail_n = n if pinned is None else fail_n
            continue  # one GPU's victims alone already weigh too much
        vic = np.unique(gj[target])
        vic = vic[vic >= 0]
        # the victims' weight together must also be clearly below the waiting job's
        if W[vic].sum() * p.preempt_ratio >= W[c]:
            fail_n = n if pinned is None else fail_n
            continue
        share = declared_share(jobs, c, n, full_speed_share(p.shares_pct, float(jobs.solo_util[c])))
        if share is None:
            continue
        victims = sorted(vic.tolist(), key=lambda t: W[t])
        touched = set(target.tolist())
        for t in victims:
            d.preempt.append(t)
            touched.update(int(g) for g in jobs.gpus[t])
            vacate(gj, gs, t, jobs.gpus[t])
        occupy(gj, gs, c, target, share)
        d.place.append((c, target, share))
        rows = np.fromiter(touched, np.int64, len(touched))
        occ_r = gj[rows] >= 0
        tj_r = np.maximum(gj[rows], 0)
        wt_r = np.where(occ_r, W[tj_r], 0.0)
        gpu_max[rows] = np.where((~occ_r | elig_job[tj_r]).all(axis=1) & ~np.isin(gj[rows], [c]).any(axis=1),
                                 wt_r.max(axis=1), np.inf)
        gpu_cost[rows] = wt_r.sum(axis=1)
        served += 1
        any_done = True
    if served:
        d.info["preempted_for"] = served
    return any_done
