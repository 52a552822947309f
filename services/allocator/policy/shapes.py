"""Resource Shape Transformation: a job's family of feasible shapes and the speed it reaches in each.

Model of throughput versus CUDA MPS compute share (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``): a job alone
that needs ``u`` of a GPU (its solo utilisation, :mod:`profiles`) runs at full speed with any share
``>= u`` and proportionally slower below it,

    speed(share) = min(1, share / u)          (share and u as fractions of one GPU)

i.e. throughput saturates at the share its solo utilisation needs. Source of the shape: MPS limits the
SMs a client may occupy, so a kernel stream that keeps only ``u`` of the SMs busy is unaffected by a cap
above ``u`` and becomes SM-bound below it (the NVIDIA MPS documentation's "active thread percentage"
semantics); the linear part is an assumption, replaceable by measured share sweeps. A share is such a limit
only on a GPU that hosts an inference service (:func:`elastico.coloc.rates.limited_slots`); training tenants of
a GPU without one run unlimited, and their share (at least :data:`UNLIMITED_MIN_SHARE_PCT`) is the slice they
reserve: memory and the GPU's capacity account.

Shapes: shares from :data:`SHARES_PCT` (25/50/75/100 %) at the job's requested GPU count, plus
GPU-count shapes -- the same job on halvings of its gang or grown up to its type's largest measured count
-- whose speed comes from measured scaling curves (:func:`count_speed`, :func:`allowed_counts`; the
policy decides when to use them, and only at counts the view allows a job: :func:`gang_sizes`, which the
live allocator fills with its declared counts or its request), memory limit proportional to the share (Gavel has no memory
profile; the pinned-memory limit is ``share x GPU memory``). A training shape is feasible only if its
speed stays at or above the slowdown floor ``1 / max_slowdown``. Inference shapes are sized from
demand (:mod:`services.allocator.policy.inference`).

Declared shapes: a job may declare its own shape family (``JobSpec.shapes``). Then *that* family is the
job's, for every policy: the live allocator's view carries it (:class:`DeclaredJobTable`, built by
``plan.build_view``), a policy plans such a job only with one of its declared shares on a declared GPU count
(:func:`declared_share`, :func:`declared_options`) instead of its own menu (the shares above, a policy's 50 %
replicas or whole GPUs, inference 5 % steps, GPU-count shapes), and ``plan.translate`` commits exactly the
declared shape (share, memory, ``shape_index`` into the declared list) or nothing. The simulator's plain
``JobTable`` declares nothing, so every helper here answers the policy's own choice for it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from elastico.coloc.profiles import TypeTable
from elastico.coloc.rates import share_speed
from elastico.domain import SHARES_PCT, Shape
from services.allocator.policy.view import TRAINING, JobTable

#: Memory of the default simulated GPU (V100 16 GB), MiB.
DEFAULT_GPU_MEM_MIB = 16384
#: The smallest share a training job holds on a GPU without a service, where shares are slices (memory, the
#: capacity account) and not compute limits: at most two such tenants share a GPU, as the measured pairs ran.
UNLIMITED_MIN_SHARE_PCT = 50.0


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


def shape_speed_table(solo_util: np.ndarray, min_speed: float, shares_pct: tuple[int, ...] = SHARES_PCT,
                      unlimited_training: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised shape family of training jobs for many jobs at once (what a scheduling round uses).

    A share of at least :data:`UNLIMITED_MIN_SHARE_PCT` is the slice a job may hold on a GPU without a
    service, where it runs unlimited (:func:`elastico.coloc.rates.limited_slots`): full speed alone. A smaller
    share is a compute limit, taken only next to a service: ``share_speed``. Every share is a limit without
    ``unlimited_training``.

    Args:
        solo_util: [J] solo utilisations.
        min_speed: slowdown floor.
        shares_pct: candidate shares.

    Returns:
        (speed [J, S], feasible [J, S] bool) over ``shares_pct``; 100 % (and, unlimited, shares of at least
        ``UNLIMITED_MIN_SHARE_PCT``) always feasible.
    """
    sh = np.asarray(shares_pct, float)[None, :]
    unlimited = sh >= (UNLIMITED_MIN_SHARE_PCT if unlimited_training else np.inf)
    speed = np.where(unlimited, 1.0, share_speed(sh, np.asarray(solo_util, float)[:, None]))
    ok = (speed + 1e-9 >= min_speed) | unlimited | (sh >= 100.0)
    return speed, ok


