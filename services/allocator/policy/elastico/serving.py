"""ElastiCo's inference passes: services sized to their forecast first, training in their slack (steps 1
and 5 of the package docstring)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from elastico.coloc.rates import slot_sum, utilisation_rule
from services.allocator.policy.elastico.params import ElastiCoParams
from services.allocator.policy.inference import required_share_pct, slo_margin
from services.allocator.policy.placement import TenantState, pick_gang, predict_join
from services.allocator.policy.shapes import any_declared, declared_shares, shapes_of
from services.allocator.policy.view import (
    INFERENCE,
    TRAINING,
    ClusterView,
    Decision,
    gpu_mask,
    occupy,
    slot_any,
    vacate,
)

if TYPE_CHECKING:
    from services.allocator.policy.elastico.core import ElastiCo


def evict_for(view: ClusterView, gj, gs, W, g: int, need_pct: float, d: Decision) -> bool:
    """Preempt lowest-weight training tenants of GPU ``g`` until ``need_pct`` share is free."""
    jobs = view.jobs
    ten = [int(t) for t in gj[g] if t >= 0 and jobs.kind[t] == TRAINING]
    ten.sort(key=lambda t: W[t])
    for t in ten:
        if 100.0 - gs[g].sum() >= need_pct - 1e-9 and (gj[g] < 0).any():
            break
        d.preempt.append(t)
        vacate(gj, gs, t, jobs.gpus[t])
    return 100.0 - gs[g].sum() >= need_pct - 1e-9 and bool((gj[g] < 0).any())


def services_key(jobs, gj, gs, run: np.ndarray, forecasts: bytes, pend: np.ndarray) -> tuple:
    """What the inference pass reads when no service is queued (see :func:`size_services`)."""
    inf_rows = slot_any(service_slots(jobs, gj)).nonzero()[0]
    return (run.tobytes(), inf_rows.tobytes(), gj[inf_rows].tobytes(), gs[inf_rows].tobytes(), forecasts,
            pend.tobytes())


def size_services(pol: ElastiCo, view: ClusterView, gj, gs, W, d: Decision) -> None:
    """Re-size running services to their forecast and place queued ones (step 1)."""
    p, memo = pol.params, pol.memo
    jobs = view.jobs
    run = view.running[jobs.kind[view.running] == INFERENCE]
    pend = view.pending[jobs.kind[view.pending] == INFERENCE]
    # same services on the same GPUs, next to the same tenants with the same shares and forecasts, as a
    # round that changed nothing, before any deferred shrink is due: the pass would decide the same
    # (nothing) again. Such a round had no service queued, and with none queued the pass reads only the
    # services' own GPUs (tenants' weights only order evictions, which are a change), so changes on
    # other GPUs do not invalidate it.
    # (Checked on the whole cluster first, which is cheaper and usually enough.)
    forecasts = jobs.load_forecast[run].tobytes()
    whole = (gj.tobytes(), gs.tobytes(), run.tobytes(), forecasts, pend.tobytes())
    key = None
    if memo.services is not None and view.now_s < memo.services_recheck_s:
        if whole == memo.services[0]:
            return
        key = services_key(jobs, gj, gs, run, forecasts, pend)
        if key == memo.services[1]:
            return
    n_before = len(d.place) + len(d.resize) + len(d.preempt)
    recheck = np.inf
    if len(run):
        g_of = np.fromiter((jobs.gpus[j][0] for j in run.tolist()), np.int64, len(run))
        rows = np.unique(g_of)
        # interference of the current co-tenants, on the services' GPUs only (an inference slot's
        # predicted speed is 1 / (1 + sum of its co-tenants' extra time); no MPS cap on inference)
        st = TenantState(pol.M, pol.kappa, gj[rows], gs[rows], jobs, True, p.unlimited_training)
        pos = np.searchsorted(rows, g_of)
        slot_mask = gj[g_of] == run[:, None]
        has = slot_mask.any(axis=1)
        slot = np.argmax(slot_mask, axis=1)
        nu = 1.0 / (1.0 + st.extra[pos, slot])
        cur = gs[g_of, slot]
        load = jobs.load_forecast[run] * p.inference_headroom
        reqs = required_share_pct(load, p.slo_factor, nu, p.inference_shares_pct)
        alone = has & (st.extra[pos, slot] == 0)
        if p.slack and alone.any():
            slack_room = slack_share(p, pol.kappa, load[alone], jobs.solo_util[run][alone])
            reqs[alone] = np.where(np.isfinite(slack_room), np.maximum(reqs[alone], slack_room), reqs[alone])
        if any_declared(jobs):  # a declaring service: its smallest declared share meeting the SLO (and, alone,
            # leaving the slack room), else its largest
            for i, j in enumerate(run.tolist()):
                if shapes_of(jobs, j):
                    own_shares = declared_shares(jobs, j, 1)
                    if not own_shares:
                        reqs[i] = cur[i]
                        continue
                    want = required_share_pct(load[i:i + 1], p.slo_factor, nu[i:i + 1], own_shares)[0]
                    if p.slack and alone[i]:
                        want = _declared_at_least(own_shares, max(want, reqs[i]))
                    reqs[i] = want
        grow = has & (reqs > cur + 1e-9)
        shrink = has & (reqs < cur - 1e-9) & (view.now_s - jobs.last_change_s[run] >= p.shrink_after_s)
        later = has & (reqs < cur - 1e-9) & ~shrink
        if later.any():
            recheck = float((jobs.last_change_s[run][later] + p.shrink_after_s).min())
        for k in np.flatnonzero(grow | shrink):
            j, g, sl, req = int(run[k]), int(g_of[k]), int(slot[k]), float(reqs[k])
            if grow[k]:
                c = float(cur[k])
                gs[g, sl] = 0.0
                boxed_in = gs[g][service_slots(jobs, gj[g])].sum() > 100.0 - req + 1e-9  # by other services
                if boxed_in and move_service(pol, view, gj, gs, W, j, g, sl, float(load[k]), d):
                    continue
                if not evict_for(view, gj, gs, W, g, req, d):
                    req = max(c, min(req, 100.0 - float(gs[g].sum())))
                    if shapes_of(jobs, j):  # the largest declared share that fits, else the current one
                        req = max((x for x in declared_shares(jobs, j, 1) if c <= x <= req + 1e-9), default=c)
                gs[g, sl] = req
                if req != c:
                    d.resize.append((j, req))
            else:
                gs[g, sl] = req
                d.resize.append((j, req))
    for j in pend:
        j = int(j)
        place_service(pol, view, gj, gs, W, j, float(jobs.load_forecast[j] * p.inference_headroom), d)
    unchanged = len(d.place) + len(d.resize) + len(d.preempt) == n_before
    if unchanged and len(pend) == 0:
        memo.services = (whole, key or services_key(jobs, gj, gs, run, forecasts, pend))
    else:
        memo.services = None
    memo.services_recheck_s = recheck


def service_slots(jobs, gj: np.ndarray) -> np.ndarray:
    """Where ``gj`` (tenant job ids, -1 = free slot; any shape) holds a service."""
    occ = gj >= 0
    return occ & (jobs.kind[np.where(occ, gj, 0)] == INFERENCE)


def services_per_node(view: ClusterView, gj) -> np.ndarray:
    """[G] how many GPUs of each GPU's node host a service (``gj``: the planning tenants)."""
    node = view.topo.gpu_node
    held = slot_any(service_slots(view.jobs, gj))
    return np.bincount(node[held], minlength=view.topo.num_nodes)[node].astype(float)


