"""MPS controllers: the exact command sequences of NVIDIA's MPS documentation, client env, faults."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastico.errors import Unavailable
from services.node_agent.mps import NoMps, RealMps, SimulatedMps, make_mps, pinned_mem_limit, thread_percentage

CTL = "nvidia-cuda-mps-control"


@pytest.fixture
def sim(tmp_path: Path) -> SimulatedMps:
    return SimulatedMps(tmp_path / "pipe", tmp_path / "log", control_timeout_s=1.0)


def spawn_client(mps, gpus: tuple[int, ...], share: float = 50.0, mem: int = 1024) -> subprocess.Popen:
    env = {**os.environ, **mps.client_env(gpus, share, mem)}
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)


@pytest.mark.parametrize(("gpus", "share", "mem", "expected"), [
    ((0,), 50.0, 4096, {"CUDA_VISIBLE_DEVICES": "0", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4096M"}),
    ((1, 3), 33.5, 2048, {"CUDA_VISIBLE_DEVICES": "1,3", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "33.5",
                          "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2048M,1=2048M"}),
    ((2,), 100.0, 16384, {"CUDA_VISIBLE_DEVICES": "2", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=16384M"}),
], ids=["one-gpu", "gang-fractional-share", "whole-gpu"])
def test_client_env_is_exactly_the_slice(sim, gpus, share, mem, expected):
    env = sim.client_env(gpus, share, mem)
    assert env == {**expected, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_MPS_PIPE_DIRECTORY": str(sim.pipe_dir),
                   "CUDA_MPS_LOG_DIRECTORY": str(sim.log_dir)}


def test_value_formats():
    assert pinned_mem_limit(3, 512) == "0=512M,1=512M,2=512M"
    assert thread_percentage(25.0) == "25" and thread_percentage(12.5) == "12.5"


def test_simulated_daemon_issues_the_documented_command_sequence(sim):
    sim.start()
    sim.start()  # idempotent: a running daemon is reused, not started twice
    assert list(sim.commands) == [f"{CTL} -d"]
    assert sim.health().state == "ok" and sim.health().server_pids == ()  # no client yet, so no server
    client = spawn_client(sim, (0,))
    try:
        deadline = time.monotonic() + 5
        while not sim.clients() and time.monotonic() < deadline:
            time.sleep(0.02)
        sim.commands.clear()
        health = sim.health()
        assert health.state == "ok" and health.client_pids == frozenset({client.pid})
        server = health.server_pids[0]
        assert list(sim.commands) == [f"echo get_server_list | {CTL}", f"echo get_client_list {server} | {CTL}"]
        sim.commands.clear()
        assert sim.fault_events() == []
        sim.stop()
        assert list(sim.commands) == [f"echo quit | {CTL}"]
        assert sim.health().state == "dead"
    finally:
        client.kill()
        client.wait()


def test_fault_kills_only_the_clients_of_that_gpu_and_is_reported_once(sim):
    sim.start()
    on0 = [spawn_client(sim, (0,)), spawn_client(sim, (0, 1))]
    on1 = spawn_client(sim, (1,))
    try:
        deadline = time.monotonic() + 5
        while len(sim.clients()) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        sim.inject_fault(0)
        (fault,) = sim.fault_events()
        assert fault.gpu_indices == frozenset({0}) and fault.client_pids == {p.pid for p in on0}
        for p in on0:
            assert p.wait(5) == -signal.SIGKILL
        assert on1.poll() is None
        assert sim.fault_events() == []
    finally:
        for p in [*on0, on1]:
            p.kill()
            p.wait()


def test_stuck_and_dead_daemon_are_detected(sim):
    sim.start()
    sim.inject_stuck()
    assert sim.health().state == "stuck"
    sim.inject_stuck(False)
    sim.inject_death()
    assert sim.health().state == "dead"
    sim.start()
    assert sim.health().state == "ok"
    assert list(sim.commands).count(f"{CTL} -d") == 2


FAKE_CTL = r"""#!/bin/sh
# stand-in for nvidia-cuda-mps-control: logs argv, stdin and the pipe directory it was given
log="$CUDA_MPS_PIPE_DIRECTORY/calls.log"
if [ "$1" = "-d" ]; then
  echo "-d log=$CUDA_MPS_LOG_DIRECTORY" >> "$log"; sh -c 'sleep 30' >/dev/null 2>&1 & echo $! > "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid"; exit 0
