"""elastico.tasks: cancelling tasks until they end, also when a cancel is lost on the way."""

from __future__ import annotations

import asyncio
import time

import pytest

from elastico.tasks import CANCEL_RETRY_S, cancel_until_done, wait_event


async def _loses_cancels(n: int, seen: list[float]) -> None:
    """Waits forever, losing its first ``n`` cancels (as redis-py's blocking reads can)."""
    while True:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            seen.append(time.monotonic())
            if len(seen) > n:
                raise


async def test_a_task_that_loses_cancels_still_ends() -> None:
    seen: list[float] = []
    task = asyncio.create_task(_loses_cancels(2, seen))
    await asyncio.sleep(0)
    assert await cancel_until_done([task]) == set()
    assert task.cancelled() and len(seen) == 3 and seen[-1] - seen[0] < 10 * CANCEL_RETRY_S


async def test_the_timeout_returns_what_still_runs_and_done_tasks_are_left_alone() -> None:
    deaf = True

    async def ignores_cancels() -> None:
        while deaf:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                continue

    done = asyncio.create_task(asyncio.sleep(0))
    await done
    stuck = asyncio.create_task(ignores_cancels())
    await asyncio.sleep(0)
    started = time.monotonic()
    assert await cancel_until_done([done, stuck], timeout_s=0.2) == {stuck}
    assert 0.15 < time.monotonic() - started < 1.0 and not done.cancelled()
    deaf = False
    assert await cancel_until_done([stuck], timeout_s=1.0) == set()


async def _waits_in_a_loop(wake: asyncio.Event | asyncio.Condition, passes: list[int]) -> None:
    """A service's background loop: a pass, then wait for a nudge or the interval, forever."""
    while True:
        passes.append(1)
        if isinstance(wake, asyncio.Condition):
            async with wake:
                await wait_event(wake, 30.0)
        else:
            wake.clear()
            await wait_event(wake, 30.0)


@pytest.mark.parametrize("kind", ["event", "condition"])
async def test_a_loop_cancelled_as_it_is_woken_ends(kind: str) -> None:
    """The cancel and the wake-up land in the same loop iteration: the wait is already over when the cancel is
    delivered (Python 3.11's asyncio.wait_for then returns normally and the loop runs on)."""
    wake = asyncio.Event() if kind == "event" else asyncio.Condition()
    passes: list[int] = []
    task = asyncio.create_task(_waits_in_a_loop(wake, passes))
    await asyncio.sleep(0.01)
    if isinstance(wake, asyncio.Condition):
        async with wake:
            wake.notify_all()
            task.cancel()
    else:
        wake.set()
        task.cancel()
    done, _ = await asyncio.wait([task], timeout=1.0)
    assert task in done and task.cancelled() and passes == [1]


async def test_wait_event_says_whether_it_was_set_or_timed_out() -> None:
    ev = asyncio.Event()
    started = time.monotonic()
    assert await wait_event(ev, 0.05) is False
    assert 0.04 < time.monotonic() - started < 1.0
    asyncio.get_running_loop().call_later(0.01, ev.set)
    assert await wait_event(ev, 5.0) is True
    assert await wait_event(ev, 0.0) is True  # already set: no wait at all
