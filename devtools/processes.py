"""Processes of a local cluster as ``devtools.cluster`` records them: telling a recorded process from a later
one given the same pid, finding a run's node agents and workloads in ``/proc``, and stopping them."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

from services.node_agent.runner import TAG_VAR


def start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` (clock ticks since boot, ``/proc/<pid>/stat`` field 22); None when it is gone or a zombie
    (a dead child of ours not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if rest[0] in ("Z", "X") else int(rest[19])


def ident(pid: int) -> str:
    return f"{pid}@{start_ticks(pid)}"


def running(p: dict) -> bool:
    """Whether the process recorded in ``p`` still runs: its pid is alive and, where its start time is recorded, it is
    the same process (not another one that got the pid after it died). A pid recorded without a start time (a state
    file of an older version, or a tool that replaced the pid alone) is taken on the pid alone."""
    ticks = start_ticks(p["pid"])
    if ticks is None:
        return False
    ident = p.get("ident", "")
    return ident == f"{p['pid']}@{ticks}" if ident.startswith(f"{p['pid']}@") else True


def alive(pid: int) -> bool:
    return start_ticks(pid) is not None


def other_pids() -> Iterable[int]:
    """Every pid in /proc but ours."""
    me = os.getpid()
    return (int(e.name) for e in os.scandir("/proc") if e.name.isdigit() and int(e.name) != me)


def environ(pid: int) -> dict[str, str]:
    """``/proc/<pid>/environ`` (the environment it was started with); {} when unreadable or gone."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="surrogateescape").split("\0") if "=" in item)


def agents_of(state_dirs: list[Path]) -> list[int]:
    """Pids of the node agents (``-m services.node_agent``, our uid) whose ELASTICO_STATE_DIR is one of ``state_dirs``."""
    dirs, uid, out = {str(d) for d in state_dirs}, os.getuid(), []
    for pid in other_pids():
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:3] == [b"-m", b"services.node_agent"] and alive(pid):
            sd = environ(pid).get("ELASTICO_STATE_DIR", "")
            if sd and str(Path(sd).resolve()) in dirs:
                out.append(pid)
    return out


def workloads_of(state_dirs: list[Path]) -> list[int]:
    """Pids of the workload processes (shims, commands and what they started, whatever their user) of these state
    dirs: those whose environment carries a workload tag naming one. A process that left its session and dropped
    its environment is not among them, but its shim (a child subreaper) ends it with the rest of the job."""
    dirs, out = {str(d) for d in state_dirs}, []
    for pid in other_pids():
        tag = environ(pid).get(TAG_VAR, "")
        if tag and tag.split("|", 1)[0] in dirs and alive(pid):
            out.append(pid)
    return out


def signal_group(pid: int, sig: int) -> None:
    """``sig`` to the process group ``pid`` leads (a service and what it started; a shim and its workload), else to
    ``pid`` alone (a process started by hand may share its group with others)."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(pids: list[int], grace_s: float, rescan=None) -> None:
    """SIGTERM ``pids``, SIGKILL those still alive after ``grace_s`` (and, with ``rescan``, what it finds then)."""
    if not pids:
        return
    for pid in pids:
        signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in {*pids, *(rescan() if rescan else ())}:
        if alive(pid):
            signal_group(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
