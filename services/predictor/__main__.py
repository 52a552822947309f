"""``python -m services.predictor``: the interference model service.

Loads the refreshed model from its state dir when there is a usable one, else the shipped artifact (else
trains one in memory: seconds, deterministic seed), serves it, and retrains periodically on node-agent
observations, writing each retrained model to the state dir, never over the shipped artifact.
"""

from __future__ import annotations

import asyncio
import sys

from elastico.logging import get_logger
from elastico.rpc.security import Access, PeerPolicy, roles
from elastico.rpc.server import ServiceBinding, run_main
from elastico.tasks import cancel_until_done
from elastico.v1 import predictor_pb2, predictor_pb2_grpc
from services.predictor import observations as obslog
from services.predictor.servicer import PredictorServicer, load_or_train
from services.predictor.settings import PredictorSettings

# predictions for the allocator and the Kubernetes extender, observations from node agents (each for its own node)
ACCESS = Access(PeerPolicy(roles("allocator", "kube", "operator"), {
    "ReportObservation": roles("node", "operator"),
    "GetModelInfo": roles("allocator", "kube", "operator", "node")}))


def build(settings: PredictorSettings):
    async def _build():
        log_store: obslog.ObservationLog
        if settings.redis_url:
            redis_log = obslog.RedisObservationLog(settings.redis_url, settings.redis_namespace)
            await redis_log.ping()  # fail fast (exit 3) on a Redis it cannot reach, as the allocator does
            log_store = redis_log
        else:
            get_logger(component="predictor").warning("no ELASTICO_REDIS_URL: observations are kept in memory only")
            log_store = obslog.MemoryObservationLog()
        model = await asyncio.to_thread(load_or_train, settings)
        servicer = PredictorServicer(settings, model, log_store)
        task = asyncio.create_task(servicer.refresh_forever()) if settings.refresh_interval_s > 0 else None

        async def cleanup() -> None:
            if task is not None:
                await cancel_until_done([task])
            await log_store.close()

        binding = ServiceBinding(predictor_pb2.DESCRIPTOR.services_by_name["Predictor"].full_name, servicer,
                                 predictor_pb2_grpc.add_PredictorServicer_to_server, ACCESS)
        return [binding], cleanup

    return _build


if __name__ == "__main__":
    sys.exit(run_main(PredictorSettings.from_env, build))
