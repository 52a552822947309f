"""The ``Store`` contract and the backend-independent half of every implementation.

Design: each backend implements a handful of primitives, the most important being ``_apply``, which
executes one ``Transaction`` atomically — all of its checks (leader epoch, job versions, GPU capacity,
request-id uniqueness) pass and all of its writes happen, or nothing changes. Every high-level
operation (submit, update, commit placements, release) is written once in ``StoreBase`` as "read,
build a transaction, apply", so Redis and memory behave identically and one contract test suite
covers both. In Redis ``_apply`` is a single Lua script; in memory it runs under a lock.

Compute shares are stored as integers in 1/100 of a percent (``SHARE_UNITS_PER_PCT``) so that
capacity checks never suffer floating-point drift after thousands of add/remove cycles.

Job indexes and retention: every job write maintains, in the same atomic step, an index by submission
sequence (all jobs, per tenant), the set of active jobs, per terminal state (and per tenant and terminal
state) and of terminal jobs by finish time; ``list_jobs`` reads only the entries matching its filter
(terminal states: their index; non-terminal states: the active set), so its cost follows the page and the
active set, not the history. Finished jobs are deleted by ``sweep_finished_jobs`` (see there).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Protocol, cast, runtime_checkable

from elastico.domain import (
    DemandReport,
    GpuInfo,
    Job,
    JobEvent,
    JobState,
    NodeInfo,
    Placement,
    StateReason,
    Workload,
    drain_key,
)
from elastico.errors import Conflict, NotFound, ResourceExhausted, StaleEpoch, WrongState
from elastico.state import codec
from elastico.state.transaction import (
    DesiredOp,
    DuplicateRequest,
    EventRecord,
    GpuDelta,
    JobWrite,
    PreparedUpdates,
    SweepResult,
    Transaction,
)

SHARE_UNITS_PER_PCT = 100
WRITTEN_CACHE_MAX = 20_000  # records remembered between two list_active_jobs calls (see StoreBase._note_written)
FULL_GPU_SHARE_UNITS = 100 * SHARE_UNITS_PER_PCT


def share_units(pct: float) -> int:
    """Percent of a GPU -> integer share units."""
    return int(round(pct * SHARE_UNITS_PER_PCT))


DEFAULT_JOB_RETENTION_S = 7 * 86400.0
DEFAULT_JOB_RETENTION_MAX = 100_000
DEMAND_REPORTS_MAX = 10_000  # demand reports kept per job at most (a reporter with distinct window ends is bounded)
SWEEP_LIMIT = 1000  # jobs deleted (or backfilled) per sweep step at most: one bounded Redis script call


def tenant_limit_message(tenant: str, live: int) -> str:
    """What a submission refused by the per-tenant limit of live jobs answers (every backend says the same)."""
    return (f"tenant {tenant!r} has {live} jobs queued or running, its limit "
            "(ELASTICO_MAX_LIVE_JOBS_PER_TENANT): retry when some finish or cancel some")


def request_key(tenant: str, request_id: str) -> str:
    """The idempotency key of a submission: request ids are a tenant's own, so one tenant can neither take
    another's ids first nor learn which it has used ("/" is in neither's alphabet)."""
    return f"{tenant}/{request_id}"


@runtime_checkable
class Store(Protocol):
    """Cluster state shared by the services. All methods are coroutines; all changes are atomic."""

    async def create_job(self, job: Job, *, live_limit: int = 0) -> tuple[Job, bool]: ...
    async def create_jobs(self, jobs: Sequence[Job], *, live_limit: int = 0) -> list[tuple[Job, bool] | ResourceExhausted]:
        """``create_job`` for each job (each on its own, idempotent by request id), in one round trip; a job
        its tenant's ``live_limit`` refuses is its ResourceExhausted in the list."""
        ...
    async def get_job(self, job_id: str) -> Job: ...
    async def find_job_by_request(self, tenant: str, request_id: str) -> Job | None: ...
    async def list_jobs(
        self, states: Sequence[JobState] = (), tenant: str = "", page_size: int = 100, page_token: str = ""
    ) -> tuple[list[Job], str]: ...
    async def list_active_jobs(self, *, for_round: bool = True) -> list[Job]:
        """Every job in a non-terminal state (PENDING, PLACED, RUNNING), in no particular order.

        ``for_round=False``: for readers other than the scheduling round (GetClusterState); they keep their
        own decode cache and leave the round's as it is."""
        ...
    async def sweep_finished_jobs(self, retention_s: float = DEFAULT_JOB_RETENTION_S,
                                  max_finished: int = DEFAULT_JOB_RETENTION_MAX, *, limit: int = SWEEP_LIMIT,
                                  now: float | None = None) -> SweepResult:
        """One bounded step of job retention (see ``StoreBase.sweep_finished_jobs``)."""
        ...
    async def update_job(self, old: Job, new: Job, *, epoch: int | None = None) -> Job: ...
    async def update_jobs(self, changes: Sequence[tuple[Job, Job]], *, epoch: int | None = None) -> list[Job | Conflict]:
        """``update_job`` for each (old, new) on its own, in one round trip: the new job or its Conflict."""
        ...
    def prepare_updates(self, changes: Sequence[tuple[Job, Job]], *, epoch: int | None = None) -> PreparedUpdates:
        """Encode ``update_jobs(changes)`` now (CPU only, no I/O) to apply later with ``apply_updates``."""
        ...
    async def apply_updates(self, prepared: PreparedUpdates) -> list[Job | Conflict]:
        """Apply prepared changes exactly as ``update_jobs`` would (each checked on its own when applied)."""
        ...
    async def commit_placements(self, epoch: int, placements: Sequence[tuple[Job, Placement]]) -> list[Job]: ...
    async def release_job(
        self, epoch: int | None, job: Job, state: JobState, reason: StateReason, message: str = ""
    ) -> Job: ...
    async def release_jobs(
        self, epoch: int | None, releases: Sequence[tuple[Job, JobState, StateReason, str]]
    ) -> list[Job | Conflict]:
        """``release_job`` for each (job, state, reason, message) on its own, in one round trip."""
        ...
    async def resize_in_place(self, epoch: int, changes: Sequence[tuple[Job, Placement, str]]) -> list[Job | Conflict]:
        """Change the slices of placed jobs without a relaunch, each (job, new placement, message) atomic on its own."""
        ...
    async def move_services(self, epoch: int, moves: Sequence[tuple[Job, Placement, str]]) -> list[Job | Conflict]:
        """Move running services make-before-break: the new placement booked, the old kept until ``finish_moves``."""
        ...
    async def finish_moves(self, epoch: int, jobs: Sequence[Job]) -> list[Job | Conflict]:
        """Moving services whose new replica runs: RUNNING, their previous placement released."""
        ...
    async def record_demand(self, reports: Sequence[DemandReport], keep_s: float) -> list[bool]:
        """Add each report to its job's demand history; per report False when that (job, window end) was there."""
        ...
    async def demand_history(self, job_ids: Sequence[str], since_s: float) -> dict[str, list[DemandReport]]:
        """Each job's reports whose window ended at or after ``since_s``, oldest first (jobs without any: absent)."""
        ...
    async def demand_after(self, after: Mapping[str, float]) -> dict[str, list[DemandReport]]:
        """Each job's reports whose window ended strictly after ``after[job]``, oldest first (none: absent)."""
        ...
    async def put_node(self, node: NodeInfo) -> None: ...
    async def get_node(self, node_id: str) -> NodeInfo: ...
    async def list_nodes(self) -> list[NodeInfo]: ...
    async def remove_node(self, node_id: str) -> None: ...
    async def get_desired(self, node_id: str) -> tuple[int, dict[str, Placement]]: ...
    async def report_workloads(self, node_id: str, applied_generation: int, workloads: Sequence[Workload]) -> None:
        """Replace the node's actual state (written only by its agent) in one atomic step."""
        ...
    async def get_workloads(self, node_id: str) -> tuple[int, dict[str, Workload]]:
        """The node's actual state: (desired generation its agent had applied, {job_id: Workload})."""
        ...
    async def get_all_workloads(self, node_ids: Sequence[str]) -> dict[str, tuple[int, dict[str, Workload]]]:
        """``get_workloads`` of every node in ``node_ids``, read together in one step."""
        ...
    async def acquire_leadership(self, holder: str, ttl_s: float) -> int | None: ...
    async def release_leadership(self, holder: str) -> None: ...
    async def current_leader(self) -> tuple[str | None, int]: ...
    async def read_events(self, after_id: str = "0", limit: int = 100, block_s: float = 0.0) -> list[JobEvent]: ...
    async def put_status(self, name: str, data: str) -> None:
        """Store a service's status document (JSON) under ``name``; last writer wins, not fenced."""
        ...
    async def get_status(self, name: str) -> str | None: ...
    async def close(self) -> None: ...