def move_service(pol: ElastiCo, view: ClusterView, gj, gs, W, j: int, g: int, sl: int, load: float, d: Decision) -> bool:
    """Running service ``j`` (slot ``sl`` of GPU ``g``, its share there already zeroed) onto another GPU at
    ``load`` (:func:`place_service`, GPU ``g`` excluded); True when it moved (preempted and placed again: a
    make-before-break move live), else it is left where it was."""
    gj[g, sl] = -1
    d.preempt.append(j)
    if place_service(pol, view, gj, gs, W, j, load, d, avoid=g):
        return True
    d.preempt.pop()
    gj[g, sl] = j
    return False


def place_service(pol: ElastiCo, view: ClusterView, gj, gs, W, j: int, load: float, d: Decision,
                  avoid: int | None = None) -> bool:
    """Place service ``j`` (on no GPU of ``gj``) at ``load``: the smallest share meeting its SLO next to the
    predicted co-tenants, on the GPU with the least free share that keeps them within theirs; else (LS service
    first) the GPU whose training tenants weigh least, cleared for it; never GPU ``avoid``. False when no GPU
    may take it."""
    p = pol.params
    jobs = view.jobs
    if len(gj) == 0:  # no GPU in the view (e.g. every node stale): nowhere to go, and nothing to clear
        return False
    mask = gpu_mask(jobs, j)
    if avoid is not None:
        mask = np.ones(len(gj), bool) if mask is None else mask.copy()
        mask[avoid] = False
    own = shapes_of(jobs, j) != ()  # a declaring service: its declared shares (on one GPU) only
    menu = p.inference_shares_pct if not own else declared_shares(jobs, j, 1)
    if not menu:
        return False
    crowd = services_per_node(view, gj)
    # training without a service runs unlimited from its launch (limited_slots): a service never joins it
    svc = service_slots(jobs, gj)
    unlimited = slot_any((gj >= 0) & ~svc) & ~slot_any(svc) & p.unlimited_training
    for share in menu:
        if share / 100.0 - load < slo_margin(p.slo_factor) - 1e-9:
            continue
        pred = predict_join(pol.M, pol.kappa, gj, gs, jobs, view.types.inference_index, load, share,
                            True, p.train_floor, p.slo_factor, p.unlimited_training)
        cap_ok = share / 100.0 * pred.new_norm - load >= slo_margin(p.slo_factor) - 1e-9
        ok = pred.slot_free & (pred.share_free >= share - 1e-9) & pred.tenant_ok & cap_ok & ~unlimited
        # ties (e.g. empty GPUs) go to the node with the most services: services gather on their own nodes
        # and leave whole nodes to training gangs (a node holding a service is never cleared for a gang)
        picked = pick_gang(-pred.share_free + pred.new_norm + 1e-6 * crowd, ok, 1, allowed=mask)
        if picked is not None:
            if p.slack and not (gj[picked[0]] >= 0).any():  # alone: leave room for a training co-tenant
                room = float(slack_share(p, pol.kappa, np.array([load]), jobs.solo_util[[j]])[0])
                if np.isfinite(room):
                    share = _declared_at_least(menu, max(share, room)) if own else max(share, room)
            occupy(gj, gs, j, picked, float(share))
            d.place.append((j, picked, float(share)))
            return True
    req = float(required_share_pct(load, p.slo_factor, 1.0, menu))
    tw = np.where(gj >= 0, W[np.maximum(gj, 0)], 0.0).sum(axis=1)
    tw[slot_any(service_slots(jobs, gj))] = np.inf
    if mask is not None:
        tw[~mask] = np.inf
    g = int(np.argmin(tw))
    if not np.isfinite(tw[g]):
        return False
    for t in [int(t) for t in gj[g] if t >= 0]:
        d.preempt.append(t)
        vacate(gj, gs, t, jobs.gpus[t])
    occupy(gj, gs, j, np.array([g]), req)
    d.place.append((j, np.array([g]), req))
    return True


