"""Leader lease: one leader at a time, standby takes over after expiry or release, epochs increase."""

from __future__ import annotations

import asyncio

from services.allocator.leader import LeaderLease


async def test_single_leader_and_takeover(store):
    a = LeaderLease(store, "alloc-a", ttl_s=0.3)
    b = LeaderLease(store, "alloc-b", ttl_s=0.3)
    ea = await a.try_acquire()
    assert ea is not None and await b.try_acquire() is None
    assert await a.try_acquire() == ea  # renewal keeps the epoch
    await asyncio.sleep(0.45)  # a "pauses" past its lease
    assert a.epoch is None  # a knows locally its lease ran out
    eb = await b.try_acquire()
    assert eb is not None and eb > ea
    assert await a.try_acquire() is None


async def test_release_hands_over_immediately(store):
    a = LeaderLease(store, "a", ttl_s=30)
    b = LeaderLease(store, "b", ttl_s=30)
    a.start()
    for _ in range(50):
        if a.epoch is not None:
            break
        await asyncio.sleep(0.01)
    first = a.epoch
    assert first is not None
    await a.stop()
    assert a.epoch is None
    second = await b.try_acquire()
    assert second is not None and second > first
