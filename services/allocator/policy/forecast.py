"""The one demand forecaster of inference services, used by the simulator and by the live allocator.

Forecast = the peak per-bin demand over the last ``window_s`` (default one hour, about one period of the Azure
profiles): a service is sized for the burst it just saw, so a rising demand is followed within one bin and a
falling one released only after the window has passed it (the policy also waits ``shrink_after_s`` before a
shrink). Demand is binned at ``BIN_S``; a bin's value is the mean rate of the reports ending in it, weighted by
their window lengths (the bin's rate, as the simulator's profile gives it: a short, noisy window is not a peak).
Reports from several sources (a gateway, the node agent's scrape) measure the same arrivals over windows that are
not aligned, so each source is binned on its own and a bin takes the highest source: averaging a gateway's
minute that holds a burst with a scrape that caught half of it would hide the burst the service must be sized for.

Two front ends, one rule: the simulator knows each service's per-bin demand profile and calls
:func:`rolling_peak` on it; the live allocator has measured reports (window end, request rate) and calls
:func:`forecast_rps`, which bins them and applies the same peak. Pure: numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

BIN_S = 60.0  # demand resolution, s (the simulator's profile bins)
DEFAULT_WINDOW_S = 3600.0


def window_bins(window_s: float, bin_s: float = BIN_S) -> int:
    """Bins in a forecast window (at least one)."""
    return max(1, int(round(window_s / bin_s)))


def rolling_peak(series: np.ndarray, n_bins: int) -> np.ndarray:
    """[P] causal rolling maximum: ``out[b] = max(series[max(0, b - n_bins + 1) : b + 1])``."""
    x = np.asarray(series, float)
    if len(x) == 0:
        return x.copy()
    w = max(1, int(n_bins))
    pad = np.concatenate([np.full(w - 1, -np.inf), x])
    return np.lib.stride_tricks.sliding_window_view(pad, w).max(axis=1)


def looped_forecast(profile: np.ndarray, n_bins: int) -> np.ndarray:
    """[P] :func:`rolling_peak` of a periodic per-bin demand profile, whose previous periods are its history."""
    p = np.asarray(profile, float)
    reps = -(-(max(1, n_bins) - 1) // max(1, len(p))) if len(p) else 0  # whole periods of history the window reaches
    return rolling_peak(np.concatenate([np.tile(p, reps), p]), n_bins)[len(p) * reps:] if len(p) else p.copy()


def forecast_rps(times_s: Sequence[float] | np.ndarray, rates_rps: Sequence[float] | np.ndarray, now_s: float,
                 window_s: float = DEFAULT_WINDOW_S, bin_s: float = BIN_S,
                 weights: Sequence[float] | np.ndarray | None = None,
                 sources: Sequence[str] | None = None) -> float:
    """Forecast request rate at ``now_s`` from reports (window end ``times_s``, rate ``rates_rps``, window length
    ``weights``; None = equal; ``sources`` names who measured each, None = one source), in the same clock as
    ``now_s``: each report counts for the bin its window ends in, a source's bin rate is its reports' weighted
    mean, a bin's rate the highest of its sources', and the forecast is the peak over the ``window_bins`` bins
    ending with ``now_s``'s bin (:func:`rolling_peak` at the last bin). NaN when no report falls in that span."""
    t = np.asarray(times_s, float)
    r = np.asarray(rates_rps, float)
    wt = np.ones(len(t)) if weights is None else np.maximum(np.asarray(weights, float), 1e-12)
    if len(t) == 0:
        return math.nan
    now_bin = math.floor(now_s / bin_s)
    w = window_bins(window_s, bin_s)
    b = np.floor(t / bin_s).astype(np.int64)
    keep = (b > now_bin - w) & (b <= now_bin)
    if not keep.any():
        return math.nan
    src = np.zeros(len(t), np.int64) if sources is None else np.unique(np.asarray(sources, str), return_inverse=True)[1]
    n_src = int(src.max()) + 1
    idx = (b[keep] - (now_bin - w + 1)).astype(np.int64) * n_src + src[keep]
    num = np.bincount(idx, r[keep] * wt[keep], minlength=w * n_src)
    den = np.bincount(idx, wt[keep], minlength=w * n_src)
    per_bin = np.where(den > 0, num / np.where(den > 0, den, 1.0), -np.inf).reshape(w, n_src).max(axis=1)
    return float(rolling_peak(per_bin, w)[-1])
