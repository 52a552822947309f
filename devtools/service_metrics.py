"""A live service's measurements, for ``make demo`` and the end-to-end tests: scrapes of its vLLM ``/metrics``
(:func:`scrape_metrics`), what a replay's sampler saw of it (:class:`ServiceObserved`), and
:func:`service_windows`, which turns those samples into per-``BIN_S`` windows of model time (rate, mean and p99
latency, share, capacity) and SLO attainment -- the live reading of the simulator's criterion.
"""

from __future__ import annotations

import http.client
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from devtools.loadgen import LoadStats
from simulator.traces import BIN_S

if TYPE_CHECKING:
    from devtools.replay import ServiceJob


@dataclass
class MetricsSample:
    """One scrape of a service's ``/metrics`` (vLLM names; latencies in model seconds)."""

    completed: float
    waiting: float
    latency_sum_s: float
    latency_count: float
    bucket_le: tuple[float, ...]  # upper bounds, ascending, +inf last
    bucket_cum: tuple[float, ...]  # cumulative counts per bound
    capacity_rps: float = math.nan  # the built-in serving workload's capacity now, requests per wall second


def parse_vllm_metrics(text: str, model_name: str = "") -> MetricsSample:
    """The vLLM series of a Prometheus text body, summed over series (only ``model_name``'s when given), read with
    the node agent's parser (``services.node_agent.scrape.parse_snapshot``).

    Raises:
        ValueError: the body is not Prometheus text, or holds no ``vllm:request_success_total``.
    """
    from services.node_agent.scrape import ScrapeError, parse_snapshot

    try:
        snap = parse_snapshot(text, 0.0, "vllm", model_name)
    except ScrapeError as exc:
        raise ValueError(str(exc)) from None
    if "vllm:request_success" not in snap.values:
        raise ValueError("metrics hold no vllm:request_success_total series" + (f" for {model_name}" if model_name else ""))
    b = snap.buckets.get("vllm:e2e_request_latency_seconds", ())
    return MetricsSample(snap.value("vllm:request_success"), snap.value("vllm:num_requests_waiting"),
                         snap.value("vllm:e2e_request_latency_seconds_sum"), snap.value("vllm:e2e_request_latency_seconds_count"),
                         tuple(le for le, _ in b), tuple(c for _, c in b),
                         snap.values.get("elastico_serving_capacity_rps", math.nan))


def scrape_metrics(endpoint: str, model_name: str = "", timeout_s: float = 1.0) -> MetricsSample:
    """GET ``http://<endpoint>/metrics`` and parse it (:func:`parse_vllm_metrics`); OSError/ValueError on failure."""
    from devtools.loadgen import split_endpoint

    host, port = split_endpoint(endpoint)
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        body = resp.read(4 << 20).decode()
        if resp.status != 200:
            raise ValueError(f"GET /metrics: HTTP {resp.status}")
    except http.client.HTTPException as exc:
        raise OSError(f"GET /metrics: {exc}") from exc
    finally:
        conn.close()
    return parse_vllm_metrics(body, model_name)


def histogram_quantile(q: float, le: np.ndarray, cum: np.ndarray) -> float:
    """Quantile ``q`` of a cumulative histogram (``services.node_agent.scrape.histogram_quantile``, PromQL's rule);
    NaN when it is empty."""
    from services.node_agent.scrape import histogram_quantile as quantile

    cum = np.asarray(cum, float)
    if len(cum) == 0 or not cum[-1] > 0:
        return math.nan
    return quantile(q, list(zip(np.asarray(le, float).tolist(), cum.tolist(), strict=True)))


@dataclass
class ServiceSample:
    """What the sampler saw of a service at wall time ``t`` (s since model time 0)."""

    t: float
    share_pct: float  # committed share (0 = no placement)
    up: bool  # a workload of its placement runs and has an endpoint
    endpoint: str
    metrics: MetricsSample | None  # None = not scraped (down) or the scrape failed


@dataclass
class ServiceObserved:
    """What a replay saw of one service."""

    job_id: str = ""
    submitted: float = math.nan  # wall s since model time 0 (negative: before it)
    first_up: float = math.nan
    cancelled: float = math.nan
    samples: list[ServiceSample] = field(default_factory=list)
    load: LoadStats | None = None
    scrape_errors: int = 0
    history_reports: int = 0  # demand windows before its submission reported (Replay.history_s)
    gateway_reports: int = 0  # per-minute demand windows reported while it ran (Replay.gateway_reports)
    reported_bin: int | None = None  # last model-time bin reported


