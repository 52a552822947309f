"""elastico.tasks: cancelling tasks until they end, also when a cancel is lost on the way."""

from __future__ import annotations

import asyncio
import time

from elastico.tasks import CANCEL_RETRY_S, cancel_until_done


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
