"""Trace loading: every record is mapped to a simulated job explicitly (documented here).

Training (``gavel_philly_vc_traces_seed0.csv`` schema: ``vc, job_index, job_type, model, batch_size,
num_gpus, arrival_time_s, total_steps, duration_v100_s_derived``):

* one row -> one training job of ``job_type`` with gang size ``num_gpus``, arriving at ``arrival_time_s``
  (sorted, shifted so the first kept arrival is 0);
* isolated run time on its ``num_gpus`` V100s = ``duration_v100_s_derived`` when present, else
  ``total_steps / isolated 1-GPU throughput`` of its type. We do *not* rescale by Gavel's multi-GPU
  throughput entries (they are anomalous, e.g. super-linear 2-GPU ResNet-18, and absent above 8 GPUs):
  the Philly duration is the job's run time at its requested size, whatever the size (so >8-GPU jobs
  need no extrapolation). Work is counted in *isolated GPU-seconds* (``num_gpus x duration``).
* unknown ``job_type`` -> the first known type of the same ``model`` family, else the type with the
  median solo utilisation (counted in ``TrainingJobs.unknown_types``; ``python -m simulator`` prints how
  many, and how many jobs need more GPUs than the cluster has -- those are reported unfinished).
* Required columns: ``arrival_time_s``, ``job_type``, ``num_gpus`` (numbers >= 0), and a positive
  ``duration_v100_s_derived`` or ``total_steps`` per row; anything else is a :class:`TraceError` naming
  the file, line and column (the CLIs print it and exit 2), never a traceback or a silently dropped job.
* ``--redraw-types SEED`` (:func:`redraw_job_types`) deals the rows' jobs out again: the job columns
  (:data:`JOB_COLUMNS`: type, model, batch size, steps, duration) are permuted across the file's rows by
  ``numpy.random.default_rng(SEED)``, arrivals and GPU counts kept -- a job-type draw nothing was tuned on,
  reproducible from its seed.
* ``--window START END`` keeps arrivals in [START, END) seconds of the original trace; ``--max-jobs N``
  keeps the first N of those; ``--load X`` rescales inter-arrival times so the *training* offered load
  (isolated GPU-seconds / (training GPUs x arrival span)) equals X. Training GPUs are the GPUs static
  allocation leaves to training: all GPUs minus the time-averaged number of live inference services (each
  holds a whole GPU under static allocation), so load 1 is where static allocation just saturates,
  whatever the inference share (:func:`static_inference_gpus`).

Inference services (optional; only when ``--inference-trace`` files are given):

* Alibaba 2025 DLRM instances (``instance_sn,...,creation_time,deletion_time``): one instance -> one
  1-GPU service. Missing creation = existed before the trace (starts at 0); missing deletion = lives to
  the trace's end. The trace's time range is mapped linearly onto the training arrival span, so a service
  ends at the latest with the loaded period: the trace says nothing after its end, and services kept
  forever would hold GPUs through the whole drain (at an inference share of 0.8 they leave no whole node
  free, so a gang that needs one would never start under any exclusive policy). Instances are drawn
  (seeded shuffle) until the peak number of concurrently live services reaches
  ``inference_fraction x GPUs`` (default 0.25).
* Request demand shape: Azure LLM inference traces (code: bursty, conversation: steady), request
  counts per 60 s bin, normalised to a peak of 1, looped; each service gets one of them (seeded) and a
  random phase.
* Inference share from data (:func:`ls_gpu_share`): in the Alibaba 2023 ``openb`` pod list, the share of
  the requested GPU (``num_gpu x gpu_milli``) held by latency-sensitive (``qos = LS``) pods, by pod count
  and weighted by each pod's scheduled lifetime (``deletion_time - scheduled_time``; pods never scheduled
  count zero). The lifetime-weighted value is GPU-time held, the quantity an inference share of a cluster
  means; the headline runs at it.
* Peak load: Alibaba 2023 ``openb`` latency-sensitive 1-GPU pods' ``gpu_milli`` (the GPU fraction an
  operator sizes a latency-sensitive pod for) is read as the share the service needs at its peak
  minute; its peak load is that minus the SLO margin (:mod:`services.allocator.policy.inference`).
  Without the pod file every service needs a whole GPU at peak.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from elastico.coloc.profiles import TraceError, TypeTable, csv_text
from services.allocator.policy.forecast import BIN_S as FORECAST_BIN_S
from services.allocator.policy.inference import slo_margin

BIN_S = FORECAST_BIN_S  # demand profile resolution, s: the forecaster's bins
# the columns that describe a training row's job (what it runs and for how long), as against when it arrives
# and on how many GPUs: what --redraw-types permutes
JOB_COLUMNS = ("job_type", "model", "batch_size", "total_steps", "duration_v100_s_derived")


@dataclass
class TrainingJobs:
    """Training jobs of one run, sorted by arrival."""

    arrival_s: np.ndarray  # [J] float, s
    type_idx: np.ndarray  # [J] int, row of the TypeTable
    num_gpus: np.ndarray  # [J] int
    duration_s: np.ndarray  # [J] float, isolated run time at num_gpus, s
    native_offered_load: float  # training offered load of the kept jobs before --load rescaling
    offered_load: float  # training offered load after rescaling
    unknown_types: int  # rows whose job_type was mapped to another type


@dataclass
class InferenceServices:
    """Inference services of one run."""

    start_s: np.ndarray  # [I] float, creation, s
    end_s: np.ndarray  # [I] float, deletion, s (at most the end of the arrival span)
    peak_load: np.ndarray  # [I] float, load at the profile's peak minute (fraction of one GPU)
    profile: np.ndarray  # [I] int, index into profiles
    phase_bin: np.ndarray  # [I] int, profile offset, bins
    profiles: list  # list of [P] float arrays, normalised per-bin demand (max 1)
    names: list  # profile names

    def demand(self, i: int) -> np.ndarray:
        """[P] load of service ``i`` per bin of its (looped) profile, fraction of one GPU."""
        return self.peak_load[i] * self.profiles[self.profile[i]]

    def mean_load(self) -> np.ndarray:
        """[I] each service's mean load over its profile, fraction of one GPU."""
        return np.array([self.demand(i).mean() for i in range(len(self.start_s))])


