"""Workloads as real processes: launch, observe, stop, re-adopt; and the on-disk ledger that survives the agent.

Each workload runs as ``shim -> command`` (see ``services/node_agent/shim.py``) in its own session, so
the agent can crash, be upgraded or be ``kill -9``-ed without taking workloads down. Every workload has
a directory ``<state_dir>/workloads/<job_id>/<placement_id>/`` holding:

- ``launch.json``  the ledger entry as it was at launch (written *before* the process starts); mode 0600
- ``workload.log`` stdout and stderr of the workload; mode 0600, opened by the agent, which hands the workload
                   only the open descriptor: no workload (they share one user) reads another's output
- ``work/``        the workload's own directory and working directory: owned by the workload user, mode 0700
- ``work/progress`` written by the workload, optional (``ELASTICO_PROGRESS_FILE``): a number of steps
                   done, or JSON ``{"steps": ..}``; programs that write nothing still run, without progress
- ``rate``         simulated GPUs only: steps/s the synthetic workload must run at, or requests/s the serving
                   workload serves (``ELASTICO_SIM_RATE_FILE``)
- ``child.json``, ``exit.json``  written by the shim: the real command's pid, and its exit status

The workload directory itself stays the agent's: a workload (run as ``WorkloadPolicy``'s unprivileged
user, see ``shim.py``) can write only ``work/``, never its launch record or the exit status the agent trusts.

Workloads start with a minimal environment (``Runner.workload_env``): a standard PATH, the locale and time zone,
HOME/USER/LOGNAME of the workload user, and the job's own ``ELASTICO_*``/``CUDA_*`` variables; nothing else of
the agent's environment (its credentials, its PATH) reaches them.

A process is identified by (pid, start time from ``/proc/<pid>/stat``), so a recycled pid is never
mistaken for a workload. Every shim carries ``ELASTICO_WORKLOAD_TAG=<state_dir>|<job_id>|<placement_id>``
in its environment: if the agent dies between starting a process and recording it in the ledger, the
restarted agent still finds it by that tag instead of starting a duplicate.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from elastico.domain import DRAIN_SUFFIX, JobKind, MetricsEndpoint, Placement, StateReason
from elastico.files import replace_file
from elastico.logging import get_logger
from elastico.state import codec
from services.node_agent.mps import read_environ
from services.node_agent.settings import REPO_ROOT, WorkloadPolicy

log = get_logger(component="runner")

TAG_VAR = "ELASTICO_WORKLOAD_TAG"
PROGRESS_VAR = "ELASTICO_PROGRESS_FILE"
RATE_VAR = "ELASTICO_SIM_RATE_FILE"
OOM_MARKERS = ("out of memory", "cuda_error_out_of_memory", "outofmemoryerror")
WORK_DIR = "work"  # the workload's writable sub-directory of its workdir
MAX_PROGRESS_BYTES = 65536
# the workload's PATH: a standard system path, never the agent's (which may name private directories, e.g. /root/...)
WORKLOAD_PATH = "/usr/local/bin:/usr/bin:/bin"
ROOT_WORKLOAD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # ELASTICO_ALLOW_ROOT_WORKLOADS
PASSED_VARS = ("LANG", "LANGUAGE", "TZ")  # taken from the agent's environment, with every LC_*: locale and time zone
JOB_VAR_PREFIXES = ("ELASTICO_", "CUDA_")  # what the agent may add for a job (its slice, ports, files)


@dataclass(frozen=True)
class LedgerEntry:
    """One workload the agent started (or is about to start), as recorded on disk."""

    job_id: str  # its ledger key: the job id, or its drain key while it is a moving service's previous replica
    placement_id: str
    placement: Placement
    gpu_indices: tuple[int, ...]  # this node's GPUs of the placement
    compute_share_pct: float
    mem_mib: int
    workdir: str
    status: str = "starting"  # starting, running, succeeded, failed, killed
    pid: int = 0  # shim pid = process group id
    pid_start_ticks: int = 0  # /proc/<pid>/stat field 22: tells a recycled pid apart
    started_at_s: float = 0.0
    ended_at_s: float = 0.0
    reason: StateReason | None = None
    exit_code: int | None = None
    message: str = ""
    progress_steps: float = 0.0
    throughput: float = 0.0
    norm_throughput: float | None = None
    model: str = ""  # model family (drives emulation and observations)
    batch_size: int = 0
    kind: str = "training"
    precision: str = "fp32"
    isolated_throughput: float = 0.0  # reference speed in this shape, steps/s; 0 = unknown
    stop_requested: bool = False  # the agent stopped it (no longer desired)
    cotenant_fault: bool = False  # an MPS fault hit its GPU while it ran
    serve_port: int = 0  # inference: the loopback port the agent picked and passed as ELASTICO_SERVE_PORT; 0 = none
    metrics: MetricsEndpoint | None = None  # inference: the endpoint the agent scrapes (port, path, format resolved)
    # Kubernetes pod job (ELASTICO_KUBE_PODS): the pod's containers are the workload, the agent starts nothing;
    # ``pid`` is then a container's main process, and workdir/log/progress/rate files are unused
    pod_uid: str = ""
    pod_seen: bool = False  # the pod was seen bound to this node: gone after that = deleted
    pod_ip: str = ""  # from the watch: where a pod's metrics endpoint is scraped
    pod_ending: str = ""  # why the pod was going away when last seen (evicted, deleted): the end's message once it is gone

    @property
    def mps_limit_pct(self) -> float:
        """The compute share it runs under: a training job's placement shape (100 % where its share limits nothing,
        ``plan.make_placement``); a service's share (its capacity: it runs unlimited, its co-tenants are limited)."""
        if self.kind != JobKind.TRAINING.value or self.placement is None:
            return self.compute_share_pct
        return self.placement.shape.compute_share_pct

    @property
    def is_pod(self) -> bool:
        return bool(self.pod_uid)

    @property
    def endpoint(self) -> str:
        """host:port of an inference service's requests and metrics; "" = none (a pod's: until it has an IP)."""
        if self.metrics is None or not self.metrics.port:
            return ""
        if self.is_pod:
            host = f"[{self.pod_ip}]" if ":" in self.pod_ip else self.pod_ip
            return f"{host}:{self.metrics.port}" if self.pod_ip else ""
        return f"127.0.0.1:{self.metrics.port}"

    @property
    def running(self) -> bool:
        return self.status in ("starting", "running")

    @property
    def draining(self) -> bool:
        """A moving service's previous replica, kept under ``drain_key(job)`` until its move finishes."""
        return self.job_id.endswith(DRAIN_SUFFIX)

    @property
    def base_job_id(self) -> str:
        """The job this workload runs (its workload dir and process tag are named by it, drain or not)."""
        return self.job_id[: -len(DRAIN_SUFFIX)] if self.draining else self.job_id

    @property
    def log_path(self) -> str:
        return "" if self.is_pod else str(Path(self.workdir) / "workload.log")

    @property
    def progress_file(self) -> str:
        if self.is_pod:
            return ""
        work = Path(self.workdir) / WORK_DIR
        # workloads launched before work/ existed (re-adopted after an agent upgrade) write it in the workdir
        return str(work / "progress") if work.is_dir() else str(Path(self.workdir) / "progress")

    @property
    def rate_file(self) -> str:
        return str(Path(self.workdir) / "rate")


