"""elastico.v1.Allocator over gRPC: validation and conversion only; state lives in the Store.

Scheduling rounds (pricing, placement, commits) run in ``rounds.Scheduler``; this servicer is the job API.
It only nudges the scheduler after a submission (``on_change``) and reads the leader's published round
status for GetClusterState, so every replica (leader or standby) answers the same.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
import os
import re
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import grpc

from elastico.auth import TokenStore
from elastico.domain import TENANT_RE, Job, JobKind, JobState, StateReason, validate_demand_report, validate_request_id
from elastico.errors import Conflict, InvalidSpec, NotFound, ResourceExhausted, WrongState
from elastico.limits import TENANT_MAX_CHARS
from elastico.logging import get_logger
from elastico.rpc import convert
from elastico.rpc.security import Access, PeerPolicy, current_caller, roles
from elastico.state.store import Store
from elastico.v1 import allocator_pb2 as apb
from elastico.v1 import allocator_pb2_grpc
from services.allocator import access, demand
from services.allocator import metrics as m
from services.allocator.fit import spec_num_gpus
from services.allocator.quota import quota_of
from services.allocator.settings import AllocatorSettings

log = get_logger(component="allocator")

MAX_PAGE_SIZE = 1000
PAGE_TOKEN_RE = re.compile(r"[1-9][0-9]{0,19}")  # ListJobs tokens: a job's submission sequence (from 1)
MAX_REPLY_BYTES = 3 << 20  # a ListJobs page stays below gRPC clients' default 4 MiB receive limit
MAX_WATCH_JOB_IDS = 1000
EVENT_ID_RE = re.compile(r"[0-9]{1,20}(-[0-9]{1,20})?")  # a Redis stream id (ASCII digits; Redis refuses longer)
CAS_RETRIES = 5
MAX_SUBMIT_BATCH = 256  # SubmitJob calls written together in one Store.create_jobs at most
# How long the first submission of a batch waits for others (a SubmitJob answers at most this much later).
# Measured on bench.allocator: 2 ms vs one loop iteration: ~3x fewer Redis calls, allocator CPU 0.88-1.13 ->
# 0.82-0.84 ms per submitted and placed job.
SUBMIT_LINGER_S = 0.002


def _require_job_id(job_id: str, path: str = "job_id") -> str:
    if not job_id or len(job_id) > 128 or not job_id.isprintable():
        raise InvalidSpec(path, "must be 1-128 printable characters")
    return job_id


def _event_id(after: str) -> str:
    """``after`` if it can be a Redis stream id (each part below 2**64); else INVALID_ARGUMENT."""
    if after and not (EVENT_ID_RE.fullmatch(after) and all(int(x) < 2**64 for x in after.split("-"))):
        raise InvalidSpec("after_event_id", "is not an event id returned by WatchJobs")
    return after


async def _visible_job(store: Store, job_id: str) -> Job:
    """The job the caller may see: the caller's role is checked before the store is read, so that a caller
    without API access learns nothing of which ids exist."""
    identity = current_caller().identity
    access.require_api_role(identity)
    return access.check_job(identity, await store.get_job(job_id))


class SubmitBatcher:
    """Coalesces concurrent submissions into one ``Store.create_jobs`` call (one Redis round trip per batch).

    The first write starts ``SUBMIT_LINGER_S`` after the first submission (the calls received meanwhile join
    it); submissions arriving while a write is in flight queue up and go together in the next one. Each job
    is still its own atomic, idempotent-by-request-id transaction, so batching changes no outcome, only the
    number of round trips.
    """

    def __init__(self, store: Store, live_limit: int = 0, max_batch: int = MAX_SUBMIT_BATCH) -> None:
        self._store = store
        self._live_limit = live_limit  # a tenant's non-terminal jobs at most (Store.create_jobs); 0 = no limit
        self._max = max_batch
        self._queue: list[tuple[Job, asyncio.Future[tuple[Job, bool]]]] = []
        self._writer: asyncio.Task[None] | None = None

    async def submit(self, job: Job) -> tuple[Job, bool]:
        """Store ``job`` (or find the job its request id already names): ``Store.create_job``'s answer."""
        fut: asyncio.Future[tuple[Job, bool]] = asyncio.get_running_loop().create_future()
        self._queue.append((job, fut))
        if self._writer is None:
            self._writer = asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        try:
            await asyncio.sleep(SUBMIT_LINGER_S)  # submissions arriving meanwhile join this first write
            while self._queue:
                batch, self._queue = self._queue[:self._max], self._queue[self._max:]
                try:
                    results = await self._store.create_jobs([job for job, _ in batch], live_limit=self._live_limit)
                except Exception as exc:  # noqa: BLE001 - every waiter gets the store's error (Unavailable...)
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(exc)
                except BaseException:  # cancelled (shutdown): no waiter may hang
                    for _, fut in batch + self._queue:
                        fut.cancel()
                    raise
                else:
                    for (_, fut), result in zip(batch, results, strict=True):
                        if fut.done():  # a cancelled caller (its RPC ended) retries by request id
                            continue
                        if isinstance(result, Exception):  # refused by its tenant's limit: that caller only
                            fut.set_exception(result)
                        else:
                            fut.set_result(result)
        finally:
            self._writer = None


