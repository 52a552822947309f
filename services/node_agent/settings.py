"""Node agent configuration (``ELASTICO_*`` environment variables, validated at start-up)."""

from __future__ import annotations

import grp
import os
import pwd
import re
import shutil
import socket
import stat
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from elastico.config import Settings
from elastico.domain import NODE_ID_RE
from elastico.errors import ConfigError

GPU_BACKENDS = ("simulated", "nvml", "auto")
MPS_MODES = ("auto", "real", "simulated", "off")
MIB = 1 << 20
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class WorkloadPolicy:
    """Who workloads run as and what they may do (docs/security.md "Workloads"), resolved once at start."""

    uid: int
    gid: int
    user: str  # USER/LOGNAME of workloads (the uid as text when it has no passwd entry)
    home: str  # HOME of workloads
    rlimits: tuple[tuple[str, int], ...] = (("core", 0), ("nofile", 65536))  # (name, value), set by the shim before exec
    allow_commands: bool = True  # False: jobs with a command line are refused
    # the interpreter synthetic workloads run with as the workload user; "" = none it can run (or it cannot read
    # this checkout): synthetic workloads (the agent's own code, no job input) then run as the agent's user
    python: str = sys.executable
    pass_env: tuple[str, ...] = ()  # variables of the agent's environment workloads also get (ELASTICO_WORKLOAD_PASS_ENV)

    @property
    def synthetic_drops(self) -> bool:
        """Whether synthetic workloads run as the workload user (free commands always do)."""
        return self.drops_privileges and bool(self.python)

    @property
    def drops_privileges(self) -> bool:
        """True when workloads run as another user or group than the agent (the agent is then root)."""
        return (self.uid, self.gid) != (os.getuid(), os.getgid())

    @classmethod
    def default(cls) -> WorkloadPolicy:
        """The policy of an agent with default settings: its own user, or ``nobody`` when it is root."""
        uid, gid, user, home = resolve_workload_user("", "")
        return cls(uid, gid, user, home, python=workload_python(uid, gid))


def resolve_workload_user(user: str, group: str) -> tuple[int, int, str, str]:
    """(uid, gid, name, home) of ``ELASTICO_WORKLOAD_USER``/``_GROUP``; "" = this process's user, ``nobody`` for root.

    Raises:
        ConfigError: unknown user or group, naming the variable.
    """
    me = os.getuid()
    spec = user or ("nobody" if me == 0 else str(me))
    try:
        pw: pwd.struct_passwd | None = pwd.getpwuid(int(spec)) if spec.isdigit() else pwd.getpwnam(spec)
    except KeyError:
        if not spec.isdigit():
            default = "" if user else " (the default for an agent running as root)"
            raise ConfigError(f"ELASTICO_WORKLOAD_USER={spec!r}{default}: no such user; give a user name or a numeric uid") from None
        pw = None
    uid = pw.pw_uid if pw else int(spec)
    if group:
        try:
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        except KeyError:
            raise ConfigError(f"ELASTICO_WORKLOAD_GROUP={group!r}: no such group; give a group name or a numeric gid") from None
    elif uid == me:
        gid = os.getgid()  # the agent's own identity (its passwd entry may name another group)
    elif pw is not None:
        gid = pw.pw_gid
    else:
        raise ConfigError(f"ELASTICO_WORKLOAD_USER={spec}: uid without a passwd entry, so no primary group: set ELASTICO_WORKLOAD_GROUP")
    home = pw.pw_dir if pw else os.environ.get("HOME", "/") if uid == me else "/"
    return uid, gid, pw.pw_name if pw else str(uid), home


