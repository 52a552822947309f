"""The one place where exceptions become gRPC statuses, and where every call is logged and metered.

Servicers raise domain errors (``elastico.errors``); this interceptor maps them to their status code
(INVALID_ARGUMENT carries the offending field in the message and in the ``field`` trailing metadata).
Anything unexpected is logged with a traceback and answered INTERNAL with an incident id, never UNKNOWN;
a request that does not decode is INVALID_ARGUMENT (the framework's deserializer is wrapped so its error
takes this path too). Streams end with OK when the server starts draining (``drain``), not cut mid-call.
Before the handler runs, the caller is authenticated and authorised (``elastico.rpc.security.authorize``:
certificate, then token), so UNAUTHENTICATED and PERMISSION_DENIED take the same path and the handler never
starts for a refused call. Every mutating call is written to the audit log with the caller and its outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import Counter, Histogram

from elastico.errors import ElasticoError, InvalidSpec, PermissionDenied
from elastico.limits import clip
from elastico.logging import get_logger
from elastico.rpc.security import Access, Caller, authorize, bind_caller
from elastico.tasks import cancel_until_done

REQUESTS = Counter("elastico_grpc_requests_total", "gRPC calls handled", ["service", "method", "code"])
LATENCY = Histogram(
    "elastico_grpc_request_seconds",
    "gRPC call latency in seconds (until the last message for streams)",
    ["service", "method"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)

log = get_logger(component="rpc")
audit_log = get_logger(component="audit")

# methods that change state: each call is audited (caller, job, outcome)
MUTATING = frozenset({"SubmitJob", "CancelJob", "Sync", "ReportObservation"})


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Map an exception to (status code, client-facing message)."""
    if isinstance(exc, ElasticoError):
        return grpc.StatusCode[exc.code_name], exc.message
    incident = uuid.uuid4().hex[:12]
    return grpc.StatusCode.INTERNAL, f"internal error (incident {incident}); see server logs"


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps unary and server-streaming handlers with error mapping, logging and metrics."""

    def __init__(self, service: str, access: dict[str, Access] | None = None, secure: bool = False) -> None:
        """``access`` maps a full service name to who may call it (absent: any certificate of the CA);
        ``secure``: client certificates are verified, so peer roles are checked."""
        self._service = service
        self._access = access or {}
        self._default_access = Access()
        self._secure = secure
        self._draining = asyncio.Event()
        self._bound_log = None
        self._handlers: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def _log(self):
        """The module logger bound once, at the first call (servers start after logging is configured): the
        lazy module logger re-binds on every call, ~10 us on every RPC for a debug line that is usually off."""
        if self._bound_log is None:
            self._bound_log = log.bind()
        return self._bound_log

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        # the wrapped handler of a method is built once (per call it cost a closure and a handler object)
        cached = self._handlers.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        decode = _safe_deserializer(handler.request_deserializer)
        if handler.unary_unary is not None:
            wrapped = grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(method, handler.unary_unary), request_deserializer=decode,
                response_serializer=handler.response_serializer)
        elif handler.unary_stream is not None:
            behavior = handler.unary_stream
            wrap = self._wrap_stream if inspect.isasyncgenfunction(behavior) else self._wrap_unary  # Health.Watch writes
            wrapped = grpc.unary_stream_rpc_method_handler(
                wrap(method, behavior), request_deserializer=decode, response_serializer=handler.response_serializer)
        elif handler.stream_stream is not None:  # server reflection: requests checked as they arrive
            wrapped = grpc.stream_stream_rpc_method_handler(
                _checked_requests(handler.stream_stream), request_deserializer=decode,
                response_serializer=handler.response_serializer)
        else:
            return handler  # client streaming: none served
        self._handlers[method] = (handler, wrapped)
        return wrapped

    def drain(self) -> None:
        """Server shutdown begins: every open stream ends cleanly (OK) at its next step."""
        self._draining.set()

    def _authorize(self, method: str, context: grpc.aio.ServicerContext) -> Caller:
        service = method[1:].split("/", 1)[0]
        return authorize(self._access.get(service, self._default_access), method, context, self._secure)

    def _audit(self, method: str, caller: Caller | None, request: Any, result: Any, code: grpc.StatusCode) -> None:
        name = method.rsplit("/", 1)[-1]
        if name not in MUTATING:
            return
        job_id = getattr(request, "job_id", "") or getattr(getattr(result, "job", None), "job_id", "")
        audit_log.info("audit", method=name, outcome=code.name, job_id=clip(job_id, 128),
                       request_id=clip(getattr(request, "request_id", ""), 128), **(caller or Caller()).describe())

    async def _fail(self, method: str, exc: BaseException, context: grpc.aio.ServicerContext, started: float,
                    caller: Caller | None = None, request: Any = None) -> None:
        code, message = status_for(exc)
        self._record(method, code, started)
        self._audit(method, caller, request, None, code)
        if code is grpc.StatusCode.INTERNAL:
            log.error("rpc failed", method=method, code=code.name, detail=message, exc_info=exc)
        else:
            log.info("rpc rejected", method=method, code=code.name, detail=message)
        if isinstance(exc, InvalidSpec | PermissionDenied) and exc.field:
            context.set_trailing_metadata((("field", exc.field),))
        await context.abort(code, message)

    def _record(self, method: str, code: grpc.StatusCode, started: float) -> None:
        REQUESTS.labels(self._service, method, code.name).inc()
        LATENCY.labels(self._service, method).observe(time.perf_counter() - started)

    def _wrap_unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = time.perf_counter()
            caller = None
            try:
                if isinstance(request, Undecodable):
                    raise request.error
                caller = self._authorize(method, context)
                bind_caller(caller)
                result = behavior(request, context)
                if inspect.isawaitable(result):
                    result = await result
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # noqa: BLE001 - this is the one error channel
                await self._fail(method, exc, context, started, caller, request)
                raise AssertionError("unreachable: context.abort raises") from exc  # pragma: no cover
            self._record(method, grpc.StatusCode.OK, started)
            self._audit(method, caller, request, result, grpc.StatusCode.OK)
            self._log().debug("rpc ok", method=method)
            return result

        return wrapped

    def _wrap_stream(self, method: str, behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            started = time.perf_counter()
            try:
                if isinstance(request, Undecodable):
                    raise request.error
                bind_caller(self._authorize(method, context))
                async for item in _until(behavior(request, context), self._draining):
                    yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # noqa: BLE001 - this is the one error channel
                await self._fail(method, exc, context, started)
                return
            self._record(method, grpc.StatusCode.OK, started)

        return wrapped


class Undecodable:
    """What the wrapped deserializer hands over instead of raising: the call then fails with ``error``."""

    __slots__ = ("error",)

    def __init__(self, error: InvalidSpec) -> None:
        self.error = error


def _safe_deserializer(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def safe(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError and any other parse failure of untrusted bytes
            return Undecodable(InvalidSpec("request", f"is not a valid message of this method ({type(exc).__name__})"))

    return safe


def _checked_requests(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """A bidi handler whose request stream aborts with INVALID_ARGUMENT at the first undecodable message."""

    async def wrapped(request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async def checked() -> AsyncIterator[Any]:
            async for r in request_iterator:
                if isinstance(r, Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, r.error.message)
                yield r

        async for item in behavior(checked(), context):
            yield item

    return wrapped


async def _until(stream: AsyncIterator[Any], stop: asyncio.Event) -> AsyncIterator[Any]:
    """The items of ``stream`` until it ends or ``stop`` is set (then it is closed and this ends normally)."""
    it = stream.__aiter__()
    stopping = asyncio.ensure_future(stop.wait())
    nxt: asyncio.Future | None = None
    try:
        while True:
            nxt = asyncio.ensure_future(it.__anext__())
            await asyncio.wait((nxt, stopping), return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                return
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        # stopping, or the call cancelled (the client went away or its deadline passed) while the stream waits
        # for its next item: that step is cancelled first (until it ends: a lost cancel would leave it waiting for
        # the next item, past the server's grace), since a generator cannot be closed while it runs
        stopping.cancel()
        if nxt is not None and not nxt.done():
            await cancel_until_done((nxt,))
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                nxt.result()  # an item it still produced is dropped: the stream is ending
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()
