"""The headline benchmark's smoke run (fixed seed, utilisation-rule estimate): every figure it prints agrees
with ``headline.json``, stays within the workload's ceiling and floor, and every PASS/FAIL verdict is the one
its numbers give, recomputed here from the JSON with the targets the benchmark states (bench/headline.py)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASELINES = ("exclusive-fifo", "exclusive-backfill", "tiresias", "mps-equal-share", "lucid")
POLICIES = ("elastico", *BASELINES)
VARIANTS = ("elastico/no-mps-shapes", "elastico/limits-everywhere", "elastico/no-prices", "elastico/rule-estimate", "elastico/jct-end",
            "elastico/work-end")
# the benchmark's stated targets: JCT vs FIFO, inference SLO, tie, share of the work/h gap, effective util vs FIFO
JCT_X, SLO, TIE, GAP, EFF = 3.0, 0.99, 0.005, 0.5, 1.25
#: metric, label, higher is better, the ceiling's key bounding it
METRICS = (("avg_jct_h", "avg JCT", False, "avg_jct_floor_h"), ("jobs_per_h_loaded", "jobs/h", True, "jobs_per_h_loaded"),
           ("work_gpu_h_per_h", "work/h", True, "work_gpu_h_per_h"), ("eff_util", "eff util", True, "eff_util"))
REL = 1e-9


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """(stdout, headline.json, output folder) of one smoke run (~25 s on 2 idle cores, about twice that on busy ones)."""
    out = tmp_path_factory.mktemp("headline")
    p = subprocess.run([sys.executable, "-m", "bench.headline", "--smoke", "--estimator", "rule", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout, json.loads((out / "headline.json").read_text()), out


def _cells(report: dict) -> dict:
    """The smoke's two cells (16 GPUs, load 1: the trace-derived share with ablations, and share 0.25)."""
    cells = {tag: cell for tag, cell in report.items() if tag != "speed"}
    assert len(cells) == 2, sorted(report)
    return cells


def _by(cell: dict) -> dict:
    return {s["policy"]: s for s in cell["summaries"]}