def workload_python(uid: int, gid: int) -> str:
    """An interpreter ``uid`` can run for the synthetic workload (standard library only): the agent's own, else
    the system's ``python3`` (the agent's may sit in a private home, e.g. a pyenv under /root); "" when there is
    none, or when ``uid`` cannot read this checkout (the synthetic workload's code)."""
    if uid != os.getuid() and blocking_dir(REPO_ROOT, uid, gid) is not None:
        return ""
    for cand in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        if not cand:
            continue
        real = Path(cand).resolve()
        try:
            st = real.stat()
        except OSError:
            continue
        bit = stat.S_IXUSR if st.st_uid == uid else stat.S_IXGRP if st.st_gid == gid else stat.S_IXOTH
        if (uid == os.getuid() or blocking_dir(real.parent, uid, gid) is None) and st.st_mode & bit:
            return cand
    return ""


def blocking_dir(path: Path, uid: int, gid: int) -> Path | None:
    """The first existing directory on the way to ``path`` that ``uid``/``gid`` may not enter (mode bits; ACLs ignored)."""
    for d in reversed([path, *path.parents]):
        try:
            st = d.stat()
        except OSError:
            return None  # the agent creates the rest
        bit = stat.S_IXUSR if st.st_uid == uid else stat.S_IXGRP if st.st_gid == gid else stat.S_IXOTH
        if stat.S_ISDIR(st.st_mode) and not st.st_mode & bit:
            return d
    return None


