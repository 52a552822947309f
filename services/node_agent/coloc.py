"""Co-location on simulated GPUs: the node agent's adapter to the simulator's ground truth.

One ground truth: how fast each tenant of a shared GPU runs is decided by :mod:`elastico.coloc.truth`
(:meth:`~elastico.coloc.truth.GroundTruth.speeds`, the same rules as the trace simulator's engine). This
module only adapts the node agent's view of a workload to it and turns normalised speed into steps/s:

1. **Job type.** A workload's ``model`` (its ``JobSpec.model_family``) and per-GPU ``batch_size`` map to a
   row of the GPU type's ``TypeTable`` exactly as the simulator maps trace rows
   (:func:`elastico.coloc.truth.type_index`): the type ``"<model> (batch size <bs>)"``, else the first
   type of that model family, else -- **unknown model** -- the type with the median solo utilisation.
   A GPU type without any data: every training workload gets utilisation
   :data:`~elastico.coloc.truth.UNKNOWN_TYPE_UTIL` and the utilisation rule against every co-tenant.
2. **One GPU** (the simulator's rules, see ``elastico/coloc/truth.py``): a lone tenant keeps 1.0; a
   measured pair of the GPU type keeps its measured fraction (``data/coloc_gavel_pairs.csv``); a pair Gavel
   could not co-locate keeps ``FAILED_PAIR_NORM`` (0.05); an unmeasured pair (or a pair with an
   inference service) the calibrated utilisation rule ``kappa x min(1, 1 / (u_a + u_b))``; k > 2 tenants
   compose pairwise values additively (``1 / (1 + sum(1/p - 1))``). A training tenant's speed is capped by
   the MPS limit it launched with (``Tenant.compute_share_pct``: the placement's shape, 100 % for training
   placed where no service runs): ``min(1, share / u)`` with ``u`` its
   type's fitted solo utilisation (saturating: a job that uses 60 % of a GPU alone loses nothing at a 75 %
   share). An inference workload (``kind="inference"``) is not capped and counts with utilisation = its
   measured load (``Tenant.load``, from its metrics scrape) up to its share, or its share while unmeasured
   (the simulator uses the service's mean load).
3. **Gang jobs** run at the pace of their slowest GPU (as the simulator's engine).
4. **Steps/s** = the measured isolated speed (``data/gavel_isolated_throughputs.csv``; linear in the GPU
   count where Gavel did not measure that count) x normalised speed. An unmeasured batch size takes the
   speed of the job type rule 1 maps it to, as the allocator's shape throughput (the agent's reference
   speed) and the simulator do (ResNet-50 at batch size 8 runs as "ResNet-50 (batch size 128)", so its
   normalised throughput stays a fraction of that reference); else the nearest measured batch size.
   Unknown models get :data:`DEFAULT_ISOLATED_STEPS_PER_S` so a synthetic workload still progresses.

Data: Gavel (MIT; see ``data/LICENSES``).
"""

from __future__ import annotations

import csv
import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from elastico.coloc.truth import UNKNOWN_TYPE_UTIL, GroundTruth, default_truth, type_index
from services.node_agent.gpu import Tenant

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
ISOLATED_CSV = "gavel_isolated_throughputs.csv"
DEFAULT_ISOLATED_STEPS_PER_S = 10.0  # isolated speed assumed for a model the data does not know
_TYPE_NAME = re.compile(r"^(?P<model>.+) \(batch size (?P<bs>\d+)\)")  # a training type's name, e.g. "VGG (batch size 16)"


