"""Interference-aware placement primitives: predicted tenant speeds if a job joins each GPU, and gangs.

Every function is vectorised over all GPUs (``[G, K]`` tenant slots), so a decision for one job costs a
few numpy operations whatever the cluster size. Predictions use the *estimate* matrix the policy was
built with (never ground truth) and the additive composition of :mod:`elastico.coloc.rates` for k tenants.
A job its declared shapes cap below its type's utilisation (``JobTable.type_util``, the live view) steals
what :func:`~elastico.coloc.rates.compose_capped` says it does: a job at 1 % of a GPU leaves its compute to
others. A share the policy chose itself is assumed to steal the job's full pair: the cap's relief is the
ground truth's, never counted on (the policy can give the share back; it cannot undo a broken floor).
"""

from __future__ import annotations

import numpy as np

from elastico.coloc.rates import MIN_NORM, limited_slots, share_speed, slot_sum, utilisation_rule, utilisation_rule_both
from services.allocator.policy.inference import slo_margin
from services.allocator.policy.shapes import any_declared, shapes_of
from services.allocator.policy.view import INFERENCE, JobTable, Topology, free_share, slot_all


def pair_estimate(M: np.ndarray, kappa: float, ta, ua, tb, ub) -> np.ndarray:
    """Estimated normalised throughput of type ``ta`` (util ``ua``) next to ``tb`` (util ``ub``); NaN -> rule."""
    v = M[ta, tb]
    nan = np.isnan(v)
    if not nan.any():  # every pair estimated (e.g. training next to training): the rule is not needed
        return v
    return np.where(nan, utilisation_rule(ua, ub, kappa), v)


def pair_estimates(M: np.ndarray, kappa: float, ta, ua, tb, ub) -> tuple[np.ndarray, np.ndarray]:
    """``(pair_estimate(.., ta, ua, tb, ub), pair_estimate(.., tb, ub, ta, ua))``: both directions of a pair,
    the rule's common part computed once."""
    v_ab, v_ba = M[ta, tb], M[tb, ta]
    nan_ab, nan_ba = np.isnan(v_ab), np.isnan(v_ba)
    if nan_ab.any() or nan_ba.any():
        r_ab, r_ba = utilisation_rule_both(ua, ub, kappa)
        v_ab, v_ba = np.where(nan_ab, r_ab, v_ab), np.where(nan_ba, r_ba, v_ba)
    return v_ab, v_ba


class JoinPrediction:
    """Predicted effect of one candidate joining each GPU (all arrays over GPUs ``[G]`` or slots ``[G, K]``)."""

    __slots__ = ("new_norm", "before", "after", "tenant_ok", "slot_free", "share_free")

    def __init__(self, new_norm, before, after, tenant_ok, slot_free, share_free):
        self.new_norm = new_norm  # [G] candidate's predicted normalised throughput on each GPU
        self.before = before  # [G, K] tenants' predicted normalised throughput now (1 for empty slots)
        self.after = after  # [G, K] tenants' predicted normalised throughput with the candidate (1 empty)
        self.tenant_ok = tenant_ok  # [G] bool, every existing tenant stays above its floor
        self.slot_free = slot_free  # [G] bool, the GPU has an empty slot
        self.share_free = share_free  # [G] float, unallocated share percent