class StoreBase:
    """High-level operations written once over backend primitives."""

    # --- primitives each backend provides -----------------------------------------------------------
    async def _apply(self, tx: Transaction) -> None:
        """Run ``tx`` atomically. Raises StaleEpoch, Conflict or DuplicateRequest; nothing changes then."""
        raise NotImplementedError

    async def _apply_each(self, txs: Sequence[Transaction]) -> list[Exception | None]:
        """Run each transaction atomically on its own, in order; per transaction None or the error it raised
        (StaleEpoch, Conflict, DuplicateRequest, ResourceExhausted), a failed one having changed nothing.
        Backends override this to send the whole list in one round trip."""
        out: list[Exception | None] = []
        for tx in txs:
            try:
                await self._apply(tx)
            except (StaleEpoch, Conflict, DuplicateRequest, ResourceExhausted) as exc:
                out.append(exc)
            else:
                out.append(None)
        return out

    async def _get_job_data(self, job_id: str) -> str | None:
        raise NotImplementedError

    async def _request_owner(self, request_id: str) -> str | None:
        raise NotImplementedError

    async def _list_page(self, states: tuple[str, ...], tenant: str, before: int | None,
                         want: int) -> tuple[list[tuple[int, str]], int | None, bool] | None:
        """Up to ``want`` jobs matching (``states`` values, none = any; ``tenant``, "" = any) with a submission
        sequence below ``before`` (None = from the newest), newest first, as (sequence, JSON); with the
        sequence of the last candidate checked (the cursor to continue from) and whether more may remain.
        Cost: the matching index entries checked (terminal states, tenant, all) or the active set (non-terminal
        states), never the whole history. None: a filter was given but the indexes are not built yet (a
        namespace older than them, until the backfill of ``_sweep`` completes)."""
        raise NotImplementedError

    async def _sweep(self, cutoff_s: float, keep: int, limit: int) -> SweepResult:
        """One retention step (``sweep_finished_jobs``), atomic: backfill ``limit`` records of an unindexed
        namespace, or delete up to ``limit`` terminal jobs finished before ``cutoff_s`` or beyond the newest
        ``keep``."""
        raise NotImplementedError

    async def _gpu_usage(self, node_id: str, gpu_indices: Sequence[int]) -> list[tuple[int, int]]:
        """(share_units_used, mem_mib_used) per GPU."""
        raise NotImplementedError

    async def _active_job_data(self) -> list[str | None]:
        """JSON of every job in the active (non-terminal) set."""
        raise NotImplementedError

    # --- jobs ---------------------------------------------------------------------------------------
    async def create_job(self, job: Job, *, live_limit: int = 0) -> tuple[Job, bool]:
        """Store a new PENDING job; idempotent by ``job.request_id`` within its tenant (:func:`request_key`).

        One atomic transaction (one Redis round trip): claim the request id, write the job, index it under
        the next submission sequence number, append its event. ``live_limit`` > 0: a new job is refused
        (ResourceExhausted) while its tenant has that many jobs in a non-terminal state (a retry of a request
        already stored still returns its job).

        Returns:
            (the stored job, True) or, when the request id was seen before, (the existing job, False).
        """
        result = (await self.create_jobs([job], live_limit=live_limit))[0]
        if isinstance(result, ResourceExhausted):
            raise result
        return result

    async def create_jobs(self, jobs: Sequence[Job], *, live_limit: int = 0) -> list[tuple[Job, bool] | ResourceExhausted]:
        """``create_job`` for each job, each its own atomic transaction, all sent in one round trip; a job its
        tenant's ``live_limit`` refuses is its ResourceExhausted in the list (the others are unaffected).

        Two jobs with the same request id in one call: the first is created, the second returns it.
        """
        stored, txs = [], []
        for job in jobs:
            now = job.submitted_at_s or time.time()
            job = replace(job, version=1, submitted_at_s=now, updated_at_s=now, queued_at_s=now)
            stored.append(job)
            key = request_key(job.spec.tenant, job.request_id)
            txs.append(Transaction(
                claim_request=(key, job.job_id),
                jobs=[JobWrite(job.job_id, 0, 1, job.state.value, codec.dumps(job), index_seq=True,
                               tenant=job.spec.tenant, request_id=key, time_s=now, live_limit=live_limit)],
                events=[_event(job)],
            ))
        out: list[tuple[Job, bool] | ResourceExhausted] = []
        for job, tx, err in zip(stored, txs, await self._apply_each(txs), strict=True):
            if err is None:
                self._note_written(tx.jobs[0].data, job)
                out.append((job, True))
            elif isinstance(err, DuplicateRequest):
                out.append((await self.get_job(err.job_id), False))
            elif isinstance(err, ResourceExhausted):
                out.append(err)
            else:
                raise err
        return out

    async def get_job(self, job_id: str) -> Job:
        data = await self._get_job_data(job_id)
        if data is None:
            raise NotFound(f"job {job_id!r} not found")
        return codec.loads(Job, data)

    async def find_job_by_request(self, tenant: str, request_id: str) -> Job | None:
        job_id = await self._request_owner(request_key(tenant, request_id))
        return None if job_id is None else await self.get_job(job_id)

    async def list_jobs(
        self, states: Sequence[JobState] = (), tenant: str = "", page_size: int = 100, page_token: str = ""
    ) -> tuple[list[Job], str]:
        """Jobs newest first (by submission), filtered; returns (page, next_page_token or "").

        Reads only the index entries matching the filter (see ``_list_page``). Paging is stable: the token is
        the submission sequence of the page's last job and a sequence never changes, so following the tokens
        returns every job at most once, in order, and every job that matched the filter throughout; a job
        that changes state between two pages shows up on a later page only if it matches then (and on no
        later page if its sequence lies above the token). A deleted job (retention) is simply absent.
        """
        if page_size < 1:
            return [], ""
        before = int(page_token) if page_token else None
        wanted = tuple(sorted({s.value for s in states}))
        out: list[Job] = []
        while True:
            page = await self._list_page(wanted, tenant, before, page_size - len(out))
            if page is None:  # first call only: once built, the indexes stay
                return await self._list_unindexed(set(states), tenant, page_size, before)
            rows, cursor, more = page
            out += [self._decoded(data) for _, data in rows]
            if len(out) >= page_size:
                return out, (str(rows[-1][0]) if more else "")
            if not more or cursor is None:
                return out, ""
            before = cursor

    async def _list_unindexed(self, wanted: set[JobState], tenant: str, page_size: int,
                              before: int | None) -> tuple[list[Job], str]:
        """``list_jobs`` with a filter before the indexes exist: every job in sequence order, filtered here."""
        out: list[Job] = []
        while True:
            rows, cursor, more = await self._list_page((), "", before, max(page_size * 2, 200))  # type: ignore[misc]
            for seq, data in rows:
                job = self._decoded(data)
                if (not wanted or job.state in wanted) and (not tenant or job.spec.tenant == tenant):
                    out.append(job)
                    if len(out) == page_size:
                        return out, str(seq) if (more or seq != rows[-1][0]) else ""
            if not more or cursor is None:
                return out, ""
            before = cursor

    def _decoded(self, data: str) -> Job:
        """The Job of a stored record, from the round's decode caches when its exact JSON is there (read only)."""
        return (self.__dict__.get("_decode_cache", {}).get(data) or self._written_jobs().get(data)
                or codec.loads(Job, data))

    async def sweep_finished_jobs(self, retention_s: float = DEFAULT_JOB_RETENTION_S,
                                  max_finished: int = DEFAULT_JOB_RETENTION_MAX, *, limit: int = SWEEP_LIMIT,
                                  now: float | None = None) -> SweepResult:
        """One bounded step of job retention; the allocator's leader calls it periodically.

        A finished job (SUCCEEDED, FAILED, CANCELLED) is kept for ``retention_s`` after it finished (its
        ``updated_at_s`` when it entered that state), and at most ``max_finished`` finished jobs are kept
        (the oldest-finished go first); beyond either, the job is deleted: its record, every index entry and
        its request-id mapping, so a later SubmitJob with that request id creates a new job. A job in a
        non-terminal state is never deleted (checked in the same atomic step). One call deletes at most
        ``limit`` jobs (``more`` says whether it stopped there: call again). A namespace older than the job
        indexes is first backfilled, ``limit`` records per call, before anything is deleted.

        Events of deleted jobs stay in the (bounded) event stream; deleting does not need the leader's epoch
        (two sweeps racing delete each job once).
        """
        if retention_s < 0 or max_finished < 0 or limit < 1:
            raise ValueError(f"retention_s={retention_s}, max_finished={max_finished}, limit={limit}: "
                             "must be >= 0, >= 0 and >= 1")
        now = time.time() if now is None else now
        return await self._sweep(now - retention_s, max_finished, limit)

    async def list_active_jobs(self, *, for_round: bool = True) -> list[Job]:
        """Every non-terminal job, read in one round trip; decoding is memoised by the record's exact JSON.

        A scheduling round calls this every time: with a thousand queued jobs, re-parsing unchanged records
        would dominate the round, so a record whose stored bytes are unchanged reuses its decoded Job.
        ``for_round=False`` (GetClusterState, any reader but the round): memoised the same way in a cache of
        its own (the round's caches are looked into, not replaced), so such reads neither decode every active
        record each time (~25 us a record) nor cost the next round its memoised decodes.
        """
        if not for_round:
            own: dict[str, Job] = self.__dict__.get("_reader_cache", {})
            fresh_own: dict[str, Job] = {}
            for data in await self._active_job_data():
                if data is not None:
                    fresh_own[data] = own.get(data) or self._decoded(data)
            self.__dict__["_reader_cache"] = fresh_own
            return [j for j in fresh_own.values() if not j.state.terminal]
        cache: dict[str, Job] = self.__dict__.get("_decode_cache", {})
        written = self._written_jobs()
        fresh: dict[str, Job] = {}
        out: list[Job] = []
        for data in await self._active_job_data():
            if data is None:
                continue
            job = cache.get(data) or written.get(data) or codec.loads(Job, data)
            fresh[data] = job
            if not job.state.terminal:
                out.append(job)
        self.__dict__["_decode_cache"] = fresh
        written.clear()
        return out

    def _written_jobs(self) -> dict[str, Job]:
        """Jobs this store object wrote, by their exact stored JSON, until the next ``list_active_jobs``: what a
        round wrote itself (placements, marks, releases) is found there instead of being decoded again."""
        return self.__dict__.setdefault("_written_cache", {})

    def _note_written(self, data: str, job: Job) -> None:
        written = self._written_jobs()
        if len(written) >= WRITTEN_CACHE_MAX:  # a replica that never lists active jobs must not grow it forever
            written.clear()
        written[data] = job

    async def update_job(self, old: Job, new: Job, *, epoch: int | None = None) -> Job:
        """Replace ``old`` by ``new`` if nobody changed it since ``old`` was read (compare-and-set).

        An event is appended when the state or reason changes. Placement bookkeeping is not touched:
        use ``commit_placements`` / ``release_job`` for that.

        Raises:
            Conflict: the stored version is no longer ``old.version``.
            StaleEpoch: ``epoch`` is given and is not the current leader epoch.
        """
        tx, stored = _update_tx(old, new, epoch)
        await self._apply(tx)
        self._note_written(tx.jobs[0].data, stored)
        return stored

    async def update_jobs(self, changes: Sequence[tuple[Job, Job]], *, epoch: int | None = None) -> list[Job | Conflict]:
        """``update_job`` for every (old, new), each its own compare-and-set, all sent in one round trip.

        Returns:
            Per change, the stored new job or the ``Conflict`` that rejected it (that change wrote nothing).

        Raises:
            StaleEpoch: ``epoch`` is stale (then no change was written).
        """
        return await self.apply_updates(self.prepare_updates(changes, epoch=epoch))

    def prepare_updates(self, changes: Sequence[tuple[Job, Job]], *, epoch: int | None = None) -> PreparedUpdates:
        """``update_jobs(changes)`` encoded now, applied later by ``apply_updates`` (the versions are checked
        then: a job that moved in between gets its Conflict, as with ``update_jobs``)."""
        return PreparedUpdates(tuple(_update_tx(old, new, epoch) for old, new in changes))

    async def apply_updates(self, prepared: PreparedUpdates) -> list[Job | Conflict]:
        """Apply ``prepare_updates``' changes in one round trip; see ``update_jobs`` for the results."""
        built = list(prepared.items)
        return self._each_result(built, await self._apply_each([tx for tx, _ in built]))

    async def commit_placements(self, epoch: int, placements: Sequence[tuple[Job, Placement]]) -> list[Job]:
        """Place PENDING jobs, all or nothing, fenced by ``epoch``.

        Checks in one atomic step: the epoch is current; every job is still at the version it was
        read at; every target GPU has room for the slice's compute share and memory. Then marks the
        jobs PLACED, books the GPU capacity and writes each node's desired state.

        Raises:
            StaleEpoch: a newer leader exists. Conflict: a version moved or a GPU lacks room.
            WrongState: a job is not PENDING.
        """
        now = time.time()
        tx = Transaction(epoch=epoch)
        placed: list[Job] = []
        for job, placement in placements:
            if job.state is not JobState.PENDING:
                raise WrongState(f"job {job.job_id} is {job.state.value}, only pending jobs can be placed")
            placement = replace(placement, job_id=job.job_id, epoch=epoch, committed_at_s=now)
            new = replace(job, state=JobState.PLACED, reason=StateReason.PLACED, message="", placement=placement,
                          version=job.version + 1, updated_at_s=now)
            tx.jobs.append(JobWrite(job.job_id, job.version, new.version, new.state.value, codec.dumps(new), time_s=now))
            for s in placement.slices:
                tx.gpus.append(GpuDelta(s.node_id, s.gpu_index, share_units(s.compute_share_pct), s.mem_mib))
            for node_id in sorted({s.node_id for s in placement.slices}):
                tx.desired.append(DesiredOp(node_id, job.job_id, codec.dumps(placement)))
            tx.events.append(_event(new))
            placed.append(new)
        await self._apply(tx)
        for w, job in zip(tx.jobs, placed, strict=True):
            self._note_written(w.data, job)
        return placed

    async def release_job(
        self, epoch: int | None, job: Job, state: JobState, reason: StateReason, message: str = ""
    ) -> Job:
        """Take a placed job off its GPUs (freeing capacity and desired state) and move it to ``state``.

        Used for completion, failure, cancellation, preemption and requeue (``state`` PENDING).

        Raises:
            Conflict: the job changed since it was read. StaleEpoch: ``epoch`` is stale.
        """
        tx, new = _release_tx(epoch, job, state, reason, message)
        await self._apply(tx)
        self._note_written(tx.jobs[0].data, new)
        return new

    async def resize_in_place(self, epoch: int, changes: Sequence[tuple[Job, Placement, str]]) -> list[Job | Conflict]:
        """Give placed jobs new slices on the same GPUs while their workloads keep running, fenced by ``epoch``.

        An inference service grows or shrinks this way (its co-tenants' MPS limits are what protect it, so its own
        process needs no relaunch). Per (job, placement, message), atomic on its own: the job is still at the
        version it was read at, PLACED or RUNNING, and every GPU has room for the growth. The placement keeps its
        identity (epoch and commit time: ``placement_id``), so the node agent adopts the new share instead of
        restarting; the job keeps its state, its reason becomes RESIZED with ``message``, an event records it.

        Returns:
            Per change, the new job or the ``Conflict`` that rejected it (that change wrote nothing).

        Raises:
            StaleEpoch: ``epoch`` is stale. WrongState: a job is not placed, or the placement moves GPUs.
        """
        now = time.time()
        built: list[tuple[Transaction, Job]] = []
        for job, placement, message in changes:
            old = job.placement
            if job.state not in (JobState.PLACED, JobState.RUNNING) or old is None:
                raise WrongState(f"job {job.job_id} is {job.state.value}, only a placed job can be resized in place")
            if sorted((s.node_id, s.gpu_index) for s in old.slices) != sorted((s.node_id, s.gpu_index) for s in placement.slices):
                raise WrongState(f"job {job.job_id}: an in-place resize keeps the job's GPUs")
            placement = replace(placement, job_id=job.job_id, epoch=old.epoch, committed_at_s=old.committed_at_s,
                                resized_at_s=now)
            new = replace(job, reason=StateReason.RESIZED, message=message, placement=placement,
                          version=job.version + 1, updated_at_s=now)
            tx = Transaction(epoch=epoch, jobs=[JobWrite(job.job_id, job.version, new.version, new.state.value,
                                                         codec.dumps(new), time_s=now)])
            before = {(s.node_id, s.gpu_index): s for s in old.slices}
            for s in placement.slices:
                b = before[(s.node_id, s.gpu_index)]
                tx.gpus.append(GpuDelta(s.node_id, s.gpu_index, share_units(s.compute_share_pct) - share_units(b.compute_share_pct),
                                        s.mem_mib - b.mem_mib))
            for node_id in sorted({s.node_id for s in placement.slices}):
                tx.desired.append(DesiredOp(node_id, job.job_id, codec.dumps(placement)))
            tx.events.append(_event(new))
            built.append((tx, new))
        return self._each_result(built, await self._apply_each([tx for tx, _ in built]))

    async def move_services(self, epoch: int, moves: Sequence[tuple[Job, Placement, str]]) -> list[Job | Conflict]:
        """Start moving running services to new placements, make-before-break, each (job, placement, message)
        atomic on its own, fenced by ``epoch``.

        The new placement is booked and goes to its nodes' desired state under the job's id (PLACED); the previous
        one stays booked and stays desired under :func:`~elastico.domain.drain_key`, so its replica keeps serving,
        until :meth:`finish_moves` (the new replica runs) releases it. A job released meanwhile (failed,
        cancelled, node lost) frees both.

        Raises:
            StaleEpoch: ``epoch`` is stale. WrongState: a job is not RUNNING, or is moving already.
        """
        now = time.time()
        built = [_move_tx(epoch, job, p, message, now) for job, p, message in moves]
        return self._each_result(built, await self._apply_each([tx for tx, _ in built]))

    async def finish_moves(self, epoch: int, jobs: Sequence[Job]) -> list[Job | Conflict]:
        """Moving services whose new replica runs: RUNNING, the previous replica's slices and desired entry released
        (its agent then stops it), each atomic on its own."""
        now = time.time()
        built = [_moved_tx(epoch, job, now) for job in jobs]
        return self._each_result(built, await self._apply_each([tx for tx, _ in built]))

    async def release_jobs(
        self, epoch: int | None, releases: Sequence[tuple[Job, JobState, StateReason, str]]
    ) -> list[Job | Conflict]:
        """``release_job`` for every (job, state, reason, message), each atomic on its own, in one round trip.

        Returns:
            Per release, the new job or the ``Conflict`` that rejected it (that release wrote nothing).

        Raises:
            StaleEpoch: ``epoch`` is stale (then nothing was written).
        """
        built = [_release_tx(epoch, job, state, reason, message) for job, state, reason, message in releases]
        return self._each_result(built, await self._apply_each([tx for tx, _ in built]))

    def _each_result(self, built: list[tuple[Transaction, Job]], errors: list[Exception | None]) -> list[Job | Conflict]:
        """Per-change results of ``_apply_each``: a stale epoch fails the call, a conflict only its change."""
        out: list[Job | Conflict] = []
        for (tx, job), err in zip(built, errors, strict=True):
            if err is None:
                self._note_written(tx.jobs[0].data, job)
                out.append(job)
            elif isinstance(err, Conflict):
                out.append(err)
            else:
                raise err
        return out

    async def get_all_workloads(self, node_ids: Sequence[str]) -> dict[str, tuple[int, dict[str, Workload]]]:
        """``get_workloads`` of every node in ``node_ids`` (backends read them in one step)."""
        return {n: await cast(Store, self).get_workloads(n) for n in node_ids}  # subclasses define it

    # --- nodes --------------------------------------------------------------------------------------
    def _with_usage(self, node: NodeInfo, usage: list[tuple[int, int]]) -> NodeInfo:
        gpus = tuple(
            replace(g, allocated_share_pct=u[0] / SHARE_UNITS_PER_PCT, allocated_mem_mib=u[1])
            for g, u in zip(node.gpus, usage, strict=True)
        )
        return replace(node, gpus=gpus)

    async def _node_with_usage(self, node: NodeInfo) -> NodeInfo:
        return self._with_usage(node, await self._gpu_usage(node.node_id, [g.index for g in node.gpus]))


