"""GPU backends behind one protocol: NVML on real nodes, a simulated backend everywhere else.

The simulated backend is a real, explicitly configured backend (``ELASTICO_GPU_BACKEND=simulated``),
never a silent fallback: ``nvml`` fails loudly on a machine without a driver, and only ``auto`` falls
back, with a warning in the log.
"""

from __future__ import annotations

from typing import Protocol

from elastico.domain import GpuCounters, GpuInfo
from elastico.errors import Unavailable
from elastico.logging import get_logger

log = get_logger(component="gpu")


class GpuBackend(Protocol):
    """What the node agent needs from the hardware."""

    name: str

    def gpus(self) -> list[GpuInfo]:
        """Every GPU of the node with its latest device counters."""
        ...

    def close(self) -> None: ...


class SimulatedBackend:
    """``count`` identical GPUs of ``gpu_type``; counters stay unknown until workloads run on them."""

    name = "simulated"

    def __init__(self, node_id: str, gpu_type: str, count: int, mem_mib: int) -> None:
        self._gpus = [
            GpuInfo(index=i, uuid=f"GPU-SIM-{node_id}-{i}", gpu_type=gpu_type, mem_total_mib=mem_mib,
                    counters=GpuCounters(sm_util_pct=0.0, mem_bw_util_pct=0.0, mem_used_mib=0.0))
            for i in range(count)
        ]

    def gpus(self) -> list[GpuInfo]:
        return list(self._gpus)

    def close(self) -> None:
        return None


class NvmlBackend:
    """GPUs and device counters through NVML (``nvidia-ml-py``, imported as ``pynvml``)."""

    name = "nvml"

    def __init__(self) -> None:
        import pynvml

        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise Unavailable(f"NVML unavailable ({exc}); no NVIDIA driver on this machine? "
                              "Set ELASTICO_GPU_BACKEND=simulated to run on simulated GPUs") from exc
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]

    def gpus(self) -> list[GpuInfo]:
        nv = self._nvml
        out = []
        for i, h in enumerate(self._handles):
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            util = nv.nvmlDeviceGetUtilizationRates(h)
            name = nv.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            uuid = nv.nvmlDeviceGetUUID(h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            out.append(GpuInfo(
                index=i, uuid=uuid, gpu_type=gpu_type_from_name(name), mem_total_mib=mem.total // (1024 * 1024),
                counters=GpuCounters(sm_util_pct=float(util.gpu), mem_bw_util_pct=float(util.memory),
                                     mem_used_mib=mem.used / (1024 * 1024)),
            ))
        return out

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def gpu_type_from_name(name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'Tesla V100-SXM2-16GB' -> 'v100': the short type used in profiles."""
    for token in name.replace("-", " ").split():
        t = token.lower()
        if t[:1] in "abhklpvt" and any(c.isdigit() for c in t) and t not in ("nvidia", "tesla"):
            return t
    return name.lower().replace(" ", "_")


def make_backend(kind: str, node_id: str, gpu_type: str, count: int, mem_mib: int) -> GpuBackend:
    """Select the backend named by configuration.

    Raises:
        Unavailable: ``kind`` is ``nvml`` and NVML cannot be loaded.
    """
    if kind == "simulated":
        return SimulatedBackend(node_id, gpu_type, count, mem_mib)
    if kind == "nvml":
        return NvmlBackend()
    try:
        return NvmlBackend()
    except Unavailable as exc:
        log.warning("NVML unavailable, falling back to SIMULATED GPUs (gpu_backend=auto)", error=str(exc))
        return SimulatedBackend(node_id, gpu_type, count, mem_mib)
