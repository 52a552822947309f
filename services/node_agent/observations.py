"""Co-located throughput measured on this node, sent to the predictor (``ReportObservation``).

Best effort by design: observations improve the interference model over time, but a predictor that is
down, slow or not built yet (UNIMPLEMENTED) must never slow down or break reconciliation. Every call
carries a deadline; failures are logged (UNIMPLEMENTED once) and dropped.
"""

from __future__ import annotations

import math
import time

import grpc

from elastico.domain import JobKind
from elastico.limits import NORM_TPUT_MAX
from elastico.logging import get_logger
from elastico.rpc.security import ClientTLS, ReloadingStub
from elastico.v1 import predictor_pb2, predictor_pb2_grpc, types_pb2
from services.node_agent.runner import LedgerEntry

log = get_logger(component="observations")


_KIND = {JobKind.TRAINING.value: types_pb2.JOB_KIND_TRAINING, JobKind.INFERENCE.value: types_pb2.JOB_KIND_INFERENCE}


def profile(e: LedgerEntry, gpu_type: str) -> predictor_pb2.TaskProfile:
    return predictor_pb2.TaskProfile(job_id=e.job_id, model_family=e.model, batch_size=e.batch_size,
                                     precision=e.precision, kind=_KIND.get(e.kind, types_pb2.JOB_KIND_UNSPECIFIED),
                                     gpu_type=gpu_type, mps_share_pct=e.mps_limit_pct)


def reportable(e: LedgerEntry) -> bool:
    """Whether the predictor accepts ``e``'s measurement: normalised throughput in (0, NORM_TPUT_MAX] (above it the
    reference speed is wrong, which is no interference) and a printable model family. The predictor refuses a
    whole call for one bad observation, so the others are not lost with it."""
    n = e.norm_throughput
    return (n is not None and math.isfinite(n) and 0.0 < n <= NORM_TPUT_MAX and bool(e.model.strip())
            and all(x.isprintable() for x in (e.model, e.precision, e.job_id)))


def to_observation(a: LedgerEntry, b: LedgerEntry, node_id: str, gpu_type: str) -> predictor_pb2.Observation:
    """The measured pair as sent (both entries :func:`reportable`), timed by this node's clock."""
    return predictor_pb2.Observation(a=profile(a, gpu_type), b=profile(b, gpu_type),
                                     norm_tput_a=a.norm_throughput or 0.0, norm_tput_b=b.norm_throughput or 0.0,
                                     node_id=node_id, time_unix_s=time.time())


class PredictorReporter:
    """Sends observations over one long-lived channel, each call with ``timeout_s``."""

    def __init__(self, address: str, gpu_type: str, timeout_s: float = 2.0, tls: ClientTLS | None = None) -> None:
        self._stub = ReloadingStub(tls or ClientTLS(None), address, predictor_pb2_grpc.PredictorStub)
        self._gpu_type = gpu_type
        self._timeout_s = timeout_s
        self._unimplemented_logged = False
        self.sent = 0

    async def __call__(self, pairs: list[tuple[LedgerEntry, LedgerEntry, str]]) -> None:
        kept = [p for p in pairs if reportable(p[0]) and reportable(p[1])]
        if len(kept) < len(pairs):
            log.debug("observations not reported: out of the predictor's range", count=len(pairs) - len(kept))
        if not kept:
            return
        pairs = kept
        req = predictor_pb2.ReportObservationRequest(
            observations=[to_observation(a, b, node, self._gpu_type) for a, b, node in pairs])
        try:
            resp = await self._stub.ReportObservation(req, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                if not self._unimplemented_logged:
                    log.info("predictor does not accept observations yet (UNIMPLEMENTED); continuing", detail=exc.details())
                    self._unimplemented_logged = True
                return
            log.warning("ReportObservation failed; dropping observations", code=exc.code().name,
                        detail=exc.details(), count=len(pairs))
            return
        self.sent += len(pairs)
        log.debug("observations reported", count=len(pairs), accepted=resp.accepted)

    async def close(self) -> None:
        await self._stub.close()
