"""PNG plots of ``make demo`` (matplotlib, Agg backend): utilisation over time per policy, and per inference
service its demand, committed share and p99 latency against its SLO, for every policy, live next to simulated.

Inputs are plain arrays (model-time seconds), so the module does no I/O beyond writing the files it is asked to.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

COLORS = {"elastico": "tab:red", "exclusive-fifo": "tab:blue"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _color(policy: str) -> str:
    return COLORS.get(policy, "tab:gray")


def util_over_time(path: Path, live: dict[str, np.ndarray], sim: dict[str, np.ndarray], window_end_s: float) -> Path:
    """Allocated and effective utilisation over time per policy: ``live``/``sim`` map a policy to its timeline
    ``[n, 3]`` (model s, allocated fraction, effective fraction); the loaded period ends at ``window_end_s``."""
    plt = _plt()
    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for pol, tl in live.items():
        if len(tl):
            axes[0].plot(tl[:, 0] / 3600, tl[:, 1], color=_color(pol), lw=1.0, label=f"{pol} live")
            axes[1].plot(tl[:, 0] / 3600, tl[:, 2], color=_color(pol), lw=1.0, label=f"{pol} live")
    for pol, tl in sim.items():
        if len(tl):
            axes[0].step(tl[:, 0] / 3600, tl[:, 1], where="post", color=_color(pol), lw=0.8, ls="--", label=f"{pol} sim")
            axes[1].step(tl[:, 0] / 3600, tl[:, 2], where="post", color=_color(pol), lw=0.8, ls="--", label=f"{pol} sim")
    for ax, name in zip(axes, ("allocated share", "effective utilisation"), strict=True):
        ax.axvline(window_end_s / 3600, color="k", lw=0.8, ls=":")
        ax.set_ylabel(name)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    axes[1].set_xlabel("trace time (h); dotted: last training arrival (end of the loaded period)")
    fig.suptitle("GPU utilisation over time (fraction of all GPUs)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def service_plot(path: Path, name: str, slo_ms: float, live: dict[str, dict], sim: dict[str, dict]) -> Path:
    """One service: demand (req/s), committed share (%) and p99 latency (ms, log; live also the mean, which the SLO
    bounds) per ``BIN_S`` window, against its SLO. ``live``/``sim`` map a policy to the windows of :func:`devtools.service_metrics.service_windows` /
    :func:`devtools.demo.sim_service_windows` (keys ``t_s``, ``arrivals_rps``, ``share_pct``, ``p99_ms``)."""
    plt = _plt()
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    shown_demand = False
    for pol, w in sim.items():
        t = w["t_s"] / 3600
        if not shown_demand:
            axes[0].step(t, w["arrivals_rps"], where="post", color="k", lw=1.0, label="demand (trace profile)")
            shown_demand = True
        axes[1].step(t, w["share_pct"], where="post", color=_color(pol), ls="--", lw=0.9, label=f"{pol} sim")
        axes[2].step(t, w["p99_ms"], where="post", color=_color(pol), ls="--", lw=0.9, label=f"{pol} sim p99 (M/M/1)")
    for pol, w in live.items():
        t = w["t_s"] / 3600
        axes[0].step(t, w["arrivals_rps"], where="post", color=_color(pol), lw=0.8, alpha=0.8,
                     label=f"arrivals sent, {pol} run")
        axes[1].step(t, w["share_pct"], where="post", color=_color(pol), lw=1.2, label=f"{pol} live")
        axes[2].step(t, w["p99_ms"], where="post", color=_color(pol), lw=1.2, label=f"{pol} live p99")
        axes[2].step(t, w["mean_ms"], where="post", color=_color(pol), lw=0.7, ls=":", label=f"{pol} live mean")
    axes[2].axhline(slo_ms, color="k", ls=":", lw=1.0, label=f"SLO {slo_ms:.0f} ms (mean latency)")
    axes[0].set_ylabel("requests / s")
    axes[1].set_ylabel("committed share %")
    axes[1].set_ylim(0, 105)
    axes[2].set_ylabel("p99 latency, ms")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("trace time (h)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"inference service {name}: demand, share and latency per minute (model time)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
