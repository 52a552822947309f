"""Per-job-type profiles the policies and the simulator share: isolated speed and solo utilisation.

Why this module exists: shapes (MPS share -> throughput) need to know how much of a GPU a job actually
uses when alone, and the data we ship (Gavel, MIT) has throughputs but no hardware counters. Everything
here is derived from measured files in ``data/`` by documented rules so real counters can replace it.

Assumptions (each one replaceable by a measurement):

* **GPU type.** Policies and the simulator use V100 rows (Philly durations are V100-derived,
  ``duration_v100_s_derived``); other GPU types load the same way by name.
* **Solo utilisation ``u`` of a training job type** (fraction of one GPU's processing capacity it
  consumes alone, in (0, 1]). Fitted from the *measured* co-location pairs of that GPU type
  (``coloc_gavel_pairs.csv``) under a processor-sharing reading of co-location: two tenants whose
  demands fit in one GPU (``u_a + u_b <= 1``) both keep ~1.0 of their isolated speed; when they do not
  fit, the GPU is shared and the pair's total normalised throughput is ``2 / (u_a + u_b)`` (equal
  slow-down). So each measured pair with ``norm_tput_sum = s`` gives one linear equation
  ``u_a + u_b = 2 / s`` (pairs with ``s >= 1.9`` say "fits": ``u_a + u_b = 1``); we solve all of them by
  bounded least squares (``scipy.optimize.lsq_linear``, bounds [0.05, 1]). Failed pairs (OOM) are
  skipped. Types absent from every pair get the median. The result is a *contention footprint*, not an
  NVML counter: e.g. ResNet-50 fits ~1.0 (it slows everything), ResNet-18 batch 16 ~0.35.
* **Throughput versus GPU count** (for shapes that run a data-parallel job on fewer GPUs than it asked
  for): Gavel's measured isolated throughputs at 1/2/4/8 V100s (``scale_factor``), relative to one GPU,
  made monotone (``T(n) = max(T(m), m <= n)``: a measurement where more GPUs ran slower than fewer is read
  as "no faster"), linear where a count is unmeasured (types measured at one GPU only scale linearly:
  shrinking them saves nothing) and linear beyond 8 GPUs (``T(n) = T(8) n / 8``). Growing a gang beyond
  its request is offered only between measured counts (at most 8 GPUs, Gavel's largest). See
  :func:`services.allocator.policy.shapes.count_speed` for how a shrunk job's speed is read from it.
* **Inference services** have no fitted type: their utilisation is their current demand (requests/s
  divided by the rate one whole GPU serves), see :mod:`services.allocator.policy.inference`.
* **A measurement campaign's GPU type** (``bench.gpu_campaign``; its derived tables ``<gpu>_*.csv`` in a
  campaign folder, :func:`campaign_tables`): its isolated table adds that GPU type's training types (one GPU,
  with their ``precision``), its training pairs at MPS 100/100 join the pair fit (pairs at other shares do
  not: a share caps the speed, so they measure the share model, not the contention footprint), and where
  its share curve fitted ``speed = min(1, share / u)`` for a type that ``u`` is the type's solo
  utilisation -- the quantity :func:`elastico.coloc.rates.share_speed` reads, measured rather than
  inferred from pair sums.

This module is pure (csv + numpy + scipy), no gRPC or Redis.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np


class TraceError(ValueError):
    """A trace or measured-data file that cannot be read as documented (the message names the file, line
    and column)."""


def csv_text(path: str | Path) -> io.StringIO:
    """The text of a CSV file, for :mod:`csv` (as ``open(path, newline="")`` gives it): a file that is not UTF-8
    text is a :class:`TraceError` naming it, not a decoding error deep inside a reader."""
    try:
        return io.StringIO(Path(path).read_text(encoding="utf-8"), newline="")
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not a UTF-8 text file (byte {exc.start}: {exc.reason})") from None


#: Project data folder (``data/`` at the repository root).
DATA_DIR = Path(__file__).resolve().parents[2] / "data"

#: GPU counts with measured isolated throughput in Gavel's profiles (columns of ``TypeTable.scale_tput``).
SCALE_COUNTS: tuple[int, ...] = (1, 2, 4, 8)

#: Name of the pseudo job type that stands for every inference service.
INFERENCE_TYPE = "inference"

#: Sub-folder of a data folder where a GPU session commits a campaign's derived tables (read by default
#: only once it holds a provenance file, :func:`default_campaign_dir`).
CAMPAIGN_SUBDIR = "h200"

#: Columns each derived campaign table must have for the loaders (``bench/gpu_campaign/derive.py`` writes more).
CAMPAIGN_COLUMNS: dict[str, tuple[str, ...]] = {
    "isolated_throughputs.csv": ("worker_type", "job_type", "model", "batch_size", "scale_factor",
                                 "isolated_tput", "precision"),
    "coloc_pairs.csv": ("gpu_type", "job_type_a", "job_type_b", "norm_tput_a", "norm_tput_b", "norm_tput_sum",
                        "coloc_failed", "share_a_pct", "share_b_pct"),
    "train_infer_pairs.csv": ("gpu_type", "stage", "job_type_train", "service", "share_train_pct",
                              "share_service_pct", "priority_train", "priority_service", "norm_tput_train",
                              "norm_capacity_service", "failed"),
    "share_curves.csv": ("gpu_type", "workload", "job_type", "kind", "share_pct", "rate", "norm", "u_fit"),
    "point_counters.csv": ("gpu_type", "stage", "label"),
}


@dataclass(frozen=True)
class TypeTable:
    """Job types known to the policies (training types from Gavel plus one inference pseudo-type).

    Index ``i`` of every array refers to ``names[i]``; the inference pseudo-type is always last.
    """

    names: tuple[str, ...]  # job-type names, e.g. "ResNet-50 (batch size 64)"; last = "inference"
    gpu_type: str  # GPU type the numbers refer to, e.g. "v100"
    solo_util: np.ndarray  # [T] float, fraction of one GPU a job of this type uses alone (0, 1]
    iso_tput_steps_s: np.ndarray  # [T] float, isolated 1-GPU throughput, steps/s (NaN unknown; inference NaN)
    fitted: np.ndarray  # [T] bool, True when solo_util came from measured pairs (else the median default)
    #: [T, 4] isolated throughput at SCALE_COUNTS GPUs relative to one GPU (monotone; linear where unmeasured)
    scale_tput: np.ndarray | None = None
    #: [T, 4] bool, True where ``scale_tput`` is a measurement (growing a gang is offered only between these)
    scale_measured: np.ndarray | None = None
    #: [T] precision of each type: "fp32" (Gavel's jobs), a campaign's ``precision`` column ("amp"/"fp32"),
    #: "" for the inference pseudo-type
    precision: tuple[str, ...] | None = None
    # name -> index, cached on the instance by index() (ClassVar so the dataclass makes no field of it)
    _lookup: ClassVar[dict[str, int]]

    def index(self, name: str) -> int:
        """Index of a job type; unknown training types map to the closest family member or raise KeyError."""
        try:
            return self._lookup[name]
        except AttributeError:
            object.__setattr__(self, "_lookup", {n: i for i, n in enumerate(self.names)})
            return self._lookup[name]

    @property
    def inference_index(self) -> int:
        """Index of the inference pseudo-type (last)."""
        return len(self.names) - 1


def _read(path: Path) -> list[dict[str, str]]:
    with csv_text(path) as fh:
        return list(csv.DictReader(fh))


@dataclass(frozen=True)
class CampaignTables:
    """One GPU type's derived tables of a measurement campaign in one folder, named ``<gpu_type>_<table>``
    (``bench/gpu_campaign/derive.py``; ``<gpu_type>_provenance.json`` marks a complete set)."""

    folder: Path
    gpu_type: str  # e.g. "h200", the files' prefix and the ``gpu_type``/``worker_type`` of their rows

    def path(self, table: str) -> Path:
        """The file of ``table`` (a key of :data:`CAMPAIGN_COLUMNS`)."""
        return self.folder / f"{self.gpu_type}_{table}"

    def rows(self, table: str) -> list[dict[str, str]]:
        """The rows of ``table``, each with ``_line`` (its line in the file) added.

        Raises:
            TraceError: the file is missing or lacks a column of :data:`CAMPAIGN_COLUMNS` (file named).
        """
        path = self.path(table)
        try:
            with csv_text(path) as fh:
                reader = csv.DictReader(fh)
                missing = [c for c in CAMPAIGN_COLUMNS[table] if c not in (reader.fieldnames or [])]
                if missing:
                    raise TraceError(f"{path}:1: campaign table lacks column(s) {', '.join(missing)}")
                rows = list(reader)
        except FileNotFoundError:
            raise TraceError(f"{path}: missing, but {self.gpu_type}_provenance.json in {self.folder} says the "
                             f"campaign's tables are here (bench.gpu_campaign.derive writes them together)") from None
        for i, r in enumerate(rows):
            r["_line"] = str(i + 2)
        return rows


def campaign_tables(campaign_dir: Path | str | None) -> tuple[CampaignTables, ...]:
    """The campaign table sets in ``campaign_dir``: one per ``<gpu_type>_provenance.json``, by GPU type.

    None, a missing folder or one without a provenance file hold none (the loaders then read only ``data/``).
    """
    if campaign_dir is None:
        return ()
    folder = Path(campaign_dir)
    if not folder.is_dir():
        return ()
    return tuple(CampaignTables(folder, p.name[: -len("_provenance.json")])
                 for p in sorted(folder.glob("*_provenance.json")))


def default_campaign_dir(data_dir: Path | str = DATA_DIR) -> Path | None:
    """``data_dir/h200`` (:data:`CAMPAIGN_SUBDIR`) when a GPU session has committed campaign tables there
    (a provenance file), else None: what the shipped ground truth, the predictor and the CLIs read by default."""
    folder = Path(data_dir) / CAMPAIGN_SUBDIR
    return folder if campaign_tables(folder) else None


def campaign_number(tables: CampaignTables, table: str, row: dict[str, str], col: str) -> float:
    """``row[col]`` of a campaign table as a float, NaN when empty; text is a :class:`TraceError` naming the
    file, line and column."""
    v = (row.get(col) or "").strip()
    try:
        return float(v) if v else math.nan
    except ValueError:
        raise TraceError(f"{tables.path(table)}:{row.get('_line', '?')}: column {col} must be a number or empty, "
                         f"got {v!r}") from None


def at_full_shares(*shares: float) -> bool:
    """Whether a campaign point ran without MPS limits (every share 100 %, or not recorded)."""
    return all(math.isnan(s) or s == 100.0 for s in shares)


def fit_solo_utilisation(pairs: list[tuple[str, str, float]], names: list[str],
                         fits_threshold: float = 1.9) -> tuple[np.ndarray, np.ndarray]:
    """Fit per-type solo utilisation from measured pair sums (see the module docstring for the model).

    Args:
        pairs: (type_a, type_b, norm_tput_sum) of successfully co-located measured pairs.
        names: the types to fit, in output order.
        fits_threshold: a pair whose normalised sum is at least this is read as "both fit" (sum of utils 1).

    Returns:
        (util [T], fitted [T] bool). Types without any pair get the median of the fitted ones.
    """
    from scipy.optimize import lsq_linear

    ix = {n: i for i, n in enumerate(names)}
    rows, rhs = [], []
    seen = np.zeros(len(names), bool)
    for a, b, s in pairs:
        if a not in ix or b not in ix or not np.isfinite(s) or s <= 0:
            continue
        r = np.zeros(len(names))
        r[ix[a]] += 1.0
        r[ix[b]] += 1.0
        rows.append(r)
        rhs.append(1.0 if s >= fits_threshold else 2.0 / s)
        seen[ix[a]] = seen[ix[b]] = True
    util = np.full(len(names), np.nan)
    if rows:
        res = lsq_linear(np.array(rows), np.array(rhs), bounds=(0.05, 1.0))
        util = np.where(seen, res.x, np.nan)
    default = float(np.nanmedian(util)) if seen.any() else 0.75
    return np.where(seen, util, default), seen


def load_type_table(data_dir: Path | str = DATA_DIR, gpu_type: str = "v100",
                    pairs_file: str = "coloc_gavel_pairs.csv", campaign_dir: Path | str | None = None) -> TypeTable:
    """Build the :class:`TypeTable` for one GPU type from Gavel's isolated throughputs and measured pairs.

    Args:
        data_dir: folder holding ``gavel_isolated_throughputs.csv`` and the pair file.
        gpu_type: GPU type rows to use (``v100``, ``p100``, ``k80``; ``h200`` from a campaign folder).
        pairs_file: measured pair file (schema of ``coloc_gavel_pairs.csv``).
        campaign_dir: folder of a campaign's derived tables (:func:`campaign_tables`; None = none): the
            tables of ``gpu_type`` add its types, pairs at 100/100 and share-curve utilisations (module
            docstring). Tables of other GPU types are not read.

    Returns:
        The table; the inference pseudo-type is appended last with utilisation NaN (set per service).
    """
    data_dir = Path(data_dir)
    iso: dict[str, float] = {}
    multi: dict[tuple[str, int], float] = {}
    precision: dict[str, str] = {}
    for r in _read(data_dir / "gavel_isolated_throughputs.csv"):
        if r["worker_type"] == gpu_type and float(r["isolated_tput"]) > 0:
            if int(r["scale_factor"]) == 1:
                iso[r["job_type"]] = float(r["isolated_tput"])
            multi[(r["job_type"], int(r["scale_factor"]))] = float(r["isolated_tput"])
    pairs = []
    for r in _read(data_dir / pairs_file):
        if r["gpu_type"] == gpu_type and r["coloc_failed"] == "0":
            pairs.append((r["job_type_a"], r["job_type_b"], float(r["norm_tput_sum"])))
            iso.setdefault(r["job_type_a"], float("nan"))
            iso.setdefault(r["job_type_b"], float("nan"))
    share_u: dict[str, float] = {}
    for ct in campaign_tables(campaign_dir):
        if ct.gpu_type == gpu_type:
            _add_campaign(ct, iso, multi, precision, pairs, share_u)
    names = sorted(iso)
    util, fitted = fit_solo_utilisation(pairs, names)
    for i, n in enumerate(names):
        if n in share_u:
            util[i], fitted[i] = min(1.0, max(0.05, share_u[n])), True  # the fit's bounds
    return TypeTable(
        names=tuple(names) + (INFERENCE_TYPE,),
        gpu_type=gpu_type,
        solo_util=np.append(util, np.nan),
        iso_tput_steps_s=np.array([iso[n] for n in names] + [np.nan]),
        fitted=np.append(fitted, False),
        precision=tuple(precision.get(n, "fp32") for n in names) + ("",),
        scale_tput=np.vstack([scaling_curve({n: multi[(t, n)] for n in SCALE_COUNTS if (t, n) in multi})
                              for t in names] + [scaling_curve({})]),
        scale_measured=np.array([[(t, n) in multi and (t, 1) in multi for n in SCALE_COUNTS] for t in names]
                                + [[False] * len(SCALE_COUNTS)]),
    )


def _add_campaign(ct: CampaignTables, iso: dict[str, float], multi: dict[tuple[str, int], float],
                  precision: dict[str, str], pairs: list[tuple[str, str, float]], share_u: dict[str, float]) -> None:
    """Add one campaign table set's training types, 100/100 pairs and share-curve ``u`` (module docstring)."""
    iso_t = "isolated_throughputs.csv"
    for r in ct.rows(iso_t):
        tput = campaign_number(ct, iso_t, r, "isolated_tput")
        if r["worker_type"] == ct.gpu_type and tput > 0:
            n = int(campaign_number(ct, iso_t, r, "scale_factor"))
            if n == 1:
                iso[r["job_type"]] = tput
                precision[r["job_type"]] = r["precision"].strip() or "fp32"
            multi[(r["job_type"], n)] = tput
    pt = "coloc_pairs.csv"
    for r in ct.rows(pt):
        shares = (campaign_number(ct, pt, r, "share_a_pct"), campaign_number(ct, pt, r, "share_b_pct"))
        if r["gpu_type"] == ct.gpu_type and r["coloc_failed"].strip() == "0" and at_full_shares(*shares):
            pairs.append((r["job_type_a"], r["job_type_b"], campaign_number(ct, pt, r, "norm_tput_sum")))
            iso.setdefault(r["job_type_a"], float("nan"))
            iso.setdefault(r["job_type_b"], float("nan"))
    ct_t = "share_curves.csv"
    for r in ct.rows(ct_t):
        u = campaign_number(ct, ct_t, r, "u_fit")
        if r["gpu_type"] == ct.gpu_type and r["kind"] == "train" and r["job_type"] in iso and u > 0:
            share_u[r["job_type"]] = u


def scaling_curve(tput_by_count: dict[int, float]) -> np.ndarray:
    """Relative throughput at :data:`SCALE_COUNTS` GPUs from measured ``{count: throughput}`` (module docstring).

    Unmeasured counts (or a type without a 1-GPU measurement) scale linearly from the last measured one;
    the result is made monotone non-decreasing.
    """
    base = tput_by_count.get(1)
    out = np.asarray(SCALE_COUNTS, float)
    if not base:
        return out
    for k, n in enumerate(SCALE_COUNTS):
        v = tput_by_count.get(n)
        out[k] = v / base if v else out[k - 1] * n / SCALE_COUNTS[k - 1] if k else 1.0
    return np.maximum.accumulate(out)
