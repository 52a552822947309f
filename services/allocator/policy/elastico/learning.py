"""Observed interference corrects ElastiCo's pair estimate (step 7 of the package docstring)."""

from __future__ import annotations

import numpy as np

from elastico.coloc.rates import slot_sum
from services.allocator.policy.view import TRAINING, ClusterView


def corrected_estimate(M: np.ndarray, view: ClusterView) -> tuple[np.ndarray, int]:
    """``(estimate, entries changed)``: ``M`` with each training pair seen running together slower than
    predicted lowered to what was seen.

    A job alone on one GPU next to one other training job is a clean measurement of the pair (a next to b):
    when its observed interference factor (``JobTable.observed_norm``) is below ``M[a, b]`` (or there is no
    estimate), it replaces ``M[a, b]`` for every later prediction, so a pair the predictor overrates is
    co-located once, not again and again. Only downwards: a pair that runs better than predicted was
    already placed, and raising it mostly re-shuffles placements. GPUs with more tenants or an inference
    service, and jobs on several GPUs, are not decomposed. A co-tenant its MPS share holds back slows the job
    less than the pair does (``compose_capped``): such a reading can leave the estimate too high, never too
    low. The matrix is replaced, never written in place (``M`` itself is returned when nothing changes): the
    caller's estimate, shared with other policies, stays untouched, and cached placement states keyed on it
    go stale.
    """
    obs = view.jobs.observed_norm
    if obs is None:
        return M, 0
    jobs, gj = view.jobs, view.gpu_job
    two = slot_sum((gj >= 0).view(np.int8)) == 2
    if not two.any():
        return M, 0
    pair = np.sort(gj[two], axis=1)[:, -2:]
    pair = pair[(jobs.kind[pair] == TRAINING).all(axis=1)]
    x = np.concatenate([pair[:, 0], pair[:, 1]])  # observed job
    y = np.concatenate([pair[:, 1], pair[:, 0]])  # its co-tenant
    keep = np.isfinite(obs[x])
    keep[keep] = view.held[x[keep]] == 1  # on one GPU only
    ta, tb, v = jobs.type_idx[x[keep]], jobs.type_idx[y[keep]], obs[x[keep]]
    new = ~(M[ta, tb] <= v + 1e-9)  # overrated, or no estimate (NaN)
    if not new.any():
        return M, 0
    out = M.copy()
    out[ta[new], tb[new]] = v[new]
    return out, int(new.sum())
