"""GPU-count shapes: measured scaling curves, their pessimistic reading, the engine's checks, and ElastiCo
growing gangs onto idle GPUs and giving them back when jobs wait."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from elastico.coloc.profiles import load_type_table, scaling_curve
from elastico.coloc.truth import GroundTruth
from services.allocator.policy import make_policy
from services.allocator.policy.contract import check
from services.allocator.policy.elastico.cache import TypeRows
from services.allocator.policy.shapes import allowed_counts, count_options, count_speed, grow_options, min_count
from services.allocator.policy.view import Decision, Topology
from simulator.engine import Engine, OversubscribedError, SimConfig
from simulator.traces import TrainingJobs
from tests.unit._policy_builders import rule_matrix, types, view

H = 3600.0
# measured curve of a sub-linear type (Gavel v100 ResNet-50 batch 16: 1 / 1.22 / 2.04 / 2.44)
SUBLINEAR = np.array([1.0, 1.22, 2.04, 2.44])


@pytest.mark.parametrize("measured, expected", [
    ({1: 1.0, 2: 1.22, 4: 2.04, 8: 2.44}, [1.0, 1.22, 2.04, 2.44]),
    ({1: 2.0, 2: 4.0, 4: 2.98, 8: 15.06}, [1.0, 2.0, 2.0, 7.53]),  # slower with more GPUs reads as no faster
    ({1: 3.0}, [1.0, 2.0, 4.0, 8.0]),  # measured on one GPU only: linear (shrinking saves nothing)
    ({}, [1.0, 2.0, 4.0, 8.0]),
], ids=["sublinear", "non-monotone", "one-gpu-only", "unknown"])
def test_scaling_curve_is_monotone_and_linear_where_unmeasured(measured, expected):
    np.testing.assert_allclose(scaling_curve(measured), expected)


@pytest.mark.parametrize("n_run, n_req, expected", [
    (8, 8, 1.0),
    (1, 8, 1.0 / 2.44),  # measured: 0.41 of its 8-GPU speed on an eighth of the GPUs
    (8, 1, 2.44),  # grows by the measured curve
    (16, 8, 2.0),  # beyond the measured counts: linear, never better
], ids=["same", "shrink", "grow", "beyond-8"])
def test_count_speed_follows_the_measured_curve(n_run, n_req, expected):
    assert float(count_speed(SUBLINEAR, n_run, n_req)) == pytest.approx(expected)


def test_count_speed_is_never_better_than_linear_nor_worse_than_the_request():
    superlinear = np.array([1.0, 3.1, 3.83, 11.83])  # Gavel ResNet-18 batch 16: anomalous, super-linear
    for n_run in (1, 2, 4, 8):
        for n_req in (1, 2, 4, 8):
            sp = float(count_speed(superlinear, n_run, n_req))
            lo, hi = sorted((1.0, n_run / n_req))
            assert lo - 1e-12 <= sp <= hi + 1e-12, (n_run, n_req, sp)


def test_count_options():
    assert count_options(8) == (8, 4, 2, 1)
    assert count_options(32) == (32, 16, 8, 4)
    assert count_options(12) == (12, 6, 3)
    assert count_options(7) == (7,)
    np.testing.assert_array_equal(min_count(np.array([1, 7, 8, 12, 32])), [1, 7, 1, 3, 4])
    measured = np.array([True, True, False, True])
    assert grow_options(1, measured) == (2, 8)
    assert grow_options(4, measured) == ()  # the request itself is unmeasured: no extrapolation upwards
    assert grow_options(2, None) == ()
    assert allowed_counts(2, measured) == (2, 1, 8)


def test_shipped_profiles_carry_measured_curves():
    t = load_type_table()
    r50 = t.names.index("ResNet-50 (batch size 16)")
    np.testing.assert_allclose(t.scale_tput[r50], SUBLINEAR, atol=0.01)
    assert t.scale_measured[r50].all()
    assert not t.scale_measured[t.names.index("A3C")][1:].any()  # measured on one GPU only
    assert np.all(np.diff(t.scale_tput, axis=1) >= 0)


# ---- engine ---------------------------------------------------------------------------------------------------
def _one_job_engine(policy, n_req: int, gpus: int = 8):
    t = load_type_table()
    typ = t.names.index("ResNet-50 (batch size 16)")
    train = TrainingJobs(arrival_s=np.array([0.0]), type_idx=np.array([typ]), num_gpus=np.array([n_req]),
                         duration_s=np.array([10 * H]), native_offered_load=1.0, offered_load=1.0,
                         unknown_types=0)
    return Engine(policy, t, GroundTruth(t), train, None, SimConfig(gpus=gpus, restart_s=0.0))


class _Place:
    """Places job 0 on the first ``n`` GPUs, whole-GPU share."""

    name, mps_limits, needs_periodic_rounds = "place-n", True, False

    def __init__(self, n: int):
        self.n = n

    def decide(self, view):
        d = Decision()
        if len(view.pending):
            d.place.append((0, np.arange(self.n), 100.0))
        return d


def test_engine_runs_a_grown_gang_at_the_measured_speed():
    e = _one_job_engine(_Place(8), n_req=1)
    r = e.run()
    assert r.completion_s[0] == pytest.approx(10 * H / e.scale[0][3], rel=1e-9)  # T(8) / T(1), measured
    assert e.scale[0][3] == pytest.approx(2.44, abs=0.01)


def test_engine_refuses_a_count_the_job_cannot_run_at():
    with pytest.raises(OversubscribedError):
        _one_job_engine(_Place(3), n_req=4).run()


# ---- ElastiCo ------------------------------------------------------------------------------------------------
def _scalable_types():
    t = types()
    T = len(t.names)
    return replace(t, scale_tput=np.tile(SUBLINEAR, (T, 1)), scale_measured=np.ones((T, 4), bool))


def _elastico(**kw):
    return make_policy("elastico", rule_matrix(1.0), 1.0, min_run_s=0.0, **kw)


def test_grows_a_running_gang_onto_idle_gpus_when_nobody_waits():
    v = view([{"type": 2, "n": 1, "remaining": 100 * H}], gpus=8, placed={0: ([0], 100.0)}, now=10 * H)
    v = replace(v, types=_scalable_types())
    d = _elastico().decide(v)
    assert d.preempt == [0]
    (j, g, share), = d.place
    assert j == 0 and len(g) == 8 and 0 in g.tolist() and share == 100.0
    assert _elastico(elastic_gpus=False).decide(v).place == []


def test_a_declaring_gang_running_shrunk_regrows_only_to_a_declared_count_and_share():
    """Live, a job declares the (GPU count, share) pairs it can run in and is requested at its largest count: one
    running on 2 of its declared 2 / 4 GPUs grows to 4 when GPUs idle, keeping its share -- not to 8 (undeclared)."""
    from elastico.domain import Shape
    from tests.unit.test_policy_shapes import with_declared

    def declaring(shapes):
        v = view([{"type": 2, "n": 4, "remaining": 100 * H}], gpus=8, placed={0: ([0, 1], 100.0)}, now=10 * H)
        v = with_declared(replace(v, types=_scalable_types()), {0: shapes})
        return replace(v, jobs=replace(v.jobs, gang_sizes=(tuple(sorted({s.num_gpus for s in shapes})),)))

    d = _elastico().decide(declaring((Shape(2, 100.0, 16384), Shape(4, 100.0, 16384))))
    assert d.preempt == [0]
    (j, g, share), = d.place
    assert j == 0 and len(g) == 4 and {0, 1} <= set(g.tolist()) and share == 100.0
    assert check(d, declaring((Shape(2, 100.0, 16384), Shape(4, 100.0, 16384))))[1] == []
    # its share is not declared on 4 GPUs: it stays as it runs
    d = _elastico().decide(declaring((Shape(2, 100.0, 16384), Shape(4, 50.0, 8192))))
    assert d.preempt == [] and d.place == []


def test_a_job_started_while_gpus_idle_starts_on_its_grown_gang():
    v = replace(view([{"type": 2, "n": 1, "remaining": 100 * H}], gpus=8, now=10 * H), types=_scalable_types())
    d = _elastico().decide(v)
    (j, g, _), = d.place
    assert j == 0 and len(g) == 8 and d.preempt == []  # launched grown: no restart at the requested size first
    (_, g, _), = _elastico(elastic_gpus=False).decide(v).place
    assert len(g) == 1


def test_does_not_grow_when_the_saving_is_below_the_restart_cost():
    v = view([{"type": 2, "n": 1, "remaining": 60.0}], gpus=8, placed={0: ([0], 100.0)}, now=10 * H)
    assert _elastico().decide(replace(v, types=_scalable_types())).place == []


def test_a_growth_pass_without_offer_is_redone_once_a_job_has_more_work_left():
    """The growth pass skips a repeat of a pass with no offer (same gangs, no job with more work left), and
    only that: the same cluster with a longer remaining time grows the gang."""
    t, pol = _scalable_types(), _elastico()

    def one(remaining: float):
        return replace(view([{"type": 2, "n": 1, "remaining": remaining}], gpus=8, placed={0: ([0], 100.0)},
                            now=10 * H), types=t)

    assert pol.decide(one(60.0)).place == [] and pol.memo.regrow is not None
    assert pol.decide(one(30.0)).place == []
    (j, g, _), = pol.decide(one(100 * H)).place
    assert j == 0 and len(g) == 8


def test_count_tables_are_kept_per_type_table_content_not_per_copy():
    """The live allocator's policy worker receives each round's view as a copy: the count tables are built once
    while the type table's content is the same (not once per copy, which grew without bound), and rebuilt
    when it differs."""
    import pickle

    pol = _elastico()
    v = replace(view([{"type": 2, "n": 2, "remaining": 100 * H}, {"type": 1, "n": 8, "remaining": H}], gpus=8,
                     placed={0: ([0, 1], 100.0)}, now=10 * H), types=_scalable_types())
    pol.decide(pickle.loads(pickle.dumps(v)))
    built = dict(pol.memo.counts)
    assert max(built[(2, 2)][0]) == 8  # (type, request) -> counts: the 2-GPU gang may grow to 8
    for _ in range(20):
        pol.decide(pickle.loads(pickle.dumps(v)))
    assert pol.memo.counts == built
    fewer = replace(v, types=replace(v.types, scale_measured=np.zeros_like(v.types.scale_measured)))
    pol.decide(fewer)  # no measured count to grow to: the tables of the other content are gone
    assert max(pol.memo.counts[(2, 2)][0]) == 2


def test_gives_a_grown_gang_back_as_soon_as_a_job_waits():
    jobs = [{"type": 2, "n": 1, "remaining": 100 * H}, {"type": 2, "n": 1, "arrival": 10 * H - 60, "remaining": H}]
    v = view(jobs, gpus=2, placed={0: ([0, 1], 100.0)}, now=10 * H)
    d = _elastico().decide(replace(v, types=_scalable_types()))
    assert 0 in d.preempt
    placed = {j: g.tolist() for j, g, _ in d.place}
    assert placed[0] == [0]  # back to its requested single GPU
    assert placed[1] == [1]  # the waiting job gets the GPU it gave back


def test_gives_back_only_the_gpus_the_waiting_jobs_need_lightest_gang_first():
    jobs = [{"type": 2, "n": 1, "remaining": 100 * H}, {"type": 2, "n": 1, "remaining": 50 * H},
            {"type": 2, "n": 1, "arrival": 10 * H - 60, "remaining": H}]
    v = view(jobs, gpus=4, placed={0: ([0, 1], 100.0), 1: ([2, 3], 100.0)}, now=10 * H)
    d = _elastico().decide(replace(v, types=_scalable_types()))
    assert d.preempt == [0]  # the lighter (longer) gang; one freed GPU covers the 1-GPU waiting job
    placed = {j: g.tolist() for j, g, _ in d.place}
    assert placed[0] == [0] and placed[2] == [1]


def test_a_gang_grown_less_than_min_run_s_ago_is_not_given_back():
    """Give-back is a resize: the preemption hysteresis holds for it too (no grow/shrink churn)."""
    jobs = [{"type": 2, "n": 1, "remaining": 100 * H}, {"type": 2, "n": 1, "arrival": 10 * H - 60, "remaining": H}]
    v = replace(view(jobs, gpus=2, placed={0: ([0, 1], 100.0)}, now=10 * H), types=_scalable_types())
    v.jobs.last_change_s[0] = 10 * H - 600  # grew 10 min ago
    assert 0 not in make_policy("elastico", rule_matrix(1.0), 1.0, min_run_s=1800.0).decide(v).preempt
    v.jobs.last_change_s[0] = 10 * H - 1800
    assert 0 in make_policy("elastico", rule_matrix(1.0), 1.0, min_run_s=1800.0).decide(v).preempt


def test_a_short_grown_job_keeps_its_gpus_while_a_long_one_waits():
    jobs = [{"type": 2, "n": 1, "remaining": H}, {"type": 2, "n": 1, "arrival": 10 * H - 60, "remaining": 100 * H}]
    v = view(jobs, gpus=2, placed={0: ([0, 1], 100.0)}, now=10 * H)
    d = _elastico().decide(replace(v, types=_scalable_types()))
    assert d.preempt == [] and d.place == []
    assert 0 in _elastico(keep_heavy_growth=False).decide(replace(v, types=_scalable_types())).preempt


def test_an_idle_gpu_goes_to_the_job_it_speeds_up_most_not_the_longest():
    t = _scalable_types()
    t = replace(t, scale_tput=np.vstack([[1.0, 2.0, 4.0, 8.0], SUBLINEAR, SUBLINEAR, SUBLINEAR]))
    jobs = [{"type": 2, "n": 1, "remaining": 1000 * H},  # long, sub-linear: 1.22x on 2 GPUs
            {"type": 0, "n": 1, "remaining": 10 * H}]  # short, linear: 2x on 2 GPUs
    v = replace(view(jobs, gpus=3, placed={0: ([0], 100.0), 1: ([1], 100.0)}, now=10 * H), types=t)
    d = _elastico().decide(v)
    assert [(j, g.tolist()) for j, g, _ in d.place] == [(1, [1, 2])]


# ---- clearing a node for a gang running shrunk (counts.defragment) -------------------------------------------
def _fragmented(tenant_kind: int = 0, settled: bool = True):
    """Two nodes of 8: an 8-GPU gang shrunk to GPUs 0-3, two 1-GPU jobs on each node (4, 5 and 8, 9), the other
    six GPUs empty but split 2 + 6, so no node has room for the gang. ``tenant_kind`` 1: the jobs on node 1
    are services."""
    small = {"type": 2, "n": 1, "remaining": 300.0}  # too short to be worth growing
    svc = {"kind": 1, "load": 0.2}
    jobs = [{"type": 2, "n": 8, "remaining": 100 * H}, small, small, small if tenant_kind == 0 else svc,
            small if tenant_kind == 0 else svc]
    placed = {0: ([0, 1, 2, 3], 100.0), 1: ([4], 100.0), 2: ([5], 100.0), 3: ([8], 100.0), 4: ([9], 100.0)}
    v = view(jobs, gpus=16, placed=placed, now=10 * H)
    if not settled:
        v.jobs.last_change_s[:] = 10 * H - 60
    return replace(v, types=_scalable_types(), topology=Topology.uniform(16, 8))


def test_clears_a_node_for_a_gang_running_shrunk():
    v = _fragmented()
    d = _elastico().decide(v)
    assert check(d, v)[1] == []  # topology, capacity, every rule of the decision contract
    placed = {j: g.tolist() for j, g, _ in d.place}
    assert sorted(d.preempt) == [0, 1, 2] and placed[0] == list(range(8))  # the gang at its request, on node 0
    assert all(g[0] >= 8 for j, g in placed.items() if j != 0)  # its two neighbours moved to node 1's empty GPUs
    assert _elastico(defrag_moves=0).decide(v).preempt == []
    assert _elastico(defrag_moves=1).decide(v).preempt == []  # two moves needed, one allowed


def test_a_node_with_a_service_or_unsettled_jobs_is_not_cleared():
    v = _fragmented(tenant_kind=1)  # node 1 holds services: only node 0 may be cleared, and it is
    d = _elastico().decide(v)
    assert sorted(d.preempt) == [0, 1, 2] and {j: g.tolist() for j, g, _ in d.place}[0] == list(range(8))
    v = _fragmented(settled=False)  # every job changed a minute ago: none moves within min_run_s
    assert make_policy("elastico", rule_matrix(1.0), 1.0, min_run_s=1800.0).decide(v).preempt == []


def test_type_rows_build_each_row_once_and_pad_to_the_widest():
    built = []

    def build(t, n):
        built.append((t, n))
        return tuple(range(1, n + 1)), tuple(float(t) for _ in range(n))

    rows = TypeRows((0, 1.0))
    (cnt, spd), at = rows.lookup(np.array([2, 0, 2]), np.array([1, 2, 1]), build)
    assert built == [(0, 2), (2, 1)] and at.tolist() == [1, 0, 1]
    assert cnt[at].tolist() == [[1, 0], [1, 2], [1, 0]] and spd[at].tolist() == [[2.0, 1.0], [0.0, 0.0], [2.0, 1.0]]
    (cnt, spd), at = rows.lookup(np.array([0, 5]), np.array([2, 4]), build)  # a new type and a wider row
    assert built == [(0, 2), (2, 1), (5, 4)] and cnt.dtype == np.int64 and spd.dtype == float
    assert cnt[at].tolist() == [[1, 2, 0, 0], [1, 2, 3, 4]] and spd[at].tolist() == [[0.0, 0.0, 1.0, 1.0], [5.0] * 4]
