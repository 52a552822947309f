"""elastico.v1.NodeAgent over gRPC and the agent's heartbeat loop.

Thin by design: validation of the request, a call into the reconciler, protobuf conversion. The
reconcile logic lives in ``reconcile.py`` and knows nothing about gRPC.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import replace

import grpc

from elastico.domain import WORKLOAD_STATUSES, NodeInfo, Workload
from elastico.errors import InvalidSpec, NotFound, Unavailable
from elastico.limits import clip
from elastico.logging import get_logger
from elastico.rpc import convert
from elastico.state.store import Store
from elastico.v1 import node_agent_pb2 as npb
from elastico.v1 import node_agent_pb2_grpc
from services.node_agent.gpu import GpuBackend
from services.node_agent.liveness import StoreFence
from services.node_agent.reconcile import Reconciler

log = get_logger(component="node_agent")

JOB_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}(~drain)?$")  # a job id, or a moving service's drain key
MAX_FILTER_ITEMS = 1000
DEFAULT_SYNC_DEADLINE_S = 30.0


class NodeAgent:
    """State of one node: its GPU backend, its identity, its reconciler, and the heartbeat it writes."""

    def __init__(self, store: Store, backend: GpuBackend, node_id: str, address: str,
                 reconciler: Reconciler | None = None, fence: StoreFence | None = None) -> None:
        self.store = store
        self.backend = backend
        self.node_id = node_id
        self.address = address
        self.reconciler = reconciler
        self.fence = fence  # told of every successful heartbeat (the store fence)

    def snapshot(self) -> NodeInfo:
        node = NodeInfo(node_id=self.node_id, address=self.address, gpu_backend=self.backend.name,
                        gpus=tuple(self.backend.gpus()), last_heartbeat_s=time.time(), ready=True)
        return self.reconciler.apply_health(node) if self.reconciler is not None else node

    def workloads(self) -> list[Workload]:
        return self.reconciler.workloads() if self.reconciler is not None else []

    async def heartbeat(self) -> None:
        """Report GPUs (drained ones unhealthy: the store then gives them no capacity) and counters."""
        await self.store.put_node(self.snapshot())
        if self.fence is not None:
            self.fence.store_answered()

    async def heartbeat_forever(self, interval_s: float) -> None:
        """Report status every ``interval_s``; a Redis outage (or any failed beat) is logged and retried, never
        fatal: the loop must outlive a bad beat, or the node would look lost and its workloads be fenced."""
        while True:
            try:
                await self.heartbeat()
            except Unavailable as exc:
                log.warning("heartbeat failed; retrying", node_id=self.node_id, error=str(exc))
            except Exception:  # noqa: BLE001 - see above
                log.exception("heartbeat failed; retrying", node_id=self.node_id)
            await asyncio.sleep(interval_s)


def _validate_list_request(request: npb.ListWorkloadsRequest) -> None:
    for name, items in (("job_ids", request.job_ids), ("statuses", request.statuses)):
        if len(items) > MAX_FILTER_ITEMS:
            raise InvalidSpec(name, f"at most {MAX_FILTER_ITEMS} items, got {len(items)}")
    for i, job_id in enumerate(request.job_ids):
        if not JOB_ID_RE.match(job_id):
            raise InvalidSpec(f"job_ids[{i}]", "must be 1-128 characters of [A-Za-z0-9._:-] (a drain key: followed by ~drain)")
    for i, status in enumerate(request.statuses):
        if status not in WORKLOAD_STATUSES:
            raise InvalidSpec(f"statuses[{i}]", f"must be one of {', '.join(WORKLOAD_STATUSES)}, got {clip(status)!r}")


class NodeAgentServicer(node_agent_pb2_grpc.NodeAgentServicer):
    def __init__(self, agent: NodeAgent) -> None:
        self._agent = agent

    async def GetNodeStatus(self, request: npb.GetNodeStatusRequest, context: grpc.aio.ServicerContext) -> npb.GetNodeStatusResponse:
        node = self._agent.snapshot()
        reconciler = self._agent.reconciler
        if reconciler is not None:
            generation = reconciler.ledger.applied_generation
        else:
            generation, _desired = await self._agent.store.get_desired(node.node_id)
        try:
            stored = await self._agent.store.get_node(node.node_id)
            usage = {g.index: g for g in stored.gpus}
            node = replace(node, gpus=tuple(replace(g, allocated_share_pct=usage[g.index].allocated_share_pct,
                                                    allocated_mem_mib=usage[g.index].allocated_mem_mib)
                                            if g.index in usage else g for g in node.gpus))
        except NotFound:  # first heartbeat not written yet: report capacity without usage
            pass
        return npb.GetNodeStatusResponse(node=convert.node_to_pb(node), desired_generation=generation,
                                         workloads=[convert.workload_to_pb(w) for w in self._agent.workloads()])

    async def Sync(self, request: npb.SyncRequest, context: grpc.aio.ServicerContext) -> npb.SyncResponse:
        reconciler = self._agent.reconciler
        if reconciler is None:
            raise Unavailable("this agent runs without a reconciler")
        remaining = context.time_remaining()
        budget = remaining if remaining is not None else DEFAULT_SYNC_DEADLINE_S
        result = await reconciler.reconcile(min_generation=request.min_generation,
                                            deadline_s=time.monotonic() + max(0.0, budget - 0.1))
        return npb.SyncResponse(applied_generation=result.applied_generation, started=result.started,
                                stopped=result.stopped, workloads=[convert.workload_to_pb(w) for w in result.workloads])

    async def ListWorkloads(self, request: npb.ListWorkloadsRequest, context: grpc.aio.ServicerContext) -> npb.ListWorkloadsResponse:
        _validate_list_request(request)
        jobs, statuses = set(request.job_ids), set(request.statuses)
        return npb.ListWorkloadsResponse(workloads=[
            convert.workload_to_pb(w) for w in self._agent.workloads()
            if (not jobs or w.job_id in jobs) and (not statuses or w.status in statuses)])
