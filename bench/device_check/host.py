"""The machine under the device check: its NVIDIA tools, MPS processes and GPU, and small shared helpers."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCHEMA = "elastico.device_check/1"
JSON_NAME = "device_check.json"
# containers often leave the driver's folders off PATH
TOOL_DIRS = ("/usr/local/nvidia/bin", "/usr/bin", "/usr/local/bin", "/usr/local/cuda/bin", "/usr/sbin", "/sbin")


class WorkerError(RuntimeError):
    """A measurement child failed, hung or exited early."""


class Terminated(BaseException):
    """SIGTERM/SIGINT: unwind through every ``finally`` (children killed, MPS quit, JSON written)."""


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def find_tool(name: str) -> str | None:
    """``name`` on PATH, else in the usual NVIDIA driver folders."""
    found = shutil.which(name)
    if found:
        return found
    for d in TOOL_DIRS:
        p = Path(d) / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def run_cmd(cmd: list[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, **kw)


def tail(path: Path, chars: int = 2000) -> str:
    try:
        data = path.read_text(errors="replace")
    except OSError:
        return ""
    return data[-chars:]


def pkg_version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def as_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj


def mps_processes() -> list[dict[str, Any]]:
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
    smi = find_tool("nvidia-smi")
    if smi is None:
        why.append("nvidia-smi not found")
    else:
        try:
            q = run_cmd([smi, "-L"], 30)
            if q.returncode == 0 and "GPU " in q.stdout:
                return None
            why.append(f"nvidia-smi -L: {(q.stdout + q.stderr).strip()[:200]}")
        except Exception as exc:  # noqa: BLE001
            why.append(f"nvidia-smi -L: {exc}")
    return "; ".join(why)


def refuse(out: Path, json_name: str, schema: str, status: str, mode: str, error: str, message: str) -> int:
    """Write the one-line report of a run that cannot start (``out/json_name``), print why; exit status 2."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / json_name).write_text(json.dumps({"schema": schema, "status": status, "mode": mode, "error": error,
                                                 "started_at": now()}, indent=1))
    except OSError:
        pass
    print(message, file=sys.stderr, flush=True)
    return 2
