"""Predictor configuration (``ELASTICO_*`` environment variables, validated at start-up)."""

from __future__ import annotations

from dataclasses import dataclass

from elastico.config import Settings
from elastico.errors import ConfigError


@dataclass(frozen=True)
class PredictorSettings(Settings):
    service_name: str = "predictor"
    port: int = 50052
    redis_namespace: str = "elastico"  # key namespace in Redis (observation stream)
    model_path: str = "models/interference.json"  # model artifact loaded at start-up
    max_batch_pairs: int = 10_000  # largest PredictInterference batch accepted

    def validate(self) -> None:
        super().validate()
        if self.max_batch_pairs <= 0:
            raise ConfigError(f"ELASTICO_MAX_BATCH_PAIRS={self.max_batch_pairs}: must be > 0")
