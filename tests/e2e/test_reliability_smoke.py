"""The outside reliability probe, reduced: ``python -m bench.reliability --smoke`` against a real local cluster.

The probe starts its own cluster (``cluster.up(2)``, secure, in a fresh temporary run dir), sends hostile input to
every service, submits jobs concurrently with duplicates, kills a node agent, the allocator and Redis while they
run, and stops the cluster again. Its exit status is the correctness verdict (no UNKNOWN status, no lost or
duplicated job, no oversubscribed GPU, no workload running twice); this test also checks that the per-service
histograms and the summary were printed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("allocator", "pricer", "predictor", "node-1")
CORRECTNESS_ROWS = ("hostile: UNKNOWN (all services)", "concurrency: duplicated request ids",
                    "concurrency: lost acknowledged jobs", "faults: oversubscribed GPU-samples",
                    "faults: workloads running twice")


@pytest.mark.slow
def test_reliability_probe_smoke_passes():
    proc = subprocess.run([sys.executable, "-m", "bench.reliability", "--smoke"], cwd=REPO, capture_output=True,
                          text=True, timeout=240)
    out = proc.stdout
    tail = f"\n--- stdout (tail) ---\n{out[-6000:]}\n--- stderr (tail) ---\n{proc.stderr[-3000:]}"
    for service in SERVICES:
        m = re.search(rf"^hostile {re.escape(service)}: n=(\d+) UNKNOWN=(\d+) INTERNAL=(\d+) \|", out, re.M)
        assert m, f"no hostile-input histogram for {service}{tail}"
        assert int(m.group(1)) >= 500, f"{service}: only {m.group(1)} hostile requests sent{tail}"
        assert m.group(2) == "0", f"{service} answered UNKNOWN {m.group(2)} times{tail}"
    assert re.search(r"^SUMMARY \[smoke\]", out, re.M), f"no summary{tail}"
    for row in CORRECTNESS_ROWS:
        assert re.search(rf"^  {re.escape(row)}\s+0\s+0\s+PASS$", out, re.M), f"summary row {row!r} is not 0 / PASS{tail}"
    assert proc.returncode == 0, f"bench.reliability --smoke exited {proc.returncode}{tail}"
