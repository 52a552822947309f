"""Kubernetes pods as workloads, pure part: which pod a process belongs to, and what a pod's status means for its job.

No I/O here (``podwatch.py`` reads ``/proc`` and the API server; the reconciler applies the outcomes):

* :func:`pod_uid_from_cgroup` -- the pod UID in the text of ``/proc/<pid>/cgroup``: cgroup v1 or v2, kubelet's
  cgroupfs driver (``.../kubepods/burstable/pod<uid>/<container>``) or its systemd driver
  (``.../kubepods-burstable-pod<uid with _>.slice/cri-containerd-<container>.scope``), also as a path relative to
  the reader's cgroup namespace (``/../../pod<uid>/...``).
* :func:`pod_outcome` -- a pod's JSON (as the API server returns it; None = the pod is gone) and whether its
  processes still run -> the workload status, reason, exit code and message the node agent reports.
* :func:`main_process`, :func:`sum_counters` -- the pid a pod job reports, and its counters summed over its pids.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from elastico.domain import GpuCounters, StateReason

_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_CGROUPFS = re.compile(rf"(?:^|/)pod({_UID})(?:/|$)", re.IGNORECASE)  # a whole path segment "pod<uid>"
_SYSTEMD = re.compile(rf"-pod({_UID})\.slice(?:/|$)", re.IGNORECASE)  # "kubepods[-<qos>]-pod<uid_>.slice"
SANDBOX_COMMS = frozenset({"pause"})  # the pod sandbox's process (kubelet's pause image): not a container's
ENDED = ("succeeded", "failed", "killed")


def pod_uid_from_cgroup(text: str) -> str | None:
    """The UID (with dashes, lower case) of the pod whose cgroup a ``/proc/<pid>/cgroup`` text names; None = no pod's."""
    for line in text.splitlines():
        parts = line.split(":", 2)  # "<hierarchy id>:<controllers>:<path>"; v2 is "0::<path>"
        if len(parts) != 3:
            continue
        m = _SYSTEMD.search(parts[2]) or _CGROUPFS.search(parts[2])
        if m:
            return m.group(1).replace("_", "-").lower()
    return None


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` the agent needs."""

    comm: str
    state: str  # R, S, D, Z (zombie), X (dead), ...
    ppid: int
    start_ticks: int  # field 22: start time in clock ticks since boot (tells a recycled pid apart)

    @property
    def alive(self) -> bool:
        return self.state not in ("Z", "X")


def parse_stat(text: str) -> ProcStat | None:
    """``/proc/<pid>/stat`` text -> :class:`ProcStat`; None when malformed (the comm may hold spaces and parentheses)."""
    head, sep, rest = text.rpartition(") ")
    if not sep or "(" not in head:
        return None
    fields = rest.split()
    if len(fields) < 20:
        return None
    try:
        return ProcStat(head.split("(", 1)[1], fields[0], int(fields[1]), int(fields[19]))
    except ValueError:
        return None


@dataclass(frozen=True)
class PodProcess:
    """One live process of a pod's containers."""

    pid: int
    ppid: int
    start_ticks: int
    comm: str = ""


def main_process(procs: Sequence[PodProcess]) -> PodProcess | None:
    """The pod's oldest container main process (one whose parent is not in the pod: the container runtime's shim
    started it); None when the pod has no process."""
    pids = {p.pid for p in procs}
    roots = [p for p in procs if p.ppid not in pids] or list(procs)
    return min(roots, key=lambda p: (p.start_ticks, p.pid)) if roots else None


def sum_counters(counters: Iterable[GpuCounters]) -> GpuCounters:
    """Per-process counters summed over a pod's processes (a field stays unknown when no process has it)."""
    total: dict[str, float | None] = {"sm_util_pct": None, "mem_bw_util_pct": None, "mem_used_mib": None,
                                      "tensor_util_pct": None}
    for c in counters:
        for name in total:
            v = getattr(c, name)
            if v is not None:
                total[name] = (total[name] or 0.0) + v
    return GpuCounters(**total)


@dataclass(frozen=True)
class PodOutcome:
    """What a pod's state means for its job's workload report."""

    status: str  # starting, running, succeeded, failed, killed
    reason: StateReason | None = None
    exit_code: int | None = None
    message: str = ""

    @property
    def ended(self) -> bool:
        return self.status in ENDED


def _statuses(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    st = pod.get("status") or {}
    return [*(st.get("containerStatuses") or []), *(st.get("initContainerStatuses") or [])]


def _disruption(pod: Mapping[str, Any]) -> str:
    """Why the pod is being evicted ("" = it is not): the DisruptionTarget condition (Eviction API, preemption,
    kubelet), or kubelet's node-pressure eviction (status.reason Evicted)."""
    st = pod.get("status") or {}
    for c in st.get("conditions") or []:
        if c.get("type") == "DisruptionTarget" and c.get("status") == "True":
            detail = ": ".join(x for x in (c.get("reason", ""), c.get("message", "")) if x)
            return f"pod evicted ({detail})" if detail else "pod evicted"
    if st.get("reason") == "Evicted":
        return f"pod evicted by the kubelet ({st.get('message', '')})" if st.get("message") else "pod evicted by the kubelet"
    return ""


def _failure(pod: Mapping[str, Any]) -> tuple[int | None, str]:
    """(exit code, message) of a Failed pod: an OOMKilled container first, else the first that exited non-zero."""
    ended: list[tuple[str, Mapping[str, Any]]] = [
        (s.get("name", "?"), t) for s in _statuses(pod) if (t := (s.get("state") or {}).get("terminated"))]
    oom = [(n, t) for n, t in ended if t.get("reason") == "OOMKilled"]
    bad = oom or [(n, t) for n, t in ended if t.get("exitCode", 0) != 0] or ended
    st = pod.get("status") or {}
    pod_detail = ": ".join(x for x in (st.get("reason", ""), st.get("message", "")) if x)
    if not bad:
        return None, f"pod Failed ({pod_detail})" if pod_detail else "pod Failed"
    name, t = bad[0]
    code = t.get("exitCode")
    why = t.get("reason") or "Error"
    msg = f"container {name} terminated: {why} (exit {code})"
    if t.get("message"):
        msg += f": {t['message']}"
    return (int(code) if code is not None else None), msg + (f"; pod: {pod_detail}" if pod_detail else "")


def _waiting(pod: Mapping[str, Any]) -> str:
    """Containers not running: waiting reasons and restarts (CrashLoopBackOff, ImagePullBackOff, ...)."""
    notes = []
    for s in _statuses(pod):
        waiting = (s.get("state") or {}).get("waiting")
        restarts = int(s.get("restartCount") or 0)
        if waiting or restarts and not (s.get("state") or {}).get("running"):
            last = (s.get("lastState") or {}).get("terminated") or {}
            bits = [waiting.get("reason", "waiting") if waiting else "not running", f"{restarts} restarts"]
            if last:
                bits.append(f"last exit {last.get('exitCode')} {last.get('reason', '')}".rstrip())
            notes.append(f"container {s.get('name', '?')} {', '.join(bits)}")
    return "; ".join(notes)


def ending(pod: Mapping[str, Any]) -> str:
    """Why the pod is going away ("pod evicted (...)", "pod deleted"); "" = it is not."""
    return _disruption(pod) or ("pod deleted" if (pod.get("metadata") or {}).get("deletionTimestamp") else "")


def pod_outcome(pod: Mapping[str, Any] | None, has_processes: bool, seen: bool, last_ending: str = "") -> PodOutcome:
    """The workload status of a pod job from its pod (None = not in the API server) and its processes on this node.

    ``seen``: the pod was seen before (a pod never seen "has not appeared yet": starting; one seen and now gone was
    deleted). ``last_ending``: :func:`ending` of the pod as last seen (why a pod now gone went). An end is reported
    only once the pod's processes are gone: its job's slices are released on that report, and the GPUs must not be
    given away while its containers still run.
    """
    if pod is None:
        if not seen:
            return PodOutcome("starting", message="pod not seen on this node yet")
        why = last_ending or "pod deleted"
        if has_processes:
            return PodOutcome("running", message=f"{why}; waiting for its containers to exit")
        return PodOutcome("killed", StateReason.PREEMPTED, message=why)
    phase = (pod.get("status") or {}).get("phase") or "Pending"
    deleting = bool((pod.get("metadata") or {}).get("deletionTimestamp"))
    disrupted = _disruption(pod)
    if has_processes:
        if phase in ("Succeeded", "Failed") or disrupted or deleting:
            why = disrupted or ("pod deleted" if deleting else f"pod {phase}")
            return PodOutcome("running", message=f"{why}; waiting for its containers to exit")
        if phase == "Running":
            return PodOutcome("running", message=_waiting(pod))
        return PodOutcome("starting", message=f"pod {phase} (init containers running)")
    if disrupted:
        return PodOutcome("killed", StateReason.PREEMPTED, message=disrupted)
    if phase == "Succeeded":
        return PodOutcome("succeeded", StateReason.COMPLETED, 0, "pod Succeeded")
    if deleting:
        return PodOutcome("killed", StateReason.PREEMPTED, message="pod deleted")
    if phase == "Failed":
        code, msg = _failure(pod)
        return PodOutcome("failed", StateReason.OWN_FAILURE, code, msg)
    waiting = _waiting(pod)
    if phase == "Running":
        return PodOutcome("starting", message=waiting or "pod Running; its containers' processes not found yet")
    return PodOutcome("starting", message=f"pod {phase}" + (f": {waiting}" if waiting else ""))


def pod_ip(pod: Mapping[str, Any] | None) -> str:
    """The pod's IP from its status ("" until it has one)."""
    return str(((pod or {}).get("status") or {}).get("podIP") or "")


def pod_uid(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("uid") or "")


def pod_name(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


class PodSource(Protocol):
    """The pods bound to this node and their processes (``podwatch.KubePods``; tests give their own)."""

    def start(self, on_change: Any) -> None:
        """Begin following the pods; ``on_change()`` is called (from any thread) when something changed."""
        ...

    def stop(self) -> None: ...

    def snapshot(self) -> tuple[bool, dict[str, dict[str, Any]]]:
        """(synced: a list has completed, {pod uid: pod JSON}) of the pods bound to this node."""
        ...

    def processes(self) -> dict[str, list[PodProcess]]:
        """{pod uid: its live processes} found on this node now (blocking: reads /proc)."""
        ...
