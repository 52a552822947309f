"""The Python client of the Allocator API: typed methods, deadlines, bounded retries, paging, resumable watches.

``AllocatorClient`` (blocking, grpc) and ``AsyncAllocatorClient`` (grpc.aio) share the request building, the
validation and the retry policy of ``_Core``; both return domain objects (``elastico.domain``). Channels come from
``elastico.rpc.security.ClientTLS`` (mTLS files re-read after a rotation, bearer token), requests from
``elastico.rpc.convert``.

Retries: UNAVAILABLE is retried on every call, DEADLINE_EXCEEDED on the idempotent ones (reads; SubmitJob, whose
request id is chosen once and kept across the attempts, so a retry returns the job the first attempt created;
ReportDemand, idempotent per window end; CancelJob, whose retry after a lost reply reads the job rather than
reporting "already cancelled"), with exponential backoff and jitter, ``retries`` times at most. With
several addresses (allocator replicas) a retry goes to the next one. Everything else (INVALID_ARGUMENT,
NOT_FOUND, FAILED_PRECONDITION...) surfaces at once. Every failure is one exception type, ``AllocatorError``,
carrying the status code, the field it names ("spec.shapes[0].mem_mib: must be > 0" -> field
``spec.shapes[0].mem_mib``) and the message.

``NodeAgentClient`` reads a node agent's status and workloads (observed speeds, endpoints) over the same
credentials, without the token (agents take certificates only).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import math
import os
import random
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from elastico import domain as d
from elastico.answers import (
    ClusterState,
    DemandAck,
    Submitted,
    cluster_state_from_pb,
    event_from_pb,
    job_from_pb,
    node_from_pb,
    workload_from_pb,
)
from elastico.config import address_problem
from elastico.errors import InvalidSpec
from elastico.rpc import convert
from elastico.rpc.security import ClientTLS, ReloadingStub, TLSFiles, read_token
from elastico.specs import checked_spec, parse_state
from elastico.v1 import allocator_pb2 as apb
from elastico.v1 import allocator_pb2_grpc, node_agent_pb2, node_agent_pb2_grpc
from elastico.v1 import types_pb2 as pb

DEFAULT_ADDRESS = "127.0.0.1:50050"
MAX_PAGE_SIZE = 1000
_FIELD_RE = re.compile(r"^[A-Za-z_][\w.]*(\[[^\]]*\][\w.]*)*$")  # spec.shapes[0].mem_mib, spec.labels["k"]


# --- errors --------------------------------------------------------------------------------------------
class AllocatorError(Exception):
    """A failed Allocator API call (or a request refused before it was sent).

    ``code``: the ``grpc.StatusCode``; ``field``: the request field the error names ("" if none);
    ``message``: the detail without the field.
    """

    def __init__(self, code: grpc.StatusCode, message: str, field: str = "", address: str = "") -> None:
        self.code, self.field, self.message, self.address = code, field, message, address
        super().__init__(f"{code.name}: {field + ': ' if field else ''}{message}")

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError, address: str = "") -> AllocatorError:
        code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
        details = (exc.details() if callable(getattr(exc, "details", None)) else "") or ""
        field, message = split_field(details) if code in (grpc.StatusCode.INVALID_ARGUMENT,
                                                          grpc.StatusCode.PERMISSION_DENIED) else ("", details)
        return cls(code or grpc.StatusCode.UNKNOWN, message, field, address)

    @classmethod
    def invalid(cls, exc: InvalidSpec) -> AllocatorError:
        return cls(grpc.StatusCode.INVALID_ARGUMENT, exc.message.split(": ", 1)[-1], exc.field)


def split_field(details: str) -> tuple[str, str]:
    """("spec.shapes[0].mem_mib", "must be > 0") from the server's "field: message" details; ("", details) otherwise."""
    head, sep, rest = details.partition(": ")
    if sep and _FIELD_RE.match(head):
        return head, rest
    return "", details


