"""HTTP(S) front end of the extender and the webhook (aiohttp): routing, JSON, metrics; no decisions here.

Routes: ``POST /filter``, ``/prioritize``, ``/bind`` (extender; ``urlPrefix`` in the scheduler config),
``POST /mutate`` (webhook), ``GET /healthz``. A body that is not JSON answers 400; an unexpected error answers
500 with an incident id (the traceback is in the log) — kube-scheduler then treats the extender call as failed.
"""

from __future__ import annotations

import json
import ssl
import time
import uuid

from aiohttp import web
from prometheus_client import Counter, Histogram

from elastico.logging import get_logger
from services.kube import webhook
from services.kube.extender import Extender
from services.kube.settings import KubeSettings

log = get_logger(component="kube-http")

REQUESTS = Counter("elastico_kube_requests_total", "Extender and webhook requests", ["endpoint", "outcome"])
SECONDS = Histogram("elastico_kube_request_seconds", "Extender and webhook request latency", ["endpoint"])


def _outcome(endpoint: str, answer) -> str:
    if endpoint == "mutate":
        return "allowed" if answer["response"]["allowed"] else "rejected"
    if isinstance(answer, dict) and answer.get("Error"):
        return "error"
    return "ok"


def build_app(settings: KubeSettings, extender: Extender | None) -> web.Application:
    """The aiohttp application for ``settings.role``."""

    def endpoint(name: str, handler):
        async def handle(request: web.Request) -> web.Response:
            t0 = time.perf_counter()
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                REQUESTS.labels(name, "bad_request").inc()
                return web.json_response({"error": "body must be JSON"}, status=400)
            try:
                answer = await handler(body)
            except ValueError as exc:
                REQUESTS.labels(name, "bad_request").inc()
                return web.json_response({"error": str(exc)}, status=400)
            except Exception:
                incident = uuid.uuid4().hex[:12]
                log.exception("request failed", endpoint=name, incident=incident)
                REQUESTS.labels(name, "internal").inc()
                return web.json_response({"error": f"internal error, incident {incident}"}, status=500)
            REQUESTS.labels(name, _outcome(name, answer)).inc()
            SECONDS.labels(name).observe(time.perf_counter() - t0)
            return web.json_response(answer)
        return handle

    async def healthz(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def mutate(body):
        return webhook.review(body, settings)

    app = web.Application(client_max_size=8 * 1024 * 1024)
    app.router.add_get("/healthz", healthz)
    if settings.role in ("webhook", "both"):
        app.router.add_post("/mutate", endpoint("mutate", mutate))
    if settings.role in ("extender", "both") and extender is not None:
        app.router.add_post("/filter", endpoint("filter", extender.filter))
        app.router.add_post("/prioritize", endpoint("prioritize", extender.prioritize))
        app.router.add_post("/bind", endpoint("bind", extender.bind))
    return app


def ssl_context(settings: KubeSettings) -> ssl.SSLContext | None:
    """Server TLS from the configured PEM files (None = plain HTTP)."""
    if not settings.tls_cert_file:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    return ctx


async def start(settings: KubeSettings, extender: Extender | None) -> tuple[web.AppRunner, int]:
    """Start serving; returns the runner (``await runner.cleanup()`` stops it) and the bound port."""
    runner = web.AppRunner(build_app(settings, extender), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, ssl_context=ssl_context(settings))
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # the bound port when settings.port is 0
    return runner, port
