"""Interference-aware placement: floors, gangs, ElastiCo and Lucid decisions."""

import numpy as np
import pytest

from services.allocator.policy import make_policy
from services.allocator.policy.placement import pick_gang, predict_join
from services.allocator.policy.view import slot_all, slot_any

from ._policy_builders import rule_matrix, view


@pytest.mark.parametrize("resident,cand,floor,ok", [
    (0, 0, 0.5, True), (0, 2, 0.7, True), (0, 2, 0.8, False),
], ids=["light+light", "light+heavy-floor-0.7", "light+heavy-floor-0.8"])
def test_training_floor_guards_tenants(resident, cand, floor, ok):
    v = view([{"type": resident}, {"type": cand}], gpus=1, placed={0: ([0], 50.0)})
    p = predict_join(rule_matrix(1.0), 1.0, v.gpu_job, v.gpu_share, v.jobs, cand, float(v.jobs.solo_util[1]),
                     50.0, True, floor, 10.0)
    assert bool(p.tenant_ok[0]) is ok


def test_inference_slo_floor_blocks_a_heavy_neighbour():
    # an inference service at 50 % with load 0.35 needs capacity >= 0.45: a heavy neighbour breaks it
    v = view([{"kind": 1, "load": 0.35}, {"type": 2}], gpus=1, placed={0: ([0], 50.0)})
    p = predict_join(rule_matrix(0.9), 0.9, v.gpu_job, v.gpu_share, v.jobs, 2, 1.0, 50.0, True, 0.5, 10.0)
    assert not p.tenant_ok[0]


@pytest.mark.parametrize("scores,feasible,n,expected", [
    ([1, 3, 2, 0], [1, 1, 1, 1], 2, [1, 2]), ([1, 3, 2, 0], [1, 0, 1, 1], 2, [0, 2]),
    ([1, 1, 1, 1], [1, 1, 1, 1], 3, [0, 1, 2]), ([5, 5], [1, 0], 2, None),
], ids=["best-two", "skip-infeasible", "ties-low-index", "too-few"])
def test_pick_gang(scores, feasible, n, expected):
    g = pick_gang(np.array(scores, float), np.array(feasible, bool), n)
    assert (g is None and expected is None) or list(g) == expected


def test_elastico_gang_places_all_gpus_with_one_share():
    v = view([{"type": 0, "n": 3}], gpus=4)
    d = make_policy("elastico", rule_matrix(), 0.9).decide(v)
    assert len(d.place) == 1
    j, gpus, share = d.place[0]
    assert len(set(gpus.tolist())) == 3 and share in (25.0, 50.0, 75.0, 100.0)


def test_elastico_prefers_free_gpu_over_colocation():
    v = view([{"type": 1}, {"type": 1}], gpus=2, placed={0: ([0], 75.0)})
    d = make_policy("elastico", rule_matrix(), 0.9).decide(v)
    assert [int(p[1][0]) for p in d.place] == [1]


def _tenants_after(v, d, M) -> tuple[dict, dict]:
    """(job -> (GPUs, share %), job -> predicted normalised speed) once ``d`` is applied, from ``M`` alone: on each
    GPU ``1 / (1 + sum over co-tenants (1/p - 1))``, capped by the MPS share (``min(1, share / solo util)``); a
    gang runs at its slowest GPU."""
    placed = {int(j): ([int(g) for g in v.jobs.gpus[j]], float(v.jobs.share_pct[j]))
              for j in v.running if j not in d.preempt}
    for j, share in d.resize:
        placed[j] = (placed[j][0], share)
    for j, gpus, share in d.place:
        placed[j] = ([int(g) for g in gpus], float(share))
    speed = {}
    for j, (gpus, share) in placed.items():
        t, u = v.jobs.type_idx[j], v.jobs.solo_util[j]
        per_gpu = []
        for g in gpus:
            extra = sum(1.0 / M[t, v.jobs.type_idx[k]] - 1.0 for k, (gk, _) in placed.items() if k != j and g in gk)
            per_gpu.append(min(1.0 / (1.0 + extra), share / 100.0 / u, 1.0))
        speed[j] = min(per_gpu)
    return placed, speed


