"""Latency model of an inference service under an MPS share, used to size shares to demand within SLO.

Model (documented assumption, replaceable by a measured latency curve):

* Demand is expressed as *load* ``l = lambda / mu_full``: the request rate divided by the rate one whole,
  uncontended GPU serves. It is dimensionless (fraction of one GPU).
* A share ``s`` (fraction of a GPU) with interference factor ``nu`` (normalised throughput next to its
  co-tenants) serves ``c = s * nu`` of a full GPU's rate (inference kernels are throughput-bound, so the
  service rate scales with the SMs it may use).
* Queueing: M/M/1, mean sojourn ``W = 1 / (mu_full * (c - l))``. The SLO is a multiple of the unloaded
  full-GPU service time, ``W <= slo_factor / mu_full``, i.e. ``c - l >= 1 / slo_factor`` (the *margin*).
  Default ``slo_factor = 10`` (margin 0.1 of a GPU).

So the smallest share meeting the SLO at load ``l`` is ``(l + margin) / nu``, rounded up to the offered
shares. Static allocation (one whole GPU sized for the peak) meets the SLO whenever ``l_peak + margin <= 1``.
"""

from __future__ import annotations

import numpy as np

from services.allocator.policy.shapes import SHARES_PCT


def slo_margin(slo_factor: float) -> float:
    """Capacity above the load (fraction of a GPU) that keeps the M/M/1 mean latency within the SLO."""
    return 1.0 / slo_factor


def within_slo(capacity: np.ndarray, load: np.ndarray, slo_factor: float) -> np.ndarray:
    """True where a service with ``capacity`` (fraction of a full GPU's rate) meets its SLO at ``load``."""
    return np.asarray(capacity) - np.asarray(load) >= slo_margin(slo_factor) - 1e-12


def required_share_pct(load: np.ndarray | float, slo_factor: float, interference: np.ndarray | float = 1.0,
                       shares_pct: tuple[float, ...] = SHARES_PCT) -> np.ndarray:
    """Smallest offered MPS share (percent) meeting the SLO at ``load``; 100 if none does.

    Args:
        load: [n] demand as a fraction of one full GPU's service rate.
        slo_factor: SLO as a multiple of the unloaded full-GPU service time.
        interference: expected normalised throughput next to co-tenants (1 = alone).
        shares_pct: offered shares, ascending.

    Returns:
        [n] float share percent.
    """
    need = (np.asarray(load, float) + slo_margin(slo_factor)) / np.maximum(np.asarray(interference, float), 1e-6)
    sh = np.asarray(shares_pct, float)
    k = np.searchsorted(sh / 100.0 + 1e-9, need)  # first share >= need
    return sh[np.minimum(k, len(sh) - 1)]