def _declared_at_least(shares, want: float) -> float:
    """The smallest of a service's declared ``shares`` (ascending) at least ``want``, else its largest."""
    return float(next((x for x in shares if x >= want - 1e-9), shares[-1]))


def slack_share(p: ElastiCoParams, kappa: float, load: np.ndarray, util: np.ndarray) -> np.ndarray:
    """[n] smallest inference share keeping the SLO at ``load`` next to one training co-tenant of at most the
    complement's utilisation (the estimate's rule for an unmeasured inference pair), where that complement is
    at least the smallest training share; NaN where there is none (the service then gets what it needs
    alone)."""
    sh = np.asarray(p.inference_shares_pct, float) / 100.0
    comp = 1.0 - sh
    nu = utilisation_rule(np.asarray(util, float)[:, None], comp[None, :], kappa)
    ok = ((sh[None, :] * nu - np.asarray(load, float)[:, None] >= slo_margin(p.slo_factor) - 1e-9)
          & (comp[None, :] * 100.0 >= min(p.shares_pct) - 1e-9))
    return np.where(ok.any(axis=1), sh[np.argmax(ok, axis=1)] * 100.0, np.nan)


def fill_slack(pol: ElastiCo, view: ClusterView, gj, gs, W, d: Decision, waiting: np.ndarray) -> None:
    """Waiting training jobs, lightest first, take the share services leave on GPUs hosting only services
    (step 5): the largest training share that fits, where the services keep their SLO and the job at least
    ``slack_floor`` of its speed (that share would idle otherwise). Lightest first: a long job that would
    wait long anyway gains most from slow progress, while a short one waits for a full-speed place."""
    p, memo = pol.params, pol.memo
    jobs = view.jobs
    occ = gj >= 0
    svc = service_slots(jobs, gj)
    free = 100.0 - slot_sum(gs)
    small = float(min(p.shares_pct))
    rows = np.flatnonzero(slot_any(svc) & ~slot_any(occ & ~svc) & slot_any(~occ) & (free >= small - 1e-9))
    if len(rows) == 0:
        return
    # the same slack next to the same services, offered to the same queue, as a pass that placed nobody
    sig = (rows.tobytes(), gj[rows].tobytes(), gs[rows].tobytes(), waiting.tobytes(),
           jobs.load_forecast[np.where(gj[rows] >= 0, gj[rows], 0)].tobytes())
    if sig == memo.slack:
        return
    placed_before = len(d.place)
    state = TenantState(pol.M, pol.kappa, gj[rows], gs[rows], jobs, True, p.unlimited_training)
    failed: set = set()
    attempts = 0
    shares = sorted(p.shares_pct, reverse=True)

    def rooms() -> dict:  # slack GPUs with room for each share
        return {sh: int((free[rows] >= sh - 1e-9).sum()) for sh in shares}

    n_room = rooms()
    for j in waiting[np.argsort(W[waiting], kind="stable")].tolist():
        if attempts >= p.max_attempts or n_room[small] == 0:
            break
        n, t, u = int(jobs.num_gpus[j]), int(jobs.type_idx[j]), float(jobs.solo_util[j])
        own = shapes_of(jobs, j) != ()  # a declaring job: its declared shares on its gang, largest first
        mask = gpu_mask(jobs, j)  # a job pinned to nodes: its own failures say nothing of other jobs
        for share in (shares if not own else sorted(declared_shares(jobs, j, n), reverse=True)):
            key = (t, n, share) if mask is None else (t, n, share, j)
            room_n = n_room[share] if not own else int((free[rows] >= share - 1e-9).sum())
            if key in failed or room_n < n or share / 100.0 < p.slack_floor * u - 1e-9:
                continue
            attempts += 1
            pred = state.join(t, u, float(share), p.train_floor, p.slo_factor, jobs.activity_util(j), declared=own)
            feas = (pred.slot_free & (pred.share_free >= share - 1e-9) & pred.tenant_ok
                    & (pred.new_norm >= p.slack_floor - 1e-9))
            gl = pick_gang(pred.new_norm, feas, n, view.topo, rows, allowed=mask)
            if gl is None:
                failed.add(key)
                continue
            g = rows[gl]
            occupy(gj, gs, j, g, float(share))
            d.place.append((j, g, float(share)))
            free[g] -= share
            n_room = rooms()
            state.refresh(gl, gj[rows], gs[rows])
            break
    memo.slack = sig if len(d.place) == placed_before else None
