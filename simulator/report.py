"""Console table, JSON and PNG plots of a comparison (one workload, several policies)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

COLUMNS = [("policy", "policy", "{:<18}"), ("avg_jct_h", "avgJCT h", "{:>9.2f}"), ("p95_jct_h", "p95JCT h", "{:>9.1f}"),
           ("makespan_h", "mkspan h", "{:>9.0f}"), ("jobs_per_h", "jobs/h", "{:>7.2f}"),
           ("jobs_per_h_loaded", "jobs/hL", "{:>7.2f}"),
           ("work_gpu_h_per_h", "work/h", "{:>7.1f}"), ("avg_queue_h", "queue h", "{:>8.2f}"),
           ("slo_attainment", "SLO", "{:>7.4f}"), ("restarts", "restarts", "{:>8d}"),
           ("alloc_util", "alloc", "{:>6.1%}"), ("eff_util", "effect", "{:>6.1%}"),
           ("unfinished", "unfin", "{:>5d}"), ("wall_s", "wall s", "{:>6.1f}")]


def table(summaries: list[dict]) -> str:
    """Fixed-width text table, one row per policy."""
    wide = max([18] + [len(str(s.get("policy", ""))) for s in summaries])
    head = " ".join(f"{h:>{len(f.format(0) if 'd' in f else f.format(0.0))}}" if k != "policy"
                    else f"{h:<{wide}}" for k, h, f in COLUMNS)
    lines = [head]
    for s in summaries:
        cells = []
        for k, _, f in COLUMNS:
            v = s.get(k)
            if k == "policy":
                cells.append(f"{v:<{wide}}")
                continue
            try:
                cells.append(f.format(v) if v is not None and not (isinstance(v, float) and np.isnan(v))
                             else f"{'n/a':>{len(f.format(0.0)) if 'd' not in f else 5}}")
            except (ValueError, TypeError):
                cells.append(str(v))
        lines.append(" ".join(cells))
    return "\n".join(lines)


def write_outputs(out: Path, summaries: list[dict], results: list, meta: dict) -> list[Path]:
    """Write ``summary.json``, ``jct_cdf.png`` and ``utilisation.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "summary.json"]
    paths[0].write_text(json.dumps({"meta": meta, "policies": summaries}, indent=2, default=float))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return paths
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        done = ~np.isnan(r.completion_s)
        jct = np.sort((r.completion_s[done] - r.arrival_s[done]) / 3600)
        if len(jct):
            ax.plot(jct, np.arange(1, len(jct) + 1) / len(jct), label=r.policy)
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (h, log)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title(f"JCT CDF - {meta.get('gpus')} GPUs, training load {meta.get('offered_load', 0):.2f}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "jct_cdf.png", dpi=120)
    plt.close(fig)
    fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for r in results:
        if len(r.timeline):
            axes[0].plot(r.timeline[:, 0] / 3600, r.timeline[:, 1], label=r.policy, lw=0.8)
            axes[1].plot(r.timeline[:, 0] / 3600, r.timeline[:, 2], label=r.policy, lw=0.8)
    axes[0].set_ylabel("allocated")
    axes[1].set_ylabel("effective")
    axes[1].set_xlabel("time (h)")
    axes[0].legend(fontsize=7, ncol=3)
    for a in axes:
        a.grid(alpha=0.3)
        a.set_ylim(0, 1.05)
    fig.suptitle("GPU utilisation over time")
    fig.tight_layout()
    fig.savefig(out / "utilisation.png", dpi=120)
    plt.close(fig)
    return paths + [out / "jct_cdf.png", out / "utilisation.png"]


def write_work_plot(path: Path, summaries: list[dict], ceiling: dict, title: str = "") -> Path | None:
    """Bar chart of each policy's normalised work/h against the workload's ceiling (``throughput_ceiling``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [s["policy"] for s in summaries]
    vals = [s["work_gpu_h_per_h"] for s in summaries]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar(range(len(vals)), vals, color=["tab:red" if n == "elastico" else "tab:blue" for n in names])
    ax.axhline(ceiling["work_gpu_h_per_h"], color="k", ls="--", lw=1, label="ceiling (every job alone from arrival)")
    ax.set_xticks(range(len(vals)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("normalised work (isolated GPU-h) per hour")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
