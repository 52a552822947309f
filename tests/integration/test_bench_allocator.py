"""``python -m bench.allocator --smoke`` runs end to end (< 30 s) and prints both figures."""

from __future__ import annotations

import re
import subprocess
import sys


def test_allocator_bench_smoke_prints_its_figures():
    out = subprocess.run([sys.executable, "-m", "bench.allocator", "--smoke"], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    m = re.search(r"1\. sustained SubmitJob \+ placement: (\d+) jobs submitted .* all (\d+) placed .* -> (\d+) jobs/s", out.stdout)
    assert m and int(m.group(2)) >= int(m.group(1)) > 0 and int(m.group(3)) > 0, out.stdout
    m = re.search(r"2\. round latency, 512 GPUs / (\d+) pending .* median (\d+) ms", out.stdout)
    assert m and int(m.group(1)) > 0, out.stdout
    assert out.stdout.index("-- mTLS + tokens") < out.stdout.index("-- plaintext")  # both modes, side by side
    assert re.search(r"secure / plaintext: placement rate [\d.]+x", out.stdout), out.stdout
