"""Workload supervisor (``python -m services.node_agent.shim [OPTIONS] WORKDIR -- ARGV...``), one per workload.

Why a shim: the agent must be able to die (upgrade, crash, ``kill -9``) without killing or losing its
workloads. The agent starts this shim in a new session (so the shim leads the workload's process group
and survives the agent); the shim runs the real command as its child, forwards SIGTERM/SIGINT to it,
and when it ends writes ``WORKDIR/exit.json`` (exit code, negative = signal) atomically. A restarted
agent that re-adopts the workload cannot ``wait()`` for a process that is not its child, so that file is
how it learns the outcome. The child's pid goes to ``WORKDIR/child.json`` (the pid NVML and MPS report).

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


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
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
    try:
        limits = _reachable_limits(args.rlimit)
        child = subprocess.Popen(cmd, cwd=args.cwd, umask=0o077, preexec_fn=lambda: _child_setup(limits, prctl), **user)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        print(f"shim: cannot start {cmd[0]!r}: {reason}", flush=True)
        _write_json(exit_file, {"exit_code": 127, "message": f"cannot start {cmd[0]!r}: {reason}",
                                "finished_at_s": time.time()})
        return 127

    def forward(sig: int, _frm: object) -> None:
        try:
            child.send_signal(sig)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the agent's terminal going away must not end workloads
    _write_json(os.path.join(args.workdir, "child.json"), {"pid": child.pid})
    while True:
        try:
            code = child.wait()
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries wait() already
            continue
    _write_json(exit_file, {"exit_code": code, "finished_at_s": time.time()})
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
