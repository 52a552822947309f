"""Feature schema of the interference predictor: profiles, vectors, catalogue, data files."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.predictor import datasets as D
from services.predictor import features as F
from services.predictor.datasets import ProfileCatalog
from services.predictor.features import JobProfile, Observation

NAN = float("nan")


@pytest.mark.parametrize(("raw", "canon"), [
    ("ResNet-18", "resnet18"), ("ResNet18", "resnet18"), ("LM", "lstm"), ("LSTM", "lstm"),
    ("Transformer", "transformer"), ("Recommendation", "recommendation"), ("MobileNetV3", "mobilenetv3"),
], ids=lambda v: str(v))
def test_canonical_family(raw: str, canon: str) -> None:
    assert F.canonical_family(raw) == canon


@pytest.mark.parametrize(("raw", "canon"), [
    ("v100", "v100"), ("Tesla V100-SXM2-16GB", "v100"), ("NVIDIA A100-PCIE-40GB", "a100"),
    ("NVIDIA GeForce RTX 3090", "rtx3090"), ("K80", "k80"), ("H100", "h100"),
], ids=lambda v: str(v))
def test_canonical_gpu(raw: str, canon: str) -> None:
    assert F.canonical_gpu(raw) == canon


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"mps_share_pct": 0.0}, "mps_share_pct"),
    ({"mps_share_pct": 100.5}, "mps_share_pct"),
    ({"mps_share_pct": NAN}, "mps_share_pct"),
    ({"batch_size": 0}, "batch_size"),
    ({"batch_size": -4}, "batch_size"),
    ({"batch_size": 2.5}, "batch_size"),
    ({"gpu_util_pct": 120.0}, "gpu_util_pct"),
    ({"mem_used_mib": -1.0}, "mem_used_mib"),
    ({"mem_used_mib": math.inf}, "mem_used_mib"),
    ({"precision": "int3"}, "precision"),
    ({"model_family": " "}, "model_family"),
], ids=lambda v: str(v))
def test_profile_rejects_malformed_fields(kwargs: dict, field: str) -> None:
    base = {"model_family": "ResNet-50", "gpu_type": "v100", "batch_size": 64}
    with pytest.raises(ValueError, match=field):
        JobProfile(**{**base, **kwargs})


def test_profile_canonicalises_and_nan_profiles_compare_equal() -> None:
    a = JobProfile("ResNet-50", "Tesla V100", 64, "FP32", gpu_util_pct=float("nan"))
    b = JobProfile("resnet50", "v100", 64, "fp32")
    assert (a.model_family, a.gpu_type, a.precision) == ("resnet50", "v100", "fp32")
    assert a == b and hash(a) == hash(b)  # distinct NaN objects are normalised to one
    assert {a: 1}[b] == 1
    assert a.job_key == ("resnet50", 64, "fp32", True)
    assert a.arch_class == "cnn" and JobProfile("mystery", "v100").arch_class == ""


def test_solo_vector_marks_unknown_as_nan() -> None:
    v = F.solo_vector(JobProfile("mystery-net", "v100"))
    assert v.shape == (len(F.SOLO_FEATURES),)
    col = dict(zip(F.SOLO_FEATURES, v))
    assert math.isnan(col["family_code"]) and math.isnan(col["gpu_util_pct"]) and math.isnan(col["log2_batch_size"])
    assert col["mps_share_pct"] == 100.0 and col["training"] == 1.0
    w = dict(zip(F.SOLO_FEATURES, F.solo_vector(JobProfile("ResNet-50", "v100", 64, "amp", gpu_util_pct=80,
                                                               mem_used_mib=8192))))
    assert w["log2_batch_size"] == 6.0 and w["mixed_precision"] == 1.0
    assert w["mem_used_frac"] == pytest.approx(8192 / (16 * 1024))


_profiles = st.builds(
    JobProfile,
    model_family=st.sampled_from(["ResNet-50", "LM", "mystery", "VGG"]),
    gpu_type=st.just("v100"),
    batch_size=st.one_of(st.none(), st.integers(1, 4096)),
    precision=st.sampled_from(["", "fp32", "amp"]),
    training=st.booleans(),
    mps_share_pct=st.floats(1.0, 100.0),
    gpu_util_pct=st.one_of(st.just(NAN), st.floats(0.0, 100.0)),
    mem_bw_util_pct=st.one_of(st.just(NAN), st.floats(0.0, 100.0)),
    mem_used_mib=st.one_of(st.just(NAN), st.floats(0.0, 40_000.0)),
)


@settings(max_examples=60, deadline=None)
@given(a=_profiles, b=_profiles)
def test_pair_rows_swap_a_and_b_columns_and_keep_combos(a: JobProfile, b: JobProfile) -> None:
    ab, ba = F.pair_matrix([(a, b), (b, a)])
    ng, ns = len(F.GPU_FEATURES), len(F.SOLO_FEATURES)
    np.testing.assert_array_equal(ab[:ng], ba[:ng])
    np.testing.assert_array_equal(ab[ng:ng + ns], ba[ng + ns:ng + 2 * ns])
    np.testing.assert_array_equal(ab[ng + 2 * ns:], ba[ng + 2 * ns:])  # symmetric combos, encodings NaN
    assert ab.shape == (len(F.PAIR_FEATURES),)


def test_pair_matrix_rejects_mixed_gpu_types() -> None:
    with pytest.raises(ValueError, match="gpu_type"):
        F.pair_matrix([(JobProfile("VGG", "v100"), JobProfile("VGG", "k80"))])


def test_util_heuristic() -> None:
    out = F.util_heuristic(np.array([30.0, 100.0, NAN]), np.array([40.0, 100.0, 50.0]))
    assert out[0] == 1.0 and out[1] == 0.5 and math.isnan(out[2])


def test_gavel_catalogue_profiles() -> None:
    cat = ProfileCatalog.from_gavel(D.PROJECT_DATA_DIR)
    assert len(cat) == 26 * 3
    p = cat.gavel("ResNet-50 (batch size 64)", "v100")
    assert p.model_family == "resnet50" and p.batch_size == 64 and p.precision == "fp32"
    assert p.isolated_tput_steps_s > 0 and p.gpu_speedup_ratio > 1 and 0 < p.rel_speed_this_gpu <= 1
    assert math.isnan(p.gpu_util_pct)  # Gavel has no counters
    a3c = cat.gavel("A3C", "k80")
    assert a3c.batch_size is None and a3c.model_family == "a3c"
    unknown = cat.gavel("NewNet (batch size 8)", "v100")
    assert unknown.model_family == "newnet" and math.isnan(unknown.isolated_tput_steps_s)


def test_catalogue_completion_fills_unknown_and_keeps_known() -> None:
    cat = ProfileCatalog.from_gavel(D.PROJECT_DATA_DIR)
    live = JobProfile("ResNet-50", "v100", 64, "", gpu_util_pct=91.0, mps_share_pct=50.0)
    done = cat.complete(live)
    assert done.gpu_util_pct == 91.0 and done.mps_share_pct == 50.0
    assert done.isolated_tput_steps_s == cat.gavel("ResNet-50 (batch size 64)", "v100").isolated_tput_steps_s
    assert done.precision == "fp32"  # unknown precision matched the fp32 entry
    stranger = JobProfile("mystery", "v100", 8)
    assert cat.complete(stranger) is stranger


def test_default_catalogue_and_training_rows_work_without_shared_data(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ELASTICO_SHARED_DATA", str(tmp_path / "absent"))
    cat = ProfileCatalog.default()
    assert len(cat) == 26 * 3 + 6  # Gavel's types on three GPUs, the H200 campaign's 3 training jobs and 3 services
    rows = D.shipped_observations(cat)
    assert {r.source for r in rows} == {"gavel", "gavel-oracle", D.CAMPAIGN_ENV}
    campaign = [r for r in rows if r.source == D.CAMPAIGN_ENV]  # data/h200: 8 training pairs, 12 with a service
    assert len(rows) == 2 * 843 + len(campaign) and len(campaign) == 20
    assert {r.a.env for r in rows if r.source == "gavel"} == {"gavel"}
    assert sum(r.failed for r in rows if r.source == "gavel") == 58
    assert sum(r.failed for r in rows if r.source == "gavel-oracle") == 69


GAVEL_HEADER = ("gpu_type,job_type_a,job_type_b,model_a,batch_size_a,model_b,batch_size_b,same_type,isolated_tput_a,"
                "isolated_tput_b,coloc_tput_a,coloc_tput_b,norm_tput_a,norm_tput_b,norm_tput_sum,coloc_failed,"
                "a_equals_isolated,b_equals_isolated")
LUCID_HEADER = ("src_row,model1,dataset1,gpu_num1,batchsize1,amp1,speed1,model2,dataset2,gpu_num2,batchsize2,amp2,"
                "speed2,gpu_util,gmem_util,gmem")


def _write(path: Path, header: str, lines: list[str]) -> Path:
    path.write_text("\n".join([header, *lines]) + "\n")
    return path


def test_read_pair_files_in_both_schemas(tmp_path: Path) -> None:
    g = _write(tmp_path / "g.csv", GAVEL_HEADER, [
        "v100,ResNet-50 (batch size 64),LM (batch size 20),ResNet-50,64,LM,20,0,1,1,0.5,0.6,0.5,0.6,1.1,0,0,0",
        "k80,A3C,CycleGAN,A3C,,CycleGAN,,0,1,1,0,0,0,0,0,1,0,0",
    ])
    lu = _write(tmp_path / "l.csv", LUCID_HEADER, ["1,VGG,CIFAR-10,1,64,0,0.9,PPO,LunarLander,1,32,1,0.95,50,20,4000"])
    cat = ProfileCatalog.from_gavel(D.PROJECT_DATA_DIR)
    assert D.detect_pair_schema(g) == "gavel" and D.detect_pair_schema(lu) == "lucid"
    rows = D.read_pair_file(g, cat)
    assert not rows[0].failed and rows[0].norm_tput_b == 0.6 and rows[0].b.model_family == "lstm"
    assert rows[1].failed and math.isnan(rows[1].norm_tput_a)
    (lr,) = D.read_pair_file(lu, cat)
    assert lr.a.gpu_type == "rtx3090" and lr.b.precision == "amp" and lr.norm_tput_a == 0.9
    bad = _write(tmp_path / "bad.csv", "a,b,c", ["1,2,3"])
    with pytest.raises(ValueError, match="neither"):
        D.detect_pair_schema(bad)


def test_observation_validation_and_group_symmetry() -> None:
    a, b = JobProfile("VGG", "v100", 64), JobProfile("LM", "v100", 20)
    assert Observation(a, b, 0.5, 0.6).group == Observation(b, a, 0.6, 0.5).group
    with pytest.raises(ValueError, match="norm_tput_a"):
        Observation(a, b, 2.0, 0.5)
    with pytest.raises(ValueError, match="gpu_type"):
        Observation(a, JobProfile("LM", "k80", 20), 0.5, 0.5)
    assert Observation(a, b, NAN, NAN, failed=True).failed


def test_gavel_campaign_is_recognised_from_isolated_throughputs() -> None:
    cat = ProfileCatalog.from_gavel(D.PROJECT_DATA_DIR)
    measured = D.read_pair_file(D.PROJECT_DATA_DIR / "coloc_gavel_pairs.csv", cat)
    oracle = D.read_pair_file(D.PROJECT_DATA_DIR / "coloc_gavel_oracle_pairs.csv", cat)
    assert {(r.a.env, r.b.env, r.source) for r in measured} == {("gavel", "gavel", "gavel")}
    assert {(r.a.env, r.b.env, r.source) for r in oracle} == {("gavel-oracle", "gavel-oracle", "gavel-oracle")}
    assert measured[0].a.domain == "k80@gavel" and JobProfile("VGG", "v100").domain == "v100"
    # the same job-type pair is one group in both campaigns (held out together)
    assert {r.group for r in measured} == {r.group for r in oracle}
