"""Workload supervisor (``python -m services.node_agent.shim WORKDIR -- ARGV...``), one per workload.

Why a shim: the agent must be able to die (upgrade, crash, ``kill -9``) without killing or losing its
workloads. The agent starts this shim in a new session (so the shim leads the workload's process group
and survives the agent); the shim runs the real command as its child, forwards SIGTERM/SIGINT to it,
and when it ends writes ``WORKDIR/exit.json`` (exit code, negative = signal) atomically. A restarted
agent that re-adopts the workload cannot ``wait()`` for a process that is not its child, so that file is
how it learns the outcome. The child's pid goes to ``WORKDIR/child.pid`` (the pid NVML and MPS report).

Deliberately imports only the standard library: it starts once per workload and must start fast.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m services.node_agent.shim WORKDIR -- ARGV...", file=sys.stderr)
        return 2
    workdir, cmd = argv[0], argv[2:]
    exit_file = os.path.join(workdir, "exit.json")
    try:
        child = subprocess.Popen(cmd)
    except OSError as exc:
        print(f"shim: cannot start {cmd[0]!r}: {exc}", flush=True)
        _write_json(exit_file, {"exit_code": 127, "message": f"cannot start {cmd[0]!r}: {exc.strerror or exc}",
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
    _write_json(os.path.join(workdir, "child.json"), {"pid": child.pid})
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
