"""Server bootstrap shared by every service.

``create_server`` builds a ``grpc.aio`` server with the health service, reflection, the error/metrics/auth
interceptor, mTLS on its port (plaintext only with ``ELASTICO_INSECURE=1``, on loopback) and (optionally) a
Prometheus ``/metrics`` endpoint. ``serve`` runs it until SIGTERM/SIGINT
and shuts down gracefully: health flips to NOT_SERVING first (load balancers and Health.Watch clients see
it), open streams end with OK, the port keeps answering for ``shutdown_drain_s`` so that callers move
elsewhere, then in-flight calls get ``shutdown_grace_s`` to finish, then the service's own cleanup runs.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from elastico.config import Settings, redact_url, redis_has_password, write_port_file
from elastico.errors import Unavailable
from elastico.logging import configure_logging, get_logger
from elastico.rpc.interceptors import ErrorMappingInterceptor
from elastico.rpc.security import Access, TLSFiles, server_credentials

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEALTH_PROBE_INTERVAL_S = 0.5


@dataclass(frozen=True)
class ServiceBinding:
    """One gRPC service to expose: its full name, its servicer and the generated ``add_*_to_server``."""

    name: str  # full service name, e.g. "elastico.v1.Pricer"
    servicer: Any
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    access: Access = field(default_factory=Access)  # who may call it (default: any certificate of the CA)
    # further health-service names this process answers, each SERVING while its probe returns True (polled every
    # HEALTH_PROBE_INTERVAL_S while serving), e.g. the allocator's view of the store (elastico.healthcheck.STORE_SERVICE)
    health_probes: Mapping[str, Callable[[], bool]] = field(default_factory=dict)


@dataclass
class ElasticoServer:
    """A started-or-startable server with its health servicer and metrics endpoint."""

    grpc_server: grpc.aio.Server
    health: health_aio.HealthServicer
    service_names: tuple[str, ...]
    metrics_port: int | None = None
    interceptor: ErrorMappingInterceptor | None = None
    probes: Mapping[str, Callable[[], bool]] = field(default_factory=dict)  # ServiceBinding.health_probes, merged
    _metrics_http: Any = field(default=None, repr=False)
    _probe_task: asyncio.Task[None] | None = field(default=None, repr=False)

    async def start(self) -> None:
        await self.grpc_server.start()
        await self.set_serving(True)
        if self.probes:
            await self.poll_probes()
            self._probe_task = asyncio.create_task(self._probe_forever())

    async def poll_probes(self) -> None:
        """Set each probed health name from its probe (a probe that raises reads as NOT_SERVING)."""
        for name, probe in self.probes.items():
            try:
                ok = bool(probe())
            except Exception:  # noqa: BLE001 - a broken probe must not stop the others or the server
                get_logger(component="health").exception("health probe failed", service=name)
                ok = False
            await self.health.set(name, SERVING if ok else NOT_SERVING)

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_PROBE_INTERVAL_S)
            await self.poll_probes()

    async def set_serving(self, serving: bool) -> None:
        """Flip every service's health status (the overall "" service included)."""
        status = SERVING if serving else NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float, drain_s: float = 0.0) -> None:
        """NOT_SERVING and streams ended, ``drain_s`` still serving, then in-flight calls get ``grace_s``, then close."""
        if self._probe_task is not None:
            self._probe_task.cancel()
            self._probe_task = None
        await self.set_serving(False)
        if self.interceptor is not None:
            self.interceptor.drain()
        if drain_s > 0:
            await asyncio.sleep(drain_s)
        await self.grpc_server.stop(grace_s)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None


