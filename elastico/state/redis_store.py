"""``Store`` on Redis (redis.asyncio): durable (with AOF), shared by every service and replica.

Every multi-key change is one Lua script (``lua.APPLY``) so checks and writes are atomic even with two
allocators racing; a connection failure surfaces as ``Unavailable`` (retry), never as a half-write.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar, cast

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MasterDownError, OutOfMemoryError, ReadOnlyError, ResponseError, TryAgainError
from redis.exceptions import TimeoutError as RedisTimeoutError

from elastico.domain import DemandReport, NodeInfo, Placement, Workload
from elastico.errors import Conflict, NotFound, ResourceExhausted, StaleEpoch, Unavailable
from elastico.state import codec, lua
from elastico.state.keys import Keys
from elastico.state.store import (
    DEMAND_REPORTS_MAX,
    JobEvent,
    StoreBase,
    event_from_fields,
    gpu_capacity_units,
    tenant_limit_message,
)
from elastico.state.transaction import DuplicateRequest, SweepResult, Transaction

P = ParamSpec("P")
R = TypeVar("R")

EVENT_STREAM_MAXLEN = 100_000


# error replies of a Redis that cannot serve now (a long script, out of memory, a replica, a failover): retryable.
# redis-py turns some into their own classes (the reply's code then gone from the message), the rest stay
# ResponseError with the code first
_TRANSIENT_CLASSES = (OutOfMemoryError, ReadOnlyError, MasterDownError, TryAgainError)
_TRANSIENT_REPLIES = ("BUSY", "CLUSTERDOWN", "NOREPLICAS")


def _unavailable_on_connection_error(fn: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise Unavailable(f"redis unavailable: {exc}") from exc
        except ResponseError as exc:
            if isinstance(exc, _TRANSIENT_CLASSES) or str(exc).startswith(_TRANSIENT_REPLIES):
                raise Unavailable(f"redis cannot serve now: {exc}") from exc
            raise

    return wrapper


class RedisStore(StoreBase):
    """Store on one Redis (or one Redis Cluster slot: all keys share a hash tag)."""

    def __init__(self, client: aioredis.Redis, namespace: str = "elastico") -> None:
        self._r = client
        self._k = Keys(namespace)
        self._apply_script = client.register_script(lua.APPLY)
        self._apply_each_script = client.register_script(lua.APPLY_EACH)
        self._active_jobs_script = client.register_script(lua.ACTIVE_JOBS)
        self._list_jobs_script = client.register_script(lua.LIST_JOBS)
        self._sweep_script = client.register_script(lua.SWEEP)
        self._nodes_script = client.register_script(lua.NODES)
        self._workloads_script = client.register_script(lua.WORKLOADS)
        self._demand_script = client.register_script(lua.DEMAND_RECORD)
        # decoded records memoised by their exact stored JSON (a round re-reads mostly unchanged records)
        self._node_cache: dict[tuple[str, str], NodeInfo] = {}
        self._workload_cache: dict[str, Workload] = {}
        self._acquire_script = client.register_script(lua.ACQUIRE)
        self._release_script = client.register_script(lua.RELEASE)

    @classmethod
    def from_url(cls, url: str, namespace: str = "elastico", timeout_s: float = 5.0) -> RedisStore:
        """Connect lazily to ``url`` with socket timeouts (a hung Redis becomes ``Unavailable``)."""
        client = aioredis.Redis.from_url(
            url, decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            health_check_interval=30,
        )
        return cls(client, namespace)

    @_unavailable_on_connection_error
    async def ping(self) -> bool:
        return bool(await cast("Awaitable[bool]", self._r.ping()))

    @staticmethod
    def _tx_payload(tx: Transaction, records: list[str]) -> dict[str, Any]:
        """The transaction as the script's JSON (``dataclasses.asdict`` by hand: it is on every write's path).

        Records (job and placement JSON) are appended to ``records`` and named by their ARGV index.
        """
        def arg(data: str) -> int:
            records.append(data)
            return len(records) + 3  # ARGV[1..3] are prefix, transaction(s), MAXLEN

        return {
            "epoch": tx.epoch,
            "claim_request": list(tx.claim_request) if tx.claim_request is not None else None,
            "jobs": [{"job_id": w.job_id, "expected_version": w.expected_version, "new_version": w.new_version,
                      "state": w.state, "data_arg": arg(w.data), "index_score": w.index_score, "index_seq": w.index_seq,
                      "tenant": w.tenant, "request_id": w.request_id, "time_s": repr(float(w.time_s)),
                      "live_limit": w.live_limit}
                     for w in tx.jobs],
            "gpus": [{"node_id": d.node_id, "gpu_index": d.gpu_index, "share_units": d.share_units, "mem_mib": d.mem_mib}
                     for d in tx.gpus],
            "desired": [{"node_id": o.node_id, "job_id": o.job_id, "data_arg": None if o.data is None else arg(o.data)}
                        for o in tx.desired],
            "events": [{"job_id": e.job_id, "state": e.state, "reason": e.reason, "message": e.message,
                        "version": e.version, "time_s": repr(float(e.time_s))} for e in tx.events],
        }

    @staticmethod
    def _tx_error(tx: Transaction, result: list) -> Exception:
        kind, *detail = result
        if kind == "stale_epoch":
            return StaleEpoch(f"epoch {tx.epoch} is stale (current {detail[0]})")
        if kind == "duplicate":
            return DuplicateRequest(detail[0])
        if kind == "version":
            return Conflict(f"job {detail[0]} is at version {detail[1]}, expected {detail[2]}")
        if kind == "unknown_gpu":
            return Conflict(f"unknown GPU {detail[0]}")
        if kind == "capacity":
            return Conflict(f"GPU {detail[0]} lacks capacity")
        if kind == "tenant_limit":
            return ResourceExhausted(tenant_limit_message(detail[0], int(detail[1])))
        raise RuntimeError(f"unexpected script result {result!r}")  # pragma: no cover

    @_unavailable_on_connection_error
    async def _apply(self, tx: Transaction) -> None:
        records: list[str] = []
        payload = json.dumps(self._tx_payload(tx, records))
        result = await self._apply_script(args=[self._k.prefix, payload, str(EVENT_STREAM_MAXLEN), *records])
        if result is not None:
            raise self._tx_error(tx, result)

    @_unavailable_on_connection_error
    async def _apply_each(self, txs: Sequence[Transaction]) -> list[Exception | None]:
        """All transactions in one script call (one round trip), each checked and written on its own."""
        if not txs:
            return []
        records: list[str] = []
        payload = json.dumps([self._tx_payload(tx, records) for tx in txs])
        results = await self._apply_each_script(args=[self._k.prefix, payload, str(EVENT_STREAM_MAXLEN), *records])
        return [None if r == ["ok"] else self._tx_error(tx, r) for tx, r in zip(txs, results, strict=True)]

    @_unavailable_on_connection_error
    async def _get_job_data(self, job_id: str) -> str | None:
        return await cast("Awaitable[str | None]", self._r.hget(self._k.job(job_id), "data"))

    @_unavailable_on_connection_error
    async def _request_owner(self, request_id: str) -> str | None:
        return await cast("Awaitable[str | None]", self._r.hget(self._k.requests, request_id))

    @_unavailable_on_connection_error
    async def _list_page(self, states: tuple[str, ...], tenant: str, before: int | None,
                         want: int) -> tuple[list[tuple[int, str]], int | None, bool] | None:
        """One script call (``lua.LIST_JOBS``): the matching index entries and their records in one step."""
        result = await self._list_jobs_script(args=[self._k.prefix, "" if before is None else str(before), str(want),
                                                    tenant, *states])
        if result[0] == "unindexed":
            return None
        _, cursor, more, flat = result
        rows = [(int(seq), data) for seq, data in zip(flat[::2], flat[1::2], strict=True)]
        return rows, (int(cursor) if cursor else None), bool(more)

    @_unavailable_on_connection_error
    async def _sweep(self, cutoff_s: float, keep: int, limit: int) -> SweepResult:
        """One script call (``lua.SWEEP``): at most ``limit`` jobs deleted (or backfilled) in one atomic step."""
        deleted, indexed, more = await self._sweep_script(args=[self._k.prefix, repr(float(cutoff_s)), str(int(keep)),
                                                                str(int(limit))])
        return SweepResult(deleted=int(deleted), indexed=int(indexed), more=bool(more))

    @_unavailable_on_connection_error
    async def _gpu_usage(self, node_id: str, gpu_indices: Sequence[int]) -> list[tuple[int, int]]:
        pipe = self._r.pipeline(transaction=False)
        for i in gpu_indices:
            pipe.hmget(self._k.gpu(node_id, i), "share_used", "mem_used")  # type: ignore[arg-type]  # stubs: keys as a list only
        rows = await pipe.execute()
        return [(int(s or 0), int(m or 0)) for s, m in rows]

    @_unavailable_on_connection_error
    async def _active_job_data(self) -> list[str | None]:
        """One script call: the active set and each member's record read in one step (one round trip)."""
        return await self._active_jobs_script(args=[self._k.prefix])

    # --- inference demand ----------------------------------------------------------------------------
    @_unavailable_on_connection_error
    async def record_demand(self, reports: Sequence[DemandReport], keep_s: float) -> list[bool]:
        """One script call (``lua.DEMAND_RECORD``) for every report."""
        if not reports:
            return []
        args: list[str] = [self._k.prefix, repr(float(keep_s)), str(DEMAND_REPORTS_MAX)]
        for r in reports:
            args += [r.job_id, repr(float(r.window_end_s)), codec.dumps(r)]
        return [bool(x) for x in await self._demand_script(args=args)]

    @_unavailable_on_connection_error
    async def demand_history(self, job_ids: Sequence[str], since_s: float) -> dict[str, list[DemandReport]]:
        if not job_ids:
            return {}
        pipe = self._r.pipeline(transaction=False)
        for j in job_ids:
            pipe.zrangebyscore(self._k.demand(j), repr(float(since_s)), "+inf")
        rows = await pipe.execute()
        return {j: [codec.loads(DemandReport, x) for x in r] for j, r in zip(job_ids, rows, strict=True) if r}

    @_unavailable_on_connection_error
    async def demand_after(self, after: Mapping[str, float]) -> dict[str, list[DemandReport]]:
        if not after:
            return {}
        ids = list(after)
        pipe = self._r.pipeline(transaction=False)
        for j in ids:
            pipe.zrangebyscore(self._k.demand(j), f"({after[j]!r}", "+inf")
        rows = await pipe.execute()
        return {j: [codec.loads(DemandReport, x) for x in r] for j, r in zip(ids, rows, strict=True) if r}

    @_unavailable_on_connection_error
    async def put_status(self, name: str, data: str) -> None:
        await self._r.set(self._k.status(name), data)

    @_unavailable_on_connection_error
    async def get_status(self, name: str) -> str | None:
        return await self._r.get(self._k.status(name))

    # --- nodes ---------------------------------------------------------------------------------------
    @_unavailable_on_connection_error
    async def put_node(self, node: NodeInfo) -> None:
        """Record an agent's report (heartbeat) and the capacity of its GPUs; usage is left alone."""
        pipe = self._r.pipeline(transaction=True)
        pipe.set(self._k.node(node.node_id), codec.dumps(node))
        pipe.sadd(self._k.nodes, node.node_id)
        for g in node.gpus:
            share_cap, mem_cap = gpu_capacity_units(g)
            key = self._k.gpu(node.node_id, g.index)
            pipe.hset(key, mapping={"share_cap": share_cap, "mem_cap": mem_cap})
            pipe.hsetnx(key, "share_used", 0)  # type: ignore[arg-type]  # redis-py encodes ints; stubs say str
            pipe.hsetnx(key, "mem_used", 0)  # type: ignore[arg-type]
        await pipe.execute()

    @_unavailable_on_connection_error
    async def get_node(self, node_id: str) -> NodeInfo:
        data = await self._r.get(self._k.node(node_id))
        if data is None:
            raise NotFound(f"node {node_id!r} not found")
        return await self._node_with_usage(codec.loads(NodeInfo, data))

    @_unavailable_on_connection_error
    async def list_nodes(self) -> list[NodeInfo]:
        """Every node with its GPUs' committed usage, read in one step by one script call (one round trip).

        Decoding is memoised by (node JSON, usage): between heartbeats a round reuses the decoded NodeInfo.
        """
        flat = await self._nodes_script(args=[self._k.prefix])
        cache, fresh, out = self._node_cache, {}, []
        for data, usage in zip(flat[::2], flat[1::2], strict=True):
            key = (data, usage)
            node = cache.get(key)
            if node is None:
                rows = [u.split(",") for u in usage.split(";")] if usage else []
                node = self._with_usage(codec.loads(NodeInfo, data), [(int(a), int(b)) for a, b in rows])
            fresh[key] = node
            out.append(node)
        self._node_cache = fresh
        return out

    @_unavailable_on_connection_error
    async def remove_node(self, node_id: str) -> None:
        data = await self._r.get(self._k.node(node_id))
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(self._k.node(node_id))
        pipe.srem(self._k.nodes, node_id)
        if data is not None:
            for g in codec.loads(NodeInfo, data).gpus:
                pipe.hset(self._k.gpu(node_id, g.index), mapping={"share_cap": 0, "mem_cap": 0})
        await pipe.execute()

    @_unavailable_on_connection_error
    async def get_desired(self, node_id: str) -> tuple[int, dict[str, Placement]]:
        pipe = self._r.pipeline(transaction=True)
        pipe.get(self._k.desired_gen(node_id))
        pipe.hgetall(self._k.desired(node_id))
        gen, table = await pipe.execute()
        return int(gen or 0), {j: codec.loads(Placement, d) for j, d in table.items()}

    # --- actual state (written by node agents) -------------------------------------------------------
    @_unavailable_on_connection_error
    async def report_workloads(self, node_id: str, applied_generation: int, workloads: Sequence[Workload]) -> None:
        """Replace the node's actual state in one MULTI/EXEC: a reader never sees half a report."""
        key = self._k.workloads(node_id)
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(key)
        if workloads:
            pipe.hset(key, mapping={w.job_id: codec.dumps(w) for w in workloads})
        pipe.set(self._k.workloads_gen(node_id), int(applied_generation))
        await pipe.execute()

    @_unavailable_on_connection_error
    async def get_workloads(self, node_id: str) -> tuple[int, dict[str, Workload]]:
        pipe = self._r.pipeline(transaction=True)
        pipe.get(self._k.workloads_gen(node_id))
        pipe.hgetall(self._k.workloads(node_id))
        gen, table = await pipe.execute()
        return int(gen or 0), {j: codec.loads(Workload, d) for j, d in table.items()}

    @_unavailable_on_connection_error
    async def get_all_workloads(self, node_ids: Sequence[str]) -> dict[str, tuple[int, dict[str, Workload]]]:
        """Every listed node's actual state in one script call (one round trip, one consistent snapshot).

        Decoding is memoised by each workload's exact JSON: agents re-report mostly unchanged workloads.
        """
        if not node_ids:
            return {}
        rows = await self._workloads_script(args=[self._k.prefix, *node_ids])
        cache, fresh, out = self._workload_cache, {}, {}
        for n, (gen, flat) in zip(node_ids, rows, strict=True):
            decoded = {}
            for j, d in zip(flat[::2], flat[1::2], strict=True):
                w = cache.get(d)
                if w is None:
                    w = codec.loads(Workload, d)
                fresh[d] = decoded[j] = w
            out[n] = (int(gen or 0), decoded)
        self._workload_cache = fresh
        return out

    # --- leadership ---------------------------------------------------------------------------------
    @_unavailable_on_connection_error
    async def acquire_leadership(self, holder: str, ttl_s: float) -> int | None:
        epoch = await self._acquire_script(keys=[self._k.leader, self._k.epoch], args=[holder, int(ttl_s * 1000)])
        return None if epoch is None else int(epoch)

    @_unavailable_on_connection_error
    async def release_leadership(self, holder: str) -> None:
        await self._release_script(keys=[self._k.leader], args=[holder])

    @_unavailable_on_connection_error
    async def current_leader(self) -> tuple[str | None, int]:
        holder, epoch = await self._r.mget(self._k.leader, self._k.epoch)
        return holder, int(epoch or 0)

    # --- events -------------------------------------------------------------------------------------
    @_unavailable_on_connection_error
    async def read_events(self, after_id: str = "0", limit: int = 100, block_s: float = 0.0) -> list[JobEvent]:
        block = int(block_s * 1000) if block_s > 0 else None
        rows = await self._r.xread({self._k.events: after_id or "0"}, count=limit, block=block)
        if not rows:
            return []
        _stream, entries = rows[0]
        return [event_from_fields(eid, fields) for eid, fields in entries]

    @_unavailable_on_connection_error
    async def last_event_id(self) -> str:
        info = await self._r.xinfo_stream(self._k.events) if await self._r.exists(self._k.events) else None
        return info["last-generated-id"] if info else "0-0"

    async def close(self) -> None:
        await self._r.aclose()