ALIVE_FILE = "agent.alive"  # touched by the agent while it lives; the shims' fence reads its age


@dataclass
class LedgerFile:
    """``<state_dir>/ledger.json``: every workload entry plus drained GPUs, replaced atomically."""

    path: Path
    entries: dict[str, LedgerEntry] = field(default_factory=dict)  # entry.job_id (job id or drain key) -> entry
    drained: dict[int, float] = field(default_factory=dict)  # gpu index -> drained since (s)
    applied_generation: int = 0
    # pod uid -> the entry of a pod job no longer desired whose pod's processes still run: not reported, but its
    # GPUs take no new process workload until they are gone
    lingering: dict[str, LedgerEntry] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> LedgerFile:
        if not path.exists():
            return cls(path)
        data = json.loads(path.read_text())
        entries = {e["job_id"]: codec.from_jsonable(LedgerEntry, e) for e in data.get("entries", [])}
        drained = {int(k): float(v) for k, v in data.get("drained", {}).items()}
        lingering = {e["pod_uid"]: codec.from_jsonable(LedgerEntry, e) for e in data.get("lingering", [])}
        return cls(path, entries, drained, int(data.get("applied_generation", 0)), lingering)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"version": 1, "applied_generation": self.applied_generation,
                "drained": {str(k): v for k, v in sorted(self.drained.items())},
                "entries": [codec.to_jsonable(e) for _, e in sorted(self.entries.items())],
                "lingering": [codec.to_jsonable(e) for _, e in sorted(self.lingering.items())]}
        # the agent's alone (0600): it names every job of the node, which workloads have no need to read
        replace_file(self.path, json.dumps(data, indent=1, sort_keys=True).encode(), 0o600, sync=True)


