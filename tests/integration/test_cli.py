"""The `elastico` command as a user drives it: a real suite on loopback (`elastico up --nodes 1`), subprocesses only.

Submit from a YAML file, see the job in `list`, `describe` it with its reason (a never-schedulable job says why),
cancel it; a malformed file exits 2 naming the field and its line; `top --once` renders a frame.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devtools.cli import main as cli_main
from elastico.redis_embedded import free_port

ELASTICO = Path(sys.executable).parent / "elastico"

FITS = """\
name: cli-fits
kind: training
model_family: ResNet-50
batch_size: 32
training:
  total_steps: 1000000
shapes:
  - num_gpus: 1
    compute_share_pct: 50
    mem_mib: 4096
"""

NEVER = """\
name: cli-never
kind: training
model_family: ResNet-50
batch_size: 32
training: {total_steps: 1000}
shapes:
  - {num_gpus: 64, compute_share_pct: 100, mem_mib: 16000}
"""

MALFORMED = """\
name: cli-bad
kind: training
model_family: ResNet-50
training:
  total_steps: 10
shapes:
  - num_gpus: 1
    compute_share_pct: 50
    mem_mib: -5
"""


@pytest.fixture(scope="module")
def suite():
    from tests.conftest import reachable_dir

    assert ELASTICO.exists(), f"{ELASTICO} missing: `make` (pip install -e .) installs the console script"
    with reachable_dir() as d:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICO_")}
        env.update({"ELASTICO_RUN_DIR": str(d / "run"), "ELASTICO_BASE_PORT": str(free_port()), "COLUMNS": "120"})
        up = subprocess.run([str(ELASTICO), "up", "--nodes", "1"], env=env, capture_output=True, text=True, timeout=60)
        try:
            assert up.returncode == 0, up.stdout + up.stderr
            yield env, d
        finally:
            down = subprocess.run([str(ELASTICO), "down"], env=env, capture_output=True, text=True, timeout=60)
            assert down.returncode == 0, down.stderr


def run(env, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ELASTICO), *args], env=env, capture_output=True, text=True, timeout=30, cwd="/")


def submit(env, d: Path, name: str, text: str) -> str:
    f = d / name
    f.write_text(text)
    r = run(env, "submit", "-f", str(f), "-o", "json")
    assert r.returncode == 0, r.stderr
    [job] = json.loads(r.stdout)
    return job["job_id"]


def test_submit_list_describe_cancel(suite):
    env, d = suite
    fits, never = submit(env, d, "fits.yaml", FITS), submit(env, d, "never.yaml", NEVER)
    deadline = time.monotonic() + 20
    while True:  # the next scheduling round places one and gives up on the other
        jobs = {j["job_id"]: j for j in json.loads(run(env, "list", "-o", "json").stdout)}
        if jobs[fits]["state"] in ("placed", "running") and jobs[never]["reason"] == "never_schedulable":
            break
        assert time.monotonic() < deadline, jobs
        time.sleep(0.3)
    listing = run(env, "list")
    assert listing.returncode == 0 and listing.stdout.splitlines()[0].split()[:5] == ["JOB", "NAME", "TENANT", "KIND", "STATE"]
    rows = {ln.split()[0]: ln.split() for ln in listing.stdout.splitlines()[1:]}
    assert rows[never][4:6] == ["pending", "never_schedulable"] and rows[fits][1] == "cli-fits"
    assert all(len(ln) <= 120 for ln in listing.stdout.splitlines())
    pending = run(env, "list", "--state", "pending", "-o", "yaml")
    assert never in pending.stdout and fits not in pending.stdout

    why = run(env, "describe", never)
    assert why.returncode == 0, why.stderr
    assert "Why pending:   never schedulable" in why.stdout and "needs 64 GPUs" in why.stdout
    assert "never_schedulable" in why.stdout.split("Events:")[1]  # the history, from WatchJobs
    placed = run(env, "describe", fits)
    assert placed.returncode == 0, placed.stderr
    assert "Placement:     shape 0" in placed.stdout and "node-1" in placed.stdout
    assert "placed" in placed.stdout.split("Events:")[1]

    top = run(env, "top", "--once")
    assert top.returncode == 0, top.stderr
    assert "\x1b" not in top.stdout and top.stdout.startswith("elastico top")
    assert re.search(r"^tenants: \S+ 1/1 running/pending 0\.50 GPUs", top.stdout, re.M), top.stdout
    gpu_rows = [ln for ln in top.stdout.splitlines() if ln.startswith("node-1 ")]
    assert len(gpu_rows) == 4 and any(fits in ln and "50%" in ln for ln in gpu_rows)

    nodes = run(env, "nodes")
    assert nodes.returncode == 0 and "node-1" in nodes.stdout and "simulated" in nodes.stdout

    watch = subprocess.Popen([str(ELASTICO), "watch", fits, "--from-start"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        seen = [watch.stdout.readline() for _ in range(3)]  # submitted, placed, running: the history first
        assert all(fits in ln for ln in seen) and "placed" in seen[1], seen
        cancel = run(env, "cancel", fits)
        assert cancel.returncode == 0 and f"job {fits} cancelled" in cancel.stdout
        while "cancelled" not in (line := watch.stdout.readline()):  # then what happens next, as it happens
            assert line, watch.stderr.read()
        watch.send_signal(signal.SIGINT)
        assert watch.wait(timeout=10) == 0
    finally:
        watch.kill()
        watch.wait()
    got = json.loads(run(env, "get", fits, "-o", "json").stdout)
    assert got[0]["state"] == "cancelled" and got[0]["reason"] == "cancelled_by_client"
    again = run(env, "cancel", fits)
    assert again.returncode == 1 and "FAILED_PRECONDITION" in again.stderr and "already cancelled" in again.stderr
    missing = run(env, "get", "j-0000")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr


def test_malformed_file_names_field_and_line(suite):
    env, d = suite
    bad = d / "bad.yaml"
    bad.write_text(MALFORMED)
    r = run(env, "submit", "-f", str(bad))
    assert r.returncode == 2 and f"{bad}:9: spec.shapes[0].mem_mib: must be in [1, 16777216] MiB, got -5" in r.stderr, r.stderr
    bad.write_text(FITS.replace("  total_steps: 1000000", "  total_steps: 1000000\n  colour: red"))
    r = run(env, "submit", "-f", str(bad))
    assert r.returncode == 2 and f"{bad}:7: spec.training.colour: unknown field" in r.stderr, r.stderr
    bad.write_text("kind: training\n  x: [\n")
    r = run(env, "submit", "-f", str(bad))
    assert r.returncode == 2 and f"{bad}:2: not valid YAML/JSON" in r.stderr, r.stderr
    assert run(env, "list", "--output", "xml").returncode == 2  # usage errors are 2 as well


def test_help_everywhere(capsys, monkeypatch):
    r = subprocess.run([str(ELASTICO), "--help"], capture_output=True, text=True, timeout=30)  # the installed script
    assert r.returncode == 0 and "usage: elastico" in r.stdout, r.stderr
    monkeypatch.setenv("COLUMNS", "80")  # argparse's width when its output is not a terminal, as in the script's run
    for cmd in ("", "up", "down", "status", "submit", "get", "list", "watch", "cancel", "describe", "nodes", "top", "bench"):
        with pytest.raises(SystemExit) as done:  # in this process: the same parser, without 0.5 s of start-up each
            cli_main([*([cmd] if cmd else []), "--help"])
        out = capsys.readouterr().out
        assert done.value.code == 0 and "usage: elastico" in out, cmd
        assert all(len(ln) <= 120 for ln in out.splitlines()), cmd
    sim = subprocess.run([str(ELASTICO), "sim", "--help"], capture_output=True, text=True, timeout=60)
    assert sim.returncode == 0 and "usage: python -m simulator" in sim.stdout


def test_hostile_arguments_are_usage_errors_before_any_call():
    env = {**os.environ, "ELASTICO_NODES": "abc"}  # a bad default of `up` breaks no other subcommand
    for args, says in ((["list", "--limit", "-5"], "--limit"), (["watch", "--from-start", "--after", "0"], "--after"),
                       (["up"], "--nodes"), (["list", "--address", "alloc ator:50050"], "--address")):
        r = subprocess.run([str(ELASTICO), *args], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
