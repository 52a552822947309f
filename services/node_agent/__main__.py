"""``python -m services.node_agent``: one agent per node."""

from __future__ import annotations

import asyncio
import contextlib
import sys

from elastico.rpc.server import ServiceBinding, run_main
from elastico.state.redis_store import RedisStore
from elastico.v1 import node_agent_pb2, node_agent_pb2_grpc
from services.node_agent.gpu import make_backend
from services.node_agent.servicer import NodeAgent, NodeAgentServicer
from services.node_agent.settings import NodeAgentSettings


def build(settings: NodeAgentSettings):
    async def _build():
        node_id = settings.effective_node_id
        backend = make_backend(settings.gpu_backend, node_id, settings.sim_gpu_type, settings.sim_gpu_count, settings.sim_gpu_mem_mib)
        store = RedisStore.from_url(settings.redis_url, namespace=settings.redis_namespace)
        await store.ping()
        address = settings.advertise_address or f"{settings.host}:{settings.port}"
        agent = NodeAgent(store, backend, node_id, address)
        await agent.heartbeat()  # register before serving, so the allocator sees the GPUs at once
        task = asyncio.create_task(agent.heartbeat_forever(settings.heartbeat_interval_s))

        async def cleanup() -> None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            backend.close()
            await store.close()

        binding = ServiceBinding(node_agent_pb2.DESCRIPTOR.services_by_name["NodeAgent"].full_name,
                                 NodeAgentServicer(agent), node_agent_pb2_grpc.add_NodeAgentServicer_to_server)
        return [binding], cleanup

    return _build


if __name__ == "__main__":
    sys.exit(run_main(NodeAgentSettings.from_env, build))
