"""ElastiCo's elastic behaviour: information parity, no starvation, preemption/shrink hysteresis, expand."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from services.allocator.policy import ClusterView, make_policy
from services.allocator.policy.view import Topology
from tests.unit._policy_builders import rule_matrix, view

HEAVY = 2  # solo utilisation 1.0 in the builder's type table
H = 3600.0


def elastico(**kw):
    return make_policy("elastico", rule_matrix(1.0), 1.0, **kw)


def placed_ids(d):
    return [j for j, _, _ in d.place]


@pytest.mark.parametrize("remaining, expected", [
    ((100 * H, 1 * H), [1]),  # same estimates Lucid/backfill get: shortest remaining work first
    ((np.nan, np.nan), [0]),  # no estimates: non-clairvoyant (equal attained service, older job first)
], ids=["with-estimates", "without-estimates"])
def test_information_parity_uses_the_supplied_estimates(remaining, expected):
    jobs = [{"type": HEAVY, "arrival": 0, "remaining": remaining[0]},
            {"type": HEAVY, "arrival": 10, "remaining": remaining[1]}]
    d = elastico().decide(view(jobs, gpus=1, now=100.0))
    assert placed_ids(d) == expected


def test_estimates_can_be_switched_off():
    jobs = [{"type": HEAVY, "arrival": 0, "remaining": 100 * H}, {"type": HEAVY, "arrival": 10, "remaining": H}]
    d = elastico(use_estimates=False).decide(view(jobs, gpus=1, now=100.0))
    assert placed_ids(d) == [0]


@pytest.mark.parametrize("work_weight, expected", [(0.0, [0]), (0.5, [0]), (1.0, [1])])
def test_the_objective_knob_moves_the_gpus_from_short_work_to_more_work(work_weight, expected):
    """Two heavy jobs (no co-location) for two GPUs: one GPU for an hour, or two for ten hours. Weighed for JCT
    the short job runs (and the gang cannot start beside it); at work_weight 1 the gang, which does twice the
    work per hour, runs; halfway the size term still decides."""
    jobs = [{"type": HEAVY, "n": 1, "remaining": H}, {"type": HEAVY, "n": 2, "remaining": 10 * H}]
    d = elastico(work_weight=work_weight).decide(view(jobs, gpus=2, now=100.0))
    assert placed_ids(d) == expected


def test_no_starvation_waiting_age_eventually_beats_short_jobs():
    """A long job that has waited long enough outweighs any freshly arrived short job.

    Bound (defaults): a job of S GPU-hours outranks every fresh job once it has waited about S days."""
    pol = elastico()
    long_job = {"type": HEAVY, "arrival": 0, "remaining": 10 * H}
    fresh_short = {"type": HEAVY, "arrival": None, "remaining": 0.5 * H}
    for now, expected in ((10 * H, [1]), (10.5 * 24 * H, [0])):
        fresh_short["arrival"] = now - 60.0
        d = pol.decide(view([long_job, dict(fresh_short)], gpus=1, now=now))
        assert placed_ids(d) == expected, now


def _contended(now):
    # job 0: long, running on the only GPU since t=0; job 1: short, waiting
    jobs = [{"type": HEAVY, "arrival": 0, "remaining": 100 * H}, {"type": HEAVY, "arrival": now - 60, "remaining": H}]
    return view(jobs, gpus=1, placed={0: ([0], 100.0)}, now=now)


def test_preempts_a_much_lighter_running_job_after_min_run():
    d = elastico(min_run_s=1800.0).decide(_contended(now=4000.0))
    assert d.preempt == [0]
    assert placed_ids(d) == [1]


def test_hysteresis_min_run_protects_a_recently_started_job():
    d = elastico(min_run_s=1800.0).decide(_contended(now=1000.0))
    assert d.preempt == [] and d.place == []


def test_hysteresis_ratio_protects_a_comparable_job():
    # remaining 1.5 h vs 1 h: the waiting job is not preempt_ratio times heavier
    jobs = [{"type": HEAVY, "arrival": 0, "remaining": 1.5 * H}, {"type": HEAVY, "arrival": 3940, "remaining": H}]
    d = elastico().decide(view(jobs, gpus=1, placed={0: ([0], 100.0)}, now=4000.0))
    assert d.preempt == []


def test_preemption_pass_is_rate_limited():
    pol = elastico(preempt_interval_s=300.0)
    pol.decide(_contended(now=1000.0))  # checked (min run not reached)
    d = pol.decide(_contended(now=4000.0))
    assert d.preempt == [0]
    pol2 = elastico(preempt_interval_s=300.0)
    pol2.decide(_contended(now=3900.0))  # checked at 3900 (min run reached: preempts)
    assert pol2.decide(_contended(now=4000.0)).preempt == []  # within the interval: not re-run


@pytest.mark.parametrize("remaining, service, grows", [(100 * H, True, True), (60.0, True, False), (100 * H, False, False)],
                         ids=["long-expands", "short-stays", "no-service-no-cap"])
def test_expand_share_capped_job_when_room_and_worth_the_restart(remaining, service, grows):
    """A training job its share caps next to a service grows the share in place when the time saved pays for the
    restart; without a service on its GPU its share caps nothing (limited_slots), so it never resizes for speed."""
    jobs = [{"type": HEAVY, "arrival": 0, "remaining": remaining}] + ([{"kind": 1, "load": 0.01}] if service else [])
    placed = {0: ([0], 50.0), **({1: ([0], 25.0)} if service else {})}
    d = elastico(min_run_s=1800.0, slack=False).decide(view(jobs, gpus=1, placed=placed, now=4000.0))
    assert ((0, 75.0) in d.resize) is grows, d


@pytest.mark.parametrize("remaining, partner, unlocked", [(100 * H, False, True), (60.0, False, False),
                                                         (100 * H, True, False)],
                         ids=["long-alone-relaunches", "short-stays", "beside-training-stays"])
def test_a_job_left_limited_by_a_service_that_left_is_relaunched_without_a_limit(remaining, partner, unlocked):
    """A 25 % share the job launched with as a limit next to a service since gone (the view's limit flag). Alone
    and with work left to pay for the restart, it is relaunched on the smallest unlimited slice (no limit there);
    beside another training job (whose pair speed the policy would have to predict) it stays."""
    jobs = [{"type": HEAVY, "arrival": 0, "remaining": remaining}] + ([{"type": HEAVY, "arrival": 0}] if partner else [])
    placed = {0: ([0], 25.0), **({1: ([0], 50.0)} if partner else {})}
    v = view(jobs, gpus=1, placed=placed, now=4000.0)
    d = elastico(min_run_s=1800.0).decide(replace(v, jobs=replace(v.jobs, limited=np.array([True, False][:len(jobs)]))))
    assert [r for r in d.resize if r[0] == 0] == ([(0, 50.0)] if unlocked else []), d


@pytest.mark.parametrize("share, flag, relaunched", [(50.0, True, True), (50.0, False, False), (25.0, False, False),
                                                     (25.0, None, False)],
                         ids=["flagged-relaunches", "not-flagged-stays", "unlimited-at-25-stays", "no-flag-stays"])
def test_the_views_limit_flag_tells_a_departed_services_limit(share, flag, relaunched):
    """Alone on a GPU without a service a job may run unlimited (at the slice it booked, or at 25 % left by a pair
    partner that finished) or under the limit it launched with next to a service since gone: the share cannot
    tell, the view's limit flag (JobTable.limited) does. Flagged, it is relaunched at the smallest unlimited slice
    at least its share, without the limit; not flagged, or with no flag, it stays (a relaunch would gain nothing)."""
    jobs = [{"type": HEAVY, "arrival": 0, "remaining": 100 * H}]
    v = view(jobs, gpus=1, placed={0: ([0], share)}, now=4000.0)
    if flag is not None:
        v = replace(v, jobs=replace(v.jobs, limited=np.array([flag])))
    d = elastico(min_run_s=1800.0).decide(v)
    assert [r for r in d.resize if r[0] == 0] == ([(0, 50.0)] if relaunched else []), d


def test_expand_waits_for_min_run():
    jobs = [{"type": HEAVY, "arrival": 0, "remaining": 100 * H}]
    d = elastico(min_run_s=1800.0).decide(view(jobs, gpus=1, placed={0: ([0], 50.0)}, now=600.0))
    assert d.resize == []


# ---- observed interference corrects the estimate -----------------------------------------------------
LIGHT, MEDIUM = 0, 1


def test_learn_lowers_only_overrated_pairs_measured_cleanly():
    est = rule_matrix(1.0)
    before = est.copy()
    pol = elastico()
    jobs = [{"type": LIGHT, "observed": 0.3}, {"type": MEDIUM, "observed": 1.0},  # GPU 0: a clean pair
            {"type": LIGHT, "observed": 0.2}, {"kind": 1, "load": 0.2},  # GPU 1: next to inference
            {"type": MEDIUM, "observed": 0.1}, {"type": MEDIUM, "observed": 0.1}, {"type": HEAVY, "observed": 0.1},  # 3 tenants
            {"type": HEAVY, "n": 2, "observed": 0.1}, {"type": MEDIUM, "observed": 0.2}]  # a 2-GPU gang + a 1-GPU job
    v = view(jobs, gpus=6, placed={0: ([0], 50), 1: ([0], 50), 2: ([1], 50), 3: ([1], 50), 4: ([2], 25),
                                   5: ([2], 25), 6: ([2], 50), 7: ([3, 4], 50), 8: ([3], 50)})
    pol.M = est
    # light next to medium: 0.3, below the estimate (medium next to light: not below); the 1-GPU medium job
    # next to the gang's GPU is a clean reading of (medium next to heavy); the gang's own is not
    assert pol.learn(v) == 2
    assert pol.M[LIGHT, MEDIUM] == 0.3 and pol.M[MEDIUM, LIGHT] == est[MEDIUM, LIGHT] and pol.M[MEDIUM, HEAVY] == 0.2
    changed = np.argwhere(~np.isclose(pol.M, before, equal_nan=True))
    assert changed.tolist() == [[LIGHT, MEDIUM], [MEDIUM, HEAVY]]  # inference and 3-tenant readings are not used
    assert np.array_equal(est, before, equal_nan=True)  # the caller's matrix (shared with other policies) is intact
    assert pol.learn(v) == 0  # the same reading again changes nothing


@pytest.mark.parametrize("learn", [True, False])
def test_a_pair_seen_slower_than_predicted_is_not_co_located_again(learn):
    """The estimate says two light jobs share a GPU for free; they are observed at 0.3 each on GPU 0. A third
    light job may then join the lone light job on GPU 1 only if the policy ignores what it saw."""
    jobs = [{"type": LIGHT, "observed": 0.3}, {"type": LIGHT, "observed": 0.3}, {"type": LIGHT},
            {"type": LIGHT, "arrival": 50, "remaining": H}]
    pol = make_policy("elastico", np.ones_like(rule_matrix(1.0)), 1.0, learn_observed=learn, elastic_gpus=False)
    d = pol.decide(view(jobs, gpus=2, placed={0: ([0], 50), 1: ([0], 50), 2: ([1], 50)}, now=100.0))
    assert (placed_ids(d) == [3]) is not learn


# ---- declared shapes (JobSpec.shapes): the job's own family replaces the policy's menu ---------------------
def _declared(v, shapes):
    from tests.unit.test_policy_shapes import with_declared

    return with_declared(v, shapes)


def test_declared_10pct_jobs_pack_by_their_share_not_the_menus():
    """Eight jobs declaring 10 % on one GPU with eight tenant slots: all eight are placed at 10 % (the menu's
    smallest share, 25 %, fits only four) -- no interference in this estimate, so only share and slots bind."""
    from elastico.domain import Shape

    jobs = [{"type": LIGHT, "arrival": i} for i in range(10)]
    v = _declared(view(jobs, gpus=1, K=8), {j: (Shape(1, 10.0, 1024),) for j in range(10)})
    d = make_policy("elastico", np.ones_like(rule_matrix(1.0)), 1.0).decide(v)
    assert len(d.place) == 8 and {s for _, _, s in d.place} == {10.0}
    plain = make_policy("elastico", np.ones_like(rule_matrix(1.0)), 1.0).decide(view(jobs, gpus=1, K=8))
    # the menu, for contrast: on a GPU without a service a job's share is a slice of at least half the GPU
    assert len(plain.place) == 2 and {s for _, _, s in plain.place} == {50.0}


def test_declared_shapes_are_priced_and_placed_never_the_menu():
    """Two shapes declared (30 % and 70 %): the job takes one of them on its declared count; a job declaring
    only a 2-GPU and a 1-GPU shape is never started on a halving or a grown gang it did not declare."""
    from elastico.domain import Shape

    jobs = [{"type": MEDIUM, "arrival": 0, "remaining": 100 * H}, {"type": HEAVY, "n": 2, "arrival": 1, "remaining": 100 * H}]
    shapes = {0: (Shape(1, 30.0, 3000), Shape(1, 70.0, 9000)), 1: (Shape(2, 45.0, 5000), Shape(1, 90.0, 9000))}
    d = elastico().decide(_declared(view(jobs, gpus=4), shapes))
    got = {j: (len(g), s) for j, g, s in d.place}
    assert got[0] == (1, 70.0)  # medium type (0.6 of a GPU): 30 % keeps only half its speed, below the floor
    assert got[1] in {(2, 45.0), (1, 90.0)}


def test_declared_job_is_not_grown_or_resized_beyond_its_shapes():
    """Idle GPUs and a long share-capped job: a job without shapes grows its share and its gang; one that
    declares a single shape keeps it (no resize, no relaunch on more GPUs)."""
    from elastico.domain import Shape
    from tests.unit.test_gpu_count_shapes import _scalable_types

    v = view([{"type": HEAVY, "n": 1, "remaining": 100 * H}], gpus=8, placed={0: ([0], 50.0)}, now=10 * H)
    v = replace(v, types=_scalable_types())
    pol = make_policy("elastico", rule_matrix(1.0), 1.0, min_run_s=0.0)
    d = pol.decide(v)
    assert d.preempt == [0] or d.resize  # without shapes: grows
    d = make_policy("elastico", rule_matrix(1.0), 1.0, min_run_s=0.0).decide(_declared(v, {0: (Shape(1, 50.0, 8192),)}))
    assert (d.preempt, d.resize, d.place) == ([], [], [])
    two = (Shape(1, 50.0, 8192), Shape(1, 80.0, 12000))  # a larger declared share: it may grow to exactly that
    d = make_policy("elastico", rule_matrix(1.0), 1.0, min_run_s=0.0).decide(_declared(v, {0: two}))
    assert d.resize == [(0, 80.0)] and d.preempt == [] and d.place == []


def test_declared_inference_service_is_sized_in_its_declared_shares():
    """A service sized by the SLO in 5 % steps otherwise: declaring 35 % and 60 %, it gets the smallest declared
    share that meets its SLO."""
    from elastico.domain import Shape

    jobs = [{"kind": 1, "load": 0.2}]
    d = elastico().decide(_declared(view(jobs, gpus=1), {0: (Shape(1, 60.0, 6000), Shape(1, 35.0, 4000))}))
    assert [s for _, _, s in d.place] == [35.0]
    d = elastico().decide(_declared(view(jobs, gpus=1), {0: (Shape(1, 60.0, 6000), Shape(1, 25.0, 4000))}))
    assert [s for _, _, s in d.place] == [60.0]  # 25 % is short of load + SLO margin (0.2 + 0.1)


def _rows(pending_type: int, ids: tuple[str, ...]) -> ClusterView:
    """One GPU whose light tenant holds 25 %, and one queued job on row 1; ``ids``: the rows' job ids."""
    H = 3600.0
    v = view([{"type": 0, "n": 1, "remaining": 100 * H}, {"type": pending_type, "n": 1, "remaining": H}], gpus=1,
             placed={0: ([0], 25.0)}, now=100.0)
    return replace(v, jobs=replace(v.jobs, job_ids=ids))


def test_a_row_that_holds_another_job_is_planned_afresh():
    """The live allocator's rows are positions: a queued job cancelled and another submitted take the same row.
    A pass that placed nobody last round is not taken as a repeat when the row holds another job."""
    pol = make_policy("elastico", rule_matrix(0.7), 0.7)
    assert pol.decide(_rows(2, ("a", "heavy"))).place == []  # the heavy job cannot join the light tenant
    assert pol.memo.idle is not None
    (j, g, _), = pol.decide(_rows(0, ("a", "light"))).place  # cancelled; a light one, same row: it joins
    assert j == 1 and g.tolist() == [0]
    # the same row, the same job: a repeat of the pass that placed nobody, skipped (the simulator's case)
    pol = make_policy("elastico", rule_matrix(0.7), 0.7)
    assert pol.decide(_rows(2, ("a", "heavy"))).place == []
    assert pol.decide(_rows(2, ("a", "heavy"))).place == [] and pol.memo.idle is not None


def test_a_service_joins_the_node_that_holds_services_not_a_training_node():
    """Two nodes of 4 GPUs: a training job holds GPU 0 (node 0), a service holds all of GPU 4 (node 1). A new
    service takes an empty GPU of node 1 (first fit would take GPU 1), so node 0 stays clearable for a gang."""
    jobs = [{"type": HEAVY, "n": 1, "remaining": 100 * H}, {"kind": 1, "load": 0.9}, {"kind": 1, "load": 0.3}]
    v = replace(view(jobs, gpus=8, placed={0: ([0], 100.0), 1: ([4], 100.0)}, now=100.0),
                topology=Topology.uniform(8, 4))
    d = elastico().decide(v)
    assert [(j, g.tolist()) for j, g, _ in d.place] == [(2, [5])]
    flat = elastico().decide(replace(v, topology=None))  # one node: the first empty GPU, as before
    assert [(j, g.tolist()) for j, g, _ in flat.place] == [(2, [1])]
