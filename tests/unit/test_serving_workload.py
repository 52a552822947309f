"""The built-in serving workload as a real process (stdlib only: run with ``python -S``, no site-packages), over real HTTP."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.node_agent.runner import free_loopback_port
from services.node_agent.scrape import demand_between, parse_snapshot
from services.node_agent.serving import MAX_ARRIVALS_PER_CALL, ServiceModel

REPO = Path(__file__).resolve().parents[2]


class Serving:
    """One ``python -m services.node_agent.serving`` process and its files."""

    def __init__(self, tmp: Path, time_scale: float, rate: float | None) -> None:
        self.port = free_loopback_port()
        self.rate_file, self.progress_file = tmp / "rate", tmp / "progress"
        if rate is not None:
            self.set_rate(rate)
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO), "ELASTICO_SERVE_PORT": str(self.port),
               "ELASTICO_SIM_RATE_FILE": str(self.rate_file), "ELASTICO_PROGRESS_FILE": str(self.progress_file),
               "ELASTICO_TIME_SCALE": repr(time_scale), "ELASTICO_JOB_ID": "svc-1"}
        self.proc = subprocess.Popen([sys.executable, "-S", "-m", "services.node_agent.serving"], env=env, cwd=tmp,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 15
        while True:
            try:
                if self.get("/healthz")[0] == 200:
                    break
            except OSError:
                pass
            assert self.proc.poll() is None, self.proc.stdout.read() if self.proc.stdout else ""
            assert time.monotonic() < deadline, "serving workload never became healthy"
            time.sleep(0.05)

    def set_rate(self, rate: float) -> None:
        tmp = self.rate_file.with_name("rate.tmp")
        tmp.write_text(f"{rate!r}\n")
        os.replace(tmp, self.rate_file)
        time.sleep(0.3)  # the workload re-reads it every 0.1 s

    def get(self, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
            return r.status, r.read().decode()

    def post(self, body: bytes) -> tuple[int, dict]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/requests", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def arrive(self, arrivals: list[float]) -> dict:
        code, body = self.post(json.dumps({"arrivals_s": arrivals}).encode())
        assert code == 200, body
        return body

    def snapshot(self):
        return parse_snapshot(self.get("/metrics")[1], time.time())

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[callable]:
    started: list[Serving] = []

    def start(time_scale: float = 1.0, rate: float | None = None) -> Serving:
        s = Serving(tmp_path, time_scale, rate)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def poisson(rate: float, start: float, span_s: float, seed: int) -> list[float]:
    rng, t, out = random.Random(seed), start, []
    while True:
        t += rng.expovariate(rate)
        if t >= start + span_s:
            return out
        out.append(t)


def mean_latency_s(snap) -> float:
    return snap.value("vllm:e2e_request_latency_seconds_sum") / snap.value("vllm:e2e_request_latency_seconds_count")


def test_bad_requests_are_400_naming_the_field_and_sigterm_exits_143(serving):
    s = serving(rate=1000.0)
    now = time.time()
    cases = [(b"not json", "body"), (b"[1, 2]", "body"), (b"{}", "arrivals_s"), (b'{"arrivals_s": "x"}', "arrivals_s"),
             (json.dumps({"arrivals_s": [now, "soon"]}).encode(), "arrivals_s[1]"),
             (json.dumps({"arrivals_s": [now, now, True]}).encode(), "arrivals_s[2]"),
             (json.dumps({"arrivals_s": [-1.0]}).encode(), "arrivals_s[0]"),
             (json.dumps({"arrivals_s": [now + 86400]}).encode(), "arrivals_s[0]"),
             (json.dumps({"arrivals_s": [now] * (MAX_ARRIVALS_PER_CALL + 1)}).encode(), "arrivals_s")]
    for body, field in cases:
        code, answer = s.post(body)
        assert code == 400 and answer["error"].startswith(f"{field}:"), (body[:40], answer)
    with pytest.raises(urllib.error.HTTPError) as err:
        s.get("/nope")
    assert err.value.code == 404
    assert s.arrive([now - 0.5, now - 0.2]) == {"accepted": 2, "dropped": 0}
    time.sleep(0.5)
    assert s.snapshot().value("vllm:request_success") == 2
    assert s.stop() == 143
    out = s.proc.stdout.read()
    assert "serving workload: port=" in out and "stopped by SIGTERM: 2 completed" in out
    assert json.loads(s.progress_file.read_text())["steps"] == 2


def test_below_capacity_latency_is_the_mm1_sojourn_in_model_time(serving):
    mu, lam, scale = 2000.0, 1000.0, 10.0  # per wall second; model time runs 10x faster
    s = serving(time_scale=scale, rate=mu)
    t0 = time.time() + 0.2
    arrivals = poisson(lam, t0, 2.5, seed=7)
    assert s.arrive(arrivals)["accepted"] == len(arrivals)
    time.sleep(max(0.0, t0 + 2.5 - time.time()) + 0.3)
    snap = s.snapshot()
    assert snap.value("vllm:request_success") == len(arrivals)
    assert snap.value("vllm:num_requests_waiting") == 0
    # M/M/1 sojourn 1/(mu - lambda) wall seconds, reported x time_scale
    assert mean_latency_s(snap) == pytest.approx(scale / (mu - lam), rel=0.25)  # ~2500 requests: +-10 % typical
    assert json.loads(s.progress_file.read_text())["steps"] > 0.9 * len(arrivals)  # progress = requests completed


def test_overload_builds_a_queue_and_capacity_changes_apply_at_once(serving):
    s = serving()  # no rate file yet: capacity 0, nothing is served
    now = time.time()
    assert s.arrive([now - 0.1] * 50)["accepted"] == 50
    time.sleep(0.3)
    idle = s.snapshot()
    assert (idle.value("vllm:request_success"), idle.value("vllm:num_requests_waiting")) == (0, 50)

    s.set_rate(100.0)  # lambda 300 > mu 100: the queue and latencies grow
    t0 = time.time() + 0.1
    arrivals = poisson(300.0, t0, 2.0, seed=3)
    s.arrive(arrivals)
    time.sleep(t0 + 1.0 - time.time())
    a = s.snapshot()
    time.sleep(t0 + 2.0 - time.time())
    b = s.snapshot()
    assert b.value("vllm:num_requests_waiting") > a.value("vllm:num_requests_waiting") + 100
    window = demand_between(a, b, "svc-1")
    assert window.request_rate_rps == pytest.approx(300.0, rel=0.25)  # arrivals = served + queue growth
    assert (b.value("vllm:request_success") - a.value("vllm:request_success")) / (b.t - a.t) == pytest.approx(100.0, rel=0.3)
    assert window.p50_latency_ms > 1000 * mean_latency_s(a)  # later requests waited longer

    s.set_rate(20000.0)  # a bigger share: the backlog drains at once
    time.sleep(0.3)
    c = s.snapshot()
    assert c.value("vllm:request_success") == 50 + len(arrivals) and c.value("vllm:num_requests_waiting") == 0


def test_service_model_bounds_its_queue_and_waits_out_zero_capacity():
    m = ServiceModel("x", max_queued=100)
    assert m.add([10.0] * 150, now=11.0) == 100 and m.dropped == 50
    assert (m.completed, m.waiting) == (0, 100)  # capacity 0: they wait
    m.set_capacity(1e6, now=20.0)
    m.process(30.0)
    assert (m.completed, m.waiting, m.running) == (100, 0, 0)
    assert 10.0 <= m.latency_sum_s / 100 <= 10.1  # waited from 10 s to the capacity at 20 s
    assert 'elastico_serving_dropped_total{model_name="x"} 50.0' in m.exposition("x")
    with pytest.raises(ValueError, match="time_scale"):
        ServiceModel("x", time_scale=0.0)


def test_sigterm_exits_at_once_while_a_client_holds_a_keep_alive_connection(serving):
    """A load generator keeps one HTTP/1.1 connection open between batches: the stop must not wait for it
    (the agent's stop would otherwise run into its SIGKILL grace, and every start on the node waits with it)."""
    import http.client

    s = serving(rate=1000.0)
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
    conn.request("POST", "/v1/requests", body=json.dumps({"arrivals_s": [time.time()]}),
                 headers={"Content-Type": "application/json"})
    assert conn.getresponse().read()  # the connection stays open, idle
    try:
        t = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(10) == 143
        assert time.monotonic() - t < 1.0
    finally:
        conn.close()
