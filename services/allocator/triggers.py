"""What wakes the leader's rounds besides the interval, and the finished-job sweep: the allocator's
background loops, each a coroutine the :class:`rounds.Scheduler` runs as a task while it is started.

* :func:`watch_events`: arrivals, requeues and cancellations on the job event stream (from any replica);
  the reason marks a round itself writes (UNSCHEDULABLE_NOW, NEVER_SCHEDULABLE) wake nothing, or every
  round would wake the next.
* :func:`watch_reports`: a change in the node agents' reported workloads (a start, an end: completions
  free capacity), polled every ``report_poll_s`` while leading.
* :func:`sweep_finished`: finished jobs past their retention deleted, in bounded steps, while leading.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from elastico.domain import JobState, StateReason
from elastico.errors import Unavailable
from elastico.logging import get_logger
from elastico.state.store import Store

log = get_logger(component="rounds")

QUEUE_NOTES = (StateReason.UNSCHEDULABLE_NOW, StateReason.NEVER_SCHEDULABLE)  # marks a round writes itself
SWEEP_PAUSE_S = 0.2  # between two job-retention steps while a backlog drains (each step one bounded Redis call)


async def watch_events(store: Store, batch_gap_s: float, wake: Callable[[str], None]) -> None:
    """Forever: wake a round on arrivals, requeues and cancellations; the stream is read in batches
    ``batch_gap_s`` apart (rounds coalesce events within ``round_min_gap_s`` anyway)."""
    after = ""
    while True:
        try:
            if not after:
                after = await store.last_event_id()
            events = await store.read_events(after, limit=1000, block_s=1.0)
        except Unavailable:
            await asyncio.sleep(1.0)
            continue
        if events:
            after = events[-1].event_id
            if any(e.state is JobState.CANCELLED or (e.state is JobState.PENDING and e.reason not in QUEUE_NOTES)
                   for e in events):
                wake("event")
            await asyncio.sleep(batch_gap_s)


async def watch_reports(store: Store, poll_s: float, node_ids: Callable[[], list[str] | None],
                        wake: Callable[[str], None]) -> None:
    """Forever, every ``poll_s``: wake a round when the workloads the agents report change (which job, which
    placement, which status). ``node_ids()``: the nodes to read, None while this replica does not lead."""
    seen: frozenset = frozenset()
    while True:
        await asyncio.sleep(poll_s)
        nodes = node_ids()
        if not nodes:
            continue
        try:
            reports = await store.get_all_workloads(nodes)
        except Unavailable:
            continue
        sig = frozenset((n, j, w.placement_id, w.status) for n, (_, ws) in reports.items() for j, w in ws.items())
        if sig != seen:
            seen = sig
            wake("reports")


async def sweep_finished(store: Store, every_s: float, retention_s: float, retention_max: int,
                         leading: Callable[[], bool]) -> None:
    """Forever, every ``every_s`` while leading: delete finished jobs past their retention
    (``Store.sweep_finished_jobs``). Each step is one bounded store call; while a step says more is due (a
    backlog), the next follows after a short pause."""
    while True:
        await asyncio.sleep(every_s)
        while leading():
            try:
                res = await store.sweep_finished_jobs(retention_s, retention_max)
            except Exception as exc:  # noqa: BLE001 - Unavailable, a refused command: retried next period
                log.warning("job retention sweep failed", error=str(exc))
                break
            if res.deleted or res.indexed:
                log.info("job retention sweep", deleted=res.deleted, indexed=res.indexed, more=res.more)
            if not res.more:
                break
            await asyncio.sleep(SWEEP_PAUSE_S)
