"""``make demo``: a saturated mix of Philly training jobs and Azure-driven inference services, through the live
suite and through the simulator, for ElastiCo and exclusive FIFO, printed side by side with plots in ``out/demo/``.

The workload: a slice of consecutive Philly training jobs (``--window``, ``--jobs``) on ``--nodes`` x
``--gpus-per-node`` simulated GPUs, plus inference services (``--services``, default three: the Azure *code*
profile, bursty, twice at different phases, and the *conversation* profile, steady), each one GPU's worth of
service rate ``mu_full`` (``--mu-full`` requests per model second), at a peak load (fraction of a full GPU) and a
phase, alive from t = 0 to the last training arrival (the simulator's ``InferenceServices.end_s``).

For each policy:

1. **live** -- start the whole local suite (``devtools.cluster``: embedded Redis, pricer, predictor, allocator
   with that policy, node agents on simulated GPUs) in accelerated time (``--time-scale`` model seconds per
   wall second), replay the slice through the allocator's gRPC API (``devtools.replay``): the services
   first, then the training jobs at their scaled arrivals, invariants checked on every sample. Each service's
   load generator (``devtools.loadgen``) replays its profile; acting as its gateway, the demo reports its
   demand through ``Allocator.ReportDemand`` -- the hour before the slice (the looped profile's previous
   period, the history the simulator's forecast starts from) at submission, then every minute as it ends.
   The node agents run each service as a request-serving process whose capacity follows its simulated GPU
   share, scrape its vLLM metrics and report that demand too; the allocator forecasts from both and resizes
   the service in place;
2. **simulated** -- the same jobs and services (same profiles, peak loads, phases, start and end) through
   ``simulator`` with the live allocator's policy options, on the same node topology. Each job runs at its
   requested GPU count on both sides: live, it declares shapes at that count only, and a gang changes count
   only to counts it declares, so the simulated policy runs without GPU-count shapes (``elastic_gpus``); a
   declared share is a compute limit wherever it runs, so the simulated policy keeps every training share a
   limit (``unlimited_training`` off).

Then the simulator's metrics table, live next to simulated, the differences, the ElastiCo / FIFO ratios, each
service's SLO attainment and p99 latency, and the plots. The estimate both sides decide on is the calibrated
utilisation rule (``ELASTICO_ESTIMATOR=rule``); the simulated GPUs take their co-location speeds from the
simulator's ground truth, so what remains in the difference is the control plane and the stochastic arrivals.

SLO attainment, both sides: the fraction of a service's lifetime in one-minute windows (model time) whose mean
latency is within its SLO (``slo_factor x`` the unloaded full-GPU service time): live, the mean latency of the
requests completed in the window (from the service's Prometheus histogram; a window without arrivals has its
few stragglers judged with the last window that had arrivals; no serving replica = violated);
simulated, the M/M/1 mean sojourn at the window's demand and the capacity the service had (the simulator's own
criterion). p99 latency: live, from the histogram over the run; simulated, the M/M/1 p99 (sojourn times are
exponential, rate ``mu_full x (capacity - load)``), mixed over the run by arrivals.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from devtools import cluster
from elastico.argtypes import ranged
from simulator.engine import Engine
from simulator.traces import BIN_S, TraceError

TRACE = "data/traces/gavel_philly_vc_traces_seed0.csv"
TRACE_DIR = Path("data/traces")
# 30 consecutive Philly 1-GPU jobs arriving over ~1 h (offered load ~2.3 on the training GPUs), none longer than
# 1.6 h alone: with three services on 8 GPUs the slice saturates the cluster and drains in ~3 h of trace time.
DEFAULT_WINDOW = (4133350.0, 4155000.0)
DEFAULT_JOBS = 30
# profile:peak load (fraction of a full GPU at the profile's peak minute):phase (profile minute at t = 0)
DEFAULT_SERVICES = "code:0.3:0,conv:0.3:0,code:0.3:28"
# requests per model second one whole, uncontended GPU serves: enough requests per minute that a window's mean latency
# reads the M/M/1 mean (a 0.3-load service sends ~1,200 arrivals per wall second at its peak, time x200)
MU_FULL = 20.0
SERVICE_MEM_MIB = 2048  # a service's memory footprint, whatever its compute share
OUT_DIR = Path("out/demo")
TARGET_GAP = 0.15  # live vs simulated, relative, on avg JCT and work/h
TARGET_SLO = 0.99


@dataclass(frozen=True)
class ServiceDef:
    """One inference service of the demo: an Azure profile, its peak load and phase, and an optional demand step."""

    profile: str  # "code" or "conv": data/traces/azure2023_llm_inference_<profile>.csv
    peak_load: float  # fraction of one full GPU's rate at the profile's peak minute
    phase_bin: int  # profile minute at model time 0
    # > 1: the profile's hour is followed by the same hour x step (a demand step up, then back down as it loops);
    # the peak load is that of the stepped hour
    step: float = 1.0

    @property
    def key(self) -> str:
        """The demand profile it follows (its trace, stepped)."""
        return self.profile if self.step == 1 else f"{self.profile}x{self.step:g}"

    def path(self, trace_dir: Path = TRACE_DIR) -> Path:
        return trace_dir / f"azure2023_llm_inference_{self.profile}.csv"


def parse_services(text: str, slo_factor: float = 10.0, trace_dir: Path = TRACE_DIR) -> list[ServiceDef]:
    """``profile:peak:phase,...`` -> service definitions; ValueError naming ``--services`` on bad input."""
    out = []
    margin = 1.0 / slo_factor
    for item in [x.strip() for x in text.split(",") if x.strip()]:
        parts = item.split(":")
        if len(parts) not in (3, 4):
            raise ValueError(f"--services: {item!r} is not profile:peak_load:phase_bin[:step]")
        prof, peak, phase = parts[:3]
        try:
            d = ServiceDef(prof, float(peak), int(phase), float(parts[3]) if len(parts) == 4 else 1.0)
        except ValueError:
            raise ValueError(f"--services: {item!r}: peak load and step are numbers, the phase a whole minute") from None
        if not (1.0 <= d.step <= 10.0):
            raise ValueError(f"--services: step {d.step:g} of {prof!r} must be in [1, 10]")
        if not d.path(trace_dir).exists():
            raise ValueError(f"--services: profile {prof!r} has no trace {d.path(trace_dir)}")
        if not (0 < d.peak_load <= 1 - margin):
            raise ValueError(f"--services: peak load {peak} of {prof!r} must be in (0, {1 - margin:g}] (a whole GPU "
                             f"minus the SLO margin {margin:g})")
        if d.phase_bin < 0:
            raise ValueError(f"--services: phase {phase} of {prof!r} must be >= 0")
        out.append(d)
    if not out:
        raise ValueError("--services: at least one service is needed")
    return out


def build_services(defs: list[ServiceDef], end_s: float, trace_dir: Path = TRACE_DIR):
    """The services as the simulator's ``InferenceServices``: alive over [0, ``end_s``), each its profile
    (``simulator.traces.azure_profile``, normalised to a peak of 1) x its peak load, looping from its phase."""
    from simulator.traces import InferenceServices, azure_profile

    by_key = {d.key: d for d in defs}
    names = sorted(by_key)
    profiles = []
    for n in names:
        d = by_key[n]
        p = azure_profile(d.path(trace_dir))
        if d.step != 1:  # the hour, then the hour x step; normalised to the stepped hour's peak
            p = np.concatenate([p, d.step * p]) / d.step
        profiles.append(p)
    k = len(defs)
    return InferenceServices(
        start_s=np.zeros(k), end_s=np.full(k, float(end_s)), peak_load=np.array([d.peak_load for d in defs]),
        profile=np.array([names.index(d.key) for d in defs]),
        phase_bin=np.array([d.phase_bin % len(profiles[names.index(d.key)]) for d in defs]),
        profiles=profiles, names=[f"azure2023_llm_inference_{n}" for n in names])


# --- simulator side ------------------------------------------------------------------------------------
class RecordingEngine(Engine):
    """The simulator's engine, recording each inference service's (time, share %, capacity) whenever the
    capacities are recomputed (``_refresh``: every placement, resize, preemption, completion and service end),
    for the per-service plots and the M/M/1 latencies; the run itself is the engine's, unchanged."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.service_log: list[list[tuple[float, float, float]]] = [[(0.0, 0.0, 0.0)] for _ in range(self.N - self.Jt)]

    def _refresh(self, gpus_touched, t: float) -> None:
        super()._refresh(gpus_touched, t)
        for i, log in enumerate(self.service_log):
            j = self.Jt + i
            cur = (float(t), float(self.share[j]), float(self.slo_cap[j]))
            if log[-1][1:] != cur[1:]:
                if log[-1][0] == cur[0]:
                    log[-1] = cur
                else:
                    log.append(cur)


