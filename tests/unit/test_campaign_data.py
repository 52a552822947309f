"""The GPU campaign's derived tables as data: the type table, the ground truth, the predictor's rows, a simulator cell.

The tests build tables the way a GPU session does (``python -m bench.gpu_campaign --dry-run --quick`` then
``bench.gpu_campaign.derive``) in a temporary folder, so that they know every value, and check that without a
campaign folder (none, missing or empty) every loader gives what it gave before; the measured tables committed
under ``data/h200`` are checked at the end.
"""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from elastico.coloc.profiles import DATA_DIR, TraceError, campaign_tables, default_campaign_dir, load_type_table
from elastico.coloc.truth import FAILED_PAIR_NORM, GroundTruth, default_truth, tenant_speeds
from services.predictor import features as F
from services.predictor.datasets import CAMPAIGN_ENV, ProfileCatalog, campaign_observations
from services.predictor.model import data_digest
from services.predictor.train import training_rows
from simulator.run import build_workload
from tests.unit._policy_builders import TRACES

REPO = Path(__file__).resolve().parents[2]
R50, GPT8, GPT4 = "ResNet-50 (batch size 64) [amp]", "GPT-2 (batch size 8) [amp]", "GPT-2 (batch size 4)"
BERT = "BERT-base serving (max batch 16)"


