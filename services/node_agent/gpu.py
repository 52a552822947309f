"""GPU backends behind one protocol: NVML on real nodes, a simulated backend everywhere else.

The simulated backend is a real, explicitly configured backend (``ELASTICO_GPU_BACKEND=simulated``),
never a silent fallback: ``nvml`` fails loudly on a machine without a driver, and only ``auto`` falls
back, with a warning in the log.

Real GPUs set each workload's pace themselves; simulated GPUs must be told. ``emulated_rates`` is that
seam: the simulated backend (:mod:`services.node_agent.simulated`, imported only when selected) answers from
the co-location ground truth, NVML answers nothing, and the reconciler writes whatever comes back into the
synthetic workloads' rate files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from elastico.domain import GpuCounters, GpuInfo
from elastico.errors import Unavailable
from elastico.logging import get_logger

log = get_logger(component="gpu")


@dataclass(frozen=True)
class Tenant:
    """One workload's claim on the GPUs of a node, as a backend that sets workloads' pace needs it."""

    job_id: str
    model: str  # model family, e.g. "ResNet-50" (Gavel spelling; case and punctuation are ignored)
    batch_size: int  # per-GPU batch size; 0 = unknown
    gpu_indices: tuple[int, ...]
    compute_share_pct: float  # MPS active-thread percentage on each of its GPUs, (0, 100]
    kind: str = "training"  # "training" or "inference"
    # inference: its measured load, fraction of a full GPU's request rate (None = unknown: counted as its share);
    # a service's co-tenants feel what it uses, as the simulator's ground truth counts a service's load
    load: float | None = None


class GpuBackend(Protocol):
    """What the node agent needs from the hardware."""

    name: str

    def gpus(self) -> list[GpuInfo]:
        """Every GPU of the node with its latest device counters."""
        ...

    def process_counters(self) -> dict[int, GpuCounters]:
        """Per-process counters (pid -> counters) of the processes using the GPUs; {} when unknown."""
        ...

    def emulated_rates(self, tenants: Sequence[Tenant], mem_mib: dict[str, int] | None = None) -> dict[str, tuple[float, float]]:
        """job_id -> (steps/s, normalised throughput) the backend imposes; {} on real hardware.

        ``mem_mib`` (job_id -> pinned memory per GPU) lets a simulated backend report memory in use.
        """
        ...

    def close(self) -> None: ...


# GPM metrics read on Hopper and newer (nvmlGpmQueryDeviceSupport says which devices)
GPM_METRICS = ("NVML_GPM_METRIC_SM_OCCUPANCY", "NVML_GPM_METRIC_DRAM_BW_UTIL", "NVML_GPM_METRIC_ANY_TENSOR_UTIL")


class NvmlBackend:
    """GPUs, device and per-process counters through NVML (``nvidia-ml-py``, imported as ``pynvml``).

    Device utilisation comes from ``nvmlDeviceGetUtilizationRates``; on devices where
    ``nvmlGpmQueryDeviceSupport(handle).isSupportedDevice`` is set, GPM replaces it with SM occupancy,
    DRAM bandwidth and tensor activity computed between two GPM samples (the previous call's and this
    one's), which is what the interference model is trained on. A metric the device does not support
    (``NVMLError_NotSupported``) is left unknown rather than failing the heartbeat.
    """

    name = "nvml"

    def __init__(self, nvml: Any = None) -> None:
        if nvml is None:
            import pynvml as nvml
        self._nvml = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise Unavailable(f"NVML unavailable ({exc}); no NVIDIA driver on this machine? "
                              "Set ELASTICO_GPU_BACKEND=simulated to run on simulated GPUs") from exc
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        self._gpm = [self._gpm_supported(h) for h in self._handles]
        self._gpm_prev: dict[int, Any] = {}
        self._proc_ts: dict[int, int] = {}  # last per-process sample timestamp seen, per device (microseconds)

    def _gpm_supported(self, handle: Any) -> bool:
        nv = self._nvml
        try:
            return bool(nv.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
        except (nv.NVMLError, AttributeError):  # old driver (function missing) or not supported
            return False

    def _gpm_counters(self, index: int, handle: Any) -> dict[str, float]:
        """SM occupancy, DRAM bandwidth and tensor utilisation between the previous sample and now."""
        nv = self._nvml
        try:
            sample = nv.nvmlGpmSampleGet(handle, nv.nvmlGpmSampleAlloc())
        except nv.NVMLError as exc:
            log.warning("GPM sample failed; disabling GPM on this GPU", gpu=index, error=str(exc))
            self._gpm[index] = False
            return {}
        prev = self._gpm_prev.get(index)
        self._gpm_prev[index] = sample
        if prev is None:
            return {}  # GPM metrics need two samples: the next call has them
        req = nv.c_nvmlGpmMetricsGet_t()
        req.version = nv.NVML_GPM_METRICS_GET_VERSION
        req.numMetrics = len(GPM_METRICS)
        req.sample1 = prev
        req.sample2 = sample
        for i, metric in enumerate(GPM_METRICS):
            req.metrics[i].metricId = getattr(nv, metric)
        out: dict[str, float] = {}
        try:
            res = nv.nvmlGpmMetricsGet(req)
            names = {"NVML_GPM_METRIC_SM_OCCUPANCY": "sm_util_pct", "NVML_GPM_METRIC_DRAM_BW_UTIL": "mem_bw_util_pct",
                     "NVML_GPM_METRIC_ANY_TENSOR_UTIL": "tensor_util_pct"}
            for i, metric in enumerate(GPM_METRICS):
                m = res.metrics[i]
                if getattr(m, "nvmlReturn", 0) == getattr(nv, "NVML_SUCCESS", 0):
                    out[names[metric]] = float(m.value)
        except nv.NVMLError as exc:
            log.warning("GPM metrics failed", gpu=index, error=str(exc))
        finally:
            try:
                nv.nvmlGpmSampleFree(prev)
            except nv.NVMLError:
                pass
        return out

    def gpus(self) -> list[GpuInfo]:
        nv = self._nvml
        out = []
        for i, h in enumerate(self._handles):
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            name = nv.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            uuid = nv.nvmlDeviceGetUUID(h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            values: dict[str, float | None] = {"mem_used_mib": mem.used / (1024 * 1024)}
            try:
                util = nv.nvmlDeviceGetUtilizationRates(h)
                values.update(sm_util_pct=float(util.gpu), mem_bw_util_pct=float(util.memory))
            except nv.NVMLError as exc:
                log.debug("utilisation unavailable", gpu=i, error=str(exc))
            if self._gpm[i]:
                values.update(self._gpm_counters(i, h))
            out.append(GpuInfo(index=i, uuid=uuid, gpu_type=gpu_type_from_name(name),
                               mem_total_mib=mem.total // (1024 * 1024), counters=GpuCounters(**values)))
        return out

    def process_counters(self) -> dict[int, GpuCounters]:
        """pid -> SM/memory utilisation (``nvmlDeviceGetProcessUtilization``) and memory used
        (``nvmlDeviceGetComputeRunningProcesses``), summed over GPUs for multi-GPU processes."""
        nv = self._nvml
        util: dict[int, list[float]] = {}
        mem: dict[int, float] = {}
        for i, h in enumerate(self._handles):
            try:
                for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                    used = getattr(p, "usedGpuMemory", None)
                    if used is not None:
                        mem[p.pid] = mem.get(p.pid, 0.0) + used / (1024 * 1024)
                    else:
                        mem.setdefault(p.pid, 0.0)
            except nv.NVMLError as exc:
                log.debug("process list unavailable", gpu=i, error=str(exc))
            try:
                samples = nv.nvmlDeviceGetProcessUtilization(h, self._proc_ts.get(i, 0))
            except nv.NVMLError_NotFound:  # no sample since the last timestamp: nothing ran
                samples = []
            except nv.NVMLError as exc:
                log.debug("per-process utilisation unavailable", gpu=i, error=str(exc))
                samples = []
            for s in samples:
                self._proc_ts[i] = max(self._proc_ts.get(i, 0), int(s.timeStamp))
                acc = util.setdefault(s.pid, [0.0, 0.0])
                acc[0] += float(s.smUtil)
                acc[1] += float(s.memUtil)
        return {pid: GpuCounters(sm_util_pct=util[pid][0] if pid in util else None,
                                 mem_bw_util_pct=util[pid][1] if pid in util else None,
                                 mem_used_mib=mem.get(pid))
                for pid in set(util) | set(mem)}

    def emulated_rates(self, tenants: Sequence[Tenant], mem_mib: dict[str, int] | None = None) -> dict[str, tuple[float, float]]:
        return {}  # real GPUs set the pace themselves

    def close(self) -> None:
        nv = self._nvml
        for sample in self._gpm_prev.values():
            try:
                nv.nvmlGpmSampleFree(sample)
            except nv.NVMLError:
                pass
        self._gpm_prev.clear()
        nv.nvmlShutdown()


def gpu_type_from_name(name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'Tesla V100-SXM2-16GB' -> 'v100': the short type used in profiles."""
    for token in name.replace("-", " ").split():
        t = token.lower()
        if t[:1] in "abhklpvt" and any(c.isdigit() for c in t) and t not in ("nvidia", "tesla"):
            return t
    return name.lower().replace(" ", "_")


def make_backend(kind: str, node_id: str, gpu_type: str, count: int, mem_mib: int, time_scale: float = 1.0) -> GpuBackend:
    """Select the backend named by configuration.

    Raises:
        Unavailable: ``kind`` is ``nvml`` and NVML cannot be loaded.
    """
    if kind == "nvml":
        return NvmlBackend()
    if kind != "simulated":
        try:
            return NvmlBackend()
        except Unavailable as exc:
            log.warning("NVML unavailable, falling back to SIMULATED GPUs (gpu_backend=auto)", error=str(exc))
    from services.node_agent.simulated import SimulatedBackend  # the co-location data only where it is used

    return SimulatedBackend(node_id, gpu_type, count, mem_mib, time_scale=time_scale)
