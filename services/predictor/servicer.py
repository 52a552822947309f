"""elastico.v1.Predictor over gRPC (filled in by the predictor issue)."""

from __future__ import annotations

import grpc

from elastico.errors import NotImplementedYet
from elastico.v1 import predictor_pb2 as prpb
from elastico.v1 import predictor_pb2_grpc
from services.predictor.settings import PredictorSettings


class PredictorServicer(predictor_pb2_grpc.PredictorServicer):
    def __init__(self, settings: PredictorSettings) -> None:
        self._settings = settings

    async def PredictInterference(self, request: prpb.PredictInterferenceRequest, context: grpc.aio.ServicerContext) -> prpb.PredictInterferenceResponse:
        raise NotImplementedYet("PredictInterference is not served by this build yet")

    async def ReportObservation(self, request: prpb.ReportObservationRequest, context: grpc.aio.ServicerContext) -> prpb.ReportObservationResponse:
        raise NotImplementedYet("ReportObservation is not served by this build yet")

    async def GetModelInfo(self, request: prpb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> prpb.GetModelInfoResponse:
        raise NotImplementedYet("GetModelInfo is not served by this build yet")