def _update_tx(old: Job, new: Job, epoch: int | None) -> tuple[Transaction, Job]:
    stored = replace(new, version=old.version + 1, updated_at_s=time.time())
    tx = Transaction(epoch=epoch, jobs=[JobWrite(old.job_id, old.version, stored.version, stored.state.value, codec.dumps(stored),
                                                 time_s=stored.updated_at_s)])
    if (old.state, old.reason) != (stored.state, stored.reason):
        tx.events.append(_event(stored))
    return tx, stored


def _release_tx(epoch: int | None, job: Job, state: JobState, reason: StateReason, message: str) -> tuple[Transaction, Job]:
    now = time.time()
    requeued = state is JobState.PENDING and job.placement is not None
    new = replace(job, state=state, reason=reason, message=message, placement=None, draining=None,
                  restarts=job.restarts + (1 if requeued else 0), version=job.version + 1, updated_at_s=now,
                  queued_at_s=now if state is JobState.PENDING else job.queued_at_s)
    tx = Transaction(epoch=epoch, jobs=[JobWrite(job.job_id, job.version, new.version, state.value, codec.dumps(new),
                                                 time_s=now)])
    if job.placement is not None:
        _unbook(tx, job.placement, job.job_id)
    if job.draining is not None:
        _unbook(tx, job.draining, drain_key(job.job_id))
    tx.events.append(_event(new))
    return tx, new


