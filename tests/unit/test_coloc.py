"""Co-location on simulated GPUs: the node agent's adapter to the simulator's one ground truth.

Expected values are derived here independently, from the measured CSV rows and the documented formulas
(measured pair, 0.05 for failed pairs, ``kappa * min(1, 1/(u_a+u_b))`` where unmeasured, additive k-way
composition, saturating share cap ``min(1, share/u)``, a capped co-tenant's extra time scaled by its activity
``min(1, cap / pace)``), and the adapter is checked against the simulator engine's own per-GPU speeds.

"""

from __future__ import annotations

import csv
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastico.coloc.truth import FAILED_PAIR_NORM, UNKNOWN_TYPE_UTIL, default_truth, tenant_speeds
from services.node_agent.coloc import DATA_DIR, DEFAULT_ISOLATED_STEPS_PER_S, ColocationTruth
from services.node_agent.gpu import Tenant
from simulator.engine import Engine

C = ColocationTruth.default()
GT = default_truth("v100")
TYPES = GT.types
R18, R50, TR64, CYC = "ResNet-18 (batch size 32)", "ResNet-50 (batch size 64)", "Transformer (batch size 64)", "CycleGAN"


def u(name: str) -> float:
    return float(TYPES.solo_util[TYPES.index(name)])


def measured(a: str, b: str) -> tuple[float, float] | None:
    """(norm_a, norm_b) of the v100 row for the pair, straight from the CSV; 'failed' if Gavel could not."""
    with open(DATA_DIR / "coloc_gavel_pairs.csv", newline="") as fh:
        for r in csv.DictReader(fh):
            if r["gpu_type"] != "v100":
                continue
            for x, y, nx, ny in ((r["job_type_a"], r["job_type_b"], "norm_tput_a", "norm_tput_b"),
                                 (r["job_type_b"], r["job_type_a"], "norm_tput_b", "norm_tput_a")):
                if (x, y) == (a, b):
                    return "failed" if r["coloc_failed"] == "1" else (min(1.0, float(r[nx])), min(1.0, float(r[ny])))
    return None


def cap(name: str, share: float) -> float:
    return min(1.0, share / 100.0 / u(name))


def t(job: str, model: str, bs: int, gpus: tuple[int, ...], share: float, kind: str = "training") -> Tenant:
    return Tenant(job, model, bs, gpus, share, kind)


def norms(tenants, gpu_type="v100"):
    return {j: n for j, (_, n) in C.rates(tenants, gpu_type).items()}


def test_fitted_utilisations_the_cases_rely_on():
    # the cases below need a saturating type (ResNet-50) and a light one (ResNet-18 batch 32)
    assert u(R50) == pytest.approx(1.0) and u(R18) < 0.6


def test_solo_full_gpu_runs_at_isolated_speed():
    got = C.rates([t("a", "ResNet-18", 32, (0,), 100)], "v100")
    assert got["a"] == pytest.approx((C.isolated("ResNet-18", 32, "v100"), 1.0))


def test_share_cap_saturates_with_solo_utilisation_not_linear():
    # a light job keeps its full speed at 75 % (the old linear cap said 0.75); a saturating one gets 0.75
    got = norms([t("a", "ResNet-18", 32, (0,), 75), t("b", "ResNet-50", 64, (1,), 75)])
    assert got["a"] == pytest.approx(1.0)
    assert got["b"] == pytest.approx(0.75)
    got = norms([t("a", "ResNet-18", 32, (0,), 25)])
    assert got["a"] == pytest.approx(0.25 / u(R18)) and got["a"] < 1.0


def capped(p: np.ndarray, caps: list[float]) -> list[float]:
    """Each tenant's speed from pairwise ``p`` (diagonal ignored) and share caps, written out tenant by tenant:
    tenant j's activity is ``min(1, cap_j / pace_j)`` (``pace_j`` from the pairs alone), and tenant i loses
    ``activity_j * (1/p[i, j] - 1)`` to each co-tenant j."""
    k = len(caps)
    pace = [1.0 / (1.0 + sum(1.0 / p[j][m] - 1.0 for m in range(k) if m != j)) for j in range(k)]
    act = [min(1.0, caps[j] / pace[j]) for j in range(k)]
    return [min(caps[i], 1.0 / (1.0 + sum(act[j] * (1.0 / p[i][j] - 1.0) for j in range(k) if j != i)))
            for i in range(k)]


