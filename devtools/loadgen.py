"""Load generator: replays Azure LLM inference demand against a serving endpoint, in accelerated time.

``python -m devtools.loadgen --endpoint 127.0.0.1:PORT --trace data/traces/azure2023_llm_inference_conv.csv
--peak-rps 4 --time-scale 120 --duration-s 30`` (``--help`` for the rest); the demo uses :class:`LoadGenerator`.

Two arrival sources, both in **model time** (seconds of the trace's clock; wall = start + model / time scale):

* :class:`ProfileArrivals` -- non-homogeneous Poisson arrivals whose rate is piecewise constant per ``BIN_S``
  bin: ``rate(t) = rates_rps[(phase_bin + floor(t / bin_s)) % P]``, the profile looping, exactly how the
  simulator indexes a service's demand (``simulator.engine``). A bin's arrivals are drawn once, from an RNG
  seeded by (seed, bin), so the arrivals do not depend on how the sender batches them.
  :meth:`ProfileArrivals.from_trace` builds the rates from an Azure trace with the simulator's profile loader
  (``simulator.traces.azure_profile``: per-bin counts normalised to a peak of 1) times a peak rate.
* :class:`TraceArrivals` -- the raw ``TIMESTAMP`` column of an Azure file, offsets from its first request,
  looping with the trace's span as period, optionally rate-scaled (a factor < 1 thins, > 1 duplicates).

:class:`LoadGenerator` runs in a thread: every ``batch_s`` it takes the arrivals that fell due since the last
batch, maps them to Unix wall times and POSTs them as ``{"arrivals_s": [...]}`` to
``http://<endpoint>/v1/requests`` (the serving workload's API). The endpoint comes from a callable (the demo
resolves it from the node agents' ``ListWorkloads``), re-resolved every ``resolve_every_s`` and after every
failure (the service may have moved). Arrivals that cannot be delivered -- no endpoint (the service is
pending), or the POST failed -- are counted with their model times: for the service they are SLO violations.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from simulator.traces import BIN_S, azure_profile

_SEED_OFFSET = 1 << 40  # bins before model time 0 (the looped profile's past) get non-negative seed words too


def _check_positive(name: str, value: float) -> float:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


class ProfileArrivals:
    """Poisson arrivals at a piecewise-constant, looping per-bin rate (module docstring)."""

    def __init__(self, rates_rps: np.ndarray, phase_bin: int = 0, bin_s: float = BIN_S, seed: int = 0) -> None:
        r = np.asarray(rates_rps, float)
        if r.ndim != 1 or len(r) == 0:
            raise ValueError(f"rates_rps must be a non-empty 1-D array, got shape {r.shape}")
        if not (np.isfinite(r).all() and (r >= 0).all()):
            raise ValueError("rates_rps must hold finite rates >= 0")
        self.rates_rps = r
        self.phase_bin = int(phase_bin)
        self.bin_s = _check_positive("bin_s", bin_s)
        self.seed = int(seed)
        self._cache: dict[int, np.ndarray] = {}

    @classmethod
    def from_trace(cls, path: str | Path, peak_rps: float, phase_bin: int = 0, seed: int = 0) -> ProfileArrivals:
        """Rates = the Azure trace's normalised per-bin profile x ``peak_rps`` (requests per model second)."""
        return cls(azure_profile(path) * _check_positive("peak_rps", peak_rps), phase_bin, BIN_S, seed)

    def rate_at(self, t: float) -> float:
        """Request rate at model time ``t``, requests/s."""
        return float(self.rates_rps[(self.phase_bin + math.floor(t / self.bin_s)) % len(self.rates_rps)])

    def bin_arrivals(self, b: int) -> np.ndarray:
        """Sorted model times of the arrivals in bin ``b`` = [b x bin_s, (b + 1) x bin_s) (drawn once)."""
        got = self._cache.get(b)
        if got is None:
            rng = np.random.default_rng([self.seed, b + _SEED_OFFSET])
            lo = b * self.bin_s
            n = rng.poisson(self.rate_at(lo) * self.bin_s)
            got = np.sort(rng.uniform(lo, lo + self.bin_s, n))
            if len(self._cache) > 64:  # the sender moves forward: old bins are never asked again
                self._cache.clear()
            self._cache[b] = got
        return got

    def arrivals(self, t0: float, t1: float) -> np.ndarray:
        """Sorted model times of the arrivals in [t0, t1)."""
        if not t1 > t0:
            return np.zeros(0)
        out = []
        for b in range(math.floor(t0 / self.bin_s), math.floor(t1 / self.bin_s) + 1):
            a = self.bin_arrivals(b)
            out.append(a[(a >= t0) & (a < t1)])
        return np.concatenate(out)


