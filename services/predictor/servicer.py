"""elastico.v1.Predictor over gRPC: a thin edge around ``services.predictor.model`` plus online learning.

Predictions run in a worker thread (XGBoost is CPU-bound; the event loop stays free for health checks).
Observations from node agents are validated (``observation_rules``) and go to a durable log (a Redis
stream); a periodic refresh retrains on the shipped data plus every learnable observation, writes the result
to the refreshed-model path (the shipped artifact is read-only input), then swaps the served model in one
assignment, so every answer comes from exactly one model and names its version.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Container
from pathlib import Path

import grpc

from elastico import limits as L
from elastico.errors import InvalidSpec, PermissionDenied
from elastico.limits import clip
from elastico.logging import get_logger
from elastico.rpc.security import current_caller
from elastico.v1 import predictor_pb2 as prpb
from elastico.v1 import predictor_pb2_grpc
from elastico.v1 import types_pb2 as pb
from services.predictor import observation_rules as rules
from services.predictor import observations as obslog
from services.predictor.features import JobProfile, Observation, canonical_gpu
from services.predictor.model import ArtifactError, InterferenceModel, artifact, train_model
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
        problem = L.text_problem(getattr(m, name), limit)  # bounded and printable
        if problem:
            raise InvalidSpec(f"{path}.{name}", problem)
    if m.batch_size > rules.BATCH_SIZE_MAX:
        raise InvalidSpec(f"{path}.batch_size", f"must be at most {rules.BATCH_SIZE_MAX}, got {m.batch_size}")
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
    for name in ("sm_util_pct", "mem_bw_util_pct", "mem_used_mib", "tensor_util_pct"):
        if c.HasField(name) and not math.isfinite(getattr(c, name)):
            raise InvalidSpec(f"{path}.counters.{name}", f"must be finite when set, got {getattr(c, name)!r}")
    if c.HasField("mem_used_mib") and c.mem_used_mib > rules.MEM_USED_MIB_MAX:
        raise InvalidSpec(f"{path}.counters.mem_used_mib", f"must be at most {rules.MEM_USED_MIB_MAX:g}, got {c.mem_used_mib!r}")
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


def _observation_entries(request: prpb.ReportObservationRequest, peer, now: float, settings: PredictorSettings,
                         families: Container[str]) -> list[str]:
    """Validate every observation (one malformed rejects the call: none is logged) and encode those the model
    can learn from (``observation_rules.learnable``); the others are dropped, not refused."""
    entries = []
    for i, o in enumerate(request.observations):
        path = f"observations[{i}]"
        problem = L.text_problem(o.node_id, L.NODE_ID_MAX_CHARS) or (None if o.node_id else "must not be empty")
        if problem:
            raise InvalidSpec(f"{path}.node_id", problem)
        if peer is not None and peer.role == "node" and o.node_id != peer.node_id:
            raise PermissionDenied(f"agent {peer.name!r} reports for its own node only", f"{path}.node_id")
        a, b = pair_from_pb(o, path)
        for name in ("norm_tput_a", "norm_tput_b"):
            problem = rules.norm_problem(getattr(o, name))
            if problem:
                raise InvalidSpec(f"{path}.{name}", problem)
        t = o.time_unix_s or now  # 0 = unset: the predictor's clock
        problem = rules.time_problem(t, now, settings.observation_max_age_s, settings.observation_max_future_s)
        if problem:
            raise InvalidSpec(f"{path}.time_unix_s", problem)
        obs = Observation(a, b, o.norm_tput_a, o.norm_tput_b, source="observation")
        if rules.learnable(obs, families):
            entries.append(obslog.encode(obs, o.node_id, t))
    return entries


def _load(path: Path) -> InterferenceModel | None:
    """The artifact at ``path``; None (logged) when it is absent or unusable."""
    if not path.exists():
        return None
    try:
        return InterferenceModel.load(path)
    except ArtifactError as exc:
        log.warning("model artifact unusable; ignoring it", path=str(path), error=str(exc))
        return None


def load_or_train(settings: PredictorSettings) -> InterferenceModel:
    """The model to serve at start-up: the refreshed one if it loads and is not older than the shipped one,
    else the shipped artifact (``model_path``, never written), else one trained in memory on the shipped data."""
    shipped_path, refreshed_path = Path(settings.model_path), settings.effective_refreshed_model_path
    refreshed = _load(refreshed_path)
    if refreshed is not None:
        shipped_at = _created_at(shipped_path)  # metadata only: a full load takes seconds
        if shipped_at is None or float(refreshed.meta.get("created_at_unix_s") or 0.0) >= shipped_at:
            log.info("serving the refreshed model", path=str(refreshed_path), model_version=refreshed.version)
            return refreshed
        # an upgrade shipped a newer model; the next refresh retrains from the shipped data and every observation
        log.warning("refreshed model predates the shipped one; ignoring it", path=str(refreshed_path))
    shipped = _load(shipped_path)
    if shipped is not None:
        log.info("serving the shipped model", path=str(shipped_path), model_version=shipped.version)
        return shipped
    if refreshed is not None:
        log.info("serving the refreshed model", path=str(refreshed_path), model_version=refreshed.version)
        return refreshed
    log.info("training the interference model in memory (no usable artifact)", path=str(shipped_path))
    return train_model(training_rows(), seed=settings.seed)


def _created_at(path: Path) -> float | None:
    """``created_at_unix_s`` of the artifact at ``path``; None when it cannot be read."""
    try:
        return float(artifact.read_json(path)["created_at_unix_s"])
    except (ArtifactError, OSError, KeyError, TypeError, ValueError):
        return None


def save_private(model: InterferenceModel, path: Path) -> Path:
    """Write ``model`` atomically to ``path``, for this user only (file 0600; a folder it creates 0700)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return model.save(path)


