"""The load generator (devtools.loadgen): arrival sources against the simulator's demand indexing, and the sender
thread against a real local HTTP server that records what it receives."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from devtools.loadgen import LoadGenerator, ProfileArrivals, TraceArrivals, main, split_endpoint
from simulator.traces import BIN_S, azure_profile

ROOT = Path(__file__).resolve().parents[2]
CONV = ROOT / "data/traces/azure2023_llm_inference_conv.csv"


class _Sink:
    """A serving endpoint stand-in: records every POSTed arrival; ``fail`` makes it answer 503."""

    def __init__(self) -> None:
        self.arrivals: list[float] = []
        self.fail = False
        self.lock = threading.Lock()
        sink = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if sink.fail:
                    self.send_response(503)
                    self.end_headers()
                    return
                with sink.lock:
                    sink.arrivals.extend(body["arrivals_s"])
                out = json.dumps({"accepted": len(body["arrivals_s"])}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *a: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.endpoint = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def sink():
    s = _Sink()
    yield s
    s.close()


def test_profile_rate_follows_the_simulators_looped_indexing() -> None:
    rates = np.array([1.0, 0.0, 3.0])
    src = ProfileArrivals(rates, phase_bin=2, bin_s=60.0)
    # the engine reads demand of bin k as profile[(phase + k) % P]
    assert [src.rate_at(t) for t in (0.0, 59.9, 60.0, 120.0, 180.0, -1.0)] == [3.0, 3.0, 1.0, 0.0, 3.0, 0.0]


def test_profile_arrivals_are_poisson_at_the_bin_rate_and_do_not_depend_on_batching() -> None:
    src = ProfileArrivals(np.array([2.0, 0.0, 8.0]), bin_s=60.0, seed=3)
    whole = src.arrivals(0.0, 180.0 * 200)
    counts = np.bincount((np.floor(whole / 60.0).astype(int)) % 3, minlength=3) / 200
    assert counts[1] == 0
    assert counts[0] == pytest.approx(120.0, rel=0.05) and counts[2] == pytest.approx(480.0, rel=0.05)
    assert np.all(np.diff(whole) >= 0)
    # the same seed gives the same arrivals however the interval is cut, and a new source redraws them alike
    cuts = np.sort(np.random.default_rng(0).uniform(0, 1800.0, 40))
    pieces = np.concatenate([src.arrivals(a, b) for a, b in zip(np.r_[0.0, cuts], np.r_[cuts, 1800.0])])
    again = ProfileArrivals(np.array([2.0, 0.0, 8.0]), bin_s=60.0, seed=3).arrivals(0.0, 1800.0)
    np.testing.assert_array_equal(pieces, again)
    assert not np.array_equal(again, ProfileArrivals(np.array([2.0, 0.0, 8.0]), bin_s=60.0, seed=4).arrivals(0.0, 1800.0))


def test_profile_from_trace_is_the_simulators_profile_times_the_peak() -> None:
    src = ProfileArrivals.from_trace(CONV, peak_rps=4.0, phase_bin=5)
    np.testing.assert_allclose(src.rates_rps, azure_profile(CONV) * 4.0)
    assert src.rates_rps.max() == pytest.approx(4.0)
    assert src.rate_at(0.0) == pytest.approx(4.0 * azure_profile(CONV)[5])
    assert BIN_S == 60.0


@pytest.mark.parametrize("kw, field", [
    (dict(rates_rps=np.array([])), "rates_rps"), (dict(rates_rps=np.array([1.0, -1.0])), "rates_rps"),
    (dict(rates_rps=np.array([1.0]), bin_s=0.0), "bin_s"), (dict(rates_rps=np.array([np.nan])), "rates_rps")])
def test_profile_rejects_bad_input_naming_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ProfileArrivals(**kw)


def test_trace_arrivals_replay_the_timestamps_looped_and_rate_scaled() -> None:
    src = TraceArrivals.from_trace(CONV)
    n = len(src.base)
    assert n > 10_000 and src.base[0] == 0.0
    one = src.arrivals(0.0, src.period_s)
    np.testing.assert_allclose(one, src.base)
    two = src.arrivals(0.0, 2 * src.period_s)
    assert len(two) == 2 * n
    np.testing.assert_allclose(two[n:] - src.period_s, src.base)
    thin = TraceArrivals.from_trace(CONV, rate_scale=0.25, seed=1).arrivals(0.0, src.period_s)
    assert len(thin) == pytest.approx(n / 4, rel=0.05)
    dup = TraceArrivals.from_trace(CONV, rate_scale=2.5, seed=1).arrivals(0.0, src.period_s)
    assert len(dup) == pytest.approx(2.5 * n, rel=0.03)
    shifted = TraceArrivals.from_trace(CONV, offset_s=100.0).arrivals(0.0, 50.0)
    np.testing.assert_allclose(shifted, src.base[(src.base >= 100.0) & (src.base < 150.0)] - 100.0)
    with pytest.raises(ValueError, match="rate_scale"):
        TraceArrivals(src.base, rate_scale=0.0)


def test_split_endpoint_names_the_field() -> None:
    assert split_endpoint("127.0.0.1:8080") == ("127.0.0.1", 8080)
    for bad in ("127.0.0.1", "host:0", ":80", "h:x"):
        with pytest.raises(ValueError, match="endpoint"):
            split_endpoint(bad)


def test_generator_delivers_every_arrival_at_its_scaled_wall_time(sink: _Sink) -> None:
    scale = 600.0
    src = ProfileArrivals(np.array([20.0, 5.0]), bin_s=60.0, seed=7)
    t0 = time.time()
    gen = LoadGenerator(src, lambda: sink.endpoint, scale, t0_wall=t0, model_start_s=0.0, model_end_s=240.0,
                        batch_s=0.05).start()
    time.sleep(0.55)
    s = gen.stop()
    expect = src.arrivals(0.0, 240.0)
    assert s.generated == len(expect) == s.delivered == s.accepted
    assert s.undelivered == 0 and s.endpoints == [sink.endpoint] and s.posts >= 3
    np.testing.assert_allclose(sorted(sink.arrivals), t0 + expect / scale)
    assert sum(s.per_bin.values()) == len(expect) and set(s.per_bin) == {0, 1, 2, 3}
    assert s.model_s == 240.0


def test_arrivals_without_an_endpoint_are_counted_with_their_times_then_delivered_once_it_resolves(sink: _Sink) -> None:
    scale = 600.0
    ready = threading.Event()
    calls = []

    def resolve() -> str | None:
        calls.append(time.time())
        return sink.endpoint if ready.is_set() else None

    src = ProfileArrivals(np.array([30.0]), bin_s=60.0, seed=1)
    t0 = time.time()
    gen = LoadGenerator(src, resolve, scale, t0_wall=t0, model_start_s=0.0, batch_s=0.05, resolve_every_s=10.0).start()
    time.sleep(0.3)
    ready.set()
    time.sleep(0.3)
    sink.fail = True  # a failed POST: those arrivals are lost, and the endpoint is resolved again
    time.sleep(0.2)
    sink.fail = False
    time.sleep(0.3)
    s = gen.stop()
    lost = np.array(s.undelivered_model_s)
    assert s.undelivered == len(lost) > 0 and s.delivered > 0 and s.errors >= 1
    assert s.generated == s.delivered + s.undelivered
    assert np.all(lost >= 0) and lost.min() < 0.25 * scale  # the first ones (pending) are among them
    delivered_model = (np.array(sink.arrivals) - t0) * scale
    assert not set(np.round(lost, 6)) & set(np.round(delivered_model, 6))
    assert len(calls) >= 3  # resolved while pending and again after the failure, despite resolve_every_s=10


def test_cli_help_and_a_short_run(sink: _Sink, capsys: pytest.CaptureFixture) -> None:
    out = subprocess.run([sys.executable, "-m", "devtools.loadgen", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0 and "--peak-rps" in out.stdout and "--time-scale" in out.stdout
    assert main(["--endpoint", sink.endpoint, "--trace", str(CONV), "--peak-rps", "4", "--time-scale", "600",
                 "--duration-s", "1"]) == 0
    text = capsys.readouterr().out
    assert "accepted" in text and len(sink.arrivals) > 0
    # about 600 model s at ~0.7 x 4 requests/s
    assert 0.3 * 4 * 600 < len(sink.arrivals) < 4 * 700
    with pytest.raises(SystemExit):
        main(["--endpoint", "nohost", "--duration-s", "1"])
    with pytest.raises(SystemExit):
        main(["--endpoint", sink.endpoint, "--duration-s", "0"])
