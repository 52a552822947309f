"""elastico.v1.Predictor over gRPC: a thin edge around ``services.predictor.model`` plus online learning.

Predictions run in a worker thread (XGBoost is CPU-bound; the event loop stays free for health checks).
Observations from node agents go to a durable log (a Redis stream); a periodic refresh retrains on the
shipped data plus every observation, then swaps the served model in one assignment, so every answer
comes from exactly one model and names its version.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import grpc

from elastico import limits as L
from elastico.errors import InvalidSpec, PermissionDenied
from elastico.limits import clip, too_long
from elastico.logging import get_logger
from elastico.rpc.security import current_caller
from elastico.v1 import predictor_pb2 as prpb
from elastico.v1 import predictor_pb2_grpc
from elastico.v1 import types_pb2 as pb
from services.predictor import observations as obslog
from services.predictor.features import JobProfile, Observation, canonical_gpu
from services.predictor.model import ArtifactError, InterferenceModel, train_model
from services.predictor.settings import PredictorSettings
from services.predictor.train import training_rows

log = get_logger(component="predictor")

#: JobProfile field -> request field it came from (to name the right field in INVALID_ARGUMENT).
_PROFILE_FIELD = {"gpu_util_pct": "counters.sm_util_pct", "mem_bw_util_pct": "counters.mem_bw_util_pct",
                  "mem_used_mib": "counters.mem_used_mib", "tensor_util_pct": "counters.tensor_util_pct"}
MAX_OBSERVATIONS_PER_CALL = L.OBSERVATIONS_PER_CALL_MAX
#: TaskProfile string fields -> longest accepted (``elastico.limits``); checked before any canonicalisation.
_PROFILE_MAX_CHARS = {"job_id": L.JOB_ID_MAX_CHARS, "model_family": L.MODEL_FAMILY_MAX_CHARS,
                      "gpu_type": L.GPU_TYPE_MAX_CHARS, "precision": L.PRECISION_MAX_CHARS}


def profile_from_pb(m: prpb.TaskProfile, path: str) -> JobProfile:
    """Convert a TaskProfile to a JobProfile; raises InvalidSpec naming ``path.field``."""
    for name, limit in _PROFILE_MAX_CHARS.items():
        n = len(getattr(m, name))
        if n > limit:
            raise InvalidSpec(f"{path}.{name}", too_long(n, limit))
    if not m.model_family.strip():
        raise InvalidSpec(f"{path}.model_family", "must not be empty")
    if not m.gpu_type.strip():
        raise InvalidSpec(f"{path}.gpu_type", "must not be empty")
    if not canonical_gpu(m.gpu_type):  # "---", "NVIDIA": nothing left of it once canonicalised
        raise InvalidSpec(f"{path}.gpu_type", "must name a GPU type (letters or digits beyond a vendor prefix)")
    share = m.mps_share_pct
    if math.isnan(share) or share < 0 or share > 100:
        raise InvalidSpec(f"{path}.mps_share_pct", f"must be in (0, 100] (0 = unset = 100), got {share!r}")
    if m.kind not in (pb.JOB_KIND_UNSPECIFIED, pb.JOB_KIND_TRAINING, pb.JOB_KIND_INFERENCE):
        raise InvalidSpec(f"{path}.kind", f"unknown job kind {m.kind}")
    c = m.counters
    try:
        return JobProfile(
            model_family=m.model_family, gpu_type=m.gpu_type, batch_size=m.batch_size or None, precision=m.precision,
            training=m.kind != pb.JOB_KIND_INFERENCE, mps_share_pct=share or 100.0,
            gpu_util_pct=c.sm_util_pct if c.HasField("sm_util_pct") else math.nan,
            mem_bw_util_pct=c.mem_bw_util_pct if c.HasField("mem_bw_util_pct") else math.nan,
            mem_used_mib=c.mem_used_mib if c.HasField("mem_used_mib") else math.nan,
            tensor_util_pct=c.tensor_util_pct if c.HasField("tensor_util_pct") else math.nan,
        )
    except ValueError as exc:
        field, _, message = str(exc).partition(": ")
        raise InvalidSpec(f"{path}.{_PROFILE_FIELD.get(field, field)}", message or str(exc)) from exc


def pair_from_pb(q: prpb.PairQuery | prpb.Observation, path: str) -> tuple[JobProfile, JobProfile]:
    """Both tenants' profiles of a pair (or observation) at ``path``; they must share a GPU type."""
    a = profile_from_pb(q.a, f"{path}.a")
    b = profile_from_pb(q.b, f"{path}.b")
    if a.gpu_type != b.gpu_type:
        raise InvalidSpec(f"{path}.b.gpu_type", f"tenants of one GPU must share its type ({clip(a.gpu_type)} vs {clip(b.gpu_type)})")
    return a, b


def _predict(model: InterferenceModel, request: prpb.PredictInterferenceRequest):
    """Convert every pair (InvalidSpec naming the first bad one) and predict them with ``model``."""
    return model.predict([pair_from_pb(q, f"pairs[{i}]") for i, q in enumerate(request.pairs)])


