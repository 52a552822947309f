"""``make demo``'s pieces that need no cluster: the inference specs, the live per-window SLO accounting from scraped
metrics (devtools.service_metrics.service_windows), the simulated side (RecordingEngine, M/M/1 windows) against the
engine's own SLO totals, and a simulator-only run of the demo writing its plots."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from devtools import demo
from devtools.loadgen import LoadStats
from devtools.replay import service_jobs
from devtools.service_metrics import (
    MetricsSample,
    ServiceObserved,
    ServiceSample,
    histogram_quantile,
    parse_vllm_metrics,
    service_windows,
)
from elastico.v1 import types_pb2 as tpb
from services.allocator.policy.forecast import looped_forecast, window_bins
from simulator.traces import BIN_S

LE = (0.5, 1.0, 2.0, 5.0, math.inf)


def _services(end_s: float = 600.0):
    return demo.build_services(demo.parse_services("code:0.4:0,conv:0.3:5"), end_s)


def test_service_specs_declare_fixed_memory_shapes_and_the_simulators_start_forecast() -> None:
    inf = _services()
    jobs = service_jobs(inf, mu_full=5.0, slo_factor=10.0, shares_pct=(10, 50, 100), mem_mib=2048)
    assert [j.name for j in jobs] == ["code", "conv"]
    for j, i in zip(jobs, range(2), strict=True):
        assert j.spec.kind == tpb.JOB_KIND_INFERENCE and j.slo_ms == pytest.approx(2000.0)
        assert [(s.compute_share_pct, s.mem_mib, s.throughput) for s in j.spec.shapes] == [
            (10.0, 2048, 0.5), (50.0, 2048, 2.5), (100.0, 2048, 5.0)]
        fc = looped_forecast(inf.demand(i), window_bins(3600.0))
        assert j.spec.inference.demand_rps == pytest.approx(fc[int(inf.phase_bin[i])] * 5.0)
        np.testing.assert_allclose(j.rates_rps, inf.demand(i) * 5.0)
    assert jobs[0].spec.inference.demand_rps == pytest.approx(0.4 * 5.0)  # the hour before t=0 holds the peak
    with pytest.raises(ValueError, match="mu_full"):
        service_jobs(inf, mu_full=0.0, slo_factor=10.0, shares_pct=(100,))
    with pytest.raises(ValueError, match="shares_pct"):
        service_jobs(inf, mu_full=5.0, slo_factor=10.0, shares_pct=(0, 100))


@pytest.mark.parametrize("text, field", [("code:0.4", "profile:peak_load"), ("nope:0.4:0", "no trace"),
                                         ("code:0.95:0", "peak load"), ("code:0.4:-1", "phase"), ("", "at least")])
def test_parse_services_names_the_option(text: str, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        demo.parse_services(text)


def test_parse_vllm_metrics_and_histogram_quantile() -> None:
    text = "\n".join([
        "# TYPE vllm:request_success_total counter",
        'vllm:request_success_total{model_name="a"} 10.0', 'vllm:request_success_total{model_name="b"} 99.0',
        "# TYPE vllm:num_requests_waiting gauge", 'vllm:num_requests_waiting{model_name="a"} 3.0',
        "# TYPE vllm:e2e_request_latency_seconds histogram",
        *[f'vllm:e2e_request_latency_seconds_bucket{{le="{le}",model_name="a"}} {c}'
          for le, c in (("0.5", 2.0), ("1.0", 6.0), ("+Inf", 10.0))],
        'vllm:e2e_request_latency_seconds_sum{model_name="a"} 9.0',
        'vllm:e2e_request_latency_seconds_count{model_name="a"} 10.0', ""])
    m = parse_vllm_metrics(text, "a")
    assert (m.completed, m.waiting, m.latency_sum_s, m.latency_count) == (10.0, 3.0, 9.0, 10.0)
    assert m.bucket_le == (0.5, 1.0, math.inf) and m.bucket_cum == (2.0, 6.0, 10.0)
    assert parse_vllm_metrics(text).completed == 109.0
    assert histogram_quantile(0.5, m.bucket_le, m.bucket_cum) == pytest.approx(0.5 + 0.5 * (5 - 2) / 4)
    assert histogram_quantile(0.1, m.bucket_le, m.bucket_cum) == pytest.approx(0.25)
    assert histogram_quantile(0.99, m.bucket_le, m.bucket_cum) == 1.0  # the +Inf bucket: largest finite bound
    assert math.isnan(histogram_quantile(0.5, m.bucket_le, (0.0, 0.0, 0.0)))
    with pytest.raises(ValueError, match="request_success_total"):
        parse_vllm_metrics("# TYPE x gauge\nx 1\n")


def _metrics(done: float, lat_sum: float, cum: tuple, waiting: float = 0.0) -> MetricsSample:
    return MetricsSample(done, waiting, lat_sum, done, LE, cum)


def _four_minute_service():
    """A service alive for four one-minute windows (mu_full 5, SLO 2 s) and its empty observation."""
    svc = service_jobs(_services(end_s=240.0), mu_full=5.0, slo_factor=10.0, shares_pct=(50, 100))[0]
    return svc, ServiceObserved(job_id="j", first_up=-0.5)


def test_service_windows_count_slow_and_missing_windows_as_violated() -> None:
    """Four one-minute windows at time scale 60 (one wall second each): fast, slow, no replica, fast after a
    restart (the counters start again from zero on the new endpoint)."""
    svc, so = _four_minute_service()
    a = "127.0.0.1:1"
    so.samples = [
        ServiceSample(0.0, 50.0, True, a, _metrics(0, 0.0, (0, 0, 0, 0, 0))),
        ServiceSample(0.9, 50.0, True, a, _metrics(100, 50.0, (100, 100, 100, 100, 100))),  # mean 0.5 s
        ServiceSample(1.9, 50.0, True, a, _metrics(200, 350.0, (100, 100, 150, 200, 200))),  # mean 3 s > SLO 2 s
        ServiceSample(2.5, 0.0, False, "", None),  # no serving replica in window 2
        ServiceSample(3.1, 50.0, True, "127.0.0.1:2", _metrics(0, 0.0, (0, 0, 0, 0, 0))),
        ServiceSample(3.9, 50.0, True, "127.0.0.1:2", _metrics(80, 8.0, (80, 80, 80, 80, 80))),
    ]
    w = service_windows(svc, so, time_scale=60.0)
    assert list(w["ok"]) == [True, False, False, True]
    np.testing.assert_allclose(w["mean_ms"][[0, 1, 3]], [500.0, 3000.0, 100.0])
    assert w["slo_attainment"] == pytest.approx(0.5) and w["lifetime_s"] == pytest.approx(240.0)
    # over the run: 180 requests <= 0.5 s, 50 in (1, 2] s, 50 in (2, 5] s -> rank 277.2 interpolated in (2, 5]
    assert w["p99_run_ms"] == pytest.approx(2000.0 + 3000.0 * 47.2 / 50)
    assert w["mean_run_ms"] == pytest.approx((50 + 300 + 8) / 280 * 1000)
    # an arrival that found no endpoint violates its window too, even with every sample up
    so.load = LoadStats(undelivered=1, undelivered_model_s=[10.0], per_bin={0: 120, 1: 60, 2: 0, 3: 50})
    w2 = service_windows(svc, so, time_scale=60.0)
    assert list(w2["ok"]) == [False, False, False, True]
    np.testing.assert_allclose(w2["arrivals_rps"], [2.0, 1.0, 0.0, 50 / 60])


def test_a_window_without_arrivals_has_its_stragglers_judged_with_the_last_window_that_had_arrivals() -> None:
    """Window 1 has no arrivals; the one slow request it completed arrived in window 0 (its latency counts
    there); window 3's slow requests are its own and violate it."""
    svc, so = _four_minute_service()
    a = "127.0.0.1:1"
    so.samples = [
        ServiceSample(0.0, 50.0, True, a, _metrics(0, 0.0, (0, 0, 0, 0, 0))),
        ServiceSample(0.9, 50.0, True, a, _metrics(99, 29.7, (99, 99, 99, 99, 99))),  # 99 at 0.3 s
        ServiceSample(1.1, 50.0, True, a, _metrics(100, 32.7, (99, 99, 99, 100, 100))),  # one at 3 s, window 1
        ServiceSample(2.5, 50.0, True, a, _metrics(100, 32.7, (99, 99, 99, 100, 100))),
        ServiceSample(3.5, 50.0, True, a, _metrics(110, 62.7, (99, 99, 99, 110, 110))),  # ten at 3 s, window 3
    ]
    so.load = LoadStats(per_bin={0: 99, 1: 0, 2: 0, 3: 10})
    w = service_windows(svc, so, time_scale=60.0)
    assert list(w["ok"]) == [True, True, True, False]
    np.testing.assert_allclose(w["mean_ms"][[0, 3]], [(29.7 + 3.0) / 100 * 1000, 3000.0])
    assert np.isnan(w["mean_ms"][1]) and w["served_rps"][1] == pytest.approx(1 / 60)  # still counted as served
    assert w["mean_run_ms"] == pytest.approx(62.7 / 110 * 1000)


