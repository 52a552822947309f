"""Where measured co-located throughput waits until the next retrain: a Redis stream (durable, shared by
predictor replicas) or, without Redis, a process-local list (documented as lost on restart).

Entries are JSON of ``(a, b, norm_tput_a, norm_tput_b, node_id, time_unix_s)`` with full solo profiles,
so a retrain needs nothing but the stream and the shipped data.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from elastico.errors import Unavailable
from elastico.state.keys import Keys
from services.predictor.features import JobProfile, Observation

OBSERVATION_STREAM_MAXLEN = 1_000_000


def encode(obs: Observation, node_id: str, time_unix_s: float) -> str:
    def prof(p: JobProfile) -> dict:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in dataclasses.asdict(p).items()}

    return json.dumps({"a": prof(obs.a), "b": prof(obs.b), "norm_tput_a": obs.norm_tput_a, "norm_tput_b": obs.norm_tput_b,
                       "node_id": node_id, "time_unix_s": time_unix_s})


def from_record(d: dict) -> Observation:
    """The observation of one decoded log record (:func:`encode`'s JSON; it also names the node and time)."""

    def prof(x: dict) -> JobProfile:
        return JobProfile(**{k: (math.nan if v is None else v) for k, v in x.items()})

    return Observation(prof(d["a"]), prof(d["b"]), d["norm_tput_a"], d["norm_tput_b"], source="observation")


class ObservationLog(Protocol):
    async def append(self, entries: Sequence[str]) -> None: ...
    async def read_after(self, after_id: str) -> tuple[list[str], str]: ...
    async def pending(self) -> int: ...
    async def consumed(self) -> str: ...
    async def mark_consumed(self, last_id: str) -> None: ...
    async def close(self) -> None: ...


class MemoryObservationLog:
    """Process-local log for a predictor without Redis (observations are lost on restart)."""

    def __init__(self) -> None:
        self._entries: list[str] = []
        self._consumed = 0

    async def append(self, entries: Sequence[str]) -> None:
        self._entries.extend(entries)

    async def read_after(self, after_id: str) -> tuple[list[str], str]:
        start = int(after_id.split("-")[0])
        return self._entries[start:], f"{len(self._entries)}-0"

    async def pending(self) -> int:
        return len(self._entries) - self._consumed

    async def consumed(self) -> str:
        return f"{self._consumed}-0"

    async def mark_consumed(self, last_id: str) -> None:
        self._consumed = int(last_id.split("-")[0])

    async def close(self) -> None:
        return None


class RedisObservationLog:
    """The observation stream in Redis (key names from ``elastico.state.keys``)."""

    def __init__(self, url: str, namespace: str = "elastico", timeout_s: float = 5.0) -> None:
        self._r = aioredis.Redis.from_url(url, decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._k = Keys(namespace)

    async def _call(self, coro):
        try:
            return await coro
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise Unavailable(f"redis unavailable: {exc}") from exc

    async def ping(self) -> None:
        """Raise Unavailable unless the store answers (a start-up check: a wrong URL fails fast)."""
        await self._call(self._r.ping())

    async def append(self, entries: Sequence[str]) -> None:
        pipe = self._r.pipeline(transaction=True)
        for e in entries:
            pipe.xadd(self._k.observations, {"obs": e}, maxlen=OBSERVATION_STREAM_MAXLEN, approximate=True)
        await self._call(pipe.execute())

    async def read_after(self, after_id: str) -> tuple[list[str], str]:
        rows = await self._call(self._r.xrange(self._k.observations, min=f"({after_id}" if after_id != "0-0" else "-", max="+"))
        if not rows:
            return [], after_id
        return [fields["obs"] for _id, fields in rows], rows[-1][0]

    async def consumed(self) -> str:
        return (await self._call(self._r.get(self._k.observations_consumed))) or "0-0"

    async def pending(self) -> int:
        after = await self.consumed()
        if after == "0-0":
            return int(await self._call(self._r.xlen(self._k.observations)))
        rows = await self._call(self._r.xrange(self._k.observations, min=f"({after}", max="+"))
        return len(rows)

    async def mark_consumed(self, last_id: str) -> None:
        await self._call(self._r.set(self._k.observations_consumed, last_id))

    async def close(self) -> None:
        await self._r.aclose()
