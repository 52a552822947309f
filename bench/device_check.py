"""Device check: real co-located throughput and MPS share limits on the GPU the project is given.

Why it exists. Everything ElastiCo knows about co-location comes from other people's GPUs: the
simulator's ground truth and the interference model are built on Gavel's measured pairs (K80, P100,
V100) and Lucid's rules, and the MPS compute share is assumed to cap a job's speed at
``min(1, share / solo utilisation)``. This script measures the same quantities on whatever GPU the
project is lent (an H200 at the time of writing), in one prepared run of a few minutes, so an operator
can set them side by side with the figures the simulator assumes:

1. ``environment`` -- ``nvidia-smi -q`` excerpt (driver, GPU, compute mode, MIG), torch and CUDA
   versions, where ``nvidia-cuda-mps-control`` is.
2. ``nvml`` -- the node agent's own ``NvmlBackend`` (``services/node_agent/gpu.py``) on real hardware:
   inventory and device counters idle and under load, per-process counters; checks that utilisation
   rises under load. The load is workload ``mlp_bf16`` in a child process, not a thread of this
   process: the orchestrator never creates a CUDA context, so none lingers next to the MPS clients
   measured later.
3. ``solo`` -- each workload alone, without MPS: steps/s.
4. ``mps`` -- the node agent's own ``RealMps`` (``services/node_agent/mps.py``) starts a control daemon
   with fresh pipe/log directories; each workload runs alone at ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
   100, 50 and 25 (the client environment comes from ``RealMps.client_env``, as the agent launches
   workloads), then in pairs at 100/100 and 50/50. Normalised throughput = co-located steps/s / solo
   steps/s at MPS 100. The daemon is always quit at the end.
5. ``timeslice`` -- the pairs without MPS (plain time-slicing): required when MPS could not start,
   otherwise run only if the time budget allows.

Workloads (children: ``python3 -m bench.device_check --worker NAME --seconds S``): ``mlp_bf16``
compute-bound training step (bf16 MLP 4096 wide, batch 4096, forward, backward, SGD), ``membound``
memory-bound training step (Adam-like elementwise update of 64 Mi fp32 parameters, ~1 GiB of tensors),
``tiny_mlp`` latency-bound inference (3-layer MLP 512 wide, batch 32, one synchronised request per step:
the kind of tenant that leaves most of the GPU idle). Each child warms up, reports ``ready``, waits for
``go <epoch>`` on stdin and then measures over the same wall-clock window as its co-tenant.
Windows are 5 s (``--seconds``): 22 measurements x (5 s + ~5 s to import torch and warm up) is about
4 minutes; 8 s windows would not leave the budget any margin.

Run on the GPU machine (plain working tree, no virtualenv, no generated stubs)::

    python3 -m bench.device_check --out $OUT            # ~4 min; --quick: 2 s windows (~3 min: startup dominates)

It always writes ``$OUT/device_check.json`` (rewritten after every measurement, so a killed run leaves
its partial results) and prints a summary. Every stage records its error and the run goes on; a global
budget (``--budget-s``, default 300 s) is checked before every stage and every measurement, skipping
what no longer fits. ``--dry-run`` runs the whole orchestration without a GPU (fake workers that sleep
and report constant rates, a stand-in NVML, ``SimulatedMps``): that is what the unit test runs.

Exit status: 0 every stage ok; 1 some stage failed or was skipped (see the JSON); 2 no GPU (without
``--dry-run``) or bad arguments; 143 terminated. Only the standard library is imported at module level:
torch and pynvml are imported in the GPU paths only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from queue import Empty, Queue
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "elastico.device_check/1"
JSON_NAME = "device_check.json"

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
TOOL_DIRS = ("/usr/local/nvidia/bin", "/usr/bin", "/usr/local/bin", "/usr/local/cuda/bin", "/usr/sbin", "/sbin")
SMI_KEYS = ("Driver Version", "CUDA Version", "Product Name", "Product Brand", "Product Architecture",
            "Compute Mode", "Persistence Mode", "Virtualization Mode", "Host VGPU Mode", "Addressing Mode",
            "GPU UUID", "Bus Id", "Total", "Power Limit", "Max Clocks", "SM ")
SMI_QUERY = "name,driver_version,compute_mode,mig.mode.current,memory.total,clocks.max.sm,power.limit"

DEFAULT_WINDOW_S = 5.0
QUICK_WINDOW_S = 2.0
DRY_WINDOW_S = 0.1


class WorkerError(RuntimeError):
    """A measurement child failed, hung or exited early."""


class Terminated(BaseException):
    """SIGTERM/SIGINT: unwind through every ``finally`` (children killed, MPS quit, JSON written)."""


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _find_tool(name: str) -> str | None:
    """``name`` on PATH, else in the usual NVIDIA driver folders (containers often leave them off PATH)."""
    found = shutil.which(name)
    if found:
        return found
    for d in TOOL_DIRS:
        p = Path(d) / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def _run(cmd: list[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        data = path.read_text(errors="replace")
    except OSError:
        return ""
    return data[-chars:]


def _pkg_version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _asdict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj


def _mps_processes() -> list[dict[str, Any]]:
    """Processes named nvidia-cuda-mps-* on this machine (read from /proc; nothing is signalled)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith("nvidia-cuda-mps"):
            out.append({"pid": int(entry.name), "comm": comm})
    return out


