"""Interference model: symmetry, missing counters, persistence, k-way composition, CLI, online refresh."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from elastico.coloc.rates import compose_k_way
from services.predictor import datasets as D
from services.predictor import features as F
from services.predictor.datasets import ProfileCatalog
from services.predictor.evaluate import cv_folds
from services.predictor.features import JobProfile, Observation
from services.predictor.model import ArtifactError, InterferenceModel, TrainParams, load_model, save_model, train_model

REPO = Path(__file__).resolve().parents[2]
NAN = float("nan")


@pytest.fixture(scope="module")
def catalog() -> ProfileCatalog:
    return ProfileCatalog.from_gavel(D.PROJECT_DATA_DIR)


@pytest.fixture(scope="module")
def rows(catalog: ProfileCatalog) -> list[Observation]:
    return D.read_pair_file(D.PROJECT_DATA_DIR / "coloc_gavel_pairs.csv", catalog)


@pytest.fixture(scope="module")
def model(rows: list[Observation], catalog: ProfileCatalog) -> InterferenceModel:
    return train_model(rows, seed=0, catalog=catalog)


@pytest.fixture(scope="module")
def profiles(catalog: ProfileCatalog) -> list[JobProfile]:
    extra = [
        JobProfile("ResNet-50", "v100", 64, gpu_util_pct=95.0, mem_bw_util_pct=70.0, mem_used_mib=9000.0),
        JobProfile("mystery-net", "v100", 32, "amp", gpu_util_pct=40.0),
        JobProfile("LM", "v100", 20, mps_share_pct=50.0),
        JobProfile("VGG", "v100", 64, training=False),
    ]
    return [p for p in catalog if p.gpu_type == "v100"] + extra


def test_symmetric_in_a_and_b(model: InterferenceModel, profiles: list[JobProfile]) -> None:
    rng = np.random.default_rng(1)
    pairs = [(profiles[i], profiles[j]) for i, j in rng.integers(0, len(profiles), (200, 2))]
    ab = model.predict_pairs(pairs)
    model.clear_cache()
    ba = model.predict_pairs([(b, a) for a, b in pairs])
    np.testing.assert_array_equal(ab, ba[:, ::-1])
    self_pairs = model.predict_pairs([(p, p) for p in profiles])
    np.testing.assert_array_equal(self_pairs[:, 0], self_pairs[:, 1])


@settings(max_examples=40, deadline=None)
@given(i=st.integers(0, 200), j=st.integers(0, 200))
def test_batched_equals_single_and_memo(model: InterferenceModel, profiles: list[JobProfile], i: int, j: int) -> None:
    a, b = profiles[i % len(profiles)], profiles[j % len(profiles)]
    batch = model.predict_pairs([(a, b), (b, a), (a, a)])
    single = model.predict_pairs([(a, b)])
    np.testing.assert_array_equal(batch[0], single[0])
    np.testing.assert_array_equal(batch[1], single[0][::-1])


def test_two_thread_prediction_equals_one_thread(model: InterferenceModel, profiles: list[JobProfile],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Boosters run on a second thread for large batches: the same numbers, in the same rows."""
    import services.predictor.model.ensemble as M

    rng = np.random.default_rng(3)
    pairs = [(profiles[i], profiles[j]) for i, j in rng.integers(0, len(profiles), (300, 2))]
    pairs += [(replace(a, env="gavel-oracle"), replace(b, env="gavel-oracle")) for a, b in pairs[:50]]
    monkeypatch.setattr(M, "_PARALLEL_MIN_ROWS", 10**9)
    model.clear_cache()
    serial = model.predict_pairs(pairs)
    monkeypatch.setattr(M, "_PARALLEL_MIN_ROWS", 1)
    model.clear_cache()
    np.testing.assert_array_equal(model.predict_pairs(pairs), serial)


