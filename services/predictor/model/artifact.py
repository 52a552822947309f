"""The model artifact: its JSON format, atomic writing and reading, and :class:`ArtifactError`.

One JSON file holds everything prediction needs: metadata, hyper-parameters, the feature column list
(checked against this build's schema on load), every booster, the encoder tables, the factorisation
variants, the job-type prior, the cap classifiers and the profile catalogue.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, TypeVar

import xgboost as xgb

from services.predictor import features as F
from services.predictor.datasets import ProfileCatalog
from services.predictor.features import JobProfile
from services.predictor.model.encoders import Encoder, JobPrior
from services.predictor.model.factors import MatrixFactors
from services.predictor.model.params import TrainParams

#: Format tag of the saved artifact. /3 added the cap classifiers (``cap_boosters``); /2 added the job-type
#: prior (``job_prior``, the boosters' base margin). /1 and /2 artifacts still load and predict as they were
#: trained (no margin for /1, no cap classifiers for /1 and /2).
ARTIFACT_FORMAT = "elastico-interference-model/3"
_READABLE_FORMATS = ("elastico-interference-model/1", "elastico-interference-model/2", ARTIFACT_FORMAT)

#: Default artifact path (relative to the repository root); the service's ``ELASTICO_MODEL_PATH`` default.
DEFAULT_MODEL_PATH = Path(__file__).resolve().parents[3] / "models" / "interference.json"

#: Metadata fields of the artifact, in file order.
META_KEYS = ("version", "schema_version", "created_at", "created_at_unix_s", "training_data_sha256",
             "training_rows", "metrics", "seed", "families_seen", "gpus_seen", "envs_seen", "reference_env")

ModelT = TypeVar("ModelT")


class ArtifactError(ValueError):
    """A model artifact is missing, malformed, or was written under another feature schema."""


def profile_to_json(p: JobProfile) -> dict:
    d = asdict(p)
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def profile_from_json(d: dict) -> JobProfile:
    kw: dict[str, Any] = {}
    for f in fields(JobProfile):
        if f.name not in d:
            continue
        v = d[f.name]
        kw[f.name] = float("nan") if v is None and isinstance(f.default, float) else v
    return JobProfile(**kw)


def to_json_dict(meta: dict, params: TrainParams, booster_sets: dict[str, list[xgb.Booster]], encoder: Encoder,
                 factors: list[MatrixFactors], prior: JobPrior | None, cap_boosters: dict[str, xgb.Booster],
                 catalog: ProfileCatalog) -> dict:
    """A model's parts as the artifact's JSON-serialisable dict."""
    return {
        "format": ARTIFACT_FORMAT,
        **meta,
        "params": asdict(params),
        "feature_names": list(F.PAIR_FEATURES),
        "boosters": {name: [json.loads(bytes(b.save_raw("json"))) for b in boosters]
                     for name, boosters in booster_sets.items()},
        "encoder": encoder.to_json(),
        "factors": [f.to_json() for f in factors],
        "job_prior": prior.to_json() if prior is not None else None,
        "cap_boosters": {name: json.loads(bytes(b.save_raw("json"))) for name, b in cap_boosters.items()},
        "catalog": [profile_to_json(p) for p in catalog],
    }


def from_json_dict(d: dict, build: Callable[..., ModelT]) -> ModelT:
    """Inverse of :func:`to_json_dict`: ``build(booster_sets, encoder, factors, catalog, meta, params, prior,
    cap_boosters)`` (the model's constructor) on the parts read from ``d``.

    Raises:
        ArtifactError: wrong format tag, other feature schema, or missing fields (also when ``build``
            rejects the parts).
    """
    if d.get("format") not in _READABLE_FORMATS:
        raise ArtifactError(f"format {d.get('format')!r} is not one of {_READABLE_FORMATS}: retrain")
    if d.get("schema_version") != F.SCHEMA_VERSION:
        raise ArtifactError(f"feature schema {d.get('schema_version')!r} != {F.SCHEMA_VERSION!r}: retrain")
    if d.get("feature_names") != list(F.PAIR_FEATURES):
        raise ArtifactError("feature_names differ from this build's schema: retrain")
    try:
        params = TrainParams(**d["params"])
        def booster(bj: dict) -> xgb.Booster:
            b = xgb.Booster()
            b.load_model(bytearray(json.dumps(bj).encode()))
            return b

        boosters = {name: [booster(bj) for bj in items] for name, items in d["boosters"].items()}
        cap_boosters = {name: booster(bj) for name, bj in (d.get("cap_boosters") or {}).items()}
        meta = {k: d[k] for k in META_KEYS}
        return build(boosters, Encoder.from_json(d["encoder"]),
                     [MatrixFactors.from_json(f) for f in d["factors"]],
                     ProfileCatalog(profile_from_json(p) for p in d["catalog"]), meta, params,
                     JobPrior.from_json(d["job_prior"]) if d.get("job_prior") is not None else None,
                     cap_boosters)
    except (KeyError, TypeError, ValueError, xgb.core.XGBoostError) as exc:
        raise ArtifactError(f"malformed model artifact: {exc}") from exc


def write_atomic(path: str | os.PathLike, artifact: dict) -> Path:
    """Write ``artifact`` (compact JSON, mode 0600) atomically: temporary file in the same folder, fsync, rename.

    Readers never see a half-written file; a crash leaves at most a ``*.json.tmp`` file behind.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(artifact, separators=(",", ":"), allow_nan=False).encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem + ".", suffix=".json.tmp")
    try:
        os.fchmod(fd, 0o600)  # owner only, whatever mkstemp's default: the renamed file keeps it
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def read_json(path: str | os.PathLike) -> dict:
    """The artifact dict at ``path``.

    Raises:
        ArtifactError: missing file or invalid JSON.
    """
    try:
        with open(path, "rb") as fh:
            return json.loads(fh.read())
    except FileNotFoundError as exc:
        raise ArtifactError(f"{path}: no model artifact (train one: python -m services.predictor.train)") from exc
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path}: not JSON: {exc}") from exc
