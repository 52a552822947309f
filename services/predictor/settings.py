"""Predictor configuration (``ELASTICO_*`` environment variables, validated at start-up)."""

from __future__ import annotations

from dataclasses import dataclass

from elastico.config import Settings
from elastico.errors import ConfigError
from services.predictor.model import DEFAULT_MODEL_PATH


@dataclass(frozen=True)
class PredictorSettings(Settings):
    service_name: str = "predictor"
    port: int = 50052
    max_request_mib: float = 16.0  # 10,000 observations x ~1.1 kB at most
    redis_namespace: str = "elastico"  # key namespace in Redis (observation stream)
    model_path: str = str(DEFAULT_MODEL_PATH)  # artifact loaded at start-up; trained and written here if absent
    max_batch_pairs: int = 10_000  # largest PredictInterference batch accepted
    refresh_interval_s: float = 300.0  # how often to check for new observations and retrain; 0 = never
    refresh_min_observations: int = 20  # new observations needed before a periodic retrain
    seed: int = 0  # training seed (deterministic retraining)

    def validate(self) -> None:
        super().validate()
        if self.max_batch_pairs <= 0:
            raise ConfigError(f"ELASTICO_MAX_BATCH_PAIRS={self.max_batch_pairs}: must be > 0")
        if self.refresh_interval_s < 0:
            raise ConfigError(f"ELASTICO_REFRESH_INTERVAL_S={self.refresh_interval_s}: must be >= 0")
        if self.refresh_min_observations < 1:
            raise ConfigError(f"ELASTICO_REFRESH_MIN_OBSERVATIONS={self.refresh_min_observations}: must be >= 1")
