"""The headline benchmark's smoke mode runs end to end and prints its verdicts."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_headline_smoke(tmp_path):
    p = subprocess.run([sys.executable, "-m", "bench.headline", "--smoke", "--estimator", "rule", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    for name in ("elastico", "exclusive-fifo", "exclusive-backfill", "tiresias", "mps-equal-share", "lucid"):
        assert name in p.stdout
    assert "OVERALL:" in p.stdout and ("PASS" in p.stdout or "FAIL" in p.stdout)
    assert "information parity" in p.stdout
    assert (tmp_path / "headline.json").exists()
    assert any(tmp_path.glob("*/jct_cdf.png")) and any(tmp_path.glob("*/utilisation.png"))
    assert any(tmp_path.glob("*/work_vs_ceiling.png")) and (tmp_path / "headline.md").exists()
    for metric in ("leads on avg JCT", "leads on jobs/h", "leads on work/h", "leads on eff util"):
        assert metric in p.stdout  # every metric has its leader, with PASS or FAIL
    assert "trace-derived inference share" in p.stdout and "ablation elastico/no-prices" in p.stdout
