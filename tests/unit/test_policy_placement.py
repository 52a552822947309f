"""Interference-aware placement: floors, gangs, ElastiCo and Lucid decisions."""

import numpy as np
import pytest

from services.allocator.policy import make_policy
from services.allocator.policy.placement import pick_gang, predict_join

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


def test_elastico_colocates_when_full_and_keeps_floor():
    # both GPUs host a light job at 50 %; a new light job joins one of them instead of waiting
    v = view([{"type": 0}, {"type": 0}, {"type": 0}], gpus=2, placed={0: ([0], 50.0), 1: ([1], 50.0)})
    d = make_policy("elastico", rule_matrix(1.0), 1.0).decide(v)
    assert len(d.place) == 1 and d.place[0][2] <= 50.0


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