def test_mm1_quantile() -> None:
    assert demo.mm1_quantile(0.99, np.array([1.0]), np.array([2.0])) == pytest.approx(math.log(100) / 2, rel=1e-6)
    q = demo.mm1_quantile(0.5, np.array([1.0, 1.0]), np.array([1.0, 1e9]))  # half the requests take no time
    assert q == pytest.approx(0.0, abs=1e-6)
    assert demo.mm1_quantile(0.99, np.array([0.9, 0.1]), np.array([1.0, 0.0])) == math.inf
    assert math.isnan(demo.mm1_quantile(0.99, np.array([0.0]), np.array([1.0])))


@pytest.fixture(scope="module")
def sim_runs():
    from services.allocator.settings import AllocatorSettings
    from simulator.engine import SimConfig
    from simulator.run import build_workload

    w = build_workload(demo.TRACE, 8, window=demo.DEFAULT_WINDOW, max_jobs=demo.DEFAULT_JOBS, estimator="rule")
    w.inf = demo.build_services(demo.parse_services(demo.DEFAULT_SERVICES), float(w.train.arrival_s.max()))
    cfg = SimConfig(gpus=8, node_gpus=4, round_interval_s=300.0)
    return w, demo.run_sim(w, ["elastico", "exclusive-fifo"], cfg, AllocatorSettings().policy_options(), demo.MU_FULL)


