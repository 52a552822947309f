"""Leader election for allocator replicas: a Redis lease with a monotonically increasing epoch.

One replica holds the lease and runs scheduling rounds; the others are hot standbys that keep trying.
The lease is renewed every ``ttl_s / 3``. Correctness does not rest on the lease being exclusive in
time (a paused process can outlive its lease without knowing): every write of a round carries the
epoch as a fencing token, and the store's atomic transaction rejects it once a newer epoch exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from elastico.errors import Unavailable
from elastico.logging import get_logger
from elastico.state.store import Store
from elastico.tasks import cancel_until_done

log = get_logger(component="leader")


class LeaderLease:
    """Keeps trying to hold the allocator lease; ``epoch`` is the fencing token while leader."""

    def __init__(self, store: Store, holder: str, ttl_s: float = 10.0, clock=time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        self._store = store
        self.holder = holder
        self.ttl_s = ttl_s
        self._clock = clock
        self._epoch: int | None = None
        self._valid_until = 0.0
        self._task: asyncio.Task[None] | None = None
        self._store_answered = -float("inf")  # clock of the last lease round trip the store answered
        self.changed = asyncio.Event()  # set whenever leadership is gained or lost

    @property
    def epoch(self) -> int | None:
        """The epoch while this replica believes it leads (lease not locally expired), else None."""
        if self._epoch is not None and self._clock() < self._valid_until:
            return self._epoch
        return None

    def store_reachable(self) -> bool:
        """The store answered a lease round trip (won or not) within the last ``ttl_s``: this replica, leader or
        standby, sees the store -- what the store health name reports to node agents cut off from it."""
        return self._clock() - self._store_answered <= self.ttl_s

    async def try_acquire(self) -> int | None:
        """One acquire-or-renew attempt; returns the epoch when leading. A failed one, whatever the error, keeps the
        lease it holds until that lapses (the store may answer at the next attempt)."""
        started = self._clock()
        try:
            epoch = await self._store.acquire_leadership(self.holder, self.ttl_s)
        except Exception as exc:  # noqa: BLE001 - no error may end the renewals: the lease lapses as if unreachable
            if isinstance(exc, Unavailable):
                log.warning("lease renewal failed", holder=self.holder, error=str(exc))
            else:
                log.error("lease renewal failed unexpectedly", holder=self.holder, error=f"{type(exc).__name__}: {exc}")
            epoch = None if self._clock() >= self._valid_until else self._epoch
            self._set(epoch, self._valid_until)
            return self.epoch
        self._store_answered = self._clock()
        # the lease is valid for ttl from when the request was sent, not from when it returned
        self._set(epoch, started + self.ttl_s if epoch is not None else 0.0)
        return self.epoch

    def _set(self, epoch: int | None, valid_until: float, handed_back: bool = False) -> None:
        if epoch != self._epoch:
            if handed_back:
                log.info("handed leadership back", holder=self.holder, epoch=self._epoch)
            elif epoch is None:
                log.warning("lost leadership", holder=self.holder, epoch=self._epoch)
            else:
                log.info("became leader", holder=self.holder, epoch=epoch)
            self.changed.set()
        self._epoch = epoch
        self._valid_until = valid_until

    async def run(self) -> None:
        """Acquire/renew forever (cancel to stop); no error ends it (:meth:`try_acquire` lets the lease lapse
        instead), so the replica leads again once the store answers."""
        while True:
            await self.try_acquire()
            await asyncio.sleep(self.ttl_s / 3)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        """Stop renewing and hand the lease back so a standby takes over at once."""
        if self._task is not None:
            await cancel_until_done([self._task])
        if self._epoch is not None:
            with contextlib.suppress(Unavailable):
                await self._store.release_leadership(self.holder)
        self._set(None, 0.0, handed_back=True)