def _unbook(tx: Transaction, p: Placement, key: str) -> None:
    """Free ``p``'s slices and delete desired-state entry ``key`` on its nodes."""
    for s in p.slices:
        tx.gpus.append(GpuDelta(s.node_id, s.gpu_index, -share_units(s.compute_share_pct), -s.mem_mib))
    for node_id in sorted({s.node_id for s in p.slices}):
        tx.desired.append(DesiredOp(node_id, key, None))


def _move_tx(epoch: int, job: Job, placement: Placement, message: str, now: float) -> tuple[Transaction, Job]:
    old = job.placement
    if job.state is not JobState.RUNNING or old is None or job.draining is not None:
        raise WrongState(f"job {job.job_id} is {job.state.value}; only a running service that is not moving already can move")
    placement = replace(placement, job_id=job.job_id, epoch=epoch, committed_at_s=now)
    new = replace(job, state=JobState.PLACED, reason=StateReason.RESIZED, message=message, placement=placement,
                  draining=old, version=job.version + 1, updated_at_s=now)
    tx = Transaction(epoch=epoch, jobs=[JobWrite(job.job_id, job.version, new.version, new.state.value, codec.dumps(new),
                                                 time_s=now)])
    for s in placement.slices:
        tx.gpus.append(GpuDelta(s.node_id, s.gpu_index, share_units(s.compute_share_pct), s.mem_mib))
    new_nodes = {s.node_id for s in placement.slices}
    for node_id in sorted(new_nodes):
        tx.desired.append(DesiredOp(node_id, job.job_id, codec.dumps(placement)))
    for node_id in sorted({s.node_id for s in old.slices}):
        tx.desired.append(DesiredOp(node_id, drain_key(job.job_id), codec.dumps(old)))
        if node_id not in new_nodes:
            tx.desired.append(DesiredOp(node_id, job.job_id, None))
    tx.events.append(_event(new))
    return tx, new