def test_simulated_windows_agree_with_the_engines_slo_accounting(sim_runs) -> None:
    w, runs = sim_runs
    for r, summary, svc in runs:
        assert len(svc) == 3
        ok = sum(s["ok_s"] for s in svc)
        total = sum(s["lifetime_s"] for s in svc)
        assert total == pytest.approx(r.slo_total_s) and ok == pytest.approx(r.slo_ok_s)
        assert summary["slo_attainment"] == pytest.approx(ok / total)
        for s in svc:
            assert len(s["t_s"]) == math.ceil(w.train.arrival_s.max() / BIN_S)
            assert (s["share_pct"] > 0).all() and s["p99_run_ms"] > s["mean_run_ms"] > 0
    fifo = runs[1][2]
    assert all((s["share_pct"] == 100.0).all() for s in fifo)  # exclusive: a whole GPU each
    ela = runs[0][2]
    assert all(s["share_pct"].max() < 100.0 for s in ela)  # ElastiCo sizes them to their demand


def test_demo_sim_only_prints_the_comparison_and_writes_the_plots(tmp_path, capsys) -> None:
    assert demo.main(["--sim-only", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "elastico (sim)" in out and "exclusive-fifo (sim)" in out and "== targets" in out
    assert "0:code peak 0.3" in out and f"plots and numbers in {tmp_path}" in out
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["service_0_code.png", "service_1_conv.png", "service_2_code.png", "summary.json",
                     "util_over_time.png"]
    assert all((tmp_path / n).stat().st_size > 10_000 for n in names if n.endswith(".png"))
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert doc["live"] is None and [s["policy"] for s in doc["sim"]] == ["elastico (sim)", "exclusive-fifo (sim)"]
    assert len(doc["services"]) == 3 and len(doc["services"][0]["sim"]["elastico"]["ok"]) == 62
    assert {t["met"] for t in doc["targets"]} <= {True, False} and len(doc["targets"]) == 5


def test_a_stepped_service_follows_its_hour_then_the_hour_times_the_step() -> None:
    [d] = demo.parse_services("conv:0.4:30:1.5")
    assert (d.key, d.step) == ("convx1.5", 1.5)
    inf = demo.build_services([d], 7200.0)
    p = inf.profiles[0]
    half = len(p) // 2
    np.testing.assert_allclose(p[half:], 1.5 * p[:half])  # the second hour is the first x 1.5
    assert p.max() == pytest.approx(1.0) and inf.peak_load[0] == 0.4  # the peak load is the stepped hour's
    for bad in ("conv:0.4:30:0.5", "conv:0.4:30:x"):
        with pytest.raises(ValueError, match="--services"):
            demo.parse_services(bad)


def test_a_job_seen_on_two_agents_read_one_after_another_is_a_double_run_only_if_the_first_still_runs_it():
    """The sampler reads the agents in turn: a job stopped on the first and started on the second between the two
    reads is seen on both; a second read of the first tells a move from a double run."""
    from types import SimpleNamespace

    from devtools.replay import Replay

    def agent(*running):
        return SimpleNamespace(workloads=lambda: [SimpleNamespace(job_id=j, placement_id=p, status="running")
                                                  for j, p in running])

    replay = Replay("127.0.0.1:1", ["n1", "n2"], [], 1.0, "run")
    seen = {"n1": "3:1.0", "n2": "3:2.0"}
    assert replay._overlap([agent(("j", "3:1.0")), agent()], "j", seen)  # still running its old placement on n1
    assert not replay._overlap([agent(), agent()], "j", seen)  # stopped on n1 meanwhile: a move, not a double run
    assert not replay._overlap([agent(("j", "3:9.0")), agent()], "j", seen)  # another placement (not the one seen)


def test_live_trace_jobs_declare_only_their_requested_gpu_count() -> None:
    """The demo's simulated side runs without GPU-count shapes because the live jobs cannot change count: each
    declares shapes at its requested count only. Declaring more counts would need the simulated side changed too."""
    from devtools.replay import trace_jobs
    from simulator.run import build_workload

    w = build_workload(demo.TRACE, 8, window=demo.DEFAULT_WINDOW, max_jobs=demo.DEFAULT_JOBS, estimator="rule")
    jobs = trace_jobs(w, train_floor=0.7, min_speed=demo._slack_floor())
    assert len(jobs) == demo.DEFAULT_JOBS
    for j in jobs:
        assert {s.num_gpus for s in j.spec.shapes} == {j.num_gpus}


@pytest.mark.parametrize("args, message", [
    (["--nodes", "0"], "argument --nodes: must be a finite number in [1, inf), got 0"),
    (["--gpus-per-node", "0"], "argument --gpus-per-node: must be a finite number in [1, inf), got 0"),
    (["--jobs", "0"], "argument --jobs: must be a finite number in [1, inf), got 0"),
    (["--time-scale", "0"], "argument --time-scale: must be a finite number in (0.0, inf), got 0"),
    (["--trace", "/no/such/trace.csv"], "/no/such/trace.csv"),
    (["--window", "0", "1"], "all arrive at once"),  # one burst of arrivals: no loaded period to divide by
])
def test_bad_arguments_are_usage_errors_naming_what_is_wrong(tmp_path, capsys, args, message) -> None:
    with pytest.raises(SystemExit) as ex:
        demo.main(["--sim-only", "--out", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert ex.value.code == 2 and message in err, err


def test_work_done_keeps_what_a_relaunched_or_just_finished_job_did() -> None:
    """The live work snapshot counts a completed job whole and any other at the most progress it has shown: a job
    read while relaunched (its new workload starting lower) or between its workload's exit and its completion
    event keeps the work it did, as the simulator's progress does."""
    from types import SimpleNamespace

    from devtools.replay import work_done_gpu_s

    jobs = {i: SimpleNamespace(num_gpus=n, duration_s=1000.0, rate=2.0) for i, n in ((0, 1), (1, 2), (2, 1), (3, 4))}
    # job 0 completed; job 1 half done (1,000 steps of 2,000); job 2 beyond its duration (capped); job 3 never ran
    assert work_done_gpu_s(jobs, {1: 1000.0, 2: 5000.0}, {0}) == pytest.approx(1000.0 + 2 * 500.0 + 1000.0)
    # completed and also seen running: counted once, whole
    assert work_done_gpu_s(jobs, {0: 10.0}, {0}) == pytest.approx(1000.0)
    assert work_done_gpu_s(jobs, {}, set()) == 0.0
