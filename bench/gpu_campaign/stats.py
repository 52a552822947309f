"""Pure helpers of the campaign: Poisson arrivals, latency percentiles and histogram, the rate search, the share fit.

Standard library only (they run inside the bare workers and in the converter alike).
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence

#: Latency histogram bin edges, ms: 10 per decade from 0.1 ms to 10 s (the end bins also take what lies beyond).
HIST_EDGES_MS: tuple[float, ...] = tuple(round(10 ** (k / 10), 4) for k in range(-10, 41))


def poisson_arrivals(rate_per_s: float, span_s: float, seed: int) -> list[float]:
    """Arrival offsets (seconds from 0, ascending, all < ``span_s``) of a Poisson process at ``rate_per_s``."""
    if rate_per_s <= 0 or span_s <= 0:
        return []
    rng = random.Random(seed)
    out: list[float] = []
    t = rng.expovariate(rate_per_s)
    while t < span_s:
        out.append(t)
        t += rng.expovariate(rate_per_s)
    return out


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank ``q``-th percentile (0 < q <= 100) of ascending ``sorted_values``; None when empty."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return float(sorted_values[min(rank, len(sorted_values)) - 1])


def histogram(values_ms: Sequence[float]) -> dict[str, list[float] | list[int]]:
    """Counts per :data:`HIST_EDGES_MS` bin, trimmed to the occupied range: ``{"edges_ms", "counts"}``.

    ``counts[i]`` counts values in ``[edges_ms[i], edges_ms[i+1])``; the first bin also takes smaller values and
    the last larger ones.
    """
    if not values_ms:
        return {"edges_ms": [], "counts": []}
    last = len(HIST_EDGES_MS) - 2
    counts = [0] * (last + 1)
    for v in values_ms:
        counts[min(last, max(0, bisect.bisect_right(HIST_EDGES_MS, v) - 1))] += 1
    lo = next(i for i, c in enumerate(counts) if c)
    hi = max(i for i, c in enumerate(counts) if c)
    return {"edges_ms": list(HIST_EDGES_MS[lo:hi + 2]), "counts": counts[lo:hi + 1]}


def latency_summary(latencies_s: Sequence[float]) -> dict[str, float | int | None]:
    """p50/p90/p99/mean/max in ms and the count of a sample of latencies in seconds."""
    ms = sorted(x * 1e3 for x in latencies_s)
    return {"n": len(ms), "p50": _r(percentile(ms, 50)), "p90": _r(percentile(ms, 90)), "p99": _r(percentile(ms, 99)),
            "mean": _r(sum(ms) / len(ms)) if ms else None, "max": _r(ms[-1]) if ms else None}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def within_slo(p99_ms: float | None, served_frac: float, slo_ms: float) -> bool:
    """A rate is served within the SLO when its p99 latency is at most ``slo_ms`` and >= 99 % of requests are served."""
    return p99_ms is not None and p99_ms <= slo_ms and served_frac >= 0.99


def next_search_rate(ok_rate: float | None, bad_rate: float | None, base: float) -> float:
    """The next rate of the SLO search: double the best good rate until one fails, then bisect the bracket.

    ``ok_rate``: highest rate served within the SLO so far; ``bad_rate``: lowest that was not; ``base``: the first
    rate tried (the offered one). With no good rate yet the search halves downwards.
    """
    if ok_rate is None:
        return (bad_rate if bad_rate is not None else base) / 2.0
    if bad_rate is None:
        return ok_rate * 2.0
    return (ok_rate + bad_rate) / 2.0


def share_speed(share_pct: float, u: float) -> float:
    """The shape model's speed at an MPS share: ``min(1, share / u)`` (share as a fraction of one GPU)."""
    return min(1.0, share_pct / 100.0 / max(u, 1e-6))


def fit_share_curve(points: Sequence[tuple[float, float]]) -> dict[str, float | int | None]:
    """Least-squares fit of ``speed = min(1, share / u)`` to ``(share_pct, normalised speed)`` points.

    ``u`` (solo utilisation, fraction of a GPU) is searched on a 0.001 grid in [0.01, 1]. Returns ``u``, the
    root-mean-square error ``rmse``, the largest residual ``max_abs_err`` and ``n`` (points used: positive finite
    speeds); ``u`` None when no point is usable.
    """
    pts = [(float(s), float(y)) for s, y in points if s > 0 and y is not None and math.isfinite(y) and y >= 0]
    if not pts:
        return {"u": None, "rmse": None, "max_abs_err": None, "n": 0}
    best_u, best_sse = 1.0, math.inf
    for k in range(10, 1001):
        u = k / 1000.0
        sse = sum((share_speed(s, u) - y) ** 2 for s, y in pts)
        if sse < best_sse - 1e-12:
            best_u, best_sse = u, sse
    resid = [abs(share_speed(s, best_u) - y) for s, y in pts]
    return {"u": best_u, "rmse": round(math.sqrt(best_sse / len(pts)), 5), "max_abs_err": round(max(resid), 5),
            "n": len(pts)}


def parse_pinned_limit_mib(value: str | None, device: int = 0) -> int | None:
    """MiB for ``device`` in a ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` value (``"0=4096M,1=2G"``); None when unset."""
    for item in (value or "").split(","):
        dev, sep, amount = item.strip().partition("=")
        if not sep or dev.strip() != str(device):
            continue
        amount = amount.strip().upper()
        scale = {"M": 1, "G": 1024}.get(amount[-1:], None)
        return int(float(amount[:-1]) * scale) if scale else int(float(amount) / 2**20)
    return None
