"""Headline benchmark: all policies on the same jobs, 64 and 512 GPUs, over a sweep of offered loads.

``python -m bench.headline`` prints, per cluster size and load, the metrics table of every policy, then
ElastiCo's ratios against exclusive FIFO (the paper's reference: static isolated allocation) and against
the best other baseline, with PASS/FAIL against the targets of issue 5:

* at offered load >= 1: avg JCT >= 2.94x lower and throughput >= 2.02x higher than exclusive FIFO;
  effective utilisation >= 46 %; inference SLO attainment >= 99 %. Throughput is judged in two readings,
  each with its own PASS/FAIL (:mod:`simulator.metrics`): jobs completed per hour of the loaded period,
  and normalised work (isolated GPU-hours) per hour of it -- the second cannot be moved by finishing
  short jobs first, only by doing more work with the same GPUs;
* at every load: ElastiCo's avg JCT below every other baseline's (a tie within 0.5 % is shown as TIE and
  counts as FAIL).

Workload: the first ``--jobs-64`` / ``--jobs-512`` jobs of the Philly-derived trace (same jobs for
every policy of a cell), arrivals rescaled to each training offered load, plus inference services from
the Alibaba 2025 instances with Azure LLM demand (a quarter of the cluster at peak under static
allocation; see ``simulator/traces.py``). Misses are printed as measured, never hidden.
``--smoke`` runs a tiny configuration (< 60 s) that exercises the whole path.

Information parity: the simulator hands every policy the same remaining-run-time estimates
(``JobTable.remaining_est_s``, exact isolated remaining time). EASY backfilling, Lucid and ElastiCo use
them (ElastiCo: shortest-remaining-work weighting with a waiting-age factor); FIFO, Tiresias and
MPS-equal-share ignore them by design. The run prints this line so no comparison hides it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from services.allocator.policy import POLICY_NAMES
from simulator.engine import SimConfig
from simulator.metrics import throughput_ceiling
from simulator.report import table, write_outputs
from simulator.run import build_workload, run_policies
from simulator.traces import TraceError

DATA = Path(__file__).resolve().parents[1] / "data" / "traces"
INFERENCE = [DATA / "alibaba2025_dlrm_inference_gpu_instances.csv", DATA / "azure2023_llm_inference_code.csv",
             DATA / "azure2023_llm_inference_conv.csv", DATA / "alibaba2023_openb_pod_list_default.csv"]

TARGET_JCT = 2.94
TARGET_TPUT = 2.02
TARGET_EFF = 0.46
TARGET_SLO = 0.99
TARGET_FULL_TRACE_S = 120.0


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def evaluate(sums: list[dict], load: float, ceiling: dict | None = None) -> tuple[list[str], bool]:
    """Ratio lines and PASS/FAIL for one (size, load) cell; ``ceiling`` (:func:`throughput_ceiling`) adds,
    to each throughput reading, the ratio no policy can exceed on the cell's workload."""
    by = {s["policy"]: s for s in sums}
    e, f = by["elastico"], by["exclusive-fifo"]
    others = [s for s in sums if s["policy"] != "elastico"]
    best = min(others, key=lambda s: s["avg_jct_h"])
    jct_x = f["avg_jct_h"] / e["avg_jct_h"]
    tput_x = e["work_gpu_h_per_h"] / f["work_gpu_h_per_h"]
    jobs_x = e["jobs_per_h_loaded"] / max(f["jobs_per_h_loaded"], 1e-12)
    jct_best = best["avg_jct_h"] / e["avg_jct_h"]
    lines, ok = [], True
    sat = load >= 1.0
    cap_jobs = cap_work = cap_jct = float("inf")
    if ceiling is not None:
        cap_jobs = ceiling["jobs_per_h_loaded"] / max(f["jobs_per_h_loaded"], 1e-12)
        cap_work = ceiling["work_gpu_h_per_h"] / max(f["work_gpu_h_per_h"], 1e-12)
        cap_jct = f["avg_jct_h"] / max(ceiling["avg_jct_floor_h"], 1e-12)
        lines.append(f"  throughput ceiling of this workload (every job alone from its arrival on its fastest gang): "
                     f"{ceiling['jobs_per_h_loaded']:.3f} jobs/h = {cap_jobs:.2f}x fifo, "
                     f"{ceiling['work_gpu_h_per_h']:.1f} work/h = {cap_work:.2f}x fifo; avg JCT floor "
                     f"{ceiling['avg_jct_floor_h']:.2f} h = at most {cap_jct:.2f}x lower than fifo")
    lines.append(f"  vs exclusive-fifo: JCT {jct_x:.2f}x lower, throughput {jobs_x:.2f}x jobs/h (loaded period), "
                 f"{tput_x:.2f}x normalised work/h, effective util "
                 f"{f['eff_util']:.1%} -> {e['eff_util']:.1%}, SLO {e['slo_attainment']:.4f} (fifo {f['slo_attainment']:.4f})")
    if sat:
        def above(cap: float, target: float = TARGET_TPUT) -> str:
            return f" [target above this workload's ceiling {cap:.2f}x: no policy can meet it]" if cap < target else ""

        # measured values to three decimals: a ratio that rounds to the target still says which side it is on
        checks = [(f"JCT >= {TARGET_JCT}x: {jct_x:.3f}x{above(cap_jct, TARGET_JCT)}", jct_x >= TARGET_JCT),
                  (f"throughput >= {TARGET_TPUT}x (jobs/h, loaded period): {jobs_x:.3f}x{above(cap_jobs)}",
                   jobs_x >= TARGET_TPUT),
                  (f"throughput >= {TARGET_TPUT}x (normalised work/h): {tput_x:.3f}x{above(cap_work)}",
                   tput_x >= TARGET_TPUT),
                  (f"effective util >= {TARGET_EFF:.0%}: {e['eff_util']:.1%}", e["eff_util"] >= TARGET_EFF)]
    else:
        checks = []
    slo = e["slo_attainment"]
    if slo == slo:  # not NaN (training-only runs have no SLO)
        checks.append((f"SLO >= {TARGET_SLO:.0%}: {slo:.4f}", slo >= TARGET_SLO))
    tie = abs(jct_best - 1.0) < 0.005
    checks.append((f"beats best baseline ({best['policy']}: {best['avg_jct_h']:.2f} h) on avg JCT, {jct_best:.2f}x",
                   jct_best > 1.005))
    for name, good in checks:
        lines.append(f"  {('TIE ' if tie and 'beats' in name else '') + verdict(good):<8} {name}")
        ok &= good
    return lines, ok