def test_measured_pair_with_share_caps():
    na, nb = measured(R18, R50)
    got = norms([t("a", "ResNet-18", 32, (0,), 70), t("b", "ResNet-50", 64, (0,), 30)])
    assert cap(R50, 30) < nb  # b's share holds it below its pace next to a: it steals less from a
    act_b = cap(R50, 30) / nb
    assert got["a"] == pytest.approx(min(1.0 / (1.0 + act_b * (1.0 / na - 1.0)), cap(R18, 70)))
    assert got["a"] > na + 0.05
    assert got["b"] == pytest.approx(min(nb, cap(R50, 30)))
    # order of tenants does not matter
    rev = norms([t("b", "ResNet-50", 64, (0,), 30), t("a", "ResNet-18", 32, (0,), 70)])
    assert rev == pytest.approx(got)


def test_failed_pair_is_a_near_stall():
    assert measured("ResNet-50 (batch size 32)", "ResNet-50 (batch size 128)") == "failed"
    got = norms([t("a", "ResNet-50", 32, (0,), 50), t("b", "ResNet-50", 128, (0,), 50)])
    assert got == pytest.approx({"a": FAILED_PAIR_NORM, "b": FAILED_PAIR_NORM})


def test_unmeasured_pair_uses_the_calibrated_utilisation_rule():
    assert measured(CYC, "ResNet-18 (batch size 16)") is None
    rule = GT.kappa * min(1.0, 1.0 / (u(CYC) + u("ResNet-18 (batch size 16)")))
    got = norms([t("a", "CycleGAN", 0, (0,), 100), t("b", "ResNet-18", 16, (0,), 100)])
    assert got == pytest.approx({"a": rule, "b": rule})
    assert 0.05 < GT.kappa < 1.0  # calibrated, not a placeholder


def test_three_tenants_compose_additively():
    names = [R18, R50, TR64]
    shares = [50, 25, 25]
    p = np.ones((3, 3))
    for i in range(3):
        for k in range(3):
            if i != k:
                p[i, k] = measured(names[i], names[k])[0]
    additive = 1.0 / (1.0 + (1.0 / p - 1.0).sum(axis=1))
    got = norms([t("a", "ResNet-18", 32, (0,), 50), t("b", "ResNet-50", 64, (0,), 25),
                 t("c", "Transformer", 64, (0,), 25)])
    want = capped(p, [cap(names[i], shares[i]) for i in range(3)])
    assert [got["a"], got["b"], got["c"]] == pytest.approx(want)
    assert additive[0] < 0.5 and cap(R18, 50) > additive[0]  # a's share (50 %) does not bind
    assert got["a"] > additive[0]  # b's (25 % of a saturating job) does: b steals less from a
    assert got["a"] != pytest.approx(p[0, 1] * p[0, 2], rel=0.05)  # not the old multiplicative rule


def test_gang_runs_at_its_slowest_gpu():
    got = C.rates([t("g", "ResNet-50", 64, (0, 1), 100), t("a", "ResNet-18", 32, (1,), 100)], "v100")
    ng, na = measured(R50, R18)
    assert got["g"][1] == pytest.approx(ng) and got["a"][1] == pytest.approx(na)
    assert got["g"][0] == pytest.approx(C.isolated("ResNet-50", 64, "v100", 2) * ng)


def test_unknown_model_and_batch_size_map_like_the_simulator():
    # unknown batch size: the first type of the family (as simulator.traces maps trace rows)
    first_r18 = next(n for n in TYPES.names if n.startswith("ResNet-18 ("))
    assert C.job_type(t("a", "resnet 18", 48, (0,), 100), "v100") == first_r18
    # unknown model: the type with the median solo utilisation, with its measured pairs
    assert C.job_type(t("a", "BERT", 8, (0,), 100), "v100") == TR64
    got = norms([t("a", "BERT", 8, (0,), 60), t("b", "ResNet-50", 64, (0,), 40)])
    na, nb = measured(TR64, R50)
    p = np.array([[1.0, na], [nb, 1.0]])
    assert [got["a"], got["b"]] == pytest.approx(capped(p, [cap(TR64, 60), cap(R50, 40)]))
    rate = C.rates([t("a", "BERT", 8, (0,), 100)], "v100")["a"]
    assert rate == pytest.approx((DEFAULT_ISOLATED_STEPS_PER_S, 1.0))


