"""Train the interference model and write its artifact.

``python -m services.predictor.train [--out PATH] [--observations CSV ...] [--campaign-dir DIR] [--seed N]
[--cv-folds K] [--no-lucid]``

Training data: Gavel's measured co-location pairs and its older campaign of the same pairs, shipped in
``data/`` (MIT); Lucid's pairs from the shared data folder when present (``ELASTICO_SHARED_DATA``, default
``../shared/data``; non-commercial, never copied into the project); and any extra observation files in
either pair schema; the GPU campaign's derived tables (environment "campaign") committed under ``data/h200``
and those of ``--campaign-dir`` (:func:`services.predictor.datasets.campaign_observations`). The seed makes the
result deterministic; training takes a few seconds on two cores.

``--cv-folds K`` additionally runs grouped K-fold cross-validation over the training rows and stores the
figures in the artifact's metrics: ``cv_mae``, ``cv_mape_pct``, ``cv_p90`` on Gavel's measured pairs and
``cv_<gpu>@<environment>_mae`` for every GPU type and environment.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from elastico.coloc.profiles import campaign_tables
from services.predictor.datasets import ProfileCatalog, read_pair_file, shipped_observations
from services.predictor.features import Observation
from services.predictor.model import DEFAULT_MODEL_PATH, InterferenceModel, TrainParams, train_model

__all__ = ["training_rows", "main"]


def training_rows(observation_files: Sequence[Path] = (), include_lucid: bool = True,
                  catalog: ProfileCatalog | None = None, campaign_dir: Path | str | None = None) -> list[Observation]:
    """The shipped training rows plus the rows of ``observation_files`` (Gavel or Lucid schema each) and of the
    campaign tables in ``campaign_dir`` (None: only those committed under ``data/h200``)."""
    catalog = catalog if catalog is not None else ProfileCatalog.default(campaign_dir=campaign_dir)
    rows = shipped_observations(catalog, include_lucid=include_lucid, campaign_dir=campaign_dir)
    for path in observation_files:
        rows += read_pair_file(Path(path), catalog)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m services.predictor.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_MODEL_PATH, help="artifact path (default: %(default)s)")
    ap.add_argument("--observations", type=Path, action="append", default=[],
                    help="extra observation rows (pair CSV, Gavel or Lucid schema); repeatable")
    ap.add_argument("--campaign-dir", type=Path, default=None,
                    help="folder of GPU-campaign tables (bench.gpu_campaign.derive) to train on as well "
                         "(data/h200 is read when committed)")
    ap.add_argument("--seed", type=int, default=0, help="training seed (default: %(default)s)")
    ap.add_argument("--cv-folds", type=int, default=0, help="also store grouped K-fold CV metrics on Gavel")
    ap.add_argument("--no-lucid", action="store_true", help="ignore Lucid's files even when present")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    if args.campaign_dir is not None and not campaign_tables(args.campaign_dir):
        print(f"error: --campaign-dir {args.campaign_dir}: no <gpu>_provenance.json there "
              f"(python3 -m bench.gpu_campaign.derive writes the tables with one)", file=sys.stderr)
        return 2
    try:
        catalog = ProfileCatalog.default(campaign_dir=args.campaign_dir)
        rows = training_rows(args.observations, include_lucid=not args.no_lucid, catalog=catalog,
                             campaign_dir=args.campaign_dir)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sources: dict[str, int] = {}
    for r in rows:
        sources[r.source] = sources.get(r.source, 0) + 1
    lucid_note = "" if "lucid" in sources else " (Lucid files absent or disabled)"
    print(f"training rows: {len(rows)} " + ", ".join(f"{k}={v}" for k, v in sorted(sources.items())) + lucid_note)
    model: InterferenceModel = train_model(rows, seed=args.seed, params=TrainParams(), catalog=catalog)
    t_train = time.perf_counter() - t0
    if args.cv_folds:
        from services.predictor.evaluate import cross_validate  # imported here: only --cv-folds needs it

        scored = cross_validate(rows, k=args.cv_folds, seed=args.seed, baselines=False, catalog=catalog)
        gavel = scored.subset(np.array([g.endswith("@gavel") for g in scored.gpu])).table()["model"]
        cv = {"cv_folds": float(args.cv_folds)}
        if gavel["all"]["n"]:
            cv.update({"cv_mae": gavel["all"]["mae"], "cv_mape_pct": gavel["all"]["mape_pct"],
                       "cv_p90": gavel["all"]["p90"]})
        cv.update({f"cv_{g}_mae": m["mae"] for g, m in scored.table()["model"].items() if g != "all"})
        model = model.with_metrics(cv)
    path = model.save(args.out)
    print(f"model {model.version} schema {model.schema_version} data sha256 {model.data_digest[:16]}...")
    for k, v in sorted(model.metrics.items()):
        print(f"  {k} = {v:.4f}")
    print(f"wrote {path} in {time.perf_counter() - t0:.1f} s (training {t_train:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