TRAINING_COLUMNS = ("arrival_time_s", "job_type", "num_gpus")  # plus a duration: see load_training


def _line(row: dict, col: str) -> int:
    """The file line ``row[col]`` was read from: a redrawn job's columns keep the line they came from."""
    return row.get("_job_line", row["_line"]) if col in JOB_COLUMNS else row["_line"]


def _number(path, row: dict, col: str) -> float:
    """``row[col]`` as a finite number >= 0, or a :class:`TraceError` naming the file, line and column."""
    try:
        x = float(row[col])
    except (TypeError, ValueError):
        x = float("nan")
    if not (np.isfinite(x) and x >= 0):
        raise TraceError(f"{path}:{_line(row, col)}: column {col} must be a finite number >= 0, got {row[col]!r}")
    return x


def _optional(path, row: dict, col: str) -> float:
    """``row[col]`` as a number, NaN when the column is absent or empty; text is a :class:`TraceError`."""
    v = (row.get(col) or "").strip()
    try:
        return float(v) if v else float("nan")
    except ValueError:
        raise TraceError(f"{path}:{_line(row, col)}: column {col} must be a number or empty, got {v!r}") from None


def redraw_job_types(rows: list[dict], seed: int) -> list[dict]:
    """The rows (in file order) with their :data:`JOB_COLUMNS` permuted across rows by
    ``numpy.random.default_rng(seed)``; every other column (arrival, GPU count, ...) stays with its row. A row's
    ``_line``, where present, comes along as ``_job_line`` (errors in a job column name the line it came from)."""
    perm = np.random.default_rng(seed).permutation(len(rows))
    out = []
    for r, k in zip(rows, perm.tolist()):
        src = rows[k]
        job = {c: src[c] for c in JOB_COLUMNS if c in src}
        if "_line" in src:
            job["_job_line"] = src["_line"]
        out.append({**r, **job})
    return out