class TraceArrivals:
    """The raw request timestamps of an Azure trace, looping (module docstring)."""

    def __init__(self, offsets_s: np.ndarray, rate_scale: float = 1.0, offset_s: float = 0.0, seed: int = 0) -> None:
        t = np.sort(np.asarray(offsets_s, float))
        if t.ndim != 1 or len(t) < 2 or not np.isfinite(t).all():
            raise ValueError("offsets_s must hold at least two finite request times")
        self.base = t - t[0]
        gaps = np.diff(self.base)
        self.period_s = float(self.base[-1] + (gaps.mean() if gaps.mean() > 0 else 1.0))
        self.rate_scale = _check_positive("rate_scale", rate_scale)
        if not math.isfinite(offset_s):
            raise ValueError(f"offset_s must be finite, got {offset_s!r}")
        self.offset_s = float(offset_s)
        self.seed = int(seed)
        self._cache: dict[int, np.ndarray] = {}

    @classmethod
    def from_trace(cls, path: str | Path, rate_scale: float = 1.0, offset_s: float = 0.0, seed: int = 0) -> TraceArrivals:
        """Offsets of the ``TIMESTAMP`` column of an Azure LLM inference trace."""
        import csv
        import datetime as dt

        ts = []
        with open(path, newline="") as fh:
            rows = csv.DictReader(fh)
            if "TIMESTAMP" not in (rows.fieldnames or []):
                raise ValueError(f"{path}: no TIMESTAMP column")
            for r in rows:
                v = (r["TIMESTAMP"] or "").strip()
                try:
                    ts.append(dt.datetime.strptime(v[:26], "%Y-%m-%d %H:%M:%S.%f").timestamp())
                except ValueError:
                    raise ValueError(f"{path}:{rows.line_num}: TIMESTAMP {v!r} is not 'YYYY-MM-DD HH:MM:SS.ffffff'") from None
        return cls(np.array(ts), rate_scale, offset_s, seed)

    def _period(self, k: int) -> np.ndarray:
        """Arrival times of loop ``k`` (trace time, before the offset), thinned or duplicated per rate_scale."""
        got = self._cache.get(k)
        if got is None:
            rng = np.random.default_rng([self.seed, k + _SEED_OFFSET])
            whole, frac = divmod(self.rate_scale, 1.0)
            copies = int(whole) + (rng.random(len(self.base)) < frac)
            got = np.repeat(self.base, copies) + k * self.period_s
            if len(self._cache) > 8:
                self._cache.clear()
            self._cache[k] = got
        return got

    def arrivals(self, t0: float, t1: float) -> np.ndarray:
        """Sorted model times of the arrivals in [t0, t1)."""
        if not t1 > t0:
            return np.zeros(0)
        lo, hi = t0 + self.offset_s, t1 + self.offset_s
        out = []
        for k in range(math.floor(lo / self.period_s), math.floor(hi / self.period_s) + 1):
            a = self._period(k)
            out.append(a[(a >= lo) & (a < hi)] - self.offset_s)
        return np.concatenate(out)


@dataclass
class LoadStats:
    """What a generator did so far (a snapshot; model times in seconds)."""

    generated: int = 0  # arrivals that fell due
    delivered: int = 0  # arrivals POSTed with a 200 answer
    accepted: int = 0  # arrivals the server said it accepted
    undelivered: int = 0  # arrivals with no endpoint or a failed POST
    undelivered_model_s: list[float] = field(default_factory=list)
    posts: int = 0
    errors: int = 0
    last_error: str = ""
    endpoints: list[str] = field(default_factory=list)  # distinct endpoints delivered to, in order
    per_bin: dict[int, int] = field(default_factory=dict)  # model-time bin -> arrivals generated in it
    model_s: float = 0.0  # model time the generator has generated up to


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); ValueError naming the field otherwise."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint must be host:port with a port in 1-65535, got {endpoint!r}")
    return host, int(port)


