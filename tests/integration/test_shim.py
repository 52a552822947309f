"""The workload shim keeps a job's processes one tree: none outlives the command or a stop, even one that left the
command's session with an empty environment (services/node_agent/shim.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _shim(workdir: Path, script: str, grace_s: float) -> subprocess.Popen:
    (workdir / "job.sh").write_text(script)
    with open(workdir / "shim.log", "w") as log:  # a file, not a pipe: a process left behind would hold a pipe open
        return subprocess.Popen([sys.executable, "-m", "services.node_agent.shim", f"--stop-grace-s={grace_s:g}",
                                 str(workdir), "--", "sh", str(workdir / "job.sh")], cwd=REPO, start_new_session=True,
                                stdout=log, stderr=subprocess.STDOUT)


def _escaped_pid(workdir: Path) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = (workdir / "escaped").read_text() if (workdir / "escaped").exists() else ""
        if text.endswith("\n"):
            return int(text)
        time.sleep(0.02)
    raise AssertionError("the workload never wrote its escaped process's pid")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _clean_up(shim: subprocess.Popen, escaped: int) -> None:
    """Whatever a failed test left running: the shim's group (it, the command) and the escaped process."""
    if shim.poll() is None:
        os.killpg(shim.pid, signal.SIGKILL)
        shim.wait()
    if _alive(escaped):
        os.kill(escaped, signal.SIGKILL)


# a process in a session of its own, with no environment left (no tag to find it by), ignoring SIGTERM
ESCAPE = "setsid sh -c 'trap \"\" TERM; echo $$ > {d}/escaped; exec env -i sleep 300' &\n"


def test_processes_a_command_leaves_behind_end_with_it(tmp_path):
    shim = _shim(tmp_path, ESCAPE.format(d=tmp_path) + f"while [ ! -s {tmp_path}/escaped ]; do sleep 0.02; done\nexit 3\n", 1.0)
    escaped = _escaped_pid(tmp_path)
    try:
        assert shim.wait(timeout=10) == 3
        assert json.loads((tmp_path / "exit.json").read_text())["exit_code"] == 3
        assert "stopping the processes it left" in (tmp_path / "shim.log").read_text()
        assert not _alive(escaped)
    finally:
        _clean_up(shim, escaped)


def test_a_stopped_job_leaves_no_process_even_one_that_left_its_session(tmp_path):
    shim = _shim(tmp_path, ESCAPE.format(d=tmp_path) + "exec sleep 300\n", 2.0)
    escaped = _escaped_pid(tmp_path)
    try:
        assert _alive(escaped) and os.getsid(escaped) != os.getsid(shim.pid)
        t0 = time.monotonic()
        os.killpg(shim.pid, signal.SIGTERM)  # what the agent does to stop a workload
        shim.wait(timeout=10)
        # SIGKILL at 0.8 of the grace (1.6 s): the shim is gone before the agent's own SIGKILL at the grace (a
        # grace of 1 s left 0.2 s for the shim's exit, which a loaded machine once took: 1.02 s)
        assert time.monotonic() - t0 < 2.0
        assert json.loads((tmp_path / "exit.json").read_text())["exit_code"] == -signal.SIGTERM
        assert not _alive(escaped)
    finally:
        _clean_up(shim, escaped)


def test_a_stop_as_soon_as_the_command_starts_still_ends_in_an_exit_record(tmp_path):
    """The agent may stop a workload the moment it exists. A SIGTERM to the group right after the command
    appears (before, the shim set its handlers only after starting it, and such a stop killed the shim with no
    exit record in about a third of the tries) ends every time with exit.json saying SIGTERM."""
    for i in range(20):
        work = tmp_path / str(i)
        work.mkdir()
        shim = _shim(work, "exec sleep 300\n", 1.0)
        try:
            deadline = time.monotonic() + 10
            while not Path(f"/proc/{shim.pid}/task/{shim.pid}/children").read_text().split():
                assert time.monotonic() < deadline, "the command never started"
                time.sleep(0.001)
            os.killpg(shim.pid, signal.SIGTERM)
            shim.wait(timeout=10)
            assert json.loads((work / "exit.json").read_text())["exit_code"] == -signal.SIGTERM
        finally:
            if shim.poll() is None:
                os.killpg(shim.pid, signal.SIGKILL)
                shim.wait()
