"""Predictor configuration (``ELASTICO_*`` environment variables, validated at start-up)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from elastico.config import Settings
from elastico.errors import ConfigError
from services.predictor.model import DEFAULT_MODEL_PATH

REFRESHED_MODEL_FILE = "interference.json"  # name of the refreshed model in the state dir


@dataclass(frozen=True)
class PredictorSettings(Settings):
    service_name: str = "predictor"
    port: int = 50052
    max_request_mib: float = 16.0  # 10,000 observations x ~1.1 kB at most
    redis_namespace: str = "elastico"  # key namespace in Redis (observation stream)
    model_path: str = str(DEFAULT_MODEL_PATH)  # shipped artifact: read only; trained in memory when absent or unusable
    # where retrained models are written (atomically, mode 0600) and read back at start-up; never model_path.
    # "" = <state dir>/interference.json
    refreshed_model_path: str = ""
    # the predictor's own state; "" = <ELASTICO_RUN_DIR>/predictor when a local cluster sets ELASTICO_RUN_DIR,
    # else $XDG_STATE_HOME/elastico/predictor (root: /var/lib/elastico/predictor), as the node agent's state dir
    state_dir: str = ""
    run_dir: str = ""  # the local cluster's run directory (devtools' ELASTICO_RUN_DIR); only picks the state dir
    max_batch_pairs: int = 10_000  # largest PredictInterference batch accepted
    refresh_interval_s: float = 300.0  # how often to check for new observations and retrain; 0 = never
    refresh_min_observations: int = 20  # new observations needed before a periodic retrain
    observation_max_age_s: float = 3600.0  # oldest time_unix_s accepted (agents report as they measure)
    observation_max_future_s: float = 300.0  # clock skew allowed ahead of the predictor's clock
    seed: int = 0  # training seed (deterministic retraining)

    @property
    def effective_state_dir(self) -> Path:
        if self.state_dir:
            return Path(self.state_dir).resolve()
        if self.run_dir:
            return Path(self.run_dir).resolve() / "predictor"
        fallback = "/var/lib" if os.getuid() == 0 else str(Path.home() / ".local" / "state")
        return Path(os.environ.get("XDG_STATE_HOME") or fallback) / "elastico" / "predictor"

    @property
    def effective_refreshed_model_path(self) -> Path:
        if self.refreshed_model_path:
            return Path(self.refreshed_model_path).resolve()
        return self.effective_state_dir / REFRESHED_MODEL_FILE

    def validate(self) -> None:
        super().validate()
        if self.max_batch_pairs <= 0:
            raise ConfigError(f"ELASTICO_MAX_BATCH_PAIRS={self.max_batch_pairs}: must be > 0")
        if self.refresh_interval_s < 0:
            raise ConfigError(f"ELASTICO_REFRESH_INTERVAL_S={self.refresh_interval_s}: must be >= 0")
        if self.refresh_min_observations < 1:
            raise ConfigError(f"ELASTICO_REFRESH_MIN_OBSERVATIONS={self.refresh_min_observations}: must be >= 1")
        if not 0 < self.observation_max_age_s <= 30 * 86400:
            raise ConfigError(f"ELASTICO_OBSERVATION_MAX_AGE_S={self.observation_max_age_s}: must be in (0, 2592000]")
        if not 0 <= self.observation_max_future_s <= 86400:
            raise ConfigError(f"ELASTICO_OBSERVATION_MAX_FUTURE_S={self.observation_max_future_s}: must be in [0, 86400]")
        # the shipped model is input: a retrain must never overwrite it
        if self.effective_refreshed_model_path == Path(self.model_path).resolve():
            raise ConfigError(f"ELASTICO_REFRESHED_MODEL_PATH={str(self.effective_refreshed_model_path)!r}: must differ "
                              f"from ELASTICO_MODEL_PATH (the shipped model is never overwritten)")
