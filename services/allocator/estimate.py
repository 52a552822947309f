"""What the live allocator feeds the pure policy besides the jobs: job types, kappa and the pair matrix.

* **Job types.** A job's row of the policy's ``TypeTable`` is found from its spec the way the simulator maps
  trace rows (``simulator/traces.py``): ``"<model_family> (batch size <batch_size>)"``, else the first type
  of the same model family, else the type with the median solo utilisation. Inference services map to the
  inference pseudo-type.
* **kappa** (contention factor of the utilisation rule for unestimated pairs) is calibrated on the measured
  pairs shipped in ``data/`` exactly as the simulator's ground truth does (``calibrate_kappa``), so the live
  policy and the simulated one are configured identically.
* **Pair matrix.** ``estimator=predictor``: every ordered pair of training types is asked of the predictor
  service (``PredictInterference``), once at start and every ``estimate_refresh_s``. ``estimator=rule``:
  the calibrated utilisation rule (what the simulator uses when no predictor artifact exists). When the
  predictor is configured but unavailable and no earlier answer exists, the round runs *degraded*: no new
  co-location at all (whole GPUs only), and it says so.
"""

from __future__ import annotations

import csv
import functools
import re
from pathlib import Path

import numpy as np

from elastico.coloc.profiles import DATA_DIR, TypeTable, load_type_table
from elastico.coloc.rates import calibrate_kappa
from elastico.coloc.truth import type_index
from elastico.domain import JobKind, JobSpec
from services.allocator.policy import RuleEstimator

_TYPE_RE = re.compile(r"^(?P<model>.+) \(batch size (?P<bs>\d+)\)$")


@functools.cache
def default_types(gpu_type: str = "v100") -> TypeTable:
    """The policy library's type table for ``gpu_type`` (read once per process)."""
    return load_type_table(DATA_DIR, gpu_type)


def measured_pairs(types: TypeTable, data_dir: Path = DATA_DIR,
                   pairs_file: str = "coloc_gavel_pairs.csv") -> list[tuple[str, str, float, float]]:
    """(type_a, type_b, norm_a, norm_b) of the successfully co-located measured pairs of the table's GPU type."""
    out = []
    with open(Path(data_dir) / pairs_file, newline="") as fh:
        for r in csv.DictReader(fh):
            if r["gpu_type"] == types.gpu_type and r["coloc_failed"] == "0":
                out.append((r["job_type_a"], r["job_type_b"], float(r["norm_tput_a"]), float(r["norm_tput_b"])))
    return out


@functools.cache
def default_kappa(gpu_type: str = "v100") -> float:
    """kappa calibrated on the shipped measurements (25th percentile of measured / processor sharing)."""
    types = default_types(gpu_type)
    return calibrate_kappa(measured_pairs(types), types)


def rule_matrix(types: TypeTable, kappa: float) -> np.ndarray:
    """The utilisation-rule estimate (NaN rows/columns for inference: the rule applies there anyway)."""
    return RuleEstimator(kappa=kappa).pair_matrix(types)


def exclusive_matrix(types: TypeTable) -> np.ndarray:
    """A matrix predicting a near-stall for every pair: no placement next to anyone passes a floor."""
    return np.full((len(types.names), len(types.names)), 1e-3)


def split_type_name(name: str) -> tuple[str, int]:
    """``"ResNet-50 (batch size 64)"`` -> ``("ResNet-50", 64)``; a name without a batch size -> (name, 0)."""
    m = _TYPE_RE.match(name)
    return (m.group("model"), int(m.group("bs"))) if m else (name, 0)


class TypeResolver:
    """Job spec -> row of the type table (memoised; see the module docstring for the rules)."""

    def __init__(self, types: TypeTable) -> None:
        self.types = types
        self._memo: dict[tuple[JobKind, str, int], int] = {}

    def __call__(self, spec: JobSpec) -> int:
        key = (spec.kind, spec.model_family, spec.batch_size)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        if spec.kind is JobKind.INFERENCE:
            idx = self.types.inference_index
        else:  # the simulator's and the node agent's mapping, so all three read a job as the same type
            found = type_index(self.types, spec.model_family, spec.batch_size)
            if found is None:
                raise ValueError("the type table has no training type to map a training job to")
            idx = found
        self._memo[key] = idx
        return idx
