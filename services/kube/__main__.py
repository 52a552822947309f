"""``python -m services.kube``: the scheduler extender and/or the admission webhook (``ELASTICO_ROLE``)."""

from __future__ import annotations

import asyncio
import sys

from prometheus_client import start_http_server

from elastico.client import AsyncAllocatorClient
from elastico.config import ConfigError, write_port_file
from elastico.logging import configure_logging
from elastico.rpc.security import ClientTLS, ReloadingStub, read_token
from elastico.rpc.server import wait_for_stop_signal
from elastico.v1 import predictor_pb2_grpc
from services.kube import app
from services.kube.extender import Extender
from services.kube.settings import KubeSettings


async def serve(settings: KubeSettings) -> None:
    log = configure_logging(settings.service_name, settings.log_level, settings.log_format)
    extender = channels = None
    loops: list[asyncio.Task] = []
    if settings.role in ("extender", "both"):
        from services.kube.kubeapi import KubeApi

        token = read_token(settings.client_token_file) if settings.client_token_file else ""
        # clients that pick up renewed certificates (cert-manager rotates the mounted Secret) without a restart; the
        # allocator's calls are retried once (UNAVAILABLE, or a deadline miss of an idempotent call), each within
        # ELASTICO_ALLOCATOR_TIMEOUT_S, so that a filter still fails closed within about twice that
        allocator = AsyncAllocatorClient(settings.allocator_address, tls=ClientTLS.from_settings(settings, token),
                                         deadline_s=settings.allocator_timeout_s, retries=1)
        channels = [allocator]
        predictor = None
        if settings.predictor_address:
            predictor = ReloadingStub(ClientTLS.from_settings(settings), settings.predictor_address,
                                      predictor_pb2_grpc.PredictorStub)
            channels.append(predictor)
        extender = Extender(settings, allocator, predictor, KubeApi(settings))
        if settings.reap_interval_s > 0:
            loops.append(asyncio.create_task(extender.reap_forever()))
        if settings.evict_interval_s > 0:
            from services.kube.evictions import EvictionController

            loops.append(asyncio.create_task(EvictionController(extender).run_forever()))
    if settings.metrics_port >= 0:
        start_http_server(settings.metrics_port, addr=settings.host)
    runner, port = await app.start(settings, extender)
    if settings.port_file:
        write_port_file(settings.port_file, port)
    log.info("serving", role=settings.role, port=port, tls=bool(settings.tls_cert_file))
    await wait_for_stop_signal()
    log.info("stopping", grace_s=settings.shutdown_grace_s)
    for task in loops:
        task.cancel()
    await runner.shutdown()
    await runner.cleanup()
    for stub in channels or ():
        await stub.close(grace=settings.shutdown_grace_s)


def main() -> int:
    try:
        settings = KubeSettings.from_env()
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(settings))
    except ConfigError as exc:  # found while starting: no Kubernetes API
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the port taken, or the host not an address of this machine
        print(f"kube: cannot start: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
