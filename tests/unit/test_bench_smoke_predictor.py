"""The predictor benchmark runs end to end in its smoke configuration; every PASS/FAIL it prints is the one the
figures of its own tables give, and the model beats every baseline's MAE on every GPU type."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _table(section: str) -> dict:
    """{scope: {estimator: MAE}} of the first accuracy table in ``section``."""
    lines = section.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("scope "))
    names = [seg.split()[0] for seg in lines[head].split("|")[1:]]
    table = {}
    for ln in lines[head + 2:]:
        if "|" not in ln:
            break
        segs = ln.split("|")
        table[segs[0].split()[0]] = {n: float(s.split()[0]) for n, s in zip(names, segs[1:])} | {
            n + " MAPE": float(s.split()[1]) for n, s in zip(names, segs[1:])}
    return table


def _consistent(word: str, value: float, target: float) -> bool:
    return value == target or (word == "PASS") is (value <= target)  # equal as printed: either verdict


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
    body, summary = out.split("\n== Summary: ")
    gavel = _table(body.split("-- Gavel measured pairs")[1])
    gpus = [g for g in gavel if g != "all"]
    assert sorted(gpus) == ["k80@gavel", "p100@gavel", "v100@gavel"], gavel
    verdicts = re.findall(r"^(PASS|FAIL)  (.*)$", body, re.M)
    seen = set()
    for word, text in verdicts:
        if m := re.fullmatch(r"overall MAE (\S+) <= (\S+)", text):
            assert float(m.group(1)) == gavel["all"]["model"] and _consistent(word, *map(float, m.groups())), text
        elif m := re.fullmatch(r"overall MAPE (\S+)% <= (\S+)%", text):
            assert float(m.group(1)) == gavel["all"]["model MAPE"] and _consistent(word, *map(float, m.groups())), text
        elif m := re.fullmatch(r"(\S+@gavel) MAE (\S+) <= (\S+)", text):
            assert float(m.group(2)) == gavel[m.group(1)]["model"], text
            assert _consistent(word, float(m.group(2)), float(m.group(3))), text
        elif m := re.fullmatch(r"beats (\S+) \(MAE\) on every GPU type(?: \(not on (.*)\))?", text):
            worse = [g for g in gpus if not gavel[g]["model"] < gavel[g][m.group(1)]]
            assert (word == "PASS") is (not worse) and (m.group(2) or "") == ", ".join(worse), text
            assert word == "PASS", text  # the model is better than every baseline on every GPU type
        elif m := re.fullmatch(r"cold p99 (\S+) ms <= (\S+) ms \(.*\)", text):
            assert re.search(rf"^cold \(memos cleared\): p50 \S+ ms  p99 {re.escape(m.group(1))} ms", body, re.M), text
            assert _consistent(word, float(m.group(1)), float(m.group(2))), text
        else:
            raise AssertionError(f"unexpected verdict line: {text}")
        seen.add(text.split()[0] if "@" not in text.split()[0] else "gpu")
    assert {"overall", "gpu", "beats", "cold"} <= seen, verdicts
    m = re.match(r"(\d+) PASS, (\d+) FAIL", summary)
    fails = [text for word, text in verdicts if word == "FAIL"]
    assert m and (int(m.group(1)), int(m.group(2))) == (len(verdicts) - len(fails), len(fails)), summary
    listed = re.findall(r"^FAIL  (?:gavel|latency): (.*?)(?: \(smoke\))?$", summary, re.M)
    assert [t.split(" (")[0] for t in listed] == [t.split(" (")[0] for t in fails], (listed, fails)
    assert elapsed < 60, elapsed  # budget 20 s on an idle machine; generous for a busy CI box


def test_fewer_than_two_folds_is_a_usage_error(capsys):
    from bench.predictor import main
    with pytest.raises(SystemExit) as ex:
        main(["--smoke", "--folds", "1"])
    err = capsys.readouterr().err
    assert ex.value.code == 2 and "argument --folds: must be a finite number in [2, inf), got 1" in err, err