def mm1_quantile(q: float, weights: np.ndarray, rates: np.ndarray) -> float:
    """Quantile ``q`` of a mixture of exponentials (M/M/1 sojourn times: ``rates`` per second, weighted by
    ``weights``, the arrivals at each); a rate <= 0 is an overloaded queue (unbounded latency). Seconds; inf when
    more than ``1 - q`` of the weight is unbounded, NaN without weight."""
    w, r = np.asarray(weights, float), np.asarray(rates, float)
    tot = w.sum()
    if not tot > 0:
        return math.nan
    fin = r > 0
    if w[~fin].sum() / tot > 1 - q + 1e-12:
        return math.inf
    wf, rf = w[fin] / tot, r[fin]
    lo, hi = 0.0, float(-math.log(max(1e-12, 1 - q)) / rf.min()) * 2 + 1e-9
    for _ in range(80):  # bisection on the mixture's CDF
        mid = (lo + hi) / 2
        if float((wf * (1 - np.exp(-rf * mid))).sum()) < q:
            lo = mid
        else:
            hi = mid
    return hi


def sim_service_windows(eng: RecordingEngine, i: int, mu_full: float, slo_factor: float, bin_s: float = BIN_S) -> dict:
    """Per-minute windows of simulated service ``i`` (the keys of :func:`devtools.service_metrics.service_windows`): demand,
    its share (lowest in the window), M/M/1 mean and p99 latency, met/violated by the engine's criterion
    (capacity - load >= the SLO margin, time-weighted), attainment and the run's M/M/1 p99."""
    inf = eng.inf
    lo, hi = float(inf.start_s[i]), float(inf.end_s[i])
    demand = inf.demand(i)
    P = len(demand)
    margin = 1.0 / slo_factor
    log = eng.service_log[i]
    times = np.array([x[0] for x in log])
    nb = max(1, math.ceil((hi - lo) / bin_s - 1e-9))
    edges = lo + bin_s * np.arange(nb + 1)
    share = np.zeros(nb)
    cap_min = np.zeros(nb)  # lowest capacity in the window, fraction of a full GPU's rate
    mean_ms = np.full(nb, np.nan)
    p99 = np.full(nb, np.nan)
    ok_s = np.zeros(nb)
    seg_w, seg_r = [], []
    for b in range(nb):
        a, e = edges[b], min(edges[b + 1], hi)
        load = float(demand[(int(inf.phase_bin[i]) + math.floor(a / BIN_S)) % P])
        cuts = np.concatenate([[a], times[(times > a) & (times < e)], [e]])
        ws, rs, shares, caps = [], [], [], []
        for c0, c1 in zip(cuts[:-1], cuts[1:], strict=True):
            k = int(np.searchsorted(times, c0, side="right")) - 1
            _, sh, cap = log[max(k, 0)]
            shares.append(sh)
            caps.append(cap)
            ok_s[b] += (c1 - c0) * (cap - load >= margin - 1e-12)
            ws.append(load * (c1 - c0))
            rs.append(mu_full * (cap - load))
        share[b] = min(shares)
        cap_min[b] = min(caps)
        if load > 0:
            w, r = np.array(ws), np.array(rs)
            mean_ms[b] = float((w * np.where(r > 0, 1.0 / np.maximum(r, 1e-12), math.inf)).sum() / w.sum()) * 1000
            p99[b] = mm1_quantile(0.99, w, r) * 1000
        seg_w += ws
        seg_r += rs
    width = np.minimum(edges[1:], hi) - edges[:-1]
    life = float(width.sum())
    ok_total = float(ok_s.sum())
    rates = np.array([float(demand[(int(inf.phase_bin[i]) + math.floor(a / BIN_S)) % P]) for a in edges[:-1]]) * mu_full
    w_all = np.array(seg_w)
    with np.errstate(divide="ignore"):
        lat = np.where(np.array(seg_r) > 0, 1.0 / np.maximum(np.array(seg_r), 1e-12), math.inf)
    return {"t_s": edges[:-1], "arrivals_rps": rates, "served_rps": rates, "share_pct": share, "capacity": cap_min,
            "mean_ms": mean_ms,
            "p99_ms": p99, "ok": ok_s >= width - 1e-9, "lifetime_s": life, "ok_s": ok_total,
            "slo_attainment": ok_total / life if life > 0 else math.nan, "slo_ms": slo_factor * 1000 / mu_full,
            "p99_run_ms": mm1_quantile(0.99, w_all, np.array(seg_r)) * 1000,
            "mean_run_ms": float((w_all * lat).sum() / w_all.sum() * 1000) if w_all.sum() > 0 else math.nan,
            "requests": float((rates * width).sum()), "undelivered": 0, "first_up_s": 0.0}


