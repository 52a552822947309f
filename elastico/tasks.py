"""Cancelling asyncio tasks so that they end.

A cancel can be lost inside a library: redis-py's blocking reads (``XREAD BLOCK``) return normally when the cancel
arrives as their reply does, and the task then runs on. :func:`cancel_until_done` repeats the cancel until each task
has ended, so a shutdown or a closed stream does not wait for the task's next blocking call, or forever.

Python 3.11's ``asyncio.wait_for`` loses one too: cancelled as the awaited event is set, it returns the result, and a
``while True`` loop around it never ends. :func:`wait_event` waits with ``asyncio.timeout`` instead, which keeps the
cancel (``asyncio.wait_for`` is banned by the lint configuration for that reason).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

#: Seconds between repeated cancels of a task that has not ended yet.
CANCEL_RETRY_S = 0.05


async def wait_event(event: asyncio.Event | asyncio.Condition, timeout_s: float) -> bool:
    """Wait until ``event`` is set (a Condition: notified; its lock held by the caller), at most ``timeout_s``.
    True when it was, False at the timeout; a cancel arriving at the same time is raised, never dropped."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def cancel_until_done(tasks: Iterable[asyncio.Future], timeout_s: float | None = None) -> set[asyncio.Future]:
    """Cancel ``tasks``, again every :data:`CANCEL_RETRY_S` while one still runs; the ones still running after
    ``timeout_s`` (None: no limit) are returned."""
    pending = {t for t in tasks if not t.done()}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        left = CANCEL_RETRY_S if deadline is None else min(CANCEL_RETRY_S, deadline - time.monotonic())
        if left <= 0:
            break
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=left)
    return pending
