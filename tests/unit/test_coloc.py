"""Co-location ground truth of the simulated GPUs: measured data plus the documented extension rules."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.node_agent.coloc import DEFAULT_ISOLATED_STEPS_PER_S, ColocationTruth, Tenant

ISO = [
    {"worker_type": "v100", "model": "ResNet-18", "batch_size": "32", "scale_factor": "1", "isolated_tput": "30"},
    {"worker_type": "v100", "model": "ResNet-50", "batch_size": "64", "scale_factor": "1", "isolated_tput": "4"},
    {"worker_type": "v100", "model": "ResNet-50", "batch_size": "64", "scale_factor": "2", "isolated_tput": "7"},
    {"worker_type": "v100", "model": "A3C", "batch_size": "", "scale_factor": "1", "isolated_tput": "7"},
    {"worker_type": "v100_unconsolidated", "model": "ResNet-18", "batch_size": "32", "scale_factor": "1", "isolated_tput": "99"},
]
PAIRS = [
    {"gpu_type": "v100", "model_a": "ResNet-18", "batch_size_a": "32", "model_b": "ResNet-50", "batch_size_b": "64",
     "norm_tput_a": "0.5", "norm_tput_b": "0.8", "coloc_failed": "0"},
    {"gpu_type": "v100", "model_a": "ResNet-18", "batch_size_a": "32", "model_b": "ResNet-18", "batch_size_b": "32",
     "norm_tput_a": "0.45", "norm_tput_b": "0.45", "coloc_failed": "0"},
    {"gpu_type": "v100", "model_a": "A3C", "batch_size_a": "", "model_b": "ResNet-50", "batch_size_b": "64",
     "norm_tput_a": "0", "norm_tput_b": "0", "coloc_failed": "1"},
]
T = ColocationTruth(ISO, PAIRS)


def t(job: str, model: str, bs: int, gpus: tuple[int, ...], share: float) -> Tenant:
    return Tenant(job, model, bs, gpus, share)


CASES = [
    ("solo-full", [t("a", "ResNet-18", 32, (0,), 100)], {"a": (30.0, 1.0)}),
    ("solo-share-cap", [t("a", "ResNet-18", 32, (0,), 40)], {"a": (12.0, 0.4)}),
    ("pair-measured-binds", [t("a", "ResNet-18", 32, (0,), 70), t("b", "ResNet-50", 64, (0,), 30)],
     {"a": (15.0, 0.5), "b": (1.2, 0.3)}),
    ("pair-order-independent", [t("b", "ResNet-50", 64, (0,), 90), t("a", "ResNet-18", 32, (0,), 10)],
     {"a": (3.0, 0.1), "b": (3.2, 0.8)}),
    ("unknown-model-fair-share", [t("a", "BERT", 8, (0,), 60), t("b", "ResNet-50", 64, (0,), 40)],
     {"a": (DEFAULT_ISOLATED_STEPS_PER_S * 0.5, 0.5), "b": (1.6, 0.4)}),
    ("failed-pair-is-unmeasured", [t("a", "A3C", 0, (0,), 50), t("b", "ResNet-50", 64, (0,), 50)],
     {"a": (3.5, 0.5), "b": (2.0, 0.5)}),
    ("three-tenants-multiply", [t("a", "ResNet-18", 32, (0,), 50), t("b", "ResNet-50", 64, (0,), 25),
                                t("c", "ResNet-18", 32, (0,), 25)],
     {"a": (30 * 0.5 * 0.45, 0.5 * 0.45), "b": (1.0, 0.25), "c": (30 * 0.45 * 0.5, 0.225)}),
    ("gang-runs-at-slowest-gpu", [t("g", "ResNet-50", 64, (0, 1), 100), t("a", "ResNet-18", 32, (1,), 100)],
     {"g": (7 * 0.8, 0.8), "a": (15.0, 0.5)}),
    ("nearest-batch-size", [t("a", "ResNet-18", 48, (0,), 100)], {"a": (30.0, 1.0)}),
]


@pytest.mark.parametrize(("tenants", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rates(tenants, expected):
    got = T.rates(tenants, "v100")
    assert set(got) == set(expected)
    for job, (rate, norm) in expected.items():
        assert got[job][0] == pytest.approx(rate) and got[job][1] == pytest.approx(norm), job


def test_unconsolidated_rows_and_unknown_gpu_are_ignored():
    assert T.isolated("ResNet-18", 32, "v100") == 30.0
    assert T.isolated("ResNet-18", 32, "a100") is None
    assert T.pair("a100", ("ResNet-18", 32), ("ResNet-50", 64)) is None


def test_shipped_data_loads_and_is_symmetric():
    truth = ColocationTruth.default()
    ab = truth.pair("v100", ("ResNet-18", 32), ("ResNet-50", 64))
    ba = truth.pair("v100", ("ResNet-50", 64), ("ResNet-18", 32))
    assert ab is not None and ab == (ba[1], ba[0])
    assert truth.isolated("ResNet-50", 64, "v100") == pytest.approx(4.394774823323071)


MODELS = st.sampled_from([("ResNet-18", 32), ("ResNet-50", 64), ("A3C", 0), ("BERT", 8)])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(MODELS, st.integers(0, 1), st.floats(1, 100)), min_size=1, max_size=4))
def test_no_tenant_beats_its_share_or_its_solo_speed(specs):
    tenants = [t(f"j{i}", m, bs, (g,), share) for i, ((m, bs), g, share) in enumerate(specs)]
    for job, (rate, norm) in T.rates(tenants, "v100").items():
        tenant = next(x for x in tenants if x.job_id == job)
        assert 0 <= norm <= tenant.compute_share_pct / 100 + 1e-9
        assert rate >= 0