def test_outputs_in_unit_interval_and_finite(model: InterferenceModel, profiles: list[JobProfile]) -> None:
    pairs = [(a, b) for a in profiles[::5] for b in profiles[::7]]
    pred = model.predict_pairs(pairs)
    assert pred.shape == (len(pairs), 2)
    assert np.isfinite(pred).all() and (pred >= 0).all() and (pred <= 1).all()


@pytest.mark.parametrize(("a", "b", "low"), [
    (JobProfile("ResNet-50", "v100", 64), JobProfile("LM", "v100", 20), False),
    (JobProfile("ResNet-50", "v100"), JobProfile("LM", "v100"), False),  # no batch size, no counters
    (JobProfile("llama", "v100", 8, "bf16", False), JobProfile("LM", "v100", 20), True),  # unseen family
    (JobProfile("ResNet-50", "h100", 64), JobProfile("LM", "h100", 20), True),  # unseen GPU type
    (JobProfile("x", "mi300x"), JobProfile("y", "mi300x"), True),  # nothing known at all
    (JobProfile("ResNet-50", "v100", 64, gpu_util_pct=99, mem_bw_util_pct=80, mem_used_mib=12000,
                tensor_util_pct=30), JobProfile("LM", "v100", 20, gpu_util_pct=60), False),
], ids=["known", "no-batch", "unseen-family", "unseen-gpu", "unknown-everything", "with-counters"])
def test_missing_information_still_answers(model: InterferenceModel, a: JobProfile, b: JobProfile, low: bool) -> None:
    pred = model.predict([(a, b)])
    assert np.isfinite(pred.norm_tput).all() and ((pred.norm_tput >= 0) & (pred.norm_tput <= 1)).all()
    assert bool(pred.low_confidence[0]) is low
    assert pred.model_version == model.version


def test_catalogue_completion_matches_full_profiles(model: InterferenceModel, rows: list[Observation]) -> None:
    full = [(r.a, r.b) for r in rows[:60]]
    bare = [(JobProfile(a.model_family, a.gpu_type, a.batch_size), JobProfile(b.model_family, b.gpu_type, b.batch_size))
            for a, b in full]
    np.testing.assert_array_equal(model.predict_pairs(full), model.predict_pairs(bare))


def test_empty_batch_and_mixed_gpus(model: InterferenceModel) -> None:
    empty = model.predict([])
    assert empty.norm_tput.shape == (0, 2) and empty.low_confidence.shape == (0,)
    with pytest.raises(ValueError, match="gpu_type"):
        model.predict_pairs([(JobProfile("VGG", "v100"), JobProfile("VGG", "k80"))])


def test_round_trip_gives_identical_predictions(model: InterferenceModel, profiles: list[JobProfile], tmp_path: Path) -> None:
    path = save_model(model, tmp_path / "m" / "interference.json")
    assert sorted(p.name for p in path.parent.iterdir()) == ["interference.json"]  # no temp file left
    loaded = load_model(path)
    pairs = [(a, b) for a in profiles[::3] for b in profiles[::4]]
    np.testing.assert_array_equal(model.predict_pairs(pairs), loaded.predict_pairs(pairs))
    assert loaded.version == model.version and loaded.data_digest == model.data_digest
    assert loaded.schema_version == F.SCHEMA_VERSION and loaded.metrics == model.metrics
    art = json.loads(path.read_text())
    for key in ("format", "version", "schema_version", "training_data_sha256", "metrics", "created_at", "boosters"):
        assert key in art
    assert len(art["training_data_sha256"]) == 64


def test_load_rejects_bad_artifacts(model: InterferenceModel, tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="no model artifact"):
        load_model(tmp_path / "absent.json")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not JSON"):
        load_model(tmp_path / "junk.json")
    art = model.to_json_dict()
    art["schema_version"] = "pf-0"
    (tmp_path / "old.json").write_text(json.dumps(art))
    with pytest.raises(ArtifactError, match="schema"):
        load_model(tmp_path / "old.json")