# --- retry policy ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff with jitter: attempt k (0-based) waits ``min(max_s, base_s * 2**k)`` times a
    uniform factor in [0.5, 1] (so that many clients retrying together spread out)."""

    retries: int = 3
    base_s: float = 0.05
    max_s: float = 2.0

    def __post_init__(self) -> None:
        if not (isinstance(self.retries, int) and self.retries >= 0):
            raise ValueError(f"retries must be an integer >= 0, got {self.retries!r}")
        if not (math.isfinite(self.base_s) and self.base_s >= 0 and math.isfinite(self.max_s) and self.max_s >= self.base_s):
            raise ValueError(f"backoff must satisfy 0 <= base_s <= max_s, got {self.base_s!r}, {self.max_s!r}")

    def delay(self, attempt: int) -> float:
        return min(self.max_s, self.base_s * 2 ** attempt) * random.uniform(0.5, 1.0)

    def retryable(self, code: grpc.StatusCode, idempotent: bool) -> bool:
        return code is grpc.StatusCode.UNAVAILABLE or (idempotent and code is grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass(frozen=True)
class _Call:
    """One prepared RPC: the method's name, its request, whether a deadline miss may be retried, how the reply
    becomes the result; ``failures`` collects the status codes of the attempts that failed."""

    method: str
    request: Any
    idempotent: bool
    result: Callable[[Any], Any]
    failures: list = dataclasses.field(default_factory=list)

    def lost_reply(self, exc: AllocatorError) -> bool:
        """A CancelJob retried after a deadline miss was refused as "already finished": the missed attempt may be
        what cancelled it (the caller then reads the job to tell)."""
        return exc.code is grpc.StatusCode.FAILED_PRECONDITION and grpc.StatusCode.DEADLINE_EXCEEDED in self.failures


def _deadline(value: float) -> float:
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"deadline_s must be a finite number > 0, got {value!r}")
    return float(value)


class _Core:
    """What both clients share: addresses, credentials, the deadline, the retry policy, request building."""

    def __init__(self, address: str | Sequence[str], tls: ClientTLS | None, token: str, deadline_s: float,
                 retries: int, backoff_s: float, max_backoff_s: float) -> None:
        addresses = [address] if isinstance(address, str) else list(address)
        if not addresses or not all(isinstance(a, str) and a.strip() for a in addresses):
            raise ValueError(f"address must be host:port (or a list of them), got {address!r}")
        self.addresses = addresses
        base = tls or ClientTLS(None)
        self.tls = dataclasses.replace(base, token=token) if token else base
        self.deadline_s = _deadline(deadline_s)
        self.policy = RetryPolicy(retries, backoff_s, max_backoff_s)
        self._route = [0]  # index of the replica calls go to; shared with the ``options()`` views of this client

    @property
    def address(self) -> str:
        return self.addresses[self._route[0] % len(self.addresses)]

    def _failover(self) -> None:
        self._route[0] += 1

    # requests -------------------------------------------------------------------------------------
    @staticmethod
    def submit_call(spec: d.JobSpec | pb.JobSpec | Mapping[str, Any], request_id: str | None) -> _Call:
        try:
            m = convert.job_spec_to_pb(checked_spec(spec))
            if m.tenant == d.JobSpec.tenant:  # unset (or the default's name): the server takes the caller's own tenant
                m.tenant = ""
            rid = request_id if request_id is not None else f"cli-{uuid.uuid4().hex}"
            d.validate_request_id(rid)
        except InvalidSpec as exc:
            raise AllocatorError.invalid(exc) from None
        return _Call("SubmitJob", apb.SubmitJobRequest(request_id=rid, spec=m), True,
                     lambda r: Submitted(job_from_pb(r.job), r.created))

    @staticmethod
    def _job_id(job_id: str) -> str:
        if not isinstance(job_id, str) or not job_id.strip():
            raise AllocatorError(grpc.StatusCode.INVALID_ARGUMENT, "is required", "job_id")
        return job_id

    def get_call(self, job_id: str) -> _Call:
        return _Call("GetJob", apb.GetJobRequest(job_id=self._job_id(job_id)), True, lambda r: job_from_pb(r.job))

    def cancel_call(self, job_id: str) -> _Call:
        # retried on a deadline miss too: if the missed attempt did cancel, the retry's FAILED_PRECONDITION is
        # answered by reading the job (cancel() returns it when it is cancelled), so a lost reply is no error
        return _Call("CancelJob", apb.CancelJobRequest(job_id=self._job_id(job_id)), True, lambda r: job_from_pb(r.job))

    @staticmethod
    def list_request(states: Iterable[d.JobState | str], tenant: str, page_size: int) -> apb.ListJobsRequest:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or not 1 <= page_size <= MAX_PAGE_SIZE:
            raise AllocatorError(grpc.StatusCode.INVALID_ARGUMENT, f"must be 1-{MAX_PAGE_SIZE}, got {page_size!r}", "page_size")
        try:
            pbs = [convert.state_to_pb(parse_state(s, f"states[{i}]")) for i, s in enumerate(states)]
        except InvalidSpec as exc:
            raise AllocatorError.invalid(exc) from None
        return apb.ListJobsRequest(states=pbs, tenant=tenant or "", page_size=page_size)

    @staticmethod
    def page_call(req: apb.ListJobsRequest, token: str) -> _Call:
        page = apb.ListJobsRequest()
        page.CopyFrom(req)
        page.page_token = token
        return _Call("ListJobs", page, True, lambda r: ([job_from_pb(j) for j in r.jobs], r.next_page_token))

    @staticmethod
    def cluster_call() -> _Call:
        return _Call("GetClusterState", apb.GetClusterStateRequest(), True, cluster_state_from_pb)

    @staticmethod
    def demand_call(report: d.DemandReport) -> _Call:
        try:
            d.validate_demand_report(report, time.time())
        except InvalidSpec as exc:
            raise AllocatorError.invalid(exc) from None
        return _Call("ReportDemand", apb.ReportDemandRequest(report=convert.demand_to_pb(report)), True,
                     lambda r: DemandAck(r.accepted, r.forecast_rps, r.reports_in_window))

    @staticmethod
    def watch_request(job_ids: Iterable[str], after: str) -> apb.WatchJobsRequest:
        return apb.WatchJobsRequest(after_event_id=after or "", job_ids=list(job_ids))


class AllocatorClient(_Core):
    """Blocking client of the Allocator API (one channel per address, rebuilt after a certificate rotation).

    ``address``: ``host:port`` or a list of replicas (a retry goes to the next); ``tls``: the process's
    ``ClientTLS`` (None = plaintext); ``token``: bearer token (overrides the one in ``tls``); ``deadline_s``: per
    attempt; ``retries``: retries after the first attempt. Use as a context manager or call ``close()``.
    """

    def __init__(self, address: str | Sequence[str] = DEFAULT_ADDRESS, *, tls: ClientTLS | None = None, token: str = "",
                 deadline_s: float = 10.0, retries: int = 3, backoff_s: float = 0.05, max_backoff_s: float = 2.0) -> None:
        super().__init__(address, tls, token, deadline_s, retries, backoff_s, max_backoff_s)
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[tuple, grpc.Channel, allocator_pb2_grpc.AllocatorStub]] = {}
        self._retired: list[grpc.Channel] = []

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, default_address: str = DEFAULT_ADDRESS,
                 default_tls: ClientTLS | None = None, **kw) -> AllocatorClient:
        cfg = ClientConfig.from_env(env, default_address=default_address, default_tls=default_tls)
        return cls(cfg.address, tls=cfg.tls, **kw)

    def __enter__(self) -> AllocatorClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            for _, ch, _ in self._channels.values():
                ch.close()
            for ch in self._retired:
                ch.close()
            self._channels.clear()
            self._retired.clear()

    def _stub(self, address: str) -> allocator_pb2_grpc.AllocatorStub:
        stamp = self.tls.stamp()
        with self._lock:
            entry = self._channels.get(address)
            if entry is not None and entry[0] == stamp:
                return entry[2]
            if entry is not None:  # rotated certificates: a new channel; the old one closes with the client
                self._retired.append(entry[1])
            ch = self.tls.channel(address)
            stub = allocator_pb2_grpc.AllocatorStub(ch)
            self._channels[address] = (stamp, ch, stub)
            return stub

    def _run(self, call: _Call) -> Any:
        attempt = 0
        while True:
            address = self.address
            try:
                reply = getattr(self._stub(address), call.method)(call.request, timeout=self.deadline_s)
                return call.result(reply)
            except grpc.RpcError as exc:
                if attempt >= self.policy.retries or not self.policy.retryable(exc.code(), call.idempotent):
                    raise AllocatorError.from_rpc(exc, address) from None
                call.failures.append(exc.code())
                self._failover()
                time.sleep(self.policy.delay(attempt))
                attempt += 1

    # API ------------------------------------------------------------------------------------------
    def submit(self, spec: d.JobSpec | pb.JobSpec | Mapping[str, Any], request_id: str | None = None) -> d.Job:
        """Submit a job (validated here first); ``request_id`` (generated when None) is kept across retries."""
        return self.submit_job(spec, request_id).job

    def submit_job(self, spec: d.JobSpec | pb.JobSpec | Mapping[str, Any], request_id: str | None = None) -> Submitted:
        """As ``submit``, also telling whether this call created the job (False: the request id existed)."""
        return self._run(self.submit_call(spec, request_id))

    def get(self, job_id: str) -> d.Job:
        return self._run(self.get_call(job_id))

    def cancel(self, job_id: str) -> d.Job:
        """Cancel a job; FAILED_PRECONDITION if it had already finished (unless our own lost attempt cancelled it)."""
        call = self.cancel_call(job_id)
        try:
            return self._run(call)
        except AllocatorError as exc:
            if call.lost_reply(exc):
                job = self.get(job_id)
                if job.state is d.JobState.CANCELLED:
                    return job
            raise

    def options(self, *, deadline_s: float | None = None, retries: int | None = None) -> AllocatorClient:
        """The same client (channels, addresses) with another per-attempt deadline or retry count."""
        other = copy.copy(self)
        if deadline_s is not None:
            other.deadline_s = _deadline(deadline_s)
        if retries is not None:
            other.policy = dataclasses.replace(self.policy, retries=retries)
        return other

    def list(self, states: Iterable[d.JobState | str] = (), tenant: str = "", page_size: int = 100) -> Iterator[d.Job]:
        """Every job matching the filters, newest first, fetched page by page as the iterator is consumed."""
        req = self.list_request(states, tenant, page_size)

        def pages() -> Iterator[d.Job]:
            token = ""
            while True:
                jobs, token = self._run(self.page_call(req, token))
                yield from jobs
                if not token:
                    return
        return pages()

    def cluster_state(self) -> ClusterState:
        return self._run(self.cluster_call())

    def report_demand(self, report: d.DemandReport) -> DemandAck:
        return self._run(self.demand_call(report))

    def watch(self, job_ids: Iterable[str] = (), after: str = "", *, stream_deadline_s: float | None = None,
              idle_stop: bool = False) -> Watch:
        """Job events after event ``after`` ("" = new ones only, "0" = from the start) for ``job_ids`` (all if empty).

        A dropped stream (UNAVAILABLE, or the server ending it) is reopened after the last event received, with
        backoff, ``retries`` times in a row at most (an event received resets the count). ``stream_deadline_s``
        bounds each stream; when it passes the stream is reopened, or with ``idle_stop`` the iteration ends (what
        reads a history: "everything so far"). ``Watch.cancel()`` ends it from another thread.
        """
        return Watch(self, self.watch_request(job_ids, after), stream_deadline_s, idle_stop)

    def history(self, job_id: str, *, idle_s: float = 1.0, until_version: int = 0) -> list[d.JobEvent]:
        """Every recorded state change of ``job_id`` (``WatchJobs`` from "0" filtered by the job): read until an
        event reaches ``until_version`` (the job's current version) or no event came for ``idle_s``."""
        out = []
        w = self.watch([self._job_id(job_id)], "0", stream_deadline_s=idle_s, idle_stop=True)
        for ev in w:
            out.append(ev)
            if until_version and ev.version >= until_version:
                w.cancel()
                break
        return out


class Watch:
    """An iterator of ``JobEvent`` over a resumable ``WatchJobs`` stream (``AllocatorClient.watch``)."""

    def __init__(self, client: AllocatorClient, request: apb.WatchJobsRequest, stream_deadline_s: float | None,
                 idle_stop: bool) -> None:
        self._client, self._req, self._deadline, self._idle_stop = client, request, stream_deadline_s, idle_stop
        self._call = None
        self._cancelled = threading.Event()
        self.last_event_id = request.after_event_id

    def cancel(self) -> None:
        self._cancelled.set()
        call = self._call
        if call is not None:
            call.cancel()

    def __iter__(self) -> Iterator[d.JobEvent]:
        c = self._client
        failures = 0
        while not self._cancelled.is_set():
            address = c.address
            try:
                self._call = c._stub(address).WatchJobs(self._req, timeout=self._deadline)
                if self._cancelled.is_set():
                    self._call.cancel()
                for m in self._call:
                    self._req.after_event_id = self.last_event_id = m.event_id
                    failures = 0
                    yield event_from_pb(m)
                code = grpc.StatusCode.UNAVAILABLE  # the server ended the stream: reopen it like a dropped one
            except grpc.RpcError as exc:
                code = exc.code()
                if self._cancelled.is_set():  # cancel() ended the call (CANCELLED)
                    return
                if code is grpc.StatusCode.DEADLINE_EXCEEDED and self._deadline is not None:
                    if self._idle_stop:
                        return
                    continue
                if code is not grpc.StatusCode.UNAVAILABLE or failures >= c.policy.retries:
                    raise AllocatorError.from_rpc(exc, address) from None
            if self._cancelled.is_set():
                return
            if failures >= c.policy.retries:
                raise AllocatorError(code, "the watch stream kept ending", address=address)
            c._failover()
            time.sleep(c.policy.delay(failures))
            failures += 1


class AsyncAllocatorClient(_Core):
    """The ``grpc.aio`` twin of ``AllocatorClient`` (same arguments, requests, retries and results).

    Its stubs are ``ReloadingStub``s: a certificate rotation takes effect at the next call, without a restart.
    Create it inside the event loop that uses it; ``await close()`` at the end.
    """

    def __init__(self, address: str | Sequence[str] = DEFAULT_ADDRESS, *, tls: ClientTLS | None = None, token: str = "",
                 deadline_s: float = 10.0, retries: int = 3, backoff_s: float = 0.05, max_backoff_s: float = 2.0) -> None:
        super().__init__(address, tls, token, deadline_s, retries, backoff_s, max_backoff_s)
        self._stubs: dict[str, ReloadingStub] = {}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, default_address: str = DEFAULT_ADDRESS,
                 default_tls: ClientTLS | None = None, **kw) -> AsyncAllocatorClient:
        cfg = ClientConfig.from_env(env, default_address=default_address, default_tls=default_tls)
        return cls(cfg.address, tls=cfg.tls, **kw)

    @classmethod
    def over(cls, stub, *, deadline_s: float = 10.0, retries: int = 3, backoff_s: float = 0.05,
             max_backoff_s: float = 2.0) -> AsyncAllocatorClient:
        """A client whose calls go through an existing aio ``AllocatorStub`` (the caller owns its channel)."""
        client = cls("<stub>", deadline_s=deadline_s, retries=retries, backoff_s=backoff_s, max_backoff_s=max_backoff_s)
        client._stubs["<stub>"] = stub
        return client

    def _stub(self, address: str) -> ReloadingStub:
        stub = self._stubs.get(address)
        if stub is None:
            stub = self._stubs[address] = ReloadingStub(self.tls, address, allocator_pb2_grpc.AllocatorStub)
        return stub

    async def close(self, grace: float | None = None) -> None:
        for stub in self._stubs.values():
            if isinstance(stub, ReloadingStub):  # a stub given to ``over`` belongs to its caller's channel
                await stub.close(grace)
        self._stubs.clear()

    async def __aenter__(self) -> AsyncAllocatorClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _run(self, call: _Call) -> Any:
        attempt = 0
        while True:
            address = self.address
            try:
                reply = await getattr(self._stub(address), call.method)(call.request, timeout=self.deadline_s)
                return call.result(reply)
            except grpc.aio.AioRpcError as exc:
                if attempt >= self.policy.retries or not self.policy.retryable(exc.code(), call.idempotent):
                    raise AllocatorError.from_rpc(exc, address) from None
                call.failures.append(exc.code())
                self._failover()
                await asyncio.sleep(self.policy.delay(attempt))
                attempt += 1

    async def submit(self, spec: d.JobSpec | pb.JobSpec | Mapping[str, Any], request_id: str | None = None) -> d.Job:
        return (await self.submit_job(spec, request_id)).job

    async def submit_job(self, spec: d.JobSpec | pb.JobSpec | Mapping[str, Any], request_id: str | None = None) -> Submitted:
        return await self._run(self.submit_call(spec, request_id))

    async def get(self, job_id: str) -> d.Job:
        return await self._run(self.get_call(job_id))

    async def cancel(self, job_id: str) -> d.Job:
        call = self.cancel_call(job_id)
        try:
            return await self._run(call)
        except AllocatorError as exc:
            if call.lost_reply(exc):
                job = await self.get(job_id)
                if job.state is d.JobState.CANCELLED:
                    return job
            raise

    async def list(self, states: Iterable[d.JobState | str] = (), tenant: str = "",
                   page_size: int = 100) -> AsyncIterator[d.Job]:
        req = self.list_request(states, tenant, page_size)
        token = ""
        while True:
            jobs, token = await self._run(self.page_call(req, token))
            for j in jobs:
                yield j
            if not token:
                return

    async def cluster_state(self) -> ClusterState:
        return await self._run(self.cluster_call())

    async def report_demand(self, report: d.DemandReport) -> DemandAck:
        return await self._run(self.demand_call(report))

    async def watch(self, job_ids: Iterable[str] = (), after: str = "", *,
                    stream_deadline_s: float | None = None, idle_stop: bool = False) -> AsyncIterator[d.JobEvent]:
        """As ``AllocatorClient.watch``; cancel the consuming task (or ``aclose()``) to end it."""
        req = self.watch_request(job_ids, after)
        failures = 0
        while True:
            address = self.address
            try:
                async for m in self._stub(address).WatchJobs(req, timeout=stream_deadline_s):
                    req.after_event_id = m.event_id
                    failures = 0
                    yield event_from_pb(m)
                code = grpc.StatusCode.UNAVAILABLE
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code is grpc.StatusCode.DEADLINE_EXCEEDED and stream_deadline_s is not None:
                    if idle_stop:
                        return
                    continue
                if code is not grpc.StatusCode.UNAVAILABLE or failures >= self.policy.retries:
                    raise AllocatorError.from_rpc(exc, address) from None
            if failures >= self.policy.retries:
                raise AllocatorError(code, "the watch stream kept ending", address=address)
            self._failover()
            await asyncio.sleep(self.policy.delay(failures))
            failures += 1


