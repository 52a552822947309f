"""bench.device_check without a GPU: the dry run exercises the whole orchestration; no GPU fails cleanly.

The check itself is meant for a borrowed GPU machine (one run, a few minutes); here its stage bookkeeping, JSON,
summary, pair scheduling and budget are checked with fake workers, a stand-in NVML and the simulated MPS daemon,
on a machine made as bare as the GPU one: no site-packages (``python -S``), structlog alone on PYTHONPATH as
``make device-deps`` leaves it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
import structlog

from bench.device_check import host
from bench.device_check import workloads as wl

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 120, bare: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m bench.device_check ARGS``; with ``bare``, without site-packages and ``bare`` on PYTHONPATH."""
    env = None
    if bare is not None:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env["PYTHONPATH"] = str(bare)
    cmd = [sys.executable, *(["-S"] if bare is not None else []), "-m", "bench.device_check", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def _has_gpu() -> bool:
    return host.gpu_missing_reason() is None


@pytest.fixture(scope="module")
def device_deps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding only structlog and its dist-info, like ``.device-deps/site``."""
    site = tmp_path_factory.mktemp("device-deps") / "site"
    pkg = Path(structlog.__file__).parent
    shutil.copytree(pkg, site / "structlog", ignore=shutil.ignore_patterns("__pycache__"))
    dist = metadata.distribution("structlog")
    info = next(pkg.parent.glob(f"structlog-{dist.version}.dist-info"))
    shutil.copytree(info, site / info.name)
    return site


def test_dry_run_writes_the_full_report(tmp_path: Path, device_deps: Path) -> None:
    t = time.perf_counter()
    res = _run("--dry-run", "--out", str(tmp_path), bare=device_deps)
    elapsed = time.perf_counter() - t
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    rep = json.loads((tmp_path / host.JSON_NAME).read_text())
    assert rep["schema"] == host.SCHEMA and rep["mode"] == "dry-run" and rep["status"] == "complete"
    assert list(rep["stages"]) == ["environment", "nvml", "solo", "mps", "timeslice"]
    assert all(s["status"] == "ok" and s["error"] is None for s in rep["stages"].values()), rep["stages"]
    packages = rep["stages"]["environment"]["result"]["packages"]
    assert packages["structlog"] == structlog.__version__ and packages["grpcio"] is None  # nothing else there

    nvml = rep["stages"]["nvml"]["result"]
    assert nvml["backend"] == "services.node_agent.gpu.NvmlBackend"  # the project's own backend class
    assert nvml["gpu_type"] == "h200" and nvml["util_higher_under_load"] is True
    assert nvml["load_pid_in_process_counters"] is True

    solo = rep["stages"]["solo"]["result"]["runs"]
    assert set(solo) == set(wl.WORKLOADS)
    assert solo["tiny_mlp"]["tenants"][0]["steps_per_s"] == wl.FAKE_RATES["tiny_mlp"]

    mps = rep["stages"]["mps"]["result"]
    assert mps["available"] is True and mps["controller"] == "services.node_agent.mps.SimulatedMps"
    assert mps["shutdown"]["daemon_gone"] is True
    assert mps["client_env_example"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    for w in wl.WORKLOADS:  # every workload alone at every share; the fake rate scales with the share env
        for share in wl.MPS_SHARES:
            t0 = mps["solo"][w][str(share)]["tenants"][0]
            assert t0["share_env_seen"] == str(share)
            assert t0["steps_per_s"] == pytest.approx(wl.FAKE_RATES[w] * share / 100)
        assert mps["share_limit"][w]["25"] == pytest.approx(0.25)
    pairs = mps["pairs"]
    assert len(pairs) == len(wl.PAIRS) * len(wl.PAIR_SHARES)
    assert {(p["pair"], tuple(p["shares"])) for p in pairs} == {
        (f"{a}+{b}", (s, s)) for a, b in wl.PAIRS for s in wl.PAIR_SHARES}
    for p in pairs:
        assert p["error"] is None and len(p["tenants"]) == 2
        assert len({t["pid"] for t in p["tenants"]}) == 2  # two processes, one window
        share = p["shares"][0]
        for t in p["tenants"]:
            assert t["norm"] == pytest.approx(share / 100)  # vs solo at MPS 100
            assert t["norm_vs_solo_same_share"] == pytest.approx(1.0)
        assert p["combined_norm"] == pytest.approx(2 * share / 100)
        assert p["counters"]["mps_health"]["state"] == "ok"
    assert {t["label"] for t in pairs[3]["tenants"]} == {"mlp_bf16#1", "mlp_bf16#2"}  # a+a: distinct labels

    ts = rep["stages"]["timeslice"]["result"]
    assert ts["required"] is False and len(ts["pairs"]) == len(wl.PAIRS)
    assert all(p["mode"] == "time-slicing" and p["combined_norm"] == pytest.approx(2.0) for p in ts["pairs"])

    out = res.stdout
    for needle in ("stage environment", "stage mps: OK", "MPS pairs @100/100", "MPS pairs @50/50",
                   "time-sliced pairs", "status complete"):
        assert needle in out, needle
    assert rep["summary"] and rep["summary"][-1] in out
    assert elapsed < 60, elapsed  # ~10 s on a busy 2-core machine


def test_budget_skips_stages_and_still_writes_json(tmp_path: Path) -> None:
    res = _run("--dry-run", "--budget-s", "0.5", "--out", str(tmp_path))
    assert res.returncode == 1, res.stdout + res.stderr
    rep = json.loads((tmp_path / host.JSON_NAME).read_text())
    assert rep["status"] == "partial"
    assert all(s["status"] == "skipped" and "budget" in s["error"] for s in rep["stages"].values())
    assert "SKIPPED" in res.stdout


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU")
def test_without_gpu_and_without_dry_run_exits_cleanly(tmp_path: Path) -> None:
    res = _run("--out", str(tmp_path), timeout=60)
    assert res.returncode == 2
    assert "no NVIDIA GPU" in res.stderr and "--dry-run" in res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert json.loads((tmp_path / host.JSON_NAME).read_text())["status"] == "no_gpu"


def test_worker_errors_are_reported_not_raised() -> None:
    res = subprocess.run([sys.executable, "-m", "bench.device_check", "--worker", "nope", "--fake", "--seconds", "1"],
                         cwd=REPO, capture_output=True, text=True, timeout=60, input="")
    assert res.returncode == 1
    ev = json.loads(res.stdout.strip().splitlines()[-1])
    assert ev["event"] == "error" and "unknown workload" in ev["error"]


def test_a_missing_module_stops_the_run_before_any_stage(tmp_path: Path) -> None:
    """Without structlog (a bare machine where ``make device-deps`` was not carried) the run refuses, naming both."""
    res = _run("--dry-run", "--out", str(tmp_path), bare=tmp_path / "empty", timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "'structlog'" in res.stderr and "make device-deps" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr + res.stdout and "stage" not in res.stdout
    rep = json.loads((tmp_path / host.JSON_NAME).read_text())
    assert rep["status"] == "missing_module" and "structlog" in rep["error"]


def test_find_tool_looks_beyond_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(host, "TOOL_DIRS", (str(tmp_path / "nvidia-bin"),))
    assert host.find_tool("nvidia-cuda-mps-control") is None
    (tmp_path / "nvidia-bin").mkdir()
    tool = tmp_path / "nvidia-bin" / "nvidia-cuda-mps-control"
    shutil.copy("/bin/true", tool)
    assert host.find_tool("nvidia-cuda-mps-control") == str(tool)
