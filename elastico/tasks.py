"""Cancelling asyncio tasks so that they end.

A cancel can be lost inside a library: redis-py's blocking reads (``XREAD BLOCK``) return normally when the cancel
arrives as their reply does, and the task then runs on. :func:`cancel_until_done` repeats the cancel until each task
has ended, so a shutdown or a closed stream does not wait for the task's next blocking call, or forever.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

#: Seconds between repeated cancels of a task that has not ended yet.
CANCEL_RETRY_S = 0.05


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
