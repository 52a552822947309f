"""``make demo``: replay a slice of the real Philly trace through the live suite, then compare with the simulator.

For each policy (ElastiCo, then exclusive FIFO, the paper's static baseline):

1. start the whole local suite (``devtools.cluster``): embedded Redis, pricer, predictor, allocator (with
   that policy) and N node agents on simulated GPUs, all in **accelerated time** (``--time-scale``: the
   simulated GPUs run that many seconds per wall second and the allocator's policy clock is scaled alike);
2. replay the slice through the allocator's gRPC API (``devtools.replay``): every job submitted at its
   (scaled) arrival, retried once with the same request id, followed to completion, invariants checked
   on every sample;
3. stop the suite.

Then the simulator runs the same jobs in-process (``simulator.run``, same policy code, same estimate),
and the demo prints the simulator's metrics table for both (``simulator.report.table``), live next to
simulated, and the difference.

The interference estimate: the allocator is configured with the calibrated utilisation rule
(``ELASTICO_ESTIMATOR=rule``), the estimate the simulator uses when no trained predictor artifact is
present, so that both sides decide on the same numbers. The simulated GPUs take their co-location speeds
from the simulator's ground truth (``elastico/coloc/truth.py``, through ``services/node_agent/coloc.py``),
so what remains in the difference row is the control plane (latency, reconcile and report intervals).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path

import numpy as np

from devtools import cluster

TRACE = "data/traces/gavel_philly_vc_traces_seed0.csv"
# 60 consecutive Philly jobs (59 x 1 GPU, one 4-GPU job) arriving over ~1.1 h, none longer than 2 h alone:
# a slice that loads 8 GPUs (offered load ~3.7) and drains in ~5 h of trace time.
DEFAULT_WINDOW = (2653756.0, 2657677.0)
DEFAULT_JOBS = 60


def _suite_env(policy: str, scale: float, gpus_per_node: int, run_dir: Path) -> dict[str, str]:
    return {
        "ELASTICO_RUN_DIR": str(run_dir), "ELASTICO_POLICY": policy, "ELASTICO_ESTIMATOR": "rule",
        "ELASTICO_TIME_SCALE": repr(scale), "ELASTICO_SIM_TIME_SCALE": repr(scale),
        "ELASTICO_ROUND_INTERVAL_S": repr(max(0.05, 300.0 / scale)),  # the simulator's 300 s periodic rounds
        "ELASTICO_REPORT_POLL_S": "0.1", "ELASTICO_RECONCILE_INTERVAL_S": "0.2", "ELASTICO_HEARTBEAT_INTERVAL_S": "0.5",
        "ELASTICO_SIM_GPU_COUNT": str(gpus_per_node), "ELASTICO_STOP_GRACE_S": "2", "ELASTICO_LOG_FORMAT": "json",
        "ELASTICO_OBSERVATION_INTERVAL_S": "1000000",
    }


def run_live(policy: str, jobs, nodes: int, gpus_per_node: int, scale: float, timeout_s: float, run_root: Path):
    """One live replay of ``jobs`` under ``policy``; returns (Observed, summary dict)."""
    from devtools.replay import Replay, live_result
    from simulator.metrics import summarise

    env = _suite_env(policy, scale, gpus_per_node, run_root / policy)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        print(f"\n== live: {policy} on {nodes} nodes x {gpus_per_node} simulated GPUs, time x{scale:g}")
        state = cluster.up(nodes)
        try:
            alloc = next(p["address"] for p in state["procs"] if p["name"] == "allocator")
            agents = [p["address"] for p in state["procs"] if p["name"].startswith("node-")]
            obs = Replay(alloc, agents, jobs, scale, f"demo-{policy}-{uuid.uuid4().hex[:6]}",
                         tls=cluster.client_tls(state)).run(timeout_s)
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
    s = summarise(live_result(policy, jobs, obs, scale, nodes * gpus_per_node))
    s["policy"] = f"{policy} (live)"
    return obs, s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--gpus-per-node", type=int, default=4)
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--window", type=float, nargs=2, default=DEFAULT_WINDOW, metavar=("START_S", "END_S"),
                    help="trace arrival window, seconds of the original trace")
    ap.add_argument("--jobs", type=int, default=DEFAULT_JOBS)
    ap.add_argument("--time-scale", type=float, default=600.0, help="trace seconds per wall second")
    ap.add_argument("--policies", default="elastico,exclusive-fifo")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="per live run")
    a = ap.parse_args(argv)
    from devtools.replay import trace_jobs
    from simulator.engine import SimConfig
    from simulator.report import table
    from simulator.run import build_workload, run_policies

    t_start = time.time()
    gpus = a.nodes * a.gpus_per_node
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    w = build_workload(a.trace, gpus, window=tuple(a.window), max_jobs=a.jobs, estimator="rule")
    from services.allocator.settings import AllocatorSettings

    live_opts = AllocatorSettings().policy_options()  # the live allocator's, so both rows run the same policy
    jobs = trace_jobs(w, train_floor=live_opts["train_floor"])
    span_h = float(w.train.arrival_s.max()) / 3600
    print(f"== slice: {len(jobs)} Philly jobs ({a.trace}, arrivals [{a.window[0]:.0f}, {a.window[1]:.0f}) s, "
          f"{span_h:.2f} h), gang sizes {dict(zip(*np.unique(w.train.num_gpus, return_counts=True)))}, "
          f"offered load {w.train.offered_load:.2f} on {gpus} GPUs; estimate: {w.estimator_name}")
    run_root = Path(os.environ.get("ELASTICO_RUN_DIR", ".run")).resolve() / "demo"
    live = []
    for p in policies:
        _, s = run_live(p, jobs, a.nodes, a.gpus_per_node, a.time_scale, a.timeout_s, run_root)
        live.append(s)
    print("\n== simulator: same jobs, same policies, same estimate (in-process)")
    sim = SimConfig(gpus=gpus, node_gpus=a.gpus_per_node, round_interval_s=300.0)  # the live nodes' topology
    _, sims = run_policies(w, policies, sim, live_opts)
    for s in sims:
        s["policy"] = f"{s['policy']} (sim)"
    rows = [r for pair in zip(sims, live, strict=True) for r in pair]
    print("\n== results (the simulator's metrics table; live rows measured through the API)")
    print(table(rows))
    print("\n== live - simulated")
    keys = ("avg_jct_h", "p95_jct_h", "makespan_h", "jobs_per_h", "work_gpu_h_per_h", "avg_queue_h", "alloc_util", "eff_util")
    print(f"{'policy':<18} " + " ".join(f"{k:>16}" for k in keys))
    for sim, lv in zip(sims, live, strict=True):
        cells = []
        for k in keys:
            d = lv[k] - sim[k]
            rel = d / sim[k] if sim[k] else float("nan")
            cells.append(f"{d:+8.2f} ({rel:+5.0%})" if "util" not in k else f"{d * 100:+7.1f} pp      ")
        print(f"{sim['policy'].replace(' (sim)', ''):<18} " + " ".join(f"{c:>16}" for c in cells))
    if len(policies) >= 2:
        for src, rs in (("sim", sims), ("live", live)):
            base = rs[1]["avg_jct_h"]
            print(f"  {src}: average JCT {policies[0]} / {policies[1]} = {rs[0]['avg_jct_h'] / base:.2f}" if base else "")
    print(f"\n== demo finished in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
