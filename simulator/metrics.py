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
* Utilisation over the loaded period, time-averaged over all GPUs: *allocated* = compute handed out (each
  tenant's share; a whole GPU for a training job its share does not limit: ``limited_slots``);
  *effective* = per GPU, sum over tenants of solo utilisation x achieved fraction of isolated speed,
  capped at 100 % (inference: its mean load, capped at its capacity). A training job's solo utilisation
  is its 1-GPU profile's times its per-GPU scaling efficiency ``T(n)/n`` at the count it runs on (capped
  at 1): a gang that scales sub-linearly leaves each of its GPUs partly idle waiting on communication.
* Throughput ceiling (:func:`throughput_ceiling`): what *no* policy can exceed on a workload, in the two
  loaded-period readings and in effective utilisation -- every job starting at its arrival, alone, on the
  fastest gang it may run on -- and, from the same schedule, the average-JCT floor no policy can go below.
  These are demand bounds: above load 1 the cluster's capacity binds first, so they are loose there. A throughput target above
  the ceiling, or a JCT ratio above FIFO's JCT over the floor, cannot be met by any scheduler on that
  workload.
"""

from __future__ import annotations

import numpy as np

from elastico.coloc.profiles import TypeTable
from services.allocator.policy.shapes import allowed_counts, count_speed, relative_tput
from simulator.engine import SimResult
from simulator.traces import InferenceServices, TrainingJobs


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


def best_gang_speed(train: TrainingJobs, types: TypeTable) -> np.ndarray:
    """[J] speed of each job alone on the fastest GPU count it may run on, relative to its requested gang
    (>= 1; :func:`shapes.count_speed`, measured curves only). No schedule runs a job faster."""
    best = np.ones(len(train.arrival_s))
    if types.scale_tput is not None:
        for i, (t, n) in enumerate(zip(train.type_idx.tolist(), train.num_gpus.tolist())):
            counts = allowed_counts(n, types.scale_measured[t] if types.scale_measured is not None else None)
            best[i] = max(1.0, float(np.max(count_speed(types.scale_tput[t], np.asarray(counts, float), n))))
    return best


def throughput_ceiling(train: TrainingJobs, types: TypeTable, window_end_s: float, gpus: int | None = None,
                       inf: InferenceServices | None = None) -> dict:
    """Bounds no policy can pass on this workload: upper bounds of ``jobs_per_h_loaded``,
    ``work_gpu_h_per_h`` and ``eff_util``, and a lower bound of the average JCT (``avg_jct_floor_h``).

    Each job is credited as if it started at its arrival, alone (co-location never makes a job faster
    than isolated), on its fastest allowed GPU count (:func:`best_gang_speed`): it completes inside the
    loaded period [0, ``window_end_s``] only if that is fast enough, it can do at most ``num_gpus x speed
    x (window_end - arrival)`` isolated GPU-seconds of work in it, and its JCT is at least ``duration /
    speed`` (averaged over the jobs that fit ``gpus``, when given: the others never complete). Effective
    utilisation counts a training job's work at its solo utilisation times its scaling efficiency at the
    requested count (:mod:`simulator.engine`: whatever its count and co-tenants, a job's effective
    utilisation per unit of work is that), plus every inference service's mean load over its life in the
    loaded period (the most it is ever credited); it needs ``gpus`` and is NaN without. Real schedules share
    GPUs and queue, so they stay on the far side of every figure.
    """
    best = best_gang_speed(train, types)
    left = np.maximum(window_end_s - train.arrival_s, 0.0)
    finish_in = train.duration_s / best <= left + 1e-9
    work_j = np.minimum(train.num_gpus * train.duration_s, train.num_gpus * best * left)
    win_h = max(window_end_s, 1e-9) / 3600.0
    fits = np.ones(len(best), bool) if gpus is None else train.num_gpus <= gpus
    floor = float((train.duration_s / best)[fits].mean() / 3600) if fits.any() else float("nan")
    eff = float("nan")
    if gpus:
        if types.scale_tput is not None:
            per_work = np.array([float(relative_tput(types.scale_tput[t], n)) / n
                                 for t, n in zip(train.type_idx.tolist(), train.num_gpus.tolist())])
        else:
            per_work = np.ones(len(best))
        eff_s = float((work_j * types.solo_util[train.type_idx] * np.minimum(per_work, 1.0)).sum())
        if inf is not None and len(inf.start_s):
            life = np.maximum(np.minimum(inf.end_s, window_end_s) - np.minimum(inf.start_s, window_end_s), 0.0)
            eff_s += float((np.minimum(inf.mean_load(), 1.0) * life).sum())
        eff = float(min(1.0, eff_s / (gpus * max(window_end_s, 1e-9))))
    return {"jobs_per_h_loaded": float(finish_in.sum() / win_h), "work_gpu_h_per_h": float(work_j.sum() / 3600 / win_h),
            "eff_util": eff, "avg_jct_floor_h": floor}
