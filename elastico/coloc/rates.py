"""How fast co-located tenants run: the one set of rules the policy, the simulator, the simulated GPUs and
the predictor share.

Conventions: ``p[a, b]`` is the normalised throughput (co-located / isolated, in (0, 1]) of a tenant of type
``a`` sharing one GPU with one tenant of type ``b``.

* **k tenants** (:func:`compose_additive`): each co-tenant adds the extra time it steals,
  ``norm_i = 1 / (1 + sum_j (1/p_ij - 1))``. Additive rather than multiplicative because k jobs that each
  saturate the GPU (p = 1/2) then get exactly 1/k each, as time-slicing gives them; the product would give
  (1/2)^(k-1). Bounds: ``prod_j p_ij <= norm_i <= min_j p_ij``.
* **Pairs without a measurement or estimate** (:func:`utilisation_rule`): processor sharing on solo
  utilisations -- both keep 1.0 if ``u_a + u_b <= 1``, else both run at ``1 / (u_a + u_b)`` -- times a
  contention factor ``kappa <= 1`` (memory bandwidth, caches), calibrated on measured pairs as a low
  quantile of measured / processor-sharing (:func:`calibrate_kappa`), so the rule is pessimistic for most.
* **MPS shares** (:func:`share_speed`): a job that uses a fraction ``u`` of a GPU alone keeps
  ``min(1, share / u)`` of its isolated speed under an active-thread share. A tenant its share holds below
  its co-located pace also steals less time from its co-tenants (:func:`compose_capped`).
* **Where a share is a limit** (:func:`limited_slots`): a training tenant's share is its compute limit only
  on a GPU that hosts an inference service (the limit protects the service). Training tenants of a GPU with
  no service share its compute unlimited, as the measured pairs ran (both tenants at 100 %); their shares
  are the slices they reserve (memory, the GPU's capacity account).

Pure numpy; no I/O.
"""

from __future__ import annotations

import numpy as np

from elastico.coloc.profiles import TypeTable

#: Pairwise values below this are read as this (a near-stall; keeps ``1/p`` finite).
MIN_NORM = 1e-3


def limited_slots(training: np.ndarray, inference: np.ndarray) -> np.ndarray:
    """Where a tenant's MPS share caps its speed: training slots of a GPU that also hosts an inference tenant.

    ``training`` and ``inference`` are bool ``[..., K]`` over one GPU's tenant slots (both False at empty
    slots); the result has the same shape.
    """
    return training & inference.any(axis=-1, keepdims=True)


def slot_sum(a: np.ndarray) -> np.ndarray:
    """Sums over the last axis (the K tenant slots) of a numeric ``[G, K]`` (or ``[G, K, K]``) array,
    added slot by slot.

    Bit-identical to ``a.sum(axis=-1)`` (numpy adds fewer than 8 terms in order too) at a fraction of the
    per-row overhead of a reduction over a short axis, which dominates at a few thousand slots.
    """
    K = a.shape[-1]
    if K == 0 or K >= 8:
        return a.sum(axis=-1)
    out = a[..., 0].copy()
    for k in range(1, K):
        out += a[..., k]
    return out


def compose_additive(pairwise: np.ndarray, axis: int = -1) -> np.ndarray:
    """k-way normalised throughput from pairwise values along ``axis`` (1.0 entries = no co-tenant).

    ``norm = 1 / (1 + sum (1/p - 1))``, with ``p`` clipped to ``[MIN_NORM, 1]``.
    """
    extra = 1.0 / np.minimum(np.maximum(pairwise, MIN_NORM), 1.0) - 1.0  # = clip, without its call overhead
    return 1.0 / (1.0 + (slot_sum(extra) if axis in (-1, extra.ndim - 1) else extra.sum(axis=axis)))


