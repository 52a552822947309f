"""Node agent configuration (``ELASTICO_*`` environment variables, validated at start-up)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from elastico.config import Settings
from elastico.errors import ConfigError

GPU_BACKENDS = ("simulated", "nvml", "auto")


@dataclass(frozen=True)
class NodeAgentSettings(Settings):
    service_name: str = "node_agent"
    port: int = 50060
    redis_namespace: str = "elastico"  # key namespace in Redis
    node_id: str = ""  # unique node name; "" = the host name
    advertise_address: str = ""  # host:port the allocator uses to reach this agent; "" = host:bound port
    gpu_backend: str = "auto"  # simulated, nvml, or auto (nvml, else simulated with a loud warning)
    sim_gpu_type: str = "v100"  # simulated backend: GPU type of every GPU
    sim_gpu_count: int = 4  # simulated backend: GPUs on this node
    sim_gpu_mem_mib: int = 16384  # simulated backend: memory of each GPU, MiB
    heartbeat_interval_s: float = 2.0  # how often node status and counters go to Redis

    def validate(self) -> None:
        super().validate()
        self.require_redis()
        if self.gpu_backend not in GPU_BACKENDS:
            raise ConfigError(f"ELASTICO_GPU_BACKEND={self.gpu_backend!r}: must be one of {', '.join(GPU_BACKENDS)}")
        if not 1 <= self.sim_gpu_count <= 64:
            raise ConfigError(f"ELASTICO_SIM_GPU_COUNT={self.sim_gpu_count}: must be in [1, 64]")
        if self.sim_gpu_mem_mib <= 0:
            raise ConfigError(f"ELASTICO_SIM_GPU_MEM_MIB={self.sim_gpu_mem_mib}: must be > 0")
        if not 0.05 <= self.heartbeat_interval_s <= 60:
            raise ConfigError(f"ELASTICO_HEARTBEAT_INTERVAL_S={self.heartbeat_interval_s}: must be in [0.05, 60]")

    @property
    def effective_node_id(self) -> str:
        return self.node_id or socket.gethostname()
