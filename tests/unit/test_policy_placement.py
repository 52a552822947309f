"""Interference-aware placement: floors, gangs, ElastiCo and Lucid decisions."""

from dataclasses import replace

import numpy as np
import pytest

from elastico.coloc.rates import compose_capped, share_speed
from services.allocator.policy import make_policy
from services.allocator.policy.placement import TenantState, pair_estimate, pick_gang, predict_join
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


def test_a_share_limits_training_only_next_to_a_service():
    """limited_slots: the policy's own share caps a training candidate's speed on a GPU hosting a service and on no
    other -- alone, or next to training only, it runs its full pair."""
    v = view([{"kind": 1, "load": 0.05}, {"type": 2}, {"type": 2}], gpus=3, placed={0: ([0], 50.0), 1: ([1], 50.0)})
    u = float(v.jobs.solo_util[2])
    p = predict_join(rule_matrix(0.9), 0.9, v.gpu_job, v.gpu_share, v.jobs, 2, u, 25.0, True, 0.1, 10.0)
    assert p.new_norm[0] <= float(share_speed(25.0, u)) + 1e-12 < 1.0  # next to the service: its share's cap
    assert p.new_norm[2] == 1.0  # alone on an empty GPU
    assert p.new_norm[1] > float(share_speed(25.0, u))  # next to training only: the pair, no cap
    assert p.before[1, 0] == 1.0  # the resident alone runs unlimited at its 50 %


def test_inference_slo_floor_blocks_a_heavy_neighbour():
    # an inference service at 50 % with load 0.35 needs capacity >= 0.45: a heavy neighbour breaks it
    v = view([{"kind": 1, "load": 0.35}, {"type": 2}], gpus=1, placed={0: ([0], 50.0)})
    p = predict_join(rule_matrix(0.9), 0.9, v.gpu_job, v.gpu_share, v.jobs, 2, 1.0, 50.0, True, 0.5, 10.0)
    assert not p.tenant_ok[0]


def declared(v, util: dict[int, float]):
    """``v`` as the live allocator builds it for jobs whose declared shapes cap them: ``solo_util`` lowered to the
    largest declared share, the type's utilisation kept in ``type_util``."""
    solo = v.jobs.solo_util.copy()
    for j, u in util.items():
        solo[j] = u
    return replace(v, jobs=replace(v.jobs, solo_util=solo, type_util=v.jobs.solo_util.copy()))


@pytest.mark.parametrize("tenants,cand,cand_share", [
    ([(2, 30.0)], 2, 100.0), ([(2, 100.0)], 2, 30.0), ([(1, 40.0), (2, 10.0)], 0, 50.0),
    ([(0, 20.0), (1, 30.0), (2, 25.0)], 2, 25.0),
], ids=["capped-tenant", "capped-candidate", "three", "four"])
def test_join_predicts_the_rule_for_declared_caps_and_the_full_pair_for_its_own_shares(tenants, cand, cand_share):
    """A job its declared shapes cap (the live view: solo_util lowered, type_util kept) is predicted as the shared
    rule has it on the joined GPU (``compose_capped``; speeds read against its declared best). A share the policy
    chose itself limits nothing on a GPU without a service (``limited_slots``): every tenant runs its full pair."""
    M, kappa = rule_matrix(0.9), 0.9
    placed = {i: ([0], s) for i, (_, s) in enumerate(tenants)}
    v = view([{"type": t} for t, _ in tenants] + [{"type": cand}], gpus=1, placed=placed)
    ty, u = np.array([t for t, _ in tenants] + [cand]), v.jobs.solo_util.copy()
    shares = np.array([s for _, s in tenants] + [cand_share])
    pm = pair_estimate(M, kappa, ty[:, None], u[:, None], ty[None, :], u[None, :])
    np.fill_diagonal(pm, 1.0)
    truth, _ = compose_capped(pm, share_speed(shares, u))
    k = len(tenants)
    p = predict_join(M, kappa, v.gpu_job, v.gpu_share, v.jobs, cand, float(u[-1]), cand_share, True, 0.5, 10.0)
    full = compose_capped(pm, np.ones(k + 1))[0]
    assert p.new_norm[0] == pytest.approx(full[-1]) and p.after[0, :k] == pytest.approx(full[:k])
    # every job declaring exactly its share: its speed against that share, its activity against its type
    best = shares / 100.0
    d = declared(v, {i: min(u[i], best[i]) for i in range(k + 1)})
    st = TenantState(M, kappa, d.gpu_job, d.gpu_share, d.jobs, True)
    p = st.join(cand, float(d.jobs.solo_util[-1]), cand_share, 0.5, 10.0, d.jobs.activity_util(k))
    norm = np.minimum(1.0, truth / share_speed(shares, u))  # against each one's declared best shape
    assert p.new_norm[0] == pytest.approx(norm[-1], rel=1e-12)
    assert p.after[0, :k] == pytest.approx(norm[:k], rel=1e-12)