@dataclass(frozen=True)
class NodeAgentSettings(Settings):
    service_name: str = "node_agent"
    port: int = 50060
    max_request_mib: float = 1.0  # its requests are a few bytes
    redis_namespace: str = "elastico"  # key namespace in Redis
    node_id: str = ""  # unique node name; "" = the host name
    advertise_address: str = ""  # host:port the allocator uses to reach this agent; "" = host:bound port
    gpu_backend: str = "auto"  # simulated, nvml, or auto (nvml, else simulated with a loud warning)
    sim_gpu_type: str = "v100"  # simulated backend: GPU type of every GPU
    sim_gpu_count: int = 4  # simulated backend: GPUs on this node
    sim_gpu_mem_mib: int = 16384  # simulated backend: memory of each GPU, MiB
    sim_time_scale: float = 1.0  # simulated backend: simulated seconds per wall second (trace replays); 1 = real time
    heartbeat_interval_s: float = 2.0  # how often node status and counters go to Redis
    state_dir: str = ""  # ledger, workload logs and MPS pipes; "" = $XDG_STATE_HOME/elastico/<node_id> (root: /var/lib/elastico/<node_id>)
    reconcile_interval_s: float = 2.0  # desired-state poll period (a Sync call reconciles at once)
    stop_grace_s: float = 10.0  # SIGTERM -> SIGKILL delay when stopping a workload
    # a workload's supervisor stops it once this agent has shown no sign of life (stopped, dead, or cut off from the
    # store while an allocator sees it: services/node_agent/liveness.py) for this long, s; keep heartbeat_interval_s
    # + 1 + fence_s + stop_grace_s below the allocator's ELASTICO_NODE_STALE_S + ELASTICO_NODE_GRACE_S (45 s), after
    # which the job is placed elsewhere, and fence_s above the allocator's ELASTICO_LEASE_TTL_S (10 s), within which
    # it reports a store outage; 0 = never (a silent agent's workloads may then run twice)
    fence_s: float = 25.0
    # host:port of each allocator replica that schedules, comma-separated: asked whether they reach the store when
    # this agent does not (an outage of everyone's keeps the workloads running); "" = none, so a store outage longer
    # than fence_s stops this node's workloads
    allocator_addresses: str = ""
    mps: str = "auto"  # auto (real MPS on NVML GPUs, simulated on simulated GPUs), real, simulated, off
    mps_pipe_dir: str = ""  # CUDA_MPS_PIPE_DIRECTORY; "" = <state_dir>/mps/pipe
    mps_log_dir: str = ""  # CUDA_MPS_LOG_DIRECTORY; "" = <state_dir>/mps/log
    mps_control_bin: str = "nvidia-cuda-mps-control"  # control daemon binary (PATH lookup)
    mps_control_timeout_s: float = 5.0  # a control command taking longer means the daemon is stuck
    mps_fault_holddown_s: float = 5.0  # a GPU stays drained this long after its faulted clients are gone
    predictor_address: str = ""  # host:port of the predictor for ReportObservation; "" = do not report
    predictor_timeout_s: float = 2.0  # deadline of each ReportObservation call
    observation_interval_s: float = 30.0  # at most one observation per co-located pair per interval
    scrape_interval_s: float = 5.0  # metrics scrape period of inference services whose endpoint names none
    stop_workloads_on_exit: bool = False  # SIGTERM also stops workloads and MPS (local clusters); default: leave them running
    # --- workloads (docs/security.md "Workloads") ------------------------------------------------------
    workload_user: str = ""  # user name or uid workloads run as; "" = the agent's user, or `nobody` when the agent is root
    workload_group: str = ""  # group name or gid of workloads; "" = the workload user's primary group
    allow_root_workloads: bool = False  # the only way workloads may run as uid 0 (said loudly at start)
    allow_commands: bool = True  # false = refuse jobs with a command line (Kubernetes: the pods are the workloads)
    # comma-separated names of the agent's environment variables workloads also get, e.g. "LD_LIBRARY_PATH,PATH" on
    # a GPU node whose CUDA libraries are found through them; "" = none: workloads get a minimal environment
    # (services/node_agent/runner.py: Runner.workload_env)
    workload_pass_env: str = ""
    workload_rlimit_nofile: int = 65536  # open files per workload process; 0 = the agent's
    workload_rlimit_nproc: int = 0  # processes of the workload user; 0 = the agent's
    workload_rlimit_core_mib: int = 0  # core dump size, MiB; 0 = no core dumps
    workload_rlimit_as_mib: int = 0  # address space per workload process, MiB; 0 = unlimited
    # --- Kubernetes (docs/kubernetes.md): the pods bound to this node are the workloads of pod jobs -------------
    kube_pods: bool = False  # follow pods (API server watch, /proc) instead of starting processes for pod jobs
    proc_root: str = "/proc"  # where the pods' container processes are found (the DaemonSet has hostPID)
    kube_api_url: str = ""  # Kubernetes API base URL; "" = in-cluster service account (else ~/.kube/config)
    kube_timeout_s: float = 5.0  # deadline of each Kubernetes API call (list; a watch's connect)

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
        for name in self.workload_pass_env_names:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or name.startswith(("ELASTICO_", "CUDA_")):
                raise ConfigError(f"ELASTICO_WORKLOAD_PASS_ENV: {name[:64]!r} is not a variable name, or is one the agent "
                                  "sets for each job (ELASTICO_*, CUDA_*)")
        if not 0 <= self.stop_grace_s <= 600:
            raise ConfigError(f"ELASTICO_STOP_GRACE_S={self.stop_grace_s}: must be in [0, 600]")
        if not (self.fence_s == 0 or 2 <= self.fence_s <= 3600):
            raise ConfigError(f"ELASTICO_FENCE_S={self.fence_s}: must be 0 (off) or in [2, 3600]")
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
        if not 0.1 <= self.scrape_interval_s <= 3600:
            raise ConfigError(f"ELASTICO_SCRAPE_INTERVAL_S={self.scrape_interval_s}: must be in [0.1, 3600]")
        if not NODE_ID_RE.fullmatch(self.effective_node_id):
            raise ConfigError(f"ELASTICO_NODE_ID={self.effective_node_id!r}: a node id is 1-253 letters, digits, '.', '_' or "
                              "'-', starting with a letter or digit (it names the node's certificate and keys)")
        if self.kube_timeout_s <= 0:
            raise ConfigError(f"ELASTICO_KUBE_TIMEOUT_S={self.kube_timeout_s}: must be > 0")
        if self.kube_pods and not (self.proc_root.startswith("/") and os.path.isdir(self.proc_root)):
            raise ConfigError(f"ELASTICO_PROC_ROOT={self.proc_root!r}: must be an existing absolute directory (a /proc "
                              "showing the pods' processes) when ELASTICO_KUBE_PODS is on")
        for name in ("nofile", "nproc", "core_mib", "as_mib"):
            if getattr(self, f"workload_rlimit_{name}") < 0:
                raise ConfigError(f"ELASTICO_WORKLOAD_RLIMIT_{name.upper()}={getattr(self, f'workload_rlimit_{name}')}: must be >= 0")
        p = self.workload_policy
        if p.uid == 0 and not self.allow_root_workloads:
            raise ConfigError(f"workloads would run as root (ELASTICO_WORKLOAD_USER={self.workload_user or 'root'!r}): set "
                              "ELASTICO_WORKLOAD_USER to an unprivileged user, or ELASTICO_ALLOW_ROOT_WORKLOADS=1 to accept "
                              "that every job command gets full control of this node")
        if os.getuid() != 0 and p.uid != os.getuid():
            raise ConfigError(f"ELASTICO_WORKLOAD_USER={self.workload_user!r}: only an agent running as root can run "
                              f"workloads as another user (this agent runs as uid {os.getuid()})")
        if os.getuid() != 0 and p.gid != os.getgid():
            raise ConfigError(f"ELASTICO_WORKLOAD_GROUP={self.workload_group!r}: only an agent running as root can run "
                              f"workloads in another group (this agent runs as gid {os.getgid()})")
        blocked = blocking_dir(self.effective_state_dir, p.uid, p.gid) if p.drops_privileges else None
        if blocked is not None:
            raise ConfigError(f"ELASTICO_STATE_DIR={str(self.effective_state_dir)!r}: the workload user {p.user} (uid {p.uid}) "
                              f"cannot enter {blocked} (mode {stat.S_IMODE(blocked.stat().st_mode):04o}), so workloads could "
                              "not write their progress files: set ELASTICO_STATE_DIR to a directory it can reach")

    @cached_property
    def workload_policy(self) -> WorkloadPolicy:
        """Workload uid/gid/home and resource limits (rlimit values in the unit of ``setrlimit``: bytes for sizes)."""
        uid, gid, user, home = resolve_workload_user(self.workload_user, self.workload_group)
        optional = (("nofile", self.workload_rlimit_nofile), ("nproc", self.workload_rlimit_nproc),
                    ("as", self.workload_rlimit_as_mib * MIB))  # 0 = leave as is
        rlimits = (("core", self.workload_rlimit_core_mib * MIB), *((n, v) for n, v in optional if v))  # core 0 = none
        return WorkloadPolicy(uid, gid, user, home, rlimits, self.allow_commands, workload_python(uid, gid),
                              self.workload_pass_env_names)

    @property
    def workload_pass_env_names(self) -> tuple[str, ...]:
        """``workload_pass_env`` split at commas, blanks dropped."""
        return tuple(n.strip() for n in self.workload_pass_env.split(",") if n.strip())

    @property
    def allocator_address_list(self) -> tuple[str, ...]:
        """``allocator_addresses`` split at commas, blanks dropped."""
        return tuple(a.strip() for a in self.allocator_addresses.split(",") if a.strip())

    @property
    def effective_node_id(self) -> str:
        return self.node_id or socket.gethostname()

    @property
    def effective_state_dir(self) -> Path:
        if self.state_dir:
            return Path(self.state_dir).resolve()
        # root's home is private (0700): its workloads' user could not reach their files there
        fallback = "/var/lib" if os.getuid() == 0 else str(Path.home() / ".local" / "state")
        base = os.environ.get("XDG_STATE_HOME") or fallback
        return Path(base) / "elastico" / self.effective_node_id

    @property
    def effective_mps_pipe_dir(self) -> Path:
        return Path(self.mps_pipe_dir) if self.mps_pipe_dir else self.effective_state_dir / "mps" / "pipe"

    @property
    def effective_mps_log_dir(self) -> Path:
        return Path(self.mps_log_dir) if self.mps_log_dir else self.effective_state_dir / "mps" / "log"