# --- project code on a bare machine ----------------------------------------------------------------------
def _structlog_stand_in() -> types.ModuleType:
    """Enough of ``structlog`` for ``elastico.logging.get_logger`` (the GPU machine has no virtualenv)."""
    mod = types.ModuleType("structlog")

    class _Logger:
        def __init__(self, **bound: Any) -> None:
            self._bound = bound

        def bind(self, **kw: Any) -> _Logger:
            return _Logger(**{**self._bound, **kw})

        def __getattr__(self, level: str) -> Callable[..., None]:
            def emit(event: str = "", *args: Any, **kw: Any) -> None:
                if level in ("warning", "error", "exception", "critical"):
                    print(f"[{level}] {event} {dict(self._bound, **kw)}", file=sys.stderr, flush=True)
            return emit

    mod.get_logger = lambda **bound: _Logger(**bound)  # type: ignore[attr-defined]
    mod.__elastico_stand_in__ = True  # type: ignore[attr-defined]
    return mod


def _coloc_stand_in() -> types.ModuleType:
    """``services.node_agent.coloc`` names that ``gpu.py`` imports; NvmlBackend never uses them."""
    mod = types.ModuleType("services.node_agent.coloc")

    class ColocationTruth:  # noqa: D401 - placeholder
        """Placeholder (the simulator's ground truth could not be imported on this machine)."""

    class Tenant:
        """Placeholder."""

    mod.ColocationTruth = ColocationTruth  # type: ignore[attr-defined]
    mod.Tenant = Tenant  # type: ignore[attr-defined]
    mod.__elastico_stand_in__ = True  # type: ignore[attr-defined]
    return mod


def load_project() -> tuple[types.ModuleType | None, types.ModuleType | None, dict[str, Any]]:
    """Import the node agent's ``gpu`` and ``mps`` modules, standing in for what a bare machine lacks.

    The GPU machine has torch, pynvml, grpcio, protobuf and numpy but not the virtualenv: ``structlog``
    (logging only) and the simulator's ground truth behind ``coloc`` (not used by ``NvmlBackend``) may be
    missing. Each stand-in is recorded; the backend and MPS classes are always the project's own code.
    """
    info: dict[str, Any] = {"stand_ins": [], "errors": {}}
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    try:
        import structlog  # noqa: F401
    except ImportError as exc:
        sys.modules["structlog"] = _structlog_stand_in()
        info["stand_ins"].append(f"structlog ({exc}): minimal logger printing warnings to stderr")
    try:
        import services.node_agent.coloc  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - anything in the simulator's import chain
        sys.modules["services.node_agent.coloc"] = _coloc_stand_in()
        info["stand_ins"].append(f"services.node_agent.coloc ({type(exc).__name__}: {exc}): placeholder names")
    gpu = mps = None
    try:
        import services.node_agent.gpu as gpu
    except Exception as exc:  # noqa: BLE001
        info["errors"]["services.node_agent.gpu"] = f"{type(exc).__name__}: {exc}"
    try:
        import services.node_agent.mps as mps
    except Exception as exc:  # noqa: BLE001
        info["errors"]["services.node_agent.mps"] = f"{type(exc).__name__}: {exc}"
    return gpu, mps, info


# --- workers (child processes) ---------------------------------------------------------------------------
def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def _wait_go() -> float | None:
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


