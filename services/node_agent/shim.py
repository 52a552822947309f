"""Workload supervisor (``python -m services.node_agent.shim [OPTIONS] WORKDIR -- ARGV...``), one per workload.

Why a shim: the agent must be able to die (upgrade, crash, ``kill -9``) without killing or losing its
workloads. The agent starts this shim in a new session (so the shim leads the workload's process group
and survives the agent); the shim runs the real command as its child, forwards SIGTERM/SIGINT to it,
and when it ends writes ``WORKDIR/exit.json`` (exit code, negative = signal) atomically. A restarted
agent that re-adopts the workload cannot ``wait()`` for a process that is not its child, so that file is
how it learns the outcome. The child's pid goes to ``WORKDIR/child.json`` (the pid NVML and MPS report).

With ``--fence FILE --fence-s S`` the shim also stops the command (SIGTERM, SIGKILL after ``--stop-grace-s``)
once FILE, which the agent touches every second while it lives, is older than S: an agent that is stopped or
dead for that long will see its node declared lost and the job placed elsewhere, and the job must not run twice.
The exit file then says ``"fenced": true``.

The shim is its workload's child subreaper: a process of the workload that leaves its session (``setsid``, a
double fork) is re-parented to the shim, not to init, so the job's processes stay one tree whatever they do.
When the command ends, or a stop (SIGTERM/SIGINT, the fence) was asked, every process left in that tree gets
SIGTERM, then SIGKILL after ``--stop-grace-s`` (0.8 of it on a stop, so that this happens before the agent's
own SIGKILL of the shim's group at the full grace); the shim exits once the tree is empty, so a workload that
forks helpers and daemons never outlives its job.

The shim keeps the agent's user (it writes those files, and the agent finds it by uid after a restart);
the command runs as ``--uid``/``--gid`` (no supplementary groups, umask 077, no privilege gain through
setuid binaries) under the ``--rlimit`` limits, in ``--cwd``. Options, not environment variables, so the
workload cannot read or change them.

Deliberately imports only the standard library: it starts once per workload and must start fast.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable

RLIMITS = {"nofile": resource.RLIMIT_NOFILE, "nproc": resource.RLIMIT_NPROC, "core": resource.RLIMIT_CORE,
           "as": resource.RLIMIT_AS}
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
POLL_S = 0.05  # how often the shim reaps and checks its stop deadlines


def _write_json(path: str, data: dict) -> None:
    """Atomically, mode 0600: the agent (this shim's user) reads it; no workload needs to."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rlimit(spec: str) -> tuple[str, int]:
    name, _, value = spec.partition("=")
    if name not in RLIMITS or not value.isdigit():
        raise argparse.ArgumentTypeError(f"{spec!r}: expected NAME=VALUE with NAME in {', '.join(RLIMITS)}")
    return name, int(value)


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="python -m services.node_agent.shim", usage="%(prog)s [OPTIONS] WORKDIR -- ARGV...")
    ap.add_argument("--uid", type=int, help="run the command as this uid (the shim needs root for another uid)")
    ap.add_argument("--gid", type=int, help="... and this gid, with no supplementary groups")
    ap.add_argument("--rlimit", type=_rlimit, action="append", default=[], metavar="NAME=VALUE",
                    help=f"soft and hard limit of the command; NAME in {', '.join(RLIMITS)} (sizes in bytes)")
    ap.add_argument("--cwd", help="working directory of the command (default: the shim's)")
    ap.add_argument("--fence", help="the agent's liveness file (module docstring)")
    ap.add_argument("--fence-s", type=float, default=0.0, help="stop the command once --fence is older than this")
    ap.add_argument("--stop-grace-s", type=float, default=10.0,
                    help="SIGTERM -> SIGKILL delay of a stop (the fence's, or the agent's signal), and of the processes "
                         "left when the command ends")
    ap.add_argument("workdir")
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        ap.error("missing -- ARGV...")
    cut = argv.index("--")
    return ap.parse_args(argv[:cut]), argv[cut + 1:]


def _reachable_limits(limits: list[tuple[str, int]]) -> list[tuple[int, int]]:
    """Lift our own hard limits to the requested ones where we may (root, CAP_SYS_RESOURCE), so that the
    child can still set them after dropping root; cap the others at our hard limit, saying so in the log."""
    out = []
    for name, value in limits:
        res = RLIMITS[name]
        soft, hard = resource.getrlimit(res)
        if hard != resource.RLIM_INFINITY and value > hard:
            try:
                resource.setrlimit(res, (soft, value))
            except (ValueError, OSError):
                print(f"shim: rlimit {name}={value} capped at {hard}, the agent's hard limit", flush=True)
                value = hard
        out.append((res, value))
    return out