def test_tenants_at_a_tiny_declared_share_leave_their_gpus_to_others():
    """Jobs of one tenant declaring 1 % of a GPU hold their GPUs' slots, not their compute: another job is placed
    beside them at once instead of waiting (two heavy jobs at full shares run at 0.45 each)."""
    M = rule_matrix(0.9)
    jobs = [{"type": 2}, {"type": 2}, {"type": 2}]
    tiny = declared(view(jobs, gpus=2, placed={0: ([0], 1.0), 1: ([1], 1.0)}), {0: 0.01, 1: 0.01})
    d = make_policy("elastico", M, 0.9).decide(tiny)
    assert [int(j) for j, _, _ in d.place] == [2]
    half = declared(view(jobs, gpus=2, placed={0: ([0], 50.0), 1: ([1], 50.0)}), {0: 0.5, 1: 0.5})
    assert make_policy("elastico", M, 0.9).decide(half).place == []  # at half a GPU each: no room


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


@pytest.mark.parametrize("unlimited", [True, False])
def test_a_share_the_policy_chose_never_counts_on_stealing_less(unlimited):
    """Whether or not its share is a limit, a candidate at a share the policy chose (no declared shapes) is
    assumed to take its full pair from its co-tenants: their predicted speeds do not depend on its share."""
    v = view([{"type": 2}, {"type": 2}], gpus=1, placed={0: ([0], 50.0)})
    st = TenantState(rule_matrix(0.9), 0.9, v.gpu_job, v.gpu_share, v.jobs, True, unlimited)
    u = float(v.jobs.solo_util[1])
    small, full = st.join(2, u, 25.0, 0.1, 10.0), st.join(2, u, 100.0, 0.1, 10.0)
    assert np.array_equal(small.after, full.after) and np.array_equal(small.tenant_ok, full.tenant_ok)


def test_the_allocators_predicted_speed_follows_where_a_share_is_a_limit():
    """decider.predicted_norm (the metric node agents' readings are compared with) reads a training job's speed
    against its shape: unlimited beside training only (its pace, the pair), against its share's cap beside a
    service or with every share a limit."""
    from services.allocator.decider import predicted_norm

    M = rule_matrix(0.9)
    v = view([{"type": 2}, {"type": 2}, {"type": 2}, {"kind": 1, "load": 0.05}], gpus=2,
             placed={0: ([0], 50.0), 1: ([0], 50.0), 2: ([1], 50.0), 3: ([1], 50.0)})
    u = float(v.jobs.solo_util[0])
    pair = float(pair_estimate(M, 0.9, np.array([2]), np.array([u]), np.array([2]), np.array([u]))[0])
    cap = float(share_speed(50.0, u))
    assert cap < 1.0 and predicted_norm(M, 0.9, v, 0, True, True) == pytest.approx(min(1.0, pair))
    assert predicted_norm(M, 0.9, v, 0, True, False) == pytest.approx(min(1.0, min(pair, 1.0) / cap))
    beside = predicted_norm(M, 0.9, v, 2, True, True)
    assert beside == predicted_norm(M, 0.9, v, 2, True, False)  # next to a service: a limit either way