def relative_tput(scale_row: np.ndarray, n) -> np.ndarray:
    """Relative isolated throughput at ``n`` GPUs from ``TypeTable.scale_tput`` rows.

    ``scale_row`` is one row ``[4]`` (``n`` any shape) or rows ``[J, 4]`` with ``n`` of shape ``[J, C]``.
    Piecewise-linear between the measured counts 1/2/4/8, linear beyond 8 (``T(8) n / 8``).
    """
    from elastico.coloc.profiles import SCALE_COUNTS

    xs = np.asarray(SCALE_COUNTS, float)
    row = np.asarray(scale_row, float)
    n = np.asarray(n, float)
    k = np.clip(np.searchsorted(xs, n, side="right") - 1, 0, len(xs) - 2)
    if row.ndim == 1:
        y0, y1, last = row[k], row[k + 1], row[-1]
    else:
        y0, y1, last = np.take_along_axis(row, k, -1), np.take_along_axis(row, k + 1, -1), row[:, -1:]
    x0 = xs[k]
    inside = y0 + (y1 - y0) * (np.minimum(n, xs[-1]) - x0) / (xs[k + 1] - x0)
    return np.where(n > xs[-1], last * n / xs[-1], inside)


def count_speed(scale_row: np.ndarray, n_run, n_req) -> np.ndarray:
    """Fraction of its isolated speed (at ``n_req`` GPUs) a data-parallel job reaches on ``n_run`` GPUs.

    ``T(n_run) / T(n_req)`` with ``T`` the job type's measured throughput curve (:mod:`profiles`, samples
    per second at a fixed per-GPU batch), read pessimistically: shrinking (``n_run < n_req``) is never
    faster than the request nor slower than linear scaling, ``clip(ratio, n_run / n_req, 1)``; growing is
    never slower than the request nor faster than linear, ``clip(ratio, 1, n_run / n_req)`` (a curve that
    looks super-linear is capped). The job processes the same samples to completion whatever its count
    (elastic data parallelism keeps the global batch by gradient accumulation, or re-scales it as
    elastic trainers do), so its progress rate is this ratio. Shrinking pays off where the curve is
    sub-linear: Gavel's ResNet-50 (batch 16) runs 2.44x faster on 8 V100s than on one, so on one GPU it
    keeps 0.41 of its 8-GPU speed with an eighth of the GPUs.
    """
    n_run = np.asarray(n_run, float)
    n_req = np.asarray(n_req, float)
    ratio = relative_tput(scale_row, n_run) / np.maximum(relative_tput(scale_row, n_req), 1e-12)
    lin = n_run / np.maximum(n_req, 1.0)
    return np.where(n_run <= n_req, np.clip(ratio, lin, 1.0), np.clip(ratio, 1.0, lin))


def min_count(n_req: np.ndarray) -> np.ndarray:
    """Smallest entry of :func:`count_options` for each requested gang size (vectorised)."""
    n = np.asarray(n_req, np.int64)
    return n // np.minimum(n & -n, 8)


def count_options(n_req: int, max_halvings: int = 3) -> tuple[int, ...]:
    """GPU counts a job asking for ``n_req`` may shrink to: itself and its halvings (at most ``max_halvings``)."""
    out = [int(n_req)]
    n = int(n_req)
    while len(out) <= max_halvings and n % 2 == 0 and n > 1:
        n //= 2
        out.append(n)
    return tuple(out)


def grow_options(n_req: int, measured_row: np.ndarray | None) -> tuple[int, ...]:
    """GPU counts above ``n_req`` a job may grow to: measured counts of its type (ascending), none if the
    request itself is not a measured count (no extrapolation of a scaling curve upwards)."""
    from elastico.coloc.profiles import SCALE_COUNTS

    if measured_row is None or int(n_req) not in SCALE_COUNTS or not measured_row[SCALE_COUNTS.index(int(n_req))]:
        return ()
    return tuple(c for c, m in zip(SCALE_COUNTS, measured_row) if c > n_req and m)


def allowed_counts(n_req: int, measured_row: np.ndarray | None) -> tuple[int, ...]:
    """Every GPU count a training job may run at (:func:`count_options` and :func:`grow_options`)."""
    return count_options(n_req) + grow_options(n_req, measured_row)


@functools.lru_cache(maxsize=4096)
def _menu_counts(n_req: int, measured: tuple[bool, ...] | None) -> tuple[int, ...]:
    return allowed_counts(n_req, None if measured is None else np.asarray(measured, bool))


def gang_sizes(jobs: JobTable, j: int) -> tuple[int, ...] | None:
    """GPU counts job ``j`` may run at; None when the table leaves them to the policy's own GPU-count shapes
    (``JobTable.gang_sizes``)."""
    sizes = jobs.gang_sizes
    return None if sizes is None else sizes[j]


