"""The invariant sampler: from the first phase to the last, no GPU oversubscribed and no job running twice.

Every ``every_s`` it reads each GPU's committed usage from the store (the admin Redis user) and what each agent's
``ListWorkloads`` says runs; a GPU whose share exceeds 100 % or whose memory exceeds its capacity counts as
oversubscribed, and a job under two placements (or twice on one node) as running twice.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from bench.reliability.live import NAMESPACE, Run
from elastico.state.redis_store import RedisStore
from elastico.v1 import node_agent_pb2 as npb
from elastico.v1 import node_agent_pb2_grpc


@dataclass
class SamplerCounts:
    samples: int = 0
    gpu_samples: int = 0
    oversubscribed_committed: int = 0  # GPU-samples: the store's committed share > 100 % or memory > capacity
    oversubscribed_running: int = 0  # GPU-samples: the running workloads' share > 100 % or memory > capacity
    running_twice: int = 0  # job-samples: a job under two placements at once, or twice on one node
    store_unreachable: int = 0
    agent_unreachable: int = 0
    max_share_seen: float = 0.0
    details: list[str] = field(default_factory=list)

    @property
    def oversubscribed(self) -> int:
        return self.oversubscribed_committed + self.oversubscribed_running


class Sampler(threading.Thread):
    """Every ``every_s``: the committed usage of every GPU (the store, as the admin user) and what every agent
    runs (``ListWorkloads`` starting/running); counts the invariant violations in ``counts``."""

    def __init__(self, run: Run, every_s: float = 0.3) -> None:
        super().__init__(daemon=True, name="sampler")
        self.run_, self.every_s = run, every_s
        self.counts = SamplerCounts()
        self._halt = threading.Event()

    def stop(self) -> SamplerCounts:
        self._halt.set()
        self.join(timeout=10)
        return self.counts

    def run(self) -> None:
        asyncio.run(self._loop())

    def _violation(self, text: str) -> None:
        if len(self.counts.details) < 20:
            self.counts.details.append(text)

    async def _loop(self) -> None:
        store = RedisStore.from_url(self.run_.admin_url, namespace=NAMESPACE, timeout_s=2.0)
        tls = self.run_.cert_only()
        chans = {n: tls.aio_channel(a) for n, a in self.run_.agents.items()}
        stubs = {n: node_agent_pb2_grpc.NodeAgentStub(c) for n, c in chans.items()}
        capacity: dict[tuple[str, int], int] = {}  # (node, gpu) -> memory MiB, from the last good store read
        c = self.counts
        try:
            while not self._halt.is_set():
                t0 = time.monotonic()
                await self._sample(store, stubs, capacity, c)
                await asyncio.sleep(max(0.0, self.every_s - (time.monotonic() - t0)))
        finally:
            for ch in chans.values():
                await ch.close()
            await store.close()

    async def _sample(self, store, stubs, capacity, c: SamplerCounts) -> None:
        c.samples += 1
        try:
            nodes = await store.list_nodes()
        except Exception:  # noqa: BLE001 - Redis down (a fault on purpose): no committed reading this time
            c.store_unreachable += 1
            nodes = []
        for n in nodes:
            for g in n.gpus:
                capacity[(n.node_id, g.index)] = g.mem_total_mib
                c.gpu_samples += 1
                c.max_share_seen = max(c.max_share_seen, g.allocated_share_pct)
                if g.allocated_share_pct > 100.0 + 1e-6 or g.allocated_mem_mib > g.mem_total_mib:
                    c.oversubscribed_committed += 1
                    self._violation(f"committed {n.node_id}:{g.index} {g.allocated_share_pct}% "
                                    f"{g.allocated_mem_mib}/{g.mem_total_mib} MiB")
        placements: dict[str, set[str]] = {}
        for name, stub in stubs.items():
            try:
                resp = await stub.ListWorkloads(npb.ListWorkloadsRequest(statuses=["starting", "running"]), timeout=2)
            except grpc.RpcError:
                c.agent_unreachable += 1  # an agent being restarted
                continue
            share: dict[int, float] = {}
            mem: dict[int, int] = {}
            seen: Counter[str] = Counter()
            for w in resp.workloads:
                seen[w.job_id] += 1
                placements.setdefault(w.job_id, set()).add(w.placement_id)
                for gi in w.gpu_indices:
                    share[gi] = share.get(gi, 0.0) + w.compute_share_pct
                    mem[gi] = mem.get(gi, 0) + w.mem_mib
            for gi in share:
                cap = capacity.get((name, gi))
                if share[gi] > 100.0 + 1e-6 or (cap is not None and mem[gi] > cap):
                    c.oversubscribed_running += 1
                    self._violation(f"running on {name}:{gi}: {share[gi]}% {mem[gi]}/{cap} MiB")
            for job_id, k in seen.items():
                if k > 1:
                    c.running_twice += 1
                    self._violation(f"job {job_id} runs {k} times on {name}")
        for job_id, pids in placements.items():
            if len(pids) > 1:
                c.running_twice += 1
                self._violation(f"job {job_id} runs under placements {sorted(pids)}")