class TenantState:
    """Per-slot interference state of the current tenants, reusable across many candidates in a round.

    Computing the tenant-tenant part once (``[G, K, K]``) and refreshing only the GPUs a placement
    touched keeps a round's cost proportional to the candidates tried, not candidates x K^2 x G. Every
    candidate-independent array of :meth:`join` (tenants' speeds now, free slots and share) is kept here
    too, so a join computes only what depends on the candidate.
    """

    # the tenants' state, set (and refreshed row by row) from _rows_state: [G, K] per slot, [G] per GPU
    mask: np.ndarray  # [G, K] bool, occupied slots
    tt: np.ndarray  # [G, K] int, tenant types
    tu: np.ndarray  # [G, K] float, tenant solo utilisations (0 for empty slots)
    tut: np.ndarray  # [G, K] float, their types' (JobTable.type_util; tu where none is given)
    extra: np.ndarray  # [G, K] float, sum over co-tenants of activity x (1/p - 1): additive composition state
    cap: np.ndarray  # [G, K] float, MPS share cap of each tenant's speed (1 = none)
    # [G, K] float, where a job's declaration lowered its utilisation below its type's (JobTable.type_util; None
    # = nowhere): its share's cap against its type (what its activity is held to; 1 elsewhere, the full pair: see
    # the module docstring), and type / own utilisation (it keeps its own speed until its type's pace falls
    # below the cap)
    cap_act: np.ndarray | None
    room: np.ndarray | None
    e: np.ndarray | None  # [G, K, K] float, 1/p - 1 of each tenant next to each co-tenant (0 off the pairs); with cap_act
    extra_pairs: np.ndarray  # [G, K] float, sum over co-tenants of (1/p - 1): the pairs alone, no caps
    is_inf: np.ndarray  # [G, K] bool, inference tenants
    has_inf: np.ndarray  # [G] bool, the GPU hosts a service (its training tenants' shares are limits)
    fc: np.ndarray  # [G, K] float, inference forecast load (0 for training)
    share: np.ndarray  # [G, K] float, tenant shares, percent
    before: np.ndarray  # [G, K] float, tenants' speed now, 1 for empty slots
    before_tol: np.ndarray  # [G, K] float, before - 1e-9
    no_floor: np.ndarray  # [G, K] bool, slots no training floor applies to
    not_inf: np.ndarray  # [G, K] bool, ~is_inf
    share_frac: np.ndarray  # [G, K] float, share / 100
    slot_free: np.ndarray  # [G] bool, the GPU has an empty slot
    occupied: np.ndarray  # [G] bool, the GPU has a tenant
    share_free: np.ndarray  # [G] float, unallocated share percent

    def __init__(self, M: np.ndarray, kappa: float, gpu_job: np.ndarray, gpu_share: np.ndarray, jobs: JobTable,
                 mps_limits: bool, unlimited_training: bool = True):
        self.M, self.kappa, self.jobs, self.mps_limits = M, kappa, jobs, mps_limits
        self.unlimited_training = unlimited_training  # with mps_limits: shares limit training only next to a service
        self._offdiag = ~np.eye(gpu_job.shape[1], dtype=bool)[None]
        self._joins: dict = {}  # (type, util, floor, slo) -> share-independent part of join(), until refresh
        for name, value in self._rows_state(gpu_job, np.array(gpu_share, float)).items():
            setattr(self, name, value)  # [G, K] slot arrays and [G] GPU arrays, see _rows_state

    def refresh(self, rows: np.ndarray, gpu_job: np.ndarray, gpu_share: np.ndarray) -> None:
        """Recompute the state of GPUs ``rows`` from the (planning) tenant arrays."""
        rows = np.atleast_1d(rows)
        self._joins.clear()
        for name, value in self._rows_state(gpu_job[rows], gpu_share[rows]).items():
            if value is not None:  # (`cap_act`, `room`, `e`: None for every row of a job table without type_util)
                getattr(self, name)[rows] = value

    def _rows_state(self, gj: np.ndarray, sh: np.ndarray) -> dict:
        """State of the GPUs whose tenant slots are ``gj`` / ``sh`` (rows of the planning arrays)."""
        jobs = self.jobs
        mask = gj >= 0  # occupied slots
        tj = np.where(mask, gj, 0)
        tt = jobs.type_idx[tj]  # tenant types
        tu = np.where(mask, jobs.solo_util[tj], 0.0)  # tenant solo utilisations
        # their types' (JobTable.type_util): the pairs, and what a share caps a tenant's activity against
        tut = tu if jobs.type_util is None else np.where(mask, jobs.type_util[tj], 0.0)
        pair = pair_estimate(self.M, self.kappa, tt[:, :, None], tut[:, :, None], tt[:, None, :], tut[:, None, :])
        both = mask[:, :, None] & mask[:, None, :] & self._offdiag
        is_inf = mask & (jobs.kind[tj] == INFERENCE)  # inference tenants
        has_inf = ~slot_all(~is_inf)  # [G] the GPU hosts a service
        # MPS share cap of each tenant's speed (1 = none): training next to a service (limited_slots), and a
        # declaring job's lowered utilisation (below) wherever it runs
        low = mask & ~is_inf & (tut > tu)
        limited = (limited_slots(mask & ~is_inf, is_inf) if self.unlimited_training else mask & ~is_inf) | low
        if any_declared(jobs):  # a declaring job runs in its declared shape, its share a limit wherever it runs
            limited |= mask & ~is_inf & np.array([bool(shapes_of(jobs, int(j))) for j in tj.ravel().tolist()],
                                                 bool).reshape(tj.shape)
        cap = (np.where(limited, share_speed(sh, np.maximum(tu, 1e-6)), 1.0) if self.mps_limits
               else np.ones_like(sh))
        # sum over co-tenants of (1/p - 1), each scaled by its activity where a declared cap holds it back
        e = np.where(both, 1.0 / np.minimum(np.maximum(pair, MIN_NORM), 1.0) - 1.0, 0.0)
        extra = extra_pairs = slot_sum(e)
        cap_act = room = None
        if self.mps_limits and jobs.type_util is not None:
            cap_act = np.where(low, share_speed(sh, np.maximum(tut, 1e-6)), 1.0)
            room = np.where(low, tut / np.maximum(tu, 1e-6), 1.0)
            act = np.minimum(1.0, cap_act * (1.0 + extra))  # fraction of its co-located pace each tenant runs at
            if (act < 1.0).any():
                extra = slot_sum(e * act[:, None, :])
        fc = np.where(is_inf, jobs.load_forecast[tj], 0.0)  # inference forecast load (0 for training)
        pace = 1.0 / (1.0 + extra)
        before = np.where(mask, np.minimum(pace if room is None else pace * room, cap), 1.0)
        if not np.isfinite(fc).all():
            fc = np.nan_to_num(fc)
        return {
            "mask": mask, "tt": tt, "tu": tu, "tut": tut, "extra": extra, "cap": cap, "cap_act": cap_act,
            "room": room, "e": None if cap_act is None else e, "extra_pairs": extra_pairs,
            "is_inf": is_inf, "fc": fc, "has_inf": has_inf,
            "share": sh,  # tenant shares, percent
            "before": before,  # tenants' speed now, 1 for empty slots
            "before_tol": before - 1e-9,
            "no_floor": ~mask | is_inf,  # slots no training floor applies to
            "not_inf": ~is_inf,
            "share_frac": sh / 100.0,
            "slot_free": ~slot_all(mask),  # [G] the GPU has an empty slot
            "occupied": ~slot_all(~mask),  # [G] the GPU has a tenant
            "share_free": free_share(sh),  # [G] unallocated share percent
        }

    def join(self, cand_type: int, cand_util: float, cand_share_pct: float, train_floor: float,
             slo_factor: float, cand_type_util: float | None = None, declared: bool = False) -> JoinPrediction:
        """Predicted effect of one candidate joining each GPU (see :func:`predict_join`).

        Everything but the candidate's own share cap is the same for every share it tries, so it is kept
        until the next :meth:`refresh` (a round tries several shares of one job on the same tenants). The
        returned arrays are valid until that refresh. ``cand_type_util``: the candidate's type's utilisation
        where its declared shapes lowered ``cand_util`` (:meth:`JobTable.activity_util`; None = ``cand_util``):
        what its share caps its activity against. The candidate's share caps its speed next to a service only
        (:func:`~elastico.coloc.rates.limited_slots`), everywhere when it is ``declared`` (it runs in its
        declared shape) or its declaration lowered its utilisation.
        """
        type_util = cand_util if cand_type_util is None else cand_type_util
        key = (cand_type, type_util, train_floor, slo_factor)
        hit = self._joins.get(key)
        if hit is None:
            hit = self._joins[key] = self._join_uncapped(cand_type, type_util, train_floor, slo_factor)
        new_raw, pace, inv, one_extra, after, tenant_ok = hit
        if not self.mps_limits:
            return JoinPrediction(new_raw, self.before, after, tenant_ok, self.slot_free, self.share_free)
        cap: float | np.ndarray = float(share_speed(cand_share_pct, max(cand_util, 1e-6)))
        if type_util > cand_util:  # its declaration holds it back wherever it runs: it steals less (compose_capped)
            act = np.minimum(1.0, float(share_speed(cand_share_pct, type_util)) / pace)
            if (act[self.occupied] < 1.0).any():
                after, tenant_ok = self._tenants_after(inv, one_extra, train_floor, slo_factor, act)
        elif not declared and self.unlimited_training:  # its share is a limit next to a service only
            cap = np.where(self.has_inf, cap, 1.0)
        new = new_raw if type_util == cand_util else new_raw * (type_util / max(cand_util, 1e-6))  # see `room`
        return JoinPrediction(np.minimum(new, cap), self.before, after, tenant_ok, self.slot_free, self.share_free)

    def _join_uncapped(self, cand_type: int, type_util: float, train_floor: float, slo_factor: float):
        """The share-independent part of :meth:`join` (``type_util``: the candidate's type's utilisation): the
        candidate's speed before its cap, its pace from the pairs alone (what its activity is relative to),
        ``1/p`` of each tenant next to it, ``1 +`` each tenant's extra time from its co-tenants once the
        candidate has joined (their activities then), and the tenants' speeds and floors were the candidate
        uncapped -- :func:`compose_capped` on the joined GPU."""
        mask = self.mask
        # tenants next to the candidate (px) and the candidate next to them (pc); px is read only at
        # occupied slots (both uses of after_raw take 1 at empty ones)
        px, pc = pair_estimates(self.M, self.kappa, self.tt, self.tut, cand_type, type_util)
        ec = np.where(mask, 1.0 / np.minimum(np.maximum(pc, MIN_NORM), 1.0) - 1.0, 0.0)
        inv = 1.0 / np.minimum(np.maximum(px, MIN_NORM), 1.0)
        pace = 1.0 / (1.0 + slot_sum(ec))
        new_raw, one_extra = pace, 1.0 + self.extra_pairs
        if self.cap_act is not None:
            act = np.minimum(1.0, self.cap_act * (self.extra_pairs + inv))  # the tenants' activities next to it
            if (act[mask] < 1.0).any():
                new_raw = 1.0 / (1.0 + slot_sum(ec * act))
                one_extra = 1.0 + slot_sum(self.e * act[:, None, :])
        return (new_raw, pace, inv, one_extra, *self._tenants_after(inv, one_extra, train_floor, slo_factor))

    def _tenants_after(self, inv: np.ndarray, one_extra: np.ndarray, train_floor: float, slo_factor: float,
                       act: np.ndarray | None = None):
        """Tenants' speeds ``[G, K]`` next to a candidate (``inv``: ``1/p`` of each tenant next to it;
        ``one_extra``: 1 + their extra time from each other; ``act``: the candidate's activity per GPU, None =
        1), and ``[G]`` whether every tenant keeps its training floor or SLO margin."""
        mask = self.mask
        after_raw = 1.0 / (one_extra + inv - 1.0 if act is None else one_extra + act[:, None] * (inv - 1.0))
        after = np.where(mask, np.minimum(after_raw if self.room is None else after_raw * self.room, self.cap), 1.0)
        train_ok = self.no_floor | (after >= train_floor - 1e-9) | (after >= self.before_tol)
        inf_ok = self.not_inf | (self.share_frac * np.where(mask, after_raw, 1.0) - self.fc
                                 >= slo_margin(slo_factor) - 1e-9)
        return after, slot_all(train_ok & inf_ok)


