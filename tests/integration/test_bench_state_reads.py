"""``python -m bench.state_reads --smoke`` runs end to end (seconds) and prints every figure and the verdict line."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


def test_state_reads_bench_smoke_prints_its_figures():
    out = subprocess.run([sys.executable, "-m", "bench.state_reads", "--smoke"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert re.search(r"stored 2,000 finished \+ 100 active jobs", out.stdout), out.stdout
    for name in ("GetClusterState", r"ListJobs \(no filter\)", r"ListJobs \(SUCCEEDED\)", r"ListJobs \(PENDING\)",
                 r"ListJobs \(tenant team-b\)", r"reference: every record scanned for the active jobs \(pre-index path\)"):
        assert re.search(rf"^{name}: p50 [\d.]+ ms, p99 [\d.]+ ms \(first call [\d.]+ ms\)$", out.stdout, re.M), (name, out.stdout)
    assert re.search(r"GetClusterState p50 [\d.]+ ms with 2,000 finished \+ 100 active jobs \(target <= 20 ms\) \[smoke\]",
                     out.stdout), out.stdout


def test_a_negative_job_count_is_a_usage_error(capsys):
    from bench.state_reads import main
    with pytest.raises(SystemExit) as ex:
        main(["--smoke", "--active", "-5"])
    err = capsys.readouterr().err
    assert ex.value.code == 2 and "argument --active: must be a finite number in [0, inf), got -5" in err, err
