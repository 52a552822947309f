"""``python -m simulator``: run policies side by side on one trace and write a table, JSON, plots and an HTML page."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from elastico.argtypes import ranged
from elastico.coloc.profiles import campaign_tables, default_campaign_dir
from services.allocator.policy import POLICY_NAMES, ElastiCoParams
from simulator.engine import SimConfig
from simulator.report import table, write_outputs
from simulator.run import build_workload, run_policies
from simulator.traces import TraceError

FLOOR = ElastiCoParams().train_floor


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m simulator", description=__doc__)
    ap.add_argument("--trace", required=True, help="training trace CSV (gavel_philly_vc_traces schema)")
    ap.add_argument("--inference-trace", nargs="*", default=[],
                    help="Alibaba 2025 instances, Azure LLM request traces, Alibaba 2023 pod list (any order)")
    ap.add_argument("--pairs", default=None, metavar="CSV",
                    help="measured pairs used as ground truth (coloc_gavel_pairs.csv schema; default: data/'s)")
    ap.add_argument("--gpu-type", default="v100", type=str.lower,
                    help="GPU type of the cluster: its job types and measured pairs are the ground truth (default "
                         "v100; a campaign's type, e.g. h200, with --campaign-dir)")
    ap.add_argument("--campaign-dir", default=None, metavar="DIR",
                    help="a GPU campaign's derived tables (python3 -m bench.gpu_campaign.derive): they add its GPU "
                         "type's job types, pairs and training+inference pairs to the ground truth (default: "
                         "data/h200 when a GPU session has committed tables there, else none)")
    ap.add_argument("--gpus", type=ranged(1, cast=int), default=64, help="cluster size (default 64)")
    ap.add_argument("--node-gpus", type=ranged(1, cast=int), default=8,
                    help="GPUs per node (default 8): a gang that fits one node runs inside one, a larger one takes "
                         "whole nodes plus at most one partial node")
    ap.add_argument("--policies", default=",".join(POLICY_NAMES), help="comma-separated policy names (default: all)")
    ap.add_argument("--out", default="out/sim", help="folder for summary.json, jct_cdf.png, utilisation.png and report.html (default out/sim)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the inference services' sampling and demand")
    ap.add_argument("--load", type=ranged(0.0, lo_open=True), default=None,
                    help="target training offered load, counted against the GPUs static allocation leaves to training "
                         "(rescales arrivals)")
    ap.add_argument("--window", type=float, nargs=2, metavar=("START", "END"), default=None,
                    help="keep training jobs arriving in [START, END) seconds of the trace")
    ap.add_argument("--redraw-types", dest="redraw_seed", type=ranged(0, cast=int), default=None, metavar="SEED",
                    help="deal the trace's jobs (type, model, batch size, steps, duration) out again over its rows "
                         "with this seed, arrivals and GPU counts kept: a job-type draw nothing was tuned on")
    ap.add_argument("--max-jobs", type=ranged(1, cast=int), default=None, help="keep the first N jobs (after --window)")
    ap.add_argument("--inference-fraction", type=ranged(0.0, 1.0, lo_open=True), default=0.25,
                    help="share of GPUs inference would hold at peak under static allocation (default 0.25)")
    ap.add_argument("--restart-s", type=ranged(0.0), default=60.0,
                    help="cost of each preemption/resize (checkpoint + relaunch), seconds (default 60)")
    ap.add_argument("--round-interval-s", type=ranged(0.0, lo_open=True), default=300.0,
                    help="scheduling round period, seconds (default 300; rounds also run on arrivals/completions)")
    ap.add_argument("--train-floor", type=ranged(0.0, 1.0, lo_open=True), default=None,
                    help=f"ElastiCo: min fraction of isolated speed (default: the policy's, {FLOOR})")
    ap.add_argument("--work-weight", type=ranged(0.0, 1.0), default=None,
                    help="ElastiCo's objective knob (ELASTICO_WORK_WEIGHT): 0 = JCT first, "
                         "1 = the most work per hour (default: the policy's, 0.5)")
    ap.add_argument("--estimator", choices=["auto", "predictor", "rule"], default="auto",
                    help="what the policies see as interference: the trained predictor, the utilisation rule, "
                         "or auto (predictor if models/interference.json loads)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICY_NAMES]
    if bad:
        ap.error(f"unknown policies {bad}; choose from {', '.join(POLICY_NAMES)}")
    if a.campaign_dir is not None and not campaign_tables(a.campaign_dir):
        ap.error(f"--campaign-dir {a.campaign_dir}: no <gpu>_provenance.json there (python3 -m "
                 f"bench.gpu_campaign.derive writes the tables with one)")
    campaign = a.campaign_dir if a.campaign_dir is not None else default_campaign_dir()
    try:
        w = build_workload(a.trace, a.gpus, a.inference_trace, a.seed, a.load, a.window, a.max_jobs,
                           a.inference_fraction, estimator=a.estimator, pairs=a.pairs, gpu_type=a.gpu_type,
                           campaign_dir=campaign, redraw_seed=a.redraw_seed)
    except (TraceError, OSError) as exc:
        ap.error(str(exc))
    ninf = 0 if w.inf is None else len(w.inf.start_s)
    too_big = int((w.train.num_gpus > a.gpus).sum())
    if w.train.unknown_types or too_big:
        print(f"note: {w.train.unknown_types} job(s) of an unknown job_type run as their model family's first "
              f"known type (else the median-utilisation type); {too_big} job(s) need more than {a.gpus} GPUs "
              f"and are reported unfinished", file=sys.stderr, flush=True)
    print(f"workload: {len(w.train.arrival_s)} training jobs, {ninf} inference services, {a.gpus} GPUs; "
          f"offered training load {w.train.offered_load:.2f} (native {w.train.native_offered_load:.2f}) on the "
          f"{w.training_gpus:.1f} GPUs static allocation leaves to training"
          f"{'' if not ninf else f' (inference: {a.inference_fraction:.2f} of the GPUs at peak, {w.static_inference_gpus:.1f} on average)'}; "
          f"estimate: {w.estimator_name}; ground truth ({a.gpu_type}): {w.truth.measured_pairs} measured pairs"
          f"{f', {w.truth.train_infer_pairs} training+inference points' if w.truth.train_infer_pairs else ''}, "
          f"rule kappa {w.truth.kappa:.2f}", flush=True)
    cfg = SimConfig(gpus=a.gpus, node_gpus=a.node_gpus, restart_s=a.restart_s, round_interval_s=a.round_interval_s, progress=not a.quiet)
    t0 = time.perf_counter()
    opts = {k: v for k, v in (("train_floor", a.train_floor), ("work_weight", a.work_weight)) if v is not None}
    results, sums = run_policies(w, policies, cfg, opts)
    wall = time.perf_counter() - t0
    print(table(sums))
    print("simulation wall time: " + ", ".join(f"{s['policy']} {s['wall_s']:.1f} s (CPU {s['cpu_s']:.1f} s)"
                                               for s in sums)
          + f" (total {wall:.1f} s)", flush=True)
    meta = {"trace": a.trace, "pairs": a.pairs, "gpu_type": a.gpu_type,
            "campaign_dir": None if campaign is None else str(campaign), "gpus": a.gpus, "node_gpus": a.node_gpus, "seed": a.seed,
            "training_gpus": w.training_gpus, "load": a.load, "offered_load": w.train.offered_load,
            "native_offered_load": w.train.native_offered_load, "inference_services": ninf,
            "estimator": w.estimator_name, "kappa": w.truth.kappa}
    for p in write_outputs(Path(a.out), sums, results, meta):
        print(f"wrote {p}")
        if p.suffix == ".html":
            print(f"report: {p.resolve().as_uri()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
