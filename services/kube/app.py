"""HTTP(S) front end of the extender and the webhook (aiohttp): routing, JSON, metrics; no decisions here.

Routes: ``POST /filter``, ``/prioritize``, ``/bind`` (extender; ``urlPrefix`` in the scheduler config),
``POST /mutate`` (webhook), ``GET /healthz``. A body that is not JSON, or whose fields the handlers read have the
wrong JSON types (``schema.py``), answers 400 naming the field; an unexpected error answers
500 with an incident id (the traceback is in the log) — kube-scheduler then treats the extender call as failed.

Client certificates (TLS on, not ``ELASTICO_INSECURE``): the handshake verifies any presented one against
``ELASTICO_HTTP_CLIENT_CA_FILE`` (default the cluster CA) but demands none (kubelet probes ``/healthz`` without one).
The extender verbs answer 403 unless it is kube-scheduler's (CN ``kube-scheduler`` or ``operator``); ``/mutate``
answers 403 without one unless ``ELASTICO_HTTP_REQUIRE_CLIENT_CERT=0`` (role webhook only); ``/healthz`` is open.
"""

from __future__ import annotations

import json
import ssl
import time
import uuid

from aiohttp import web
from prometheus_client import Counter, Histogram

from elastico.logging import get_logger
from elastico.rpc.security import file_stamp
from services.kube import schema, webhook
from services.kube.extender import Extender
from services.kube.settings import KubeSettings

log = get_logger(component="kube-http")

REQUESTS = Counter("elastico_kube_requests_total", "Extender and webhook requests", ["endpoint", "outcome"])
SECONDS = Histogram("elastico_kube_request_seconds", "Extender and webhook request latency", ["endpoint"])


# who may call the extender verbs: kube-scheduler (its tlsConfig certFile, deploy/kubernetes/certificates.yaml) and
# an operator (docs/security.md: an operator may call every service)
EXTENDER_CLIENTS = frozenset({"kube-scheduler", "operator"})


def client_auth(settings: KubeSettings) -> bool:
    """Whether the HTTPS server verifies and checks client certificates (TLS on and not ``ELASTICO_INSECURE``)."""
    return bool(settings.tls_cert_file) and not settings.insecure


def client_ca_file(settings: KubeSettings) -> str:
    return settings.http_client_ca_file or settings.tls_ca_file


def client_name(request: web.Request) -> str | None:
    """The common name of the request's verified client certificate ("" if it has none); None without a certificate."""
    transport = request.transport
    cert = transport.get_extra_info("peercert") if transport is not None else None
    if not cert:  # None: no certificate; {} would be an unverified one, which CERT_OPTIONAL never lets through
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return value
    return ""


def refusal(settings: KubeSettings, kind: str, request: web.Request) -> str | None:
    """Why ``request`` may not call a route of ``kind`` ("extender" or "webhook"); None when it may."""
    if not client_auth(settings):
        return None
    name = client_name(request)
    if kind == "extender":
        if name is None:
            return ("a client certificate is required: kube-scheduler's (extenders[].tlsConfig certFile/keyFile, "
                    "CN kube-scheduler)")
        if name not in EXTENDER_CLIENTS:
            allowed = ", ".join(sorted(EXTENDER_CLIENTS))
            return f"client certificate {name!r} may not call the extender (allowed: {allowed})"
        return None
    if name is None and settings.http_require_client_cert:
        return ("a client certificate is required: the API server presents one when its AdmissionConfiguration "
                "gives this webhook a kubeconfig (docs/security.md)")
    return None


def _outcome(endpoint: str, answer) -> str:
    if endpoint == "mutate":
        return "allowed" if answer["response"]["allowed"] else "rejected"
    if isinstance(answer, dict) and answer.get("Error"):
        return "error"
    return "ok"


def build_app(settings: KubeSettings, extender: Extender | None) -> web.Application:
    """The aiohttp application for ``settings.role``."""

    def endpoint(name: str, handler):
        kind = "webhook" if name == "mutate" else "extender"

        async def handle(request: web.Request) -> web.Response:
            t0 = time.perf_counter()
            why = refusal(settings, kind, request)
            if why is not None:
                REQUESTS.labels(name, "forbidden").inc()
                log.warning("caller refused", endpoint=name, client=client_name(request), remote=request.remote,
                            reason=why)
                body = {"error": why}
                if kind == "extender":
                    body["Error"] = f"elastico: {why}"  # the extender protocol's error field (kube-scheduler logs it)
                else:  # a metav1.Status, which the API server can report
                    body.update(kind="Status", apiVersion="v1", status="Failure", reason="Forbidden", code=403,
                                message=why)
                return web.json_response(body, status=403)
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                REQUESTS.labels(name, "bad_request").inc()
                return web.json_response({"error": "body must be JSON"}, status=400)
            except RecursionError:  # valid JSON nested deeper than the decoder can follow (no request of ours is)
                REQUESTS.labels(name, "bad_request").inc()
                return web.json_response({"error": "body is nested too deeply"}, status=400)
            try:
                schema.check(name, body)
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
    """Server TLS from the configured PEM files (None = plain HTTP); client certificates verified, not demanded.

    The files are re-read at the first handshake after one changed (cert-manager renews the mounted Secret):
    the handshake's SNI callback swaps in a context built from the new files.
    """
    if not settings.tls_cert_file:
        return None
    paths = [p for p in (settings.tls_cert_file, settings.tls_key_file, client_ca_file(settings) if client_auth(settings) else "") if p]
    state = {"stamp": file_stamp(paths), "ctx": _build_context(settings)}

    def reload_if_changed(sock: ssl.SSLObject, _server_name: str | None, _ctx: ssl.SSLContext) -> None:
        stamp = file_stamp(paths)
        if stamp != state["stamp"]:
            try:
                state["ctx"] = _build_context(settings)
                state["ctx"].sni_callback = reload_if_changed
                state["stamp"] = stamp
                log.info("TLS certificate reloaded", cert_file=settings.tls_cert_file)
            except (OSError, ssl.SSLError) as exc:  # mid-rotation: keep serving the previous certificate
                log.warning("TLS files unreadable; keeping the previous certificate", error=str(exc))
        if state["ctx"] is not _ctx:
            sock.context = state["ctx"]

    state["ctx"].sni_callback = reload_if_changed
    return state["ctx"]


def _build_context(settings: KubeSettings) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)  # trusts no system CA for clients
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    if client_auth(settings):
        ctx.load_verify_locations(cafile=client_ca_file(settings))
        # OPTIONAL: a presented certificate must chain to the CA (else the handshake fails), but none is demanded
        # at the TLS layer: kubelet's probes of /healthz present none; the routes check (refusal)
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


async def start(settings: KubeSettings, extender: Extender | None) -> tuple[web.AppRunner, int]:
    """Start serving; returns the runner (``await runner.cleanup()`` stops it) and the bound port."""
    runner = web.AppRunner(build_app(settings, extender), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, ssl_context=ssl_context(settings))
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # the bound port when settings.port is 0
    return runner, port
