"""``python -m services.pricer``: the stateless shadow-price solver service."""

from __future__ import annotations

import sys

from elastico.rpc.security import Access, PeerPolicy, roles
from elastico.rpc.server import ServiceBinding, run_main
from elastico.v1 import pricer_pb2, pricer_pb2_grpc
from services.pricer.servicer import PricerServicer
from services.pricer.settings import PricerSettings


def build(settings: PricerSettings):
    async def _build():
        binding = ServiceBinding(pricer_pb2.DESCRIPTOR.services_by_name["Pricer"].full_name,
                                 PricerServicer(settings), pricer_pb2_grpc.add_PricerServicer_to_server,
                                 Access(PeerPolicy(roles("allocator", "operator"))))
        return [binding], None

    return _build


if __name__ == "__main__":
    sys.exit(run_main(PricerSettings.from_env, build))