def predict_join(M: np.ndarray, kappa: float, gpu_job: np.ndarray, gpu_share: np.ndarray, jobs: JobTable,
                 cand_type: int, cand_util: float, cand_share_pct: float, mps_limits: bool,
                 train_floor: float, slo_factor: float, unlimited_training: bool = True) -> JoinPrediction:
    """Predict, for every GPU, the candidate's and the tenants' speed if the candidate joined it.

    Args:
        M: estimate matrix ``[T, T]`` (NaN = rule).
        kappa: contention factor of the utilisation rule.
        gpu_job, gpu_share: tenant slots (planning copies).
        jobs: job table (types, utilisations, inference forecasts).
        cand_type, cand_util, cand_share_pct: the candidate.
        mps_limits: True when shares cap speed (MPS); False for unrestricted sharing.
        unlimited_training: with ``mps_limits``, a training job's share limits it only next to a service.
        train_floor: minimum normalised throughput a training tenant may be pushed to (a tenant already
            below it may stay if it does not get worse).
        slo_factor: inference SLO multiple (see :mod:`inference`).

    Returns:
        :class:`JoinPrediction`.
    """
    return TenantState(M, kappa, gpu_job, gpu_share, jobs, mps_limits, unlimited_training).join(
        cand_type, cand_util, cand_share_pct, train_floor, slo_factor)