def _norm_model(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def _norm_gpu(name: str) -> str:
    return name.lower().split("_")[0].strip()


class ColocationTruth:
    """Isolated speeds (steps/s) plus the simulator's ground truth for co-location (module docstring)."""

    def __init__(self, isolated_rows: Iterable[Mapping[str, str]], data_dir: Path | str = DATA_DIR) -> None:
        # (gpu, model, num_gpus) -> {batch_size: steps/s}; "_unconsolidated" worker types are skipped
        self._iso: dict[tuple[str, str, int], dict[int, float]] = {}
        for r in isolated_rows:
            if "_" in r["worker_type"]:
                continue
            key = (_norm_gpu(r["worker_type"]), _norm_model(r["model"]), int(r["scale_factor"]))
            self._iso.setdefault(key, {})[int(r["batch_size"] or 0)] = float(r["isolated_tput"])
        self.data_dir = Path(data_dir)

    @classmethod
    @functools.cache
    def default(cls, data_dir: Path = DATA_DIR) -> ColocationTruth:
        """The project's shipped data (read once per process)."""
        with open(data_dir / ISOLATED_CSV, newline="") as f_iso:
            return cls(list(csv.DictReader(f_iso)), data_dir)

    def ground_truth(self, gpu_type: str) -> GroundTruth:
        """The simulator's ground truth for ``gpu_type`` (type table, measured pairs, kappa)."""
        return default_truth(_norm_gpu(gpu_type), self.data_dir)

    def _reference_batch(self, table: Mapping[int, float], model: str, batch_size: int, gpu_type: str) -> int:
        """The measured batch size whose speed stands for ``batch_size`` (rule 4): itself, else that of the job
        type rule 1 maps it to, else the nearest measured one."""
        if batch_size in table or not table:
            return batch_size
        types = self.ground_truth(gpu_type).types
        i = type_index(types, model, batch_size)
        hit = _TYPE_NAME.match(types.names[i]) if i is not None else None
        if hit and _norm_model(hit["model"]) == _norm_model(model) and int(hit["bs"]) in table:
            return int(hit["bs"])
        # nearest in log space: batch sizes are powers of two in the data
        return min(table, key=lambda b: abs(math.log2(max(b, 1)) - math.log2(max(batch_size, 1))))

    def isolated(self, model: str, batch_size: int, gpu_type: str, num_gpus: int = 1) -> float | None:
        """Measured isolated steps/s at the batch size of rule 4; None if the model/GPU is unknown.

        For a GPU count Gavel did not measure, the single-GPU speed times the count (linear scaling).
        """
        gpu, m = _norm_gpu(gpu_type), _norm_model(model)
        table = self._iso.get((gpu, m, num_gpus))
        if table:
            return table[self._reference_batch(table, model, batch_size, gpu_type)]
        single = self._iso.get((gpu, m, 1))
        if single:
            return single[self._reference_batch(single, model, batch_size, gpu_type)] * num_gpus
        return None

    def job_type(self, tenant: Tenant, gpu_type: str) -> str | None:
        """Name of the ground-truth job type ``tenant`` maps to (rule 1); None on a GPU type without data."""
        types = self.ground_truth(gpu_type).types
        if tenant.kind == "inference":
            return types.names[types.inference_index]
        i = type_index(types, tenant.model, tenant.batch_size)
        return None if i is None else types.names[i]

    def norms_on_gpu(self, tenants: Sequence[Tenant], gpu_type: str) -> list[float]:
        """Normalised speed of each tenant of ONE GPU (rules 1-2), in the order given."""
        gt = self.ground_truth(gpu_type)
        types = gt.types
        idx, util, training = [], [], []
        for t in tenants:
            if t.kind == "inference":
                u = t.compute_share_pct / 100.0
                i, u = types.inference_index, (min(u, max(t.load, 0.0)) if t.load is not None else u)
            else:
                i = type_index(types, t.model, t.batch_size)
                if i is None:  # no training type on this GPU type: NaN pair row -> the utilisation rule
                    i, u = types.inference_index, UNKNOWN_TYPE_UTIL
                else:
                    u = float(types.solo_util[i])
            idx.append(i)
            util.append(u)
            training.append(t.kind != "inference")
        shares = [max(0.0, t.compute_share_pct) for t in tenants]
        return [float(x) for x in gt.speeds(idx, shares, util, training)]

    def rates(self, tenants: Sequence[Tenant], gpu_type: str) -> dict[str, tuple[float, float]]:
        """Emulated (steps/s, normalised throughput) of every tenant of one node (rule 3 for gangs).

        Args:
            tenants: every workload running on the node's GPUs.
            gpu_type: the node's GPU type (the simulated backend has one type per node).
        """
        by_gpu: dict[int, list[Tenant]] = {}
        for t in tenants:
            for g in t.gpu_indices:
                by_gpu.setdefault(g, []).append(t)
        per_gpu: dict[int, dict[str, float]] = {}
        for g, on in by_gpu.items():
            per_gpu[g] = dict(zip((t.job_id for t in on), self.norms_on_gpu(on, gpu_type)))
        out: dict[str, tuple[float, float]] = {}
        for t in tenants:
            norm = min((per_gpu[g][t.job_id] for g in t.gpu_indices), default=0.0)
            iso = self.isolated(t.model, t.batch_size, gpu_type, max(1, len(t.gpu_indices)))
            out[t.job_id] = ((iso if iso is not None else DEFAULT_ISOLATED_STEPS_PER_S) * norm, norm)
        return out