def _torch_info() -> dict[str, Any]:
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
            _emit({"event": "info", **(_torch_info() if not fake else {"fake": True})})
            return 0
        if fake:
            if name not in FAKE_RATES:
                raise ValueError(f"unknown workload {name!r}")
            rate = FAKE_RATES[name] * (float(share) / 100.0 if share else 1.0)
            _emit({"event": "ready", **base, "fake": True, "startup_s": round(time.perf_counter() - t_start, 3)})
            go = _wait_go()
            if go is None:
                return 3
            time.sleep(max(0.0, go - time.time()) + seconds)
            _emit({"event": "result", **base, "fake": True, "steps": int(rate * seconds), "seconds": seconds,
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
        _emit({"event": "ready", **base, "device": props.name, "sm_count": props.multi_processor_count,
               "warmup_steps": warm, "chunk": chunk, "startup_s": round(time.perf_counter() - t_start, 3)})
        go = _wait_go()
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
        _emit(res)
        return 0
    except Exception as exc:  # noqa: BLE001 - reported to the orchestrator, which records it
        _emit({"event": "error", **base, "error": f"{type(exc).__name__}: {exc}",
               "traceback": traceback.format_exc()[-3000:]})
        return 1


# --- orchestrator side of one child -----------------------------------------------------------------------
class Child:
    """One worker process: JSON events from its stdout on a queue, stderr in a file."""

    def __init__(self, label: str, workload: str, seconds: float, env: dict[str, str], fake: bool, tmp: Path) -> None:
        self.label = label
        self.workload = workload
        self.stderr_path = tmp / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', label)}-{time.monotonic_ns()}.stderr"
        # fake workers need only the standard library: -S skips site-packages (5x faster start, quick tests)
        cmd = [sys.executable, *(["-S"] if fake else []), "-m", "bench.device_check", "--worker", workload,
               "--seconds", f"{seconds:g}", *(["--fake"] if fake else [])]
        self.t_spawn = time.monotonic()
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True, bufsize=1)
        self.events: Queue[dict[str, Any]] = Queue()
        self.noise: list[str] = []
        threading.Thread(target=self._read, daemon=True, name=f"read-{label}").start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                try:
                    self.events.put(json.loads(line))
                    continue
                except json.JSONDecodeError:
                    pass
            if line:
                self.noise.append(line[:300])
        self.events.put({"event": "exit"})

    def stderr_tail(self) -> str:
        return _tail(self.stderr_path, 1500).strip()

    def wait_event(self, kind: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"{self.label}: no '{kind}' within {timeout:.0f} s")
            try:
                ev = self.events.get(timeout=min(left, 0.5))
            except Empty:
                continue
            if ev.get("event") == kind:
                return ev
            if ev.get("event") == "error":
                raise WorkerError(f"{self.label}: {ev.get('error')}\n{ev.get('traceback', '')[-1200:]}")
            if ev.get("event") == "exit":
                try:
                    rc = self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    rc = None
                raise WorkerError(f"{self.label} exited (rc {rc}) before '{kind}'; stderr: "
                                  f"{self.stderr_tail()[-800:] or '(empty)'}")

    def go(self, t_go: float) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"go {t_go:.6f}\n")
        self.proc.stdin.flush()

    def finish(self) -> None:
        """Reap the child; kill it (it is ours, by pid) if it has not exited within a few seconds."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


@dataclass(frozen=True)
class TenantSpec:
    label: str
    workload: str
    share_pct: int | None  # MPS active-thread percentage; None = no MPS
    env: dict[str, str]


# --- dry-run stand-in for pynvml ---------------------------------------------------------------------------
class _FakeNvmlError(Exception):
    pass


class _FakeNvmlNotFound(_FakeNvmlError):
    pass


class FakeNvml:
    """Just the pynvml calls ``NvmlBackend`` makes, driven by which fake workers are measuring."""

    NVMLError = _FakeNvmlError
    NVMLError_NotFound = _FakeNvmlNotFound
    MIB = 2**20

    def __init__(self, busy: Callable[[], set[int]]) -> None:
        self._busy = busy

    def nvmlInit(self) -> None:
        return None

    def nvmlShutdown(self) -> None:
        return None

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        return "Dry-run stand-in H200"

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return "GPU-DRY-RUN-0"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(total=141 * 1024 * self.MIB, used=(500 + 1024 * len(self._busy())) * self.MIB)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> types.SimpleNamespace:
        util = min(100, 60 * len(self._busy()))
        return types.SimpleNamespace(gpu=util, memory=util // 2)

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[types.SimpleNamespace]:
        return [types.SimpleNamespace(pid=p, usedGpuMemory=1024 * self.MIB) for p in sorted(self._busy())]

    def nvmlDeviceGetProcessUtilization(self, h: int, ts: int) -> list[types.SimpleNamespace]:
        busy = sorted(self._busy())
        if not busy:
            raise _FakeNvmlNotFound("no samples")
        return [types.SimpleNamespace(pid=p, timeStamp=int(time.time() * 1e6), smUtil=60, memUtil=30) for p in busy]


# --- the check -------------------------------------------------------------------------------------------
class DeviceCheck:
    """Stages, budget, children, JSON and summary of one run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dry = bool(args.dry_run)
        self.window = float(args.seconds if args.seconds is not None else
                            DRY_WINDOW_S if self.dry else QUICK_WINDOW_S if args.quick else DEFAULT_WINDOW_S)
        self.budget = float(args.budget_s)
        self.out = Path(args.out)
        self.t0 = time.monotonic()
        self.tmp = Path(tempfile.mkdtemp(prefix="elastico-device-check-"))
        self.go_delay = 0.02 if self.dry else 0.3
        self.startup_est = 1.0 if self.dry else 20.0  # seconds from spawn to 'ready'; first one imports torch cold
        self.ready_timeout = 20.0 if self.dry else 90.0
        self.live: list[Child] = []
        self.measuring: set[int] = set()
        self.backend: Any = None
        self.gpu_mod: types.ModuleType | None = None
        self.mps_mod: types.ModuleType | None = None
        self.import_info: dict[str, Any] | None = None
        self.mem_total_mib: int | None = None
        self.solo_plain: dict[str, float] = {}
        self.solo_mps: dict[str, dict[int, float]] = {}
        self.mps_ok = False
        self.n_meas = 0
        plan = self._plan()
        self.report: dict[str, Any] = {
            "schema": SCHEMA, "status": "running", "mode": "dry-run" if self.dry else "gpu",
            "started_at": _now(), "finished_at": None, "elapsed_s": 0.0, "budget_s": self.budget,
            "window_s": self.window, "args": {k: v for k, v in vars(args).items() if k not in ("worker", "fake")},
            "workloads": WORKLOADS, "plan": plan, "stages": {}, "summary": [],
        }

    # --- bookkeeping -------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def remaining(self) -> float:
        return self.budget - self.elapsed()

    def say(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)

    def _plan(self) -> dict[str, Any]:
        n = 1 + len(WORKLOADS) + 1 + len(WORKLOADS) * len(MPS_SHARES) + len(PAIRS) * len(PAIR_SHARES)
        per = self.window + (1.0 if self.dry else 5.0) + self.go_delay
        return {"measurements": n, "optional_timeslice_pairs": len(PAIRS),
                "estimated_s": round(n * per + (1 if self.dry else 25), 1),
                "assumes_startup_s": 1.0 if self.dry else 5.0}

    def write(self) -> None:
        self.report["elapsed_s"] = round(self.elapsed(), 2)
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            path = self.out / JSON_NAME
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.report, indent=1, default=str))
            os.replace(tmp, path)
        except OSError as exc:
            print(f"device_check: cannot write {self.out / JSON_NAME}: {exc}", file=sys.stderr, flush=True)

    def stage(self, name: str, fn: Callable[[dict[str, Any]], None], min_s: float) -> None:
        res: dict[str, Any] = {}
        entry: dict[str, Any] = {"status": "running", "started_s": round(self.elapsed(), 2), "elapsed_s": None,
                                 "error": None, "result": res}
        self.report["stages"][name] = entry
        if self.remaining() < min_s:
            entry.update(status="skipped", error=f"budget: {self.remaining():.0f} s left, stage needs ~{min_s:.0f} s")
            self.say(f"stage {name}: SKIPPED ({entry['error']})")
            self.write()
            return
        self.say(f"stage {name} ...")
        self.write()
        t = time.monotonic()
        try:
            fn(res)
            entry["status"] = "ok"
        except Terminated:
            entry.update(status="interrupted", error="terminated (SIGTERM/SIGINT)")
            raise
        except Exception as exc:  # noqa: BLE001 - recorded; the next stage runs
            entry.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
        finally:
            entry["elapsed_s"] = round(time.monotonic() - t, 2)
            self.say(f"stage {name}: {entry['status'].upper()} in {entry['elapsed_s']:.1f} s"
                     + (f" -- {entry['error']}" if entry["error"] else ""))
            self.write()

    def measurement_cost(self, seconds: float) -> float:
        return self.startup_est + seconds + self.go_delay + 1.0

    def _grace(self, timeout: float) -> float:
        """A child's wait, shortened near the end of the budget (the run must end well inside its limit)."""
        return min(timeout, max(15.0 if not self.dry else timeout, self.remaining() + 30.0))

    def child_env(self, extra: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["PYTHONUNBUFFERED"] = "1"
        env["PATH"] = os.pathsep.join([env.get("PATH", "")] + list(TOOL_DIRS))
        env.update(extra)
        return env

    # --- one measurement ------------------------------------------------------------------------------
    def measure(self, label: str, mode: str, tenants: list[TenantSpec], seconds: float,
                ready_timeout: float | None = None, mps: Any = None) -> dict[str, Any]:
        """Start every tenant, wait until all are warm, measure them over one common window."""
        rec: dict[str, Any] = {"label": label, "mode": mode, "window_s": seconds, "tenants": [], "counters": None,
                               "error": None}
        cost = self.measurement_cost(seconds)
        if self.remaining() < cost:
            rec["error"] = f"skipped: budget ({self.remaining():.0f} s left, needs ~{cost:.0f} s)"
            rec["skipped"] = True
            self.say(f"  {label}: SKIPPED (budget)")
            return rec
        t = time.monotonic()
        children: list[Child] = []
        try:
            for tn in tenants:
                c = Child(tn.label, tn.workload, seconds, self.child_env(tn.env), self.dry, self.tmp)
                children.append(c)
                self.live.append(c)
            deadline = time.monotonic() + self._grace(ready_timeout or self.ready_timeout)
            readies = [c.wait_event("ready", max(0.1, deadline - time.monotonic())) for c in children]
            startup = max(time.monotonic() - c.t_spawn for c in children)
            self.startup_est = max(1.0 if self.dry else 3.0, startup + 1.0)
            t_go = time.time() + self.go_delay
            for c in children:
                c.go(t_go)
                self.measuring.add(c.proc.pid)
            rec["counters"] = self.sample(t_go, seconds, {c.label: c.proc.pid for c in children}, mps)
            results = [c.wait_event("result", seconds + self._grace(60.0)) for c in children]
            for tn, c, ready, res in zip(tenants, children, readies, results):
                rec["tenants"].append({
                    "label": tn.label, "workload": tn.workload, "share_pct": tn.share_pct, "pid": c.proc.pid,
                    "steps_per_s": res["steps_per_s"], "steps": res["steps"], "seconds": res["seconds"],
                    "start_lag_s": res.get("start_lag_s"), "startup_s": ready.get("startup_s"),
                    "sm_count_seen": ready.get("sm_count"), "share_env_seen": ready.get("share_env"),
                    "peak_mem_mib": res.get("peak_mem_mib"), "latency_ms": res.get("latency_ms"),
                })
        except Terminated:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded with the measurement
            rec["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            for c in children:
                self.measuring.discard(c.proc.pid)
                c.finish()
                if c in self.live:
                    self.live.remove(c)
            rec["wall_s"] = round(time.monotonic() - t, 2)
            self.n_meas += 1
        rates = "  ".join(f"{x['label']} {x['steps_per_s']:.1f}/s" for x in rec["tenants"])
        self.say(f"  {label}: {rates or 'FAILED: ' + str(rec['error'])[:300]}")
        return rec

    def sample(self, t_go: float, seconds: float, pids: dict[str, int], mps: Any) -> dict[str, Any] | None:
        """NVML device and per-process counters inside the window (GPM needs two samples), MPS health."""
        if self.backend is None and mps is None:
            return None
        out: dict[str, Any] = {}
        try:
            time.sleep(max(0.0, t_go + 0.25 * seconds - time.time()))
            if self.backend is not None:
                self.backend.gpus()
            time.sleep(max(0.0, t_go + 0.75 * seconds - time.time()))
            if self.backend is not None:
                gpus = self.backend.gpus()
                out["gpu0"] = _asdict(gpus[0].counters) if gpus else None
                procs = self.backend.process_counters()
                out["processes"] = {str(pid): _asdict(c) for pid, c in procs.items()}
                out["tenant_pids_seen"] = {label: str(pid) in out["processes"] for label, pid in pids.items()}
            if mps is not None:
                h = mps.health()
                out["mps_health"] = {"state": h.state, "servers": list(h.server_pids),
                                     "clients": sorted(h.client_pids), "detail": h.detail}
        except Exception as exc:  # noqa: BLE001
            out["error"] = f"{type(exc).__name__}: {exc}"
        return out

    # --- stages ---------------------------------------------------------------------------------------
    def stage_environment(self, res: dict[str, Any]) -> None:
        res["python"] = sys.version.split()[0]
        res["platform"] = platform.platform()
        res["packages"] = {d: _pkg_version(d) for d in ("torch", "nvidia-ml-py", "grpcio", "protobuf", "numpy")}
        res["env"] = {k: v for k, v in os.environ.items()
                      if k.startswith(("CUDA_", "NVIDIA_")) or k in ("LD_LIBRARY_PATH",)}
        res["mps_control"] = _find_tool("nvidia-cuda-mps-control")
        res["mps_server"] = _find_tool("nvidia-cuda-mps-server")
        res["default_mps_pipe_dir_exists"] = Path("/tmp/nvidia-mps").exists()  # a system MPS daemon already up?
        res["mps_processes_before"] = _mps_processes()
        smi = _find_tool("nvidia-smi")
        res["nvidia_smi"] = smi
        if smi and not self.dry:
            try:
                q = _run([smi, "-q"], 60)
                lines = q.stdout.splitlines()
                excerpt = [ln.rstrip() for ln in lines if ln.strip().startswith(SMI_KEYS)]
                for i, ln in enumerate(lines):
                    if ln.strip().startswith("MIG Mode"):
                        excerpt.extend(x.rstrip() for x in lines[i:i + 3])
                res["smi_q_excerpt"] = excerpt[:80]
                res["smi_q_rc"] = q.returncode
            except Exception as exc:  # noqa: BLE001
                res["smi_q_error"] = f"{type(exc).__name__}: {exc}"
            try:
                q = _run([smi, f"--query-gpu={SMI_QUERY}", "--format=csv"], 60)
                res["smi_query"] = q.stdout.strip() or q.stderr.strip()
            except Exception as exc:  # noqa: BLE001
                res["smi_query_error"] = f"{type(exc).__name__}: {exc}"
        if self.dry:
            res["torch_runtime"] = {"skipped": "dry-run"}
            return
        c = Child("torch-info", "info", 0, self.child_env({}), False, self.tmp)
        try:
            ev = c.wait_event("info", 150)
            ev.pop("event", None)
            res["torch_runtime"] = ev
        finally:
            c.finish()

    def stage_nvml(self, res: dict[str, Any]) -> None:
        self.gpu_mod, self.mps_mod, self.import_info = load_project()
        res["import"] = self.import_info
        if self.gpu_mod is None:
            raise RuntimeError(f"cannot import services.node_agent.gpu: {self.import_info['errors']}")
        nvml = FakeNvml(lambda: set(self.measuring)) if self.dry else None
        self.backend = self.gpu_mod.NvmlBackend(nvml=nvml)
        res["backend"] = f"{type(self.backend).__module__}.{type(self.backend).__qualname__}"
        res["gpm_supported"] = list(getattr(self.backend, "_gpm", []))
        nap = 0.05 if self.dry else 1.0
        first = self.backend.gpus()
        time.sleep(nap)
        idle = self.backend.gpus()
        res["inventory"] = [_asdict(g) for g in idle]
        res["gpu_type"] = idle[0].gpu_type if idle else None
        self.mem_total_mib = int(idle[0].mem_total_mib) if idle else None
        res["idle"] = {"first_read": _asdict(first[0].counters) if first else None,
                       "counters": _asdict(idle[0].counters) if idle else None,
                       "raw_utilization": self._raw_util(), "processes": {
                           str(p): _asdict(c) for p, c in self.backend.process_counters().items()}}
        self.write()
        load_s = self.window if self.dry else max(4.0, self.window)
        rec = self.measure("nvml load (mlp_bf16, no MPS)", "plain", [TenantSpec("mlp_bf16", "mlp_bf16", None, {})],
                           load_s)
        res["load"] = rec
        if rec["error"]:
            raise RuntimeError(f"load run failed: {rec['error']}")
        res["load_raw_utilization_after"] = self._raw_util()  # after the child exits: should fall back
        idle_c, load_c = res["idle"]["counters"] or {}, (rec["counters"] or {}).get("gpu0") or {}
        res["comparison"] = {k: {"idle": idle_c.get(k), "load": load_c.get(k)}
                             for k in ("sm_util_pct", "mem_bw_util_pct", "tensor_util_pct", "mem_used_mib")}
        i_sm, l_sm = idle_c.get("sm_util_pct"), load_c.get("sm_util_pct")
        res["util_higher_under_load"] = (i_sm is not None and l_sm is not None and l_sm > i_sm)
        res["load_pid_in_process_counters"] = any((rec["counters"] or {}).get("tenant_pids_seen", {}).values())
        if not res["util_higher_under_load"]:
            raise RuntimeError(f"sm_util_pct not higher under load: idle {i_sm}, load {l_sm}")

    def _raw_util(self) -> dict[str, Any] | None:
        """``nvmlDeviceGetUtilizationRates`` directly (the backend replaces it with GPM where supported)."""
        try:
            nv, h = self.backend._nvml, self.backend._handles[0]
            u = nv.nvmlDeviceGetUtilizationRates(h)
            return {"gpu": float(u.gpu), "memory": float(u.memory)}
        except Exception as exc:  # noqa: BLE001
            return {"error": f"{type(exc).__name__}: {exc}"}

    def stage_solo(self, res: dict[str, Any]) -> None:
        runs: dict[str, Any] = {}
        res["runs"] = runs
        for w in WORKLOADS:
            rec = self.measure(f"solo {w} (no MPS)", "plain", [TenantSpec(w, w, None, {})], self.window)
            runs[w] = rec
            if rec["tenants"]:
                self.solo_plain[w] = rec["tenants"][0]["steps_per_s"]
            self.write()
        failed = [w for w, r in runs.items() if r["error"]]
        if failed:
            raise RuntimeError(f"solo runs failed or skipped: {', '.join(failed)}")

    def _mps_mem_mib(self) -> int:
        """Pinned memory limit per client: a third of the GPU (the workloads need ~1-2 GiB)."""
        return max(4096, (self.mem_total_mib or 3 * 16384) // 3)

    def stage_mps(self, res: dict[str, Any]) -> None:
        if self.mps_mod is None:
            self.gpu_mod, self.mps_mod, self.import_info = load_project()
        res["available"] = False
        if self.mps_mod is None:
            raise RuntimeError(f"cannot import services.node_agent.mps: {(self.import_info or {}).get('errors')}")
        pipe = Path(tempfile.mkdtemp(prefix="elastico-mps-pipe-", dir="/tmp"))
        logd = Path(tempfile.mkdtemp(prefix="elastico-mps-log-", dir="/tmp"))
        res["pipe_dir"], res["log_dir"] = str(pipe), str(logd)
        if self.dry:
            ctl = self.mps_mod.SimulatedMps(pipe, logd)
        else:
            binary = _find_tool("nvidia-cuda-mps-control")
            res["control_bin"] = binary
            if binary is None:
                res["reason"] = "nvidia-cuda-mps-control not found (PATH, " + ", ".join(TOOL_DIRS) + ")"
                raise RuntimeError(res["reason"])
            ctl = self.mps_mod.RealMps(pipe, logd, control_bin=binary, control_timeout_s=15.0)
        res["controller"] = f"{type(ctl).__module__}.{type(ctl).__qualname__}"
        started = False
        try:
            started = True  # from here on, always quit (a failed start may still have left a daemon)
            try:
                ctl.start()
            except Exception as exc:
                res["reason"] = f"control daemon did not start: {type(exc).__name__}: {exc}"
                raise
            time.sleep(0.05 if self.dry else 0.5)
            res["daemon_pid_from_pid_file"] = ctl.daemon_pid()
            res["pipe_dir_files"] = sorted(p.name for p in pipe.iterdir())
            res["mps_processes_after_start"] = _mps_processes()
            mem = self._mps_mem_mib()
            res["pinned_mem_limit_mib"] = mem

            def spec(label: str, w: str, share: int) -> TenantSpec:
                return TenantSpec(label, w, share, dict(ctl.client_env((0,), share, mem)))

            probe = self.measure("mps probe (tiny_mlp @100)", "mps", [spec("probe", "tiny_mlp", 100)],
                                 min(0.5, self.window), ready_timeout=45.0 if not self.dry else None, mps=ctl)
            res["probe"] = probe
            if probe["error"]:
                res["reason"] = f"first MPS client failed: {probe['error']}"
                raise RuntimeError(res["reason"])
            self.mps_ok = res["available"] = True
            res["client_env_example"] = dict(ctl.client_env((0,), 50, mem))
            solo: dict[str, dict[str, Any]] = {w: {} for w in WORKLOADS}
            pairs: list[dict[str, Any]] = []
            res["solo"], res["pairs"] = solo, pairs

            def run_solo(share: int) -> None:
                for w in WORKLOADS:
                    rec = self.measure(f"mps solo {w} @{share}", "mps", [spec(w, w, share)], self.window, mps=ctl)
                    if rec["tenants"]:
                        self.solo_mps.setdefault(w, {})[share] = rec["tenants"][0]["steps_per_s"]
                        base = self.solo_mps[w].get(100)
                        rec["tenants"][0]["norm_vs_mps100"] = rec["tenants"][0]["steps_per_s"] / base if base else None
                    solo[w][str(share)] = rec
                    self.write()

            def run_pairs(share: int) -> None:
                for a, b in PAIRS:
                    la, lb = (f"{a}#1", f"{b}#2") if a == b else (a, b)
                    rec = self.measure(f"mps pair {SHORT[a]}+{SHORT[b]} {a}+{b} @{share}/{share}", "mps",
                                       [spec(la, a, share), spec(lb, b, share)], self.window, mps=ctl)
                    rec.update(pair=f"{a}+{b}", shares=[share, share])
                    self._normalise(rec, {w: v.get(100) for w, v in self.solo_mps.items()},
                                    {w: v.get(share) for w, v in self.solo_mps.items()})
                    pairs.append(rec)
                    self.write()

            run_solo(100)
            run_pairs(100)
            run_solo(50)
            run_solo(25)
            run_pairs(50)
            res["share_limit"] = {w: {str(s): (v.get(s) / v[100] if v.get(100) and v.get(s) else None)
                                      for s in MPS_SHARES} for w, v in self.solo_mps.items()}
            bad = [r["label"] for r in pairs if r["error"]] + [
                r["label"] for w in solo.values() for r in w.values() if r["error"]]
            if bad:
                raise RuntimeError(f"{len(bad)} MPS measurement(s) failed or skipped: {'; '.join(bad)}")
        finally:
            if started:
                self._stop_mps(ctl, res)

    def _stop_mps(self, ctl: Any, res: dict[str, Any]) -> None:
        stop: dict[str, Any] = {}
        res["shutdown"] = stop
        try:
            had_pid = ctl.daemon_pid() is not None
            ctl.stop()  # echo quit | nvidia-cuda-mps-control (only when the pid file names a live daemon)
            if not had_pid and not self.dry:  # pid file not where mps.py expects it: quit directly
                binary = getattr(ctl, "_bin", None) or _find_tool("nvidia-cuda-mps-control")
                if binary:
                    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(ctl.pipe_dir),
                           "CUDA_MPS_LOG_DIRECTORY": str(ctl.log_dir)}
                    q = _run([binary], 15, input="quit\n", env=env)
                    stop["direct_quit"] = {"rc": q.returncode, "out": (q.stdout + q.stderr).strip()[-500:]}
            deadline = time.monotonic() + (1 if self.dry else 10)
            while ctl.daemon_pid() is not None and time.monotonic() < deadline:
                time.sleep(0.2)
            stop["daemon_gone"] = ctl.daemon_pid() is None
            deadline = time.monotonic() + (0 if self.dry else 5)  # servers exit once their clients have
            while _mps_processes() and time.monotonic() < deadline:
                time.sleep(0.2)
        except Exception as exc:  # noqa: BLE001
            stop["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            stop["mps_processes_after_quit"] = _mps_processes()
            res["commands"] = list(getattr(ctl, "commands", []))
            res["log_tail"] = {p.name: _tail(p, 1500) for p in sorted(Path(ctl.log_dir).glob("*.log"))}
            self.say(f"  MPS quit: daemon gone={stop.get('daemon_gone')} "
                     f"left={[p['comm'] for p in stop['mps_processes_after_quit']]}")

    def stage_timeslice(self, res: dict[str, Any]) -> None:
        res["required"] = not self.mps_ok
        res["reason"] = ("MPS unavailable: pairs run with plain time-slicing" if not self.mps_ok
                         else "MPS worked: time-sliced pairs for comparison, as far as the budget allows")
        pairs: list[dict[str, Any]] = []
        res["pairs"] = pairs
        for a, b in PAIRS:
            if self.mps_ok and self.remaining() < self.measurement_cost(self.window) + 15:
                res["stopped_early"] = f"budget ({self.remaining():.0f} s left)"
                break
            la, lb = (f"{a}#1", f"{b}#2") if a == b else (a, b)
            rec = self.measure(f"time-sliced pair {SHORT[a]}+{SHORT[b]} {a}+{b} (no MPS)", "time-slicing",
                               [TenantSpec(la, a, None, {}), TenantSpec(lb, b, None, {})], self.window)
            rec.update(pair=f"{a}+{b}", shares=[None, None])
            self._normalise(rec, self.solo_plain, None)
            pairs.append(rec)
            self.write()
        bad = [r["label"] for r in pairs if r["error"]]
        if bad and res["required"]:
            raise RuntimeError(f"{len(bad)} time-sliced pair(s) failed or skipped: {'; '.join(bad)}")

    @staticmethod
    def _normalise(rec: dict[str, Any], base: dict[str, float] | dict[str, float | None],
                   same_share: dict[str, float | None] | None) -> None:
        total: float | None = 0.0
        for t in rec["tenants"]:
            b = base.get(t["workload"])
            t["norm"] = t["steps_per_s"] / b if b else None
            if same_share is not None:
                s = same_share.get(t["workload"])
                t["norm_vs_solo_same_share"] = t["steps_per_s"] / s if s else None
            total = total + t["norm"] if (total is not None and t["norm"] is not None) else None
        rec["combined_norm"] = total if rec["tenants"] else None

    # --- run ------------------------------------------------------------------------------------------
    def run(self) -> int:
        p = self.report["plan"]
        self.say(f"ElastiCo device check ({self.report['mode']}): window {self.window:g} s, budget {self.budget:g} s, "
                 f"{p['measurements']} measurements planned, ~{p['estimated_s']:.0f} s; JSON -> {self.out / JSON_NAME}")
        self.write()
        per = self.measurement_cost(self.window)
        try:
            self.stage("environment", self.stage_environment, 1.0 if self.dry else 10.0)
            self.stage("nvml", self.stage_nvml, per)
            self.stage("solo", self.stage_solo, per)
            self.stage("mps", self.stage_mps, per)
            self.stage("timeslice", self.stage_timeslice, per)
            bad = [n for n, s in self.report["stages"].items() if s["status"] != "ok"]
            self.report["status"] = "complete" if not bad else "partial"
            rc = 0 if not bad else 1
        except Terminated:
            self.report["status"] = "interrupted"
            rc = 143
        finally:
            for c in list(self.live):
                c.finish()
            if self.backend is not None:
                try:
                    self.backend.close()
                except Exception:  # noqa: BLE001
                    pass
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.report["finished_at"] = _now()
            self.report["elapsed_s"] = round(self.elapsed(), 2)
            try:
                self.report["summary"] = summary_lines(self.report)
            except Exception as exc:  # noqa: BLE001
                self.report["summary"] = [f"(summary failed: {type(exc).__name__}: {exc})"]
            self.write()
        print("\n".join(self.report["summary"]), flush=True)
        return rc


# --- summary ------------------------------------------------------------------------------------------------
def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


def _pair_line(rec: dict[str, Any]) -> str:
    if rec.get("error") and not rec.get("tenants"):
        return f"  {rec.get('pair', rec['label']):<22} {str(rec['error'])[:90]}"
    parts = [f"{t['label']} {_f(t['steps_per_s'])}/s ({_f(t.get('norm'), '{:.2f}')})" for t in rec["tenants"]]
    total = _f(rec.get("combined_norm"), "{:.2f}")
    return f"  {rec.get('pair', rec['label']):<22} " + "  +  ".join(parts) + f"   sum {total}"


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The readable end-of-run summary (also stored in the JSON)."""
    st = report["stages"]
    out = ["", "=" * 100, f"ElastiCo device check -- {report['mode']}, status {report['status']}, "
           f"{report['elapsed_s']:.0f} s, window {report['window_s']:g} s", "=" * 100]
    for name, s in st.items():
        out.append(f"  {name:<12} {s['status']:<11} {_f(s.get('elapsed_s'))} s"
                   + (f"  {str(s['error'])[:150]}" if s.get("error") else ""))
    env = (st.get("environment") or {}).get("result", {})
    if env:
        tr = env.get("torch_runtime") or {}
        torch_v = tr.get("torch") or env.get("packages", {}).get("torch")
        out.append(f"GPU: {tr.get('device', '?')} ({tr.get('sm_count', '?')} SMs)  torch {torch_v} "
                   f"CUDA {tr.get('cuda', '?')}  mps-control {env.get('mps_control')}")
        if env.get("smi_query"):
            out.append("nvidia-smi: " + " | ".join(env["smi_query"].splitlines()[-1:]))
    nv = (st.get("nvml") or {}).get("result", {})
    if nv.get("comparison"):
        c = nv["comparison"]
        out.append(f"NVML ({nv.get('backend')}, gpu_type {nv.get('gpu_type')}, GPM {nv.get('gpm_supported')}): "
                   + ", ".join(f"{k} {_f(v['idle'])} -> {_f(v['load'])}" for k, v in c.items())
                   + f"; higher under load: {nv.get('util_higher_under_load')}")
        if nv.get("import", {}).get("stand_ins"):
            out.append("  stand-ins: " + "; ".join(s[:80] for s in nv["import"]["stand_ins"]))
    solo = (st.get("solo") or {}).get("result", {}).get("runs", {})
    mps = (st.get("mps") or {}).get("result", {})
    if solo or mps.get("solo"):
        out.append(f"{'steps/s':<12} {'no MPS':>10} " + " ".join(f"{'MPS ' + str(s):>10}" for s in MPS_SHARES)
                   + "   share limit 50 / 25 (vs MPS 100)")
        for w in WORKLOADS:
            plain = (solo.get(w) or {}).get("tenants") or [{}]
            row = [f"{w:<12} {_f(plain[0].get('steps_per_s')):>10}"]
            for s in MPS_SHARES:
                t = (((mps.get("solo") or {}).get(w) or {}).get(str(s)) or {}).get("tenants") or [{}]
                row.append(f"{_f(t[0].get('steps_per_s')):>10}")
            lim = (mps.get("share_limit") or {}).get(w) or {}
            out.append(" ".join(row) + f"   {_f(lim.get('50'), '{:.2f}')} / {_f(lim.get('25'), '{:.2f}')}")
    if mps:
        out.append(f"MPS: available={mps.get('available')}" + (f" ({mps.get('reason')})" if mps.get("reason") else "")
                   + f", pid file found={mps.get('daemon_pid_from_pid_file') is not None}"
                   + f", quit ok={(mps.get('shutdown') or {}).get('daemon_gone')}")
    for share in PAIR_SHARES:
        rows = [r for r in mps.get("pairs", []) if r.get("shares") == [share, share]]
        if rows:
            out.append(f"MPS pairs @{share}/{share} -- steps/s (normalised to solo MPS 100), sum of normalised:")
            out.extend(_pair_line(r) for r in rows)
    ts = (st.get("timeslice") or {}).get("result", {})
    if ts.get("pairs"):
        out.append("time-sliced pairs, no MPS -- steps/s (normalised to solo without MPS), sum:")
        out.extend(_pair_line(r) for r in ts["pairs"])
    out.append("(the simulator's pair figures are Gavel's measured V100/P100/K80 pairs; compare the sums above)")
    return out


# --- entry point ----------------------------------------------------------------------------------------------
def gpu_missing_reason() -> str | None:
    """None when this machine has an NVIDIA GPU (NVML or nvidia-smi sees one), else why not."""
    why = []
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            if pynvml.nvmlDeviceGetCount() > 0:
                return None
            why.append("NVML sees 0 GPUs")
        finally:
            pynvml.nvmlShutdown()
    except ImportError:
        why.append("pynvml (nvidia-ml-py) not installed")
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound etc.
        why.append(f"NVML: {exc}")
    smi = _find_tool("nvidia-smi")
    if smi is None:
        why.append("nvidia-smi not found")
    else:
        try:
            q = _run([smi, "-L"], 30)
            if q.returncode == 0 and "GPU " in q.stdout:
                return None
            why.append(f"nvidia-smi -L: {(q.stdout + q.stderr).strip()[:200]}")
        except Exception as exc:  # noqa: BLE001
            why.append(f"nvidia-smi -L: {exc}")
    return "; ".join(why)


def parse_args(argv: Iterable[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python3 -m bench.device_check", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."),
                    help="folder for device_check.json (default $OUT or .)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="global time budget in seconds (default 300)")
    ap.add_argument("--seconds", type=float, default=None,
                    help=f"measurement window per run (default {DEFAULT_WINDOW_S:g}; --quick {QUICK_WINDOW_S:g}; "
                         f"--dry-run {DRY_WINDOW_S:g})")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_WINDOW_S:g} s windows")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: fake workers, stand-in NVML, simulated MPS")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # child mode: one workload
    ap.add_argument("--fake", action="store_true", help=argparse.SUPPRESS)  # child mode: sleep, constant rate
    return ap.parse_args(None if argv is None else list(argv))


def _on_signal(signum: int, frame: Any) -> None:
    raise Terminated(signum)


def main(argv: Iterable[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args.worker, float(args.seconds or 0.0), args.fake)
    if (args.seconds is not None and args.seconds <= 0) or args.budget_s <= 0:
        print("device_check: --seconds and --budget-s must be > 0", file=sys.stderr)
        return 2
    if not args.dry_run:
        why = gpu_missing_reason()
        if why is not None:
            out = Path(args.out)
            try:
                out.mkdir(parents=True, exist_ok=True)
                (out / JSON_NAME).write_text(json.dumps({"schema": SCHEMA, "status": "no_gpu", "mode": "gpu",
                                                         "error": why, "started_at": _now()}, indent=1))
            except OSError:
                pass
            print(f"device_check: no NVIDIA GPU on this machine ({why}).\n"
                  "Run it on the GPU machine, or pass --dry-run to exercise the orchestration with fake workers.",
                  file=sys.stderr, flush=True)
            return 2
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    return DeviceCheck(args).run()


if __name__ == "__main__":
    sys.exit(main())
