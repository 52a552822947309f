"""``python -m services.allocator``: the allocator service (job API + scheduling rounds while leader)."""

from __future__ import annotations

import sys

from elastico.healthcheck import STORE_SERVICE
from elastico.logging import get_logger
from elastico.rpc.security import ClientTLS
from elastico.rpc.server import ServiceBinding, run_main
from elastico.state.redis_store import RedisStore
from elastico.v1 import allocator_pb2, allocator_pb2_grpc
from services.allocator.clients import AgentNudger, GrpcSolver, PredictorClient
from services.allocator.leader import LeaderLease
from services.allocator.rounds import Scheduler, tune_gc
from services.allocator.servicer import AllocatorServicer, api_access
from services.allocator.settings import AllocatorSettings


def build(settings: AllocatorSettings):
    async def _build():
        log = get_logger(component="allocator")
        store = RedisStore.from_url(settings.redis_url, namespace=settings.redis_namespace)
        await store.ping()  # fail fast on a wrong URL instead of on the first call
        scheduler = lease = None
        tls = ClientTLS.from_settings(settings)
        if settings.schedule:
            lease = LeaderLease(store, settings.effective_replica_id, ttl_s=settings.lease_ttl_s)
            solver = GrpcSolver(settings.pricer_address, settings.pricer_timeout_s, tls) if settings.pricer_address else None
            if solver is None and settings.policy == "elastico":
                log.warning("no ELASTICO_PRICER_ADDRESS: pricing runs in-process (services.pricer.core)")
            predictor = (PredictorClient(settings.predictor_address, settings.predictor_timeout_s, tls)
                         if settings.predictor_address and settings.estimator == "predictor" else None)
            scheduler = Scheduler(store, settings, lease, solver=solver, predictor=predictor,
                                  nudger=AgentNudger(settings.sync_timeout_s, tls))
            lease.start()
            scheduler.start()
            log.info("scheduling enabled", replica=lease.holder, policy=settings.policy, estimator=settings.estimator,
                     round_interval_s=settings.round_interval_s, time_scale=settings.time_scale)
        servicer = AllocatorServicer(store, settings, on_change=scheduler.wake if scheduler else None)
        access = api_access(settings)
        if access.tokens is None:
            log.warning("no ELASTICO_AUTH_TOKENS_FILE: the Allocator API takes calls without tokens (ELASTICO_INSECURE=1)")
        # a scheduling replica reports whether it reaches the store: node agents cut off from it ask, to tell their
        # own partition (their workloads must stop: this replica may requeue them) from an outage of everyone's
        probes = {STORE_SERVICE: lease.store_reachable} if lease is not None else {}
        binding = ServiceBinding(allocator_pb2.DESCRIPTOR.services_by_name["Allocator"].full_name,
                                 servicer, allocator_pb2_grpc.add_AllocatorServicer_to_server, access, probes)
        tune_gc()  # start-up objects frozen: a full collection no longer walks them inside a round

        async def cleanup() -> None:
            if scheduler is not None:
                await scheduler.close()
            if lease is not None:
                await lease.stop()  # hand the lease back: a standby takes over at once
            await store.close()

        return [binding], cleanup

    return _build


if __name__ == "__main__":
    sys.exit(run_main(AllocatorSettings.from_env, build))
