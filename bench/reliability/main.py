"""The probe's run: cluster up, the six phases in order with the sampler around the first three, teardown, summary."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import bench.reliability as package
from bench.reliability.faults import faults
from bench.reliability.hostile import hostile_input
from bench.reliability.jobs import concurrency
from bench.reliability.live import REPO_ROOT, Run, leftover_workloads, say, start_cluster
from bench.reliability.probes import cluster_state_latency, health, print_rss, rss
from bench.reliability.report import Outcome, summary
from bench.reliability.sampler import Sampler
from devtools import cluster


@dataclass(frozen=True)
class Size:
    """How much of each phase one mode runs."""

    hostile: int  # hostile requests per service
    jobs: int  # concurrent SubmitJob
    finished: int  # finished jobs written to the store for GetClusterState
    settle_s: float  # how long the jobs may take to settle after the faults


SIZES = {"full": Size(hostile=10_000, jobs=1_000, finished=10_000, settle_s=420.0),
         "smoke": Size(hostile=600, jobs=100, finished=1_000, settle_s=30.0)}


def teardown(run: Run | None, sampler: Sampler | None, tmp: Path, keep: bool = False) -> None:
    """Stop the sampler and the cluster whatever happened; kill anything of this run that is still alive."""
    if sampler is not None:
        with contextlib.suppress(Exception):
            sampler.stop()
    if run is not None:
        try:
            cluster.down(quiet=True)
        finally:
            for pid in leftover_workloads(run.run_dir):  # e.g. a workload orphaned by a failed restart (none expected)
                say(f"WARNING: process {pid} of this run outlived the cluster; killed")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    if keep:
        say(f"run directory kept: {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    description = (package.__doc__ or "").split("\n\n")[0]
    ap = argparse.ArgumentParser(prog="python -m bench.reliability", description=description)
    ap.add_argument("--smoke", action="store_true", help="reduced sizes (< 90 s); speed and memory targets not judged")
    ap.add_argument("--seed", type=int, default=0, help="seed of every hostile request and job (default 0)")
    ap.add_argument("--keep", action="store_true", help="keep the run directory (logs, Redis data) for inspection")
    args = ap.parse_args(argv)
    mode = "smoke" if args.smoke else "full"
    size = SIZES[mode]
    say(f"bench.reliability [{mode}]: live local cluster (cluster.up(2): embedded Redis, pricer, predictor, allocator, "
        f"2 node agents x 4 simulated V100), mTLS + tokens, seed {args.seed}")
    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="elastico-reliability-"))
    tmp.chmod(0o755)  # a root cluster's workloads run as nobody and must enter the run dir
    os.chdir(REPO_ROOT)
    run = None
    sampler = None
    try:
        run = start_cluster(tmp)
        say(f"cluster up in {time.monotonic() - t_start:.1f} s: " + ", ".join(f"{p['name']} {p['address'] or ''}".strip()
                                                                              for p in run.state["procs"]))
        sampler = Sampler(run)
        sampler.start()
        rss_start = rss(run)
        hostile = hostile_input(run, size.hostile, args.seed)
        sub, first = concurrency(run, size.jobs, args.seed)
        rss_loaded = rss(run)
        f = faults(run, sub, size.settle_s)
        counts = sampler.stop()
        sampler = None
        say(f"  sampler (from start to here): {counts.samples} samples, {counts.gpu_samples} GPU-samples; oversubscribed "
            f"{counts.oversubscribed} (committed {counts.oversubscribed_committed}, running {counts.oversubscribed_running}); "
            f"running twice {counts.running_twice}; max committed share seen {counts.max_share_seen:.0f}%; "
            f"unreachable during the faults: store {counts.store_unreachable}, agents {counts.agent_unreachable}")
        for d in counts.details:
            say(f"    {d}")
        rss_rows = print_rss(rss_start, rss_loaded, rss(run), args.smoke)
        p50, p99, total_jobs = cluster_state_latency(run, size.finished)
        healthy = health(run)
    finally:
        teardown(run, sampler, tmp, keep=args.keep)
    outcome = Outcome(hostile, first, f, counts, rss_rows, p50, p99, total_jobs, healthy)
    return 0 if summary(outcome, mode, args.smoke, time.monotonic() - t_start) else 1