def _moved_tx(epoch: int, job: Job, now: float) -> tuple[Transaction, Job]:
    if job.draining is None:
        raise WrongState(f"job {job.job_id} is not moving")
    new = replace(job, state=JobState.RUNNING, reason=StateReason.STARTED, message="new replica serving; previous one stopped",
                  draining=None, version=job.version + 1, updated_at_s=now)
    tx = Transaction(epoch=epoch, jobs=[JobWrite(job.job_id, job.version, new.version, new.state.value, codec.dumps(new),
                                                 time_s=now)])
    _unbook(tx, job.draining, drain_key(job.job_id))
    tx.events.append(_event(new))
    return tx, new


def _event(job: Job) -> EventRecord:
    return EventRecord(job.job_id, job.state.value, job.reason.value, job.message, job.version, job.updated_at_s or time.time())


def event_from_fields(event_id: str, fields: dict[str, str]) -> JobEvent:
    """Rebuild a JobEvent from its stored string fields."""
    return JobEvent(
        event_id=event_id,
        job_id=fields["job_id"],
        state=JobState(fields["state"]),
        reason=StateReason(fields["reason"]),
        message=fields.get("message", ""),
        version=int(fields["version"]),
        time_s=float(fields["time_s"]),
    )


def gpu_capacity_units(gpu: GpuInfo) -> tuple[int, int]:
    """(share capacity in units, memory capacity MiB) of a healthy GPU; an unhealthy one has none left."""
    return (FULL_GPU_SHARE_UNITS, gpu.mem_total_mib) if gpu.healthy else (0, 0)
