"""The pricer benchmark runs end to end in its smoke configuration and never oversubscribes a pool."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_pricer_bench_smoke() -> None:
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "bench.pricer", "--smoke"], cwd=REPO, capture_output=True,
                         text=True, timeout=180)
    elapsed = time.perf_counter() - t
    assert res.returncode == 0, res.stdout + res.stderr  # non-zero exactly when a capacity was exceeded
    out = res.stdout
    for needle in ("QUALITY", "random cluster-like", "random generic MMKP", "trace 64 GPUs", "SPEED",
                   "512 GPUs x 1,000 jobs", "SCALING", "capacity checks:", "0 violation(s)"):
        assert needle in out, needle
    assert ("PASS" in out) or ("FAIL" in out)
    assert elapsed < 60, elapsed  # budget 20 s on an idle machine; generous for a busy CI box
