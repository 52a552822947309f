"""NvmlBackend against pynvml's own error types, structures and call signatures (no GPU needed).

Each test builds a stand-in ``pynvml`` whose functions are ``create_autospec`` copies of the real ones
(a call with the wrong arguments fails like it would against the library) and whose errors, structures
and constants *are* the real module's.
"""

from __future__ import annotations

import types
from unittest import mock

import pynvml
import pytest

from elastico.errors import Unavailable
from services.node_agent.gpu import NvmlBackend, gpu_type_from_name, make_backend
from services.node_agent.simulated import SimulatedBackend

FUNCS = ("nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetMemoryInfo",
         "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlGpmQueryDeviceSupport",
         "nvmlGpmSampleAlloc", "nvmlGpmSampleGet", "nvmlGpmMetricsGet", "nvmlGpmSampleFree",
         "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetProcessUtilization")
MIB = 1024 * 1024


def fake_nvml(gpus: int = 1, gpm: bool = False, name: str = "NVIDIA H200") -> types.SimpleNamespace:
    nv = types.SimpleNamespace(**{k: getattr(pynvml, k) for k in dir(pynvml) if k.startswith(("NVML", "c_nvml"))})
    for f in FUNCS:
        setattr(nv, f, mock.create_autospec(getattr(pynvml, f)))
    nv.nvmlDeviceGetCount.return_value = gpus
    nv.nvmlDeviceGetHandleByIndex.side_effect = lambda i: f"handle-{i}"
    nv.nvmlDeviceGetMemoryInfo.return_value = types.SimpleNamespace(total=80 * 1024 * MIB, used=1024 * MIB, free=0)
    nv.nvmlDeviceGetUtilizationRates.return_value = types.SimpleNamespace(gpu=37, memory=12)
    nv.nvmlDeviceGetName.return_value = name
    nv.nvmlDeviceGetUUID.side_effect = lambda h: f"GPU-{h}"
    support = pynvml.c_nvmlGpmSupport_t()
    support.isSupportedDevice = 1 if gpm else 0
    nv.nvmlGpmQueryDeviceSupport.return_value = support
    nv.samples = [pynvml.c_nvmlGpmSample_t() for _ in range(8)]  # real (null) GPM sample handles
    pool = iter(nv.samples)
    nv.nvmlGpmSampleAlloc.side_effect = lambda: next(pool)
    nv.nvmlGpmSampleGet.side_effect = lambda handle, sample: sample

    def metrics_get(req):
        values = {pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 61.5, pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 44.0,
                  pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 20.25}
        assert req.version == pynvml.NVML_GPM_METRICS_GET_VERSION and req.numMetrics == 3
        for i in range(req.numMetrics):
            req.metrics[i].value = values[req.metrics[i].metricId]
            req.metrics[i].nvmlReturn = pynvml.NVML_SUCCESS
        return req

    nv.nvmlGpmMetricsGet.side_effect = metrics_get
    nv.nvmlDeviceGetComputeRunningProcesses.return_value = []
    nv.nvmlDeviceGetProcessUtilization.side_effect = pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
    return nv


def test_driverless_machine_is_a_clear_error():
    nv = fake_nvml()
    nv.nvmlInit.side_effect = pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    assert isinstance(nv.nvmlInit.side_effect, pynvml.NVMLError_LibraryNotFound)
    with pytest.raises(Unavailable, match="NVML unavailable.*ELASTICO_GPU_BACKEND=simulated"):
        NvmlBackend(nv)


def test_real_library_on_this_machine_fails_the_same_way_or_works():
    try:
        backend = NvmlBackend()
    except Unavailable as exc:
        assert "NVML unavailable" in str(exc)
        return
    assert backend.gpus()  # pragma: no cover - only on a machine with a driver
    backend.close()  # pragma: no cover


def test_auto_falls_back_loudly_and_nvml_does_not(monkeypatch):
    monkeypatch.setattr("services.node_agent.gpu.NvmlBackend", mock.Mock(side_effect=Unavailable("NVML unavailable (x)")))
    with mock.patch("services.node_agent.gpu.log") as log:
        backend = make_backend("auto", "n", "v100", 2, 1000)
    assert isinstance(backend, SimulatedBackend)
    assert "falling back to SIMULATED" in log.warning.call_args.args[0]
    with pytest.raises(Unavailable):
        make_backend("nvml", "n", "v100", 2, 1000)


