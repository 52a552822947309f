"""A leading allocator for integration tests: the job API over gRPC (insecure, a free port) and scheduling rounds."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from elastico.rpc.server import ServiceBinding, create_server
from elastico.v1 import allocator_pb2_grpc
from services.allocator.leader import LeaderLease
from services.allocator.rounds import Scheduler
from services.allocator.servicer import AllocatorServicer
from services.allocator.settings import AllocatorSettings


@dataclass
class LeadingAllocator:
    lease: LeaderLease
    scheduler: Scheduler
    port: int


@contextlib.asynccontextmanager
async def leading_allocator(store, settings: AllocatorSettings, holder: str) -> AsyncIterator[LeadingAllocator]:
    """Rounds run as leader ``holder`` on ``store``; the Allocator API answers on ``127.0.0.1:<port>``."""
    lease = LeaderLease(store, holder, ttl_s=30)
    scheduler = Scheduler(store, settings, lease)
    lease.start()
    scheduler.start()
    server, port = await create_server(settings, [ServiceBinding(
        "elastico.v1.Allocator", AllocatorServicer(store, settings, on_change=scheduler.wake),
        allocator_pb2_grpc.add_AllocatorServicer_to_server)])
    await server.start()
    try:
        yield LeadingAllocator(lease, scheduler, port)
    finally:
        await server.stop(0)
        await scheduler.close()
        await lease.stop()
