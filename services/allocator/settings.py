"""Allocator configuration (``ELASTICO_*`` environment variables, validated at start-up)."""

from __future__ import annotations

from dataclasses import dataclass

from elastico.config import Settings
from elastico.errors import ConfigError


@dataclass(frozen=True)
class AllocatorSettings(Settings):
    service_name: str = "allocator"
    port: int = 50050
    redis_namespace: str = "elastico"  # key namespace in Redis; lets clusters share one Redis
    pricer_address: str = ""  # host:port of the pricer; "" = not configured
    predictor_address: str = ""  # host:port of the predictor; "" = not configured
    node_stale_s: float = 15.0  # a node whose heartbeat is older than this is shown not ready
    watch_poll_s: float = 1.0  # how long WatchJobs blocks on the event stream per poll

    def validate(self) -> None:
        super().validate()
        self.require_redis()
        if self.node_stale_s <= 0:
            raise ConfigError(f"ELASTICO_NODE_STALE_S={self.node_stale_s}: must be > 0")
        if not 0 < self.watch_poll_s <= 4:
            raise ConfigError(f"ELASTICO_WATCH_POLL_S={self.watch_poll_s}: must be in (0, 4]")
