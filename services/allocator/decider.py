"""Where a round's policy runs (a worker thread or a dedicated worker process) and what it reports back.

``decide`` is pure CPU. In a worker *thread* it shares the interpreter lock with the event loop, so the job
API (SubmitJob, WatchJobs...) and the round's own I/O crawl while it runs; in a worker *process*
(``ELASTICO_DECIDE_WORKER=process``, the default) it runs on another core while the loop keeps serving, for
the cost of pickling the view and the decision (figures: docs/results.md, "Allocator: measurement history").

The policy object lives where ``decide`` runs and keeps its state between rounds (warm prices, the pair
matrix it learnt from observed interference); the scheduler names each policy it builds with a key (a new
leader term, a new pair matrix or a degraded mode starts a new one) and the worker rebuilds only when the
key changes. Whatever the allocator reports about the policy is therefore computed where it lives, by
:func:`run_policy` in both modes, and handed back with the decision as a :class:`DecisionReport`: the
scheduler's own copy of the policy would report a matrix the deciding policy no longer uses. With the
pricer service, the worker owns the gRPC solver too and hands back its state (last prices, gap,
degradation) with each decision, so the scheduler reports it exactly as in thread mode.

A worker that dies or cannot start is not fatal: rounds decide in a thread (logged) and a fresh worker is
tried again after ``RETRY_S``. A worker that does not answer within ``timeout_s`` (stopped, swapping, or a
decide that never ends) is killed and its round fails with :class:`DecideTimeout` (the round loop logs it and
goes on): the next round starts a fresh worker. Not a thread: a decide that never ends there could not be
stopped, and would hold scheduling while the leader's lease keeps renewing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from elastico.coloc.rates import compose_capped, limited_slots, share_speed
from elastico.logging import get_logger
from services.allocator.policy import ClusterView, Decision, ElastiCo, LucidPacking, Policy
from services.allocator.policy.placement import pair_estimate
from services.allocator.policy.shapes import shapes_of
from services.allocator.policy.view import INFERENCE

log = get_logger(component="decider")

DECIDE_WORKERS = ("process", "thread")
RETRY_S = 30.0  # after a worker failure, rounds decide in a thread this long before a new worker is tried


@dataclass(frozen=True)
class PolicySpec:
    """Everything needed to build the round's policy in another process (picklable)."""

    key: int  # changes whenever the scheduler starts a new policy
    name: str  # services.allocator.policy.POLICY_NAMES
    matrix: np.ndarray  # [T, T] pair estimate
    kappa: float
    options: dict[str, Any]  # make_policy options except the solver
    pricer: tuple | None  # (address, timeout_s, ClientTLS) of the pricer service; None = in-process pricing


@dataclass(frozen=True)
class DecisionReport:
    """The policy's state as the allocator reports it, computed where the policy lives, after its decide."""

    predicted_norm: dict[int, float]  # view row -> predicted normalised throughput next to its co-tenants
    max_attempts: int  # the policy's placement attempts per round; 0 = it has no such cap


@dataclass(frozen=True)
class Decided:
    """One run of the round's policy: its decision (None when only the report was asked for) and report."""

    decision: Decision | None
    report: DecisionReport


def run_policy(policy: Policy, view: ClusterView, rows: Sequence[int], decide: bool) -> Decided:
    """``policy.decide(view)`` when ``decide``, then the report for the running jobs ``rows`` of the view.

    The report reads the policy as the decision left it (a learning policy may have replaced its matrix),
    so it must run in the process holding the policy (the worker's :func:`_decide_in_worker` or a thread)."""
    decision = policy.decide(view) if decide else None
    model = _pair_model(policy)
    predicted: dict[int, float] = {}
    if model is not None:
        M, kappa, mps_limits, unlimited = model
        for r in rows:
            pred = predicted_norm(M, kappa, view, int(r), mps_limits, unlimited)
            if pred is not None:
                predicted[int(r)] = pred
    attempts = policy.params.max_attempts if isinstance(policy, ElastiCo) else 0
    return Decided(decision, DecisionReport(predicted, int(attempts)))


def _pair_model(policy: Policy) -> tuple[np.ndarray, float, bool, bool] | None:
    """``(pair matrix, kappa, mps_limits, unlimited_training)`` the policy predicts interference with; None for a
    policy that predicts none."""
    if isinstance(policy, (ElastiCo, LucidPacking)):
        return policy.M, policy.kappa, policy.mps_limits, policy.unlimited_training
    return None