fi
read cmd; echo "$cmd" >> "$log"
case "$cmd" in
  get_server_list) echo 4242 ;;
  "get_client_list 4242") printf '101\n102\n' ;;
  "get_server_status 4242") cat "$CUDA_MPS_PIPE_DIRECTORY/status" 2>/dev/null || echo ACTIVE ;;
  quit) kill "$(cat "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid")"; rm -f "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid" ;;
esac
"""


def test_real_controller_drives_the_binary_through_stdin(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    ctl = bindir / CTL
    ctl.write_text(FAKE_CTL)
    ctl.chmod(ctl.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    mps = make_mps("auto", "nvml", tmp_path / "pipe", tmp_path / "log", control_timeout_s=5)
    assert isinstance(mps, RealMps)
    mps.start()
    try:
        health = mps.health()
        assert (health.state, health.server_pids, health.client_pids) == ("ok", (4242,), frozenset({101, 102}))
        assert mps.fault_events() == []
        (tmp_path / "pipe" / "status").write_text("FAULT\n")
        (fault,) = mps.fault_events()
        assert fault.client_pids == {101, 102} and "FAULT" in fault.detail
        assert mps.fault_events() == []  # reported once per server
    finally:
        mps.stop()
    calls = (tmp_path / "pipe" / "calls.log").read_text().splitlines()
    assert calls[0] == f"-d log={tmp_path / 'log'}"
    assert calls[1:4] == ["get_server_list", "get_client_list 4242", "get_server_list"]
    assert calls[-1] == "quit"
    assert list(mps.commands)[0] == f"{CTL} -d" and list(mps.commands)[-1] == f"echo quit | {CTL}"


def test_real_controller_without_the_binary_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(Unavailable, match="ELASTICO_MPS=off"):
        make_mps("real", "nvml", tmp_path / "p", tmp_path / "l")


def test_mode_selection(tmp_path):
    assert isinstance(make_mps("auto", "simulated", tmp_path, tmp_path), SimulatedMps)
    off = make_mps("off", "nvml", tmp_path, tmp_path)
    assert isinstance(off, NoMps) and off.client_env((1,), 50, 10) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"}


@pytest.mark.skipif(os.getuid() != 0, reason="starting the daemon as another user needs root")
def test_a_root_agent_runs_the_daemon_as_the_workload_user(open_tmp, monkeypatch):
    """Daemon, servers and clients share one UID: the daemon runs as the workload user in directories it owns."""
    import pwd

    nobody = pwd.getpwnam("nobody")
    bindir = open_tmp / "bin"
    bindir.mkdir()
    ctl = bindir / CTL
    ctl.write_text(FAKE_CTL.replace('echo "-d log=', 'echo "-d uid=$(id -u) log='))
    ctl.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    mps = make_mps("real", "nvml", open_tmp / "pipe", open_tmp / "log", control_timeout_s=5,
                   run_as=(nobody.pw_uid, nobody.pw_gid))
    mps.start()
    try:
        assert mps.health().state == "ok"
    finally:
        mps.stop()
    assert (open_tmp / "pipe").stat().st_uid == nobody.pw_uid and (open_tmp / "log").stat().st_uid == nobody.pw_uid
    assert (open_tmp / "pipe" / "calls.log").read_text().splitlines()[0] == f"-d uid={nobody.pw_uid} log={open_tmp / 'log'}"
