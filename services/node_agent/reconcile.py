"""Level-triggered reconciliation: make what runs on this node equal what the allocator wants.

Every ``reconcile_interval_s`` (and at once on a Sync nudge) the agent reads the node's desired state
``{job_id: Placement}`` and compares it with its ledger of workloads — never with a log of changes, so a
lost nudge, a restart or a Redis blip can delay but never lose or duplicate work:

1. **MPS** (``mps_health.py``): probe the daemon (restart it if dead; start nothing while it is dead or stuck) and
   drain the GPUs a fault hit until every client on them has exited and ``mps_fault_holddown_s`` passed.
2. **Observe**: a workload whose process ended is classified — success (exit 0), own failure (non-zero
   exit, OOM), co-tenant fault (its GPU's MPS server failed while it ran: requeue without penalty), or
   stopped by us (no longer desired).
3. **Keep moving services' previous replicas**: a service moves make-before-break. Its new placement is
   desired under the job id and its previous one under ``drain_key(job)``; the workload running that previous
   placement is re-keyed in the ledger under the drain key (so it is not stopped, and is reported under that
   key), and the new replica starts in step 5. A drain entry is never started: one naming no workload of
   this node is ignored. When the drain key leaves the desired state the old replica is stopped as usual.
4. **Resize in place** an inference service whose desired placement keeps its ``placement_id`` but changes
   its compute share: services run with MPS limit 100 % (their co-tenants' limits protect them), so only
   the share the agent accounts (and the emulated capacity) changes; the process keeps running.
   **Stop** what is running but no longer desired (or desired with another placement: MPS limits are
   fixed at launch, so a new shape is a restart): SIGTERM to its process group, SIGKILL after
   ``stop_grace_s``. Ended workloads that are no longer desired are forgotten. Shrinks apply before the
   stops, growths only after them: a service grows into the share a co-tenant relaunched smaller gives up,
   so its larger capacity must not be accounted (or emulated) while the old co-tenant still runs.
5. **Start** what is desired and has no workload yet, as the unprivileged workload user (``WorkloadPolicy``);
   what goes on GPUs that no stopping workload holds starts right after the SIGTERMs, the rest once they exited.
   A placement that already ran here (same ``placement_id``) is never started again, whatever its outcome:
   the allocator re-places a job to run it again, which gives it a new placement id. A job whose command
   cannot start (unparsable, or commands refused by ``ELASTICO_ALLOW_COMMANDS=0``) is reported failed.
   An inference job without a command runs the built-in serving workload (``serving.py``) on a loopback
   port the agent picks.
6. **Measure and report** (``measure.py``): emulated rates (simulated GPUs), progress, throughput, co-tenants; the metrics
   of inference services whose scrape is due (``service_demand.py``; concurrently, each bounded by a timeout) become
   their ``Workload.demand`` (a previous replica still serving is not scraped: only the current one's demand
   counts); the ledger is saved atomically, the node's actual state goes to the store,
   co-located observations to the predictor.

The ledger (``<state_dir>/ledger.json``) makes a restarted agent re-adopt its running processes (matched
by pid *and* start time) instead of starting them twice or leaving them orphaned.

**Kubernetes pods** (``ELASTICO_KUBE_PODS``, a ``PodSource``): a pod job's workload is its pod's containers,
which kubelet runs. Step 5 starts nothing for it: the entry is bound to the pod UID and "starting" until the
pod is Running with its processes found (``/proc/<pid>/cgroup``), then "running" (pid = a container's main
process; counters summed over every pid of the pod). Step 2 reads its end from the pod (``pods.pod_outcome``)
once its processes are gone: Succeeded, Failed (exit code, OOMKilled), evicted or deleted; an MPS fault on its
GPU while it ran makes a failure COTENANT_FAULT. Step 4 never signals a pod (kubelet owns its containers; the
extender evicts): an entry no longer desired is forgotten, but while its pod's processes still run its GPUs
take no new process workload. A pod job on an agent not following pods is reported failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from elastico.domain import (
    DRAIN_SUFFIX,
    POD_UID_LABEL,
    JobKind,
    JobSpec,
    MetricsEndpoint,
    NodeInfo,
    Placement,
    StateReason,
    Workload,
    is_pod_job,
    label,
    placement_id,
)
from elastico.errors import NotFound, Unavailable
from elastico.logging import get_logger
from elastico.state import codec
from elastico.state.store import Store
from elastico.tasks import wait_event
from services.node_agent.coloc import ColocationTruth
from services.node_agent.gpu import GpuBackend
from services.node_agent.measure import MeasureStep
from services.node_agent.mps import MpsController
from services.node_agent.mps_health import MpsHealth
from services.node_agent.pairs import ObservationSink, PairObserver, Samples
from services.node_agent.pods import (
    PodProcess,
    PodSource,
    ending,
    main_process,
    pod_ip,
    pod_name,
    pod_outcome,
)
from services.node_agent.runner import (
    ExitWatcher,
    LedgerEntry,
    LedgerFile,
    Runner,
    find_tagged,
    free_loopback_port,
    path_safe_id,
    proc_start_ticks,
    serving_argv,
    synthetic_argv,
    workload_dir,
)
from services.node_agent.service_demand import ServiceScrapes
from services.node_agent.settings import WorkloadPolicy

log = get_logger(component="reconcile")
MAX_SYNC_WAIT_S = 5.0  # a Sync waits at most this long for the generation it asks for (the allocator asks for one it just wrote)

@dataclass(frozen=True)
class SyncResult:
    """Outcome of one reconcile pass."""

    applied_generation: int
    started: int
    stopped: int
    workloads: tuple[Workload, ...]
    resized: int = 0  # inference services resized in place


class Reconciler(MeasureStep):
    """Owns the ledger, the runner and the MPS controller of one node."""

    def __init__(self, store: Store, backend: GpuBackend, mps: MpsController, node_id: str, state_dir: Path, *,
                 stop_grace_s: float = 10.0, fault_holddown_s: float = 5.0, observation_interval_s: float = 30.0,
                 observation_sink: ObservationSink | None = None, truth: ColocationTruth | None = None,
                 policy: WorkloadPolicy | None = None, scrape_interval_s: float = 5.0,
                 pods: PodSource | None = None, fence_s: float = 0.0) -> None:
        self.store = store
        self.backend = backend
        self.mps = mps
        self.node_id = node_id
        self.state_dir = Path(state_dir)
        self._refused_ids: set[str] = set()  # desired-state keys left out as not path-safe (logged once each)
        self.runner = Runner(self.state_dir, policy, fence_s, stop_grace_s)  # None = the default policy (never root)
        self.ledger = LedgerFile.load(self.state_dir / "ledger.json")
        self.stop_grace_s = stop_grace_s
        self.health = MpsHealth(mps, self.ledger, fault_holddown_s)  # the daemon's state, GPUs an MPS fault drained
        self.pairs = PairObserver(node_id, observation_interval_s, observation_sink)  # co-located pairs -> predictor
        self._truth = truth
        self._lock = asyncio.Lock()
        self._exits = ExitWatcher(self.nudge)  # a supervisor's exit asks for a pass at once
        self._wake = asyncio.Event()
        self._samples: dict[str, Samples] = {}
        self._child_pids: dict[str, int] = {}
        self.scrapes = ServiceScrapes(node_id, scrape_interval_s)  # the demand its running services measure
        self.pods = pods  # None = pod jobs are not followed (not Kubernetes mode)
        self._pod_procs: dict[str, list[PodProcess]] = {}  # pod uid -> its live processes, this pass's scan
        self._blocked_logged: set[str] = set()  # jobs whose wait for a lingering pod's GPUs was logged

    # --- start-up -------------------------------------------------------------------------------------
    async def recover(self) -> None:
        """Re-adopt processes from the ledger and from tagged processes missing in it; start MPS."""
        if self.runner.fence_s > 0:
            self.runner.touch_alive()  # back in time: the shims that still run keep their workloads
        await asyncio.to_thread(self.mps.start)
        tagged = await asyncio.to_thread(find_tagged, str(self.state_dir))
        known = {(e.base_job_id, e.placement_id) for e in self.ledger.entries.values()}  # tags name the real job
        for (job_id, pid_), pid in tagged.items():
            if (job_id, pid_) in known:
                continue
            # started right before a crash, never recorded: launch.json has its entry
            try:  # the tag comes from the process's environment: workload_dir refuses one that leaves the state dir
                entry = codec.loads(LedgerEntry, (workload_dir(self.state_dir, job_id, pid_) / "launch.json").read_text())
            except (OSError, ValueError, KeyError) as exc:
                log.error("unknown tagged workload process; killing it", job_id=job_id, pid=pid, error=str(exc))
                self.runner.signal_group(LedgerEntry(job_id, pid_, _EMPTY_PLACEMENT, (), 0, 0, "", pid=pid,
                                                     pid_start_ticks=_ticks(pid)), signal.SIGKILL)
                continue
            if job_id in self.ledger.entries:  # an older placement of the same job is recorded: keep the newest
                old = self.ledger.entries[job_id]
                if old.running:
                    log.warning("two placements of one job running; stopping the unrecorded one", job_id=job_id)
                    self.runner.signal_group(replace(entry, pid=pid, pid_start_ticks=_ticks(pid)), signal.SIGKILL)
                    continue
            self.ledger.entries[job_id] = replace(entry, status="running", pid=pid, pid_start_ticks=_ticks(pid))
            log.info("re-adopted unrecorded workload", job_id=job_id, pid=pid)
        adopted = [e.job_id for e in self.ledger.entries.values() if e.running and (e.is_pod or self.runner.alive(e))]
        if adopted:
            log.info("re-adopted running workloads from the ledger", jobs=sorted(adopted))
        await asyncio.to_thread(self.ledger.save)
        if self.pods is not None:
            loop = asyncio.get_running_loop()
            self.pods.start(lambda: loop.call_soon_threadsafe(self._wake.set))  # a pod changed: reconcile now

    # --- loop -----------------------------------------------------------------------------------------
    def nudge(self) -> None:
        """Ask the loop for a pass now (Sync does its own pass; this is for other callers)."""
        self._wake.set()

    async def run_forever(self, interval_s: float) -> None:
        """Reconcile every ``interval_s`` (or when nudged); a Redis outage is logged and retried."""
        while True:
            self._wake.clear()  # before the pass: a nudge during it (a workload's end) asks for the next one
            try:
                await self.reconcile()
            except Unavailable as exc:
                log.warning("reconcile skipped: store unavailable", error=str(exc))
            except Exception:  # noqa: BLE001 - the loop must survive any single bad pass
                log.exception("reconcile pass failed")
            await wait_event(self._wake, interval_s)

    async def reconcile(self, min_generation: int = 0, deadline_s: float | None = None) -> SyncResult:
        """One pass; with ``min_generation`` first wait (until ``deadline_s``, at most ``MAX_SYNC_WAIT_S``) for
        that desired generation. The wait holds no lock: a caller asking for a generation that never comes
        delays nobody else's pass.

        Raises:
            Unavailable: the store is unreachable, or ``min_generation`` did not become visible in time.
        """
        limit = time.monotonic() + MAX_SYNC_WAIT_S
        deadline_s = limit if deadline_s is None else min(deadline_s, limit)
        gen, _ = await self.store.get_desired(self.node_id)
        while gen < min_generation:
            if time.monotonic() >= deadline_s:
                raise Unavailable(f"desired state generation {min_generation} not visible yet (store at {gen})")
            await asyncio.sleep(0.05)
            gen, _ = await self.store.get_desired(self.node_id)
        async with self._lock:
            gen, desired = await self.store.get_desired(self.node_id)
            return await self._pass(gen, desired)

    async def _pass(self, gen: int, desired: dict[str, Placement]) -> SyncResult:
        desired = self._path_safe(desired)
        now = time.time()
        await self.health.check(now, self._client_pids)
        self._observe_ends(now)
        await self._observe_pods(now)
        self.health.update_drains(now)
        stopped = await self._keep_moving(desired)
        resized = self._resize_in_place(desired, grow=False)
        victims, started = self._unwanted(desired), 0
        if victims:
            # a workload may take up to stop_grace_s to exit: what goes on GPUs none of them holds starts right after
            # the SIGTERMs; the rest once they have exited
            await self._signal_stop(victims)
            started = await self._start_missing(desired, avoid_gpus={g for e in victims for g in e.gpu_indices})
            stopped += await self._reap(victims)
        resized += self._resize_in_place(desired, grow=True)  # after the stops: see the module docstring, step 4
        started += await self._start_missing(desired)
        await self._measure(now)
        await self.scrapes.scrape_due(list(self.ledger.entries.values()))
        self.ledger.applied_generation = gen
        self._exits.watch({e.pid for e in self.ledger.entries.values() if e.running and not e.is_pod and e.pid > 0})
        await asyncio.to_thread(self.ledger.save)
        workloads = self.workloads()
        await self.store.report_workloads(self.node_id, gen, workloads)
        await self.pairs.observe(self.ledger.entries.values(), self._samples, now)
        if started or stopped or resized:
            log.info("reconciled", generation=gen, started=started, stopped=stopped, resized=resized,
                     running=sum(1 for w in workloads if w.status == "running"))
        return SyncResult(gen, started, stopped, tuple(workloads), resized)

    # --- 1. MPS: mps_health.MpsHealth -----------------------------------------------------------------
    def _client_pids(self, e: LedgerEntry) -> set[int | None]:
        """The processes of running workload ``e`` that are MPS clients (a pod's: its containers')."""
        return {p.pid for p in self._pod_procs.get(e.pod_uid, [])} if e.is_pod else {self._child_pid(e)}

    # --- 2. ends --------------------------------------------------------------------------------------
    def _observe_ends(self, now: float) -> None:
        for e in list(self.ledger.entries.values()):
            if e.running and not e.is_pod and not self.runner.alive(e):
                self.ledger.entries[e.job_id] = self._classify(e, now)

    async def _observe_pods(self, now: float) -> None:
        """Pod entries follow their pods: status, main pid, pod IP, and their end once their processes are gone."""
        if self.pods is None:
            return
        synced, pods = self.pods.snapshot()
        self._pod_procs = await asyncio.to_thread(self.pods.processes)
        for e in list(self.ledger.entries.values()):
            if not (e.is_pod and e.running):
                continue
            pod = pods.get(e.pod_uid)
            if pod is None and not synced:
                continue  # the watch has not listed yet: "gone" would be a guess
            procs = self._pod_procs.get(e.pod_uid, [])
            out = pod_outcome(pod, bool(procs), e.pod_seen, e.pod_ending)
            main = main_process(procs)
            e = replace(e, pod_seen=e.pod_seen or pod is not None, pod_ip=pod_ip(pod) or e.pod_ip, message=out.message,
                        pid=main.pid if main else 0, pid_start_ticks=main.start_ticks if main else 0,
                        pod_ending=(ending(pod) if pod is not None else "") or e.pod_ending)
            if out.ended:
                reason, message = out.reason, out.message
                if e.cotenant_fault and out.status == "failed":
                    reason = StateReason.COTENANT_FAULT
                    message = f"MPS server fault on GPU {','.join(map(str, e.gpu_indices))} ({message}); requeue without penalty"
                e = replace(e, status=out.status, reason=reason, exit_code=out.exit_code, message=message, ended_at_s=now,
                            throughput=0.0, pid=0, pid_start_ticks=0)
                log.info("pod workload ended", job_id=e.job_id, pod=pod_name(pod) if pod else e.pod_uid, status=e.status,
                         reason=reason.value if reason else "", detail=message)
                self._samples.pop(e.job_id, None)
                self.scrapes.forget(e.job_id)
            elif out.status == "running" and e.status != "running":
                e = replace(e, status="running", started_at_s=now)
                log.info("pod workload running", job_id=e.job_id, pod=pod_name(pod) if pod else e.pod_uid, pid=e.pid,
                         pids=sorted(p.pid for p in procs))
            self.ledger.entries[e.job_id] = e  # a running pod between container restarts stays running
        for uid in [u for u in self.ledger.lingering if not self._pod_procs.get(u)]:
            gone = self.ledger.lingering.pop(uid)
            log.info("processes of a pod no longer desired are gone; its GPUs take new workloads", job_id=gone.job_id,
                     pod_uid=uid, gpus=list(gone.gpu_indices))

    def _classify(self, e: LedgerEntry, now: float) -> LedgerEntry:
        code, message, fenced = self.runner.exit_status(e)
        if e.stop_requested:
            status, reason = "killed", StateReason.PREEMPTED
            message = f"stopped by the node agent ({message})"
        elif fenced:
            status, reason = "killed", StateReason.NODE_LOST
        elif e.cotenant_fault and code != 0:
            status, reason = "failed", StateReason.COTENANT_FAULT
            message = f"MPS server fault on GPU {','.join(map(str, e.gpu_indices))} ({message}); requeue without penalty"
        elif code == 0:
            status, reason = "succeeded", StateReason.COMPLETED
        else:
            status, reason = "failed", StateReason.OWN_FAILURE
            if self.runner.log_mentions_oom(e):
                message = f"out of memory ({message})"
        progress = self.runner.read_progress(e.progress_file)
        ended = replace(e, status=status, reason=reason, exit_code=code, message=message, ended_at_s=now,
                        progress_steps=progress[0] if progress else e.progress_steps, throughput=0.0)
        log.info("workload ended", job_id=e.job_id, status=status, reason=reason.value, detail=message)
        self._samples.pop(e.job_id, None)
        self._child_pids.pop(e.job_id, None)
        self.scrapes.forget(e.job_id)
        return ended

    # --- 3. moving services --------------------------------------------------------------------------
    def _path_safe(self, desired: dict[str, Placement]) -> dict[str, Placement]:
        """Desired entries whose job and placement ids can name directories (the allocator's always can): one
        that could not would make this root process write outside its state dir, so it is left out, and logged
        once."""
        bad = [k for k, p in desired.items()
               if not (path_safe_id(k.removesuffix(DRAIN_SUFFIX)) and path_safe_id(placement_id(p)))]
        for k in bad:
            if k not in self._refused_ids:
                self._refused_ids.add(k)
                log.error("desired state names a job id that is not path-safe; ignored", job_id=k[:128])
        return {k: p for k, p in desired.items() if k not in bad} if bad else desired

    async def _keep_moving(self, desired: dict[str, Placement]) -> int:
        """Re-key the workload running a moving service's previous placement under its drain key; returns how
        many stale drain replicas (an older move's, still in the ledger) had to be stopped to make room.

        A drain entry only keeps an existing workload: one naming no workload of this node is ignored (it
        may be another node's replica, or one that ended and was forgotten), never started.
        """
        moves: list[tuple[str, LedgerEntry]] = []
        stale: list[LedgerEntry] = []
        for key, p in sorted(desired.items()):
            if not key.endswith(DRAIN_SUFFIX):
                continue
            job_id, pid_ = key[: -len(DRAIN_SUFFIX)], placement_id(p)
            kept = self.ledger.entries.get(key)
            if kept is not None and kept.placement_id == pid_:
                continue  # kept already
            e = self.ledger.entries.get(job_id)
            current = desired.get(job_id)
            if e is None or e.is_pod or e.placement_id != pid_ or (current is not None and placement_id(current) == pid_):
                log.debug("drain entry names no workload of this node; nothing to keep", job_id=job_id, placement_id=pid_)
                continue
            if kept is not None and kept.running:  # an older move's replica still holds the key: not desired now
                stale.append(kept)
            moves.append((key, e))
        stopped = await self._stop(stale) if stale else 0
        for key, e in moves:
            del self.ledger.entries[e.job_id]
            self.ledger.entries[key] = replace(e, job_id=key)
            if e.job_id in self._samples:
                self._samples[key] = self._samples.pop(e.job_id)
            if e.job_id in self._child_pids:
                self._child_pids[key] = self._child_pids.pop(e.job_id)
            self.scrapes.forget(e.job_id)  # the job's demand is the new replica's from here
            log.info("service moving: keeping its previous replica until the new one runs", job_id=e.job_id,
                     pid=e.pid, placement_id=e.placement_id, drain_key=key)
        if moves:
            await asyncio.to_thread(self.ledger.save)  # before the new replica starts: a restart keeps both apart
        return stopped

    # --- 4. resize in place, stop ---------------------------------------------------------------------
    def _resize_in_place(self, desired: dict[str, Placement], *, grow: bool) -> int:
        """Take a running service's new compute share from a desired placement with its own placement id:
        shrinks (and other changes) with ``grow=False``, growths with ``grow=True``.

        Its MPS limit is 100 % (see ``_start_missing``) and its memory limit stays as launched, so nothing
        about the process changes: only the share the agent reports and emulates its capacity from.
        """
        resized = 0
        for e in list(self.ledger.entries.values()):
            want = desired.get(e.job_id)
            if (not e.running or e.is_pod or e.kind != JobKind.INFERENCE.value or want is None
                    or placement_id(want) != e.placement_id):
                continue
            slices = [s for s in want.slices if s.node_id == self.node_id]
            if not slices or want == e.placement:
                continue
            share = slices[0].compute_share_pct
            if (share > e.compute_share_pct) != grow:
                continue  # a growth waits for the stops; the rest applies before them
            if share != e.compute_share_pct:
                log.info("service resized in place", job_id=e.job_id, pid=e.pid, old_share_pct=e.compute_share_pct,
                         new_share_pct=share, placement_id=e.placement_id)
                resized += 1
            self.ledger.entries[e.job_id] = replace(e, compute_share_pct=share, placement=want)
        return resized

    def _unwanted(self, desired: dict[str, Placement]) -> list[LedgerEntry]:
        """The running entries to stop (not desired, or desired with another placement); ended ones that are not
        desired any more are forgotten, and so are pod entries (never signalled)."""
        victims = []
        for e in list(self.ledger.entries.values()):
            want = desired.get(e.job_id)
            if want is not None and placement_id(want) == e.placement_id:
                continue
            if e.is_pod:
                self._forget_pod(e)
                continue
            if e.running:
                victims.append(e)
            else:
                del self.ledger.entries[e.job_id]  # outcome acknowledged by the allocator: forget it
        return victims

    def _forget_pod(self, e: LedgerEntry) -> None:
        """A pod entry no longer desired is forgotten, never signalled: kubelet owns its containers, and the extender
        evicts pods. While its processes still run it lingers (unreported): its GPUs take no new process workload."""
        del self.ledger.entries[e.job_id]
        self._samples.pop(e.job_id, None)
        self.scrapes.forget(e.job_id)
        if self._pod_procs.get(e.pod_uid):
            self.ledger.lingering[e.pod_uid] = e
            log.info("pod job no longer desired but its pod's processes still run; keeping its GPUs from new process "
                     "workloads until they exit", job_id=e.job_id, pod_uid=e.pod_uid, gpus=list(e.gpu_indices))

    async def _stop(self, victims: list[LedgerEntry]) -> int:
        """Stop ``victims`` (running ledger entries) and forget them; returns once every one has exited."""
        await self._signal_stop(victims)
        return await self._reap(victims)

    async def _signal_stop(self, victims: list[LedgerEntry]) -> None:
        for e in victims:
            self.ledger.entries[e.job_id] = replace(e, stop_requested=True)
            self.runner.signal_group(e, signal.SIGTERM)
        await asyncio.to_thread(self.ledger.save)  # a crash mid-stop still classifies them as stopped

    async def _exited(self, victims: list[LedgerEntry]) -> None:
        """Wait for signalled ``victims`` to exit (SIGKILL after ``stop_grace_s``)."""
        deadline = time.monotonic() + self.stop_grace_s
        while any(self.runner.alive(e) for e in victims) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for e in victims:
            if self.runner.alive(e):
                log.warning("workload ignored SIGTERM; killing it", job_id=e.job_id, grace_s=self.stop_grace_s)
                self.runner.signal_group(e, signal.SIGKILL)
        while any(self.runner.alive(e) for e in victims):
            await asyncio.sleep(0.02)

    async def _reap(self, victims: list[LedgerEntry]) -> int:
        """Wait for signalled ``victims`` to exit, then classify and forget them."""
        await self._exited(victims)
        now = time.time()
        for e in victims:
            # stopped on request: the allocator already knows why (it released or re-placed the job),
            # so the entry goes; a re-placed job starts below under its new placement id
            ended = self._classify(self.ledger.entries.pop(e.job_id), now)
            log.info("stopped workload", job_id=e.job_id, detail=ended.message)
        return len(victims)

    # --- 5. start -------------------------------------------------------------------------------------
    async def _start_missing(self, desired: dict[str, Placement], avoid_gpus: set[int] | frozenset[int] = frozenset()) -> int:
        """Start what is desired and has no entry, except on ``avoid_gpus`` (a workload there is still stopping)."""
        started = 0
        for job_id, p in sorted(desired.items()):
            if job_id in self.ledger.entries or job_id.endswith(DRAIN_SUFFIX):
                continue  # running, or ran with this placement: never twice; a drain entry only keeps a replica
            slices = [s for s in p.slices if s.node_id == self.node_id]
            if not slices:
                continue
            gpus = tuple(s.gpu_index for s in slices)
            if avoid_gpus.intersection(gpus):
                continue
            # MPS not ready, or wait for the GPU to come back (or for the allocator to move the job); following a
            # pod starts nothing, so pod jobs get their entries whatever the state of MPS
            held = self.health.holds(gpus)
            if held and self.pods is None:
                continue
            try:
                job = await self.store.get_job(job_id)
            except NotFound:
                log.warning("desired job has no record; not starting it", job_id=job_id)
                continue
            spec = job.spec
            share, mem = slices[0].compute_share_pct, slices[0].mem_mib
            pid_ = placement_id(p)
            entry = LedgerEntry(
                job_id=job_id, placement_id=pid_, placement=p, gpu_indices=gpus, compute_share_pct=share, mem_mib=mem,
                workdir=str(workload_dir(self.state_dir, job_id, pid_)), model=spec.model_family,
                batch_size=p.shape.batch_size or spec.batch_size, kind=spec.kind.value, precision=spec.precision,
                progress_steps=job.progress_steps, isolated_throughput=self._isolated(p, spec.model_family,
                                                                                       p.shape.batch_size or spec.batch_size, len(gpus)),
            )
            if is_pod_job(spec):
                self.ledger.entries[job_id] = entry = self._pod_entry(entry, spec)
                await asyncio.to_thread(self.ledger.save)
                started += 1
                log.info("following pod" if entry.running else "pod job refused", job_id=job_id, pod_uid=entry.pod_uid,
                         gpus=list(gpus), share_pct=share, mem_mib=mem, placement_id=pid_,
                         **({"detail": entry.message} if not entry.running else {}))
                continue
            if held:
                continue
            lingering = sorted(u for u, o in self.ledger.lingering.items() if set(o.gpu_indices) & set(gpus))
            if lingering:
                if job_id not in self._blocked_logged:
                    self._blocked_logged.add(job_id)
                    log.info("waiting for the processes of pods no longer desired to exit before starting", job_id=job_id,
                             gpus=list(gpus), pod_uids=lingering)
                continue
            self._blocked_logged.discard(job_id)
            inference = spec.kind is JobKind.INFERENCE
            # a service is resized in place (_resize_in_place): it runs unlimited and its co-tenants' limits protect it
            env = self.mps.client_env(gpus, 100.0 if inference else entry.mps_limit_pct, mem)
            try:
                if spec.command:
                    if not self.runner.policy.allow_commands:
                        raise ValueError("this node runs no job commands (ELASTICO_ALLOW_COMMANDS=0; on Kubernetes "
                                         "the job's pod is its workload)")
                    argv = self.runner.command_argv(spec.command)
                    if not argv:
                        raise ValueError("command is blank")
                    declared = spec.inference.metrics if inference and spec.inference else None
                    if declared is not None:
                        port = declared.port or free_loopback_port()
                        if not declared.port:
                            env["ELASTICO_SERVE_PORT"] = str(port)
                        entry = replace(entry, serve_port=0 if declared.port else port, metrics=MetricsEndpoint(
                            port, declared.path or "/metrics", declared.format or "vllm", declared.scrape_interval_s,
                            declared.model))
                elif inference:
                    declared = spec.inference.metrics if spec.inference else None
                    port = declared.port if declared is not None and declared.port else free_loopback_port()
                    entry = replace(entry, serve_port=port, metrics=MetricsEndpoint(
                        port, "/metrics", "vllm", declared.scrape_interval_s if declared else 0.0,
                        declared.model if declared else ""))
                    argv = serving_argv(self.runner.policy.python or sys.executable)
                    env.update({"ELASTICO_SIM_RATE_FILE": entry.rate_file, "ELASTICO_SERVE_PORT": str(port),
                                "ELASTICO_TIME_SCALE": repr(float(getattr(self.backend, "time_scale", 1.0)))})
                else:
                    total = spec.training.total_steps if spec.kind is JobKind.TRAINING and spec.training else 0
                    argv = synthetic_argv(total, job.progress_steps, self.runner.policy.python or sys.executable)
                    env["ELASTICO_SIM_RATE_FILE"] = entry.rate_file
                drop = bool(spec.command) or self.runner.policy.synthetic_drops
                entry = await asyncio.to_thread(self.runner.start, entry, argv, env, drop)
            except (OSError, ValueError) as exc:  # unparsable command line, unwritable state dir...
                entry = replace(entry, status="failed", reason=StateReason.OWN_FAILURE, message=f"cannot start: {exc}",
                                ended_at_s=time.time())
            self.ledger.entries[job_id] = entry
            await asyncio.to_thread(self.ledger.save)
            started += 1
            log.info("started workload", job_id=job_id, pid=entry.pid, gpus=list(gpus), share_pct=share, mem_mib=mem,
                     placement_id=pid_, **({"endpoint": entry.endpoint} if entry.endpoint else {}))
        return started

    def _pod_entry(self, entry: LedgerEntry, spec: JobSpec) -> LedgerEntry:
        """The entry of a pod job: bound to its pod, "starting" until the pod runs; failed on an agent not following pods."""
        entry = replace(entry, workdir="", pod_uid=label(spec, POD_UID_LABEL))
        if self.pods is None:
            return replace(entry, status="failed", reason=StateReason.OWN_FAILURE, ended_at_s=time.time(),
                           message="cannot start: a Kubernetes pod's job (its pod's containers are the workload) on a node "
                                   "agent not following pods (set ELASTICO_KUBE_PODS=true on Kubernetes nodes)")
        declared = spec.inference.metrics if spec.kind is JobKind.INFERENCE and spec.inference else None
        if declared is not None and declared.port:  # scraped at the pod's IP (elastico.io/metrics-port)
            entry = replace(entry, metrics=MetricsEndpoint(declared.port, declared.path or "/metrics",
                                                           declared.format or "vllm", declared.scrape_interval_s,
                                                           declared.model))
        return replace(entry, message="pod not seen on this node yet")

    def apply_health(self, node: NodeInfo) -> NodeInfo:
        """Mark drained GPUs unhealthy and the node not ready while MPS is dead or stuck."""
        return self.health.apply(node)

    # --- shutdown -------------------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Stop following pods and release the scraper's HTTP session (workloads keep running)."""
        self._exits.close()
        if self.pods is not None:
            await asyncio.to_thread(self.pods.stop)
        await self.scrapes.close()

    @contextlib.asynccontextmanager
    async def between_passes(self):
        """Held, no pass runs: one in progress finishes first, its report included (cancelling it mid-write at exit
        could leave a workload started but not in the ledger, or a report landing after the last one)."""
        async with self._lock:
            yield

    async def stop_all(self) -> int:
        """Stop every workload and quit MPS (``stop_workloads_on_exit``; the default leaves them running).

        Unlike a stop the allocator asked for, nobody knows of this one: each stopped workload stays in the ledger,
        ended (killed, PREEMPTED, with its progress), and the node's actual state is reported once more. The
        allocator requeues the job with its progress, and a restarted agent never starts that placement again.
        Ended entries and pods' stay as they are.
        """
        async with self._lock:
            victims = [e for e in self.ledger.entries.values() if e.running and not e.is_pod]
            if victims:
                await self._signal_stop(victims)
                await self._exited(victims)
                now = time.time()
                for e in victims:
                    self.ledger.entries[e.job_id] = self._classify(self.ledger.entries[e.job_id], now)
            await asyncio.to_thread(self.ledger.save)
            try:
                await self.store.report_workloads(self.node_id, self.ledger.applied_generation, self.workloads())
            except Unavailable as exc:  # the agent's next start reports them
                log.warning("could not report the stopped workloads at exit", error=str(exc))
            await asyncio.to_thread(self.mps.stop)
            return len(victims)


_EMPTY_PLACEMENT = Placement(job_id="", shape_index=0, shape=None, slices=())  # type: ignore[arg-type]


def _ticks(pid: int) -> int:
    return proc_start_ticks(pid) or 0
