"""Scheduling rounds: the live allocator's control loop around the pure policy library.

One round (:meth:`Scheduler.round`), run by the leader only, every write fenced by its epoch, in steps:

1. **Read** (:meth:`Scheduler._read`) everything from Redis: the active jobs, the nodes (heartbeats, GPUs,
   committed usage) and each node agent's actual state. Nothing the round needs lives only in memory, so a
   restarted or new leader continues where the last one stopped.
2. **Consume reports** (:func:`plan.transitions`): PLACED -> RUNNING when the agent runs the placement;
   COMPLETED -> SUCCEEDED, OWN_FAILURE -> FAILED, COTENANT_FAULT -> PENDING (requeued without penalty,
   progress kept); a node silent past ``node_stale_s + node_grace_s`` -> its jobs PENDING (NODE_LOST). A
   Kubernetes pod's job ends terminally (COTENANT_FAULT -> FAILED, an evicted or deleted pod -> CANCELLED) and
   stays placed on a lost node until its pod is gone (:func:`plan.transitions`).
3. **Decide**: inference demand first (``demand_tracker.DemandTracker``: the windows the agents scraped are
   stored, and every service is forecast from its history, ``demand.py``); the view (:func:`plan.build_view`: GPU rows of
   fresh, ready nodes' healthy GPUs only, services sized to their forecast); the
   pair matrix from the predictor service (cached, refreshed; unavailable -> degraded: whole GPUs only);
   ``policy.decide(view)`` in a worker process (``decider.py``; or a thread), the event loop serving
   meanwhile, ElastiCo pricing through the pricer service with a deadline (:class:`clients.GrpcSolver`;
   down -> last good prices, degraded). The policy state the round reports (predicted speeds, its cap)
   comes back with the decision (:class:`decider.DecisionReport`), computed where the policy lives.
4. **Apply** (:func:`plan.translate`): preemptions -> ``release_job(PENDING, PREEMPTED)`` with the progress
   the agent reported; a training job's resize -> release (RESIZED) + re-place (MPS limits are fixed at launch:
   it restarts from its checkpoint); then services' resizes in place (``Store.resize_in_place``: the process
   keeps serving; training first, so a growing service takes only what a relaunched co-tenant gave up); all
   placements of the round -> ONE ``commit_placements`` (all or nothing; Conflict -> nothing written,
   the next round re-reads). A round decides when jobs are pending or services run (their demand moves).
   A Kubernetes pod's job is never released by a decision: preempted, resized or moved, it gets reason
   EVICTION_REQUESTED (one fenced batch, its placement and slices unchanged; the kube extender evicts the pod)
   and its slices are freed only once the pod is gone (its agent's report, or the extender's reaper).
5. **Nudge** the touched node agents (``Sync``, deadline, best effort), **record** the round's metrics
   (:class:`round_metrics.RoundMetrics`) and **publish** its status (prices, gap, degradations) to Redis
   for ``GetClusterState`` on any replica.

Rounds run on an interval (``round_interval_s``) and on events (``triggers.py``; arrivals, cancellations: the event
stream; completions, starts, failures: agent reports polled every ``report_poll_s``), coalesced.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from elastico.coloc.profiles import TypeTable
from elastico.domain import Job, JobState, NodeInfo, Placement, StateReason, Workload
from elastico.errors import Conflict, ElasticoError, StaleEpoch, Unavailable, WrongState
from elastico.logging import get_logger
from elastico.state.store import Store
from elastico.state.transaction import PreparedUpdates
from elastico.tasks import cancel_until_done, wait_event
from services.allocator import reasons, triggers
from services.allocator.clients import AgentNudger, GrpcSolver, PredictorClient, pool_names
from services.allocator.decider import Decided, PolicySpec, ProcessDecider, run_policy
from services.allocator.demand_tracker import DemandTracker
from services.allocator.estimate import TypeResolver, default_kappa, default_types, exclusive_matrix
from services.allocator.leader import LeaderLease
from services.allocator.pair_estimate import PairEstimate
from services.allocator.plan import (
    Transition,
    ViewIndex,
    build_view,
    current_reports,
    node_fresh,
    still_running,
    transitions,
    translate,
)
from services.allocator.policy import INFERENCE, ClusterView, Decision, Policy, make_policy, options_for
from services.allocator.quota import held_by_quota
from services.allocator.round_metrics import RoundMetrics, RoundOutcome, RoundReport, observed_speeds, pending_reasons
from services.allocator.settings import AllocatorSettings

log = get_logger(component="rounds")

STATUS_NAME = "allocator"  # Store.put_status key of the leader's last round
# Reasons a round writes on a job it leaves queued; their events must not wake another round.
SIT_OUT_ROUNDS = 4  # rounds a pending job whose placement could not be applied is left out of (Scheduler._not_applied)


GC_THRESHOLDS = (20_000, 20, 20)  # gen0 allocations, gen1 and gen2 collection multipliers


def tune_gc() -> None:
    """Tune the garbage collector for a process running scheduling rounds; call once, after start-up.

    A round allocates ~10^5 short-lived objects (decoded records, views) next to a few hundred thousand
    long-lived ones (modules, numpy/scipy/grpc, type tables); with the defaults a full collection walks all
    of them every few rounds, a pause inside a round. Start-up's objects are never garbage: they are frozen
    out of collections, and collections run less eagerly (docs/results.md, "Allocator: measurement history"). Cycles are still
    collected, only later.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