def compose_capped(pairwise: np.ndarray, cap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Speeds of the k tenants of GPUs whose MPS shares cap them: ``(capped, uncapped)``.

    ``pairwise`` is ``[..., k, k]`` (``[i, j]``: tenant i next to tenant j alone; the diagonal and empty slots
    must be 1), ``cap`` ``[..., k]`` (1 = no cap). A tenant its cap holds below its co-located pace ``raw``
    (additive composition of the pairs as measured) runs ``cap / raw`` of the time the pairs saw it run, so
    each co-tenant's ``1/p - 1`` from it is scaled by that activity ``min(1, cap * (1 + sum (1/p - 1)))``:
    a job at a 1 % share barely slows its neighbours. One step from the pairs, no fixed point. ``uncapped``
    is each tenant's speed after the scaling and before its own cap; ``capped`` adds the cap.
    """
    e = 1.0 / np.minimum(np.maximum(pairwise, MIN_NORM), 1.0) - 1.0
    act = np.minimum(1.0, cap * (1.0 + slot_sum(e)))
    uncapped = 1.0 / (1.0 + slot_sum(e * act[..., None, :]))
    return np.minimum(uncapped, cap), uncapped


def compose_k_way(pairwise: np.ndarray) -> np.ndarray:
    """Normalised throughput of each of k tenants of one GPU from their ``[k, k]`` pairwise values.

    ``pairwise[i, j]`` is tenant i next to tenant j alone; the diagonal is ignored; a single tenant keeps 1.0.

    Raises:
        ValueError: ``pairwise`` is not square.
    """
    p = np.array(pairwise, float)
    k = p.shape[0] if p.ndim else 0
    if p.shape != (k, k):
        raise ValueError(f"pairwise: shape {p.shape} is not square")
    np.fill_diagonal(p, 1.0)
    return compose_additive(p, axis=1)


def _shared_speed(u_a, u_b, kappa: float) -> np.ndarray:
    """kappa x processor-sharing speed of two tenants (symmetric in ``u_a``, ``u_b``)."""
    s = np.asarray(u_a, float) + np.asarray(u_b, float)
    return kappa * np.minimum(1.0, 1.0 / np.maximum(s, 1e-9))


def utilisation_rule(u_self: np.ndarray, u_other: np.ndarray, kappa: float) -> np.ndarray:
    """Conservative pairwise normalised throughput of ``self`` next to ``other`` from solo utilisations.

    Args:
        u_self, u_other: solo utilisations (fractions of a GPU), broadcastable.
        kappa: contention factor in (0, 1] applied to any actually shared GPU (both utilisations > 0).

    Returns:
        Normalised throughput in (0, 1].
    """
    return np.where(np.asarray(u_other) > 0, _shared_speed(u_self, u_other, kappa), 1.0)


def utilisation_rule_both(u_a: np.ndarray, u_b: np.ndarray, kappa: float) -> tuple[np.ndarray, np.ndarray]:
    """``(utilisation_rule(u_a, u_b, kappa), utilisation_rule(u_b, u_a, kappa))``, their common part once."""
    k = _shared_speed(u_a, u_b, kappa)
    return np.where(np.asarray(u_b) > 0, k, 1.0), np.where(np.asarray(u_a) > 0, k, 1.0)


def calibrate_kappa(measured: list[tuple[str, str, float, float]], types: TypeTable, quantile: float = 0.25) -> float:
    """Contention factor of the conservative rule: a low quantile of measured / processor-sharing.

    Args:
        measured: (type_a, type_b, norm_a, norm_b) of successfully co-located measured pairs.
        types: gives the solo utilisations.
        quantile: which quantile of the ratios to take (lower = more pessimistic).

    Returns:
        kappa in [0.05, 1]; 0.8 when nothing was measured.
    """
    u = types.solo_util
    ratios = []
    for a, b, na, nb in measured:
        try:
            ia, ib = types.index(a), types.index(b)
        except KeyError:
            continue
        ps = utilisation_rule(u[ia], u[ib], 1.0)
        ratios += [na / ps, nb / ps]
    if not ratios:
        return 0.8
    return float(np.clip(np.quantile(ratios, quantile), 0.05, 1.0))


def share_speed(share_pct: np.ndarray | float, solo_util: np.ndarray | float) -> np.ndarray:
    """Fraction of isolated speed a job keeps under an MPS share: ``min(1, share / u)``.

    Args:
        share_pct: MPS share, percent of one GPU.
        solo_util: solo utilisation, fraction of one GPU (> 0).

    Returns:
        Speed fraction in (0, 1].
    """
    s = np.asarray(share_pct, float) / 100.0
    return np.minimum(1.0, s / np.maximum(np.asarray(solo_util, float), 1e-6))
