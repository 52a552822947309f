"""Pricer configuration (``ELASTICO_*`` environment variables, validated at start-up)."""

from __future__ import annotations

from dataclasses import dataclass

from elastico.config import Settings
from elastico.errors import ConfigError


@dataclass(frozen=True)
class PricerSettings(Settings):
    service_name: str = "pricer"
    port: int = 50051
    max_jobs: int = 200_000  # largest request accepted (jobs); bigger answers INVALID_ARGUMENT
    default_gap_tolerance: float = 0.001  # relative gap at which the solver stops when the request says 0

    def validate(self) -> None:
        super().validate()
        if self.max_jobs <= 0:
            raise ConfigError(f"ELASTICO_MAX_JOBS={self.max_jobs}: must be > 0")
        if not 0 < self.default_gap_tolerance < 1:
            raise ConfigError(f"ELASTICO_DEFAULT_GAP_TOLERANCE={self.default_gap_tolerance}: must be in (0, 1)")