def test_training_is_deterministic_and_digest_tracks_data(rows: list[Observation], catalog: ProfileCatalog,
                                                         model: InterferenceModel) -> None:
    again = train_model(rows, seed=0, catalog=catalog)
    pairs = [(r.a, r.b) for r in rows[:100]]
    np.testing.assert_array_equal(model.predict_pairs(pairs), again.predict_pairs(pairs))
    assert again.data_digest == model.data_digest
    fewer = train_model(rows[:-1], seed=0, catalog=catalog, params=TrainParams(n_bags=1, rounds=10))
    assert fewer.data_digest != model.data_digest


def test_training_needs_usable_rows() -> None:
    a, b = JobProfile("VGG", "v100"), JobProfile("LM", "v100")
    with pytest.raises(ValueError, match="no usable"):
        train_model([Observation(a, b, NAN, NAN, failed=True)])


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 6).flatmap(lambda k: arrays(np.float64, (k, k), elements=st.floats(0.001, 1.0))))
def test_k_way_composition_bounds(pw: np.ndarray) -> None:
    out = compose_k_way(pw)
    k = pw.shape[0]
    off = ~np.eye(k, dtype=bool)
    for i in range(k):
        others = pw[i][off[i]]
        assert np.prod(others) - 1e-12 <= out[i] <= others.min() + 1e-12


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_k_way_saturating_jobs_share_time_evenly(k: int) -> None:
    pw = np.full((k, k), 0.5)
    np.testing.assert_allclose(compose_k_way(pw), np.full(k, 1.0 / k) if k > 1 else [1.0])


def test_predict_k_way(model: InterferenceModel, catalog: ProfileCatalog) -> None:
    a = catalog.gavel("ResNet-50 (batch size 64)", "v100")
    b = catalog.gavel("LM (batch size 20)", "v100")
    c = catalog.gavel("Transformer (batch size 32)", "v100")
    np.testing.assert_array_equal(model.predict_k_way([a]), [1.0])
    np.testing.assert_allclose(model.predict_k_way([a, b]), model.predict_pairs([(a, b)])[0])
    three = model.predict_k_way([a, b, c])
    ab, ac, bc = model.predict_pairs([(a, b), (a, c), (b, c)])
    assert three[0] <= min(ab[0], ac[0]) and three[1] <= min(ab[1], bc[0]) and three[2] <= min(ac[1], bc[1])
    with pytest.raises(ValueError, match="one GPU type"):
        model.predict_k_way([a, catalog.gavel("LM (batch size 20)", "k80")])


def test_cv_folds_never_split_a_job_type_pair(rows: list[Observation]) -> None:
    folds = cv_folds(rows, 5, seed=3)
    fold_of: dict[tuple, int] = {}
    for r, f in zip(rows, folds):
        assert fold_of.setdefault(r.group, f) == f  # every GPU type of a pair lands in one fold
    per_gpu = cv_folds(rows, 5, seed=3, group_by="gpu-pair")
    assert len(set(per_gpu.tolist())) == 5


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.predictor.evaluate", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_evaluate_cli_on_small_files(model: InterferenceModel, tmp_path: Path) -> None:
    path = model.save(tmp_path / "model.json")
    lines = (D.PROJECT_DATA_DIR / "coloc_gavel_pairs.csv").read_text().splitlines()
    small = tmp_path / "gavel_small.csv"
    small.write_text("\n".join([lines[0], *lines[1:30], *lines[-30:]]) + "\n")
    res = _run("--model", str(path), "--pairs", str(small))
    assert res.returncode == 0, res.stderr
    for word in ("gavel schema", "model", "mean", "util-sum", "k80", "v100", "in-sample"):
        assert word in res.stdout
    # made-up rows in Lucid's schema (not Lucid's data): scored with task features only
    lucid = tmp_path / "lucid_schema.csv"
    lucid.write_text("src_row,model1,dataset1,gpu_num1,batchsize1,amp1,speed1,model2,dataset2,gpu_num2,batchsize2,"
                     "amp2,speed2,gpu_util,gmem_util,gmem\n"
                     "0,VGG,CIFAR-10,1,64,0,0.9,PPO,LunarLander,1,32,0,0.95,50,20,4000\n"
                     "1,ResNet18,CIFAR-10,1,128,1,0.7,VGG,CIFAR-10,1,64,0,0.8,90,40,6000\n")
    res = _run("--model", str(path), "--pairs", str(lucid))
    assert res.returncode == 0, res.stderr
    assert "lucid schema" in res.stdout and "rtx3090" in res.stdout and "2 low-confidence" in res.stdout
    bad = tmp_path / "bad.csv"
    bad.write_text("x,y\n1,2\n")
    res = _run("--model", str(path), "--pairs", str(bad))
    assert res.returncode == 2 and "neither" in res.stderr
    res = _run("--model", str(tmp_path / "absent.json"), "--pairs", str(small))
    assert res.returncode == 2 and "no model artifact" in res.stderr


