"""An inference service's Prometheus metrics -> its measured demand (``DemandReport``).

The node agent scrapes the endpoint a workload declares (``InferenceWork.metrics``, or the built-in serving
workload's own) and turns two consecutive scrapes into one window of demand:

* **Pure part** -- :func:`parse_snapshot` reads Prometheus text into a :class:`Snapshot` (sample values and
  histogram buckets, summed over series, optionally only one model's series) and :func:`demand_between`
  computes the window's arrival rate, latency quantiles and queue from two snapshots. No I/O.
* **I/O part** -- :class:`Scraper`: an aiohttp GET of ``http://127.0.0.1:<port><path>`` (loopback: a process
  workload's endpoint is on its own node), with a short timeout and a body cap. A Kubernetes pod's endpoint is
  at its pod IP (from the API server's watch of the pods bound to this node): the reconciler passes that IP,
  for pod jobs only; the host must be an IP literal, never a name to resolve.

Metric names read, per ``MetricsEndpoint.format``:

* ``vllm``: ``vllm:request_success_total`` (completed), ``vllm:num_requests_waiting`` and
  ``vllm:num_requests_running`` (in the system), ``vllm:e2e_request_latency_seconds`` (histogram); model
  label ``model_name``.
* ``triton``: ``nv_inference_request_success`` (+ ``nv_inference_request_failure``: failed requests arrived
  too), ``nv_inference_pending_request_count``, ``nv_inference_request_duration_us`` (cumulative); model
  label ``model``.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from elastico.domain import DemandReport

MAX_BODY_BYTES = 1 << 20  # a metrics page larger than this is refused (vLLM's is tens of KiB)
SCRAPE_TIMEOUT_S = 2.0
MODEL_LABEL = {"vllm": "model_name", "triton": "model"}
VLLM_COMPLETED = "vllm:request_success"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_LATENCY = "vllm:e2e_request_latency_seconds"
TRITON_SUCCESS = "nv_inference_request_success"
TRITON_FAILURE = "nv_inference_request_failure"
TRITON_PENDING = "nv_inference_pending_request_count"
TRITON_DURATION_US = "nv_inference_request_duration_us"


class ScrapeError(Exception):
    """A scrape that produced no snapshot (unreachable, bad status, oversized or malformed body)."""


@dataclass(frozen=True)
class Snapshot:
    """One scrape: every sample's value summed over its series, and histogram buckets.

    ``values`` is keyed by sample name with a trailing ``_total`` removed (the text format writes counters
    with or without it); ``buckets`` maps a histogram's name to its ``(le, cumulative count)`` pairs in
    ascending ``le`` (``+Inf`` last), summed over series by ``le``.
    """

    t: float  # Unix wall time of the scrape
    values: Mapping[str, float] = field(default_factory=dict)
    buckets: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)

    def value(self, name: str) -> float:
        return self.values.get(name, 0.0)


def _strip_total(name: str) -> str:
    return name[:-6] if name.endswith("_total") else name


def parse_snapshot(text: str, t: float, fmt: str = "vllm", model: str = "") -> Snapshot:
    """Parse Prometheus text exposition into a :class:`Snapshot` taken at ``t``.

    ``model``: keep only series whose model label (``MODEL_LABEL[fmt]``) equals it; "" = every series.

    Raises:
        ScrapeError: the text is not valid Prometheus exposition.
    """
    label = MODEL_LABEL.get(fmt or "vllm", "model_name")
    values: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if model and s.labels.get(label) != model:
                    continue
                v = float(s.value)
                if math.isnan(v):
                    continue
                if s.name.endswith("_bucket") and "le" in s.labels:
                    le = float(s.labels["le"])  # "+Inf" parses as inf
                    per = buckets.setdefault(s.name[:-7], {})
                    per[le] = per.get(le, 0.0) + v
                else:
                    name = _strip_total(s.name)
                    values[name] = values.get(name, 0.0) + v
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise ScrapeError(f"malformed Prometheus text: {exc}") from None
    return Snapshot(t, values, {h: tuple(sorted(b.items())) for h, b in buckets.items()})


def _delta(prev: float, cur: float) -> float:
    """Counter increase; a counter that went down was reset (process restart): count from 0, as rate() does."""
    return cur - prev if cur >= prev else cur


def _bucket_deltas(prev: tuple[tuple[float, float], ...], cur: tuple[tuple[float, float], ...]) -> list[tuple[float, float]]:
    """Per-``le`` cumulative count increases over the window; a reset histogram counts from 0."""
    before = dict(prev)
    reset = any(c < before.get(le, 0.0) for le, c in cur)
    return [(le, c if reset else c - before.get(le, 0.0)) for le, c in cur]


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """The ``q`` quantile of cumulative ``(le, count)`` buckets, linear within a bucket (PromQL's
    ``histogram_quantile``); the highest finite bound when it falls in ``+Inf``; 0 when there are no counts."""
    if not buckets:
        return 0.0
    total = buckets[-1][1]
    if total <= 0:
        return 0.0
    rank = q * total
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower
            width = count - below
            return lower + (le - lower) * ((rank - below) / width if width > 0 else 1.0)
        lower, below = le, count
    return lower


def demand_between(prev: Snapshot, cur: Snapshot, job_id: str, fmt: str = "vllm") -> DemandReport:
    """The demand measured between two scrapes of one service.

    Arrivals in the window = completed requests + growth of the requests in the system (vLLM: waiting +
    running; Triton: pending), so ``request_rate_rps`` is the offered load even while a queue builds up.
    Latencies in ms: vLLM's p50/p99 come from the histogram's bucket increases (linear interpolation, as
    PromQL's ``histogram_quantile``); Triton exports only cumulative durations, so its p50 and p99 are both
    the window's **mean** latency (duration increase / request increase). ``queue_length`` is the requests
    waiting at ``cur``. A counter that went down (service restart) counts from 0, like Prometheus ``rate()``.

    Raises:
        ValueError: ``cur`` is not later than ``prev``.
    """
    window = cur.t - prev.t
    if not window > 0:
        raise ValueError(f"cur.t must be after prev.t (window {window!r} s)")
    if (fmt or "vllm") == "triton":
        done = (_delta(prev.value(TRITON_SUCCESS), cur.value(TRITON_SUCCESS))
                + _delta(prev.value(TRITON_FAILURE), cur.value(TRITON_FAILURE)))
        waiting = cur.value(TRITON_PENDING)
        growth = waiting - prev.value(TRITON_PENDING)
        dur_us = _delta(prev.value(TRITON_DURATION_US), cur.value(TRITON_DURATION_US))
        p50 = p99 = dur_us / done / 1000.0 if done > 0 else 0.0
    else:
        done = _delta(prev.value(VLLM_COMPLETED), cur.value(VLLM_COMPLETED))
        waiting = cur.value(VLLM_WAITING)
        growth = (waiting + cur.value(VLLM_RUNNING)) - (prev.value(VLLM_WAITING) + prev.value(VLLM_RUNNING))
        deltas = _bucket_deltas(prev.buckets.get(VLLM_LATENCY, ()), cur.buckets.get(VLLM_LATENCY, ()))
        p50 = histogram_quantile(0.5, deltas) * 1000.0
        p99 = histogram_quantile(0.99, deltas) * 1000.0
    return DemandReport(job_id=job_id, window_end_s=cur.t, window_s=window,
                        request_rate_rps=max(0.0, (done + growth) / window), p50_latency_ms=max(0.0, p50),
                        p99_latency_ms=max(0.0, p99), queue_length=max(0.0, waiting))


class Scraper:
    """GETs metrics pages (loopback, or a pod's IP) over one shared aiohttp session (created on first use)."""

    def __init__(self, timeout_s: float = SCRAPE_TIMEOUT_S, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._session: aiohttp.ClientSession | None = None

    async def fetch(self, port: int, path: str = "/metrics", host: str = "127.0.0.1") -> str:
        """The body of ``http://<host>:<port><path>``; ``host`` an IP address (a pod's; default loopback).

        Raises:
            ScrapeError: bad host, port or path, connection failure, timeout, non-200 status or a body over ``max_bytes``.
        """
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise ScrapeError(f"host must be an IP address, got {host[:64]!r}") from None
        if not 1 <= port <= 65535:
            raise ScrapeError(f"port must be 1-65535, got {port}")
        path = path or "/metrics"
        if not path.startswith("/") or any(c.isspace() or c in "?#" for c in path):
            raise ScrapeError(f"path must be an HTTP path starting with '/', got {path[:64]!r}")
        if self._session is None or self._session.closed:
            # trust_env=False: never route a scrape through a configured HTTP proxy
            self._session = aiohttp.ClientSession(trust_env=False)
        url = f"http://{f'[{ip}]' if ip.version == 6 else ip}:{port}{path}"
        try:
            async with self._session.get(url, allow_redirects=False,
                                         timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                if resp.status != 200:
                    raise ScrapeError(f"GET {url}: HTTP {resp.status}")
                if (resp.content_length or 0) > self.max_bytes:
                    raise ScrapeError(f"GET {url}: body over {self.max_bytes} bytes")
                chunks, size = [], 0
                async for chunk in resp.content.iter_chunked(65536):
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise ScrapeError(f"GET {url}: body over {self.max_bytes} bytes")
                    chunks.append(chunk)
        except ScrapeError:
            raise
        except TimeoutError:
            raise ScrapeError(f"GET {url}: no answer within {self.timeout_s:g} s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise ScrapeError(f"GET {url}: {type(exc).__name__}: {exc}") from None
        return b"".join(chunks).decode("utf-8", errors="replace")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