def size_allowed(jobs: JobTable, j: int, n: int) -> bool:
    """True when job ``j`` may run on ``n`` GPUs as far as the table says (:func:`gang_sizes`)."""
    sizes = jobs.gang_sizes
    return sizes is None or n in sizes[j]


def sizes_of(jobs: JobTable, types: TypeTable, j: int) -> tuple[int, ...]:
    """Every GPU count job ``j`` may run at: the table's (:func:`gang_sizes`), else the widest menu a policy
    offers it (training: :func:`allowed_counts` of its type's measured counts; a service: one GPU)."""
    sizes = jobs.gang_sizes
    if sizes is not None:
        return sizes[j]
    if jobs.kind[j] != TRAINING:  # a service runs on one GPU
        return (1,)
    measured = types.scale_measured
    row = None if measured is None else tuple(bool(m) for m in measured[int(jobs.type_idx[j])])
    return _menu_counts(int(jobs.num_gpus[j]), row)


# --------------------------------------------------------------------------------------------------
# Declared shapes (see the module docstring)


@dataclass(frozen=True)
class DeclaredJobTable(JobTable):
    """A :class:`JobTable` whose jobs may declare their own shapes (the live allocator's view).

    ``declared[j]``: job ``j``'s declared shapes in the order it gave them (a placement's ``shape_index``
    indexes this tuple), ``()`` for a job shaped by the policy. ``any_declared``: some job declares shapes
    (policies skip every declared-shape check when it is False).
    """

    declared: tuple[tuple[Shape, ...], ...] = ()
    any_declared: bool = False


def shapes_of(jobs: JobTable, j: int) -> tuple[Shape, ...]:
    """Job ``j``'s declared shapes, ``()`` when it declares none (or the table carries none)."""
    d = getattr(jobs, "declared", ())
    return d[j] if 0 <= j < len(d) else ()


def any_declared(jobs: JobTable) -> bool:
    """True when some job of the table declares its shapes."""
    return bool(getattr(jobs, "any_declared", False))


def declared_shares(jobs: JobTable, j: int, n: int) -> tuple[float, ...]:
    """Distinct declared shares of job ``j`` on ``n`` GPUs, ascending (``()``: none declared on ``n``)."""
    return tuple(sorted({float(s.compute_share_pct) for s in shapes_of(jobs, j) if s.num_gpus == n}))


def declared_counts(jobs: JobTable, j: int) -> tuple[int, ...]:
    """Distinct declared GPU counts of job ``j``, descending (its requested gang first)."""
    return tuple(sorted({int(s.num_gpus) for s in shapes_of(jobs, j)}, reverse=True))


def declared_share(jobs: JobTable, j: int, n: int, want: float) -> float | None:
    """The share a policy places job ``j`` with on ``n`` GPUs when it would give it ``want`` percent.

    A job without declared shapes gets ``want``. A declaring job gets the declared share on ``n`` GPUs
    nearest ``want`` from above (the smallest that still grants what the policy meant), else its largest
    one (e.g. a whole-GPU policy's 100 % -> the largest declared share); None when it declares no shape on
    ``n`` GPUs (the placement must not happen).
    """
    if not shapes_of(jobs, j):
        return float(want)
    sh = declared_shares(jobs, j, n)
    if not sh:
        return None
    return next((s for s in sh if s >= want - 1e-9), sh[-1])


def declared_options(jobs: JobTable, j: int) -> tuple[tuple[int, float], ...]:
    """Job ``j``'s declared (GPU count, share) pairs, requested gang first, shares ascending, no repeats."""
    return tuple(sorted({(int(s.num_gpus), float(s.compute_share_pct)) for s in shapes_of(jobs, j)},
                        key=lambda o: (-o[0], o[1])))


def declared_matches(shapes: tuple[Shape, ...], n: int, share_pct: float) -> list[int]:
    """Indices of the declared shapes on ``n`` GPUs with MPS share ``share_pct`` (declared order)."""
    return [i for i, s in enumerate(shapes) if s.num_gpus == n and abs(s.compute_share_pct - share_pct) < 1e-6]


def declared_util_cap(shapes: tuple[Shape, ...]) -> float:
    """Utilisation a job of declared shapes can reach: its largest declared share (fraction of a GPU); inf
    when it declares none. MPS caps the job at its share, so the policy reads its speed relative to its best
    declared shape (``share_speed(best, cap) = 1``) rather than to a whole GPU it never asked for."""
    return max((s.compute_share_pct for s in shapes), default=np.inf) / 100.0
