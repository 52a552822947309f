"""CUDA MPS behind one protocol: the real control daemon on GPU nodes, a simulated one everywhere else.

What the agent needs from MPS (NVIDIA, "Multi-Process Service", Appendix: Tools and Interface Reference):

- one control daemon per node, started with ``nvidia-cuda-mps-control -d`` and its own
  ``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY`` (so several agents or test runs on one host
  never share pipes), stopped with ``echo quit | nvidia-cuda-mps-control``;
- clients (every workload, all under the agent's UID: MPS serialises clients of different UIDs)
  launched with ``CUDA_VISIBLE_DEVICES``, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` — limits are fixed at launch, so a new shape means a restart;
- health: ``get_server_list``, ``get_server_status <PID>`` and ``get_client_list <PID>`` through
  ``echo <command> | nvidia-cuda-mps-control``. A control daemon that does not answer within
  ``control_timeout_s`` is *stuck*; one whose pid file is gone or dead is *dead*.

MPS does not isolate faults: a client's fatal GPU exception takes down the clients sharing its GPU,
and the server refuses new clients until every affected client has exited. ``fault_events()``
reports each such fault once, with the client pids it hit, so the reconciler can drain the GPU and
requeue the victims without penalty.

Both controllers share ``_ControlBase``, which builds every command and records it in
``commands`` exactly as NVIDIA's documentation writes it: tests assert on those sequences for the
simulated controller, and the real one issues the same strings.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from elastico.errors import Unavailable
from elastico.logging import get_logger

log = get_logger(component="mps")

CONTROL_BIN = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"  # written by the control daemon into CUDA_MPS_PIPE_DIRECTORY


def pinned_mem_limit(num_gpus: int, mem_mib: int) -> str:
    """``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` value: ``"0=4096M,1=4096M"``.

    Device ordinals are the client's own (after ``CUDA_VISIBLE_DEVICES`` remapping), so they always
    run 0..n-1 whatever physical GPUs the client sees.
    """
    return ",".join(f"{i}={int(mem_mib)}M" for i in range(num_gpus))


def thread_percentage(share_pct: float) -> str:
    """``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` value; integral shares print without a decimal point."""
    return str(int(share_pct)) if float(share_pct).is_integer() else f"{share_pct:g}"


@dataclass(frozen=True)
class MpsFault:
    """One fatal fault of an MPS server, reported once."""

    time_s: float
    client_pids: frozenset[int]  # clients it hit (they will exit or have exited)
    gpu_indices: frozenset[int] = frozenset()  # GPUs it hit when known (simulated); empty = "those of its clients"
    detail: str = ""


@dataclass(frozen=True)
class MpsHealth:
    """Result of one health probe."""

    state: str  # "ok", "dead" (control daemon gone), "stuck" (did not answer), "off" (MPS disabled)
    server_pids: tuple[int, ...] = ()
    client_pids: frozenset[int] = frozenset()
    detail: str = ""


class MpsController(Protocol):
    """What the reconciler needs from MPS."""

    name: str
    pipe_dir: Path
    log_dir: Path
    commands: deque[str]

    def start(self) -> None:
        """Start the control daemon unless one already serves ``pipe_dir`` (idempotent)."""
        ...

    def stop(self) -> None:
        """Quit the control daemon (servers exit once their clients are done)."""
        ...

    def client_env(self, gpu_indices: tuple[int, ...], share_pct: float, mem_mib: int) -> dict[str, str]:
        """Environment a client must be launched with to get exactly this slice."""
        ...

    def health(self) -> MpsHealth:
        """Probe the daemon; never raises."""
        ...

    def fault_events(self) -> list[MpsFault]:
        """Faults seen since the last call (each reported once)."""
        ...


class _ControlBase:
    """Command building, recording and health logic shared by the real and simulated daemons."""

    name = "base"

    def __init__(self, pipe_dir: Path, log_dir: Path, control_timeout_s: float = 5.0) -> None:
        self.pipe_dir = Path(pipe_dir)
        self.log_dir = Path(log_dir)
        self.control_timeout_s = control_timeout_s
        self.commands: deque[str] = deque(maxlen=4096)  # every command issued, newest last
        self._lock = threading.Lock()
        self._reported_faulty_servers: set[int] = set()

    # --- primitives -------------------------------------------------------------------------------
    def _daemon_env(self) -> dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def _spawn_daemon(self) -> None:
        raise NotImplementedError

    def _send(self, command: str) -> str:
        """Send one interactive command; returns its output. Raises TimeoutError when stuck, OSError when dead."""
        raise NotImplementedError

    def _record(self, line: str) -> None:
        with self._lock:
            self.commands.append(line)

    def control(self, command: str) -> str:
        """``echo <command> | nvidia-cuda-mps-control``."""
        self._record(f"echo {command} | {CONTROL_BIN}")
        return self._send(command)

    # --- lifecycle ----------------------------------------------------------------------------------
    def daemon_pid(self) -> int | None:
        """Pid of the control daemon serving ``pipe_dir``, if it is alive."""
        try:
            pid = int((self.pipe_dir / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _pid_alive(pid) else None

    def start(self) -> None:
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.daemon_pid() is not None:
            log.info("MPS control daemon already running; reusing it", pipe_dir=str(self.pipe_dir))
            return
        self._record(f"{CONTROL_BIN} -d")
        self._spawn_daemon()

    def stop(self) -> None:
        if self.daemon_pid() is None:
            return
        try:
            self.control("quit")
        except (TimeoutError, OSError) as exc:
            log.warning("MPS control daemon did not quit cleanly", error=str(exc))

    def client_env(self, gpu_indices: tuple[int, ...], share_pct: float, mem_mib: int) -> dict[str, str]:
        return {
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # CUDA ordinals = NVML indices (the placement's gpu_index)
            "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in gpu_indices),
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": thread_percentage(share_pct),
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": pinned_mem_limit(len(gpu_indices), mem_mib),
        }

    # --- health -------------------------------------------------------------------------------------
    def _servers(self) -> tuple[int, ...]:
        return tuple(int(tok) for tok in self.control("get_server_list").split() if tok.isdigit())

    def health(self) -> MpsHealth:
        if self.daemon_pid() is None:
            return MpsHealth("dead", detail=f"no live control daemon for {self.pipe_dir}")
        try:
            servers = self._servers()
            clients: set[int] = set()
            for pid in servers:
                clients.update(int(t) for t in self.control(f"get_client_list {pid}").split() if t.isdigit())
        except TimeoutError:
            return MpsHealth("stuck", detail=f"control daemon did not answer within {self.control_timeout_s}s")
        except OSError as exc:
            return MpsHealth("dead", detail=str(exc))
        return MpsHealth("ok", servers, frozenset(clients))

    def fault_events(self) -> list[MpsFault]:
        """Servers whose ``get_server_status`` reports a fault, once each, with their clients."""
        events: list[MpsFault] = []
        try:
            for pid in self._servers():
                if pid in self._reported_faulty_servers:
                    continue
                status = self.control(f"get_server_status {pid}").strip()
                if "fault" in status.lower():
                    self._reported_faulty_servers.add(pid)
                    clients = frozenset(int(t) for t in self.control(f"get_client_list {pid}").split() if t.isdigit())
                    events.append(MpsFault(time.time(), clients, detail=f"MPS server {pid}: {status}"))
        except (TimeoutError, OSError):
            return events  # health() reports the daemon state
        return events


class RealMps(_ControlBase):
    """The NVIDIA control daemon, driven through its binary.

    ``run_as`` (uid, gid): a root agent whose workloads run as an unprivileged user starts the daemon and sends
    its commands as that user, with the pipe and log directories owned by it, so that the daemon, its servers
    and every client share one UID (what MPS requires of the clients of a server).
    """

    name = "real"

    def __init__(self, pipe_dir: Path, log_dir: Path, control_bin: str = CONTROL_BIN, control_timeout_s: float = 5.0,
                 run_as: tuple[int, int] | None = None) -> None:
        super().__init__(pipe_dir, log_dir, control_timeout_s)
        self._user = {"user": run_as[0], "group": run_as[1], "extra_groups": []} if run_as else {}
        self._run_as = run_as
        path = shutil.which(control_bin)
        if path is None:
            raise Unavailable(f"{control_bin} not found on PATH; install the NVIDIA driver utilities "
                              "or set ELASTICO_MPS=off to run workloads without MPS limits")
        self._bin = path

    def _spawn_daemon(self) -> None:
        env = {**os.environ, **self._daemon_env()}
        env.pop("CUDA_VISIBLE_DEVICES", None)  # the daemon must see every GPU: clients select their own
        if self._run_as is not None:
            for d in (self.pipe_dir, self.log_dir):
                os.chown(d, *self._run_as)
        res = subprocess.run([self._bin, "-d"], env=env, capture_output=True, text=True, timeout=self.control_timeout_s,
                             **self._user)
        if res.returncode != 0:
            raise Unavailable(f"{CONTROL_BIN} -d failed ({res.returncode}): {res.stderr.strip() or res.stdout.strip()}")

    def _send(self, command: str) -> str:
        env = {**os.environ, **self._daemon_env()}
        try:
            res = subprocess.run([self._bin], input=command + "\n", env=env, capture_output=True, text=True,
                                 timeout=self.control_timeout_s, **self._user)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(command) from exc
        if res.returncode != 0:
            raise OSError(f"{command!r} failed ({res.returncode}): {res.stderr.strip()}")
        return res.stdout


class SimulatedMps(_ControlBase):
    """A stand-in daemon whose state lives in its pipe directory, like the real one's.

    Clients are found the way the real server knows them: processes of this UID launched with this
    ``CUDA_MPS_PIPE_DIRECTORY`` (read from ``/proc/<pid>/environ``); their GPUs come from their
    ``CUDA_VISIBLE_DEVICES``. Faults are injected from any process (tests) by dropping files into
    the pipe directory — ``inject_fault(gpu)`` makes the next probe kill every client of that GPU
    (as a real fatal exception does) and report one ``MpsFault``; ``inject_stuck()`` /
    ``inject_death()`` make the daemon hang or vanish.
    """

    name = "simulated"
    _FAULT_PREFIX = "sim-fault-gpu-"
    _STUCK = "sim-stuck"

    def _spawn_daemon(self) -> None:
        (self.pipe_dir / PID_FILE).write_text(f"{os.getpid()}\n")  # "the daemon" lives as long as the agent

    def _send(self, command: str) -> str:
        if (self.pipe_dir / self._STUCK).exists():
            raise TimeoutError(command)
        if self.daemon_pid() is None:
            raise OSError("control daemon is not running")
        verb, *args = command.split()
        if verb == "quit":
            (self.pipe_dir / PID_FILE).unlink(missing_ok=True)
            return ""
        if verb == "get_server_list":
            return f"{os.getpid()}\n" if self.clients() else ""
        if verb == "get_client_list":
            return "".join(f"{pid}\n" for pid in sorted(self.clients()))
        if verb == "get_server_status":
            return "ACTIVE\n"
        return ""

    def clients(self) -> dict[int, tuple[int, ...]]:
        """pid -> GPU indices of every live client of this daemon."""
        return find_clients(str(self.pipe_dir))

    # --- fault injection (callable from any process that knows the pipe directory) -------------
    def inject_fault(self, gpu_index: int) -> None:
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        (self.pipe_dir / f"{self._FAULT_PREFIX}{gpu_index}").write_text(f"{time.time()}\n")

    def inject_stuck(self, stuck: bool = True) -> None:
        path = self.pipe_dir / self._STUCK
        if stuck:
            path.write_text("1\n")
        else:
            path.unlink(missing_ok=True)

    def inject_death(self) -> None:
        (self.pipe_dir / PID_FILE).unlink(missing_ok=True)

    def fault_events(self) -> list[MpsFault]:
        events: list[MpsFault] = []
        for req in sorted(self.pipe_dir.glob(f"{self._FAULT_PREFIX}*")):
            gpu = int(req.name[len(self._FAULT_PREFIX):])
            victims = {pid for pid, gpus in self.clients().items() if gpu in gpus}
            for pid in victims:  # a fatal exception ends every client of the GPU
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            req.unlink(missing_ok=True)
            events.append(MpsFault(time.time(), frozenset(victims), frozenset({gpu}),
                                   detail=f"simulated fatal exception on GPU {gpu}"))
            log.warning("simulated MPS fault", gpu=gpu, victims=sorted(victims))
        return events


class NoMps:
    """MPS disabled (``ELASTICO_MPS=off``): clients get only ``CUDA_VISIBLE_DEVICES``; nothing is enforced."""

    name = "off"

    def __init__(self, pipe_dir: Path, log_dir: Path) -> None:
        self.pipe_dir, self.log_dir = Path(pipe_dir), Path(log_dir)
        self.commands: deque[str] = deque(maxlen=1)

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def client_env(self, gpu_indices: tuple[int, ...], share_pct: float, mem_mib: int) -> dict[str, str]:
        return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in gpu_indices)}

    def health(self) -> MpsHealth:
        return MpsHealth("off")

    def fault_events(self) -> list[MpsFault]:
        return []


def make_mps(mode: str, gpu_backend: str, pipe_dir: Path, log_dir: Path, control_bin: str = CONTROL_BIN,
             control_timeout_s: float = 5.0, run_as: tuple[int, int] | None = None) -> MpsController:
    """``auto`` = the real daemon on NVML GPUs, the simulated one on simulated GPUs.

    Raises:
        Unavailable: ``real`` (or ``auto`` on NVML GPUs) and the control binary is missing.
    """
    if mode == "off":
        return NoMps(pipe_dir, log_dir)
    if mode == "simulated" or (mode == "auto" and gpu_backend == "simulated"):
        return SimulatedMps(pipe_dir, log_dir, control_timeout_s)
    return RealMps(pipe_dir, log_dir, control_bin, control_timeout_s, run_as)


# --- /proc helpers ---------------------------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def read_environ(pid: int) -> dict[str, str] | None:
    """Environment of a process of ours; None if gone or not readable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def _is_shim(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"services.node_agent.shim" in f.read()
    except OSError:
        return True


def find_clients(pipe_dir: str) -> dict[int, tuple[int, ...]]:
    """Live processes (not shims) launched with ``CUDA_MPS_PIPE_DIRECTORY=pipe_dir`` -> their GPU indices."""
    uid = os.getuid()
    out: dict[int, tuple[int, ...]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            if entry.stat().st_uid != uid:
                continue
        except OSError:
            continue
        env = read_environ(pid)
        if not env or env.get("CUDA_MPS_PIPE_DIRECTORY") != pipe_dir or not _pid_alive(pid) or _is_shim(pid):
            continue
        gpus = tuple(int(g) for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip().isdigit())
        out[pid] = gpus
    return out
