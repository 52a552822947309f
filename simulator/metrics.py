"""Metrics of one run (definitions are the ones printed in the report).

* JCT = completion - arrival (finished training jobs); average and p95. Unfinished jobs are counted
  separately, never dropped silently.
* Makespan = last completion - first arrival.
* Throughput, three readings: jobs completed per hour of makespan (a finite trace's makespan is set by
  its last, longest jobs, so this moves little); *jobs completed per hour of the loaded period* [0, last
  arrival] (what an operator sees while the cluster is busy; a scheduler that finishes short jobs first
  scores higher on it); and *normalised work per hour*: isolated GPU-hours (at the requested gang size)
  of training work done during the loaded period divided by its length (a scheduler that serves faster
  does more isolated-equivalent work in the same time; short-job-first ordering does not move it).
* Queueing delay = first start - arrival.
* SLO attainment = fraction of inference service lifetime (queued time included) whose 60-s demand bin
  meets the latency SLO at the capacity the service had.
* Utilisation over the loaded period, time-averaged over all GPUs: *allocated* = share handed out;
  *effective* = per GPU, sum over tenants of solo utilisation x achieved fraction of isolated speed,
  capped at 100 % (inference: its mean load, capped at its capacity). A training job's solo utilisation
  is its 1-GPU profile's times its per-GPU scaling efficiency ``T(n)/n`` at the count it runs on (capped
  at 1): a gang that scales sub-linearly leaves each of its GPUs partly idle waiting on communication.
"""

from __future__ import annotations

import numpy as np

from simulator.engine import SimResult


def summarise(r: SimResult) -> dict:
    """Plain-dict metrics of a run (JSON-serialisable)."""
    done = ~np.isnan(r.completion_s)
    jct = r.completion_s[done] - r.arrival_s[done]
    q = r.first_start_s - r.arrival_s
    q = q[~np.isnan(q)]
    makespan = float(np.nanmax(r.completion_s) - r.arrival_s.min()) if done.any() else float("nan")
    win_h = max(r.window_end_s, 1e-9) / 3600.0
    return {
        "policy": r.policy,
        "gpus": r.gpus,
        "jobs": int(len(r.arrival_s)),
        "completed": int(done.sum()),
        "unfinished": int((~done).sum()),
        "avg_jct_h": float(jct.mean() / 3600) if len(jct) else float("nan"),
        "p95_jct_h": float(np.percentile(jct, 95) / 3600) if len(jct) else float("nan"),
        "makespan_h": makespan / 3600,
        "jobs_per_h": float(done.sum() / (makespan / 3600)) if done.any() else float("nan"),
        "jobs_per_h_loaded": float((r.completion_s[done] <= r.window_end_s).sum() / win_h),
        "work_gpu_h_per_h": float(r.work_in_window_gpu_s / 3600 / win_h),
        "avg_queue_h": float(q.mean() / 3600) if len(q) else float("nan"),
        "slo_attainment": float(r.slo_ok_s / r.slo_total_s) if r.slo_total_s > 0 else float("nan"),
        "restarts": int(r.restarts_training + r.restarts_inference),
        "restarts_inference": int(r.restarts_inference),
        "alloc_util": float(r.alloc_gpu_s / (r.gpus * max(r.window_end_s, 1e-9))),
        "eff_util": float(r.eff_gpu_s / (r.gpus * max(r.window_end_s, 1e-9))),
        "median_pricing_gap": float(np.median(r.pricing_gaps)) if r.pricing_gaps else None,
        "rounds": r.rounds,
        "events": r.events,
        "wall_s": r.wall_s,
        "cpu_s": r.cpu_s,
    }
