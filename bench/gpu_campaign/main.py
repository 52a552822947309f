"""Arguments and the checks before a run: a worker child, bad arguments, a missing module, no GPU."""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import bench.gpu_campaign as package
from bench.device_check.host import Terminated, gpu_missing_reason, refuse
from bench.device_check.project import MissingModule, load_project
from bench.gpu_campaign.campaign import JSON_NAME, SCHEMA, Campaign
from bench.gpu_campaign.workloads import DEFAULT_WINDOW_S, DRY_WINDOW_S, QUICK_WINDOW_S, select_plan

PROG = "python3 -m bench.gpu_campaign"


def parse_args(argv: Iterable[str] | None = None) -> argparse.Namespace:
    description = (package.__doc__ or "").split("\n\n")[0]
    ap = argparse.ArgumentParser(prog=PROG, description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help=f"folder for {JSON_NAME} (default $OUT or .)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="global time budget in seconds (default 480)")
    ap.add_argument("--seconds", type=float, default=None,
                    help=f"measurement window per point (default {DEFAULT_WINDOW_S:g}; --quick {QUICK_WINDOW_S:g}; "
                         f"--dry-run {DRY_WINDOW_S:g}); a service's rate search takes as long again")
    ap.add_argument("--quick", action="store_true", help="a smoke subset of every stage, short windows")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: fake workers, stand-in NVML, simulated MPS")
    ap.add_argument("--points", default=None, metavar="REGEX",
                    help="only the plan's points whose 'STAGE LABEL' matches (re.search), e.g. to measure what an "
                         "earlier run's budget cut off: --points '^(solo|shares .*@(10|75)$|splits)'")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # child mode: one workload
    ap.add_argument("--fake", action="store_true", help=argparse.SUPPRESS)  # child mode: sleep for the GPU work
    ap.add_argument("--params", default=None, help=argparse.SUPPRESS)  # child mode: JSON object of settings
    return ap.parse_args(None if argv is None else list(argv))


def _on_signal(signum: int, frame: Any) -> None:
    raise Terminated(signum)


def main(argv: Iterable[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        from bench.gpu_campaign.worker import parse_params, run_worker

        return run_worker(args.worker, float(args.seconds or 0.0), args.fake, parse_params(args.params))
    if (args.seconds is not None and args.seconds <= 0) or args.budget_s <= 0:
        print("gpu_campaign: --seconds and --budget-s must be > 0", file=sys.stderr)
        return 2
    if args.points is not None:
        try:
            selected = select_plan(args.quick, args.points)
        except re.error as exc:
            print(f"gpu_campaign: --points is not a regular expression: {exc}", file=sys.stderr)
            return 2
        if not selected:
            print(f"gpu_campaign: --points {args.points!r} matches no point of the plan", file=sys.stderr)
            return 2
    mode = "dry-run" if args.dry_run else "gpu"
    out = Path(args.out)
    try:
        gpu_mod, mps_mod = load_project()
    except MissingModule as exc:
        return refuse(out, JSON_NAME, SCHEMA, "missing_module", mode, str(exc), f"gpu_campaign: {exc}")
    if not args.dry_run:
        why = gpu_missing_reason()
        if why is not None:
            return refuse(out, JSON_NAME, SCHEMA, "no_gpu", mode, why,
                          f"gpu_campaign: no NVIDIA GPU on this machine ({why}).\nRun it on the GPU machine, or pass "
                          "--dry-run to exercise the orchestration with fake workers.")
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    return Campaign(args, gpu_mod, mps_mod).run()