def run_sim(w, policies: list[str], cfg, policy_options: dict, mu_full: float):
    """Each policy on the workload with :class:`RecordingEngine`; returns [(SimResult, summary, [service windows])]."""
    from services.allocator.policy import make_policy, options_for
    from simulator.metrics import summarise

    out = []
    for name in policies:
        opts = options_for(name, dict(slo_factor=cfg.slo_factor, **policy_options))
        eng = RecordingEngine(make_policy(name, w.estimate, w.truth.kappa, **opts), w.types, w.truth, w.train, w.inf, cfg)
        r = eng.run()
        svc = [sim_service_windows(eng, i, mu_full, cfg.slo_factor) for i in range(len(w.inf.start_s))] if w.inf else []
        out.append((r, summarise(r), svc))
    return out


# --- live side -----------------------------------------------------------------------------------------
def _suite_env(policy: str, scale: float, gpus_per_node: int, run_dir: Path, forecast_window_s: float) -> dict[str, str]:
    return {
        "ELASTICO_RUN_DIR": str(run_dir), "ELASTICO_POLICY": policy, "ELASTICO_ESTIMATOR": "rule",
        "ELASTICO_TIME_SCALE": repr(scale), "ELASTICO_SIM_TIME_SCALE": repr(scale),
        "ELASTICO_ROUND_INTERVAL_S": repr(max(0.05, 300.0 / scale)),  # the simulator's 300 s periodic rounds
        "ELASTICO_REPORT_POLL_S": "0.1", "ELASTICO_RECONCILE_INTERVAL_S": "0.2", "ELASTICO_HEARTBEAT_INTERVAL_S": "0.5",
        "ELASTICO_SIM_GPU_COUNT": str(gpus_per_node), "ELASTICO_STOP_GRACE_S": "2", "ELASTICO_LOG_FORMAT": "json",
        "ELASTICO_OBSERVATION_INTERVAL_S": "1000000",
        # one demand window per minute of model time, forecast over the simulator's window
        "ELASTICO_SCRAPE_INTERVAL_S": repr(max(0.1, BIN_S / scale)),
        "ELASTICO_FORECAST_WINDOW_S": repr(forecast_window_s),
    }