@pytest.fixture(scope="module")
def campaign(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dry run's derived tables (``h200_*.csv`` + ``h200_provenance.json``)."""
    run = tmp_path_factory.mktemp("run")
    res = subprocess.run([sys.executable, "-m", "bench.gpu_campaign", "--dry-run", "--quick", "--out", str(run)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    out = tmp_path_factory.mktemp("derived")
    res = subprocess.run([sys.executable, "-m", "bench.gpu_campaign.derive", str(run / "gpu_campaign.json"),
                          "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return out


def _rows(folder: Path, table: str) -> list[dict[str, str]]:
    with open(folder / f"h200_{table}", newline="") as fh:
        return list(csv.DictReader(fh))


def _edited(campaign: Path, dest: Path, table: str, edit) -> Path:
    """A copy of the campaign folder with ``edit(rows)`` applied to one table."""
    shutil.copytree(campaign, dest)
    rows = _rows(dest, table)
    edit(rows)
    with open(dest / f"h200_{table}", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return dest


def test_dry_run_tables_load_into_the_h200_type_table(campaign: Path) -> None:
    assert [ct.gpu_type for ct in campaign_tables(campaign)] == ["h200"]
    t = load_type_table(DATA_DIR, "h200", campaign_dir=campaign)
    assert t.gpu_type == "h200" and t.names == (GPT4, GPT8, R50, "inference")
    assert t.precision == ("fp32", "amp", "amp", "")
    iso = {r["job_type"]: float(r["isolated_tput"]) for r in _rows(campaign, "isolated_throughputs.csv")}
    assert t.iso_tput_steps_s[:3].tolist() == [iso[n] for n in t.names[:3]]
    # the share curve's fitted u of speed = min(1, share/u) is the type's solo utilisation
    u = {r["job_type"]: float(r["u_fit"]) for r in _rows(campaign, "share_curves.csv") if r["kind"] == "train"}
    assert t.solo_util[:3].tolist() == [u[n] for n in t.names[:3]] and t.fitted.tolist() == [True] * 3 + [False]
    assert t.scale_tput is not None and t.scale_tput[0].tolist() == [1.0, 2.0, 4.0, 8.0]  # one GPU measured: linear


def test_ground_truth_reads_pairs_at_full_shares_and_keeps_the_others_apart(campaign: Path) -> None:
    t = load_type_table(DATA_DIR, "h200", campaign_dir=campaign)
    gt = GroundTruth(t, DATA_DIR, campaign_dir=campaign)
    pairs = _rows(campaign, "coloc_pairs.csv")
    full = next(r for r in pairs if r["share_a_pct"] == r["share_b_pct"] == "100")
    a, b = t.index(full["job_type_a"]), t.index(full["job_type_b"])
    assert gt.matrix[a, b] == min(1.0, float(full["norm_tput_a"])) and gt.matrix[b, a] == min(1.0, float(full["norm_tput_b"]))
    assert gt.measured_pairs == 1  # the 50/50 point is not a second value of the same pair
    half = next(r for r in pairs if r["share_a_pct"] == "50")
    assert any(p.job_a == half["job_type_a"] and p.share_a_pct == 50 and p.norm_a == float(half["norm_tput_a"])
               for p in gt.share_points)
    prio = [p for p in gt.share_points if p.priorities]
    assert len(prio) == 1 and prio[0].job_a == GPT8 and prio[0].priorities == "train=1 service=0"
    assert np.isnan(gt.matrix[t.index(GPT8), t.inference_index])  # only a priority point: the rule stays


def test_a_training_pair_measured_in_several_runs_enters_the_matrix_as_their_mean(campaign: Path,
                                                                                   tmp_path: Path) -> None:
    def repeat(rows):  # the 100/100 pair again in run 2 and run 3 (failed there: not part of the mean)
        full = next(r for r in rows if r["share_a_pct"] == r["share_b_pct"] == "100")
        full.update(norm_tput_a="0.4", norm_tput_b="0.8")
        rows += [{**full, "norm_tput_a": "0.6", "norm_tput_b": "0.6", "run": "2"},
                 {**full, "coloc_failed": "1", "norm_tput_a": "", "norm_tput_b": "", "run": "3"}]

    folder = _edited(campaign, tmp_path / "r", "coloc_pairs.csv", repeat)
    t = load_type_table(DATA_DIR, "h200", campaign_dir=folder)
    gt = GroundTruth(t, DATA_DIR, campaign_dir=folder)
    full = next(r for r in _rows(folder, "coloc_pairs.csv") if r["share_a_pct"] == "100")
    a, b = t.index(full["job_type_a"]), t.index(full["job_type_b"])
    assert (gt.matrix[a, b], gt.matrix[b, a]) == pytest.approx((0.5, 0.7)) and gt.measured_pairs == 1

    def all_failed(rows):
        for r in rows:
            if r["share_a_pct"] == "100":
                r.update(coloc_failed="1", norm_tput_a="", norm_tput_b="")

    gt = GroundTruth(t, DATA_DIR, campaign_dir=_edited(folder, tmp_path / "f", "coloc_pairs.csv", all_failed))
    assert gt.matrix[a, b] == gt.matrix[b, a] == FAILED_PAIR_NORM and gt.measured_pairs == 0


def test_training_inference_speeds_come_from_the_table(campaign: Path, tmp_path: Path) -> None:
    """ResNet-50 next to each of three services at 100/100: the ground truth's ResNet-50 row next to the
    inference pseudo-type is their mean, and the inference row next to ResNet-50 the services' capacities."""
    values = {BERT: ("0.5", "0.9"), "GPT-2 serving (max batch 8)": ("0.6", "0.7"),
              "ResNet-18 serving (max batch 8)": ("0.7", "1.4")}  # 1.4: read as 1 (no faster than alone)

    def edit(rows):
        for r in rows:
            if r["job_type_train"] == R50 and r["share_train_pct"] == "100":
                r["norm_tput_train"], r["norm_capacity_service"] = values[r["service"]]

    folder = _edited(campaign, tmp_path / "c", "train_infer_pairs.csv", edit)
    t = load_type_table(DATA_DIR, "h200", campaign_dir=folder)
    gt = GroundTruth(t, DATA_DIR, campaign_dir=folder)
    r50, inf = t.index(R50), t.inference_index
    assert gt.train_infer_pairs == 3
    assert gt.matrix[r50, inf] == pytest.approx(0.6) and gt.matrix[inf, r50] == pytest.approx((0.9 + 0.7 + 1.0) / 3)
    # one GPU: ResNet-50 and a service, no MPS limits -> the measured values, not the utilisation rule
    got = gt.speeds([r50, inf], util=[t.solo_util[r50], 0.3], training=[True, False])
    assert got.tolist() == pytest.approx([0.6, (0.9 + 0.7 + 1.0) / 3])
    plain = GroundTruth(t, DATA_DIR, campaign_dir=campaign)  # the dry run's own values (~1) differ
    assert plain.speeds([r50, inf], util=[t.solo_util[r50], 0.3], training=[True, False])[0] > 0.9

    def fail(rows):  # BERT's point failed: it counts as a near-stall (as Gavel's failed pairs do)
        next(r for r in rows if r["service"] == BERT and r["share_train_pct"] == "100").update(failed="1")

    failed = GroundTruth(t, DATA_DIR, campaign_dir=_edited(folder, tmp_path / "f", "train_infer_pairs.csv", fail))
    assert failed.matrix[r50, inf] == pytest.approx((FAILED_PAIR_NORM + 0.6 + 0.7) / 3)
    assert failed.matrix[inf, r50] == pytest.approx((FAILED_PAIR_NORM + 0.7 + 1.0) / 3)


def test_committed_tables_are_the_shipped_ground_truth_with_no_code_change(campaign: Path, tmp_path: Path) -> None:
    """A data folder with the tables under ``h200/`` (as a GPU session commits them): ``tenant_speeds`` (the
    node agent's simulated GPUs) knows h200 and maps a trace's ResNet-50 to the campaign's type."""
    data = tmp_path / "data"
    data.mkdir()
    for f in ("gavel_isolated_throughputs.csv", "coloc_gavel_pairs.csv"):
        (data / f).symlink_to(DATA_DIR / f)
    assert default_campaign_dir(data) is None
    shutil.copytree(campaign, data / "h200")
    assert default_campaign_dir(data) == data / "h200"
    gt = GroundTruth(load_type_table(DATA_DIR, "h200", campaign_dir=campaign), DATA_DIR, campaign_dir=campaign)
    r50, inf = gt.types.index(R50), gt.types.inference_index
    got = tenant_speeds("h200", [("ResNet-50 (batch size 64)", 60), ("inference", 40, 0.3)], data_dir=data)
    want = gt.speeds([r50, inf], [60, 40], [gt.types.solo_util[r50], 0.3], [True, False])
    assert got == want.tolist() and got[0] == pytest.approx(min(gt.matrix[r50, inf], 0.6 / gt.types.solo_util[r50]))
    assert tenant_speeds("v100", [("ResNet-50 (batch size 64)", 50)] * 2, data_dir=data) == \
        tenant_speeds("v100", [("ResNet-50 (batch size 64)", 50)] * 2)


def test_predictor_training_rows_include_the_campaign_rows(campaign: Path) -> None:
    assert CAMPAIGN_ENV in F.KNOWN_ENVS and F.KNOWN_ENVS[:4] == ("", "gavel", "gavel-oracle", "lucid")
    base = training_rows(include_lucid=False)
    rows = training_rows(include_lucid=False, campaign_dir=campaign)
    extra = rows[len(base):]
    assert data_digest(rows[:len(base)]) == data_digest(base)
    ti = [r for r in _rows(campaign, "train_infer_pairs.csv") if not r["priority_train"]]
    assert len(extra) == len(_rows(campaign, "coloc_pairs.csv")) + len(ti) == 8
    assert {o.source for o in extra} == {CAMPAIGN_ENV} and {o.a.domain for o in extra} == {"h200@campaign"}
    services = [o for o in extra if not o.b.training]
    assert len(services) == 6 and all(o.a.training for o in services)
    bert = next(o for o in services if o.b.model_family == "bert" and o.a.mps_share_pct == 50)
    row = next(r for r in ti if r["service"] == BERT and r["share_train_pct"] == "50")
    assert bert.b.mps_share_pct == 50 and bert.norm_tput_a == float(row["norm_tput_train"])
    assert bert.b.batch_size == 16 and bert.b.gpu_util_pct == 60.0  # counters of its solo point
    assert max(o.norm_tput_b for o in services) == 1.0  # the dry run's 1.5 capacity is read as 1
    # the features see the environment and the GPU type
    gv = F.pair_matrix([(bert.a, bert.b)])[0, :len(F.GPU_FEATURES)]
    assert gv[F.GPU_FEATURES.index("env_code")] == F.KNOWN_ENVS.index("campaign") and np.isfinite(gv).all()
    # the catalogue completes a live h200 request with the campaign's solo profile
    cat = ProfileCatalog.default(campaign_dir=campaign)
    live = cat.complete(F.JobProfile("ResNet-50", "NVIDIA H200", 64, "bf16", True))
    assert live.isolated_tput_steps_s > 0 and live.mem_used_mib == 1524.0
    assert cat.gavel(R50, "h200") == cat.get("ResNet-50", 64, "h200", "amp")


def test_simulator_runs_a_cell_with_the_campaign_as_ground_truth(campaign: Path, tmp_path: Path, capsys) -> None:
    from simulator.__main__ import main

    out = tmp_path / "sim"
    assert main(["--trace", str(TRACES / "gavel_philly_vc_traces_seed0.csv"), "--max-jobs", "6", "--gpus", "4",
                 "--node-gpus", "4", "--gpu-type", "h200", "--campaign-dir", str(campaign), "--estimator", "rule",
                 "--policies", "exclusive-fifo,mps-equal-share", "--quiet", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "ground truth (h200): 1 measured pairs, 3 training+inference points" in said
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["gpu_type"] == "h200" and summary["meta"]["campaign_dir"] == str(campaign)
    assert [s["completed"] for s in summary["policies"]] == [6, 6]
    w = build_workload(str(TRACES / "gavel_philly_vc_traces_seed0.csv"), 4, max_jobs=6, estimator="rule",
                       gpu_type="h200", campaign_dir=campaign)
    assert w.types.gpu_type == "h200" and set(w.train.type_idx.tolist()) <= {0, 1, 2}


def test_simulator_campaign_options_fail_clearly(campaign: Path, tmp_path: Path, capsys) -> None:
    from simulator.__main__ import main

    trace = str(TRACES / "gavel_philly_vc_traces_seed0.csv")
    (tmp_path / "empty").mkdir()
    for args, says in ((["--campaign-dir", str(tmp_path / "empty")], "--campaign-dir"),
                       (["--gpu-type", "a100"], "gpu type 'a100': no training job types"),
                       (["--gpu-type", "a100", "--campaign-dir", str(campaign)], "GPU types there: h200")):
        with pytest.raises(SystemExit) as ex:
            main(["--trace", trace, "--max-jobs", "3", "--quiet", "--out", str(tmp_path / "o"), *args])
        err = capsys.readouterr().err
        assert ex.value.code == 2 and says in err and "Traceback" not in err, err


def test_malformed_campaign_tables_name_the_file(campaign: Path, tmp_path: Path) -> None:
    bad = _edited(campaign, tmp_path / "cols", "coloc_pairs.csv", lambda rows: [r.pop("share_a_pct") for r in rows])
    with pytest.raises(TraceError, match=r"h200_coloc_pairs.csv:1: campaign table lacks column\(s\) share_a_pct"):
        load_type_table(DATA_DIR, "h200", campaign_dir=bad)
    text = _edited(campaign, tmp_path / "text", "train_infer_pairs.csv",
                   lambda rows: rows[0].update(norm_tput_train="fast"))
    with pytest.raises(TraceError, match=r"h200_train_infer_pairs.csv:2: column norm_tput_train must be a number"):
        campaign_observations(text)
    gone = tmp_path / "gone"
    shutil.copytree(campaign, gone)
    (gone / "h200_share_curves.csv").unlink()
    with pytest.raises(TraceError, match="h200_share_curves.csv: missing"):
        load_type_table(DATA_DIR, "h200", campaign_dir=gone)


def test_without_a_campaign_folder_nothing_changes(campaign: Path, tmp_path: Path) -> None:
    """None, a missing folder, an empty one and the campaign itself (its rows are h200's) give v100 the same
    table and ground truth; the predictor's rows and catalogue are the same without one as with an empty one."""
    (tmp_path / "empty").mkdir()
    folders = [None, tmp_path / "missing", tmp_path / "empty", campaign]
    tables = [load_type_table(DATA_DIR, "v100", campaign_dir=d) for d in folders]
    truths = [GroundTruth(t, DATA_DIR, campaign_dir=d) for t, d in zip(tables, folders)]
    for t, gt in zip(tables[1:], truths[1:]):
        assert t.names == tables[0].names and t.precision == tables[0].precision
        for field in ("solo_util", "iso_tput_steps_s", "fitted", "scale_tput", "scale_measured"):
            assert np.array_equal(getattr(t, field), getattr(tables[0], field), equal_nan=True), field
        assert np.array_equal(gt.matrix, truths[0].matrix, equal_nan=True)
        assert (gt.kappa, gt.measured_pairs, gt.train_infer_pairs, gt.share_points) == (truths[0].kappa, 265, 0, [])
    for d in folders[1:3]:  # h200 without tables: only the inference pseudo-type, as before
        assert load_type_table(DATA_DIR, "h200", campaign_dir=d).names == ("inference",)
    base = data_digest(training_rows(include_lucid=False))
    assert all(data_digest(training_rows(include_lucid=False, campaign_dir=d)) == base for d in folders[1:3])
    assert len(ProfileCatalog.default(campaign_dir=tmp_path / "empty")) == len(ProfileCatalog.default())


def test_committed_h200_tables_are_derived_from_the_committed_runs(tmp_path: Path) -> None:
    """``data/h200`` is exactly what ``bench.gpu_campaign.derive`` makes of the raw runs its provenance names, and
    the shipped type table and ground truth read it by default."""
    shipped = default_campaign_dir()
    assert shipped == DATA_DIR / "h200"
    prov = json.loads((shipped / "h200_provenance.json").read_text())
    sources = [REPO / r["source"] for r in prov["runs"]]
    assert prov["gpu"] == "NVIDIA H200" and prov["mode"] == "gpu" and len(sources) == 4
    # runs 1-3 warmed their services up on two batch sizes only: their service figures are left out
    assert [r["services_used"] for r in prov["runs"]] == [False, False, False, True]
    train_only = [a for r in prov["runs"] if not r["services_used"] for a in ("--train-only", str(REPO / r["source"]))]
    res = subprocess.run([sys.executable, "-m", "bench.gpu_campaign.derive", *map(str, sources), *train_only, "--out",
                          str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    for f in sorted(shipped.glob("h200_*.csv")):
        assert (tmp_path / f.name).read_text() == f.read_text(), f.name
    types = load_type_table(DATA_DIR, "h200", campaign_dir=shipped)
    iso = {r["job_type"]: float(r["isolated_tput"]) for r in _rows(shipped, "isolated_throughputs.csv")}
    assert {R50, GPT8, GPT4} <= set(types.names) and len(iso) == 3
    for name, tput in iso.items():
        assert types.iso_tput_steps_s[types.index(name)] == pytest.approx(tput)
    gt = default_truth("h200")  # what the node agent's simulated h200 GPUs and the simulator read
    assert gt.types.names == types.names and gt.measured_pairs == 2 and gt.train_infer_pairs == 6  # run 4
    assert gt.share_points


def test_capped_composition_is_closer_to_the_h200_pairs_at_half_shares() -> None:
    """The H200 campaign's training pairs at 50/50 MPS shares against the shared rule: a tenant its share holds
    back steals less from its co-tenant (``compose_capped``), which the measurements show -- the job the pair
    slows most ran at 0.55-0.58 of its isolated speed at half shares where it ran at 0.43-0.47 at full shares.
    The rule's mean error is below that of the cap alone (the pair's full-share values capped by each share)."""
    from elastico.coloc.rates import compose_additive, compose_capped, share_speed

    gt = default_truth("h200")
    pts = [p for p in gt.share_points if not p.priorities and p.job_a in gt.types.names and p.job_b in gt.types.names]
    assert len(pts) >= 4
    err_rule, err_cap = [], []
    for p in pts:
        a, b = gt.types.index(p.job_a), gt.types.index(p.job_b)
        pm = np.array([[1.0, gt.matrix[a, b]], [gt.matrix[b, a], 1.0]])
        cap = share_speed(np.array([p.share_a_pct, p.share_b_pct]), gt.types.solo_util[[a, b]])
        seen = np.array([p.norm_a, p.norm_b])
        err_rule += list(np.abs(compose_capped(pm, cap)[0] - seen))
        err_cap += list(np.abs(np.minimum(compose_additive(pm), cap) - seen))
    assert np.mean(err_rule) < 0.8 * np.mean(err_cap)
