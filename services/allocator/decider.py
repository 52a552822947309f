"""Where a round's ``policy.decide(view)`` runs: a worker thread or a dedicated worker process.

``decide`` is pure CPU (the policy library, ~0.27 ms per placement at 512 GPUs). In a worker *thread* it
shares the interpreter lock with the event loop, so while it runs the job API (SubmitJob, WatchJobs...) and
the round's own I/O crawl. In a worker *process* (``ELASTICO_DECIDE_WORKER=process``, the default) it runs
on another core while the loop keeps serving. Measured on bench.allocator (this 2-core box, load ~2, three
runs each, alternating): sustained submit+placement 486/521/638 jobs/s in a thread, 490/764/835 in a process;
a 1,000-pending round the same within noise (pickling the view and the decision costs ~1.5 ms).

The policy object lives where ``decide`` runs and keeps its state between rounds (warm prices); the
scheduler names each policy it builds with a key (a new leader term, a new pair matrix or a degraded mode
starts a new one) and the worker rebuilds only when the key changes. With the pricer service, the worker
owns the gRPC solver too and hands back its state (last prices, gap, degradation) with each decision, so
the scheduler reports it exactly as in thread mode.

A worker that dies or cannot start is not fatal: rounds decide in a thread (logged) and a fresh worker is
tried again after ``RETRY_S``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from elastico.logging import get_logger

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


# --- worker process side ------------------------------------------------------------------------------
_WORKER: dict[str, Any] = {}


def _exit_with_parent(parent_pid: int) -> None:
    """Worker initializer: leave when the scheduler's process is gone (even SIGKILLed, which skips cleanup)."""
    import os
    import threading

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _warm_up() -> bool:
    """Import the policy library in the worker before the first round needs it."""
    import services.allocator.policy  # noqa: F401

    return True


def _decide_in_worker(spec: PolicySpec, view) -> tuple[Any, tuple | None]:
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
    decision = _WORKER["policy"].decide(view)
    solver = _WORKER.get("solver")
    return decision, (solver.snapshot() if solver is not None else None)


# --- scheduler side ---------------------------------------------------------------------------------------
class ProcessDecider:
    """One spawned worker process running ``decide`` for the scheduler (see module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._clock = clock
        self._retry_at = 0.0
        self.failures = 0

    def start(self) -> None:
        """Start the worker (spawn: a fresh interpreter, no forked gRPC or event-loop state) and warm it up."""
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                                initializer=_exit_with_parent, initargs=(os.getpid(),))
            self._pool.submit(_warm_up)

    async def decide(self, spec: PolicySpec, view, local: Callable[[], Any]) -> tuple[Any, tuple | None]:
        """``(decision, solver snapshot)`` from the worker; ``local()`` decides in a thread if the worker fails."""
        if self._clock() < self._retry_at:
            return await asyncio.to_thread(local), None
        self.start()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, _decide_in_worker, spec, view)
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
        procs = getattr(self._pool, "_processes", None) or {}
        return next(iter(procs), None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