def test_online_refresh_reduces_error_of_a_badly_predicted_pair(rows: list[Observation],
                                                               catalog: ProfileCatalog) -> None:
    usable = [r for r in rows if not r.failed and r.a.job_key != r.b.job_key]
    groups = sorted({r.group for r in usable}, key=repr)
    held = set(groups[::9])  # ~30 pairs the first model never sees
    train = [r for r in rows if r.group not in held]
    base = train_model(train, seed=0, catalog=catalog)
    test = [r for r in usable if r.group in held]
    pred = base.predict_pairs([(r.a, r.b) for r in test])
    truth = np.array([[r.norm_tput_a, r.norm_tput_b] for r in test])
    err = np.abs(pred - truth).mean(axis=1)
    worst = test[int(np.argmax(err))]
    before = float(err.max())
    assert before > 0.05  # it really was predicted badly
    # node agents report the pair three times (measurement noise of +-0.01 around the true value)
    observations = [Observation(worst.a, worst.b, worst.norm_tput_a + d, worst.norm_tput_b - d, source="observation")
                    for d in (-0.01, 0.0, 0.01)]
    refreshed = train_model(train + observations, seed=0, catalog=catalog)
    after = float(np.abs(refreshed.predict_pairs([(worst.a, worst.b)])[0]
                         - [worst.norm_tput_a, worst.norm_tput_b]).mean())
    assert after < before / 2, (before, after)
    assert refreshed.version != base.version


def test_environments_are_kept_apart_and_unknown_env_uses_the_reference(catalog: ProfileCatalog) -> None:
    measured = D.read_pair_file(D.PROJECT_DATA_DIR / "coloc_gavel_pairs.csv", catalog)
    oracle = D.read_pair_file(D.PROJECT_DATA_DIR / "coloc_gavel_oracle_pairs.csv", catalog)
    m = train_model(measured + oracle, seed=0, catalog=catalog, params=TrainParams(n_bags=1, rounds=40))
    assert m.meta["envs_seen"] == ["gavel", "gavel-oracle"] and m.meta["reference_env"] == "gavel"
    assert set(m.to_json_dict()["boosters"]) == {"*", "gavel", "gavel-oracle"}
    r = next(x for x in measured if x.a.gpu_type == "p100" and not x.failed and x.a.job_key != x.b.job_key)
    as_measured = m.predict_pairs([(r.a, r.b)])
    as_oracle = m.predict_pairs([(replace(r.a, env="gavel-oracle"), replace(r.b, env="gavel-oracle"))])
    live = m.predict_pairs([(JobProfile(r.a.model_family, "p100", r.a.batch_size),
                             JobProfile(r.b.model_family, "p100", r.b.batch_size))])
    assert not np.array_equal(as_measured, as_oracle)
    np.testing.assert_array_equal(live, as_measured)  # "" (this cluster, no rows yet) -> reference env


