"""Node agent configuration (``ELASTICO_*`` environment variables, validated at start-up)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from elastico.config import Settings
from elastico.errors import ConfigError

GPU_BACKENDS = ("simulated", "nvml", "auto")
MPS_MODES = ("auto", "real", "simulated", "off")


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
    sim_time_scale: float = 1.0  # simulated backend: simulated seconds per wall second (trace replays); 1 = real time
    heartbeat_interval_s: float = 2.0  # how often node status and counters go to Redis
    state_dir: str = ""  # ledger, workload logs and MPS pipes; "" = $XDG_STATE_HOME/elastico/<node_id>
    reconcile_interval_s: float = 2.0  # desired-state poll period (a Sync call reconciles at once)
    stop_grace_s: float = 10.0  # SIGTERM -> SIGKILL delay when stopping a workload
    mps: str = "auto"  # auto (real MPS on NVML GPUs, simulated on simulated GPUs), real, simulated, off
    mps_pipe_dir: str = ""  # CUDA_MPS_PIPE_DIRECTORY; "" = <state_dir>/mps/pipe
    mps_log_dir: str = ""  # CUDA_MPS_LOG_DIRECTORY; "" = <state_dir>/mps/log
    mps_control_bin: str = "nvidia-cuda-mps-control"  # control daemon binary (PATH lookup)
    mps_control_timeout_s: float = 5.0  # a control command taking longer means the daemon is stuck
    mps_fault_holddown_s: float = 5.0  # a GPU stays drained this long after its faulted clients are gone
    predictor_address: str = ""  # host:port of the predictor for ReportObservation; "" = do not report
    predictor_timeout_s: float = 2.0  # deadline of each ReportObservation call
    observation_interval_s: float = 30.0  # at most one observation per co-located pair per interval
    stop_workloads_on_exit: bool = False  # SIGTERM also stops workloads and MPS (local clusters); default: leave them running

    def validate(self) -> None:
        super().validate()
        self.require_redis()
        if self.gpu_backend not in GPU_BACKENDS:
            raise ConfigError(f"ELASTICO_GPU_BACKEND={self.gpu_backend!r}: must be one of {', '.join(GPU_BACKENDS)}")
        if not 1 <= self.sim_gpu_count <= 64:
            raise ConfigError(f"ELASTICO_SIM_GPU_COUNT={self.sim_gpu_count}: must be in [1, 64]")
        if not 0 < self.sim_time_scale <= 1e6:
            raise ConfigError(f"ELASTICO_SIM_TIME_SCALE={self.sim_time_scale}: must be in (0, 1e6]")
        if self.sim_gpu_mem_mib <= 0:
            raise ConfigError(f"ELASTICO_SIM_GPU_MEM_MIB={self.sim_gpu_mem_mib}: must be > 0")
        if not 0.05 <= self.heartbeat_interval_s <= 60:
            raise ConfigError(f"ELASTICO_HEARTBEAT_INTERVAL_S={self.heartbeat_interval_s}: must be in [0.05, 60]")
        if not 0.05 <= self.reconcile_interval_s <= 300:
            raise ConfigError(f"ELASTICO_RECONCILE_INTERVAL_S={self.reconcile_interval_s}: must be in [0.05, 300]")
        if not 0 <= self.stop_grace_s <= 600:
            raise ConfigError(f"ELASTICO_STOP_GRACE_S={self.stop_grace_s}: must be in [0, 600]")
        if self.mps not in MPS_MODES:
            raise ConfigError(f"ELASTICO_MPS={self.mps!r}: must be one of {', '.join(MPS_MODES)}")
        if self.mps_control_timeout_s <= 0:
            raise ConfigError(f"ELASTICO_MPS_CONTROL_TIMEOUT_S={self.mps_control_timeout_s}: must be > 0")
        if self.mps_fault_holddown_s < 0:
            raise ConfigError(f"ELASTICO_MPS_FAULT_HOLDDOWN_S={self.mps_fault_holddown_s}: must be >= 0")
        if self.predictor_timeout_s <= 0:
            raise ConfigError(f"ELASTICO_PREDICTOR_TIMEOUT_S={self.predictor_timeout_s}: must be > 0")
        if self.observation_interval_s < 0:
            raise ConfigError(f"ELASTICO_OBSERVATION_INTERVAL_S={self.observation_interval_s}: must be >= 0")
        if self.predictor_address and ":" not in self.predictor_address:
            raise ConfigError(f"ELASTICO_PREDICTOR_ADDRESS={self.predictor_address!r}: must be host:port")

    @property
    def effective_node_id(self) -> str:
        return self.node_id or socket.gethostname()

    @property
    def effective_state_dir(self) -> Path:
        if self.state_dir:
            return Path(self.state_dir).resolve()
        base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        return Path(base) / "elastico" / self.effective_node_id

    @property
    def effective_mps_pipe_dir(self) -> Path:
        return Path(self.mps_pipe_dir) if self.mps_pipe_dir else self.effective_state_dir / "mps" / "pipe"

    @property
    def effective_mps_log_dir(self) -> Path:
        return Path(self.mps_log_dir) if self.mps_log_dir else self.effective_state_dir / "mps" / "log"
