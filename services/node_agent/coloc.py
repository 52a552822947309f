"""Co-location ground truth for simulated GPUs: how fast each tenant of a shared GPU runs.

Pure (csv + math, no I/O beyond reading the two data files once): the simulated GPU backend uses it
to set the progress rate of every synthetic workload, so that what the node agent *observes* on
simulated GPUs follows measured data rather than a made-up curve.

Data (Gavel, MIT; see ``data/LICENSES``):

- ``data/gavel_isolated_throughputs.csv``: isolated steps/s per (GPU type, model, batch size, GPUs).
- ``data/coloc_gavel_pairs.csv``: for each unordered pair of job types on one GPU type, the fraction of
  its isolated throughput each tenant kept when both shared the GPU under CUDA MPS *without* limits
  (``norm_tput_a`` / ``norm_tput_b``).

Gavel measured pairs without MPS active-thread limits, and never triples. The rules that extend the data
to what the allocator actually places (shares that sum to at most 100 %, any number of tenants) are:

1. **Share cap.** A client limited to ``s`` % of the SMs runs at most at ``s/100`` of its isolated
   speed (linear; real kernels often saturate earlier, so this errs on the slow side).
2. **Measured pair.** Next to one co-tenant a workload keeps ``min(share cap, measured norm)``: the
   co-tenant's pressure on memory bandwidth and caches, which MPS limits do not partition, is at most
   what it was without limits, so the measured fraction bounds it; the SM cap bounds it too.
3. **More tenants.** Pairwise fractions multiply (each co-tenant's slowdown applies independently),
   then the share cap applies: ``min(share cap, prod_b norm(a|b))``.
4. **Unmeasured pair** (a model, batch size or GPU type Gavel did not measure, or a pair Gavel could not
   co-locate): ``min(share cap, 1/n)`` for ``n`` tenants — the fair time-slice, which is close to the
   median of the measured pairs (their normalised sum is ~1) and below most of them.
5. **Gang jobs** run at the pace of their slowest GPU.

Unknown models get ``DEFAULT_ISOLATED_STEPS_PER_S`` as isolated speed, so a synthetic workload still
progresses.

TO UNIFY: ``simulator/groundtruth.py`` (issue 5) landed while this was written, with different rules for
what the data does not cover (unmeasured pairs: a calibrated utilisation rule instead of ``1/n``; pairs
Gavel could not co-locate: 0.05 instead of ``1/n``; more than two tenants: additive instead of
multiplicative composition). It is a job-type matrix over the allocator's ``TypeTable`` without a
per-tenant entry point yet; simulated GPUs and the simulator should share one ground truth (this module
imports nothing from the node agent, so either can absorb the other).
"""

from __future__ import annotations

import csv
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
ISOLATED_CSV = "gavel_isolated_throughputs.csv"
PAIRS_CSV = "coloc_gavel_pairs.csv"
DEFAULT_ISOLATED_STEPS_PER_S = 10.0  # isolated speed assumed for a model the data does not know


@dataclass(frozen=True)
class Tenant:
    """One workload's claim on the GPUs of a node, as the emulation needs it."""

    job_id: str
    model: str  # model family, e.g. "ResNet-50" (Gavel spelling; case and punctuation are ignored)
    batch_size: int  # per-GPU batch size; 0 = unknown
    gpu_indices: tuple[int, ...]
    compute_share_pct: float  # MPS active-thread percentage on each of its GPUs, (0, 100]