def predicted_norm(M: np.ndarray, kappa: float, view: ClusterView, r: int, mps_limits: bool = False,
                   unlimited_training: bool = False) -> float | None:
    """Predicted normalised throughput of running job ``r`` next to the co-tenants of its first GPU; None when
    it runs alone. Against the speed of the job's own shape, as node agents measure it: with ``mps_limits``
    a job its share caps loses nothing until its pace falls below the cap. As the policy predicts it
    (:class:`~services.allocator.policy.placement.TenantState`): a co-tenant its declared shapes hold below its
    type's utilisation steals less (:func:`compose_capped`)."""
    jobs = view.jobs
    g = jobs.gpus[r]
    if g is None or not len(g):
        return None
    slots = [k for k, o in enumerate(view.gpu_job[g[0]]) if o >= 0]
    ten = [int(view.gpu_job[g[0]][k]) for k in slots]
    if len(ten) < 2:
        return None
    tt, uu = jobs.type_idx[ten], jobs.solo_util[ten]
    ut = uu if jobs.type_util is None else jobs.type_util[ten]  # pairs are of the types (JobTable.type_util)
    pair = pair_estimate(M, kappa, tt[:, None], ut[:, None], tt[None, :], ut[None, :])
    np.fill_diagonal(pair, 1.0)
    i = ten.index(r)
    if not mps_limits:
        return float(compose_capped(pair, np.ones(len(ten)))[1][i])
    training = jobs.kind[ten] != INFERENCE
    shares = view.gpu_share[g[0]][slots]
    pace = float(compose_capped(pair, np.where(training & (ut > uu), share_speed(shares, np.maximum(ut, 1e-6)), 1.0))[1][i])
    # against its shape: the share's cap on its type's pace (plan._observed_pace reads agents' readings back),
    # where the share is a limit: next to a service, or a declared shape (plan.make_placement)
    limited = bool(training[i]) and (not unlimited_training or bool(limited_slots(training, ~training)[i])
                                     or bool(shapes_of(jobs, r)))
    cap = float(share_speed(shares[i], max(float(ut[i]), 1e-6))) if limited else 1.0
    return min(1.0, pace / cap)


# --- worker process side ------------------------------------------------------------------------------
_WORKER: dict[str, Any] = {}


def _exit_with_parent(parent_pid: int) -> None:
    """Worker initializer: leave when the scheduler's process is gone (even SIGKILLed, which skips cleanup).

    SIGTERM and SIGINT sent to the whole process group (``make down``, Ctrl-C) are ignored: the scheduler's
    own shutdown stops the worker, after the round in flight, instead of breaking that round.
    """
    import signal
    import threading

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _warm_up() -> bool:
    """A first task, so that the worker starts (and imports the policy library) before a round needs it."""
    return True


def _decide_in_worker(spec: PolicySpec, view: ClusterView, rows: Sequence[int], decide: bool) -> tuple[Decided, tuple | None]:
    from services.allocator.policy import make_policy

    if _WORKER.get("key") != spec.key:
        solver = _WORKER.get("solver")
        if spec.pricer is None:
            solver = None
        elif solver is None or (solver.address, solver.timeout_s, solver.tls) != spec.pricer:
            from services.allocator.clients import GrpcSolver

            solver = GrpcSolver(*spec.pricer)
        options = dict(spec.options)
        if solver is not None:
            options["solver"] = solver
        _WORKER.update(key=spec.key, solver=solver, policy=make_policy(spec.name, spec.matrix, spec.kappa, **options))
    decided = run_policy(_WORKER["policy"], view, rows, decide)
    solver = _WORKER.get("solver")
    return decided, (solver.snapshot() if solver is not None else None)


# --- scheduler side ---------------------------------------------------------------------------------------
class DecideTimeout(RuntimeError):
    """The worker did not answer a round's decide in time; it was killed and the round decides nothing."""


class ProcessDecider:
    """One spawned worker process running the round's policy for the scheduler (see module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, timeout_s: float = 60.0) -> None:
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._clock = clock
        self._retry_at = 0.0
        self.timeout_s = timeout_s
        self.failures = 0
        self.timeouts = 0

    def start(self) -> None:
        """Start the worker (spawn: a fresh interpreter, no forked gRPC or event-loop state) and warm it up."""
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                                initializer=_exit_with_parent, initargs=(os.getpid(),))
            self._pool.submit(_warm_up)

    async def decide(self, spec: PolicySpec, view: ClusterView, rows: Sequence[int], decide: bool,
                     local: Callable[[], Decided]) -> tuple[Decided, tuple | None]:
        """``(run_policy(...) in the worker, solver snapshot)``; ``local()`` runs it in a thread if the worker fails."""
        if self._clock() < self._retry_at:
            return await asyncio.to_thread(local), None
        self.start()
        try:
            async with asyncio.timeout(self.timeout_s):
                return await asyncio.get_running_loop().run_in_executor(
                    self._pool, _decide_in_worker, spec, view, tuple(rows), decide)
        except TimeoutError:
            self.timeouts += 1
            log.error(f"decide worker process gave no answer in {self.timeout_s:g}s: killed, this round decides "
                      "nothing, the next one starts a fresh worker", pid=self.pid)
            self.close(kill=True)
            raise DecideTimeout(f"decide worker gave no answer in {self.timeout_s:g}s") from None
        except (concurrent.futures.process.BrokenProcessPool, OSError, RuntimeError) as exc:
            self.failures += 1
            self._retry_at = self._clock() + RETRY_S
            log.warning(f"decide worker process failed: rounds decide in a thread for {RETRY_S:.0f}s, then a new "
                        "worker is tried", error=repr(exc))
            self.close()
            return await asyncio.to_thread(local), None

    @property
    def pid(self) -> int | None:
        """The worker's process id while it runs (tests)."""
        procs = self._pool._processes if self._pool is not None else None  # the executor has no public accessor
        return next(iter(procs or {}), None)

    def close(self, kill: bool = False) -> None:
        """Stop the worker after its task in flight; ``kill``: at once (SIGKILL also ends a stopped process)."""
        if self._pool is not None:
            if kill:
                for proc in list((self._pool._processes or {}).values()):  # the executor has no public accessor
                    proc.kill()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