# --- configuration from the environment -----------------------------------------------------------------
def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class ClientConfig:
    """Where the Allocator API is and how to dial it."""

    address: str
    tls: ClientTLS

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, default_address: str = DEFAULT_ADDRESS,
                 default_tls: ClientTLS | None = None) -> ClientConfig:
        """``ELASTICO_ALLOCATOR_ADDRESS`` (else ``default_address``); ``ELASTICO_TLS_CERT_FILE``/``_KEY_FILE``/
        ``_CA_FILE`` (all three, else ``default_tls``'s files, e.g. the local cluster's operator certificate;
        ``ELASTICO_INSECURE=1``: plaintext); ``ELASTICO_TOKEN`` or ``ELASTICO_TOKEN_FILE`` (else ``default_tls``'s).

        Raises:
            ValueError: naming the variable (an address not host:port, a partial set of TLS files, an unreadable
                or empty token file).
        """
        env = os.environ if env is None else env
        address = env.get("ELASTICO_ALLOCATOR_ADDRESS", "").strip() or default_address
        if problem := address_problem(address):
            raise ValueError(f"ELASTICO_ALLOCATOR_ADDRESS={address!r}: {problem}")
        base = default_tls or ClientTLS(None)
        files = base.files
        names = ("ELASTICO_TLS_CERT_FILE", "ELASTICO_TLS_KEY_FILE", "ELASTICO_TLS_CA_FILE")
        given = [env.get(n, "").strip() for n in names]
        if any(given):
            missing = [n for n, v in zip(names, given, strict=True) if not v]
            if missing:
                raise ValueError(f"{', '.join(missing)}: required with the other ELASTICO_TLS_* files")
            for n, v in zip(names, given, strict=True):
                if not os.path.isfile(v):
                    raise ValueError(f"{n}={v!r}: no such file")
            files = TLSFiles(*given)
            files.checked_read()  # ConfigError (a ValueError) naming a file that is not a usable certificate/key/CA
        if _truthy(env.get("ELASTICO_INSECURE", "")):
            files = None
        token = env.get("ELASTICO_TOKEN", "").strip()
        if not token and env.get("ELASTICO_TOKEN_FILE", "").strip():
            path = env["ELASTICO_TOKEN_FILE"].strip()
            try:
                token = read_token(path)
            except (OSError, ValueError) as exc:
                raise ValueError(f"ELASTICO_TOKEN_FILE={path!r}: {exc}") from None
        return cls(address, ClientTLS(files, token=token or base.token, target_name=base.target_name))