def _speed_run(trace: str, inf: list[str] | None, seed: int, estimator: str, pairs: str | None) -> dict:
    w = build_workload(trace, 512, inf, seed, None, None, None, estimator=estimator, pairs=pairs)
    (r,), _ = run_policies(w, ["elastico"], SimConfig(gpus=512, progress=True))
    return {"wall_s": r.wall_s, "cpu_s": r.cpu_s, "rounds": r.rounds, "jobs": len(w.train.arrival_s),
            "load": w.train.offered_load, "unfinished": int(np.isnan(r.completion_s).sum())}


def full_trace_speed(trace: str, inf: list[str] | None, seed: int, estimator: str, pairs: str | None = None) -> dict:
    """Simulate ElastiCo on the whole trace at 512 GPUs in a fresh (spawned) interpreter, so the dozens of
    runs before it -- their heaps, plots -- do not weigh on the timing; returns its wall/CPU seconds."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_speed_run, trace, inf, seed, estimator, pairs).result()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.headline", description=__doc__)
    ap.add_argument("--trace", default=str(DATA / "gavel_philly_vc_traces_seed0.csv"))
    ap.add_argument("--pairs", default=None, metavar="CSV",
                    help="measured pairs used as ground truth (coloc_gavel_pairs.csv schema; default: data/'s)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--loads", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0])
    ap.add_argument("--jobs-64", type=int, default=400)
    ap.add_argument("--jobs-512", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-inference", action="store_true")
    ap.add_argument("--estimator", choices=["auto", "predictor", "rule"], default="auto")
    ap.add_argument("--out", default="out/headline")
    ap.add_argument("--smoke", action="store_true", help="tiny run (< 60 s) exercising the whole path")
    ap.add_argument("--skip-speed", action="store_true",
                    help=f"skip the speed target (ElastiCo on the whole trace at 512 GPUs in <= {TARGET_FULL_TRACE_S:.0f} s)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.sizes, a.loads, a.jobs_64 = [16], [0.5, 2.0], 40
    inf = None if a.no_inference else [str(p) for p in INFERENCE if p.exists()]
    t0 = time.perf_counter()
    print("information parity: exclusive-backfill, lucid and elastico receive the same (exact) remaining-run-time "
          "estimates; exclusive-fifo, tiresias and mps-equal-share do not use them", flush=True)
    all_ok, report = True, {}
    for G in a.sizes:
        n = a.jobs_64 if G <= 64 else a.jobs_512
        for load in a.loads:
            try:
                w = build_workload(a.trace, G, inf, a.seed, load, None, n, estimator=a.estimator, pairs=a.pairs)
            except (TraceError, OSError) as exc:
                ap.error(str(exc))
            ninf = 0 if w.inf is None else len(w.inf.start_s)
            print(f"\n== {G} GPUs, {len(w.train.arrival_s)} training jobs, offered training load "
                  f"{w.train.offered_load:.2f} (native {w.train.native_offered_load:.2f}), {ninf} inference "
                  f"services (static peak {0 if not ninf else 0.25:.2f} of GPUs), estimate: {w.estimator_name}; ground "
                  f"truth: {w.truth.measured_pairs} measured pairs", flush=True)
            cfg = SimConfig(gpus=G)
            results, sums = run_policies(w, list(POLICY_NAMES), cfg)
            print(table(sums))
            ceiling = throughput_ceiling(w.train, w.types, results[0].window_end_s, G)
            lines, ok = evaluate(sums, load, ceiling)
            print("\n".join(lines), flush=True)
            all_ok &= ok
            write_outputs(Path(a.out) / f"g{G}_load{load}", sums, results,
                          {"gpus": G, "load": load, "offered_load": w.train.offered_load})
            report[f"{G}@{load}"] = {"summaries": sums, "ok": ok, "lines": lines, "throughput_ceiling": ceiling}
    if not (a.smoke or a.skip_speed):
        speed = full_trace_speed(a.trace, inf, a.seed, a.estimator, a.pairs)
        ok = speed["wall_s"] <= TARGET_FULL_TRACE_S
        all_ok &= ok
        print(f"\n== speed: elastico, whole trace ({speed['jobs']} training jobs, native load {speed['load']:.2f}), "
              f"512 GPUs, fresh process: {speed['wall_s']:.1f} s wall, {speed['cpu_s']:.1f} s CPU, {speed['rounds']} rounds\n"
              f"  {verdict(ok):<8} whole trace at 512 GPUs <= {TARGET_FULL_TRACE_S:.0f} s", flush=True)
        report["speed"] = {**speed, "ok": ok}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "headline.json").write_text(json.dumps(report, indent=2, default=float))
    print(f"\nOVERALL: {'PASS' if all_ok else 'FAIL (see the FAIL lines above; figures are as measured)'}  "
          f"[{time.perf_counter() - t0:.0f} s]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
