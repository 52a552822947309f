"""Prometheus scrape -> DemandReport: the pure parser and window arithmetic, and the reconciler's scrape loop
against a real local HTTP server whose page changes between scrapes."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from elastico.domain import GpuSlice, MetricsEndpoint, Placement, Shape
from elastico.state.memory import MemoryStore
from services.node_agent.mps import NoMps
from services.node_agent.reconcile import Reconciler
from services.node_agent.runner import LedgerEntry, free_loopback_port
from services.node_agent.scrape import (
    ScrapeError,
    Scraper,
    Snapshot,
    demand_between,
    histogram_quantile,
    parse_snapshot,
)
from services.node_agent.simulated import SimulatedBackend

BOUNDS = (0.01, 0.1, 1.0)


def vllm_text(model_counts: dict[str, tuple[float, float, float, tuple[float, ...]]]) -> str:
    """vLLM-style page: model -> (completed, waiting, running, per-bucket counts for BOUNDS and +Inf)."""
    lines = ["# HELP vllm:request_success_total done", "# TYPE vllm:request_success_total counter"]
    lines += [f'vllm:request_success_total{{model_name="{m}"}} {c[0]}' for m, c in model_counts.items()]
    lines += ["# TYPE vllm:num_requests_waiting gauge"]
    lines += [f'vllm:num_requests_waiting{{model_name="{m}"}} {c[1]}' for m, c in model_counts.items()]
    lines += ["# TYPE vllm:num_requests_running gauge"]
    lines += [f'vllm:num_requests_running{{model_name="{m}"}} {c[2]}' for m, c in model_counts.items()]
    lines += ["# TYPE vllm:e2e_request_latency_seconds histogram"]
    for m, c in model_counts.items():
        cum = 0.0
        for le, n in zip((*map(str, BOUNDS), "+Inf"), c[3], strict=True):
            cum += n
            lines.append(f'vllm:e2e_request_latency_seconds_bucket{{le="{le}",model_name="{m}"}} {cum}')
        lines.append(f'vllm:e2e_request_latency_seconds_count{{model_name="{m}"}} {cum}')
        lines.append(f'vllm:e2e_request_latency_seconds_sum{{model_name="{m}"}} 1.0')
    return "\n".join(lines) + "\n"


def triton_text(success: float, pending: float, duration_us: float, model: str = "resnet") -> str:
    return (f"# TYPE nv_inference_request_success counter\n"
            f'nv_inference_request_success{{model="{model}",version="1"}} {success}\n'
            f"# TYPE nv_inference_pending_request_count gauge\n"
            f'nv_inference_pending_request_count{{model="{model}",version="1"}} {pending}\n'
            f"# TYPE nv_inference_request_duration_us counter\n"
            f'nv_inference_request_duration_us{{model="{model}",version="1"}} {duration_us}\n')


def test_vllm_window_rate_quantiles_and_queue():
    prev = parse_snapshot(vllm_text({"a": (100, 5, 1, (50, 50, 0, 0))}), t=1000.0)
    # 200 more completions in 10 s; 100 of them in (0.01, 0.1], 98 in (0.1, 1], 2 above 1 s; queue 5+1 -> 25+1
    cur = parse_snapshot(vllm_text({"a": (300, 25, 1, (50, 150, 98, 2))}), t=1010.0)
    r = demand_between(prev, cur, "job-a")
    assert (r.job_id, r.window_end_s, r.window_s) == ("job-a", 1010.0, 10.0)
    assert r.request_rate_rps == pytest.approx((200 + 20) / 10)  # served + queue growth
    assert r.queue_length == 25
    assert r.p50_latency_ms == pytest.approx((0.01 + 0.09 * (100 / 100)) * 1000)  # rank 100 = top of (0.01, 0.1]
    assert r.p99_latency_ms == pytest.approx((0.1 + 0.9 * (198 - 100) / 98) * 1000)  # rank 198 = top of (0.1, 1]
    q = histogram_quantile(0.25, [(0.01, 0.0), (0.1, 100.0), (1.0, 198.0), (math.inf, 200.0)])
    assert q == pytest.approx(0.01 + 0.09 * 0.5)
    assert histogram_quantile(0.999, [(1.0, 1.0), (math.inf, 10.0)]) == 1.0  # +Inf bucket: highest finite bound
    assert histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) == 0.0


def test_draining_queue_gives_arrivals_not_completions_and_never_a_negative_rate():
    prev = parse_snapshot(vllm_text({"a": (0, 100, 1, (0, 0, 0, 0))}), t=0.5)
    cur = parse_snapshot(vllm_text({"a": (50, 40, 1, (0, 0, 50, 0))}), t=10.5)
    r = demand_between(prev, cur, "a")
    assert r.request_rate_rps == 0.0  # 50 served while the system shrank by 60: clamped, never negative
    cur2 = parse_snapshot(vllm_text({"a": (150, 0, 0, (0, 0, 150, 0))}), t=10.5)
    assert demand_between(prev, cur2, "a").request_rate_rps == pytest.approx((150 - 101) / 10)


def test_counter_reset_counts_the_window_from_zero():
    prev = parse_snapshot(vllm_text({"a": (5000, 0, 0, (0, 5000, 0, 0))}), t=100.0)
    cur = parse_snapshot(vllm_text({"a": (40, 0, 0, (0, 0, 40, 0))}), t=104.0)  # restarted: 40 since
    r = demand_between(prev, cur, "a")
    assert r.request_rate_rps == pytest.approx(10.0)
    assert 100 < r.p50_latency_ms <= 1000 and r.p99_latency_ms >= r.p50_latency_ms
    with pytest.raises(ValueError, match="after prev"):
        demand_between(cur, cur, "a")


def test_model_filter_and_sum_over_series():
    text = vllm_text({"a": (10, 1, 0, (10, 0, 0, 0)), "b": (20, 2, 0, (0, 0, 20, 0))})
    both, only_b = parse_snapshot(text, 1.0), parse_snapshot(text, 1.0, model="b")
    assert both.value("vllm:request_success") == 30 and only_b.value("vllm:request_success") == 20
    assert only_b.buckets["vllm:e2e_request_latency_seconds"][-1] == (math.inf, 20.0)
    assert parse_snapshot(text, 1.0, model="zzz").values == {}
    tri = parse_snapshot(triton_text(7, 1, 100) + triton_text(3, 2, 50, model="other"), 1.0, "triton", model="resnet")
    assert (tri.value("nv_inference_request_success"), tri.value("nv_inference_pending_request_count")) == (7, 1)


def test_triton_reports_the_mean_latency_as_p50_and_p99():
    prev = parse_snapshot(triton_text(100, 2, 1_000_000), 10.0, "triton")
    cur = parse_snapshot(triton_text(300, 6, 3_000_000), 20.0, "triton")  # 200 requests, 2 s total: 10 ms each
    r = demand_between(prev, cur, "t", "triton")
    assert r.request_rate_rps == pytest.approx((200 + 4) / 10) and r.queue_length == 6
    assert r.p50_latency_ms == r.p99_latency_ms == pytest.approx(10.0)
    idle = demand_between(cur, replace(cur, t=30.0), "t", "triton")
    assert (idle.request_rate_rps, idle.p50_latency_ms) == (0.0, 0.0)


def test_malformed_text_is_a_scrape_error():
    with pytest.raises(ScrapeError, match="malformed"):
        parse_snapshot("vllm:request_success_total{model_name=\"a\"} not-a-number\n", 1.0)


# --- I/O: a real HTTP server and the reconciler's scrape loop ---------------------------------------------
class Page:
    """What the canned server answers: a body (or a stall) that a test changes between scrapes."""

    def __init__(self) -> None:
        self.body = ""
        self.status = 200
        self.stall = threading.Event()  # set = hold the request until the test ends (a non-responding service)
        self.release = threading.Event()


@pytest.fixture
def page() -> Iterator[tuple[Page, int]]:
    state = Page()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            return None

        def do_GET(self) -> None:  # noqa: N802
            if state.stall.is_set():
                state.release.wait(10)
                return
            body = state.body.encode()
            self.send_response(state.status if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield state, httpd.server_address[1]
    state.release.set()
    httpd.shutdown()
    httpd.server_close()


def _entry(job_id: str, port: int, fmt: str = "vllm", model: str = "") -> LedgerEntry:
    p = Placement(job_id, 0, Shape(1, 50.0, 1024), (GpuSlice("n", 0, 50.0, 1024),), epoch=1, committed_at_s=1.0)
    return LedgerEntry(job_id=job_id, placement_id="1:1.000000", placement=p, gpu_indices=(0,), compute_share_pct=50.0,
                       mem_mib=1024, workdir="/nonexistent", status="running", kind="inference", started_at_s=0.0,
                       metrics=MetricsEndpoint(port, "/metrics", fmt, 0.1, model))


@pytest.fixture
async def reconciler(tmp_path: Path):
    r = Reconciler(MemoryStore(), SimulatedBackend("n", "v100", 1, 16384), NoMps(tmp_path / "p", tmp_path / "l"), "n",
                   tmp_path / "state", scrape_interval_s=0.1)
    yield r
    await r.aclose()


async def _scrape(r: Reconciler) -> None:
    for st in r.scrapes.states.values():
        st.due_at = 0.0  # due now, whatever the interval
    await r.scrapes.scrape_due(list(r.ledger.entries.values()))


def _demand(r: Reconciler, job_id: str):
    return next(w.demand for w in r.workloads() if w.job_id == job_id)


async def test_reconciler_scrapes_a_changing_page_and_keeps_the_last_report_on_failures(reconciler, page):
    state, port = page
    r = reconciler
    r.ledger.entries["svc"] = _entry("svc", port, model="a")
    state.body = vllm_text({"a": (100, 0, 0, (0, 100, 0, 0)), "b": (999, 9, 9, (0, 0, 0, 999))})
    await _scrape(r)
    assert _demand(r, "svc") is None  # one scrape is no window yet
    state.body = vllm_text({"a": (160, 4, 0, (0, 160, 0, 0)), "b": (5000, 9, 9, (0, 0, 0, 5000))})
    await _scrape(r)
    first = _demand(r, "svc")
    assert first is not None and first.job_id == "svc" and first.source == "node:n"
    assert first.request_rate_rps == pytest.approx(64 / first.window_s) and first.queue_length == 4
    assert 10 < first.p50_latency_ms <= 100
    assert next(w.endpoint for w in r.workloads() if w.job_id == "svc") == f"127.0.0.1:{port}"

    state.body = "vllm:request_success_total{model_name=\"a\"} garbage\n"
    with capture_logs() as logs:
        await _scrape(r)
    assert _demand(r, "svc") == first
    assert any(e["event"].startswith("metrics scrape failed") and "malformed" in e["error"] for e in logs)

    state.stall.set()  # the service accepts the connection and never answers
    r.scrapes.scraper.timeout_s = 0.3
    r.scrapes.states["svc"].logged_at = -1e9  # past the per-job log rate limit
    with capture_logs() as logs:
        await _scrape(r)
    assert _demand(r, "svc") == first
    assert any("no answer within" in e.get("error", "") for e in logs)
    with capture_logs() as logs:
        await _scrape(r)  # rate-limited: counted, not logged again
    assert not logs and r.scrapes.states["svc"].failures == 1

    state.stall.clear()
    state.body = vllm_text({"a": (260, 0, 0, (0, 260, 0, 0))})
    await _scrape(r)
    assert _demand(r, "svc").request_rate_rps == pytest.approx((100 - 4) / _demand(r, "svc").window_s)

    r.ledger.entries["svc"] = replace(r.ledger.entries["svc"], status="succeeded")
    await _scrape(r)
    assert "svc" not in r.scrapes.states and _demand(r, "svc") is None  # forgotten once it ended


async def test_closed_port_and_oversized_body_are_scrape_errors(page):
    state, port = page
    scraper = Scraper(timeout_s=1.0, max_bytes=1000)
    try:
        with pytest.raises(ScrapeError, match="ClientConnectorError|Connect"):
            await scraper.fetch(free_loopback_port(), "/metrics")
        state.body = "x" * 5000
        with pytest.raises(ScrapeError, match="over 1000 bytes"):
            await scraper.fetch(port, "/metrics")
        with pytest.raises(ScrapeError, match="HTTP 404"):
            await scraper.fetch(port, "/other")
        with pytest.raises(ScrapeError, match="path"):
            await scraper.fetch(port, "http://elsewhere/metrics")
        state.body = triton_text(1, 0, 1)
        snap = parse_snapshot(await scraper.fetch(port, "/metrics"), 1.0, "triton")
        assert isinstance(snap, Snapshot) and snap.value("nv_inference_request_success") == 1
    finally:
        await scraper.close()
