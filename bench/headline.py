"""Headline benchmark: every policy on the same jobs, 64 and 512 GPUs in nodes of 8, over inference shares
and offered loads, with the leader of every metric, the workload's ceiling, ablations and PASS/FAIL.

Workload of a cell (size, inference share F, load): the first ``--jobs-64`` / ``--jobs-512`` jobs of the
Philly-derived trace, arrivals rescaled so the training offered load, counted against the GPUs static
allocation leaves to training, is ``load``; inference services from the Alibaba 2025 instances, drawn
until they hold F of the GPUs at peak under static allocation, with Azure LLM demand and Alibaba 2023
latency-sensitive pod sizes (``simulator/traces.py``; ``--inference-trace`` runs another mix). The headline
share is the trace's own: the share of requested GPU-time latency-sensitive pods hold in the Alibaba 2023
``openb`` pod list, computed here from the file (``--shares`` overrides it). It runs at every load of
``--loads``; the other shares of the sweep (``--extra-shares``) at the loads of ``--extra-loads`` only (fewer
points, to fit the run time).

The policies run with the live allocator's configuration (``services/allocator/settings.py`` defaults,
printed): what is measured is what ``make up`` runs.

Per loaded cell (load >= 1), with PASS/FAIL:

* leadership: ElastiCo at least as good as every baseline that keeps inference SLO attainment >= 99 % on
  avg JCT, jobs/h of the loaded period, normalised work/h and effective utilisation (a tie within 0.5 %
  counts as met); the best other policy of each metric is printed with ElastiCo's ratio to it and to the
  workload's ceiling (``simulator.metrics.throughput_ceiling``: demand bounds, loose above load 1);
* avg JCT >= 3x lower than exclusive FIFO (the floor says when no policy can), SLO >= 99 %;
* at the headline share: work/h closing at least half of the gap from exclusive FIFO to the ceiling, and
  effective utilisation >= 1.25x exclusive FIFO's (the ceiling says when no policy can).

Ablations of ElastiCo run beside it in the headline-share cells: without MPS shapes (whole GPUs only), with
every training share a compute limit (``unlimited_training`` off: no unlimited training pairs),
without shadow prices (each job its best shape, greedy by utility), and with the utilisation rule instead
of the predictor as its interference estimate; and the objective knob (``work_weight``,
``ELASTICO_WORK_WEIGHT``) at its JCT end (0: shortest remaining GPU-work first) and at its work end (1: jobs
weighed by their requested GPUs), beside the default, halfway (0.5). The whole trace at 512 GPUs (the default inference share,
native load) runs last, alone, for the speed target. Misses are printed as measured, never hidden.

Information parity: the simulator hands every policy the same remaining-run-time estimates (exact
isolated remaining time). EASY backfilling, Lucid and ElastiCo use them; FIFO, Tiresias and
MPS-equal-share ignore them by design.

Output: ``headline.json``, ``headline.md`` and ``report.html`` (the summary table, every cell's table, checks
and plots, the configuration) in ``--out``, and per cell a folder with its JSON, PNGs and own ``report.html``.
Where Chromium is installed, the report is rendered headless and checked non-blank (``bench.render_report``;
not in ``--smoke``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from elastico.argtypes import ranged
from services.allocator.policy import POLICY_NAMES, RuleEstimator
from services.allocator.settings import AllocatorSettings
from simulator.engine import SimConfig
from simulator.metrics import throughput_ceiling
from simulator.report import Section, markdown_table, table, write_html, write_outputs, write_work_plot
from simulator.run import build_workload, run_policies
from simulator.traces import TraceError, load_inference, ls_gpu_share

DATA = Path(__file__).resolve().parents[1] / "data" / "traces"
PODS = DATA / "alibaba2023_openb_pod_list_default.csv"
INFERENCE = [DATA / "alibaba2025_dlrm_inference_gpu_instances.csv", DATA / "azure2023_llm_inference_code.csv",
             DATA / "azure2023_llm_inference_conv.csv", PODS]

TARGET_JCT = 3.0
TARGET_SLO = 0.99
TARGET_GAP = 0.5  # share of the FIFO -> ceiling work/h gap to close at the headline share
TARGET_EFF = 1.25  # effective utilisation vs exclusive FIFO at the headline share
TIE = 0.005
TARGET_FULL_TRACE_S = 120.0

#: metric, label, True when higher is better
METRICS = (("avg_jct_h", "avg JCT", False), ("jobs_per_h_loaded", "jobs/h", True),
           ("work_gpu_h_per_h", "work/h", True), ("eff_util", "eff util", True))

#: ElastiCo ablations: label, policy options, estimate ("rule" = the utilisation rule instead of the predictor)
ABLATIONS = (("elastico/no-mps-shapes", {"shares_pct": (100,)}, None),
             ("elastico/limits-everywhere", {"unlimited_training": False}, None),
             ("elastico/no-prices", {"pricing": False}, None),
             ("elastico/rule-estimate", {}, "rule"))
#: the objective knob (ELASTICO_WORK_WEIGHT) at its two ends; the default (0.5) is halfway
KNOB_ENDS = (("elastico/jct-end", {"work_weight": 0.0}, None), ("elastico/work-end", {"work_weight": 1.0}, None))
VARIANTS = ABLATIONS + KNOB_ENDS


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def run_part(spec: dict, common: dict, variant: int | None) -> dict:
    """One task of a cell, picklable: every policy (``variant`` None, with the cell's ceiling and heading) or
    ElastiCo variant ``VARIANTS[variant]`` alone -- a cell's variants spread over the workers."""
    w = build_workload(common["trace"], spec["gpus"], common["inference"], common["seed"], spec["load"], None,
                       spec["jobs"], inference_fraction=spec["share"], estimator=common["estimator"],
                       pairs=common["pairs"], redraw_seed=common["redraw_seed"])
    cfg = SimConfig(gpus=spec["gpus"], node_gpus=common["node_gpus"], max_tenants=common["max_tenants"])
    if variant is not None:
        label, opts, est = VARIANTS[variant]
        if est == "rule":
            w = dataclasses.replace(w, estimate=RuleEstimator(kappa=w.truth.kappa).pair_matrix(w.types))
        (r,), (s,) = run_policies(w, ["elastico"], cfg, {**common["options"], **opts})
        r.policy = s["policy"] = label
        return {"results": [r], "sums": [s]}
    results, sums = run_policies(w, list(POLICY_NAMES), cfg, common["options"])
    ceiling = throughput_ceiling(w.train, w.types, results[0].window_end_s, spec["gpus"], w.inf)
    ninf = 0 if w.inf is None else len(w.inf.start_s)
    head = (f"== {spec['gpus']} GPUs (nodes of {common['node_gpus']}), inference share {spec['share']:.2f}"
            f"{' (trace-derived)' if spec['main'] and common['inference'] else ''}: {ninf} services, {w.static_inference_gpus:.1f} GPUs on "
            f"average under static allocation; {len(w.train.arrival_s)} training jobs at offered load "
            f"{w.train.offered_load:.2f} on the {w.training_gpus:.1f} GPUs left to training; estimate: "
            f"{w.estimator_name}; ground truth: {w.truth.measured_pairs} measured pairs"
            + (f"; job types redrawn with seed {common['redraw_seed']}" if common["redraw_seed"] is not None else ""))
    return {**spec, "head": head, "sums": sums, "results": results, "ceiling": ceiling}


def submit_cells(pool: ProcessPoolExecutor, specs: list[dict], common: dict) -> list[list]:
    """Every cell's tasks, cell by cell (so cells finish, and print, in order): per cell, its futures in the
    order the cell's table lists them."""
    return [[pool.submit(run_part, s, common, None)]
            + [pool.submit(run_part, s, common, k) for k in range(len(VARIANTS) if s["ablations"] else 0)]
            for s in specs]


def gather_cell(futures: list) -> dict:
    """A cell's result from its tasks' (:func:`submit_cells`)."""
    cell = futures[0].result()
    for fut in futures[1:]:
        part = fut.result()
        cell["results"] += part["results"]
        cell["sums"] += part["sums"]
    return cell


def _ratio(e: float, other: float, higher: bool) -> float:
    """How many times better ``e`` is than ``other`` (> 1 = better)."""
    if higher:
        return e / other if other > 0 else float("inf")
    return other / e if e > 0 else float("inf")


def leaders(cell: dict) -> tuple[dict, list[str]]:
    """(metric -> the best baseline's summary among those keeping the SLO, the baselines that do not)."""
    baselines = [s for s in cell["sums"] if s["policy"] in POLICY_NAMES and s["policy"] != "elastico"]
    keep = [s for s in baselines if not s["slo_attainment"] < TARGET_SLO]  # NaN (no inference) keeps
    best = {key: (max if higher else min)(keep, key=lambda s, k=key: s[k]) for key, _, higher in METRICS}
    return best, [s["policy"] for s in baselines if s not in keep]


def work_target(cell: dict) -> float:
    """The work/h a headline-share cell asks of ElastiCo: exclusive FIFO's plus half its gap to the ceiling."""
    f = next(s for s in cell["sums"] if s["policy"] == "exclusive-fifo")["work_gpu_h_per_h"]
    return f + TARGET_GAP * (cell["ceiling"]["work_gpu_h_per_h"] - f)


def empty_window(cell: dict) -> None:
    """Raise TraceError when the cell's loaded period (up to its last training arrival) admits no finished job or no
    work: a ceiling of 0 leaves no jobs/h, work/h or utilisation figure or target to read off the cell."""
    c, r = cell["ceiling"], cell["results"][0]
    if min(c["jobs_per_h_loaded"], c["work_gpu_h_per_h"], c["eff_util"]) > 0:
        return
    raise TraceError(f"{cell['gpus']} GPUs, share {cell['share']:.2f}, load {cell['load']:g}: the loaded period (up to "
                     f"the last of {len(r.arrival_s)} training arrivals) is {r.window_end_s:.0f} s, too short for any "
                     f"job to finish in it (ceilings: {c['jobs_per_h_loaded']:.3f} jobs/h, {c['work_gpu_h_per_h']:.2f} "
                     f"work/h); use more jobs (--jobs-64 / --jobs-512)")


def evaluate(cell: dict) -> tuple[list[str], list[tuple[str, bool]]]:
    """Leader lines and PASS/FAIL checks of one cell."""
    by = {s["policy"]: s for s in cell["sums"]}
    e, f, c = by["elastico"], by["exclusive-fifo"], cell["ceiling"]
    lead, dropped = leaders(cell)
    lines = [f"  ceiling (every job alone from its arrival on its fastest gang): {c['jobs_per_h_loaded']:.3f} jobs/h, "
             f"{c['work_gpu_h_per_h']:.1f} work/h, effective util {c['eff_util']:.1%}, avg JCT floor "
             f"{c['avg_jct_floor_h']:.1f} h"]
    if dropped:
        lines.append(f"  not leaders (inference SLO < {TARGET_SLO:.0%}): " + ", ".join(
            f"{p} {by[p]['slo_attainment']:.4f}" for p in dropped))
    checks: list[tuple[str, bool]] = []
    loaded = cell["load"] >= 1.0
    ceil_of = {"avg_jct_h": c["avg_jct_floor_h"], "jobs_per_h_loaded": c["jobs_per_h_loaded"],
               "work_gpu_h_per_h": c["work_gpu_h_per_h"], "eff_util": c["eff_util"]}
    for key, label, higher in METRICS:
        best = lead[key]
        x = _ratio(e[key], best[key], higher)
        to_ceiling = e[key] / ceil_of[key] if higher else ceil_of[key] / e[key]
        fmt = (lambda v: f"{v:.1%}") if key == "eff_util" else (lambda v: f"{v:.3f}" if v < 1 else f"{v:.2f}")
        text = (f"{label}: elastico {fmt(e[key])} vs leader {best['policy']} {fmt(best[key])} = {x:.3f}x; "
                f"{to_ceiling:.2f} of the {'floor' if not higher else 'ceiling'} {fmt(ceil_of[key])}")
        if loaded:
            checks.append((f"leads on {text}", x >= 1.0 - TIE))
        else:
            lines.append(f"  {text}")
    if loaded:
        jct_x = f["avg_jct_h"] / e["avg_jct_h"]
        cap = f["avg_jct_h"] / c["avg_jct_floor_h"]
        checks.append((f"avg JCT >= {TARGET_JCT:.0f}x lower than exclusive-fifo: {jct_x:.2f}x"
                       + (f" [above this workload's bound {cap:.2f}x]" if cap < TARGET_JCT else ""), jct_x >= TARGET_JCT))
        if cell["main"]:
            need = work_target(cell)
            checks.append((f"work/h closes >= half the gap to the ceiling: fifo {f['work_gpu_h_per_h']:.2f}, "
                           f"elastico {e['work_gpu_h_per_h']:.2f}, ceiling {c['work_gpu_h_per_h']:.2f} (needs "
                           f"{need:.2f})", e["work_gpu_h_per_h"] >= need - 1e-9))
            need = TARGET_EFF * f["eff_util"]
            checks.append((f"effective util >= {TARGET_EFF}x exclusive-fifo: fifo {f['eff_util']:.1%}, elastico "
                           f"{e['eff_util']:.1%} = {e['eff_util'] / f['eff_util']:.2f}x, ceiling {c['eff_util']:.1%}"
                           + (" [target above the ceiling: no policy can meet it]" if c["eff_util"] < need else ""),
                           e["eff_util"] >= need - 1e-9))
    slo = e["slo_attainment"]
    if slo == slo:
        checks.append((f"inference SLO >= {TARGET_SLO:.0%}: {slo:.4f}", slo >= TARGET_SLO))
    variants = [("ablation", label) for label, _, _ in ABLATIONS] + \
        [(f"objective knob work_weight={opts['work_weight']}", label) for label, opts, _ in KNOB_ENDS]
    need = work_target(cell) if loaded and cell["main"] else None
    for kind, label in variants:
        if label in by:
            a = by[label]
            gap = "" if need is None else \
                f"; the work/h target {need:.2f} {'met' if a['work_gpu_h_per_h'] >= need - 1e-9 else 'missed'}"
            lines.append(f"  {kind} {label}: avg JCT {a['avg_jct_h']:.2f} h ({a['avg_jct_h'] / e['avg_jct_h']:.3f}x "
                         f"elastico's), work/h {a['work_gpu_h_per_h']:.2f} ({a['work_gpu_h_per_h'] / e['work_gpu_h_per_h']:.3f}x), "
                         f"effective util {a['eff_util']:.1%} ({a['eff_util'] / e['eff_util']:.3f}x){gap}")
    return lines, checks


def _speed_run(trace: str, inf: list[str] | None, seed: int, estimator: str, pairs: str | None, options: dict,
               redraw_seed: int | None = None) -> dict:
    w = build_workload(trace, 512, inf, seed, None, None, None, estimator=estimator, pairs=pairs,
                       redraw_seed=redraw_seed)
    (r,), _ = run_policies(w, ["elastico"], SimConfig(gpus=512, progress=True), options)
    return {"wall_s": r.wall_s, "cpu_s": r.cpu_s, "rounds": r.rounds, "jobs": len(w.train.arrival_s),
            "load": w.train.offered_load, "unfinished": int(np.isnan(r.completion_s).sum())}


def full_trace_speed(trace: str, inf: list[str] | None, seed: int, estimator: str, pairs: str | None,
                     options: dict, redraw_seed: int | None = None) -> dict:
    """ElastiCo on the whole trace at 512 GPUs in a fresh (spawned) interpreter, so the runs before it do not
    weigh on the timing; returns its wall/CPU seconds."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_speed_run, trace, inf, seed, estimator, pairs, options, redraw_seed).result()


def summary_rows(cells: list[dict]) -> list[str]:
    """The table of docs/results.md: one row per loaded cell."""
    rows = ["| GPUs | share | load | ElastiCo avg JCT | vs FIFO | leader avg JCT | leader jobs/h | leader work/h | "
            "leader eff util | work/h FIFO → ElastiCo [ceiling] | eff util FIFO → ElastiCo [ceiling] | SLO |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cell in cells:
        if cell["load"] < 1.0:
            continue
        by = {s["policy"]: s for s in cell["sums"]}
        e, f, c = by["elastico"], by["exclusive-fifo"], cell["ceiling"]
        best, _ = leaders(cell)
        lead = [f"{best[key]['policy']} {_ratio(e[key], best[key][key], higher):.3f}x" for key, _, higher in METRICS]
        rows.append(f"| {cell['gpus']} | {cell['share']:.2f}{'*' if cell['main'] else ''} | {cell['load']:g} | "
                    f"{e['avg_jct_h']:.1f} h | {f['avg_jct_h'] / e['avg_jct_h']:.2f}x | " + " | ".join(lead) +
                    f" | {f['work_gpu_h_per_h']:.1f} → {e['work_gpu_h_per_h']:.1f} [{c['work_gpu_h_per_h']:.1f}] | "
                    f"{f['eff_util']:.1%} → {e['eff_util']:.1%} [{c['eff_util']:.1%}] | {e['slo_attainment']:.4f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.headline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(DATA / "gavel_philly_vc_traces_seed0.csv"), help="training trace CSV")
    ap.add_argument("--pairs", default=None, metavar="CSV",
                    help="measured pairs used as ground truth (coloc_gavel_pairs.csv schema; default: data/'s)")
    ap.add_argument("--sizes", type=ranged(1, cast=int), nargs="+", default=[64, 512], help="cluster sizes (default 64 512)")
    ap.add_argument("--node-gpus", type=ranged(1, cast=int), default=8, help="GPUs per node (default 8)")
    ap.add_argument("--shares", type=ranged(0.0, 1.0, lo_open=True), nargs="+", default=None,
                    help="headline inference share(s) (default: the trace-derived one)")
    ap.add_argument("--loads", type=ranged(0.0, lo_open=True), nargs="+", default=[1.0, 2.0], help="loads at the headline share")
    ap.add_argument("--extra-shares", type=ranged(0.0, 1.0, lo_open=True), nargs="*", default=[0.25, 0.5, 0.75],
                    help="the sweep's other inference shares (default 0.25 0.5 0.75)")
    ap.add_argument("--extra-loads", type=ranged(0.0, lo_open=True), nargs="*", default=[1.0], help="loads at the other shares (default 1)")
    ap.add_argument("--jobs-64", type=ranged(1, cast=int), default=400, help="training jobs at <= 64 GPUs (default 400)")
    ap.add_argument("--jobs-512", type=ranged(1, cast=int), default=2000, help="training jobs above 64 GPUs (default 2000)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the inference services' draw and demand")
    ap.add_argument("--redraw-types", dest="redraw_seed", type=ranged(0, cast=int), default=None, metavar="SEED",
                    help="deal the trace's jobs (type, model, batch size, steps, duration) out again over its rows "
                         "with this seed (>= 0), arrivals and GPU counts kept: a job-type draw nothing was tuned on")
    mix = ap.add_mutually_exclusive_group()
    mix.add_argument("--inference-trace", nargs="+", default=None, metavar="CSV",
                     help="inference traces instead of the four of data/traces (python -m simulator's files: one "
                          "instance file, any Azure profiles and pod list); the headline share still comes from the "
                          "openb pod list unless --shares is given")
    mix.add_argument("--no-inference", action="store_true", help="training only (no shares to sweep)")
    ap.add_argument("--no-ablations", action="store_true", help="skip the ElastiCo ablations")
    ap.add_argument("--estimator", choices=["auto", "predictor", "rule"], default="auto")
    ap.add_argument("--workers", type=ranged(1, cast=int), default=2, help="cells simulated in parallel (default 2)")
    ap.add_argument("--out", default="out/headline", help="folder for JSON and plots (default out/headline)")
    ap.add_argument("--smoke", action="store_true", help="tiny run (< 60 s) exercising the whole path")
    ap.add_argument("--skip-speed", action="store_true",
                    help=f"skip the speed target (ElastiCo on the whole trace at 512 GPUs in <= {TARGET_FULL_TRACE_S:.0f} s)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    if a.inference_trace:
        missing = [p for p in a.inference_trace if not Path(p).is_file()]
        if missing:
            ap.error(f"--inference-trace: no such file: {', '.join(missing)}")
        try:  # the files' kinds, and an instance file among them, before any cell starts
            load_inference(a.inference_trace, 64, 1.0, a.seed)
        except (TraceError, OSError, KeyError, ValueError) as exc:
            ap.error(f"--inference-trace: {exc}")
    inf = None if a.no_inference else (a.inference_trace or [str(p) for p in INFERENCE if p.exists()])
    if a.shares is None and inf and PODS.exists():
        try:
            pods = ls_gpu_share(PODS)
        except (TraceError, OSError) as exc:
            ap.error(str(exc))
        main_shares = [round(pods["by_lifetime"], 2)]
        print(f"trace-derived inference share: latency-sensitive pods of {PODS.name} hold {pods['by_lifetime']:.3f} of "
              f"the requested GPU-time ({pods['by_count']:.3f} of the requested GPUs by count); headline share "
              f"{main_shares[0]:.2f}", flush=True)
    else:
        main_shares = [0.0] if a.no_inference else (a.shares or [0.25])  # 0: no inference at all
    extra = [] if a.no_inference else [s for s in a.extra_shares if s not in main_shares]
    if a.smoke:
        a.sizes, a.loads, a.jobs_64, a.skip_speed = [16], [1.0], 24, True
        extra = extra[:1]
    if inf:
        print(f"inference traces: {', '.join(Path(p).name for p in inf)}", flush=True)
    options = AllocatorSettings().policy_options()
    print("policy configuration = the live allocator's defaults (services/allocator/settings.py): "
          + ", ".join(f"{k}={v}" for k, v in options.items()) + f"; tenants per GPU {AllocatorSettings.max_tenants}", flush=True)
    print("information parity: exclusive-backfill, lucid and elastico receive the same (exact) remaining-run-time "
          "estimates; exclusive-fifo, tiresias and mps-equal-share do not use them", flush=True)
    specs = []
    for G in a.sizes:
        n = a.jobs_64 if G <= 64 else a.jobs_512
        for share in main_shares:
            specs += [{"gpus": G, "share": share, "load": x, "jobs": n, "main": True, "ablations": not a.no_ablations}
                      for x in a.loads]
        for share in extra:
            specs += [{"gpus": G, "share": share, "load": x, "jobs": n, "main": False, "ablations": False}
                      for x in a.extra_loads]
    common = {"trace": a.trace, "inference": inf, "seed": a.seed, "estimator": a.estimator, "pairs": a.pairs,
              "node_gpus": a.node_gpus, "max_tenants": AllocatorSettings.max_tenants, "options": options,
              "redraw_seed": a.redraw_seed}
    out = Path(a.out)
    cells, misses, report = [], [], {}
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=a.workers, mp_context=ctx) as pool:
        for futures in submit_cells(pool, specs, common):
            try:
                cell = gather_cell(futures)
                empty_window(cell)
            except (TraceError, OSError) as exc:
                pool.shutdown(wait=False, cancel_futures=True)
                ap.error(str(exc))
            lines, checks = evaluate(cell)
            print("\n" + cell["head"])
            print(table(cell["sums"]))
            print("\n".join(lines))
            for name, ok in checks:
                print(f"  {verdict(ok):<5} {name}")
                if not ok:
                    misses.append(f"{cell['gpus']} GPUs, share {cell['share']:.2f}, load {cell['load']:g}: {name}")
            sys.stdout.flush()
            tag = f"g{cell['gpus']}_share{cell['share']:.2f}_load{cell['load']:g}"
            meta = {k: cell[k] for k in ("gpus", "share", "load", "jobs", "main")}
            work = write_work_plot(out / tag / "work_vs_ceiling.png", cell["sums"], cell["ceiling"],
                                   f"{cell['gpus']} GPUs (nodes of {a.node_gpus}), inference share {cell['share']:.2f}, "
                                   f"load {cell['load']:g}", slo_floor=TARGET_SLO,
                                   target=work_target(cell) if cell["main"] and cell["load"] >= 1.0 else None,
                                   target_label="target: half the FIFO -> ceiling gap,")
            write_outputs(out / tag, cell["sums"], cell["results"], {**meta, "offered_load": cell["load"]},
                          extra_images=[work] if work else [], notes=_notes(lines, checks))
            report[tag] = {"meta": meta, "summaries": cell["sums"], "ceiling": cell["ceiling"], "lines": lines,
                           "checks": checks}
            cell.pop("results")
            cell["tag"], cell["notes"] = tag, _notes(lines, checks)
            cells.append(cell)
    if not a.skip_speed:
        speed = full_trace_speed(a.trace, inf, a.seed, a.estimator, a.pairs, options, a.redraw_seed)
        ok = speed["wall_s"] <= TARGET_FULL_TRACE_S
        print(f"\n== speed: elastico, whole trace ({speed['jobs']} training jobs, offered load {speed['load']:.2f}, "
              f"inference share 0.25), 512 GPUs, fresh process: {speed['wall_s']:.1f} s wall, {speed['cpu_s']:.1f} s "
              f"CPU, {speed['rounds']} rounds\n  {verdict(ok):<5} whole trace at 512 GPUs <= {TARGET_FULL_TRACE_S:.0f} s")
        if not ok:
            misses.append(f"speed: {speed['wall_s']:.1f} s wall (CPU {speed['cpu_s']:.1f} s)")
        report["speed"] = {**speed, "ok": ok}
    rows = summary_rows(cells)
    print("\n" + "\n".join(rows))
    out.mkdir(parents=True, exist_ok=True)
    (out / "headline.json").write_text(json.dumps(report, indent=2, default=float))
    (out / "headline.md").write_text("\n".join(rows) + "\n")
    page = write_report(out / "report.html", rows, cells, report.get("speed"), misses, {**common, "sizes": a.sizes})
    if not a.smoke:
        misses += render_check(page)
    print(f"\nOVERALL: {'PASS' if not misses else f'FAIL ({len(misses)} miss(es), as measured)'}  "
          f"[{time.perf_counter() - t0:.0f} s]")
    for m in misses:
        print(f"  miss: {m}")
    print(f"report: {page.resolve().as_uri()}")
    return 0


def _notes(lines: list[str], checks: list[tuple[str, bool]]) -> list[str]:
    """A cell's printed lines and its checks' verdicts, for its HTML report."""
    return [ln.strip() for ln in lines if ln.strip()] + [f"{verdict(ok)} {name}" for name, ok in checks]


def write_report(path: Path, rows: list[str], cells: list[dict], speed: dict | None, misses: list[str],
                 config: dict) -> Path:
    """The run's HTML page: the summary table, the misses, then per cell its table, checks and plots (linked from
    the cell's folder, whose own report.html embeds them), and the configuration."""
    head = [Section("Summary", grid=markdown_table(rows) if len(rows) > 2 else None,
                    notes=[f"OVERALL: {'PASS' if not misses else f'FAIL ({len(misses)} miss(es))'}"]
                    + [f"miss: {m}" for m in misses]
                    + ([f"speed: elastico, whole trace at 512 GPUs: {speed['wall_s']:.1f} s wall, "
                        f"{speed['cpu_s']:.1f} s CPU ({verdict(speed['ok'])})"] if speed else []),
                    config=config)]
    body = [Section(cell["head"].strip("= "), summaries=cell["sums"], notes=cell["notes"],
                    link=("this cell's report (plots embedded)", f"{cell['tag']}/report.html"),
                    images=[(f, f"{cell['tag']}/{f}") for f in ("jct_cdf.png", "utilisation.png", "work_vs_ceiling.png")
                            if (path.parent / cell["tag"] / f).exists()])
            for cell in cells]
    return write_html(path, "ElastiCo headline benchmark", head + body)


def render_check(page: Path) -> list[str]:
    """Render ``page`` in headless Chromium and check it is not blank (``bench.render_report``); the misses it
    finds. Without Chromium it says so and finds none (the check needs a browser, the benchmark does not)."""
    from bench.render_report import RenderError, check, find_browser

    if find_browser() is None:
        print("render check: not run, no Chromium on PATH (apt-get install chromium)")
        return []
    try:
        stats, shot = check(page)
    except RenderError as exc:
        print(f"render check: FAIL {exc}")
        return [f"render check: {exc}"]
    problems = stats.problems()
    print(f"render check: {verdict(not problems)} {shot} ({stats.ink:.1%} ink, {stats.colour:.2%} coloured)")
    return [f"render check: {p}" for p in problems]


if __name__ == "__main__":
    sys.exit(main())