@pytest.mark.parametrize("typ,floor,joins", [(0, 0.7, True), (1, 0.7, True), (1, 0.8, False), (0, 0.95, False)],
                         ids=["light", "medium", "medium-strict-floor", "light-strict-floor"])
def test_elastico_colocates_when_full_and_keeps_floor(typ, floor, joins):
    # both GPUs host a job at 50 %; a third of the same type joins one of them instead of waiting exactly when
    # every tenant then keeps the floor (kappa 0.9: a light pair keeps 0.9, a medium one 0.75; a medium job at
    # 25 % would keep only 0.42)
    v = view([{"type": typ}] * 3, gpus=2, placed={0: ([0], 50.0), 1: ([1], 50.0)})
    M = rule_matrix(0.9)
    d = make_policy("elastico", M, 0.9, train_floor=floor).decide(v)
    assert d.preempt == [] and d.resize == []
    assert [j for j, _, _ in d.place] == ([2] if joins else [])
    placed, speed = _tenants_after(v, d, M)
    if joins:
        (gpu,) = placed[2][0]
        assert sorted(j for j, (g, _) in placed.items() if gpu in g) == [gpu, 2]  # next to the job already there
        assert sum(s for g, s in placed.values() if gpu in g) <= 100.0
        assert speed[2] < 1.0 and speed[gpu] < 1.0  # really co-located (the pair slows both)
    assert all(sp >= floor - 1e-9 for sp in speed.values()), speed


def test_elastico_grows_inference_share_by_evicting_training():
    v = view([{"kind": 1, "load": 0.2, "forecast": 0.7}, {"type": 0}], gpus=1,
             placed={0: ([0], 25.0), 1: ([0], 75.0)})
    d = make_policy("elastico", rule_matrix(1.0), 1.0).decide(v)
    assert 1 in d.preempt
    assert dict(d.resize)[0] >= 75.0


def test_lucid_packs_only_when_no_free_gpu():
    v = view([{"type": 0, "remaining": 10}, {"type": 0, "remaining": 5}], gpus=1, placed={0: ([0], 100.0)})
    d = make_policy("lucid", rule_matrix(1.0), 1.0).decide(v)
    assert d.place and d.place[0][2] == 50.0 and (0, 50.0) in d.resize


def test_a_service_that_other_services_leave_no_room_to_grow_moves_to_a_gpu_where_it_fits():
    # two services placed at their declared demand share GPU 0; their forecasts rose past what both fit
    v = view([{"kind": 1, "load": 0.1, "forecast": 0.5}, {"kind": 1, "load": 0.1, "forecast": 0.5}], gpus=2,
             placed={0: ([0], 45.0), 1: ([0], 50.0)})
    d = make_policy("elastico", rule_matrix(1.0), 1.0).decide(v)
    from services.allocator.policy.contract import check

    ok, rejected = check(d, v)
    assert not rejected
    # one service moves (preempted and placed again: make-before-break live) to the free GPU, the other grows
    # in place; neither is left below the share its forecast needs
    moved = [j for j in ok.preempt if any(p[0] == j for p in ok.place)]
    assert len(moved) == 1
    (j, gpus, share), = [p for p in ok.place if p[0] == moved[0]]
    assert list(gpus) == [1] and share >= 60.0
    other = 1 - moved[0]
    assert dict(ok.resize).get(other, float(v.gpu_share[0][v.gpu_job[0] == other][0])) >= 60.0


@pytest.mark.parametrize("slots", range(10))
def test_slot_all_and_any_are_numpy_s_all_and_any_whatever_the_layout(slots):
    rng = np.random.default_rng(slots)
    for _ in range(50):
        m = rng.random((37, slots)) < rng.random()
        for a in (m, np.asfortranarray(m), m[:, ::-1]):  # contiguous rows read as words; the others slot by slot
            assert (slot_all(a) == m.all(axis=1)).all() and (slot_any(a) == m.any(axis=1)).all()
