"""elastico.v1.Pricer over gRPC (filled in by the pricer issue)."""

from __future__ import annotations

import grpc

from elastico.errors import NotImplementedYet
from elastico.v1 import pricer_pb2 as ppb
from elastico.v1 import pricer_pb2_grpc
from services.pricer.settings import PricerSettings


class PricerServicer(pricer_pb2_grpc.PricerServicer):
    def __init__(self, settings: PricerSettings) -> None:
        self._settings = settings

    async def ComputeAllocation(self, request: ppb.ComputeAllocationRequest, context: grpc.aio.ServicerContext) -> ppb.ComputeAllocationResponse:
        raise NotImplementedYet("ComputeAllocation is not served by this build yet")
