"""``python -m services.allocator``: the allocator service."""

from __future__ import annotations

import sys

from elastico.rpc.server import ServiceBinding, run_main
from elastico.state.redis_store import RedisStore
from elastico.v1 import allocator_pb2, allocator_pb2_grpc
from services.allocator.servicer import AllocatorServicer
from services.allocator.settings import AllocatorSettings


def build(settings: AllocatorSettings):
    async def _build():
        store = RedisStore.from_url(settings.redis_url, namespace=settings.redis_namespace)
        await store.ping()  # fail fast on a wrong URL instead of on the first call
        binding = ServiceBinding(allocator_pb2.DESCRIPTOR.services_by_name["Allocator"].full_name,
                                 AllocatorServicer(store, settings), allocator_pb2_grpc.add_AllocatorServicer_to_server)
        return [binding], store.close

    return _build


if __name__ == "__main__":
    sys.exit(run_main(AllocatorSettings.from_env, build))