class LoadGenerator:
    """Sends an arrival source's requests to a (re-resolved) endpoint from a thread (module docstring).

    Model time ``t`` is wall time ``t0_wall + t / time_scale``; the generator covers model time
    [``model_start_s``, ``model_end_s``) (start defaults to the model time at :meth:`start`).
    """

    def __init__(self, source: ProfileArrivals | TraceArrivals, resolve: Callable[[], str | None], time_scale: float,
                 *, t0_wall: float | None = None, model_start_s: float | None = None, model_end_s: float = math.inf,
                 batch_s: float = 0.075, resolve_every_s: float = 1.0, timeout_s: float = 2.0,
                 name: str = "service", clock: Callable[[], float] = time.time) -> None:
        self.source, self.resolve, self.name, self.clock = source, resolve, name, clock
        self.scale = _check_positive("time_scale", time_scale)
        self.batch_s = _check_positive("batch_s", batch_s)
        self.timeout_s = _check_positive("timeout_s", timeout_s)
        if not resolve_every_s >= 0:
            raise ValueError(f"resolve_every_s must be >= 0, got {resolve_every_s!r}")
        self.resolve_every_s = float(resolve_every_s)
        self.t0_wall = clock() if t0_wall is None else float(t0_wall)
        self.model_start_s = model_start_s
        self.model_end_s = float(model_end_s)
        self._stats = LoadStats()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._endpoint: str | None = None
        self._resolved_at = -math.inf
        self._conn: http.client.HTTPConnection | None = None

    def model_now(self) -> float:
        """Model time now."""
        return (self.clock() - self.t0_wall) * self.scale

    def start(self) -> LoadGenerator:
        if self._thread is not None:
            raise RuntimeError(f"load generator {self.name} already started")
        cursor = self.model_now() if self.model_start_s is None else float(self.model_start_s)
        self._thread = threading.Thread(target=self._run, args=(cursor,), name=f"loadgen-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> LoadStats:
        """Deliver what fell due up to now, stop the thread and return the final counters."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.stats()

    def stats(self) -> LoadStats:
        with self._lock:
            s = self._stats
            return LoadStats(s.generated, s.delivered, s.accepted, s.undelivered, list(s.undelivered_model_s), s.posts,
                             s.errors, s.last_error, list(s.endpoints), dict(s.per_bin), s.model_s)

    # --- the sender thread ------------------------------------------------------------------------------
    def _run(self, cursor: float) -> None:
        try:
            while True:
                stopping = self._stop.is_set()
                hi = min(self.model_now(), self.model_end_s)
                if hi > cursor:
                    self._deliver(self.source.arrivals(cursor, hi))
                    cursor = hi
                    with self._lock:
                        self._stats.model_s = cursor
                if stopping or cursor >= self.model_end_s:
                    return
                self._stop.wait(self.batch_s)
        finally:
            self._close()

    def _deliver(self, model_t: np.ndarray) -> None:
        n = len(model_t)
        bins, counts = np.unique(np.floor(model_t / BIN_S).astype(np.int64), return_counts=True)
        with self._lock:
            self._stats.generated += n
            for b, c in zip(bins.tolist(), counts.tolist()):
                self._stats.per_bin[b] = self._stats.per_bin.get(b, 0) + c
        if n == 0:
            return
        now = self.clock()
        if self._endpoint is None or now - self._resolved_at >= self.resolve_every_s:
            self._set_endpoint(self._safe_resolve(), now)
        err = ""
        accepted = 0
        if self._endpoint is None:
            err = "no endpoint"
        else:
            wall = (self.t0_wall + model_t / self.scale).tolist()
            try:
                accepted = self._post({"arrivals_s": wall})
            except (OSError, http.client.HTTPException, ValueError) as exc:
                err = f"{self._endpoint}: {type(exc).__name__}: {exc}"
                self._close()
                self._endpoint = None  # re-resolved on the next batch
        with self._lock:
            s = self._stats
            if err:
                s.undelivered += n
                s.undelivered_model_s.extend(model_t.tolist())
                s.errors += err != "no endpoint"
                s.last_error = err
            else:
                s.posts += 1
                s.delivered += n
                s.accepted += accepted
                if not s.endpoints or s.endpoints[-1] != self._endpoint:
                    s.endpoints.append(str(self._endpoint))

    def _safe_resolve(self) -> str | None:
        try:
            return self.resolve() or None
        except Exception as exc:  # noqa: BLE001 - a failing resolver means "no endpoint now", reported in stats
            with self._lock:
                self._stats.last_error = f"resolve: {type(exc).__name__}: {exc}"
            return None

    def _set_endpoint(self, ep: str | None, now: float) -> None:
        self._resolved_at = now
        if ep != self._endpoint:
            self._close()
            self._endpoint = ep

    def _post(self, body: dict) -> int:
        """POST ``body`` to the current endpoint; returns the server's ``accepted`` count."""
        if self._conn is None:
            host, port = split_endpoint(str(self._endpoint))
            self._conn = http.client.HTTPConnection(host, port, timeout=self.timeout_s)
        data = json.dumps(body).encode()
        self._conn.request("POST", "/v1/requests", body=data, headers={"Content-Type": "application/json"})
        resp = self._conn.getresponse()
        text = resp.read()
        if resp.status != 200:
            raise ValueError(f"HTTP {resp.status}: {text[:200]!r}")
        return int(json.loads(text).get("accepted", 0))

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.loadgen", description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoint", required=True, help="host:port of the serving workload (POST /v1/requests)")
    ap.add_argument("--trace", default="data/traces/azure2023_llm_inference_conv.csv", help="Azure LLM inference CSV")
    ap.add_argument("--mode", choices=("profile", "timestamps"), default="profile",
                    help="profile: Poisson at the trace's per-minute profile x --peak-rps; timestamps: the raw "
                         "TIMESTAMP column x --rate-scale")
    ap.add_argument("--peak-rps", type=float, default=4.0, help="profile mode: rate at the profile's peak minute, "
                                                                "requests per model second")
    ap.add_argument("--phase-bin", type=int, default=0, help="profile mode: start this many minutes into the profile")
    ap.add_argument("--rate-scale", type=float, default=1.0, help="timestamps mode: < 1 thins, > 1 duplicates")
    ap.add_argument("--offset-s", type=float, default=0.0, help="timestamps mode: start this far into the trace, s")
    ap.add_argument("--time-scale", type=float, default=120.0, help="model seconds per wall second")
    ap.add_argument("--duration-s", type=float, default=30.0, help="wall seconds to run")
    ap.add_argument("--batch-ms", type=float, default=75.0, help="send interval, ms")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        split_endpoint(a.endpoint)
        _check_positive("--duration-s", a.duration_s)
        _check_positive("--time-scale", a.time_scale)
        if a.mode == "profile":
            src: ProfileArrivals | TraceArrivals = ProfileArrivals.from_trace(a.trace, a.peak_rps, a.phase_bin, a.seed)
        else:
            src = TraceArrivals.from_trace(a.trace, a.rate_scale, a.offset_s, a.seed)
        gen = LoadGenerator(src, lambda: a.endpoint, a.time_scale, model_start_s=0.0, batch_s=a.batch_ms / 1000.0,
                            name=Path(a.trace).stem)
    except (ValueError, OSError) as exc:
        ap.error(str(exc))
    print(f"loadgen: {a.mode} of {a.trace} -> http://{a.endpoint}/v1/requests, time x{a.time_scale:g}, "
          f"{a.duration_s:g} s wall", flush=True)
    gen.start()
    end = time.time() + a.duration_s
    try:
        while time.time() < end:
            time.sleep(min(1.0, max(0.0, end - time.time())))
            s = gen.stats()
            print(f"  model t={s.model_s:8.0f} s  generated {s.generated:7d}  accepted {s.accepted:7d}  "
                  f"undelivered {s.undelivered:6d}" + (f"  ({s.last_error})" if s.undelivered else ""), flush=True)
    except KeyboardInterrupt:
        pass
    s = gen.stop()
    rate = s.generated / max(s.model_s, 1e-9)
    print(f"loadgen: {s.generated} arrivals over {s.model_s:.0f} model s ({rate:.2f} requests per model s), "
          f"{s.accepted} accepted, {s.undelivered} undelivered, {s.errors} failed POSTs")
    return 0 if s.generated == s.delivered else 1


if __name__ == "__main__":
    sys.exit(main())
