"""Whether this node's workloads may keep running while the agent cannot reach the store (the store fence).

The allocator declares a node lost once its heartbeat is older than ``node_stale_s + node_grace_s`` and places its
jobs elsewhere. An agent that is alive but cut off from Redis (a partition) must therefore stop its workloads
first, or a job runs twice. It stops them the way a dead agent's do: it no longer touches the liveness file its
workloads' supervisors fence on (``Runner.fence_s``), so they stop after ``ELASTICO_FENCE_S``.

An outage of the store itself looks the same from the node, yet there nobody can requeue anything (the allocator
holds no silence against a node while it cannot see the store either, ``plan.node_lost``), and stopping every
workload of the cluster would only lose work. So once its heartbeats fail, the agent asks the allocators
(``ELASTICO_ALLOCATOR_ADDRESSES``) whether *they* reach the store (the health name
:data:`elastico.healthcheck.STORE_SERVICE`): the workloads keep running only while every allocator answers
NOT_SERVING. An allocator that sees the store, or one that cannot be asked (this node may be cut off from
everything), means the node may be declared lost: the fence goes ahead.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from elastico.healthcheck import STORE_SERVICE, health_status
from elastico.logging import get_logger
from elastico.rpc.security import ClientTLS
from services.node_agent.runner import Runner

log = get_logger(component="liveness")

ASK_TIMEOUT_S = 1.0  # deadline of each allocator health check


class StoreFence:
    """Tracks the agent's last successful store round trip and decides whether its workloads may keep running.

    Args:
        allocators: host:port of every allocator replica that may schedule ("" entries ignored); none = an
            outage cannot be told from a partition, so the fence always goes ahead.
        silence_s: how long after the last successful heartbeat the store counts as unreachable (the heartbeat
            interval plus slack for one slow write).
        ask_every_s: at most one round of health checks per this period while cut off.
        ask: ``health_status``-like function (address, service, timeout, tls) -> SERVING / NOT_SERVING / ...
    """

    def __init__(self, allocators: Sequence[str], tls: ClientTLS | None, silence_s: float, ask_every_s: float = 1.0,
                 ask: Callable[..., str] = health_status, clock: Callable[[], float] = time.monotonic) -> None:
        self.allocators = tuple(a for a in allocators if a)
        self.tls, self.silence_s, self.ask_every_s = tls, silence_s, ask_every_s
        self._ask, self._clock = ask, clock
        self._answered = clock()  # started after a successful first heartbeat
        self._asked_at = -float("inf")
        self._shared_outage = False  # the last answers: every allocator is blind too
        self._state = "connected"  # connected / outage / fenced: what was last logged

    def store_answered(self) -> None:
        """A store round trip (the heartbeat) succeeded."""
        self._answered = self._clock()
        if self._state != "connected":
            log.info("store reachable again; workloads kept alive", was=self._state)
            self._state = "connected"

    async def may_run(self) -> bool:
        """True while the workloads may keep running: the store answered lately, or every allocator is blind too."""
        now = self._clock()
        if now - self._answered <= self.silence_s:
            return True
        if now - self._asked_at >= self.ask_every_s:
            self._asked_at = now
            answers = await asyncio.gather(*(asyncio.to_thread(self._ask, a, STORE_SERVICE, ASK_TIMEOUT_S, self.tls)
                                             for a in self.allocators))
            if self._clock() - self._answered <= self.silence_s:
                return True  # a heartbeat got through while they were asked (e.g. the agent was just resumed)
            self._shared_outage = bool(answers) and all(a == "NOT_SERVING" for a in answers)
            state = "outage" if self._shared_outage else "fenced"
            if state != self._state:
                silent = round(now - self._answered, 1)
                if self._shared_outage:
                    log.warning("store unreachable, and for every allocator too: nobody can move this node's jobs, "
                                "its workloads keep running", silent_s=silent)
                else:
                    log.error("cut off from the store while an allocator may see it (its answers: "
                              f"{dict(zip(self.allocators, answers)) or 'no allocator configured'}): the workloads' "
                              "supervisors stop them after ELASTICO_FENCE_S, before the node can be declared lost, so "
                              "that no job runs twice", silent_s=silent)
                self._state = state
        return self._shared_outage

    async def keep_alive(self, runner: Runner) -> None:
        """While this agent runs and :meth:`may_run`: touch the liveness file its workloads' shims fence on
        (``Runner.fence_s`` > 0)."""
        every = min(1.0, runner.fence_s / 4)
        while True:
            if await self.may_run():
                runner.touch_alive()
            await asyncio.sleep(every)