# --- /proc -----------------------------------------------------------------------------------------
def _proc_stat(pid: int) -> list[str] | None:
    """Fields 3 onwards of ``/proc/<pid>/stat``, or None when the process is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if rest[0] in ("Z", "X") else rest


def proc_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None when the process is gone or a zombie."""
    rest = _proc_stat(pid)
    return None if rest is None else int(rest[19])  # field 22 of stat


def is_alive(pid: int, start_ticks: int) -> bool:
    """True if ``pid`` runs and is the same process that was started (not a recycled pid)."""
    return pid > 0 and proc_start_ticks(pid) == start_ticks


def find_tagged(state_dir: str) -> dict[tuple[str, str], int]:
    """Shims started by an agent with this state dir: (job_id, placement_id) -> pid."""
    uid = os.getuid()
    prefix = f"{state_dir}|"
    found: dict[tuple[str, str], dict[int, int]] = {}  # key -> {pid: parent pid}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
        except OSError:
            continue
        pid = int(entry.name)
        env = read_environ(pid)
        tag = (env or {}).get(TAG_VAR, "")
        stat = _proc_stat(pid) if tag.startswith(prefix) else None
        if stat is None:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"services.node_agent.shim" not in f.read():
                    continue  # the workload itself inherits the tag; the shim is the one we track
        except OSError:
            continue
        _, job_id, pid_placement = tag.split("|", 2)
        found.setdefault((job_id, pid_placement), {})[pid] = int(stat[1])  # field 4: parent pid
    # a shim's child between fork and exec still shows the shim's command line and tag: keep the ancestor
    return {key: next(p for p, parent in procs.items() if parent not in procs) for key, procs in found.items()}


def kill_tagged(state_dir: str, sig: int = signal.SIGKILL) -> list[int]:
    """Signal every workload process group of this state dir (test clean-up, ``stop on exit``)."""
    killed = []
    for pid in find_tagged(state_dir).values():
        try:
            os.killpg(pid, sig)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return killed


# --- runner ----------------------------------------------------------------------------------------
#: a job or placement id that may name a directory: no separator, no leading dot ("..", hidden names)
PATH_SAFE_ID_RE = re.compile(r"[A-Za-z0-9_:-][A-Za-z0-9._:-]{0,127}")


def path_safe_id(value: str) -> bool:
    """Whether ``value`` can name a directory under the state dir without leaving it."""
    return PATH_SAFE_ID_RE.fullmatch(value) is not None


def workload_dir(state_dir: Path, job_id: str, placement_id: str) -> Path:
    """``<state>/workloads/<job>/<placement>``.

    Raises:
        ValueError: an id that would leave that directory (desired state is checked before it gets here).
    """
    if not (path_safe_id(job_id) and path_safe_id(placement_id)):
        raise ValueError(f"job {job_id[:64]!r} / placement {placement_id[:64]!r}: not a path-safe id")
    return state_dir / "workloads" / job_id / placement_id.replace(":", "_")


def synthetic_argv(total_steps: float, start_steps: float, python: str = sys.executable) -> list[str]:
    return [python, "-m", "services.node_agent.synthetic", "--total-steps", repr(float(total_steps)),
            "--start-steps", repr(float(start_steps))]