#: what one node's observations may weigh in a retrain (the newest are kept): at most this many rows of one pair
#: (the same two profiles) and in all -- a node, or its certificate, cannot outvote the shipped data and the others
OBSERVATIONS_PER_NODE_PAIR = 32
OBSERVATIONS_PER_NODE = 100


def _learnable_logged(texts: list[str], families: Container[str]) -> tuple[list[Observation], int]:
    """Decode the logged observations (oldest first) and keep those the model may learn from (entries logged
    before the checks of :func:`_observation_entries` existed may not pass them), each node's newest within
    ``OBSERVATIONS_PER_NODE_PAIR`` / ``OBSERVATIONS_PER_NODE``; returns them and how many were dropped."""
    kept: list[Observation] = []
    per_node: dict[str, int] = {}
    per_pair: dict[tuple, int] = {}
    for t in reversed(texts):  # newest first: what a node's caps keep
        try:
            raw = json.loads(t)
            obs, node = obslog.from_record(raw), str(raw.get("node_id", ""))
            pair = (node, json.dumps(raw["a"], sort_keys=True), json.dumps(raw["b"], sort_keys=True))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if not rules.learnable(obs, families):
            continue
        if per_node.get(node, 0) >= OBSERVATIONS_PER_NODE or per_pair.get(pair, 0) >= OBSERVATIONS_PER_NODE_PAIR:
            continue
        per_node[node] = per_node.get(node, 0) + 1
        per_pair[pair] = per_pair.get(pair, 0) + 1
        kept.append(obs)
    kept.reverse()
    return kept, len(texts) - len(kept)


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
        families = frozenset(self.model.meta.get("families_seen") or ())
        entries = await asyncio.to_thread(_observation_entries, request, current_caller().peer, time.time(),
                                          self._settings, families)
        if entries:
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
        """Retrain on shipped data + all learnable observations, write the model to the refreshed-model path
        and swap it in; returns True if it swapped.

        Without ``force`` it only retrains once ``refresh_min_observations`` new ones have arrived.
        """
        async with self._refresh_lock:
            pending = await self._log.pending()
            if pending == 0 or (not force and pending < self._settings.refresh_min_observations):
                return False
            texts, last_id = await self._log.read_after("0-0")
            if self._base_rows is None:
                self._base_rows = await asyncio.to_thread(training_rows)
            families = {p.model_family for o in self._base_rows for p in (o.a, o.b)}
            observed, dropped = _learnable_logged(texts, families)
            started = time.perf_counter()
            new = await asyncio.to_thread(train_model, self._base_rows + observed, self._settings.seed)
            path = self._settings.effective_refreshed_model_path  # never model_path: the shipped model is input
            await asyncio.to_thread(save_private, new, path)
            self.model = new
            await self._log.mark_consumed(last_id)
            log.info("model refreshed", model_version=new.version, observations=len(observed), dropped=dropped,
                     path=str(path), training_s=round(time.perf_counter() - started, 2))
            return True

    async def refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._settings.refresh_interval_s)
            try:
                await self.refresh()
            except Exception as exc:  # noqa: BLE001 - a failed refresh keeps serving the old model
                log.error("model refresh failed; keeping the current model", error=str(exc), exc_info=exc)
