"""bench.device_check without a GPU: the dry run exercises the whole orchestration; no GPU fails cleanly.

The script itself is meant for a borrowed GPU machine (one run, a few minutes); here its stage
bookkeeping, JSON, summary, pair scheduling, budget and import stand-ins are checked with fake workers,
a stand-in NVML and the simulated MPS daemon.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import device_check as dc

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.device_check", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _has_gpu() -> bool:
    return dc.gpu_missing_reason() is None


def test_dry_run_writes_the_full_report(tmp_path: Path) -> None:
    t = time.perf_counter()
    res = _run("--dry-run", "--out", str(tmp_path))
    elapsed = time.perf_counter() - t
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    rep = json.loads((tmp_path / dc.JSON_NAME).read_text())
    assert rep["schema"] == dc.SCHEMA and rep["mode"] == "dry-run" and rep["status"] == "complete"
    assert list(rep["stages"]) == ["environment", "nvml", "solo", "mps", "timeslice"]
    assert all(s["status"] == "ok" and s["error"] is None for s in rep["stages"].values()), rep["stages"]

    nvml = rep["stages"]["nvml"]["result"]
    assert nvml["backend"] == "services.node_agent.gpu.NvmlBackend"  # the project's own backend class
    assert nvml["gpu_type"] == "h200" and nvml["util_higher_under_load"] is True
    assert nvml["load_pid_in_process_counters"] is True

    solo = rep["stages"]["solo"]["result"]["runs"]
    assert set(solo) == set(dc.WORKLOADS)
    assert solo["tiny_mlp"]["tenants"][0]["steps_per_s"] == dc.FAKE_RATES["tiny_mlp"]

    mps = rep["stages"]["mps"]["result"]
    assert mps["available"] is True and mps["controller"] == "services.node_agent.mps.SimulatedMps"
    assert mps["shutdown"]["daemon_gone"] is True
    assert mps["client_env_example"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    for w in dc.WORKLOADS:  # every workload alone at every share; the fake rate scales with the share env
        for share in dc.MPS_SHARES:
            t0 = mps["solo"][w][str(share)]["tenants"][0]
            assert t0["share_env_seen"] == str(share)
            assert t0["steps_per_s"] == pytest.approx(dc.FAKE_RATES[w] * share / 100)
        assert mps["share_limit"][w]["25"] == pytest.approx(0.25)
    pairs = mps["pairs"]
    assert len(pairs) == len(dc.PAIRS) * len(dc.PAIR_SHARES)
    assert {(p["pair"], tuple(p["shares"])) for p in pairs} == {
        (f"{a}+{b}", (s, s)) for a, b in dc.PAIRS for s in dc.PAIR_SHARES}
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
    assert ts["required"] is False and len(ts["pairs"]) == len(dc.PAIRS)
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
    rep = json.loads((tmp_path / dc.JSON_NAME).read_text())
    assert rep["status"] == "partial"
    assert all(s["status"] == "skipped" and "budget" in s["error"] for s in rep["stages"].values())
    assert "SKIPPED" in res.stdout


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU")
def test_without_gpu_and_without_dry_run_exits_cleanly(tmp_path: Path) -> None:
    res = _run("--out", str(tmp_path), timeout=60)
    assert res.returncode == 2
    assert "no NVIDIA GPU" in res.stderr and "--dry-run" in res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert json.loads((tmp_path / dc.JSON_NAME).read_text())["status"] == "no_gpu"


def test_worker_errors_are_reported_not_raised() -> None:
    res = subprocess.run([sys.executable, "-m", "bench.device_check", "--worker", "nope", "--fake", "--seconds", "1"],
                         cwd=REPO, capture_output=True, text=True, timeout=60, input="")
    assert res.returncode == 1
    ev = json.loads(res.stdout.strip().splitlines()[-1])
    assert ev["event"] == "error" and "unknown workload" in ev["error"]


def test_project_code_loads_on_a_bare_machine() -> None:
    """Without structlog and numpy (as on the GPU machine), the real NvmlBackend and RealMps still load."""
    code = ("import sys; sys.modules['structlog'] = None; sys.modules['numpy'] = None\n"
            "from bench import device_check as dc\n"
            "gpu, mps, info = dc.load_project()\n"
            "assert gpu.NvmlBackend.__module__ == 'services.node_agent.gpu', gpu\n"
            "assert mps.RealMps.__module__ == 'services.node_agent.mps'\n"
            "assert not info['errors'], info\n"
            "print('|'.join(s.split(' ')[0] for s in info['stand_ins']))\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip() == "structlog|services.node_agent.coloc"


def test_find_tool_looks_beyond_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(dc, "TOOL_DIRS", (str(tmp_path / "nvidia-bin"),))
    assert dc._find_tool("nvidia-cuda-mps-control") is None
    (tmp_path / "nvidia-bin").mkdir()
    tool = tmp_path / "nvidia-bin" / "nvidia-cuda-mps-control"
    shutil.copy("/bin/true", tool)
    assert dc._find_tool("nvidia-cuda-mps-control") == str(tool)
