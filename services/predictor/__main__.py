"""``python -m services.predictor``: the interference model service."""

from __future__ import annotations

import sys

from elastico.rpc.server import ServiceBinding, run_main
from elastico.v1 import predictor_pb2, predictor_pb2_grpc
from services.predictor.servicer import PredictorServicer
from services.predictor.settings import PredictorSettings


def build(settings: PredictorSettings):
    async def _build():
        binding = ServiceBinding(predictor_pb2.DESCRIPTOR.services_by_name["Predictor"].full_name,
                                 PredictorServicer(settings), predictor_pb2_grpc.add_PredictorServicer_to_server)
        return [binding], None

    return _build


if __name__ == "__main__":
    sys.exit(run_main(PredictorSettings.from_env, build))