def _observation_entries(request: prpb.ReportObservationRequest, peer, now: float) -> list:
    """Validate every observation (all or none are logged) and encode it for the observation log."""
    entries = []
    for i, o in enumerate(request.observations):
        if len(o.node_id) > L.NODE_ID_MAX_CHARS:
            raise InvalidSpec(f"observations[{i}].node_id", too_long(len(o.node_id), L.NODE_ID_MAX_CHARS))
        if peer is not None and peer.role == "node" and o.node_id != peer.node_id:
            raise PermissionDenied(f"agent {peer.name!r} reports for its own node only", f"observations[{i}].node_id")
        a, b = pair_from_pb(o, f"observations[{i}]")
        for name in ("norm_tput_a", "norm_tput_b"):
            v = getattr(o, name)
            if not (math.isfinite(v) and 0.0 <= v <= 1.5):
                raise InvalidSpec(f"observations[{i}].{name}", f"must be in [0, 1.5], got {v!r}")
        obs = Observation(a, b, o.norm_tput_a, o.norm_tput_b, source="observation")
        entries.append(obslog.encode(obs, o.node_id, o.time_unix_s or now))
    return entries


def load_or_train(settings: PredictorSettings) -> InterferenceModel:
    """The artifact at ``settings.model_path``; trained on the shipped data and saved there when absent."""
    path = Path(settings.model_path)
    if path.exists():
        try:
            return InterferenceModel.load(path)
        except ArtifactError as exc:
            log.warning("model artifact unusable; retraining", path=str(path), error=str(exc))
    log.info("training the interference model (no artifact yet)", path=str(path))
    model = train_model(training_rows(), seed=settings.seed)
    model.save(path)
    return model


class PredictorServicer(predictor_pb2_grpc.PredictorServicer):
    """Serves one model at a time; ``refresh`` retrains with observations and swaps it."""

    def __init__(self, settings: PredictorSettings, model: InterferenceModel | None = None,
                 log_store: obslog.ObservationLog | None = None) -> None:
        """``model`` defaults to :func:`load_or_train`; ``log_store`` to a process-local log."""
        self._settings = settings
        self.model = model if model is not None else load_or_train(settings)
        self._log = log_store if log_store is not None else obslog.MemoryObservationLog()
        self._base_rows: list[Observation] | None = None
        self._refresh_lock = asyncio.Lock()

    async def PredictInterference(self, request: prpb.PredictInterferenceRequest, context: grpc.aio.ServicerContext) -> prpb.PredictInterferenceResponse:
        n = len(request.pairs)
        if n == 0:
            raise InvalidSpec("pairs", "at least one pair is required")
        if n > self._settings.max_batch_pairs:
            raise InvalidSpec("pairs", f"at most {self._settings.max_batch_pairs} pairs per call, got {n}")
        model = self.model  # one model for the whole answer, even if a refresh swaps it meanwhile
        # conversion (~50 us per pair: 0.5 s at 10,000) and prediction are CPU-bound: both off the event loop
        pred = await asyncio.to_thread(_predict, model, request)
        return prpb.PredictInterferenceResponse(
            predictions=[prpb.PairPrediction(norm_tput_a=float(a), norm_tput_b=float(b), low_confidence=bool(low))
                         for (a, b), low in zip(pred.norm_tput.tolist(), pred.low_confidence.tolist(), strict=True)],
            model_version=pred.model_version,
        )

    async def ReportObservation(self, request: prpb.ReportObservationRequest, context: grpc.aio.ServicerContext) -> prpb.ReportObservationResponse:
        n = len(request.observations)
        if n == 0:
            raise InvalidSpec("observations", "at least one observation is required")
        if n > MAX_OBSERVATIONS_PER_CALL:
            raise InvalidSpec("observations", f"at most {MAX_OBSERVATIONS_PER_CALL} per call, got {n}")
        entries = await asyncio.to_thread(_observation_entries, request, current_caller().peer, time.time())
        await self._log.append(entries)
        return prpb.ReportObservationResponse(accepted=len(entries))

    async def GetModelInfo(self, request: prpb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> prpb.GetModelInfoResponse:
        m = self.model
        return prpb.GetModelInfoResponse(
            model_version=m.version, schema_version=m.schema_version, data_digest=m.data_digest,
            training_rows=int(m.meta.get("training_rows", 0)), trained_at_unix_s=float(m.meta.get("created_at_unix_s", 0.0)),
            metrics={k: float(v) for k, v in m.metrics.items()}, pending_observations=await self._log.pending(),
        )

    # --- online learning ------------------------------------------------------------------------------
    async def refresh(self, force: bool = False) -> bool:
        """Retrain on shipped data + all observations and swap the model; returns True if it swapped.

        Without ``force`` it only retrains once ``refresh_min_observations`` new ones have arrived.
        """
        async with self._refresh_lock:
            pending = await self._log.pending()
            if pending == 0 or (not force and pending < self._settings.refresh_min_observations):
                return False
            texts, last_id = await self._log.read_after("0-0")
            observed = [obslog.decode(t) for t in texts]
            if self._base_rows is None:
                self._base_rows = await asyncio.to_thread(training_rows)
            started = time.perf_counter()
            new = await asyncio.to_thread(train_model, self._base_rows + observed, self._settings.seed)
            await asyncio.to_thread(new.save, self._settings.model_path)
            self.model = new
            await self._log.mark_consumed(last_id)
            log.info("model refreshed", model_version=new.version, observations=len(observed),
                     training_s=round(time.perf_counter() - started, 2))
            return True

    async def refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._settings.refresh_interval_s)
            try:
                await self.refresh()
            except Exception as exc:  # noqa: BLE001 - a failed refresh keeps serving the old model
                log.error("model refresh failed; keeping the current model", error=str(exc), exc_info=exc)