async def create_server(settings: Settings, bindings: Sequence[ServiceBinding]) -> tuple[ElasticoServer, int]:
    """Build the server for ``bindings`` and bind ``settings.host:settings.port``.

    Returns:
        The server (not yet started) and the bound port (the real one when ``settings.port`` is 0).
    """
    files = TLSFiles.from_settings(settings)
    access = {b.name: b.access for b in bindings}
    interceptor = ErrorMappingInterceptor(settings.service_name, access,
                                          secure=files is not None and settings.tls_require_client_cert)
    server = grpc.aio.server(
        interceptors=[interceptor],
        options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", int(settings.max_request_mib * (1 << 20))),
                 # a burst of calls waits to be taken up instead of being refused (Settings.max_pending_rpcs)
                 ("grpc.server.max_pending_requests", settings.max_pending_rpcs),
                 ("grpc.server.max_pending_requests_hard_limit", 2 * settings.max_pending_rpcs)],
    )
    for b in bindings:
        b.add_to_server(b.servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = tuple(b.name for b in bindings)
    reflection.enable_server_reflection((*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    address = f"{settings.host}:{settings.port}"
    try:
        if files is None:
            get_logger(component="security").warning(
                "ELASTICO_INSECURE=1: plaintext gRPC without client certificates, loopback only", address=address)
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, server_credentials(files, settings.tls_require_client_cert))
    except RuntimeError:  # grpc's "Failed to bind", whatever the cause (see the message below)
        port = 0
    if port == 0:
        tls = "" if files is None else (", or ELASTICO_TLS_CERT_FILE and ELASTICO_TLS_KEY_FILE do not hold a matching "
                                        "certificate and key")
        raise Unavailable(f"cannot serve on ELASTICO_HOST={settings.host!r} ELASTICO_PORT={settings.port}: the port is in "
                          f"use, or the host is not an address of this machine (an IPv6 address goes in brackets){tls}")
    probes = {name: probe for b in bindings for name, probe in b.health_probes.items()}
    es = ElasticoServer(grpc_server=server, health=health, service_names=names, interceptor=interceptor, probes=probes)
    for name in ("", *names, *probes):
        await health.set(name, NOT_SERVING)
    if settings.metrics_port >= 0:
        try:
            http, _thread = start_http_server(settings.metrics_port, addr=settings.host)
        except OSError as exc:
            raise Unavailable(f"cannot serve metrics on ELASTICO_METRICS_PORT={settings.metrics_port}: {exc.strerror}") from None
        es._metrics_http = http
        es.metrics_port = http.server_port
    return es, port


Cleanup = Callable[[], Awaitable[None]]


async def serve(
    settings: Settings,
    build: Callable[[], Awaitable[tuple[Sequence[ServiceBinding], Cleanup | None]]],
) -> None:
    """Run a service until SIGTERM/SIGINT.

    Args:
        settings: the service's validated settings.
        build: creates the servicers (and background tasks) and returns the bindings and an optional
            cleanup coroutine run after the server has drained.
    """
    log = configure_logging(settings.service_name, settings.log_level, settings.log_format)
    if settings.redis_url and not redis_has_password(settings.redis_url):
        log.warning("Redis without a password (ELASTICO_REDIS_ALLOW_NO_AUTH or ELASTICO_INSECURE): whoever reaches it "
                    "can rewrite desired state", redis_url=redact_url(settings.redis_url))
    bindings, cleanup = await build()
    server, port = await create_server(settings, bindings)
    await server.start()
    if settings.port_file:
        write_port_file(settings.port_file, port)
    log.info("serving", address=f"{settings.host}:{port}", metrics_port=server.metrics_port, services=list(server.service_names))

    await wait_for_stop_signal()
    log.info("shutting down", drain_s=settings.shutdown_drain_s, grace_s=settings.shutdown_grace_s)
    await server.stop(settings.shutdown_grace_s, settings.shutdown_drain_s)
    if cleanup is not None:
        await cleanup()
    log.info("stopped")


async def wait_for_stop_signal() -> None:
    """Return on the first SIGTERM or SIGINT (the graceful-stop trigger of every ElastiCo process)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def run_main(settings_factory: Callable[[], Settings], build_factory: Callable[[Settings], Callable[[], Awaitable[Any]]]) -> int:
    """Entry point helper for ``python -m services.<name>``: config errors exit 2 with a clear message."""
    import sys

    from elastico.errors import ConfigError, ElasticoError

    try:
        settings = settings_factory()
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(settings, build_factory(settings)))
    except ConfigError as exc:  # a setting found unusable while building the service (a token file, a certificate)
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    except ElasticoError as exc:  # e.g. Redis unreachable at start-up, the port taken
        print(f"{settings.service_name}: cannot start: {exc}", file=sys.stderr)
        return 3
    return 0


__all__ = ["ElasticoServer", "ServiceBinding", "create_server", "get_logger", "run_main", "serve"]