def _child_setup(limits: list[tuple[int, int]], prctl: Callable[..., int] | None) -> None:
    """In the child, after the uid switch, before exec: the resource limits, and no new privileges."""
    for res, value in limits:
        resource.setrlimit(res, (value, value))
    if prctl is not None:
        prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # setuid binaries (sudo, su) cannot give the workload root back


def main(argv: list[str]) -> int:
    args, cmd = _parse(argv)
    exit_file = os.path.join(args.workdir, "exit.json")
    user = {} if args.uid is None else {"user": args.uid, "group": args.gid, "extra_groups": []}
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        prctl = None
    if prctl is not None and prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:  # pragma: no cover - Linux >= 3.4 has it
        print("shim: cannot become the workload's subreaper; processes that leave its session may outlive it", flush=True)
    # a stop may come as soon as the command exists (the agent signals the whole group): caught from before it
    # starts, and applied once its tree is known (exec gives the command the default handlers back)
    tree: _Tree | None = None
    early: list[int] = []

    def forward(sig: int, _frm: object) -> None:
        if tree is None:
            early.append(sig)
        else:
            tree.stop(sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        limits = _reachable_limits(args.rlimit)
        child = subprocess.Popen(cmd, cwd=args.cwd, umask=0o077, preexec_fn=lambda: _child_setup(limits, prctl), **user)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        print(f"shim: cannot start {cmd[0]!r}: {reason}", flush=True)
        _write_json(exit_file, {"exit_code": 127, "message": f"cannot start {cmd[0]!r}: {reason}",
                                "finished_at_s": time.time()})
        return 127
    tree = _Tree(child.pid, args.stop_grace_s)
    if early:
        tree.stop(early[0])
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the agent's terminal going away must not end workloads
    _write_json(os.path.join(args.workdir, "child.json"), {"pid": child.pid})
    silent = tree.wait(args.fence, args.fence_s if args.fence else 0.0)
    code = tree.status
    out: dict = {"exit_code": code, "finished_at_s": time.time()}
    if silent is not None:
        out.update(fenced=True, message=f"stopped by its supervisor: the node agent showed no sign of life for "
                                        f"{silent:.0f} s (ELASTICO_FENCE_S {args.fence_s:g}), so the job may run elsewhere")
    _write_json(exit_file, out)
    return code if code >= 0 else 128 - code


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` in the process tree (from ``/proc``), parents before their children."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])  # field 4, after the command in parentheses
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, ())
    return out


class _Tree:
    """The workload's process tree below this shim (its subreaper): reaped, stopped and emptied."""

    def __init__(self, child: int, grace_s: float) -> None:
        self.child, self.grace_s = child, grace_s
        self.status: int | None = None  # the command's exit code (negative: signal), once it ended
        self.stop_at: float | None = None  # monotonic time a stop was asked
        self.killed = False

    def signal_all(self, sig: int) -> None:
        for pid in _descendants(os.getpid()):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """A stop: ``sig`` to every process of the tree now, SIGKILL at 0.8 of the grace (:meth:`wait`)."""
        if self.stop_at is None:
            self.stop_at = time.monotonic()
        self.signal_all(sig)

    def reap(self) -> bool:
        """Collect every ended child (the command, and orphans re-parented here); False once none is left."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid == 0:
                return True
            if pid == self.child:
                self.status = os.waitstatus_to_exitcode(status)

    def wait(self, fence: str | None, fence_s: float) -> float | None:
        """Until the command has ended and the tree is empty; returns the agent's silence, s, when the fence
        stopped it (``fence`` untouched for ``fence_s`` > 0: timed on this process's monotonic clock from the last
        change of its modification time, so a step of the wall clock neither fences a live agent nor spares a
        dead one), else None."""
        seen, changed_at = (_mtime(fence), time.monotonic()) if fence_s > 0 else (None, 0.0)
        fenced = None
        ended_at = None
        while self.reap():
            now = time.monotonic()
            if fence_s > 0 and fenced is None:
                m = _mtime(fence)
                if m != seen:
                    seen, changed_at = m, now
                if now - changed_at > fence_s:
                    fenced = now - changed_at
                    print(f"shim: the node agent showed no sign of life for {fenced:.0f} s; stopping the workload "
                          "(fence)", flush=True)
                    self.stop()
            if self.status is not None and ended_at is None:
                ended_at = now
                if _descendants(os.getpid()):
                    print("shim: the command ended; stopping the processes it left", flush=True)
                    self.signal_all(signal.SIGTERM)
            deadlines = ([] if self.stop_at is None else [self.stop_at + 0.8 * self.grace_s]) + \
                        ([] if ended_at is None else [ended_at + self.grace_s])
            if not self.killed and deadlines and now >= min(deadlines):
                self.killed = True
                self.signal_all(signal.SIGKILL)
            time.sleep(POLL_S)
        if self.status is None:  # pragma: no cover - the command is our child: reap() saw it end
            self.status = -signal.SIGKILL
        return fenced


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