def test_job_prior_leaves_the_pair_out_at_prediction_as_in_training(rows: list[Observation],
                                                                     catalog: ProfileCatalog) -> None:
    """The boosters' base margin of a pair equals the margin of a model that never saw the pair: training
    rows were fitted with leave-own-pair-out priors, so an in-training pair must get the same one."""
    from services.predictor.model import ordered_examples

    held = rows[1].group
    full = train_model(rows, seed=0, catalog=catalog)
    without = train_model([r for r in rows if r.group != held], seed=0, catalog=catalog)
    pair = (rows[1].a, rows[1].b)
    margins = []
    for m in (full, without):
        ids = m._table.ids_of(list(pair))
        margins.append(m._margin(ids[:1], ids[1:]))
    np.testing.assert_allclose(margins[0], margins[1], rtol=1e-9)
    pairs, y, _ = ordered_examples(rows)
    assert np.all((margins[0] >= 0.0) & (margins[0] <= 1.0)) and len(pairs) == len(y)


def test_version_1_artifact_without_prior_still_loads(model: InterferenceModel, profiles: list[JobProfile],
                                                      tmp_path: Path) -> None:
    art = model.to_json_dict()
    art["format"] = "elastico-interference-model/1"
    art.pop("job_prior")
    for k in ("prior_margin", "prior_n", "objective"):
        art["params"].pop(k)
    (tmp_path / "v1.json").write_text(json.dumps(art))
    old = load_model(tmp_path / "v1.json")  # boosters predict without a margin, as /1 trained them
    assert np.all(np.isfinite(old.predict_pairs([(profiles[0], profiles[1])])))
    art["format"] = "elastico-interference-model/0"
    (tmp_path / "v0.json").write_text(json.dumps(art))
    with pytest.raises(ArtifactError, match="retrain"):
        load_model(tmp_path / "v0.json")


def _kept_full_pair(rows: list[Observation]) -> Observation:
    """Gavel's measured V100 row (ResNet-18 bs 32 next to LSTM bs 80): ResNet-18 kept all its throughput
    (1.0), as it did next to most co-tenants on that campaign's V100, while the regression alone answers
    about 0.94 for this pair when it is unseen."""
    return next(r for r in rows if r.a.gpu_type == "v100" and r.a.model_family == "resnet18" and r.a.batch_size == 32
                and r.b.model_family == "lstm" and r.b.batch_size == 80 and not r.failed)


def test_regressors_rise_with_the_pair_encoding(model: InterferenceModel, profiles: list[JobProfile]) -> None:
    """``monotone_enc``: every regression booster is non-decreasing in ``enc_pair_mean`` (its leave-own-pair-
    out training values would otherwise teach a backwards slope), whatever the other features are."""
    ids = model._table.ids_of(profiles)
    ia, ib = np.meshgrid(ids, ids, indexing="ij")
    X = model._pair_x(ia.ravel(), ib.ravel())
    col = F.PAIR_FEATURES.index("enc_pair_mean")
    for boosters in model._set_list:
        for booster in boosters:
            out = []
            for v in np.linspace(0.0, 1.0, 11):
                Xv = X.copy()
                Xv[:, col] = v
                out.append(booster.inplace_predict(Xv))
            assert np.all(np.diff(np.array(out), axis=0) >= -1e-6)


