"""Resource Shape Transformation: a job's family of feasible shapes and the speed it reaches in each.

Model of throughput versus CUDA MPS compute share (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``): a job alone
that needs ``u`` of a GPU (its solo utilisation, :mod:`profiles`) runs at full speed with any share
``>= u`` and proportionally slower below it,

    speed(share) = min(1, share / u)          (share and u as fractions of one GPU)

i.e. throughput saturates at the share its solo utilisation needs. Source of the shape: MPS limits the
SMs a client may occupy, so a kernel stream that keeps only ``u`` of the SMs busy is unaffected by a cap
above ``u`` and becomes SM-bound below it (the NVIDIA MPS documentation's "active thread percentage"
semantics); the linear part is an assumption, replaceable by measured share sweeps.

Shapes: shares from :data:`SHARES_PCT` (25/50/75/100 %), the job's requested GPU count (Philly jobs
are data-parallel gangs whose batch size and step count assume that count, so the count is kept; the
shape family is a per-GPU share family), memory limit proportional to the share (Gavel has no memory
profile; the pinned-memory limit is ``share x GPU memory``). A training shape is feasible only if its
speed stays at or above the slowdown floor ``1 / max_slowdown``. Inference shapes are sized from
demand (:mod:`services.allocator.policy.inference`).
"""

from __future__ import annotations

import numpy as np

from elastico.domain import Shape

#: MPS compute shares offered as shapes, percent of one GPU (ascending: ties pick the smaller share).
SHARES_PCT: tuple[int, ...] = (25, 50, 75, 100)

#: Memory of the default simulated GPU (V100 16 GB), MiB.
DEFAULT_GPU_MEM_MIB = 16384


def share_speed(share_pct: np.ndarray | float, solo_util: np.ndarray | float) -> np.ndarray:
    """Fraction of isolated speed a job keeps under an MPS share (saturating model above).

    Args:
        share_pct: MPS share, percent of one GPU.
        solo_util: solo utilisation, fraction of one GPU (> 0).

    Returns:
        Speed fraction in (0, 1].
    """
    s = np.asarray(share_pct, float) / 100.0
    return np.minimum(1.0, s / np.maximum(np.asarray(solo_util, float), 1e-6))


def training_shapes(num_gpus: int, solo_util: float, iso_tput_steps_s: float, min_speed: float = 0.5,
                    gpu_type: str = "", gpu_mem_mib: int = DEFAULT_GPU_MEM_MIB,
                    shares_pct: tuple[int, ...] = SHARES_PCT) -> tuple[Shape, ...]:
    """Feasible shapes of a training job, smallest share first.

    Args:
        num_gpus: the job's gang size.
        solo_util: its solo utilisation (fraction of a GPU).
        iso_tput_steps_s: isolated throughput at ``num_gpus`` whole GPUs, steps/s.
        min_speed: slowdown floor, fraction of isolated speed a shape must keep (``1/max_slowdown``).
        gpu_type: GPU type of the shapes ("" = any).
        gpu_mem_mib: memory of one GPU, MiB.
        shares_pct: candidate shares, percent.

    Returns:
        Shapes whose speed is >= ``min_speed``; the 100 % shape is always included.
    """
    out = []
    for s in shares_pct:
        sp = float(share_speed(s, solo_util))
        if sp + 1e-9 >= min_speed or s == 100:
            out.append(Shape(num_gpus=num_gpus, compute_share_pct=float(s), mem_mib=int(gpu_mem_mib * s // 100),
                             gpu_type=gpu_type, throughput=iso_tput_steps_s * sp))
    return tuple(out)


def shape_speed_table(solo_util: np.ndarray, min_speed: float,
                      shares_pct: tuple[int, ...] = SHARES_PCT) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised shape family for many jobs at once (what a scheduling round uses).

    Args:
        solo_util: [J] solo utilisations.
        min_speed: slowdown floor.
        shares_pct: candidate shares.

    Returns:
        (speed [J, S], feasible [J, S] bool) over ``shares_pct``; the 100 % column is always feasible.
    """
    sh = np.asarray(shares_pct, float)[None, :]
    speed = share_speed(sh, np.asarray(solo_util, float)[:, None])
    ok = (speed + 1e-9 >= min_speed) | (sh >= 100.0)
    return speed, ok