@dataclass
class _Cluster:
    """The round's picture of the cluster: read from the store, then updated by the report transitions."""

    jobs: list[Job]  # active (non-terminal) jobs
    nodes: list[NodeInfo]  # every registered node, GPUs with committed usage
    node_map: dict[str, NodeInfo]
    workloads: dict[str, dict[str, Workload]]  # node id -> job id -> its agent's report
    never: frozenset[str] = frozenset()  # pending jobs that cannot be placed on the healthy cluster as it is
    touched: set[str] = field(default_factory=set)  # nodes whose desired state the round changed (nudged)


@dataclass
class _RoundDecision:
    """What the decide step produced for the apply and record steps."""

    view: ClusterView
    index: ViewIndex
    decision: Decision | None  # None: nothing to apply
    prepared: PreparedUpdates | None  # UNSCHEDULABLE_NOW marks encoded while the worker decided
    observed: dict[int, float]  # running view row -> normalised throughput its agent reports
    predicted: dict[int, float]  # the same rows' predicted throughput where they share a GPU (the policy's report)
    est_note: str  # estimate degradation ("" = healthy)
    demand: dict[str, float] = field(default_factory=dict)  # inference job id -> forecast req/s from measured demand


class Scheduler:
    """Runs rounds while this replica leads (see module docstring)."""

    def __init__(self, store: Store, settings: AllocatorSettings, lease: LeaderLease, *,
                 solver: GrpcSolver | None = None, predictor: PredictorClient | None = None,
                 nudger: AgentNudger | None = None, types: TypeTable | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.s = settings
        self.lease = lease
        self.solver = solver
        self.predictor = predictor
        self.nudger = nudger
        self.types = types or default_types()
        self.kappa = default_kappa(self.types.gpu_type)
        self.resolve = TypeResolver(self.types)
        self.clock = clock
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._bg: set[asyncio.Task] = set()
        self._term: int | None = None
        # since when this replica sees nodes' heartbeats: the first read of its term, or the store's return after an
        # outage (no heartbeat lands while Redis is down); a node's silence before it is not held against it.
        # inf = not watching (no term yet, or the store unreachable): set at the next successful read
        self._watched_since = math.inf
        # pending job -> the round number up to which it sits out: its placement could not be applied, and a plan
        # the store cannot take (a declared shape whose memory the chosen GPUs lack, say) must not hold GPUs on
        # paper round after round while other jobs wait for them
        self._not_applied: dict[str, int] = {}
        self._decided = 0  # rounds decided by this scheduler
        self._policies: dict[str, Policy] = {}
        self._policy_key = 0  # names the current policy for the decide worker process (bumped on every new one)
        self._spec: PolicySpec | None = None  # how the worker builds the current policy; None = decide in a thread
        self._decider = ProcessDecider(timeout_s=settings.decide_timeout_s) if settings.decide_worker == "process" else None
        self._policy_attempts = 0  # the policy's per-round placement cap, as its last report gave it
        self.metrics = RoundMetrics()
        self.estimate = PairEstimate(settings.estimator, predictor, self.types, self.kappa, settings.estimate_refresh_s)
        self.demand = DemandTracker(store, settings.forecast_window_s, settings.time_scale)  # stored, forecast
        self.quotas = settings.service_quotas()
        self._node_ids: list[str] = []
        self.last: RoundReport | None = None
        self.rounds = 0

    # --- lifecycle --------------------------------------------------------------------------------------
    def wake(self, why: str = "") -> None:
        """Ask for a round soon (coalesced with other wake-ups)."""
        self._wake.set()

    def start(self) -> None:
        if self._decider is not None:
            self._decider.start()  # spawn and warm the worker now, not in the first round
        s, leading = self.s, lambda: self.lease.epoch is not None
        self._tasks = [asyncio.create_task(self.run(), name="rounds"),
                       asyncio.create_task(triggers.watch_events(self.store, s.round_min_gap_s, self.wake), name="watch-events"),
                       asyncio.create_task(triggers.watch_reports(self.store, s.report_poll_s,
                                                                  lambda: self._node_ids if leading() else None, self.wake),
                                           name="watch-reports")]
        if s.job_retention_sweep_s > 0:
            self._tasks.append(asyncio.create_task(
                triggers.sweep_finished(self.store, s.job_retention_sweep_s, s.job_retention_s, s.job_retention_max, leading),
                name="job-retention"))

    async def stop(self) -> None:
        # bounded: a task stuck in a store call must not hold up shutdown
        await cancel_until_done([*self._tasks, *self._bg], timeout_s=2.0)
        self._tasks = []
        if self._decider is not None:
            self._decider.close()  # a later round starts a fresh worker
        self.metrics.leading(None)

    async def run(self) -> None:
        """Forever: wait for a trigger (or the interval), then run a round if leading."""
        while True:
            await wait_event(self._wake, self.s.round_interval_s)
            if self.s.round_min_gap_s:
                await asyncio.sleep(self.s.round_min_gap_s)  # let a burst of events share one round
            self._wake.clear()
            epoch = self.lease.epoch
            self.metrics.leading(epoch)
            if epoch is None:
                if self._term is not None:
                    log.warning("not leading any more: rounds paused", epoch=self._term)
                    self._term = None
                continue
            try:
                await self.round(epoch)
            except StaleEpoch as exc:
                self.metrics.failed("stale_epoch")
                log.warning("round rejected: a newer leader exists", epoch=epoch, error=str(exc))
                await self.lease.try_acquire()
            except Unavailable as exc:
                self.metrics.failed("unavailable")
                log.warning("round skipped: store unavailable", error=str(exc))
                await asyncio.sleep(min(1.0, self.s.round_interval_s))
            except Exception:  # noqa: BLE001 - one bad round must not stop scheduling
                self.metrics.failed("error")
                log.exception("round failed")
                await asyncio.sleep(min(1.0, self.s.round_interval_s))

    # --- estimate and policy ------------------------------------------------------------------------------
    def _policy(self, matrix: np.ndarray | None) -> Policy:
        mode = "normal" if matrix is not None else "exclusive"
        key = f"{mode}:{id(matrix)}"
        pol = self._policies.get(key)
        if pol is None:
            opts: dict = self.s.policy_options()
            if self.s.policy_max_attempts:
                opts["max_attempts"] = self.s.policy_max_attempts
            if matrix is None:  # degraded: the same policy on whole GPUs with a matrix that forbids sharing
                matrix, opts["shares_pct"] = exclusive_matrix(self.types), (100,)
                opts["learn_observed"] = False  # readings of earlier co-locations must not re-open sharing
            opts = options_for(self.s.policy, opts)  # the configured policy's part (the worker builds it from them too)
            pol = make_policy(self.s.policy, matrix, self.kappa, solver=self.solver, **opts)
            self._policies = {key: pol}  # a new matrix or mode starts a fresh policy (warm prices only)
            self._policy_key += 1
            pricer = (self.solver.address, self.solver.timeout_s, self.solver.tls) if isinstance(self.solver, GrpcSolver) else None
            # the worker process can build the same policy unless the solver is something it cannot rebuild
            self._spec = (PolicySpec(self._policy_key, self.s.policy, matrix, self.kappa, opts, pricer)
                          if self._decider is not None and (self.solver is None or pricer is not None) else None)
        return pol

    async def _run_policy(self, policy: Policy, view: ClusterView, rows: list[int], decide: bool = True) -> Decided:
        """:func:`decider.run_policy` where the policy lives: the worker process (``decide_worker=process``),
        else this process (``decide`` in a worker thread; a report alone is cheap enough to compute inline)."""
        here = functools.partial(run_policy, policy, view, rows, decide)
        if self._spec is None:
            decided = await asyncio.to_thread(here) if decide else here()
        else:
            decided, solver_state = await self._decider.decide(self._spec, view, rows, decide, here)
            if solver_state is not None and self.solver is not None:
                self.solver.restore(solver_state)  # prices, gap, degradation as the worker's solver saw them
        self._policy_attempts = decided.report.max_attempts
        return decided

    # --- the round ------------------------------------------------------------------------------------
    async def round(self, epoch: int) -> RoundReport:
        """One scheduling round with fencing token ``epoch``: read, consume reports, decide, apply, then nudge,
        record and publish (see module docstring)."""
        t0 = time.perf_counter()
        now = self.clock()
        if epoch != self._term:
            log.info("leading: scheduling rounds start", epoch=epoch, holder=self.lease.holder, policy=self.s.policy)
            self._term = epoch
            self._policies = {}
            self._watched_since = math.inf
        self.metrics.started(epoch)
        rep = RoundReport(epoch=epoch)
        try:
            try:
                cluster = await self._read()
            except Unavailable:
                self._watched_since = math.inf
                raise
            self._watched_since = min(self._watched_since, now)
            await self._consume_reports(epoch, cluster, now, rep)
            decided = await self._decide(epoch, cluster, now, rep)
            if decided.decision is not None:
                await self._apply(epoch, cluster, decided, rep)
        finally:
            self.metrics.writes(rep)  # what the store accepted, even when a later step failed
        self._nudge(cluster)
        rep.degraded = self._degradations(cluster.nodes, now, decided.est_note)
        rep.seconds = time.perf_counter() - t0
        fresh = [n for n in cluster.nodes if node_fresh(n, now, self.s.node_stale_s)]
        self.metrics.record(RoundOutcome(rep, decided.view, fresh, decided.observed, decided.predicted,
                                         self.demand.series(cluster.jobs, decided.demand), pending_reasons(cluster.jobs)))
        await self._publish(rep, now)
        self.last = rep
        self.rounds += 1
        if rep.placed_jobs or rep.released or rep.preempted or rep.started or rep.evictions:
            log.info("round", epoch=epoch, pending=rep.pending, placed=rep.placed_jobs, started=rep.started,
                     released=rep.released, preempted=rep.preempted, resized=rep.resized, evictions=rep.evictions or None,
                     round_ms=round(rep.seconds * 1e3, 1),
                     decide_ms=round(rep.decide_seconds * 1e3, 1), degraded=rep.degraded or None)
        return rep

    async def _read(self) -> _Cluster:
        """Jobs, nodes (with usage) and the agents' reports, three round trips in parallel (reports of the nodes
        known from the last round; re-read when the node set changed)."""
        known = list(self._node_ids)
        jobs, nodes, workloads = await asyncio.gather(self.store.list_active_jobs(), self.store.list_nodes(),
                                                      self.store.get_all_workloads(known))
        self._node_ids = [n.node_id for n in nodes]
        if self._node_ids != known:
            workloads = await self.store.get_all_workloads(self._node_ids)
        return _Cluster(jobs, nodes, {n.node_id: n for n in nodes}, {n: ws for n, (_, ws) in workloads.items()})

    async def _consume_reports(self, epoch: int, cluster: _Cluster, now: float, rep: RoundReport) -> None:
        """Agent reports and heartbeats -> job transitions (every one its own compare-and-set, all in one batch);
        then pending jobs larger than the cluster are marked NEVER_SCHEDULABLE."""
        changed: dict[str, Job] = {}
        released = False
        for t, new in await self._apply_transitions(epoch, transitions(cluster.jobs, cluster.node_map, cluster.workloads,
                                                                        now, self.s.node_stale_s, self.s.node_grace_s,
                                                                        self._watched_since), rep):
            changed[t.job.job_id] = new
            if t.release and t.job.placement is not None:
                released = True
                cluster.touched.update(s.node_id for s in t.job.placement.slices)
            if t.job.draining is not None:  # a move finished (or its job ended): the old replica's node stops it
                released = True
                cluster.touched.update(s.node_id for s in t.job.draining.slices)
        if changed:
            jobs = [changed.get(j.job_id, j) for j in cluster.jobs]
            cluster.jobs = [j for j in jobs if not j.state.terminal]
        if released:
            cluster.nodes = await self.store.list_nodes()  # releases changed committed usage
        cluster.never = await reasons.mark_never_schedulable(self.store, epoch, cluster.jobs, cluster.nodes)

    async def _decide(self, epoch: int, cluster: _Cluster, now: float, rep: RoundReport) -> _RoundDecision:
        """View, estimate, the policy's decision (when jobs are pending) and its report."""
        matrix, est_note = await self.estimate.current()
        policy = self._policy(matrix)
        forecasts = await self.demand.forecasts(cluster.jobs, cluster.workloads, now)
        # a queued service that can never fit neither counts against its tenant's quota nor is held by it
        held = held_by_quota([j for j in cluster.jobs if j.job_id not in cluster.never], self.quotas) if self.quotas else {}
        for job in await reasons.mark_held(self.store, epoch, cluster.jobs, held) if held else ():
            log.info("service waits for its tenant's service quota", job_id=job.job_id, tenant=job.spec.tenant,
                     detail=job.message)
        stopping = still_running(cluster.jobs, cluster.node_map, cluster.workloads, now,
                                 self.s.node_stale_s + self.s.node_grace_s, self._watched_since)
        if stopping:
            log.debug("pending jobs wait for their previous run to stop", job_ids=sorted(stopping))
        self._decided += 1
        self._not_applied = {j: last for j, last in self._not_applied.items() if last >= self._decided}
        skip = stopping | set(self._not_applied) | set(held)
        if self._not_applied:
            log.debug("pending jobs sit out this round: their last placement could not be applied",
                      job_ids=sorted(self._not_applied))
        jobs = [j for j in cluster.jobs if j.job_id not in skip] if skip else cluster.jobs
        # pure and a good part of a round with thousands of jobs pending: in a thread, so the event loop keeps
        # answering the API meanwhile (it holds the GIL only between the interpreter's switches)
        view, index = await asyncio.to_thread(
            build_view, jobs, cluster.nodes, self.types, self.resolve, now, self.s.node_stale_s, self.s.time_scale,
            self.s.max_tenants, observed=self._readings(cluster.jobs, cluster.workloads), demand_rps=forecasts)
        rep.pending = len(view.pending)
        observed = observed_speeds(view, index, cluster.workloads)
        t1 = time.perf_counter()
        # with services running, every round decides: their demand moves without any job arriving
        serving = bool((view.jobs.kind[view.running] == INFERENCE).any())
        decided, prepared = await self._decide_and_prepare(policy, view, index, list(observed), cluster.never, epoch) \
            if len(view.pending) or serving else (None, None)
        rep.decide_seconds = time.perf_counter() - t1
        if decided is None and observed:  # nothing to decide: the policy still predicts the running jobs' speeds
            decided = await self._run_policy(policy, view, list(observed), decide=False)
        return _RoundDecision(view, index, decided.decision if decided else None, prepared, observed,
                              decided.report.predicted_norm if decided else {}, est_note, forecasts)

    async def _apply(self, epoch: int, cluster: _Cluster, decided: _RoundDecision, rep: RoundReport) -> None:
        """The decision as store writes (:func:`plan.translate`): releases (preemptions, resizes) in one batch,
        then one commit of every placement, with the UNSCHEDULABLE_NOW marks of the jobs left queued."""
        view, index, decision, workloads = decided.view, decided.index, decided.decision, cluster.workloads
        plan = translate(decision, view, index, unlimited_training=self.s.policy == "elastico" and self.s.unlimited_training)
        rep.dropped = len(plan.dropped)
        pending = {index.jobs[int(r)].job_id for r in view.pending}
        self._not_applied.update((job_id, self._decided + SIT_OUT_ROUNDS) for job_id, _ in plan.dropped if job_id in pending)
        for job_id, why in plan.dropped:
            log.warning("decision not applied", job_id=job_id, why=why)
        for job_id, why in plan.waiting:
            log.debug("placement waits", job_id=job_id, why=why)
        batch = []
        releases = [(self._with_progress(job, workloads), JobState.PENDING, StateReason.PREEMPTED, "preempted by the policy")
                    for job in plan.preempt]
        growing = {(s.node_id, s.gpu_index): j.job_id for j, p in plan.in_place for s in p.slices
                   if s.compute_share_pct > j.placement.slices[0].compute_share_pct}
        releases += [(self._with_progress(job, workloads), JobState.PENDING, StateReason.RESIZED,
                      _relaunch_reason(job, p, growing)) for job, p in plan.resize]
        results = await self.store.release_jobs(epoch, releases) if releases else []
        for i, (job, new) in enumerate(zip([*plan.preempt, *(j for j, _ in plan.resize)], results, strict=True)):
            if isinstance(new, Conflict):
                continue
            cluster.touched.update(s.node_id for s in job.placement.slices)
            if i < len(plan.preempt):
                rep.preempted += 1
                log.info("job preempted", job_id=job.job_id, epoch=epoch)
            else:
                rep.resized += 1
                batch.append((new, plan.resize[i - len(plan.preempt)][1]))
        if plan.evict:
            await self._request_evictions(epoch, plan.evict, rep)
        if plan.in_place:  # after the releases (a relaunched co-tenant frees the share), before the commit
            await self._resize_in_place(epoch, plan.in_place, decided.demand, cluster, rep)
        if plan.move:
            await self._move_services(epoch, plan.move, cluster, rep)
        batch += plan.place
        # the commit and the UNSCHEDULABLE_NOW marks of the jobs left queued touch disjoint jobs: both in flight
        # together (one encodes while Redis runs the other)
        placing = {j.job_id for j, _ in batch}
        left = [index.jobs[int(r)] for r in view.pending if index.jobs[int(r)].job_id not in placing]
        outcomes = await asyncio.gather(self._commit(epoch, batch, rep, cluster.touched),
                                        reasons.mark_unschedulable_now(self.store, epoch, left, cluster.never, decided.prepared),
                                        return_exceptions=True)
        if not isinstance(outcomes[1], BaseException):
            rep.unschedulable = outcomes[1]
        for outcome in outcomes:
            if isinstance(outcome, BaseException):  # StaleEpoch, Unavailable: after both have finished
                raise outcome
        info = decision.info.get("pricing")
        if info is not None and info.get("gap") is not None and np.isfinite(info["gap"]):
            rep.gap = float(info["gap"])

    async def _request_evictions(self, epoch: int, evict: list[tuple[Job, StateReason, str]], rep: RoundReport) -> None:
        """Pod jobs the policy preempted, resized or moved -> reason EVICTION_REQUESTED with why, in one fenced
        batch (each its own compare-and-set; state, placement and slices unchanged: they stay booked until the
        pod is gone). A Conflict (the job changed, e.g. its pod ended) is left to the next round."""
        results = await self.store.update_jobs(
            [(job, replace(job, reason=StateReason.EVICTION_REQUESTED, message=why)) for job, _, why in evict], epoch=epoch)
        for (job, meant, why), new in zip(evict, results, strict=True):
            if isinstance(new, Conflict):
                log.warning("pod eviction request not written; re-reading next round", job_id=job.job_id, error=str(new))
                continue
            rep.evictions[meant.value] = rep.evictions.get(meant.value, 0) + 1
            log.info("pod eviction requested", job_id=job.job_id, detail=why, epoch=epoch)

    async def _resize_in_place(self, epoch: int, changes: list[tuple[Job, Placement]], forecasts: dict[str, float],
                               cluster: _Cluster, rep: RoundReport) -> None:
        """Services' new shares, each atomic on its own (a conflict leaves that service as it was until next round)."""
        def why(job: Job, p: Placement) -> str:
            old, new = job.placement.slices[0].compute_share_pct, p.slices[0].compute_share_pct
            f = forecasts.get(job.job_id)
            basis = f"forecast {f:.3g} req/s" if f is not None else f"declared {job.spec.inference.demand_rps:.3g} req/s"
            return f"share {old:g}% -> {new:g}% in place ({basis} + SLO margin)"

        await self._service_changes(self.store.resize_in_place, epoch, changes, why, "service resized in place", cluster, rep)

    async def _move_services(self, epoch: int, moves: list[tuple[Job, Placement]], cluster: _Cluster, rep: RoundReport) -> None:
        """Services moving make-before-break (``Store.move_services``), each on its own."""
        def why(job: Job, p: Placement) -> str:
            to = ", ".join(f"{s.node_id}:{s.gpu_index}" for s in p.slices)
            return f"moving to {to} at {p.slices[0].compute_share_pct:g}%; the current replica serves until the new one runs"

        await self._service_changes(self.store.move_services, epoch, moves, why, "service moving", cluster, rep)

    async def _service_changes(self, write: Callable, epoch: int, changes: list[tuple[Job, Placement]],
                               why: Callable[[Job, Placement], str], what: str, cluster: _Cluster, rep: RoundReport) -> None:
        """Write services' changes with ``write`` (a Store method taking (job, placement, message) triples, each
        atomic on its own), counting the written ones as resized and nudging their old and new nodes."""
        results = await write(epoch, [(j, p, why(j, p)) for j, p in changes])
        for (job, p), new in zip(changes, results, strict=True):
            if isinstance(new, Conflict):
                log.warning(f"{what}: not applied; re-reading next round", job_id=job.job_id, error=str(new))
                continue
            rep.resized += 1
            cluster.touched.update(s.node_id for s in (*p.slices, *job.placement.slices))
            log.info(what, job_id=job.job_id, detail=new.message, epoch=epoch)

    def _nudge(self, cluster: _Cluster) -> None:
        """Ask the agents of the touched nodes to sync now (best effort, in the background)."""
        for node_id in cluster.touched:
            node = cluster.node_map.get(node_id)
            if node is not None and self.nudger is not None:
                task = asyncio.create_task(self.nudger.sync(node.address))
                self._bg.add(task)
                task.add_done_callback(self._bg.discard)

    async def _apply_transitions(self, epoch: int, ts: list[Transition], rep: RoundReport) -> list[tuple[Transition, Job]]:
        """Write the report-driven transitions, each its own compare-and-set, in one batch per kind (two round
        trips in parallel); returns the ones written with their new job (a Conflict means the job changed under
        us, e.g. cancelled: it is re-read next round)."""
        starts = [t for t in ts if not t.release and t.job.draining is None]
        moved = [t for t in ts if not t.release and t.job.draining is not None]  # new replica runs: stop the old one
        ends = [t for t in ts if t.release]
        started, ended, done_moving = await asyncio.gather(
            self.store.update_jobs([(t.job, _started(t.job)) for t in starts], epoch=epoch) if starts else _none(),
            self.store.release_jobs(epoch, [(t.job, t.state, t.reason, t.message) for t in ends]) if ends else _none(),
            self.store.finish_moves(epoch, [t.job for t in moved]) if moved else _none())
        starts += moved
        started += done_moving
        out = []
        jlog = log.bind()  # bound once (see _commit)
        for t, new in zip(starts, started, strict=True):
            if isinstance(new, Conflict):
                continue
            rep.started += 1
            jlog.info("job running", job_id=t.job.job_id, epoch=epoch)
            out.append((t, new))
        for t, new in zip(ends, ended, strict=True):
            if isinstance(new, Conflict):
                continue
            rep.released[t.reason.value] = rep.released.get(t.reason.value, 0) + 1
            jlog.info("job released", job_id=t.job.job_id, state=t.state.value, reason=t.reason.value, detail=t.message,
                     progress_steps=t.job.progress_steps, epoch=epoch)
            out.append((t, new))
        return out

    async def _commit(self, epoch: int, batch: list[tuple[Job, Placement]], rep: RoundReport, touched: set[str]) -> bool:
        """All of the round's placements in one fenced, all-or-nothing commit; False when it was rejected."""
        if not batch:
            return True
        try:
            placed = await self.store.commit_placements(epoch, batch)
        except (Conflict, WrongState) as exc:
            rep.conflict = str(exc) or type(exc).__name__
            log.warning("round commit rejected, nothing written; re-reading next round", epoch=epoch,
                        error=str(exc), jobs=len(batch))
            self.wake("conflict")
            return False
        rep.placed_jobs = len(placed)
        rep.placed = [j.job_id for j in placed]
        jlog = log.bind()  # bound once: the lazy module logger re-binds on every call (hundreds of jobs a round)
        for j in placed:
            touched.update(s.node_id for s in j.placement.slices)
            jlog.info("job placed", job_id=j.job_id, epoch=epoch, share_pct=j.placement.slices[0].compute_share_pct,
                     gpus=[f"{s.node_id}:{s.gpu_index}" for s in j.placement.slices])
        return True

    async def _decide_and_prepare(self, policy: Policy, view: ClusterView, index: ViewIndex, rows: list[int],
                                  never: frozenset[str], epoch: int) -> tuple[Decided, PreparedUpdates | None]:
        """``(decided, prepared marks or None)``. While the worker *process* decides, the event loop is free: when
        the policy's per-round cap (as its last report gave it) means some candidates must stay queued, their
        UNSCHEDULABLE_NOW marks are encoded meanwhile (the round drops those of jobs it places: at most ``cap``
        encodings wasted)."""
        cap = self.s.policy_max_attempts or self._policy_attempts
        task = asyncio.ensure_future(self._run_policy(policy, view, rows))
        prepared = None
        try:
            if self._spec is not None and cap:
                candidates = reasons.mark_candidates([index.jobs[int(r)] for r in view.pending], never)
                if len(candidates) > cap:
                    await asyncio.sleep(0)  # the decide task hands the view to the worker first
                    prepared = self.store.prepare_updates(reasons.marked(candidates), epoch=epoch)
        except BaseException:
            task.cancel()
            raise
        return await task, prepared

    @staticmethod
    def _readings(jobs: list[Job], workloads: dict[str, dict[str, Workload]]) -> dict[str, tuple[float, tuple[str, ...]]]:
        """job id -> (slowest normalised throughput its agents report for its *current* placement, the
        co-tenants at that measurement): what the policy may learn interference from (``build_view``)."""
        out: dict[str, tuple[float, tuple[str, ...]]] = {}
        for job in jobs:
            if job.state is not JobState.RUNNING or job.placement is None:
                continue
            seen = [w for w in current_reports(job, workloads) if w.status == "running" and w.norm_throughput is not None]
            if seen and len(seen) == len({s.node_id for s in job.placement.slices}):  # every node has reported
                low = min(seen, key=lambda w: w.norm_throughput)
                out[job.job_id] = (float(low.norm_throughput), tuple(sorted({c for w in seen for c in w.cotenants})))
        return out

    @staticmethod
    def _with_progress(job: Job, workloads: dict[str, dict[str, Workload]]) -> Job:
        """The job with the progress its agents last reported (where a restart resumes)."""
        best = job.progress_steps
        for s in job.placement.slices if job.placement else ():
            w = workloads.get(s.node_id, {}).get(job.job_id)
            if w is not None:
                best = max(best, w.progress_steps)
        return replace(job, progress_steps=best)

    def _degradations(self, nodes: list[NodeInfo], now: float, est_note: str) -> list[str]:
        out = []
        if self.solver is not None and self.solver.degraded:
            out.append(self.solver.degraded)
        if est_note:
            out.append(est_note)
        for n in nodes:
            if not node_fresh(n, now, self.s.node_stale_s):
                age = now - n.last_heartbeat_s
                why = f"heartbeat {age:.0f}s old" if age > self.s.node_stale_s else "agent not ready"
                out.append(f"node {n.node_id}: {why}: no new placements")
        return out

    async def _publish(self, rep: RoundReport, now: float) -> None:
        prices = []
        if self.solver is not None and self.solver.last_prices is not None:
            cap = self.solver.last_capacity if self.solver.last_capacity is not None else np.zeros(len(self.solver.last_prices))
            prices = [{"pool": n, "price": float(p), "capacity": float(c)}
                      for n, p, c in zip(pool_names(len(self.solver.last_prices)), self.solver.last_prices, cap, strict=True)]
        doc = {"holder": self.lease.holder, "epoch": rep.epoch, "time_s": now, "round_s": rep.seconds,
               "gap": rep.gap if rep.gap is not None else (self.solver.last_gap if self.solver else None),
               "prices": prices, "degraded": rep.degraded, "pending": rep.pending, "policy": self.s.policy,
               "round_interval_s": self.s.round_interval_s}
        with contextlib.suppress(Unavailable):
            await self.store.put_status(STATUS_NAME, json.dumps(doc))

    async def close(self) -> None:
        await self.stop()
        if self.nudger is not None:
            await self.nudger.close()
        if self.predictor is not None:
            await self.predictor.close()
        if self.solver is not None:
            self.solver.close()
        if self._decider is not None:
            self._decider.close()


def _relaunch_reason(job: Job, p: Placement, growing: dict[tuple[str, int], str]) -> str:
    """Why a training job restarts at another share: the event message of its RESIZED release."""
    why = f"restart at {p.slices[0].compute_share_pct:g}%"
    svc = sorted({growing[k] for k in ((s.node_id, s.gpu_index) for s in job.placement.slices) if k in growing})
    return f"{why}: co-located service {', '.join(svc)} needs a larger share" if svc else why


def _started(job: Job) -> Job:
    """``job`` RUNNING: reason STARTED, except that a pod job's pending eviction request stays its reason (the
    kube extender evicts the pods whose jobs carry it)."""
    if job.reason is StateReason.EVICTION_REQUESTED:
        return replace(job, state=JobState.RUNNING)
    return replace(job, state=JobState.RUNNING, reason=StateReason.STARTED, message="")


async def _none() -> list:
    return []


__all__ = ["Scheduler", "RoundReport", "tune_gc", "STATUS_NAME", "ElasticoError"]