def serving_argv(python: str = sys.executable) -> list[str]:
    """The built-in inference workload (configured by its environment: ELASTICO_SERVE_PORT and friends)."""
    return [python, "-m", "services.node_agent.serving"]


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a service to listen on once it has started.

    Taken below the kernel's ephemeral range (``ip_local_port_range``) where it can: a port from that range (what
    binding port 0 gives) may be taken by any outgoing connection of the node before the service binds it, which
    then fails to start; below it, only another listener could take it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    below = range(max(1024, low - 12000), low)
    for port in [*random.sample(below, min(64, len(below))), 0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise OSError("no free TCP port on 127.0.0.1")


class ExitWatcher:
    """Calls ``on_exit`` as soon as one of the watched processes exits, on the running event loop: each pid is
    watched through a pidfd (Linux >= 5.3; where there is none, nothing is watched and callers keep polling)."""

    def __init__(self, on_exit: Callable[[], None]) -> None:
        self._on_exit = on_exit
        self._fds: dict[int, int] = {}  # pid -> its pidfd

    def watch(self, pids: set[int]) -> None:
        """Watch exactly ``pids`` from now on (new ones added, others dropped)."""
        if not hasattr(os, "pidfd_open"):
            return
        loop = asyncio.get_running_loop()
        for pid in [p for p in self._fds if p not in pids]:
            self._drop(loop, pid)
        for pid in pids - self._fds.keys():
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:  # already gone
                self._on_exit()
                continue
            except OSError:  # e.g. no pidfd support in this kernel
                return
            self._fds[pid] = fd
            loop.add_reader(fd, self._exited, pid)

    def close(self) -> None:
        loop = asyncio.get_running_loop()
        for pid in list(self._fds):
            self._drop(loop, pid)

    def _exited(self, pid: int) -> None:
        self._drop(asyncio.get_running_loop(), pid)
        self._on_exit()

    def _drop(self, loop: asyncio.AbstractEventLoop, pid: int) -> None:
        fd = self._fds.pop(pid, None)
        if fd is not None:
            loop.remove_reader(fd)
            os.close(fd)


class Runner:
    """Starts, observes and stops workload processes for one agent (one state dir)."""

    def __init__(self, state_dir: Path, policy: WorkloadPolicy | None = None, fence_s: float = 0.0,
                 stop_grace_s: float = 10.0) -> None:
        """``fence_s`` > 0: each shim stops its workload once the agent has not touched :attr:`alive_file` for that
        long (``shim.py``); the agent keeps it fresh with :meth:`touch_alive`."""
        self.state_dir = Path(state_dir)
        self.policy = policy or WorkloadPolicy.default()
        self.fence_s, self.stop_grace_s = fence_s, stop_grace_s
        self.alive_file = self.state_dir / ALIVE_FILE
        self._children: dict[int, subprocess.Popen[bytes]] = {}  # shims we started: reaped by poll()

    def start(self, entry: LedgerEntry, argv: list[str], extra_env: dict[str, str], drop: bool = True) -> LedgerEntry:
        """Launch ``argv`` under a shim in its own session; returns the entry with pid and start time.

        ``drop``: run it as the workload user (always for a job's command; see ``WorkloadPolicy.synthetic_drops``).

        ``launch.json`` is written first, so a crash right after the fork still leaves a record that
        the restarted agent can match with the tagged process.
        """
        workdir, policy = Path(entry.workdir), self.policy
        (workdir / WORK_DIR).mkdir(mode=0o700, parents=True, exist_ok=True)
        if policy.drops_privileges:
            os.chown(workdir / WORK_DIR, policy.uid, policy.gid)
            for d in (self.state_dir, self.state_dir / "workloads", workdir.parent, workdir):  # enterable, whatever our umask
                os.chmod(d, stat.S_IMODE(os.stat(d).st_mode) | 0o111)
        for stale in ("exit.json", "child.json"):
            (workdir / stale).unlink(missing_ok=True)
        replace_file(workdir / "launch.json", json.dumps(codec.to_jsonable(entry)).encode(), 0o600, sync=True)
        env = self.workload_env(entry, extra_env)
        opts = ["--cwd", str(workdir / WORK_DIR), *(f"--rlimit={n}={v}" for n, v in policy.rlimits),
                f"--stop-grace-s={self.stop_grace_s:g}"]
        if self.fence_s > 0:
            opts += ["--fence", str(self.alive_file), f"--fence-s={self.fence_s:g}"]
        if policy.drops_privileges and drop:
            opts += ["--uid", str(policy.uid), "--gid", str(policy.gid)]
        # the log is the agent's, mode 0600: the workload writes it through the descriptor it inherits, and no other
        # workload (every one runs as the same user) can open it by name
        logfd = os.open(entry.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.fchmod(logfd, 0o600)  # one created by an older agent was 0644
            proc = subprocess.Popen([sys.executable, "-m", "services.node_agent.shim", *opts, str(workdir), "--", *argv],
                                    env=env, cwd=workdir, stdin=subprocess.DEVNULL, stdout=logfd,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            os.close(logfd)
        self._children[proc.pid] = proc
        ticks = proc_start_ticks(proc.pid) or 0
        return replace(entry, status="running", pid=proc.pid, pid_start_ticks=ticks, started_at_s=time.time())

    def workload_env(self, entry: LedgerEntry, extra_env: dict[str, str]) -> dict[str, str]:
        """The whole environment of a workload (and of its shim), built from an allow-list, never from a copy of ours.

        A standard PATH (with sbin for root workloads); LANG, LANGUAGE, LC_* and TZ as the agent has them; HOME, USER
        and LOGNAME of the workload user; PYTHONPATH (this checkout: the shim and the synthetic workloads need it) and
        PYTHONUNBUFFERED; the variables the operator names in ELASTICO_WORKLOAD_PASS_ENV; and the job's own variables: ``extra_env`` (its slice: CUDA_*; its port, rate file, time
        scale: ELASTICO_*), ELASTICO_JOB_ID, ELASTICO_PROGRESS_FILE and ELASTICO_WORKLOAD_TAG.

        Raises:
            ValueError: a name in ``extra_env`` that is not CUDA_* or ELASTICO_* (a bug of the caller).
        """
        stray = sorted(k for k in extra_env if not k.startswith(JOB_VAR_PREFIXES))
        if stray:
            raise ValueError(f"workload environment: {', '.join(stray)} not a job variable (CUDA_* or ELASTICO_*)")
        policy = self.policy
        env = {k: v for k, v in os.environ.items() if k in PASSED_VARS or k.startswith("LC_")}
        env.update(PATH=ROOT_WORKLOAD_PATH if policy.uid == 0 else WORKLOAD_PATH, PYTHONPATH=str(REPO_ROOT),
                   PYTHONUNBUFFERED="1", HOME=policy.home, USER=policy.user, LOGNAME=policy.user)
        env.update({k: os.environ[k] for k in policy.pass_env if k in os.environ})  # the operator's ELASTICO_WORKLOAD_PASS_ENV
        env.update(extra_env)
        env[TAG_VAR] = f"{self.state_dir}|{entry.base_job_id}|{entry.placement_id}"
        env[PROGRESS_VAR] = entry.progress_file
        env["ELASTICO_JOB_ID"] = entry.base_job_id
        return env

    def touch_alive(self) -> None:
        """The agent's sign of life for the shims' fence (a file's modification time)."""
        try:
            self.alive_file.touch()
        except FileNotFoundError:  # before the state directory's first use
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self.alive_file.touch()

    def reap(self) -> None:
        """Collect exit statuses of our own children so none lingers as a zombie."""
        for pid, proc in list(self._children.items()):
            if proc.poll() is not None:
                del self._children[pid]

    def alive(self, entry: LedgerEntry) -> bool:
        self.reap()
        return is_alive(entry.pid, entry.pid_start_ticks)

    def exit_status(self, entry: LedgerEntry) -> tuple[int | None, str, bool]:
        """(exit code or None if unknown, message, whether its shim stopped it for its silent agent) of an ended
        workload, from the shim's exit file."""
        try:
            data = json.loads((Path(entry.workdir) / "exit.json").read_text())
        except (OSError, ValueError):
            return None, "workload supervisor ended without an exit status", False
        code, fenced = int(data["exit_code"]), bool(data.get("fenced"))
        if data.get("message"):
            return code, data["message"], fenced
        if code < 0:
            sig = -code
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
            hint = " (OOM killer?)" if sig == signal.SIGKILL else ""
            return code, f"killed by {name}{hint}", fenced
        return code, f"exit {code}", fenced

    def log_mentions_oom(self, entry: LedgerEntry, tail_bytes: int = 16384) -> bool:
        try:
            with open(entry.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - tail_bytes))
                text = f.read().decode(errors="replace").lower()
        except OSError:
            return False
        return any(m in text for m in OOM_MARKERS)

    def child_pid(self, entry: LedgerEntry) -> int | None:
        """Pid of the real command (what MPS and NVML see), once the shim has started it."""
        try:
            return int(json.loads((Path(entry.workdir) / "child.json").read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None

    def signal_group(self, entry: LedgerEntry, sig: int) -> None:
        if not self.alive(entry):
            return
        try:
            os.killpg(entry.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    @staticmethod
    def read_progress(path: str) -> tuple[float, float] | None:
        """(steps, time written) from a progress file; None when absent or unreadable.

        The workload owns the file: a symlink, a FIFO or a huge file must not make the agent read
        elsewhere, block or run out of memory.
        """
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            raw, mtime = os.read(fd, MAX_PROGRESS_BYTES).decode(errors="replace").strip(), st.st_mtime
        except OSError:
            return None
        finally:
            os.close(fd)
        if not raw:
            return None
        try:
            if raw.startswith("{"):
                data = json.loads(raw)
                return float(data["steps"]), float(data.get("time_s", mtime))
            return float(raw.splitlines()[-1]), mtime
        except (ValueError, KeyError, TypeError):
            return None

    def write_rate(self, entry: LedgerEntry, steps_per_s: float) -> None:
        """The simulated workload's rate file: the agent's, readable by the workload user's group only (by the
        agent's user alone when workloads run as it)."""
        data = f"{steps_per_s!r}\n".encode()
        if self.policy.drops_privileges:
            replace_file(entry.rate_file, data, 0o640, group=self.policy.gid)
        else:
            replace_file(entry.rate_file, data, 0o600)

    @staticmethod
    def command_argv(command: str) -> list[str]:
        """Split a job's command line like a shell would (no pipes: wrap in ``sh -c`` for that)."""
        return shlex.split(command)
