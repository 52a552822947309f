"""In-process ``Store``: the same semantics as Redis, for unit tests, the simulator and single-process runs.

Not durable and not shared between processes: a production deployment uses ``RedisStore``.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Callable, Mapping, Sequence
from typing import cast

from elastico.domain import DemandReport, NodeInfo, Placement, Workload
from elastico.errors import Conflict, NotFound, ResourceExhausted, StaleEpoch
from elastico.state import codec
from elastico.state.store import (
    DEMAND_REPORTS_MAX,
    JobEvent,
    StoreBase,
    event_from_fields,
    gpu_capacity_units,
    tenant_limit_message,
)
from elastico.state.transaction import DuplicateRequest, SweepResult, Transaction

_TERMINAL = ("succeeded", "failed", "cancelled")


class MemoryStore(StoreBase):
    """Dictionary-backed store; ``_apply`` runs each transaction under one lock, check-then-write."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = asyncio.Lock()
        self._clock = clock
        self._jobs: dict[str, tuple[int, str, str]] = {}  # job_id -> (version, state, data)
        self._active: set[str] = set()  # ids of non-terminal jobs
        self._status: dict[str, str] = {}
        self._demand: dict[str, dict[float, str]] = {}  # job_id -> window end -> DemandReport JSON
        self._index: dict[str, int] = {}  # job_id -> submission sequence
        self._meta: dict[str, tuple[str, str]] = {}  # job_id -> (tenant, request_id), recorded at creation
        self._finished: dict[str, float] = {}  # terminal job_id -> when it finished (unix s): retention order
        self._seq = 0
        self._requests: dict[str, str] = {}
        self._gpu_caps: dict[tuple[str, int], tuple[int, int]] = {}
        self._gpu_used: dict[tuple[str, int], list[int]] = {}
        self._nodes: dict[str, str] = {}
        self._desired: dict[str, dict[str, str]] = {}
        self._desired_gen: dict[str, int] = {}
        self._workloads: dict[str, tuple[int, dict[str, str]]] = {}  # node_id -> (applied gen, job_id -> JSON)
        self._leader: tuple[str, float] | None = None  # (holder, expires at monotonic s)
        self._epoch = 0
        self._events: list[tuple[int, dict[str, str]]] = []
        self._event_cond = asyncio.Condition(self._lock)

    async def _apply(self, tx: Transaction) -> None:
        async with self._lock:
            if tx.epoch is not None and tx.epoch != self._epoch:
                raise StaleEpoch(f"epoch {tx.epoch} is stale (current {self._epoch})")
            if tx.claim_request and tx.claim_request[0] in self._requests:
                raise DuplicateRequest(self._requests[tx.claim_request[0]])
            for w in tx.jobs:
                current = self._jobs.get(w.job_id)
                version = current[0] if current else 0
                if version != w.expected_version:
                    raise Conflict(f"job {w.job_id} is at version {version}, expected {w.expected_version}")
                if w.live_limit > 0:
                    live = sum(1 for j in self._active if self._meta.get(j, ("",))[0] == w.tenant)
                    if live >= w.live_limit:
                        raise ResourceExhausted(tenant_limit_message(w.tenant, live))
            pending: dict[tuple[str, int], list[int]] = {}
            for d in tx.gpus:
                key = (d.node_id, d.gpu_index)
                if key not in self._gpu_caps:
                    raise Conflict(f"unknown GPU {d.node_id}:{d.gpu_index}")
                used = pending.setdefault(key, list(self._gpu_used[key]))
                used[0] += d.share_units
                used[1] += d.mem_mib
                cap = self._gpu_caps[key]
                if (d.share_units > 0 and used[0] > cap[0]) or (d.mem_mib > 0 and used[1] > cap[1]):
                    raise Conflict(f"GPU {d.node_id}:{d.gpu_index} lacks capacity")
            # all checks passed: write
            if tx.claim_request:
                self._requests[tx.claim_request[0]] = tx.claim_request[1]
            for w in tx.jobs:
                old = self._jobs.get(w.job_id)
                self._jobs[w.job_id] = (w.new_version, w.state, w.data)
                if w.index_score is not None or w.index_seq:
                    if w.index_score is not None:
                        self._index[w.job_id] = w.index_score
                    else:
                        self._seq += 1
                        self._index[w.job_id] = self._seq
                    self._meta[w.job_id] = (w.tenant, w.request_id)
                if w.state in _TERMINAL:
                    self._active.discard(w.job_id)
                    if w.job_id in self._meta and (old is None or old[1] != w.state):
                        self._finished[w.job_id] = w.time_s
                else:
                    self._active.add(w.job_id)
            for key, used in pending.items():
                self._gpu_used[key] = [max(0, used[0]), max(0, used[1])]
            for op in tx.desired:
                table = self._desired.setdefault(op.node_id, {})
                if op.data is None:
                    table.pop(op.job_id, None)
                else:
                    table[op.job_id] = op.data
                self._desired_gen[op.node_id] = self._desired_gen.get(op.node_id, 0) + 1
            for e in tx.events:
                self._events.append((len(self._events) + 1, {
                    "job_id": e.job_id, "state": e.state, "reason": e.reason, "message": e.message,
                    "version": str(e.version), "time_s": repr(e.time_s)}))
            if tx.events:
                self._event_cond.notify_all()

    async def _get_job_data(self, job_id: str) -> str | None:
        entry = self._jobs.get(job_id)
        return entry[2] if entry else None

    async def _active_job_data(self) -> list[str | None]:
        return [self._jobs[j][2] for j in self._active if j in self._jobs]

    async def record_demand(self, reports: Sequence[DemandReport], keep_s: float) -> list[bool]:
        """As ``lua.DEMAND_RECORD`` (minus the key expiry)."""
        out = []
        async with self._lock:
            for r in reports:
                hist = self._demand.setdefault(r.job_id, {})
                if r.window_end_s in hist or (hist and r.window_end_s < max(hist) - keep_s):
                    out.append(False)
                    continue
                hist[r.window_end_s] = codec.dumps(r)
                top = max(hist)
                for t in sorted(hist)[:max(0, len(hist) - DEMAND_REPORTS_MAX)] + [t for t in hist if t < top - keep_s]:
                    hist.pop(t, None)
                out.append(True)
        return out

    async def demand_history(self, job_ids: Sequence[str], since_s: float) -> dict[str, list[DemandReport]]:
        out = {}
        for j in job_ids:
            rows = [codec.loads(DemandReport, d) for t, d in sorted(self._demand.get(j, {}).items()) if t >= since_s]
            if rows:
                out[j] = rows
        return out

    async def demand_after(self, after: Mapping[str, float]) -> dict[str, list[DemandReport]]:
        out = {}
        for j, t0 in after.items():
            rows = [codec.loads(DemandReport, d) for t, d in sorted(self._demand.get(j, {}).items()) if t > t0]
            if rows:
                out[j] = rows
        return out

    async def put_status(self, name: str, data: str) -> None:
        self._status[name] = data

    async def get_status(self, name: str) -> str | None:
        return self._status.get(name)

    async def _request_owner(self, request_id: str) -> str | None:
        return self._requests.get(request_id)

    async def _list_page(self, states: tuple[str, ...], tenant: str, before: int | None,
                         want: int) -> tuple[list[tuple[int, str]], int | None, bool] | None:
        """As ``lua.LIST_JOBS`` (the candidates here: every indexed job matching now, which is what the Redis
        indexes yield once their stale entries are skipped). O(jobs) per page: a memory store holds few."""
        wanted = set(states)
        top = heapq.nlargest(want + 1, (
            (seq, j) for j, seq in self._index.items()
            if (before is None or seq < before) and (not wanted or self._jobs[j][1] in wanted)
            and (not tenant or self._meta.get(j, ("", ""))[0] == tenant)))
        rows = [(seq, self._jobs[j][2]) for seq, j in top[:want]]
        return rows, (rows[-1][0] if rows else None), len(top) > want

    async def _sweep(self, cutoff_s: float, keep: int, limit: int) -> SweepResult:
        """As ``lua.SWEEP`` (nothing to backfill: a memory store starts empty, indexed)."""
        async with self._lock:
            excess = len(self._finished) - keep
            oldest = heapq.nsmallest(limit, ((t, j) for j, t in self._finished.items()))
            deleted = taken = 0
            for t, job_id in oldest:
                if not (taken < excess or t < cutoff_s):
                    break
                taken += 1
                del self._finished[job_id]
                entry = self._jobs.get(job_id)
                if entry is not None and entry[1] not in _TERMINAL:
                    continue  # back in a non-terminal state: never deleted
                self._jobs.pop(job_id, None)
                self._index.pop(job_id, None)
                _, request_id = self._meta.pop(job_id, ("", ""))
                if request_id and self._requests.get(request_id) == job_id:
                    del self._requests[request_id]
                deleted += 1
            return SweepResult(deleted=deleted, more=taken == limit)

    async def _gpu_usage(self, node_id: str, gpu_indices: Sequence[int]) -> list[tuple[int, int]]:
        return [cast("tuple[int, int]", tuple(self._gpu_used.get((node_id, i), (0, 0)))) for i in gpu_indices]

    # --- nodes ---------------------------------------------------------------------------------------
    async def put_node(self, node: NodeInfo) -> None:
        async with self._lock:
            self._nodes[node.node_id] = codec.dumps(node)
            for g in node.gpus:
                key = (node.node_id, g.index)
                self._gpu_caps[key] = gpu_capacity_units(g)
                self._gpu_used.setdefault(key, [0, 0])

    async def get_node(self, node_id: str) -> NodeInfo:
        data = self._nodes.get(node_id)
        if data is None:
            raise NotFound(f"node {node_id!r} not found")
        return await self._node_with_usage(codec.loads(NodeInfo, data))

    async def list_nodes(self) -> list[NodeInfo]:
        return [await self.get_node(n) for n in sorted(self._nodes)]

    async def remove_node(self, node_id: str) -> None:
        async with self._lock:
            data = self._nodes.pop(node_id, None)
            if data is not None:
                for g in codec.loads(NodeInfo, data).gpus:
                    self._gpu_caps.pop((node_id, g.index), None)

    async def get_desired(self, node_id: str) -> tuple[int, dict[str, Placement]]:
        table = self._desired.get(node_id, {})
        return self._desired_gen.get(node_id, 0), {j: codec.loads(Placement, d) for j, d in table.items()}

    async def report_workloads(self, node_id: str, applied_generation: int, workloads: Sequence[Workload]) -> None:
        async with self._lock:
            self._workloads[node_id] = (int(applied_generation), {w.job_id: codec.dumps(w) for w in workloads})

    async def get_workloads(self, node_id: str) -> tuple[int, dict[str, Workload]]:
        gen, table = self._workloads.get(node_id, (0, {}))
        return gen, {j: codec.loads(Workload, d) for j, d in table.items()}

    async def get_all_workloads(self, node_ids: Sequence[str]) -> dict[str, tuple[int, dict[str, Workload]]]:
        return {n: await self.get_workloads(n) for n in node_ids}  # no await point inside: one consistent step

    # --- leadership ---------------------------------------------------------------------------------
    async def acquire_leadership(self, holder: str, ttl_s: float) -> int | None:
        async with self._lock:
            now = self._clock()
            if self._leader is not None and self._leader[1] > now and self._leader[0] != holder:
                return None
            if self._leader is None or self._leader[0] != holder or self._leader[1] <= now:
                self._epoch += 1
            self._leader = (holder, now + ttl_s)
            return self._epoch

    async def release_leadership(self, holder: str) -> None:
        async with self._lock:
            if self._leader is not None and self._leader[0] == holder:
                self._leader = None

    async def current_leader(self) -> tuple[str | None, int]:
        if self._leader is not None and self._leader[1] > self._clock():
            return self._leader[0], self._epoch
        return None, self._epoch

    # --- events -------------------------------------------------------------------------------------
    async def read_events(self, after_id: str = "0", limit: int = 100, block_s: float = 0.0) -> list[JobEvent]:
        after = int(after_id.split("-")[0]) if after_id else 0
        async with self._lock:
            if len(self._events) <= after and block_s > 0:
                try:
                    async with asyncio.timeout(block_s):
                        await self._event_cond.wait_for(lambda: len(self._events) > after)
                except TimeoutError:
                    return []
            return [event_from_fields(f"{n}-0", f) for n, f in self._events[after:after + limit]]

    async def last_event_id(self) -> str:
        return f"{len(self._events)}-0"

    async def close(self) -> None:
        return None
