"""The pricer benchmark runs end to end in its smoke configuration, never oversubscribes a pool, and every
PASS/FAIL it prints is the one its own numbers give."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NUM = r"-?[\d,]+\.\d+"


def _ms(value: str, unit: str) -> float:
    return float(value.replace(",", "")) * (1.0 if unit == "ms" else 1e3)


def test_pricer_bench_smoke() -> None:
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "bench.pricer", "--smoke"], cwd=REPO, capture_output=True,
                         text=True, timeout=180)
    elapsed = time.perf_counter() - t
    assert res.returncode == 0, res.stdout + res.stderr  # non-zero exactly when a capacity was exceeded
    out = res.stdout
    for needle in ("QUALITY", "random cluster-like", "random generic MMKP", "trace 64 GPUs", "SPEED",
                   "512 GPUs x 1,000 jobs", "SCALING"):
        assert needle in out, needle
    m = re.search(r"^capacity checks: (\d+) allocations, (\d+) violation\(s\)$", out, re.M)
    assert m and int(m.group(1)) > 0 and m.group(2) == "0", out[-2000:]
    # quality verdicts: the gap against its target, and the ALL row of the table says the same figures
    gaps = re.findall(rf"^  (PASS|FAIL)  (median|worst) gap to MILP over all (\d+) instances <= ({NUM})%: ({NUM})%$",
                      out, re.M)
    assert [g[1] for g in gaps] == ["median", "worst"], out
    verdicts = []
    for word, kind, _n, target, value in gaps:
        if value != target:  # equal at 4 decimals: either verdict is consistent
            assert (word == "PASS") is (float(value) <= float(target)), (kind, value, target)
        verdicts.append(word == "PASS")
    row = re.search(rf"^ALL\s+(\d+)\s+\S+\s+({NUM})%\s+({NUM})%\s", out, re.M)
    assert row and (row.group(1), row.group(2), row.group(3)) == (gaps[0][2], gaps[0][4], gaps[1][4]), out
    # speed verdict: within the speed tolerance (0.1 %) of its own bound and no slower than the target
    m = re.search(rf"^512 GPUs x 1,000 jobs\s+\d+\s+({NUM}) (ms|s)\s+{NUM} (?:ms|s)\s+({NUM})%\s+\d+\s+.*"
                  rf"<= ({NUM}) (ms|s)\s+(PASS|FAIL)\s*$", out, re.M)
    assert m, out
    wall, target = _ms(m.group(1), m.group(2)), _ms(m.group(4), m.group(5))
    assert (m.group(6) == "PASS") is (float(m.group(3)) <= 0.1 and wall <= target), m.group(0)
    verdicts.append(m.group(6) == "PASS")
    m = re.search(r"^targets: (\d+)/(\d+) PASS;", out, re.M)
    assert m and (int(m.group(1)), int(m.group(2))) == (sum(verdicts), len(verdicts)), out[-500:]
    assert elapsed < 60, elapsed  # budget 20 s on an idle machine; generous for a busy CI box