def load_training(path: str | Path, types: TypeTable, gpus: float, window: tuple[float, float] | None = None,
                  max_jobs: int | None = None, load: float | None = None,
                  redraw_seed: int | None = None) -> TrainingJobs:
    """Read a training trace (schema above) into arrays; see the module docstring for the mapping.

    ``gpus`` is the capacity the offered load is counted against (the training GPUs, module docstring);
    ``redraw_seed``: the job columns dealt out again first (:func:`redraw_job_types`).
    """
    with csv_text(path) as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in TRAINING_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{path}: missing column(s) {', '.join(missing)} (need {', '.join(TRAINING_COLUMNS)}"
                             f" and duration_v100_s_derived or total_steps)")
        rows = list(reader)
    if not rows:
        raise TraceError(f"{path}: no data rows")
    for i, r in enumerate(rows):
        r["_line"] = i + 2  # 1-based, after the header: what an operator finds in an editor
    if redraw_seed is not None:
        rows = redraw_job_types(rows, redraw_seed)
    arr = np.array([_number(path, r, "arrival_time_s") for r in rows])
    order = np.argsort(arr, kind="stable")
    rows = [rows[i] for i in order]
    arr = arr[order]
    if window is not None:
        keep = (arr >= window[0]) & (arr < window[1])
        rows = [r for r, k in zip(rows, keep) if k]
        arr = arr[keep]
    if max_jobs is not None:
        rows, arr = rows[:max_jobs], arr[:max_jobs]
    if not rows:
        raise TraceError(f"{path}: no training jobs left after --window/--max-jobs")
    arr = arr - arr[0]
    by_family = {}
    for i, n in enumerate(types.names[:-1]):
        by_family.setdefault(n.split(" (")[0], i)
    med = int(np.argsort(types.solo_util[:-1])[len(types.names[:-1]) // 2])
    tix, unknown, dur, ng = [], 0, [], []
    for r in rows:
        try:
            t = types.index(r["job_type"])
        except KeyError:
            t = by_family.get(r.get("model", "") or r["job_type"].split(" (")[0], med)
            unknown += 1
        tix.append(t)
        ng.append(max(1, int(_number(path, r, "num_gpus"))))
        d = _optional(path, r, "duration_v100_s_derived")
        if not (d > 0):
            d = _optional(path, r, "total_steps") / types.iso_tput_steps_s[t]
            if not (np.isfinite(d) and d > 0):
                raise TraceError(f"{path}:{_line(r, 'duration_v100_s_derived')}: job {r.get('job_index', '?')} has no positive "
                                 f"duration_v100_s_derived, and total_steps ({r.get('total_steps')!r}) cannot "
                                 f"give one for job type {types.names[t]!r}")
        dur.append(d)
    ng = np.array(ng)
    dur = np.array(dur)
    span = float(arr[-1]) if arr[-1] > 0 else float(dur.max())
    native = float((ng * dur).sum() / (gpus * span))
    if load is not None:
        if not load > 0:
            raise TraceError(f"--load must be > 0, got {load}")
        arr = arr * (native / load)
    span2 = float(arr[-1]) if arr[-1] > 0 else span
    return TrainingJobs(arr, np.array(tix), ng, dur, native, float((ng * dur).sum() / (gpus * span2)), unknown)


def ls_gpu_share(path: str | Path) -> dict:
    """Share of the requested GPU held by latency-sensitive pods in an ``openb`` pod list (module docstring).

    Returns:
        ``{"by_count": ..., "by_lifetime": ..., "pods": ...}``.

    Raises:
        TraceError: the file lacks a needed column or holds no GPU request.
    """
    need = ("num_gpu", "gpu_milli", "qos", "scheduled_time", "deletion_time")
    with csv_text(path) as fh:
        rows = csv.DictReader(fh)
        missing = [c for c in need if c not in (rows.fieldnames or [])]
        if missing:
            raise TraceError(f"{path}:1: pod list lacks column(s) {', '.join(missing)}")
        gpu, life, ls = [], [], []
        for r in rows:
            r["_line"] = rows.line_num
            gpu.append(_number(path, r, "num_gpu") * _number(path, r, "gpu_milli") / 1000.0)
            t0, t1 = _optional(path, r, "scheduled_time"), _optional(path, r, "deletion_time")
            life.append(max(t1 - t0, 0.0) if np.isfinite(t0) and np.isfinite(t1) else 0.0)
            ls.append(r["qos"] == "LS")
    gpu, life, ls = np.array(gpu), np.array(life), np.array(ls, bool)
    if not gpu.sum() > 0 or not (gpu * life).sum() > 0:
        raise TraceError(f"{path}: no pod requests a GPU for a scheduled lifetime")
    return {"by_count": float(gpu[ls].sum() / gpu.sum()),
            "by_lifetime": float((gpu * life)[ls].sum() / (gpu * life).sum()), "pods": int(len(gpu))}


def static_inference_gpus(inf: InferenceServices | None, span_s: float) -> float:
    """Time-averaged number of live inference services over [0, ``span_s``]: the GPUs static allocation
    (a whole GPU per service) keeps from training on average."""
    if inf is None or len(inf.start_s) == 0 or not span_s > 0:
        return 0.0
    lo = np.clip(inf.start_s, 0.0, span_s)
    hi = np.clip(inf.end_s, 0.0, span_s)
    return float(np.maximum(hi - lo, 0.0).sum() / span_s)


def azure_profile(path: str | Path) -> np.ndarray:
    """[P] per-``BIN_S`` request counts of an Azure LLM inference trace (``TIMESTAMP`` column), normalised to a
    peak of 1; the last, partial bin is dropped. The shape services loop (module docstring)."""
    with csv_text(path) as fh:
        stamps = [(r["TIMESTAMP"] or "").strip()[:26] for r in csv.DictReader(fh)]  # microseconds: numpy parses 6 digits
    try:
        t = np.array(stamps, dtype="datetime64[us]")
    except ValueError as exc:
        raise TraceError(f"{path}: TIMESTAMP is not a date and time ({exc})") from exc
    if len(t) == 0:
        raise TraceError(f"{path}: no requests")
    nat = np.isnat(t)  # an empty or "NaT" field parses without an error
    if nat.any():
        raise TraceError(f"{path}:{int(np.argmax(nat)) + 2}: TIMESTAMP is not a date and time")
    c = np.bincount(((t - t.min()) // np.timedelta64(int(BIN_S * 1e6), "us")).astype(int)).astype(float)
    if len(c) > 2:  # the last bin is partial
        c = c[:-1]
    return c / c.max()


def _header(path: Path) -> list[str]:
    with csv_text(path) as fh:
        return next(csv.reader(fh), [])  # (an empty file: no header, an unrecognised one)


def load_inference(paths: list[str | Path], gpus: int, span_s: float, seed: int,
                   inference_fraction: float = 0.25, slo_factor: float = 10.0) -> InferenceServices | None:
    """Build inference services from the given files (detected by header); None when no file is given.

    The instance file (``instance_sn``) gives the services and their lifetimes; the Azure profiles and the pod
    list only shape their demand, so without it the services would silently be none: that is an error."""
    inst, profs, names, need = None, [], [], None
    for p in map(Path, paths):
        h = _header(p)
        if "instance_sn" in h:
            with csv_text(p) as fh:
                inst = list(csv.DictReader(fh))
        elif "TIMESTAMP" in h:
            profs.append(azure_profile(p))
            names.append(p.stem)
        elif "gpu_milli" in h:
            with csv_text(p) as fh:
                need = np.array([int(r["gpu_milli"]) / 1000.0 for r in csv.DictReader(fh)
                                 if r["qos"] == "LS" and r["num_gpu"] == "1" and int(r["gpu_milli"]) > 0])
        else:
            raise TraceError(f"{p}: unrecognised inference trace header {h[:4]}")
    if inst is None:
        if paths:
            raise TraceError(f"inference traces {', '.join(Path(p).name for p in paths)}: none is an instance file "
                             "(alibaba2025_dlrm_inference_gpu_instances.csv schema, column instance_sn), which gives "
                             "the services and their lifetimes; the others only shape their demand")
        return None
    if not profs:
        profs, names = [np.ones(60)], ["flat"]
    rng = np.random.default_rng(seed)
    c = np.array([float(r["creation_time"] or "nan") for r in inst])
    d = np.array([float(r["deletion_time"] or "nan") for r in inst])
    lo = np.nanmin(np.concatenate([c, d]))
    hi = np.nanmax(np.concatenate([c, d]))
    start = np.where(np.isnan(c), 0.0, (c - lo) / (hi - lo) * span_s)
    end = np.where(np.isnan(d), span_s, (d - lo) / (hi - lo) * span_s)
    perm = rng.permutation(len(inst))
    target = max(1, int(round(inference_fraction * gpus)))

    def peak(m: int) -> int:
        s, e = start[perm[:m]], end[perm[:m]]
        ev = np.concatenate([np.stack([s, np.ones(m)], 1), np.stack([e, -np.ones(m)], 1)])
        ev = ev[np.lexsort((ev[:, 1], ev[:, 0]))]
        return int(np.cumsum(ev[:, 1]).max())

    lo_m, hi_m = 1, len(inst)
    while lo_m < hi_m:  # largest prefix whose peak concurrency <= target
        mid = (lo_m + hi_m + 1) // 2
        if peak(mid) <= target:
            lo_m = mid
        else:
            hi_m = mid - 1
    sel = perm[:lo_m]
    m = len(sel)
    if need is None or len(need) == 0:
        need_s = np.ones(m)
    else:
        need_s = rng.choice(need, size=m)
    prof = rng.integers(0, len(profs), size=m)
    phase = np.array([rng.integers(0, len(profs[k])) for k in prof])
    peak_load = np.clip(need_s - slo_margin(slo_factor), 0.02, None)
    return InferenceServices(start[sel], end[sel], peak_load, prof, phase, profs, names)
