"""Built-in inference workload (``python -m services.node_agent.serving``): a request-serving process for simulated GPUs.

It serves requests at the rate its simulated GPU share allows and publishes the Prometheus metrics a vLLM
server would, so the node agent's scrape path (``scrape.py``) runs end to end without a real model server.

HTTP on ``127.0.0.1:$ELASTICO_SERVE_PORT``:

* ``POST /v1/requests`` ``{"arrivals_s": [unix times...]}`` (at most ``MAX_ARRIVALS_PER_CALL``): one request
  per arrival -> ``{"accepted": n, "dropped": k}``; 400 naming the field on bad input.
* ``GET /metrics``: ``vllm:request_success_total``, ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
  ``vllm:e2e_request_latency_seconds`` (histogram), label ``model_name=$ELASTICO_JOB_ID``; plus
  ``elastico_serving_dropped_total`` and ``elastico_serving_capacity_rps``.
* ``GET /healthz``: 200 once serving.

Service model (the policy's M/M/1, so live and simulated runs agree): one FIFO server in virtual time. The
capacity mu (requests per wall second) is read from ``$ELASTICO_SIM_RATE_FILE`` (written by the agent, as for
``synthetic.py``; missing or 0 = nothing is served and requests queue). A request starting service at t draws
its service time from Exp(mu(t)) (RNG seeded from the job id); departure = max(arrival, previous departure)
+ service. Requests are processed lazily, at each arrival batch, scrape and tick, so the cost is O(requests)
without per-request timers; a request is completed once its departure <= now. Latencies are reported in
model time: wall latency x ``$ELASTICO_TIME_SCALE`` (the simulated backend's accelerated clock).

Standard library only (like ``synthetic.py``): workloads run as an unprivileged user whose interpreter may
have no third-party packages, so the exposition text is written here rather than by prometheus_client.
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
import os
import random
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from services.node_agent.synthetic import read_rate, write_progress

MAX_ARRIVALS_PER_CALL = 100_000
MAX_QUEUED = 1_000_000  # requests waiting (or not yet arrived); arrivals beyond it are dropped and counted
MAX_BODY_BYTES = 8 << 20  # 100k arrivals as JSON numbers fit in ~2.5 MB
MAX_FUTURE_S = 3600.0  # an arrival may lie at most this far ahead of this process's clock
MAX_CAPACITY_SEGMENTS = 4096  # capacity changes remembered for arrivals that predate the last departure
TICK_S = 0.1  # rate file refresh and lazy processing period
PROGRESS_EVERY_S = 0.25
# latency buckets, seconds: 1-2-5 per decade from 1 ms to 100 s
LATENCY_BUCKETS_S = tuple(m * 10.0 ** e for e in range(-3, 2) for m in (1, 2, 5)) + (100.0,)


class ServiceModel:
    """A FIFO single-server queue in virtual time whose service rate follows a capacity history.

    Not thread-safe: callers hold a lock. ``now`` arguments are Unix wall seconds.
    """

    def __init__(self, seed: str, time_scale: float = 1.0, max_queued: int = MAX_QUEUED) -> None:
        if not (math.isfinite(time_scale) and time_scale > 0):
            raise ValueError(f"time_scale must be a finite number > 0, got {time_scale!r}")
        self.time_scale = time_scale
        self.max_queued = max_queued
        self._rng = random.Random(f"elastico-serving:{seed}")
        self._future: list[float] = []  # arrivals later than the last processed time (min-heap)
        self._waiting: list[float] = []  # arrived, not started (min-heap: FIFO by arrival time)
        self._running: tuple[float, float] | None = None  # (arrival, departure) of the request in service
        self._last_departure = 0.0
        self._mu_times: list[float] = [0.0]  # capacity history: mu_values[i] holds from mu_times[i]
        self._mu_values: list[float] = [0.0]
        self.completed = 0
        self.dropped = 0
        self.latency_sum_s = 0.0  # model time
        self.bucket_counts = [0] * (len(LATENCY_BUCKETS_S) + 1)  # per bucket (not cumulative); last = +Inf

    @property
    def capacity(self) -> float:
        return self._mu_values[-1]

    def set_capacity(self, mu: float, now: float) -> None:
        """From ``now`` on, requests that start service draw service times at ``mu`` requests/s."""
        mu = max(0.0, mu) if math.isfinite(mu) else 0.0
        if mu == self._mu_values[-1]:
            return
        self.process(now)  # requests started before now keep the old capacity
        t = max(now, self._mu_times[-1])
        self._mu_times.append(t)
        self._mu_values.append(mu)

    def add(self, arrivals: list[float], now: float) -> int:
        """Queue ``arrivals``; returns how many were accepted (the rest were dropped: queue full)."""
        self.process(now)
        room = max(0, self.max_queued - len(self._waiting) - len(self._future))
        take = arrivals[:room]
        self.dropped += len(arrivals) - len(take)
        if len(take) > len(self._future):  # a large batch: one O(n) heapify beats n pushes
            self._future.extend(take)
            heapq.heapify(self._future)
        else:
            for a in take:
                heapq.heappush(self._future, a)
        self.process(now)
        return len(take)

    def _mu_from(self, t: float) -> tuple[float, float] | None:
        """(start, mu): the first moment >= t with a capacity > 0 and that capacity; None if there is none yet."""
        i = bisect.bisect_right(self._mu_times, t) - 1
        if self._mu_values[i] > 0:
            return t, self._mu_values[i]
        for j in range(i + 1, len(self._mu_times)):
            if self._mu_values[j] > 0:
                return self._mu_times[j], self._mu_values[j]
        return None

    def process(self, now: float) -> None:
        """Advance the queue to ``now``: admit arrivals, complete departures, start the next requests."""
        while True:
            while self._future and self._future[0] <= now:
                heapq.heappush(self._waiting, heapq.heappop(self._future))
            if self._running is not None:
                arrival, departure = self._running
                if departure > now:
                    break
                self._complete(arrival, departure)
                self._running = None
            if not self._waiting:
                break
            got = self._mu_from(max(self._waiting[0], self._last_departure))
            if got is None or got[0] > now:
                break  # no capacity yet: the queue waits
            start, mu = got
            arrival = heapq.heappop(self._waiting)
            self._last_departure = start + self._rng.expovariate(mu)
            self._running = (arrival, self._last_departure)
        # capacity segments wholly before the next possible start are no longer needed
        keep_from = bisect.bisect_right(self._mu_times, self._last_departure) - 1
        keep_from = max(keep_from, len(self._mu_times) - MAX_CAPACITY_SEGMENTS)  # bound: very late arrivals use the oldest kept
        if keep_from > 0:
            del self._mu_times[:keep_from], self._mu_values[:keep_from]

    def _complete(self, arrival: float, departure: float) -> None:
        latency = (departure - arrival) * self.time_scale
        self.completed += 1
        self.latency_sum_s += latency
        self.bucket_counts[bisect.bisect_left(LATENCY_BUCKETS_S, latency)] += 1

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return 0 if self._running is None else 1

    def exposition(self, model_name: str) -> str:
        """Prometheus text format 0.0.4 of the current counters (call ``process`` first)."""
        lbl = 'model_name="' + model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
        out = [
            "# HELP vllm:request_success_total Requests completed.",
            "# TYPE vllm:request_success_total counter",
            f"vllm:request_success_total{{{lbl}}} {float(self.completed)!r}",
            "# HELP vllm:num_requests_waiting Requests arrived and not started.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{lbl}}} {float(self.waiting)!r}",
            "# HELP vllm:num_requests_running Requests in service.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{lbl}}} {float(self.running)!r}",
            "# HELP vllm:e2e_request_latency_seconds End-to-end latency of completed requests (model time).",
            "# TYPE vllm:e2e_request_latency_seconds histogram",
        ]
        cum = 0
        for le, n in zip((*LATENCY_BUCKETS_S, math.inf), self.bucket_counts, strict=True):
            cum += n
            bound = "+Inf" if math.isinf(le) else repr(le)
            out.append(f'vllm:e2e_request_latency_seconds_bucket{{le="{bound}",{lbl}}} {float(cum)!r}')
        out += [
            f"vllm:e2e_request_latency_seconds_sum{{{lbl}}} {self.latency_sum_s!r}",
            f"vllm:e2e_request_latency_seconds_count{{{lbl}}} {float(self.completed)!r}",
            "# HELP elastico_serving_dropped_total Arrivals dropped because the queue was full.",
            "# TYPE elastico_serving_dropped_total counter",
            f"elastico_serving_dropped_total{{{lbl}}} {float(self.dropped)!r}",
            "# HELP elastico_serving_capacity_rps Service capacity now, requests per wall second.",
            "# TYPE elastico_serving_capacity_rps gauge",
            f"elastico_serving_capacity_rps{{{lbl}}} {self.capacity!r}",
        ]
        return "\n".join(out) + "\n"


class BadRequest(ValueError):
    """Invalid request input; the message names the field."""


def parse_arrivals(body: bytes, now: float) -> list[float]:
    """The arrival times of a ``POST /v1/requests`` body.

    Raises:
        BadRequest: not a JSON object, ``arrivals_s`` missing, not a list, too long, or an element that is
            not a finite Unix time (> 0, at most ``MAX_FUTURE_S`` ahead of ``now``).
    """
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BadRequest("body: must be a JSON object with an 'arrivals_s' list")
    if "arrivals_s" not in data:
        raise BadRequest("arrivals_s: is required (a list of Unix times in seconds)")
    arrivals = data["arrivals_s"]
    if not isinstance(arrivals, list):
        raise BadRequest(f"arrivals_s: must be a list of Unix times in seconds, got {type(arrivals).__name__}")
    if len(arrivals) > MAX_ARRIVALS_PER_CALL:
        raise BadRequest(f"arrivals_s: at most {MAX_ARRIVALS_PER_CALL} arrivals per call, got {len(arrivals)}")
    limit = now + MAX_FUTURE_S
    for i, a in enumerate(arrivals):
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) or a <= 0:
            raise BadRequest(f"arrivals_s[{i}]: must be a finite Unix time in seconds, got {str(a)[:32]!r}")
        if a > limit:
            raise BadRequest(f"arrivals_s[{i}]: is {a - now:.0f} s in the future (at most {MAX_FUTURE_S:.0f} s)")
    return [float(a) for a in arrivals]


class Server:
    """The HTTP front of one ``ServiceModel``, plus the tick that follows the rate file."""

    def __init__(self, port: int, model: ServiceModel, model_name: str, rate_file: str = "", progress_file: str = "") -> None:
        self.model = model
        self.model_name = model_name
        self.rate_file = rate_file
        self.progress_file = progress_file
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: a load generator posts batches over one connection

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
                return None  # one line per request would swamp the workload log

            def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _error(self, code: int, message: str) -> None:
                self._send(code, json.dumps({"error": message}).encode())

            def do_GET(self) -> None:  # noqa: N802 - stdlib name
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, outer.metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
                elif path == "/healthz":
                    self._send(200, b"ok\n", "text/plain")
                else:
                    self._error(404, f"no such path {path[:64]!r} (GET /metrics, /healthz; POST /v1/requests)")

            def do_POST(self) -> None:  # noqa: N802 - stdlib name
                if self.path.split("?", 1)[0] != "/v1/requests":
                    self._error(404, f"no such path {self.path[:64]!r} (POST /v1/requests)")
                    return
                raw_len = self.headers.get("Content-Length")
                if raw_len is None or not raw_len.strip().isdigit():
                    self.close_connection = True
                    self._error(411, "Content-Length: required (a number of bytes)")
                    return
                length = int(raw_len)
                if length > MAX_BODY_BYTES:
                    self.close_connection = True  # the unread body would be taken for the next request
                    self._error(413, f"body: at most {MAX_BODY_BYTES} bytes, got {length}")
                    return
                body = self.rfile.read(length)
                try:
                    accepted, dropped = outer.submit(body)
                except BadRequest as exc:
                    self._error(400, str(exc))
                    return
                self._send(200, json.dumps({"accepted": accepted, "dropped": dropped}).encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True

    def submit(self, body: bytes) -> tuple[int, int]:
        now = time.time()
        arrivals = parse_arrivals(body, now)
        with self.lock:
            accepted = self.model.add(arrivals, now)
        return accepted, len(arrivals) - accepted

    def metrics(self) -> str:
        with self.lock:
            self.model.process(time.time())
            return self.model.exposition(self.model_name)

    def tick(self) -> None:
        """Follow the rate file and advance the queue (completions between requests and scrapes)."""
        mu = read_rate(self.rate_file, 0.0) if self.rate_file else 0.0
        with self.lock:
            now = time.time()
            self.model.set_capacity(mu, now)
            self.model.process(now)

    def write_progress(self) -> None:
        if self.progress_file:
            with self.lock:
                done = self.model.completed
            write_progress(self.progress_file, float(done))


def config_from_env(env: dict[str, str]) -> tuple[int, float, str]:
    """(port, time scale, job id) from the environment.

    Raises:
        ValueError: a missing or invalid variable, named in the message.
    """
    raw_port = env.get("ELASTICO_SERVE_PORT", "")
    if not raw_port.strip().isdigit() or not 1 <= int(raw_port) <= 65535:
        raise ValueError(f"ELASTICO_SERVE_PORT={raw_port!r}: required, a port number 1-65535")
    raw_scale = env.get("ELASTICO_TIME_SCALE", "") or "1"
    try:
        scale = float(raw_scale)
    except ValueError:
        scale = math.nan
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"ELASTICO_TIME_SCALE={raw_scale!r}: must be a finite number > 0")
    return int(raw_port), scale, env.get("ELASTICO_JOB_ID", "")


def main(argv: list[str] | None = None) -> int:
    if argv:
        print(f"serving workload: takes no arguments (configured by ELASTICO_* variables), got {argv}", file=sys.stderr)
        return 2
    try:
        port, scale, job_id = config_from_env(dict(os.environ))
    except ValueError as exc:
        print(f"serving workload: {exc}", file=sys.stderr)
        return 2
    try:
        server = Server(port, ServiceModel(job_id, scale), job_id, os.environ.get("ELASTICO_SIM_RATE_FILE", ""),
                        os.environ.get("ELASTICO_PROGRESS_FILE", ""))
    except OSError as exc:
        print(f"serving workload: cannot listen on 127.0.0.1:{port}: {exc}", file=sys.stderr)
        return 1
    # a plain flag, not a threading.Event: the handler runs in the main thread between two bytecodes, possibly
    # inside Event.wait/set holding its lock, and SIGTERM comes twice (to the group, and forwarded by the shim)
    stopping = False

    def on_term(_sig: int, _frm: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    server.tick()
    thread = threading.Thread(target=server.httpd.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    thread.start()
    print(f"serving workload: port={port} model_name={job_id} time_scale={scale:g} "
          f"visible_devices={os.environ.get('CUDA_VISIBLE_DEVICES', '')} "
          f"mps_share={os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE', '')} "
          f"mps_mem={os.environ.get('CUDA_MPS_PINNED_DEVICE_MEM_LIMIT', '')}", flush=True)
    last_progress = 0.0
    while not stopping:
        time.sleep(TICK_S)
        server.tick()
        if time.monotonic() - last_progress >= PROGRESS_EVERY_S:
            server.write_progress()
            last_progress = time.monotonic()
    server.httpd.shutdown()
    server.httpd.server_close()
    server.write_progress()
    m = server.model
    print(f"stopped by SIGTERM: {m.completed} completed, {m.waiting} waiting, {m.dropped} dropped", flush=True)
    return 143


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