def _norm_model(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def _norm_gpu(name: str) -> str:
    return name.lower().split("_")[0].strip()


class ColocationTruth:
    """Lookup over Gavel's measurements plus the documented extension rules (see module docstring)."""

    def __init__(self, isolated_rows: Iterable[Mapping[str, str]], pair_rows: Iterable[Mapping[str, str]]) -> None:
        # (gpu, model, num_gpus) -> {batch_size: steps/s}; "_unconsolidated" worker types are skipped
        self._iso: dict[tuple[str, str, int], dict[int, float]] = {}
        for r in isolated_rows:
            if "_" in r["worker_type"]:
                continue
            key = (_norm_gpu(r["worker_type"]), _norm_model(r["model"]), int(r["scale_factor"]))
            self._iso.setdefault(key, {})[int(r["batch_size"] or 0)] = float(r["isolated_tput"])
        # (gpu, model_a, bs_a, model_b, bs_b) -> (norm_a, norm_b); stored in both orders
        self._pairs: dict[tuple[str, str, int, str, int], tuple[float, float]] = {}
        for r in pair_rows:
            if r.get("coloc_failed", "0") == "1":
                continue  # Gavel could not run the pair together: treated as unmeasured
            gpu = _norm_gpu(r["gpu_type"])
            a = (_norm_model(r["model_a"]), int(r["batch_size_a"] or 0))
            b = (_norm_model(r["model_b"]), int(r["batch_size_b"] or 0))
            na, nb = float(r["norm_tput_a"]), float(r["norm_tput_b"])
            self._pairs[(gpu, *a, *b)] = (na, nb)
            self._pairs[(gpu, *b, *a)] = (nb, na)

    @classmethod
    @functools.cache
    def default(cls, data_dir: Path = DATA_DIR) -> ColocationTruth:
        """The project's shipped data (read once per process)."""
        with open(data_dir / ISOLATED_CSV, newline="") as f_iso, open(data_dir / PAIRS_CSV, newline="") as f_pairs:
            return cls(list(csv.DictReader(f_iso)), list(csv.DictReader(f_pairs)))

    def _nearest_batch(self, table: Mapping[int, float], batch_size: int) -> int:
        if batch_size in table or not table:
            return batch_size
        # nearest in log space: batch sizes are powers of two in the data
        return min(table, key=lambda b: abs(math.log2(max(b, 1)) - math.log2(max(batch_size, 1))))

    def isolated(self, model: str, batch_size: int, gpu_type: str, num_gpus: int = 1) -> float | None:
        """Measured isolated steps/s, at the nearest measured batch size; None if the model/GPU is unknown.

        For a GPU count Gavel did not measure, the single-GPU speed times the count (linear scaling).
        """
        gpu, m = _norm_gpu(gpu_type), _norm_model(model)
        table = self._iso.get((gpu, m, num_gpus))
        if table:
            return table[self._nearest_batch(table, batch_size)]
        single = self._iso.get((gpu, m, 1))
        if single:
            return single[self._nearest_batch(single, batch_size)] * num_gpus
        return None

    def pair(self, gpu_type: str, a: tuple[str, int], b: tuple[str, int]) -> tuple[float, float] | None:
        """Measured (norm_a, norm_b) for two single-GPU tenants without MPS limits; None if unmeasured."""
        gpu = _norm_gpu(gpu_type)
        ma, mb = _norm_model(a[0]), _norm_model(b[0])
        ta = self._iso.get((gpu, ma, 1), {})
        tb = self._iso.get((gpu, mb, 1), {})
        ba = self._nearest_batch(ta, a[1]) if ta else a[1]
        bb = self._nearest_batch(tb, b[1]) if tb else b[1]
        return self._pairs.get((gpu, ma, ba, mb, bb))

    def norm_on_gpu(self, tenant: Tenant, others: Sequence[Tenant], gpu_type: str) -> float:
        """Fraction of its isolated speed ``tenant`` keeps on one GPU shared with ``others`` (rules 1-4)."""
        cap = min(1.0, max(0.0, tenant.compute_share_pct) / 100.0)
        if not others:
            return cap
        frac = 1.0
        for o in others:
            measured = self.pair(gpu_type, (tenant.model, tenant.batch_size), (o.model, o.batch_size))
            if measured is None:
                return min(cap, 1.0 / (len(others) + 1))
            frac *= measured[0]
        return min(cap, frac)

    def rates(self, tenants: Sequence[Tenant], gpu_type: str) -> dict[str, tuple[float, float]]:
        """Emulated (steps/s, normalised throughput) of every tenant of one node (rule 5 for gangs).

        Args:
            tenants: every workload running on the node's GPUs.
            gpu_type: the node's GPU type (the simulated backend has one type per node).
        """
        by_gpu: dict[int, list[Tenant]] = {}
        for t in tenants:
            for g in t.gpu_indices:
                by_gpu.setdefault(g, []).append(t)
        out: dict[str, tuple[float, float]] = {}
        for t in tenants:
            norm = min((self.norm_on_gpu(t, [o for o in by_gpu[g] if o.job_id != t.job_id], gpu_type)
                        for g in t.gpu_indices), default=0.0)
            iso = self.isolated(t.model, t.batch_size, gpu_type, max(1, len(t.gpu_indices)))
            out[t.job_id] = ((iso if iso is not None else DEFAULT_ISOLATED_STEPS_PER_S) * norm, norm)
        return out