def tenant_weights(gpu_job: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """[G, K] utility weight of each tenant slot (0 for empty slots)."""
    mask = gpu_job >= 0
    return np.where(mask, weight[np.where(mask, gpu_job, 0)], 0.0)


def weighted_loss(pred: JoinPrediction, tenant_w: np.ndarray) -> np.ndarray:
    """[G] utility the existing tenants lose if the candidate joins (sum of weight x speed drop).

    ``tenant_w`` is :func:`tenant_weights` of the tenants the prediction was made on (computed once
    for all the candidates tried on them).
    """
    return slot_sum(tenant_w * (pred.before - pred.after))


def pick_gang(score: np.ndarray, feasible: np.ndarray, n: int, topo: Topology | None = None,
              rows: np.ndarray | None = None, allowed: np.ndarray | None = None) -> np.ndarray | None:
    """Best ``n`` feasible GPUs by score (gang placement) that keep the topology rule, or None.

    Args:
        score, feasible: [X] per candidate GPU.
        n: gang size.
        topo: the cluster's nodes (None or flat: any ``n`` GPUs will do).
        rows: [X] GPU row of each candidate when they are a subset of the cluster's GPUs (default: 0..X-1).
        allowed: [G] bool over the cluster's GPU rows, the GPUs the job may use (:func:`view.gpu_mask`; None =
            any): a candidate outside it is infeasible.

    Returns:
        Sorted positions into ``score``. A gang that fits one node takes the node whose best ``n`` feasible
        GPUs score highest (ties: the lowest node, i.e. first fit); a larger gang takes whole nodes (every
        GPU feasible; highest total score first) plus the best remainder on one more node. Ties between GPUs
        break by the lowest position (stable sorts), so decisions are deterministic.
    """
    if allowed is not None:
        feasible = feasible & (allowed if rows is None else allowed[np.asarray(rows)])
    idx = np.flatnonzero(feasible)
    if len(idx) < n:
        return None
    if n <= 1 or topo is None or topo.flat:
        if len(idx) == n:
            return idx
        order = np.argsort(-score[idx], kind="stable")[:n]
        return np.sort(idx[order])
    node = topo.gpu_node[idx if rows is None else np.asarray(rows)[idx]]
    cnt = np.bincount(node, minlength=topo.num_nodes)
    sc = np.asarray(score, float)[idx]
    flat_score = sc.min() == sc.max()  # e.g. exclusive placement: every free GPU alike
    if n <= topo.max_node:
        fits = np.flatnonzero(cnt >= n)
        if len(fits) == 0:
            return None
        if flat_score:  # the first node with room, its first n GPUs
            return idx[node == fits[0]][:n]
        keep = cnt[node] >= n  # GPUs on a node with room for the gang
        idx, node, sc = idx[keep], node[keep], sc[keep]
    order = np.lexsort((-sc, node))  # by node, best score first within a node (stable: lowest position on ties)
    node_o, sc_o = node[order], sc[order]
    rank = np.arange(len(order)) - np.searchsorted(node_o, node_o, side="left")

    def best_node(k: int, exclude=()) -> int | None:
        take = rank < k
        tot = np.bincount(node_o[take], weights=sc_o[take], minlength=topo.num_nodes)
        cand = np.flatnonzero(cnt >= k)
        if len(exclude):
            cand = cand[~np.isin(cand, exclude)]
        if not len(cand):
            return None
        return int(cand[np.argmax(np.round(tot[cand], 9))])  # ties: the lowest node

    if n <= topo.max_node:
        b = best_node(n)
        return np.sort(idx[order[(node_o == b) & (rank < n)]])
    whole = np.flatnonzero(cnt == topo.node_size)
    if int(topo.node_size[whole].sum()) < n - topo.max_node:
        return None  # not enough whole nodes, whatever the remainder
    wtot = np.bincount(node_o, weights=sc_o, minlength=topo.num_nodes)[whole]
    chosen, need = [], n
    for nd in whole[np.lexsort((whole, -np.round(wtot, 9)))].tolist():
        if topo.node_size[nd] <= need:
            chosen.append(nd)
            need -= int(topo.node_size[nd])
            if need == 0:
                break
    sel = np.isin(node_o, chosen)
    if need:
        b = best_node(need, np.asarray(chosen, np.int64))
        if b is None:
            return None
        sel |= (node_o == b) & (rank < need)
    return np.sort(idx[order[sel]])


def sub_gang(gpus: np.ndarray, n: int, topo: Topology | None = None) -> np.ndarray | None:
    """The first ``n`` of a gang's GPUs (in the order given) that keep the topology rule, or None."""
    gpus = np.asarray(gpus)
    first = pick_gang(-np.arange(len(gpus), dtype=float), np.ones(len(gpus), bool), n, topo, gpus)
    return None if first is None else gpus[first]


def first_free_gpus(gpu_job: np.ndarray, n: int, topo: Topology | None = None,
                    allowed: np.ndarray | None = None) -> np.ndarray | None:
    """``n`` GPUs with no tenant (exclusive gang placement) among ``allowed`` (None = any) that keep the
    topology rule, or None: the lowest-index ones of the first node with room (:func:`pick_gang`)."""
    empty = slot_all(gpu_job < 0)
    return pick_gang(np.zeros(len(empty)), empty, n, topo, allowed=allowed)