def test_device_counters_without_gpm():
    nv = fake_nvml(gpus=2, name="Tesla V100-SXM2-16GB")
    backend = NvmlBackend(nv)
    gpus = backend.gpus()
    assert [g.uuid for g in gpus] == ["GPU-handle-0", "GPU-handle-1"]
    assert gpus[0].gpu_type == "v100" and gpus[0].mem_total_mib == 80 * 1024
    c = gpus[0].counters
    assert (c.sm_util_pct, c.mem_bw_util_pct, c.mem_used_mib, c.tensor_util_pct) == (37.0, 12.0, 1024.0, None)
    nv.nvmlGpmSampleGet.assert_not_called()


def test_gpm_metrics_need_two_samples_and_free_the_old_one():
    nv = fake_nvml(gpm=True)
    backend = NvmlBackend(nv)
    first = backend.gpus()[0].counters
    assert first.sm_util_pct == 37.0 and first.tensor_util_pct is None  # one sample: plain NVML utilisation
    second = backend.gpus()[0].counters
    assert (second.sm_util_pct, second.mem_bw_util_pct, second.tensor_util_pct) == (61.5, 44.0, 20.25)
    nv.nvmlGpmSampleFree.assert_called_once_with(nv.samples[0])
    backend.close()
    nv.nvmlGpmSampleFree.assert_called_with(nv.samples[1])
    nv.nvmlShutdown.assert_called_once_with()


def test_gpm_query_unsupported_or_missing_disables_gpm():
    nv = fake_nvml(gpm=True)
    nv.nvmlGpmQueryDeviceSupport.side_effect = pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    backend = NvmlBackend(nv)
    backend.gpus()
    backend.gpus()
    nv.nvmlGpmSampleGet.assert_not_called()


def test_unsupported_utilisation_is_unknown_not_fatal():
    nv = fake_nvml()
    nv.nvmlDeviceGetUtilizationRates.side_effect = pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    c = NvmlBackend(nv).gpus()[0].counters
    assert c.sm_util_pct is None and c.mem_used_mib == 1024.0


def test_per_process_counters():
    nv = fake_nvml(gpus=2)
    p1 = types.SimpleNamespace(pid=101, usedGpuMemory=512 * MIB)
    p2 = types.SimpleNamespace(pid=102, usedGpuMemory=None)  # not available (e.g. under some hypervisors)
    nv.nvmlDeviceGetComputeRunningProcesses.side_effect = lambda h: [p1, p2] if h == "handle-0" else [p1]
    sample = pynvml.c_nvmlProcessUtilizationSample_t()
    sample.pid, sample.timeStamp, sample.smUtil, sample.memUtil = 101, 5000, 40, 10
    nv.nvmlDeviceGetProcessUtilization.side_effect = lambda h, ts: [sample] if h == "handle-0" else (_ for _ in ()).throw(
        pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND))
    backend = NvmlBackend(nv)
    counters = backend.process_counters()
    assert counters[101].sm_util_pct == 40.0 and counters[101].mem_bw_util_pct == 10.0
    assert counters[101].mem_used_mib == 1024.0  # 512 MiB on each of its two GPUs
    assert counters[102].sm_util_pct is None and counters[102].mem_used_mib == 0.0
    backend.process_counters()
    assert nv.nvmlDeviceGetProcessUtilization.call_args_list[-2].args == ("handle-0", 5000)  # only newer samples


@pytest.mark.parametrize(("name", "short"), [("NVIDIA H200", "h200"), ("Tesla V100-SXM2-16GB", "v100"),
                                             ("NVIDIA A100-SXM4-80GB", "a100"), ("Tesla K80", "k80")],
                         ids=["h200", "v100", "a100", "k80"])
def test_gpu_type_from_name(name, short):
    assert gpu_type_from_name(name) == short
