"""Ground truth of the simulator: what co-located jobs *actually* achieve. Measured data, not our predictor.

* Training x training on one GPU: the measured pair (``coloc_gavel_pairs.csv``, rows of the cluster's GPU
  type): ``norm_tput_a`` for (a next to b) and ``norm_tput_b`` for (b next to a). Pairs Gavel could not
  run together (``coloc_failed``, probably out of memory) get :data:`FAILED_PAIR_NORM` (a near-stall
  stand-in for an OOM/restart loop) -- policies that co-locate them pay for it.
* Pairs without a measurement (including the ~20% withheld from ``data/`` and every pair involving an
  inference service): the conservative utilisation rule of
  :func:`services.allocator.policy.interference.utilisation_rule`, with ``kappa`` calibrated as the 25th
  percentile of measured / processor-sharing ratios (:func:`calibrate_kappa`).
* k > 2 tenants: additive composition of the pairwise values (``compose_additive``).
* MPS shares: a tenant's speed is additionally capped by ``share_speed(share, solo_util)`` when the policy
  enforces MPS limits (the min of the two: a share cannot make co-location *better* than measured, which
  was unrestricted sharing).
* Inference: serving capacity = share x interference factor; its utilisation in the rule is its mean
  load (constant per service, so a segment's capacity is constant between placement changes).
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from services.allocator.policy.interference import calibrate_kappa
from services.allocator.policy.profiles import DATA_DIR, TypeTable

#: Normalised throughput assigned to measured pairs that failed to co-locate (OOM stand-in).
FAILED_PAIR_NORM = 0.05


class GroundTruth:
    """Measured pair matrix plus the calibrated rule for everything unmeasured."""

    def __init__(self, types: TypeTable, data_dir: Path | str = DATA_DIR, pairs_file: str = "coloc_gavel_pairs.csv",
                 kappa_quantile: float = 0.25):
        T = len(types.names)
        self.types = types
        self.matrix = np.full((T, T), np.nan)  # [T, T] measured normalised throughput, NaN = rule
        measured = []
        with open(Path(data_dir) / pairs_file, newline="") as fh:
            for r in csv.DictReader(fh):
                if r["gpu_type"] != types.gpu_type:
                    continue
                try:
                    a, b = types.index(r["job_type_a"]), types.index(r["job_type_b"])
                except KeyError:
                    continue
                if r["coloc_failed"] == "1":
                    self.matrix[a, b] = self.matrix[b, a] = FAILED_PAIR_NORM
                    continue
                na, nb = float(r["norm_tput_a"]), float(r["norm_tput_b"])
                self.matrix[a, b], self.matrix[b, a] = min(na, 1.0), min(nb, 1.0)
                measured.append((r["job_type_a"], r["job_type_b"], na, nb))
        self.measured_pairs = len(measured)  # number of measured (successful) pairs
        self.kappa = calibrate_kappa(measured, types, kappa_quantile)  # contention factor of the rule