def api_access(settings: AllocatorSettings) -> Access:
    """Who may call the Allocator API: any certificate of the cluster's CA, and a bearer token on every call
    (none only with ELASTICO_INSECURE=1 and no tokens file)."""
    tokens = TokenStore(settings.auth_tokens_file) if settings.auth_tokens_file else None
    return Access(PeerPolicy(roles("allocator", "pricer", "predictor", "kube", "operator", "node")), tokens)


class AllocatorServicer(allocator_pb2_grpc.AllocatorServicer):
    """Job API over a Store."""

    def __init__(self, store: Store, settings: AllocatorSettings, on_change: Callable[[str], None] | None = None) -> None:
        self._store = store
        self._settings = settings
        self._quotas = settings.service_quotas()
        self._on_change = on_change or (lambda why: None)
        self._submits = SubmitBatcher(store, settings.max_live_jobs_per_tenant)
        self._watches: dict[str, int] = {}  # caller identity ("" insecure) -> WatchJobs streams it holds open
        self._bound_log = None

    def _log(self):
        """The module logger bound once, at first use (after the service configured logging): the lazy module
        logger re-binds on every call, ~10 us on each SubmitJob."""
        if self._bound_log is None:
            self._bound_log = log.bind()
        return self._bound_log

    async def SubmitJob(self, request: apb.SubmitJobRequest, context: grpc.aio.ServicerContext) -> apb.SubmitJobResponse:
        validate_request_id(request.request_id)
        if not request.HasField("spec"):
            raise InvalidSpec("spec", "is required")
        identity = current_caller().identity
        spec = access.submission_spec(identity, convert.job_spec_from_pb(request.spec), request.spec.tenant)
        job = Job(job_id=f"j-{os.urandom(8).hex()}", request_id=request.request_id, spec=spec)  # 64 random bits
        stored, created = await self._submits.submit(job)  # request ids are per tenant (store.request_key)
        if created:
            self._log().info("job submitted", job_id=stored.job_id, request_id=stored.request_id, tenant=spec.tenant, kind=spec.kind.value)
            self._on_change("arrival")
        return apb.SubmitJobResponse(job=convert.job_to_pb(stored), created=created)

    async def CancelJob(self, request: apb.CancelJobRequest, context: grpc.aio.ServicerContext) -> apb.CancelJobResponse:
        job_id = _require_job_id(request.job_id)
        identity = current_caller().identity
        for _ in range(CAS_RETRIES):
            job = await _visible_job(self._store, job_id)
            access.check_cancel(identity, job)
            if job.state.terminal:
                raise WrongState(f"job {job_id} is already {job.state.value}")
            # a pod job the policy asked to evict ends as preempted whoever reports its pod gone first (the node
            # agent, or the extender's reaper through this call)
            reason, message = ((StateReason.PREEMPTED, job.message) if job.reason is StateReason.EVICTION_REQUESTED
                               else (StateReason.CANCELLED_BY_CLIENT, ""))
            try:
                if job.placement is not None:
                    done = await self._store.release_job(None, job, JobState.CANCELLED, reason, message)
                else:
                    done = await self._store.update_job(job, replace(job, state=JobState.CANCELLED, reason=reason, message=message))
            except Conflict:
                continue  # the job moved under us (placed, progressed): re-read and retry
            log.info("job cancelled", job_id=job_id, reason=reason.value)
            self._on_change("cancel")
            return apb.CancelJobResponse(job=convert.job_to_pb(done))
        raise Conflict(f"job {job_id} kept changing; retry the cancel")

    async def GetJob(self, request: apb.GetJobRequest, context: grpc.aio.ServicerContext) -> apb.GetJobResponse:
        job = await _visible_job(self._store, _require_job_id(request.job_id))
        return apb.GetJobResponse(job=convert.job_to_pb(job))

    async def ListJobs(self, request: apb.ListJobsRequest, context: grpc.aio.ServicerContext) -> apb.ListJobsResponse:
        if request.page_size > MAX_PAGE_SIZE:
            raise InvalidSpec("page_size", f"must be at most {MAX_PAGE_SIZE}, got {request.page_size}")
        if request.page_token and not PAGE_TOKEN_RE.fullmatch(request.page_token):  # a job's sequence, from 1
            raise InvalidSpec("page_token", "is not a token returned by ListJobs")
        if len(request.states) > 16:
            raise InvalidSpec("states", f"at most 16 states, got {len(request.states)}")
        states = [convert.state_from_pb(s, f"states[{i}]") for i, s in enumerate(request.states)]
        if request.tenant and not TENANT_RE.fullmatch(request.tenant):
            raise InvalidSpec("tenant", f"must be empty (every tenant the caller may see) or 1-{TENANT_MAX_CHARS} "
                                        "characters of [A-Za-z0-9._-]")
        tenant = access.list_tenant(current_caller().identity, request.tenant)

        async def page(size: int):
            jobs, token = await self._store.list_jobs(states=states, tenant=tenant, page_size=size, page_token=request.page_token)
            return [convert.job_to_pb(j) for j in jobs], token

        pbs, token = await page(request.page_size or 100)
        sizes = list(itertools.accumulate(m.ByteSize() for m in pbs))
        if sizes and sizes[-1] > MAX_REPLY_BYTES:  # a shorter page, so that any client can receive it
            pbs, token = await page(max(1, bisect.bisect_right(sizes, MAX_REPLY_BYTES)))
        return apb.ListJobsResponse(jobs=pbs, next_page_token=token)

    async def WatchJobs(self, request: apb.WatchJobsRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[apb.JobEvent]:
        after = _event_id(request.after_event_id)
        if len(request.job_ids) > MAX_WATCH_JOB_IDS:
            raise InvalidSpec("job_ids", f"at most {MAX_WATCH_JOB_IDS} job ids, got {len(request.job_ids)}")
        wanted = {_require_job_id(j, f"job_ids[{i}]") for i, j in enumerate(request.job_ids)}
        identity = current_caller().identity
        tenant = access.visible_tenant(identity)
        caller = identity.name if identity is not None else ""
        self._open_watch(caller)
        try:
            if not after:
                after = await self._store.last_event_id()
            owners: dict[str, bool] = {}  # job id -> the caller's tenant owns it (a tenant's watch sees only its jobs)
            while not context.done():
                for ev in await self._store.read_events(after, limit=500, block_s=self._settings.watch_poll_s):
                    after = ev.event_id
                    if wanted and ev.job_id not in wanted:
                        continue
                    if tenant is not None and not await self._owned(ev.job_id, tenant, owners):
                        continue
                    yield apb.JobEvent(event_id=ev.event_id, job_id=ev.job_id, state=convert.state_to_pb(ev.state),
                                       reason=convert.reason_to_pb(ev.reason), message=ev.message, version=ev.version,
                                       time_unix_s=ev.time_s)
        finally:
            self._watches[caller] -= 1
            if not self._watches[caller]:
                del self._watches[caller]

    def _open_watch(self, caller: str) -> None:
        """Count one more open WatchJobs stream of ``caller`` (each holds a Redis connection while it waits), or
        refuse it past the per-caller and the server's limits."""
        s = self._settings
        if self._watches.get(caller, 0) >= s.max_watches_per_caller:
            raise ResourceExhausted(f"{self._watches[caller]} WatchJobs streams of this caller are open, its limit "
                                    "(ELASTICO_MAX_WATCHES_PER_CALLER); close one, or watch several jobs in one stream")
        if sum(self._watches.values()) >= s.max_watches:
            raise ResourceExhausted("the allocator serves ELASTICO_MAX_WATCHES WatchJobs streams already; retry later")
        self._watches[caller] = self._watches.get(caller, 0) + 1

    async def _owned(self, job_id: str, tenant: str, owners: dict[str, bool]) -> bool:
        if job_id not in owners:
            if len(owners) > 100_000:
                owners.clear()
            try:
                owners[job_id] = (await self._store.get_job(job_id)).spec.tenant == tenant
            except NotFound:
                owners[job_id] = False
        return owners[job_id]

    async def ReportDemand(self, request: apb.ReportDemandRequest, context: grpc.aio.ServicerContext) -> apb.ReportDemandResponse:
        if not request.HasField("report"):
            raise InvalidSpec("report", "is required")
        report = convert.demand_from_pb(request.report)
        now = time.time()
        validate_demand_report(report, now)
        identity = current_caller().identity
        job = await _visible_job(self._store, report.job_id)
        if job.spec.kind is not JobKind.INFERENCE:
            raise WrongState(f"job {job.job_id} is a training job; only inference services report demand")
        if job.state.terminal:
            raise WrongState(f"job {job.job_id} is already {job.state.value}")
        s = self._settings
        report = replace(report, source=f"api:{identity.name if identity is not None else 'anonymous'}")
        [accepted] = await self._store.record_demand([report], demand.keep_s(s.forecast_window_s, s.time_scale))
        since = now - demand.keep_s(s.forecast_window_s, s.time_scale)
        history = (await self._store.demand_history([job.job_id], since)).get(job.job_id, [])
        f = demand.forecast(history, now, s.forecast_window_s, s.time_scale)
        if accepted:
            m.DEMAND_REPORTS.labels("api").inc()
            self._log().info("demand reported", job_id=job.job_id, rps=report.request_rate_rps, window_s=report.window_s,
                             p99_ms=report.p99_latency_ms, source=report.source)
        return apb.ReportDemandResponse(accepted=accepted, forecast_rps=f * s.time_scale if f == f else 0.0,  # the caller's clock
                                        reports_in_window=sum(1 for r in history if r.window_end_s >= since))

    async def GetClusterState(self, request: apb.GetClusterStateRequest, context: grpc.aio.ServicerContext) -> apb.GetClusterStateResponse:
        tenant = access.visible_tenant(current_caller().identity)
        now = time.time()
        nodes = await self._store.list_nodes()
        holder, epoch = await self._store.current_leader()
        usage: dict[str, apb.TenantUsage] = defaultdict(apb.TenantUsage)
        # the active set only (one read, O(active jobs), however many finished jobs are kept), decoded through
        # a cache of its own (for_round=False: the scheduling round's memoised decodes stay as they are)
        for j in await self._store.list_active_jobs(for_round=False):
            if tenant is not None and j.spec.tenant != tenant:
                continue  # a tenant sees its own usage only
            u = usage[j.spec.tenant]
            u.tenant = j.spec.tenant
            if j.state is JobState.PENDING:
                u.pending_jobs += 1
            else:
                u.running_jobs += 1
                if j.placement is not None:
                    u.allocated_gpus += sum(s.compute_share_pct for s in j.placement.slices) / 100.0
                if j.spec.kind is JobKind.INFERENCE:
                    u.service_gpus += spec_num_gpus(j.spec)
        for t, u in usage.items():
            q = quota_of(self._quotas, t)
            if q is not None:
                u.service_quota_gpus = q
        status = json.loads(await self._store.get_status("allocator") or "{}")
        degraded: list[str] = []
        if not holder:
            degraded.append("no allocator leader: scheduling rounds are not running")
        elif status.get("epoch") != epoch:
            degraded.append(f"leader {holder} (epoch {epoch}) has not completed a scheduling round yet")
        else:
            degraded += status.get("degraded", [])
            age = now - float(status.get("time_s", 0.0))
            if age > 3 * float(status.get("round_interval_s", self._settings.round_interval_s)) + 5:
                degraded.append(f"scheduling rounds stalled: the last one ended {age:.0f}s ago")
        nodes = [replace(n, ready=n.ready and now - n.last_heartbeat_s <= self._settings.node_stale_s) for n in nodes]
        if tenant is not None:  # agents' addresses are the cluster's internals, not a tenant's business
            nodes = [replace(n, address="") for n in nodes]
        return apb.GetClusterStateResponse(
            nodes=[convert.node_to_pb(n) for n in nodes],
            tenants=[usage[t] for t in sorted(usage)], leader_epoch=epoch, leader_id=holder or "", degraded=degraded,
            prices=[apb.PoolPrice(pool=p["pool"], price=p["price"], capacity=p["capacity"]) for p in status.get("prices", [])],
            last_round_gap=float(status.get("gap") or 0.0), last_round_time_unix_s=float(status.get("time_s", 0.0)),
        )
