"""Builders for policy tests: a tiny type table, a cluster view with chosen tenants, a small trace."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from elastico.coloc.profiles import TypeTable
from services.allocator.policy import ClusterView, JobTable

INF = 3  # index of the inference pseudo-type in TYPES


def types() -> TypeTable:
    """Three training types (light, medium, heavy) + inference."""
    return TypeTable(names=("light", "medium", "heavy", "inference"), gpu_type="v100",
                     solo_util=np.array([0.3, 0.6, 1.0, np.nan]), iso_tput_steps_s=np.array([10.0, 10.0, 10.0, np.nan]),
                     fitted=np.array([True, True, True, False]))


def view(jobs: list[dict], gpus: int = 4, K: int = 4, placed: dict | None = None, now: float = 0.0) -> ClusterView:
    """jobs: dicts with kind, type, n (GPUs), arrival, attained, load (inference), remaining, observed
    (interference factor seen while placed). placed: job -> (gpu list, share)."""
    N = len(jobs)
    T = types()
    util = np.array([T.solo_util[j.get("type", 0)] if j.get("kind", 0) == 0 else j.get("load", 0.2) for j in jobs])
    gj = np.full((gpus, K), -1)
    gs = np.zeros((gpus, K))
    gl = [None] * N
    share = np.zeros(N)
    for j, (g, s) in (placed or {}).items():
        for gg in g:
            k = int(np.flatnonzero(gj[gg] < 0)[0])
            gj[gg, k] = j
            gs[gg, k] = s
        gl[j] = np.array(g)
        share[j] = s
    tbl = JobTable(
        kind=np.array([j.get("kind", 0) for j in jobs], np.int8),
        type_idx=np.array([j.get("type", 0) if j.get("kind", 0) == 0 else INF for j in jobs]),
        num_gpus=np.array([j.get("n", 1) for j in jobs]),
        arrival_s=np.array([float(j.get("arrival", i)) for i, j in enumerate(jobs)]),
        priority=np.ones(N), attained_gpu_s=np.array([float(j.get("attained", 0.0)) for j in jobs]),
        share_pct=share, solo_util=util,
        load_forecast=np.array([j.get("forecast", j.get("load", np.nan)) if j.get("kind", 0) == 1 else np.nan for j in jobs]),
        gpus=gl, restarts=np.zeros(N, int), queued_since_s=np.array([float(j.get("arrival", i)) for i, j in enumerate(jobs)]),
        remaining_est_s=np.array([float(j.get("remaining", np.nan)) for j in jobs]), last_change_s=np.zeros(N),
        observed_norm=np.array([float(j.get("observed", np.nan)) for j in jobs]))
    placed = placed or {}
    pend = np.array([i for i in range(N) if i not in placed], int)
    run = np.array(sorted(placed), int)
    return ClusterView(now, gj, gs, tbl, pend, run, T)


def rule_matrix(kappa: float = 0.9) -> np.ndarray:
    from services.allocator.policy import RuleEstimator

    return RuleEstimator(kappa).pair_matrix(types())


TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"
#: The inference traces of the simulator tests' small workload.
INFERENCE_TRACES = [TRACES / f for f in ("alibaba2025_dlrm_inference_gpu_instances.csv",
                                         "azure2023_llm_inference_code.csv", "alibaba2023_openb_pod_list_default.csv")]


def write_small_trace(out: Path) -> Path:
    """The first 60 Philly jobs with GPU counts capped at 6 and durations at 10 h, written to ``out`` (fits an
    8-GPU test cluster; in two nodes of 4, gangs of 5 and 6 take a whole node and part of the other)."""
    with open(TRACES / "gavel_philly_vc_traces_seed0.csv", newline="") as fh:
        rows = sorted(csv.DictReader(fh), key=lambda r: float(r["arrival_time_s"]))[:60]
    for r in rows:
        r["num_gpus"] = str(min(6, int(r["num_gpus"])))
        r["duration_v100_s_derived"] = str(min(float(r["duration_v100_s_derived"]), 36000.0))
    with open(out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return out
