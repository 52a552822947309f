"""Build one workload and run several policies on exactly the same jobs (library entry of the CLI/bench)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from elastico.coloc.profiles import DATA_DIR, campaign_tables, load_type_table
from elastico.coloc.truth import GroundTruth
from services.allocator.policy import POLICY_NAMES, RuleEstimator, make_policy, options_for
from simulator.engine import Engine, SimConfig
from simulator.metrics import summarise
from simulator.traces import TraceError, load_inference, load_training, static_inference_gpus


@dataclass
class Workload:
    """Everything shared by the policies of one comparison."""

    types: object
    truth: GroundTruth
    estimate: np.ndarray
    estimator_name: str
    train: object
    inf: object
    gpus: int = 0  # cluster size
    static_inference_gpus: float = 0.0  # time-averaged GPUs static allocation gives inference

    @property
    def training_gpus(self) -> float:
        """GPUs static allocation leaves to training on average: what the offered load is counted against."""
        return self.gpus - self.static_inference_gpus


def make_estimate(types, truth: GroundTruth, estimator: str = "auto") -> tuple[np.ndarray, str]:
    """The estimate matrix the policies see: the trained predictor when available, else the rule.

    ``auto`` uses ``models/interference.json`` if it loads, otherwise the utilisation rule (said so).
    """
    if estimator in ("auto", "predictor"):
        try:
            from services.predictor.estimator import PredictorEstimator

            est = PredictorEstimator.from_artifact()
            meta = est.model.meta  # the training data differ with Lucid's shared files present or not: say which
            return est.pair_matrix(types), (f"predictor (models/interference.json: {meta.get('training_rows', '?')} rows "
                                            f"from {', '.join(sorted(meta.get('envs_seen', ())))})")
        except Exception as exc:  # noqa: BLE001 - explicit, reported fallback
            if estimator == "predictor":
                raise
            print(f"note: predictor artifact unavailable ({type(exc).__name__}: {exc}); "
                  f"policies use the utilisation rule as their interference estimate", file=sys.stderr)
    return RuleEstimator(kappa=truth.kappa).pair_matrix(types), f"utilisation rule (kappa={truth.kappa:.2f})"


def build_workload(trace: str, gpus: int, inference_traces: list[str] | None = None, seed: int = 0,
                   load: float | None = None, window=None, max_jobs: int | None = None,
                   inference_fraction: float = 0.25, slo_factor: float = 10.0, estimator: str = "auto",
                   data_dir: Path = DATA_DIR, pairs: str | Path | None = None, gpu_type: str = "v100",
                   campaign_dir: str | Path | None = None, redraw_seed: int | None = None) -> Workload:
    """Load traces and profiles once; every policy of a comparison then runs on this same workload.

    ``pairs``: the measured-pairs CSV the ground truth reads (``coloc_gavel_pairs.csv`` schema; default
    ``data_dir/coloc_gavel_pairs.csv``) -- e.g. the complete table including the pairs withheld from
    ``data/``, so the policies, which see only the predictor, are judged on pairs it never saw.

    ``gpu_type``: the GPU type of the cluster (type table and ground truth rows); ``campaign_dir``: a GPU
    campaign's derived tables (``bench.gpu_campaign.derive``) that add its GPU type's job types, pairs and
    training + inference pairs to both (:func:`elastico.coloc.profiles.load_type_table`,
    :class:`elastico.coloc.truth.GroundTruth`), e.g. ``gpu_type="h200", campaign_dir="data/h200"``. Trace
    rows keep their Philly (V100) durations; their job types map to the GPU type's types as unknown ones do
    (model family, else the median-utilisation type).

    ``redraw_seed``: a seed to deal the trace's jobs out again over its rows (:func:`simulator.traces.redraw_job_types`).

    ``load`` is the training offered load against the GPUs static allocation leaves to training
    (:func:`simulator.traces.static_inference_gpus`): the services are drawn first (which ones, and their
    time-averaged share of the arrival span, do not depend on its length), then arrivals are rescaled.
    """
    types = load_type_table(data_dir, gpu_type, campaign_dir=campaign_dir)
    if len(types.names) < 2:
        held = sorted(ct.gpu_type for ct in campaign_tables(campaign_dir))
        raise TraceError(f"gpu type {gpu_type!r}: no training job types in {data_dir}"
                         + (f" nor in the campaign tables of {campaign_dir} (GPU types there: {', '.join(held) or 'none'})"
                            if campaign_dir is not None else " (a campaign's GPU type needs its tables: campaign_dir)"))
    truth = (GroundTruth(types, data_dir, campaign_dir=campaign_dir) if pairs is None
             else GroundTruth(types, pairs_file=Path(pairs).resolve(), campaign_dir=campaign_dir))
    est, name = make_estimate(types, truth, estimator)
    static = 0.0
    if inference_traces:
        unit = load_inference(inference_traces, gpus, 1.0, seed, inference_fraction, slo_factor)
        static = static_inference_gpus(unit, 1.0)
    if gpus - static < 1.0:
        raise TraceError(f"inference share {inference_fraction}: static allocation leaves {gpus - static:.2f} of {gpus} "
                         f"GPUs to training, too few to count a training load against")
    train = load_training(trace, types, gpus - static, window, max_jobs, load, redraw_seed)
    inf = None
    if inference_traces:
        inf = load_inference(inference_traces, gpus, float(train.arrival_s.max()) or 1.0, seed, inference_fraction,
                             slo_factor)
    return Workload(types, truth, est, name, train, inf, gpus, static)


def run_policies(w: Workload, policies: list[str], cfg: SimConfig, policy_options: dict | None = None):
    """Run each policy on the workload; returns (results, summaries). ``policy_options`` configure the whole
    comparison: each policy gets the ones it accepts (:func:`options_for`), and the engine's SLO factor."""
    results, sums = [], []
    for name in policies:
        if name not in POLICY_NAMES:
            raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
        opts = options_for(name, dict(slo_factor=cfg.slo_factor, **(policy_options or {})))
        pol = make_policy(name, w.estimate, w.truth.kappa, **opts)
        r = Engine(pol, w.types, w.truth, w.train, w.inf, cfg).run()
        results.append(r)
        sums.append(summarise(r))
    return results, sums
