"""Pricer configuration (``ELASTICO_*`` environment variables, validated at start-up)."""

from __future__ import annotations

from dataclasses import dataclass

from elastico import limits
from elastico.config import Settings
from elastico.errors import ConfigError


@dataclass(frozen=True)
class PricerSettings(Settings):
    service_name: str = "pricer"
    port: int = 50051
    max_request_mib: float = 32.0  # 100k jobs x 8 shapes x 2 pools is ~25 MB; memory is bounded by max_cells
    max_jobs: int = limits.PRICER_MAX_JOBS  # largest request accepted (jobs); bigger answers INVALID_ARGUMENT
    max_cells: int = limits.PRICER_MAX_CELLS  # largest padded problem: jobs x longest shape list x pools (float64 cells)
    default_gap_tolerance: float = 0.001  # relative gap at which the solver stops when the request says 0
    # requests converted and solved at once; more wait their turn (within their deadline). One request at the
    # cell limit holds ~800 MB while it is solved, so this bounds the pricer's memory
    max_concurrent: int = 2

    def validate(self) -> None:
        super().validate()
        if self.max_jobs <= 0:
            raise ConfigError(f"ELASTICO_MAX_JOBS={self.max_jobs}: must be > 0")
        if self.max_cells <= 0:
            raise ConfigError(f"ELASTICO_MAX_CELLS={self.max_cells}: must be > 0")
        if not 1 <= self.max_concurrent <= 64:
            raise ConfigError(f"ELASTICO_MAX_CONCURRENT={self.max_concurrent}: must be in [1, 64]")
        if not 0 < self.default_gap_tolerance < 1:
            raise ConfigError(f"ELASTICO_DEFAULT_GAP_TOLERANCE={self.default_gap_tolerance}: must be in (0, 1)")