def test_gpu_type_without_data_uses_the_rule_with_default_utilisation():
    gt = default_truth("a100")
    got = norms([t("a", "ResNet-50", 64, (0,), 50), t("b", "Foo", 0, (0,), 50)], "a100")
    rule = gt.kappa * min(1.0, 1.0 / (2 * UNKNOWN_TYPE_UTIL))
    want = capped(np.array([[1.0, rule], [rule, 1.0]]), [min(1.0, 0.5 / UNKNOWN_TYPE_UTIL)] * 2)
    assert got == pytest.approx({"a": want[0], "b": want[1]})
    assert norms([t("a", "Foo", 0, (0,), 50)], "a100")["a"] == pytest.approx(0.5 / UNKNOWN_TYPE_UTIL)


def test_inference_is_not_capped_and_counts_its_share_as_utilisation():
    got = norms([t("i", "", 0, (0,), 40, "inference"), t("a", "ResNet-50", 64, (0,), 60)])
    rule_i = GT.kappa * min(1.0, 1.0 / (0.4 + u(R50)))
    assert got["i"] == pytest.approx(rule_i)
    assert got["a"] == pytest.approx(min(rule_i, cap(R50, 60)))


def test_tenant_speeds_is_the_same_lookup():
    assert tenant_speeds("V100", [(R18, 70), (R50, 30)]) == pytest.approx(
        [norms([t("a", "ResNet-18", 32, (0,), 70), t("b", "ResNet-50", 64, (0,), 30)])[j] for j in "ab"])
    assert tenant_speeds("v100", [("BERT (batch size 8)", 100)]) == [1.0]


TYPE_NAMES = [n for n in TYPES.names[:-1]]


def _engine_norms(type_names, shares, limited=None):
    """Speeds of one GPU's tenants as the simulator's engine computes them (its own method, unbound); ``limited``:
    which tenants launched with their share as a limit (default all)."""
    k = len(type_names)
    tix = np.array([TYPES.index(n) for n in type_names] + [0])
    lim = np.ones(len(tix), bool) if limited is None else np.array(list(limited) + [True])
    fake = SimpleNamespace(
        gpu_job=[np.array(list(range(k)) + [-1] * (4 - k))], type_idx=tix, util=TYPES.solo_util[tix].copy(),
        truth=GT, p=SimpleNamespace(mps_limits=True), gpu_share=[np.array(list(shares) + [0.0] * (4 - k))],
        kind=np.zeros(len(tix), np.int8), limited=lim)
    d = Engine._gpu_norms(fake, 0)
    return [d[i] for i in range(k)]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(TYPE_NAMES), st.sampled_from([25.0, 50.0, 75.0, 100.0]), st.booleans()),
                min_size=1, max_size=4))
def test_node_agent_equals_the_simulator_engine(specs):
    """The node agent's tenants carry the MPS limit they launched with (100 % where the share limits nothing:
    plan.make_placement); the engine the share and whether it is a limit. Both give the same speeds."""
    from services.allocator.estimate import split_type_name

    tenants = [t(f"j{i}", *split_type_name(n), (0,), s if lim else 100.0) for i, (n, s, lim) in enumerate(specs)]
    got = norms(tenants)
    want = _engine_norms([n for n, _, _ in specs], [s for _, s, _ in specs], [lim for _, _, lim in specs])
    assert [got[x.job_id] for x in tenants] == pytest.approx(want)


MODELS = st.sampled_from([("ResNet-18", 32), ("ResNet-50", 64), ("A3C", 0), ("BERT", 8)])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(MODELS, st.integers(0, 1), st.floats(1, 100)), min_size=1, max_size=4))
def test_no_tenant_beats_its_share_cap_or_its_solo_speed(specs):
    tenants = [t(f"j{i}", m, bs, (g,), share) for i, ((m, bs), g, share) in enumerate(specs)]
    for job, (rate, norm) in C.rates(tenants, "v100").items():
        tenant = next(x for x in tenants if x.job_id == job)
        name = C.job_type(tenant, "v100")
        assert 0 < norm <= min(1.0, tenant.compute_share_pct / 100 / u(name)) + 1e-9
        assert rate > 0


