"""The predictor benchmark runs end to end in its smoke configuration."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_predictor_bench_smoke() -> None:
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "bench.predictor", "--smoke"], cwd=REPO, capture_output=True,
                         text=True, timeout=180)
    elapsed = time.perf_counter() - t
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for needle in ("grouped 3-fold CV", "onehot-xgb", "util-sum", "cold (memos cleared)", "p99", "pairs/s",
                   "== Summary"):
        assert needle in out, needle
    assert "SMOKE" in out  # reduced figures are labelled as such
    assert ("PASS" in out) or ("FAIL" in out)
    assert elapsed < 60, elapsed  # budget 20 s on an idle machine; generous for a busy CI box
