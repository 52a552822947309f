"""The store fence's decision (services/node_agent/liveness.py) and the allocator's side of it (the lease's view of
the store): a node agent cut off from the store lets its workloads be fenced unless every allocator is blind too."""

from __future__ import annotations

import pytest

from elastico.errors import Unavailable
from elastico.healthcheck import STORE_SERVICE
from elastico.state.memory import MemoryStore
from services.allocator.leader import LeaderLease
from services.node_agent.liveness import StoreFence


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Allocators:
    """Health answers per address; records every question."""

    def __init__(self, **answers: str) -> None:
        self.answers = answers
        self.asked: list[tuple[str, str]] = []

    def __call__(self, address: str, service: str, timeout_s: float, tls) -> str:
        self.asked.append((address, service))
        return self.answers.get(address, "UNREACHABLE")


def fence(clock: Clock, ask: Allocators, *addresses: str) -> StoreFence:
    return StoreFence(addresses, None, silence_s=3.0, ask_every_s=1.0, ask=ask, clock=clock)


async def test_workloads_run_while_the_store_answers_and_nobody_is_asked():
    clock, ask = Clock(), Allocators(a="SERVING")
    f = fence(clock, ask, "a")
    for _ in range(10):
        clock.t += 1.0
        f.store_answered()
        assert await f.may_run()
    clock.t += 3.0  # exactly the silence allowed
    assert await f.may_run()
    assert ask.asked == []


@pytest.mark.parametrize(("answers", "runs"), [
    ({"a": "SERVING"}, False),  # a partition: the allocator sees the store and may move the jobs
    ({"a": "NOT_SERVING"}, True),  # an outage of everyone's: nobody can move them
    ({"a": "NOT_SERVING", "b": "SERVING"}, False),  # a standby blind, the leader not
    ({"a": "NOT_SERVING", "b": "UNREACHABLE"}, False),  # one cannot be asked: it may see the store
    ({"a": "NOT_SERVING", "b": "NOT_SERVING"}, True),
    ({"a": "SERVICE_UNKNOWN"}, False),  # an allocator that does not schedule says nothing of the store
])
async def test_cut_off_the_workloads_run_only_while_every_allocator_is_blind_too(answers, runs):
    clock, ask = Clock(), Allocators(**answers)
    f = fence(clock, ask, *answers)
    clock.t += 3.5
    assert await f.may_run() is runs
    assert sorted(ask.asked) == sorted((a, STORE_SERVICE) for a in answers)


async def test_without_allocators_a_store_outage_is_fenced():
    clock, ask = Clock(), Allocators()
    f = fence(clock, ask, "", "")  # blank entries are ignored
    assert f.allocators == ()
    clock.t += 10.0
    assert not await f.may_run()


async def test_the_allocators_are_asked_at_most_once_per_period_and_a_heartbeat_ends_the_fence():
    clock, ask = Clock(), Allocators(a="NOT_SERVING")
    f = fence(clock, ask, "a")
    clock.t += 5.0
    assert await f.may_run()
    clock.t += 0.5
    ask.answers["a"] = "SERVING"  # the store is back for the allocator, not yet asked again
    assert await f.may_run()
    assert len(ask.asked) == 1
    clock.t += 0.5
    assert not await f.may_run()  # asked again: the allocator sees the store, this node does not
    assert len(ask.asked) == 2
    f.store_answered()
    assert await f.may_run()
    assert len(ask.asked) == 2


async def test_a_heartbeat_that_gets_through_while_the_allocators_are_asked_ends_the_silence_without_a_fence():
    """An agent resumed after a long stop: its clock says silent, so it asks the allocators (who see the store); its
    heartbeat succeeds meanwhile. It used to log "cut off from the store" and fence for that round anyway."""
    clock = Clock()
    f: StoreFence

    class Answering(Allocators):
        def __call__(self, address, service, timeout_s, tls):
            f.store_answered()  # the heartbeat lands during the question
            return super().__call__(address, service, timeout_s, tls)

    ask = Answering(a="SERVING")
    f = fence(clock, ask, "a")
    clock.t += 75.0
    assert await f.may_run()
    assert f._state == "connected" and len(ask.asked) == 1


class FlakyStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.down = False

    async def acquire_leadership(self, holder: str, ttl_s: float) -> int | None:
        if self.down:
            raise Unavailable("redis unavailable: down")
        return await super().acquire_leadership(holder, ttl_s)


async def test_the_lease_reports_the_store_reachable_until_ttl_after_its_last_answered_round_trip():
    store, clock = FlakyStore(), Clock()
    leader, standby = LeaderLease(store, "a", ttl_s=10.0, clock=clock), LeaderLease(store, "b", ttl_s=10.0, clock=clock)
    assert not leader.store_reachable()  # nothing asked yet
    assert await leader.try_acquire() is not None
    assert await standby.try_acquire() is None  # lost the lease, yet the store answered
    assert leader.store_reachable() and standby.store_reachable()
    store.down = True
    clock.t += 5.0
    await leader.try_acquire()
    await standby.try_acquire()
    assert leader.store_reachable() and standby.store_reachable()  # within ttl of the last answer
    clock.t += 5.1
    assert not leader.store_reachable() and not standby.store_reachable()
    store.down = False
    await standby.try_acquire()
    assert standby.store_reachable() and not leader.store_reachable()


class BrokenOnceStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.beats = 0

    async def put_node(self, node) -> None:
        self.beats += 1
        if self.beats == 1:
            raise RuntimeError("a bad beat")
        if self.beats == 2:
            raise Unavailable("redis unavailable: blip")
        await super().put_node(node)


async def test_the_heartbeat_loop_outlives_a_failed_beat_and_tells_the_fence_of_each_good_one():
    import asyncio

    from services.node_agent.servicer import NodeAgent
    from services.node_agent.simulated import SimulatedBackend

    clock = Clock()
    f = StoreFence(("a",), None, silence_s=3.0, ask=Allocators(a="SERVING"), clock=clock)
    store = BrokenOnceStore()
    agent = NodeAgent(store, SimulatedBackend("n1", "v100", 1, 16384), "n1", "127.0.0.1:1", fence=f)
    clock.t += 10.0  # silent long enough to be fenced...
    assert not await f.may_run()
    task = asyncio.create_task(agent.heartbeat_forever(0.01))
    for _ in range(200):
        if store.beats >= 3:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    assert store.beats >= 3 and (await store.get_node("n1")).node_id == "n1"
    assert await f.may_run()  # ...until a beat landed