def test_unconsolidated_rows_and_unknown_gpu_are_ignored():
    iso = [
        {"worker_type": "v100", "model": "ResNet-18", "batch_size": "32", "scale_factor": "1", "isolated_tput": "30"},
        {"worker_type": "v100_unconsolidated", "model": "ResNet-18", "batch_size": "32", "scale_factor": "1",
         "isolated_tput": "99"},
    ]
    c = ColocationTruth(iso)
    assert c.isolated("ResNet-18", 32, "v100") == 30.0
    assert c.isolated("ResNet-18", 48, "v100") == 30.0  # nearest measured batch size
    assert c.isolated("ResNet-18", 32, "v100", 2) == 60.0  # linear where the count is unmeasured
    assert c.isolated("ResNet-18", 32, "a100") is None


def test_shipped_isolated_speed():
    assert C.isolated("ResNet-50", 64, "v100") == pytest.approx(4.394774823323071)


def test_a_service_counts_with_its_measured_load_up_to_its_share():
    train = t("a", "CycleGAN", 0, (0,), 50)
    by_share = norms([train, Tenant("s", "inference", 0, (0,), 50, "inference")])
    by_load = norms([train, Tenant("s", "inference", 0, (0,), 50, "inference", load=0.2)])
    above = norms([train, Tenant("s", "inference", 0, (0,), 50, "inference", load=0.9)])
    assert u(CYC) + 0.5 > 1.0  # heavy enough that the service's utilisation matters
    rule = GT.kappa * min(1.0, 1.0 / (u(CYC) + 0.2))  # the rule with the service's load
    assert by_load["s"] == pytest.approx(capped(np.array([[1.0, rule], [rule, 1.0]]), [cap(CYC, 50), 1.0])[1])
    assert by_load["s"] > by_share["s"] and by_load["a"] >= by_share["a"]  # a lightly loaded service interferes less
    assert above == pytest.approx(by_share)  # a load above its share counts as its share (what it can use)


def test_capped_composition_without_binding_caps_is_the_additive_one():
    from elastico.coloc.rates import compose_additive, compose_capped

    p = np.array([[1.0, 0.6, 0.8], [0.5, 1.0, 0.7], [0.9, 0.4, 1.0]])
    capped_out, uncapped = compose_capped(p, np.ones(3))
    assert (capped_out == compose_additive(p)).all() and (uncapped == capped_out).all()  # bit for bit
    pace = compose_additive(p)
    assert (compose_capped(p, pace + 0.01)[0] == pace).all()  # caps above each pace change nothing


def test_a_tenant_at_a_tiny_share_barely_slows_its_neighbour():
    from elastico.coloc.rates import compose_capped

    p = np.array([[1.0, 0.45], [0.45, 1.0]])  # two saturating jobs at full shares
    out, uncapped = compose_capped(p, np.array([1.0, 0.01]))
    assert out[0] > 0.97 and out[1] == pytest.approx(0.01)  # next to it at a full share: 0.45
    assert uncapped[1] == pytest.approx(0.45)  # its own pace from the pairs: the neighbour is not held back


@given(st.lists(st.floats(0.05, 1.0), min_size=6, max_size=6), st.lists(st.floats(0.01, 1.0), min_size=3, max_size=3),
       st.integers(0, 2), st.floats(0.01, 1.0))
def test_lowering_a_cap_never_slows_the_co_tenants(pairs, caps, k, lower):
    from elastico.coloc.rates import compose_capped

    p = np.ones((3, 3))
    p[~np.eye(3, dtype=bool)] = pairs
    c = np.array(caps)
    before = compose_capped(p, c)[0]
    c2 = c.copy()
    c2[k] = min(c[k], lower)
    after = compose_capped(p, c2)[0]
    others = np.arange(3) != k
    assert (after[others] >= before[others] - 1e-12).all()
    assert after[k] <= before[k] + 1e-12
