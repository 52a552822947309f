"""The measured workloads, how they are combined, and the worker child that runs one of them.

A child (``python3 -m bench.device_check --worker NAME --seconds S``) warms up, reports ``ready``, waits for
``go <epoch>`` on stdin and measures over the same wall-clock window as its co-tenants, printing one JSON event
per line. ``--fake`` (dry run) sleeps and reports a constant rate scaled by the MPS share in its environment.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

WORKLOADS: dict[str, str] = {
    "mlp_bf16": "compute-bound training: bf16 MLP 4096x4096 x2, batch 4096, fwd+bwd+SGD",
    "membound": "memory-bound training: Adam-like elementwise update, 64 Mi fp32 params (~1 GiB tensors)",
    "tiny_mlp": "latency-bound inference: fp32 MLP 512 wide x3, batch 32, one synchronised request per step",
}
SHORT = {"mlp_bf16": "a", "membound": "b", "tiny_mlp": "c"}
MPS_SHARES = (100, 50, 25)
PAIRS: tuple[tuple[str, str], ...] = (("mlp_bf16", "membound"), ("mlp_bf16", "tiny_mlp"),
                                      ("membound", "tiny_mlp"), ("mlp_bf16", "mlp_bf16"))
PAIR_SHARES = (100, 50)
FAKE_RATES = {"mlp_bf16": 500.0, "membound": 1200.0, "tiny_mlp": 8000.0}  # --dry-run workers, steps/s at 100 %


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def wait_go() -> float | None:
    """Block until the orchestrator writes ``go <epoch seconds>``; None on EOF (orchestrator gone)."""
    for line in sys.stdin:
        parts = line.split()
        if parts and parts[0] == "go":
            return float(parts[1]) if len(parts) > 1 else time.time()
    return None


def _build(name: str, torch: Any) -> tuple[Callable[[], None], bool]:
    """(one training/inference step, whether every step synchronises like a served request)."""
    dev = torch.device("cuda")
    if name == "mlp_bf16":
        model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU(),
                                    torch.nn.Linear(4096, 4096)).to(dev, torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)

        def step() -> None:
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step, False
    if name == "membound":
        n = 64 * 2**20
        p = torch.randn(n, device=dev)
        g = torch.randn(n, device=dev)
        m = torch.zeros(n, device=dev)
        v = torch.ones(n, device=dev)

        def step() -> None:
            m.mul_(0.9).add_(g, alpha=0.1)
            v.mul_(0.999).addcmul_(g, g, value=0.001)
            p.addcdiv_(m, v.sqrt().add_(1e-8), value=-1e-3)
        return step, False
    if name == "tiny_mlp":
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                    torch.nn.ReLU(), torch.nn.Linear(512, 10)).to(dev).requires_grad_(False)
        x = torch.randn(32, 512, device=dev)

        def step() -> None:
            model(x).argmax(dim=1)
        return step, True
    raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")


def torch_info() -> dict[str, Any]:
    t = time.perf_counter()
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "import_s": round(time.perf_counter() - t, 2), "cuda_available": torch.cuda.is_available()}
    if out["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        out.update(device=p.name, capability=f"{p.major}.{p.minor}", sm_count=p.multi_processor_count,
                   total_mem_mib=p.total_memory // 2**20, device_count=torch.cuda.device_count(),
                   bf16=torch.cuda.is_bf16_supported())
    return out


def run_worker(name: str, seconds: float, fake: bool) -> int:
    """Child: warm up, print ``ready``, wait for ``go``, measure over ``seconds``, print ``result``."""
    t_start = time.perf_counter()
    share = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    base = {"workload": name, "pid": os.getpid(), "share_env": share,
            "mps_pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY")}
    try:
        if name == "info":
            emit({"event": "info", **(torch_info() if not fake else {"fake": True})})
            return 0
        if fake:
            if name not in FAKE_RATES:
                raise ValueError(f"unknown workload {name!r}")
            rate = FAKE_RATES[name] * (float(share) / 100.0 if share else 1.0)
            emit({"event": "ready", **base, "fake": True, "startup_s": round(time.perf_counter() - t_start, 3)})
            go = wait_go()
            if go is None:
                return 3
            time.sleep(max(0.0, go - time.time()) + seconds)
            emit({"event": "result", **base, "fake": True, "steps": int(rate * seconds), "seconds": seconds,
                  "steps_per_s": rate, "start_lag_s": 0.0})
            return 0
        import torch

        step, sync_each = _build(name, torch)
        sync = torch.cuda.synchronize
        t_w, warm = time.perf_counter(), 0
        while warm < 10 or time.perf_counter() - t_w < 0.5:  # kernels loaded, cuBLAS picked, clocks up
            step()
            warm += 1
            if sync_each or warm % 10 == 0:
                sync()
        sync()
        per_step = (time.perf_counter() - t_w) / warm
        chunk = 1 if sync_each else max(1, min(200, int(0.02 / max(per_step, 1e-6))))  # ~20 ms between syncs
        props = torch.cuda.get_device_properties(0)
        torch.cuda.reset_peak_memory_stats()
        emit({"event": "ready", **base, "device": props.name, "sm_count": props.multi_processor_count,
              "warmup_steps": warm, "chunk": chunk, "startup_s": round(time.perf_counter() - t_start, 3)})
        go = wait_go()
        if go is None:
            return 3
        time.sleep(max(0.0, go - time.time()))
        lag = time.time() - go
        t0 = time.perf_counter()
        end = t0 + seconds
        steps = 0
        lat: list[float] = []
        if sync_each:
            while True:
                s = time.perf_counter()
                step()
                sync()
                e = time.perf_counter()
                lat.append(e - s)
                steps += 1
                if e >= end:
                    break
        else:
            while True:
                for _ in range(chunk):
                    step()
                sync()
                steps += chunk
                if time.perf_counter() >= end:
                    break
        elapsed = time.perf_counter() - t0
        res: dict[str, Any] = {"event": "result", **base, "steps": steps, "seconds": round(elapsed, 4),
                               "steps_per_s": steps / elapsed, "start_lag_s": round(lag, 4),
                               "peak_mem_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1)}
        if lat:
            lat.sort()
            res["latency_ms"] = {"p50": round(lat[len(lat) // 2] * 1e3, 4),
                                 "p99": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3, 4)}
        emit(res)
        return 0
    except Exception as exc:  # noqa: BLE001 - reported to the orchestrator, which records it
        emit({"event": "error", **base, "error": f"{type(exc).__name__}: {exc}",
              "traceback": traceback.format_exc()[-3000:]})
        return 1