def test_cap_classifier_predicts_exactly_one_for_a_pair_never_seen(rows: list[Observation],
                                                                   catalog: ProfileCatalog) -> None:
    """A domain with a mass of values at 1 gets a classifier; where it says P(1) >= 1/2 the answer is the
    median, 1.0, instead of the regression's average of 1s and lower values."""
    r = _kept_full_pair(rows)
    assert r.norm_tput_a == 1.0
    train = [x for x in rows if x.group != r.group]  # the pair is unseen on every GPU type
    on = train_model(train, seed=0, catalog=catalog)
    off = train_model(train, seed=0, catalog=catalog, params=TrainParams(cap_model=False))
    assert sorted(on.to_json_dict()["cap_boosters"]) == ["v100@gavel"]  # K80/P100 have no value at 1
    assert off.to_json_dict()["cap_boosters"] == {}
    got_on, got_off = on.predict_pairs([(r.a, r.b)])[0], off.predict_pairs([(r.a, r.b)])[0]
    assert got_on[0] == 1.0 and got_off[0] < 0.99, (got_on, got_off)
    assert got_on[1] == got_off[1]  # LSTM's value is not capped: the regression's answer stays
    # symmetric like every other part of the model
    np.testing.assert_array_equal(on.predict_pairs([(r.b, r.a)])[0], got_on[::-1])
    # other GPU types have no classifier: identical answers with and without
    k80 = next(x for x in rows if x.a.gpu_type == "k80" and not x.failed)
    np.testing.assert_array_equal(on.predict_pairs([(k80.a, k80.b)]), off.predict_pairs([(k80.a, k80.b)]))


def test_version_2_artifact_without_cap_classifiers_still_loads(rows: list[Observation], catalog: ProfileCatalog,
                                                                 tmp_path: Path) -> None:
    r = _kept_full_pair(rows)
    m = train_model([x for x in rows if x.group != r.group], seed=0, catalog=catalog)
    art = m.to_json_dict()
    assert art["format"] == "elastico-interference-model/3" and art["cap_boosters"]
    art["format"] = "elastico-interference-model/2"
    art.pop("cap_boosters")
    for k in [k for k in art["params"] if k.startswith("cap_")]:
        art["params"].pop(k)
    (tmp_path / "v2.json").write_text(json.dumps(art))
    old = load_model(tmp_path / "v2.json")  # no classifier: the regression's answer, as /2 gave it
    off = train_model([x for x in rows if x.group != r.group], seed=0, catalog=catalog,
                      params=TrainParams(cap_model=False))
    np.testing.assert_array_equal(old.predict_pairs([(r.a, r.b)]), off.predict_pairs([(r.a, r.b)]))
    assert m.predict_pairs([(r.a, r.b)])[0, 0] == 1.0


def test_the_clusters_own_domain_mean_starts_from_the_shipped_ones_and_moves_with_its_rows():
    """The prior of a pair nobody measured in this cluster's environment (no "@env" domain) is the shipped
    environments' mean until the cluster's own rows accumulate: one observation does not set it (it moved an
    unrelated pair from 0.60 to 0.18), 1,000 mostly do. Shipped domains are unaffected."""
    from services.predictor.model.encoders import CLUSTER_DOMAIN_N, JobPrior

    shipped = [(JobProfile("ResNet-50", "v100", 64, env="gavel"), JobProfile("ResNet-18", "v100", 32, env="gavel"))] * 50
    own = (JobProfile("ResNet-50", "v100", 64), JobProfile("ResNet-18", "v100", 32))
    unseen = ["v100", "transformer|32", "recommendation|8192"]
    for n, near_own in ((1, False), (1000, True)):
        prior, _ = JobPrior.fit(shipped + [own] * n, np.array([0.8] * 50 + [0.2] * n), prior_n=2.0)
        [v] = prior.values([unseen[0]], [unseen[1]], [unseen[2]])
        expected = (0.2 * n + CLUSTER_DOMAIN_N * prior.global_mean) / (n + CLUSTER_DOMAIN_N)
        assert v == pytest.approx(expected) and bool(abs(v - 0.2) < 0.1) is near_own, (n, v)
    [g] = prior.values(["v100@gavel"], [unseen[1]], [unseen[2]])
    assert g == pytest.approx(0.8)  # a shipped domain keeps its own mean
