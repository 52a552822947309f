"""Interference-aware placement primitives: predicted tenant speeds if a job joins each GPU, and gangs.

Every function is vectorised over all GPUs (``[G, K]`` tenant slots), so a decision for one job costs a
few numpy operations whatever the cluster size. Predictions use the *estimate* matrix the policy was
built with (never ground truth) and :func:`interference.compose_additive` for k tenants.
"""

from __future__ import annotations

import numpy as np

from services.allocator.policy.inference import slo_margin
from services.allocator.policy.interference import compose_additive, utilisation_rule
from services.allocator.policy.shapes import share_speed
from services.allocator.policy.view import INFERENCE, JobTable


def pair_estimate(M: np.ndarray, kappa: float, ta, ua, tb, ub) -> np.ndarray:
    """Estimated normalised throughput of type ``ta`` (util ``ua``) next to ``tb`` (util ``ub``); NaN -> rule."""
    v = M[ta, tb]
    return np.where(np.isnan(v), utilisation_rule(ua, ub, kappa), v)


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


def predict_join(M: np.ndarray, kappa: float, gpu_job: np.ndarray, gpu_share: np.ndarray, jobs: JobTable,
                 cand_type: int, cand_util: float, cand_share_pct: float, mps_limits: bool,
                 train_floor: float, slo_factor: float) -> JoinPrediction:
    """Predict, for every GPU, the candidate's and the tenants' speed if the candidate joined it.

    Args:
        M: estimate matrix ``[T, T]`` (NaN = rule).
        kappa: contention factor of the utilisation rule.
        gpu_job, gpu_share: tenant slots (planning copies).
        jobs: job table (types, utilisations, inference forecasts).
        cand_type, cand_util, cand_share_pct: the candidate.
        mps_limits: True when shares cap speed (MPS); False for unrestricted sharing.
        train_floor: minimum normalised throughput a training tenant may be pushed to.
        slo_factor: inference SLO multiple (see :mod:`inference`).

    Returns:
        :class:`JoinPrediction`.
    """
    mask = gpu_job >= 0
    tj = np.where(mask, gpu_job, 0)
    tt = jobs.type_idx[tj]
    tu = np.where(mask, jobs.solo_util[tj], 0.0)
    pair = pair_estimate(M, kappa, tt[:, :, None], tu[:, :, None], tt[:, None, :], tu[:, None, :])
    both = mask[:, :, None] & mask[:, None, :]
    K = gpu_job.shape[1]
    pair = np.where(both & ~np.eye(K, dtype=bool)[None], pair, 1.0)
    before = np.where(mask, compose_additive(pair), 1.0)
    px = np.where(mask, pair_estimate(M, kappa, tt, tu, cand_type, cand_util), 1.0)
    pc = np.where(mask, pair_estimate(M, kappa, cand_type, cand_util, tt, tu), 1.0)
    pair_x = np.concatenate([pair, px[:, :, None]], axis=2)
    after = np.where(mask, compose_additive(pair_x), 1.0)
    new_norm = compose_additive(pc)
    is_inf = mask & (jobs.kind[tj] == INFERENCE)
    if mps_limits:
        cap = np.where(mask & ~is_inf, share_speed(gpu_share, np.maximum(tu, 1e-6)), 1.0)
        after_c = np.minimum(after, cap)
        before = np.minimum(before, cap)
        new_norm = np.minimum(new_norm, share_speed(cand_share_pct, max(cand_util, 1e-6)))
    else:
        after_c = after
    # floors: training tenants keep >= floor (or do not lose if already below); inference keeps its SLO
    train_ok = ~mask | is_inf | (after_c >= train_floor - 1e-9) | (after_c >= before - 1e-9)
    fc = np.where(is_inf, jobs.load_forecast[tj], 0.0)
    inf_ok = ~is_inf | (gpu_share / 100.0 * after - np.nan_to_num(fc) >= slo_margin(slo_factor) - 1e-9)
    return JoinPrediction(new_norm, before, after_c, (train_ok & inf_ok).all(axis=1),
                          ~mask.all(axis=1), 100.0 - gpu_share.sum(axis=1))


def weighted_loss(pred: JoinPrediction, gpu_job: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """[G] utility the existing tenants lose if the candidate joins (sum of weight x speed drop)."""
    mask = gpu_job >= 0
    w = np.where(mask, weight[np.where(mask, gpu_job, 0)], 0.0)
    return (w * (pred.before - pred.after)).sum(axis=1)


def pick_gang(score: np.ndarray, feasible: np.ndarray, n: int) -> np.ndarray | None:
    """Best ``n`` feasible GPUs by score (gang placement), or None when fewer than ``n`` are feasible.

    Ties break by the lowest GPU index (stable sort), so decisions are deterministic.
    """
    idx = np.flatnonzero(feasible)
    if len(idx) < n:
        return None
    if len(idx) == n:
        return idx
    order = np.argsort(-score[idx], kind="stable")[:n]
    return np.sort(idx[order])


def first_free_gpus(gpu_job: np.ndarray, n: int) -> np.ndarray | None:
    """The ``n`` lowest-index GPUs with no tenant (exclusive gang placement), or None."""
    idx = np.flatnonzero((gpu_job < 0).all(axis=1))
    return idx[:n] if len(idx) >= n else None
