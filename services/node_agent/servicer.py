"""elastico.v1.NodeAgent over gRPC and the agent's heartbeat loop."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import grpc

from elastico.domain import NodeInfo
from elastico.errors import NotFound, NotImplementedYet, Unavailable
from elastico.logging import get_logger
from elastico.rpc import convert
from elastico.state.store import Store
from elastico.v1 import node_agent_pb2 as npb
from elastico.v1 import node_agent_pb2_grpc
from services.node_agent.gpu import GpuBackend

log = get_logger(component="node_agent")


class NodeAgent:
    """State of one node: its GPU backend, its identity, and the heartbeat it writes to the Store."""

    def __init__(self, store: Store, backend: GpuBackend, node_id: str, address: str) -> None:
        self.store = store
        self.backend = backend
        self.node_id = node_id
        self.address = address

    def snapshot(self) -> NodeInfo:
        return NodeInfo(node_id=self.node_id, address=self.address, gpu_backend=self.backend.name,
                        gpus=tuple(self.backend.gpus()), last_heartbeat_s=time.time(), ready=True)

    async def heartbeat(self) -> None:
        await self.store.put_node(self.snapshot())

    async def heartbeat_forever(self, interval_s: float) -> None:
        """Report status every ``interval_s``; a Redis outage is logged and retried, never fatal."""
        while True:
            try:
                await self.heartbeat()
            except Unavailable as exc:
                log.warning("heartbeat failed; retrying", node_id=self.node_id, error=str(exc))
            await asyncio.sleep(interval_s)


class NodeAgentServicer(node_agent_pb2_grpc.NodeAgentServicer):
    def __init__(self, agent: NodeAgent) -> None:
        self._agent = agent

    async def GetNodeStatus(self, request: npb.GetNodeStatusRequest, context: grpc.aio.ServicerContext) -> npb.GetNodeStatusResponse:
        node = self._agent.snapshot()
        generation, _desired = await self._agent.store.get_desired(node.node_id)
        try:
            stored = await self._agent.store.get_node(node.node_id)
            usage = {g.index: g for g in stored.gpus}
            node = replace(node, gpus=tuple(replace(g, allocated_share_pct=usage[g.index].allocated_share_pct,
                                                    allocated_mem_mib=usage[g.index].allocated_mem_mib)
                                            if g.index in usage else g for g in node.gpus))
        except NotFound:  # first heartbeat not written yet: report capacity without usage
            pass
        return npb.GetNodeStatusResponse(node=convert.node_to_pb(node), workloads=[], desired_generation=generation)

    async def Sync(self, request: npb.SyncRequest, context: grpc.aio.ServicerContext) -> npb.SyncResponse:
        raise NotImplementedYet("Sync: workload reconciliation is not built yet (node agent issue)")

    async def ListWorkloads(self, request: npb.ListWorkloadsRequest, context: grpc.aio.ServicerContext) -> npb.ListWorkloadsResponse:
        return npb.ListWorkloadsResponse(workloads=[])