def service_windows(svc: ServiceJob, so: ServiceObserved, time_scale: float, bin_s: float = BIN_S) -> dict:
    """Per-``bin_s`` windows (model time) of a service's lifetime [start, end) from its samples, and their summary.

    Counter deltas between consecutive scrapes go to the window of the interval's midpoint; a new endpoint or a
    counter that went down (a new serving process) counts from zero; the latencies a window without arrivals
    completed count with the last window that had arrivals. A window is *violated* when a sample in it
    saw no serving replica (or, if it has none, the last one before it did), when an arrival of it could not be
    delivered, when its completed requests' mean latency exceeds the SLO, or when it completed nothing while
    requests waited; else it is met. Returns arrays per window (``t_s`` window start; ``arrivals_rps``,
    ``served_rps``, ``mean_ms``, ``p99_ms``, ``share_pct`` and ``capacity`` -- the lowest seen, the latter the
    serving workload's own capacity as a fraction of ``mu_full`` --, ``ok``) and ``slo_attainment`` (met time over the
    lifetime), ``p99_ms`` and ``mean_ms`` over the lifetime, ``lifetime_s`` and ``ok_s``.
    """
    sc = time_scale
    lo, hi = svc.start_s, svc.end_s
    nb = max(1, math.ceil((hi - lo) / bin_s - 1e-9))
    edges = lo + bin_s * np.arange(nb + 1)
    width = np.minimum(edges[1:], hi) - edges[:-1]
    cnt = np.zeros(nb)
    lat = np.zeros(nb)
    served = np.zeros(nb)
    down = np.zeros(nb, bool)
    waiting = np.zeros(nb)
    share = np.full(nb, np.nan)
    capacity = np.full(nb, np.nan)  # lowest capacity seen, fraction of a full GPU's rate (the serving workload's own)
    les: tuple[float, ...] = ()
    hist = None
    samples = sorted(so.samples, key=lambda x: x.t)

    def bin_of(t_model: float) -> int:
        return int(math.floor((t_model - lo) / bin_s))

    seen = np.zeros(nb, bool)
    for x in samples:
        b = bin_of(x.t * sc)
        if 0 <= b < nb:
            seen[b] = True
            down[b] |= not x.up
            share[b] = x.share_pct if np.isnan(share[b]) else min(share[b], x.share_pct)
            if x.metrics is not None:
                waiting[b] = x.metrics.waiting
                c = x.metrics.capacity_rps / sc / svc.mu_full
                capacity[b] = c if np.isnan(capacity[b]) else min(capacity[b], c)
    last_up = None
    for b in range(nb):  # a window no sample fell in takes the state of the last sample before it
        if seen[b]:
            before = [x for x in samples if x.t * sc < edges[b + 1]]
            last_up = before[-1].up if before else last_up
        else:
            before = [x for x in samples if x.t * sc < edges[b]]
            last_up = before[-1].up if before else False
            down[b] = not last_up
            share[b] = before[-1].share_pct if before else 0.0
    prev: ServiceSample | None = None
    for x in samples:
        m = x.metrics
        if m is None:
            continue
        if hist is None:
            les = m.bucket_le
            hist = np.zeros((nb, len(les)))
        if prev is not None and prev.metrics is not None:
            pm = prev.metrics
            fresh = x.endpoint != prev.endpoint or m.completed < pm.completed or m.bucket_le != pm.bucket_le
            base = (0.0, 0.0, 0.0, np.zeros(len(m.bucket_cum))) if fresh else (
                pm.completed, pm.latency_sum_s, pm.latency_count, np.asarray(pm.bucket_cum))
            b = bin_of((prev.t + x.t) / 2 * sc)
            if 0 <= b < nb:
                served[b] += m.completed - base[0]
                lat[b] += m.latency_sum_s - base[1]
                cnt[b] += m.latency_count - base[2]
                if m.bucket_le == les:
                    hist[b] += np.asarray(m.bucket_cum) - base[3]
        prev = x
    arrivals = np.zeros(nb)
    if so.load is not None:
        for b_model, c in so.load.per_bin.items():  # the generator's bins are BIN_S bins of model time from 0
            k = bin_of(b_model * BIN_S + 0.5 * BIN_S)
            if 0 <= k < nb:
                arrivals[k] += c
        for t in so.load.undelivered_model_s:
            k = bin_of(t)
            if 0 <= k < nb:
                down[k] = True
    # completions in a window without arrivals are an earlier window's stragglers (a request completes within
    # seconds of arriving; scrape timing spills a few across the edge): judged with the last window that had arrivals
    last = -1
    for b in range(nb):
        if arrivals[b] > 0:
            last = b
        elif last >= 0 and cnt[b] > 0:
            lat[last] += lat[b]
            cnt[last] += cnt[b]
            lat[b] = cnt[b] = 0.0
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_ms = np.where(cnt > 0, lat / np.maximum(cnt, 1e-12) * 1000.0, np.nan)
    stalled = (cnt <= 0) & (arrivals > 0) & (waiting > 0)
    ok = ~down & ~stalled & ~(mean_ms > svc.slo_ms)
    p99 = np.array([histogram_quantile(0.99, les, hist[b]) * 1000.0 if hist is not None else math.nan
                    for b in range(nb)])
    total = hist.sum(axis=0) if hist is not None else np.zeros(0)
    life = float(width.sum())
    ok_s = float((width * ok).sum())
    return {"name": svc.name, "t_s": edges[:-1], "arrivals_rps": arrivals / width, "served_rps": served / width,
            "mean_ms": mean_ms, "p99_ms": p99, "share_pct": share, "capacity": capacity, "ok": ok, "lifetime_s": life, "ok_s": ok_s,
            "slo_attainment": ok_s / life if life > 0 else math.nan, "slo_ms": svc.slo_ms,
            "p99_run_ms": histogram_quantile(0.99, les, total) * 1000.0 if len(total) else math.nan,
            "mean_run_ms": float(lat.sum() / cnt.sum() * 1000.0) if cnt.sum() > 0 else math.nan,
            "requests": float(arrivals.sum()), "undelivered": 0 if so.load is None else so.load.undelivered,
            "first_up_s": so.first_up * sc if math.isfinite(so.first_up) else math.nan}