def _same(a, b) -> bool:
    """Equal as JSON (NaN equals NaN)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _ratio(e: float, other: float, higher: bool) -> float:
    if higher:
        return e / other if other > 0 else math.inf
    return other / e if e > 0 else math.inf


def _leaders(cell: dict) -> tuple[dict, list[str]]:
    """(metric -> best baseline keeping the SLO, baselines below the SLO), as the benchmark defines them."""
    by = _by(cell)
    keep = [by[p] for p in BASELINES if not by[p]["slo_attainment"] < SLO]
    best = {k: (max if higher else min)(keep, key=lambda s, k=k: s[k]) for k, _, higher, _ in METRICS}
    return best, [p for p in BASELINES if by[p]["slo_attainment"] < SLO]


def _section(stdout: str, cell: dict) -> str:
    """The part of stdout printed for ``cell`` (from its ``== ...`` head to the next one)."""
    m = cell["meta"]
    head = f"== {m['gpus']} GPUs (nodes of 8), inference share {m['share']:.2f}"
    start = stdout.index(head)
    end = stdout.find("\n== ", start + 1)
    return stdout[start:] if end < 0 else stdout[start:end]


def test_headline_smoke(smoke):
    """The smoke cells, their policies, files and the trace-derived headline share."""
    stdout, report, out = smoke
    m = re.search(r"hold (\d\.\d+) of the requested GPU-time .* headline share (\d\.\d\d)", stdout)
    assert m and abs(float(m.group(1)) - float(m.group(2))) <= 0.0051, stdout[:2000]  # the share, to 2 places
    cells = _cells(report)
    assert "speed" not in report  # the smoke skips the whole-trace speed run
    assert sorted((c["meta"]["share"], c["meta"]["main"]) for c in cells.values()) == sorted(
        [(float(m.group(2)), True), (0.25, False)])
    assert "information parity" in stdout and "policy configuration = the live allocator's defaults" in stdout
    for tag, cell in cells.items():
        meta = cell["meta"]
        assert (meta["gpus"], meta["load"], meta["jobs"]) == (16, 1.0, 24)
        assert tag == f"g16_share{meta['share']:.2f}_load1"
        assert [s["policy"] for s in cell["summaries"]] == list(POLICIES) + (list(VARIANTS) if meta["main"] else [])
        for name in ("summary.json", "jct_cdf.png", "utilisation.png", "work_vs_ceiling.png"):
            assert (out / tag / name).stat().st_size > 0, (tag, name)
        assert _same(json.loads((out / tag / "summary.json").read_text())["policies"], cell["summaries"]), tag
        section = _section(stdout, cell)
        for line in cell["lines"]:
            assert line in section.splitlines(), line


def test_every_figure_is_within_the_ceiling_and_floor(smoke):
    _, report, _ = smoke
    for tag, cell in _cells(report).items():
        c = cell["ceiling"]
        for s in cell["summaries"]:
            who = (tag, s["policy"])
            assert s["completed"] + s["unfinished"] == cell["meta"]["jobs"], who
            assert s["jobs_per_h_loaded"] <= c["jobs_per_h_loaded"] * (1 + REL), who
            assert s["work_gpu_h_per_h"] <= c["work_gpu_h_per_h"] * (1 + REL), who
            assert 0.0 < s["eff_util"] <= s["alloc_util"] <= 1.0, who
            assert s["avg_jct_h"] >= c["avg_jct_floor_h"] * (1 - REL), who
            assert 0.0 <= s["slo_attainment"] <= 1.0, who  # every smoke cell has inference services
        by = _by(cell)
        assert by["elastico"]["avg_jct_h"] < by["exclusive-fifo"]["avg_jct_h"], tag
        if cell["meta"]["main"]:  # --estimator rule: the rule-estimate ablation is ElastiCo itself, figure by figure
            timing = ("policy", "wall_s", "cpu_s")
            assert _same({k: v for k, v in by["elastico/rule-estimate"].items() if k not in timing},
                         {k: v for k, v in by["elastico"].items() if k not in timing})


def test_effective_utilisation_is_within_its_ceiling(smoke):
    _, report, _ = smoke
    for tag, cell in _cells(report).items():
        for s in cell["summaries"]:
            assert s["eff_util"] <= cell["ceiling"]["eff_util"] * (1 + REL), (tag, s["policy"], s["eff_util"],
                                                                             cell["ceiling"]["eff_util"])


def test_stdout_table_is_the_json(smoke):
    stdout, report, _ = smoke
    for tag, cell in _cells(report).items():
        rows = {ln.split()[0]: ln.split() for ln in _section(stdout, cell).splitlines()
                if ln.split() and ln.split()[0] in POLICIES + VARIANTS}
        assert sorted(rows) == sorted(_by(cell)), tag
        for s in cell["summaries"]:
            r = rows[s["policy"]]
            # columns: policy avgJCT p95JCT mkspan jobs/h jobs/hL work/h queue SLO restarts alloc effect unfin wall
            assert (r[1], r[6], r[8], r[9], r[11], r[12]) == (
                f"{s['avg_jct_h']:.2f}", f"{s['work_gpu_h_per_h']:.1f}", f"{s['slo_attainment']:.4f}",
                str(s["restarts"]), f"{s['eff_util']:.1%}", str(s["unfinished"])), (tag, s["policy"])


def _expected_checks(cell: dict) -> list[tuple[list[str], bool]]:
    """(substrings the check's text must hold, verdict) of each check of a loaded cell, in the benchmark's order."""
    by, c = _by(cell), cell["ceiling"]
    e, f = by["elastico"], by["exclusive-fifo"]
    best, _ = _leaders(cell)
    checks = []
    for key, label, higher, ckey in METRICS:
        x = _ratio(e[key], best[key][key], higher)
        to_c = e[key] / c[ckey] if higher else c[ckey] / e[key]
        checks.append(([f"leads on {label}: elastico ", f" vs leader {best[key]['policy']} ", f" = {x:.3f}x; ",
                        f"{to_c:.2f} of the {'ceiling' if higher else 'floor'} "], x >= 1.0 - TIE))
    jct_x = f["avg_jct_h"] / e["avg_jct_h"]
    checks.append(([f"avg JCT >= 3x lower than exclusive-fifo: {jct_x:.2f}x"], jct_x >= JCT_X))
    if cell["meta"]["main"]:
        need = f["work_gpu_h_per_h"] + GAP * (c["work_gpu_h_per_h"] - f["work_gpu_h_per_h"])
        checks.append(([f"fifo {f['work_gpu_h_per_h']:.2f}, elastico {e['work_gpu_h_per_h']:.2f}", f"(needs {need:.2f})"],
                       e["work_gpu_h_per_h"] >= need - 1e-9))
        checks.append(([f"effective util >= {EFF}x exclusive-fifo", f"= {e['eff_util'] / f['eff_util']:.2f}x"],
                        e["eff_util"] >= EFF * f["eff_util"] - 1e-9))
    checks.append(([f"inference SLO >= 99%: {e['slo_attainment']:.4f}"], e["slo_attainment"] >= SLO))
    return checks


def test_every_verdict_agrees_with_its_numbers(smoke):
    stdout, report, _ = smoke
    misses = 0
    for tag, cell in _cells(report).items():
        section = _section(stdout, cell).splitlines()
        want = _expected_checks(cell)
        assert len(cell["checks"]) == len(want), (tag, cell["checks"])
        for (name, ok), (parts, expected) in zip(cell["checks"], want):
            assert all(p in name for p in parts), (tag, name, parts)
            assert ok is expected, (tag, name)
            assert f"  {'PASS' if ok else 'FAIL':<5} {name}" in section, (tag, name)
            misses += not ok
        _, dropped = _leaders(cell)
        by, e = _by(cell), _by(cell)["elastico"]
        below = [ln for ln in cell["lines"] if ln.startswith("  not leaders")]
        assert below == (["  not leaders (inference SLO < 99%): " + ", ".join(
            f"{p} {by[p]['slo_attainment']:.4f}" for p in dropped)] if dropped else []), tag
        for v in VARIANTS if cell["meta"]["main"] else ():
            a = by[v]
            assert any(f" {v}: avg JCT {a['avg_jct_h']:.2f} h ({a['avg_jct_h'] / e['avg_jct_h']:.3f}x elastico's), "
                       f"work/h {a['work_gpu_h_per_h']:.2f} ({a['work_gpu_h_per_h'] / e['work_gpu_h_per_h']:.3f}x)" in ln
                       for ln in cell["lines"]), (tag, v)
        f, c = by["exclusive-fifo"], cell["ceiling"]
        need = f["work_gpu_h_per_h"] + GAP * (c["work_gpu_h_per_h"] - f["work_gpu_h_per_h"])
        for v in ("elastico/jct-end", "elastico/work-end") if cell["meta"]["main"] else ():
            met = "met" if by[v]["work_gpu_h_per_h"] >= need - 1e-9 else "missed"
            assert any(f" {v}: " in ln and ln.endswith(f"; the work/h target {need:.2f} {met}") for ln in cell["lines"]), (tag, v)
    overall = re.search(r"^OVERALL: (PASS|FAIL \((\d+) miss\(es\), as measured\))", stdout, re.M)
    assert overall, stdout[-2000:]
    assert (overall.group(1) == "PASS") is (misses == 0) and int(overall.group(2) or 0) == misses
    assert len(re.findall(r"^  miss: ", stdout, re.M)) == misses


def test_summary_table_agrees_with_the_cells(smoke):
    stdout, report, out = smoke
    rows = (out / "headline.md").read_text().splitlines()
    assert "\n".join(rows) in stdout
    cells = list(_cells(report).values())
    assert len(rows) == 2 + len(cells)
    for cell, row in zip(cells, rows[2:]):
        meta, by, c = cell["meta"], _by(cell), cell["ceiling"]
        e, f = by["elastico"], by["exclusive-fifo"]
        best, _ = _leaders(cell)
        lead = " | ".join(f"{best[k]['policy']} {_ratio(e[k], best[k][k], higher):.3f}x" for k, _, higher, _ in METRICS)
        assert row == (f"| 16 | {meta['share']:.2f}{'*' if meta['main'] else ''} | 1 | {e['avg_jct_h']:.1f} h | "
                       f"{f['avg_jct_h'] / e['avg_jct_h']:.2f}x | {lead} | {f['work_gpu_h_per_h']:.1f} → "
                       f"{e['work_gpu_h_per_h']:.1f} [{c['work_gpu_h_per_h']:.1f}] | {f['eff_util']:.1%} → "
                       f"{e['eff_util']:.1%} [{c['eff_util']:.1%}] | {e['slo_attainment']:.4f} |"), row


def test_a_negative_redraw_seed_is_a_usage_error(capsys):
    from bench.headline import main
    with pytest.raises(SystemExit) as ex:
        main(["--redraw-types", "-1", "--smoke"])
    err = capsys.readouterr().err
    assert ex.value.code == 2 and "--redraw-types: must be a finite number in [0, inf), got -1" in err, err


@pytest.mark.parametrize("args, named", [(["--sizes", "0"], "--sizes"), (["--node-gpus", "0"], "--node-gpus"),
                                         (["--jobs-64", "0"], "--jobs-64"), (["--workers", "0"], "--workers"),
                                         (["--loads", "-1"], "--loads"), (["--shares", "1.5"], "--shares"),
                                         (["--extra-shares", "0"], "--extra-shares")])
def test_out_of_range_numbers_are_usage_errors_naming_the_option(capsys, args, named):
    from bench.headline import main
    with pytest.raises(SystemExit) as ex:
        main([*args, "--smoke"])
    err = capsys.readouterr().err
    assert ex.value.code == 2 and f"argument {named}: must be a finite number in" in err, err


def test_inference_traces_must_exist_and_include_an_instance_file(capsys, tmp_path):
    from bench.headline import DATA, main
    with pytest.raises(SystemExit) as ex:
        main(["--inference-trace", str(tmp_path / "nope.csv"), "--smoke"])
    assert ex.value.code == 2 and "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ex:  # demand profiles alone: no services to shape
        main(["--inference-trace", str(DATA / "azure2023_llm_inference_conv.csv"), "--smoke"])
    err = capsys.readouterr().err
    assert ex.value.code == 2 and "instance_sn" in err, err
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit) as ex:
        main(["--inference-trace", str(bad), "--smoke"])
    err = capsys.readouterr().err
    assert ex.value.code == 2 and "bad.csv" in err and "unrecognised" in err, err


def test_a_loaded_period_no_job_can_finish_in_is_refused_with_the_option_to_change():
    """The trace's first 14 rows arrive within seconds: at 16 GPUs their loaded period admits no finished job, so the
    ceilings are 0 and the bench refuses the cell (naming --jobs-64) instead of dividing by them."""
    from types import SimpleNamespace

    from bench.headline import DATA, INFERENCE, empty_window
    from simulator.metrics import throughput_ceiling
    from simulator.run import build_workload
    from simulator.traces import TraceError

    def cell(n: int) -> dict:
        w = build_workload(str(DATA / "gavel_philly_vc_traces_seed0.csv"), 16, [str(p) for p in INFERENCE], 0, 1.0,
                           None, n, inference_fraction=0.8, estimator="rule")
        end = float(w.train.arrival_s.max())
        return {"gpus": 16, "share": 0.8, "load": 1.0, "ceiling": throughput_ceiling(w.train, w.types, end, 16, w.inf),
                "results": [SimpleNamespace(arrival_s=w.train.arrival_s, window_end_s=end)]}

    with pytest.raises(TraceError, match=r"last of 14 training arrivals.*--jobs-64"):
        empty_window(cell(14))
    empty_window(cell(24))  # the smoke's workload: a loaded period of about 1,900 h
