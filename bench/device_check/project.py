"""The node agent's own code under test (``NvmlBackend``, ``RealMps``), and a stand-in pynvml for ``--dry-run``.

The GPU machine has torch, pynvml, grpcio, protobuf and numpy but no virtualenv. ``services.node_agent.gpu`` and
``.mps`` need, beyond the standard library, only ``elastico.domain``/``errors``/``logging`` and structlog, which
travels as an unpacked wheel (``make device-deps``). Nothing is faked in the import: a missing module stops the
run before its first stage, named, with the way to provide it.
"""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Callable

from bench.device_check.host import REPO

DEPS_HINT = ("run `make device-deps` in the project (it unpacks the pinned structlog wheel into .device-deps/site), "
             "carry .device-deps to this machine and start the check from the project root as "
             "`PYTHONPATH=.device-deps/site python3 -m bench.device_check ...`")


class MissingModule(RuntimeError):
    """The node agent's code cannot be imported on this machine."""


def load_project() -> tuple[types.ModuleType, types.ModuleType]:
    """``services.node_agent.gpu`` and ``services.node_agent.mps``, with the project's logging at warning level.

    Raises:
        MissingModule: a module they import is not installed (structlog, on a bare machine).
    """
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    try:
        from elastico.logging import configure_logging
        from services.node_agent import gpu, mps
    except ImportError as exc:
        missing = exc.name or str(exc)
        raise MissingModule(f"cannot import the node agent's code: module {missing!r} is missing ({exc}); "
                            f"{DEPS_HINT}") from exc
    configure_logging("device-check", level="warning")  # the backends' warnings on stderr, nothing else
    return gpu, mps


class _FakeNvmlError(Exception):
    pass


class _FakeNvmlNotFound(_FakeNvmlError):
    pass


class FakeNvml:
    """Just the pynvml calls ``NvmlBackend`` makes, driven by which fake workers are measuring (``--dry-run``)."""

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