# --- node agents ----------------------------------------------------------------------------------------
class NodeAgentClient:
    """Reads one node agent (``GetNodeStatus``, ``ListWorkloads``) with the caller's certificate, no token."""

    def __init__(self, address: str, *, tls: ClientTLS | None = None, deadline_s: float = 5.0) -> None:
        self.address, self.deadline_s = address, deadline_s
        self._channel = dataclasses.replace(tls or ClientTLS(None), token="").channel(address)
        self._stub = node_agent_pb2_grpc.NodeAgentStub(self._channel)

    def __enter__(self) -> NodeAgentClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: str, request):
        try:
            return getattr(self._stub, method)(request, timeout=self.deadline_s)
        except grpc.RpcError as exc:
            raise AllocatorError.from_rpc(exc, self.address) from None

    def node_status(self) -> tuple[d.NodeInfo, list[d.Workload]]:
        r = self._call("GetNodeStatus", node_agent_pb2.GetNodeStatusRequest())
        return node_from_pb(r.node), [workload_from_pb(w) for w in r.workloads]

    def workloads(self, job_ids: Iterable[str] = (), statuses: Iterable[str] = ()) -> list[d.Workload]:
        r = self._call("ListWorkloads", node_agent_pb2.ListWorkloadsRequest(job_ids=list(job_ids), statuses=list(statuses)))
        return [workload_from_pb(w) for w in r.workloads]