def run_live(policy: str, jobs, services, nodes: int, gpus_per_node: int, scale: float, timeout_s: float,
             run_root: Path, forecast_window_s: float, seed: int = 0):
    """One live replay of ``jobs`` and ``services`` under ``policy``; returns (Observed, summary, [service windows])."""
    from devtools.replay import Replay, live_result
    from devtools.service_metrics import service_windows
    from simulator.metrics import summarise

    env = _suite_env(policy, scale, gpus_per_node, run_root / policy, forecast_window_s)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        print(f"\n== live: {policy} on {nodes} nodes x {gpus_per_node} simulated GPUs, time x{scale:g}")
        state = cluster.up(nodes)
        try:
            alloc = next(p["address"] for p in state["procs"] if p["name"] == "allocator")
            agents = [p["address"] for p in state["procs"] if p["name"].startswith("node-")]
            obs = Replay(alloc, agents, jobs, scale, f"demo-{policy}-{uuid.uuid4().hex[:6]}",
                         tls=cluster.client_tls(state), services=services, history_s=forecast_window_s,
                         gateway_reports=True, seed=seed).run(timeout_s)
        finally:
            cluster.down(quiet=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if obs.violations:
        print(f"  INVARIANT VIOLATIONS ({len(obs.violations)}):")
        for v in obs.violations[:10]:
            print(f"    {v}")
    else:
        print(f"  invariants held on every sample ({len(obs.samples)} samples: no GPU above 100 % share or its memory, "
              f"no job running twice, every retried submit returned the same job, none lost)")
    svc = [service_windows(s, obs.services[s.index], scale) for s in services if s.index in obs.services]
    for s in services:
        so = obs.services[s.index]
        ld = so.load
        print(f"  service {s.name}: {ld.generated if ld else 0} requests sent ({ld.undelivered if ld else 0} undelivered), "
              f"serving {-so.first_up:.1f} s wall before the slice, {len(so.samples)} samples, "
              f"{so.scrape_errors} failed scrapes, {so.history_reports} + {so.gateway_reports} gateway demand reports")
    s = summarise(live_result(policy, jobs, obs, scale, nodes * gpus_per_node, services))
    s["policy"] = f"{policy} (live)"
    return obs, s, svc


# --- report --------------------------------------------------------------------------------------------
def _rel(a: float, b: float) -> float:
    return (a - b) / b if b else math.nan


def _x(a: dict, b: dict, key: str) -> str:
    """``a[key] / b[key]`` as a ratio, n/a where ``b[key]`` is 0."""
    return f"{a[key] / b[key]:.2f}x" if b[key] else "n/a"


def _ms(x: float) -> str:
    return "inf" if math.isinf(x) else ("n/a" if math.isnan(x) else f"{x:.0f}")


def targets(policies: list[str], sims: list[dict], lives: list[dict] | None, svc_sim: list[list[dict]],
            svc_live: list[list[dict]] | None) -> list[tuple[str, bool]]:
    """The issue's targets, each (statement with the measured numbers, met?), computed from the results
    (without live runs: the simulated ones only)."""
    out = []
    both = [("live", lives, svc_live), ("sim", sims, svc_sim)] if lives is not None else [("sim", sims, svc_sim)]
    if len(policies) >= 2:
        e, f = 0, 1
        for src, rs, _ in both:
            out.append((f"{src}: {policies[e]} avg JCT < {policies[f]}'s ({rs[e]['avg_jct_h']:.2f} vs {rs[f]['avg_jct_h']:.2f} h)",
                        rs[e]["avg_jct_h"] < rs[f]["avg_jct_h"]))
            out.append((f"{src}: {policies[e]} work/h > {policies[f]}'s ({rs[e]['work_gpu_h_per_h']:.2f} vs "
                         f"{rs[f]['work_gpu_h_per_h']:.2f})", rs[e]["work_gpu_h_per_h"] > rs[f]["work_gpu_h_per_h"]))
            out.append((f"{src}: {policies[e]} effective utilisation > {policies[f]}'s ({rs[e]['eff_util']:.1%} vs "
                        f"{rs[f]['eff_util']:.1%})", rs[e]["eff_util"] > rs[f]["eff_util"]))
    for k, p in enumerate(policies):
        for src, _, svcs in both:
            worst = min((sw["slo_attainment"] for sw in svcs[k]), default=math.nan)
            out.append((f"{src}: {p} SLO attainment >= {TARGET_SLO:.0%} for every service (lowest {worst:.4f})",
                        bool(worst >= TARGET_SLO)))
        if lives is None:
            continue
        for key, name in (("avg_jct_h", "avg JCT"), ("work_gpu_h_per_h", "work/h")):
            d = _rel(lives[k][key], sims[k][key])
            out.append((f"{p}: live vs simulated {name} within {TARGET_GAP:.0%} ({d:+.1%})", bool(abs(d) <= TARGET_GAP)))
    return out


def print_report(policies, sims, lives, svc_defs, svc_sim, svc_live) -> list[tuple[str, bool]]:
    """Print the comparison (``lives``/``svc_live`` None: simulated rows only); returns :func:`targets`."""
    from simulator.report import table

    rows = [r for pair in zip(sims, lives, strict=True) for r in pair] if lives is not None else sims
    print("\n== results (the simulator's metrics table; live rows measured through the API and the services' metrics)")
    print(table(rows))
    if lives is not None:
        _print_differences(sims, lives)
    if len(policies) >= 2:
        print(f"\n== {policies[0]} / {policies[1]}")
        for src, rs in (("sim", sims), ("live", lives)):
            if rs is None:
                continue
            a, b = rs[0], rs[1]
            print(f"  {src:<4}  avg JCT {_x(a, b, 'avg_jct_h')}   work/h {_x(a, b, 'work_gpu_h_per_h')}   effective "
                  f"utilisation {_x(a, b, 'eff_util')}   allocated {_x(a, b, 'alloc_util')}")
    print("\n== inference services (SLO: mean latency per minute within the SLO; p99 over the run, model time; "
          "sim p99 = M/M/1)")
    print(f"{'service':<22} {'policy':<16} {'SLO ms':>7} {'live SLO':>9} {'sim SLO':>8} {'live p99':>9} {'sim p99':>8} "
          f"{'live mean':>9} {'sim mean':>8} {'live share':>10} {'sim share':>9} {'requests':>9}")
    nan = {"slo_attainment": math.nan, "p99_run_ms": math.nan, "mean_run_ms": math.nan, "share_pct": np.array([np.nan]),
           "requests": math.nan}
    for i, d in enumerate(svc_defs):
        for k, p in enumerate(policies):
            lv, sm = (svc_live[k][i] if svc_live is not None else nan), svc_sim[k][i]
            print(f"{f'{i}:{d.key} peak {d.peak_load:g}':<22} {p:<16} {sm['slo_ms']:>7.0f} "
                  f"{lv['slo_attainment']:>9.4f} {sm['slo_attainment']:>8.4f} {_ms(lv['p99_run_ms']):>9} "
                  f"{_ms(sm['p99_run_ms']):>8} {_ms(lv['mean_run_ms']):>9} {_ms(sm['mean_run_ms']):>8} "
                  f"{np.nanmean(lv['share_pct']) if np.isfinite(lv['share_pct']).any() else math.nan:>9.0f}% "
                  f"{np.nanmean(sm['share_pct']):>8.0f}% {lv['requests']:>9.0f}")
    res = targets(policies, sims, lives, svc_sim, svc_live)
    print("\n== targets (issue #22)")
    for text, ok in res:
        print(f"  [{'PASS' if ok else 'MISS'}] {text}")
    return res


def _print_differences(sims: list[dict], lives: list[dict]) -> None:
    print("\n== live - simulated")
    keys = ("avg_jct_h", "p95_jct_h", "makespan_h", "work_gpu_h_per_h", "avg_queue_h", "alloc_util", "eff_util",
            "slo_attainment")
    print(f"{'policy':<18} " + " ".join(f"{k:>16}" for k in keys))
    for sim, lv in zip(sims, lives, strict=True):
        cells = []
        for k in keys:
            d = lv[k] - sim[k]
            if "util" in k or k == "slo_attainment":
                cells.append(f"{d * 100:+7.1f} pp      ")
            else:
                cells.append(f"{d:+8.2f} ({_rel(lv[k], sim[k]):+5.0%})")
        print(f"{sim['policy'].replace(' (sim)', ''):<18} " + " ".join(f"{c:>16}" for c in cells))


def write_plots(out_dir: Path, policies, sim_results, live_timelines, window_end_s, svc_defs, svc_sim, svc_live) -> list[Path]:

    """``util_over_time.png`` and one ``service_<i>_<profile>.png`` per service under ``out_dir`` (live curves only
    when there were live runs: ``live_timelines`` empty, ``svc_live`` None)."""
    from devtools import demo_plots

    paths = [demo_plots.util_over_time(out_dir / "util_over_time.png", dict(zip(policies, live_timelines, strict=False)),
                                       {p: r.timeline for p, r in zip(policies, sim_results, strict=True)}, window_end_s)]
    for i, d in enumerate(svc_defs):
        name = f"{i}_{d.key}"
        paths.append(demo_plots.service_plot(
            out_dir / f"service_{name}.png", f"{name} (peak load {d.peak_load:g}, phase {d.phase_bin} min)",
            svc_sim[0][i]["slo_ms"], {p: svc_live[k][i] for k, p in enumerate(policies)} if svc_live is not None else {},
            {p: svc_sim[k][i] for k, p in enumerate(policies)}))
    return paths


def write_summary(path: Path, policies, sims, lives, svc_defs, svc_sim, svc_live, res) -> Path:
    """Every printed number, and each service's per-minute windows, as JSON (NaN/inf as null)."""
    import json

    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        if isinstance(x, np.ndarray):
            return clean(x.tolist())
        if isinstance(x, np.generic):
            x = x.item()
        return None if isinstance(x, float) and not math.isfinite(x) else x

    doc = {"policies": policies, "sim": sims, "live": lives,
           "services": [{"profile": d.profile, "peak_load": d.peak_load, "phase_bin": d.phase_bin, "step": d.step,
                         "sim": {p: svc_sim[k][i] for k, p in enumerate(policies)},
                         "live": {p: svc_live[k][i] for k, p in enumerate(policies)} if svc_live is not None else None}
                        for i, d in enumerate(svc_defs)],
           "targets": [{"target": t, "met": ok} for t, ok in res]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean(doc), indent=1))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=ranged(1, cast=int), default=2)
    ap.add_argument("--gpus-per-node", type=ranged(1, cast=int), default=4)
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--window", type=float, nargs=2, default=DEFAULT_WINDOW, metavar=("START_S", "END_S"),
                    help="trace arrival window, seconds of the original trace")
    ap.add_argument("--jobs", type=ranged(1, cast=int), default=DEFAULT_JOBS)
    ap.add_argument("--services", default=DEFAULT_SERVICES,
                    help="inference services, profile:peak_load:phase_bin,... (profiles: code, conv)")
    ap.add_argument("--mu-full", type=ranged(0.0, lo_open=True), default=MU_FULL, help="requests per model second of one whole GPU")
    ap.add_argument("--time-scale", type=ranged(0.0, lo_open=True), default=200.0, help="trace seconds per wall second")
    ap.add_argument("--policies", default="elastico,exclusive-fifo")
    ap.add_argument("--timeout-s", type=ranged(0.0, lo_open=True), default=90.0, help="per live run, wall seconds")
    ap.add_argument("--sim-only", action="store_true", help="skip the live runs (simulator rows only)")
    ap.add_argument("--out", default=str(OUT_DIR), help="directory of the plots")
    ap.add_argument("--seed", type=int, default=0, help="seeds the services' arrivals")
    a = ap.parse_args(argv)
    from devtools.replay import service_jobs, trace_jobs
    from services.allocator.settings import AllocatorSettings
    from simulator.engine import SimConfig
    from simulator.run import build_workload

    t_start = time.time()
    settings = AllocatorSettings()
    live_opts = settings.policy_options()  # the live allocator's, so both rows run the same policy
    slo_factor = float(live_opts.get("slo_factor", 10.0))
    try:
        svc_defs = parse_services(a.services, slo_factor)
    except ValueError as exc:
        ap.error(str(exc))
    gpus = a.nodes * a.gpus_per_node
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    try:
        w = build_workload(a.trace, gpus, window=tuple(a.window), max_jobs=a.jobs, estimator="rule")
    except (TraceError, OSError) as exc:
        ap.error(str(exc))
    end_s = float(w.train.arrival_s.max())
    if end_s <= 0:
        ap.error(f"the {len(w.train.arrival_s)} training jobs of --window {a.window[0]:g} {a.window[1]:g} all arrive at "
                 f"once: no loaded period to measure work/h or utilisation in; widen --window")
    w.inf = build_services(svc_defs, end_s)
    cfg = SimConfig(gpus=gpus, node_gpus=a.gpus_per_node, round_interval_s=300.0, slo_factor=slo_factor,
                    forecast_window_s=float(getattr(settings, "forecast_window_s", 3600.0)))
    # the whole share menu, as the simulator's policy sees it (the policy keeps its floors)
    jobs = trace_jobs(w, train_floor=live_opts["train_floor"], min_speed=_slack_floor())
    services = service_jobs(w.inf, mu_full=a.mu_full, slo_factor=slo_factor,
                            shares_pct=_inference_shares(), mem_mib=SERVICE_MEM_MIB, forecast_window_s=cfg.forecast_window_s)
    print(f"== slice: {len(jobs)} Philly jobs ({a.trace}, arrivals [{a.window[0]:.0f}, {a.window[1]:.0f}) s, "
          f"{end_s / 3600:.2f} h), gang sizes {dict(zip(*np.unique(w.train.num_gpus, return_counts=True)))}, "
          f"offered load {w.train.offered_load:.2f} on {gpus} GPUs; estimate: {w.estimator_name}")
    for s, d in zip(services, svc_defs, strict=True):
        print(f"   service {s.index}:{s.name}: peak load {d.peak_load:g} ({d.peak_load * a.mu_full:.2f} req/s), mean "
              f"{s.rates_rps.mean():.2f} req/s, phase {d.phase_bin} min, SLO {s.slo_ms:.0f} ms, mu_full "
              f"{a.mu_full:g} req/s, declared demand {s.spec.inference.demand_rps:.2f} req/s, alive [0, {end_s / 3600:.2f} h)")
    print("== simulator: same jobs and services, same policies, same estimate (in-process)")
    # the trace jobs declare shapes at their requested GPU count only, so live no job changes its count (the live
    # policy grows or shrinks a gang only to counts it declares) and a declared share is a compute limit wherever it
    # runs; the simulated jobs get the same constraints
    sim_opts = {**live_opts, "elastic_gpus": False, "unlimited_training": False}
    print("   every job runs at its requested GPU count on both sides (its declared shapes): no GPU-count shapes, and "
          "every training share a compute limit")
    sim = run_sim(w, policies, cfg, sim_opts, a.mu_full)
    sims = [s for _, s, _ in sim]
    for s in sims:
        s["policy"] = f"{s['policy']} (sim)"
    svc_sim = [v for _, _, v in sim]
    run_root = Path(os.environ.get("ELASTICO_RUN_DIR", ".run")).resolve() / "demo"
    lives: list[dict] | None = None
    svc_live: list[list[dict]] | None = None
    timelines: list[np.ndarray] = []
    if not a.sim_only:
        lives, svc_live = [], []
        for p in policies:
            obs, s, sv = run_live(p, jobs, services, a.nodes, a.gpus_per_node, a.time_scale, a.timeout_s, run_root,
                                  cfg.forecast_window_s, a.seed)
            lives.append(s)
            svc_live.append(sv)
            t_first = min(obs.submitted.values()) if obs.submitted else 0.0
            timelines.append(np.array([((t - t_first) * a.time_scale, x, y) for t, x, y in obs.samples])
                             if obs.samples else np.zeros((0, 3)))
    res = print_report(policies, sims, lives, svc_defs, svc_sim, svc_live)
    out = Path(a.out)
    paths = write_plots(out, policies, [r for r, _, _ in sim], timelines, end_s, svc_defs, svc_sim, svc_live)
    paths.append(write_summary(out / "summary.json", policies, sims, lives, svc_defs, svc_sim, svc_live, res))
    print(f"\n== plots and numbers in {out.resolve()}/: " + ", ".join(p.name for p in paths))
    missed = sum(1 for _, ok in res if not ok)
    print(f"== demo finished in {time.time() - t_start:.0f} s; {len(res) - missed}/{len(res)} targets met")
    return 0


def _slack_floor() -> float:
    """The lowest speed any ElastiCo placement keeps (its ``slack_floor`` default: a job in a service's slack)."""
    from services.allocator.policy.elastico.params import ElastiCoParams

    return float(ElastiCoParams().slack_floor)


def _inference_shares() -> tuple[int, ...]:
    """The shares the ElastiCo policy sizes services in (its ``inference_shares_pct`` default)."""
    from services.allocator.policy.elastico.params import ElastiCoParams

    return tuple(ElastiCoParams().inference_shares_pct)


if __name__ == "__main__":
    sys.exit(main())
