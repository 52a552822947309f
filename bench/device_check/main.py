"""Arguments and the checks before a run: a worker child, bad arguments, a missing module, no GPU."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import bench.device_check as package
from bench.device_check.host import JSON_NAME, SCHEMA, Terminated, gpu_missing_reason, refuse
from bench.device_check.measurement import DEFAULT_WINDOW_S, DRY_WINDOW_S, QUICK_WINDOW_S
from bench.device_check.project import MissingModule, load_project
from bench.device_check.stages import DeviceCheck
from bench.device_check.workloads import run_worker


def parse_args(argv: Iterable[str] | None = None) -> argparse.Namespace:
    description = (package.__doc__ or "").split("\n\n")[0]
    ap = argparse.ArgumentParser(prog="python3 -m bench.device_check", description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."),
                    help="folder for device_check.json (default $OUT or .)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="global time budget in seconds (default 300)")
    ap.add_argument("--seconds", type=float, default=None,
                    help=f"measurement window per run (default {DEFAULT_WINDOW_S:g}; --quick {QUICK_WINDOW_S:g}; "
                         f"--dry-run {DRY_WINDOW_S:g})")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_WINDOW_S:g} s windows")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: fake workers, stand-in NVML, simulated MPS")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # child mode: one workload
    ap.add_argument("--fake", action="store_true", help=argparse.SUPPRESS)  # child mode: sleep, constant rate
    return ap.parse_args(None if argv is None else list(argv))


def _on_signal(signum: int, frame: Any) -> None:
    raise Terminated(signum)


def _refuse(out: Path, status: str, mode: str, error: str, message: str) -> int:
    return refuse(out, JSON_NAME, SCHEMA, status, mode, error, message)


def main(argv: Iterable[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args.worker, float(args.seconds or 0.0), args.fake)
    if (args.seconds is not None and args.seconds <= 0) or args.budget_s <= 0:
        print("device_check: --seconds and --budget-s must be > 0", file=sys.stderr)
        return 2
    mode = "dry-run" if args.dry_run else "gpu"
    try:
        gpu_mod, mps_mod = load_project()
    except MissingModule as exc:
        return _refuse(Path(args.out), "missing_module", mode, str(exc), f"device_check: {exc}")
    if not args.dry_run:
        why = gpu_missing_reason()
        if why is not None:
            return _refuse(Path(args.out), "no_gpu", mode, why,
                           f"device_check: no NVIDIA GPU on this machine ({why}).\nRun it on the GPU machine, or pass "
                           "--dry-run to exercise the orchestration with fake workers.")
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    return DeviceCheck(args, gpu_mod, mps_mod).run()
