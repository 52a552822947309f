"""The decision contract (services.allocator.policy.contract.check): every policy's decision on any view is
accepted whole; each kind of violation is rejected with its reason; the simulator's runs never see a rejection."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastico.domain import Shape
from services.allocator.estimate import default_kappa, default_types, rule_matrix
from services.allocator.policy import INFERENCE, POLICY_NAMES, TRAINING, ClusterView, Decision, JobTable, make_policy
from services.allocator.policy.contract import check
from services.allocator.policy.elastico import counts
from services.allocator.policy.placement import pick_gang
from services.allocator.policy.shapes import DeclaredJobTable, allowed_counts, declared_util_cap
from services.allocator.policy.view import Topology, free_share
from simulator.engine import Engine, SimConfig
from simulator.run import build_workload
from tests.unit._policy_builders import INFERENCE_TRACES, write_small_trace
from tests.unit._policy_builders import rule_matrix as tiny_matrix
from tests.unit._policy_builders import view as tiny_view

TYPES = default_types()
KAPPA = default_kappa()
MATRIX = rule_matrix(TYPES, KAPPA)
TRAIN_TYPES = [i for i in range(TYPES.inference_index) if np.isfinite(TYPES.iso_tput_steps_s[i])]
ROOT = Path(__file__).resolve().parents[2]


def freeze(view: ClusterView) -> ClusterView:
    """The view read-only, as both front ends hand it over."""
    jobs = view.jobs
    arrays = [view.gpu_job, view.gpu_share, view.pending, view.running, *(g for g in jobs.gpus if g is not None),
              *(m for m in jobs.allowed_gpus or () if m is not None)]
    arrays += [getattr(jobs, f.name) for f in fields(JobTable) if isinstance(getattr(jobs, f.name), np.ndarray)]
    for a in arrays:
        a.setflags(write=False)
    return view


def table(n: int, **kw) -> dict:
    """JobTable fields of ``n`` queued training jobs of the first type on one GPU each, overridden by ``kw``."""
    t = TRAIN_TYPES[0]
    base = dict(kind=np.zeros(n, np.int8), type_idx=np.full(n, t), num_gpus=np.ones(n, np.int64),
                arrival_s=np.arange(n, dtype=float), priority=np.ones(n), attained_gpu_s=np.zeros(n),
                share_pct=np.zeros(n), solo_util=np.full(n, float(TYPES.solo_util[t])), load_forecast=np.full(n, np.nan),
                gpus=[None] * n, restarts=np.zeros(n, np.int64), queued_since_s=np.zeros(n),
                remaining_est_s=np.full(n, 3600.0), last_change_s=np.zeros(n))
    base.update(kw)
    return base


def small_view(placed: dict[int, tuple[list[int], float]], n: int = 4, gpus: int = 4, node_gpus: int = 2,
               K: int = 2, cls=JobTable, **kw) -> ClusterView:
    """``n`` jobs on ``gpus`` GPUs in nodes of ``node_gpus``; ``placed``: job -> (GPU rows, share)."""
    gj, gs = np.full((gpus, K), -1, np.int64), np.zeros((gpus, K))
    f = table(n, **kw)
    for j, (g, sh) in placed.items():
        for x in g:
            k = int(np.flatnonzero(gj[x] < 0)[0])
            gj[x, k], gs[x, k] = j, sh
        f["gpus"][j] = np.array(g, np.int64)
        f["share_pct"][j] = sh
    pend = np.array([j for j in range(n) if j not in placed], np.int64)
    return freeze(ClusterView(1e5, gj, gs, cls(**f), pend, np.array(sorted(placed), np.int64), TYPES,
                              Topology.uniform(gpus, node_gpus)))


# --------------------------------------------------------------------------------------------------
# check: each violation, with its reason


def test_a_valid_decision_is_accepted_whole_and_a_no_op_resize_is_left_out():
    v = small_view({0: ([0], 50.0), 1: ([1], 50.0)})
    d = Decision(preempt=[0, 0], resize=[(1, 50.0)], place=[(0, np.array([2]), 100.0), (2, np.array([0]), 100.0)],
                 info={"x": 1})
    ok, rejected = check(d, v)
    assert rejected == [] and ok.preempt == [0] and ok.resize == [] and ok.info == {"x": 1}
    assert [(r, g.tolist(), s) for r, g, s in ok.place] == [(0, [2], 100.0), (2, [0], 100.0)]
    assert check(Decision(), v) == (Decision(), [])


@pytest.mark.parametrize(("decision", "why"), [
    (Decision(place=[(9, np.array([2]), 50.0)]), "placed while neither pending nor preempted by the same decision"),
    (Decision(preempt=[9]), "preempted job row out of range"),
    (Decision(preempt=[2]), "preempted while not running"),
    (Decision(resize=[(2, 50.0)]), "resized while not running"),
    (Decision(preempt=[0], resize=[(0, 25.0)]), "resized and preempted in one decision"),
    (Decision(resize=[(1, 0.0)]), "share 0.0% outside (0, 100]"),
    (Decision(place=[(0, np.array([2]), 50.0)]), "placed while neither pending nor preempted by the same decision"),
    (Decision(place=[(2, np.array([2]), 50.0), (2, np.array([3]), 50.0)]), "placed twice in one decision"),
    (Decision(place=[(2, np.array([4]), 50.0)]), "GPU rows [4] out of range (view of 4 GPUs)"),
    (Decision(place=[(2, np.array([-1]), 50.0)]), "GPU rows [-1] out of range (view of 4 GPUs)"),
    (Decision(place=[(3, np.array([2, 2]), 50.0)]), "GPU rows [2, 2] are not distinct"),
    (Decision(place=[(2, np.array([2]), 150.0)]), "share 150.0% outside (0, 100]"),
    (Decision(place=[(2, np.array([2]), float("nan"))]), "share nan% outside (0, 100]"),
    (Decision(place=[(3, np.array([1, 2]), 50.0)]), "gang [1, 2] breaks the node topology (one node, or whole nodes plus one partial)"),
    (Decision(place=[(2, np.array([2, 3]), 50.0)]), "gang of 2 GPUs: the job runs on 1"),
    (Decision(place=[(2, np.array([0]), 60.0)]), "60.0% oversubscribes GPU rows [0]"),
    (Decision(resize=[(1, 75.0)], place=[(2, np.array([1]), 50.0)]), "50.0% oversubscribes GPU rows [1]"),
    (Decision(place=[(2, np.array([0]), 25.0), (3, np.array([0, 1]), 25.0)]), "no free tenant slot on GPU rows [0]"),
], ids=["place-row-out-of-range", "preempt-row-out-of-range", "preempt-not-running", "resize-not-running",
        "resize-and-preempt", "resize-share", "place-running", "place-twice", "gpu-out-of-range", "gpu-negative",
        "gpus-not-distinct", "share-above-100", "share-nan", "topology", "gang-size", "share-oversubscribed",
        "after-a-resize", "no-free-slot"])
def test_check_rejects_each_violation_with_its_reason(decision, why):
    # jobs 0, 1 run at 50 % on GPUs 0 and 1 (node 0); 2 (one GPU) and 3 (two GPUs) queue; K = 2
    v = small_view({0: ([0], 50.0), 1: ([1], 50.0)}, num_gpus=np.array([1, 1, 1, 2]))
    ok, rejected = check(decision, v)
    assert [w for _, w in rejected] == [why]
    assert len(ok.place) + len(ok.resize) + len(ok.preempt) < len(decision.place) + len(decision.resize) + len(
        dict.fromkeys(decision.preempt)) or not decision.place


def test_a_resize_that_oversubscribes_is_rejected_and_the_job_keeps_its_share():
    v = small_view({0: ([0], 50.0), 1: ([0], 50.0)})
    ok, rejected = check(Decision(resize=[(0, 75.0)], place=[(2, np.array([1]), 100.0)]), v)
    assert rejected == [(0, "resize to 75.0% oversubscribes GPU rows [0]")] and ok.resize == [] and len(ok.place) == 1


def test_gpus_outside_the_jobs_allowed_ones_are_rejected():
    allowed = (None, np.array([False, False, True, True]), None, None)
    v = small_view({}, allowed_gpus=allowed)
    ok, rejected = check(Decision(place=[(1, np.array([1]), 50.0), (0, np.array([1]), 50.0)]), v)
    assert rejected == [(1, "GPU rows [1] are not among the job's allowed GPUs")] and [r for r, _, _ in ok.place] == [0]
    assert check(Decision(place=[(1, np.array([3]), 50.0)]), v)[1] == []


def test_gang_sizes_come_from_the_view_else_from_the_policys_menu():
    t = next(t for t in TRAIN_TYPES if tuple(allowed_counts(4, TYPES.scale_measured[t])) != (4,))
    menu = allowed_counts(4, TYPES.scale_measured[t])
    v = small_view({}, n=1, gpus=8, node_gpus=8, type_idx=np.array([t]), num_gpus=np.array([4]))
    for n in range(1, 9):
        assert (check(Decision(place=[(0, np.arange(n), 100.0)]), v)[1] == []) == (n in menu), n
    v = small_view({}, n=1, gpus=8, node_gpus=8, type_idx=np.array([t]), num_gpus=np.array([4]), gang_sizes=((2, 4),))
    assert [check(Decision(place=[(0, np.arange(n), 100.0)]), v)[1] == [] for n in (1, 2, 4, 8)] == [False, True, True, False]
    v = small_view({}, n=1, kind=np.array([INFERENCE], np.int8), type_idx=np.array([TYPES.inference_index]))
    assert check(Decision(place=[(0, np.arange(2), 100.0)]), v)[1] == [(0, "gang of 2 GPUs: the job runs on 1")]


def test_declared_shapes_are_matched_exactly_on_place_and_resize():
    shapes = ((Shape(1, 30.0, 3000), Shape(1, 60.0, 6000)), (), (Shape(1, 10.0, 1000),), ())
    v = small_view({0: ([0], 30.0)}, cls=DeclaredJobTable, declared=shapes, any_declared=True)
    ok, rejected = check(Decision(resize=[(0, 50.0)], place=[(2, np.array([1]), 20.0), (1, np.array([1]), 20.0)]), v)
    assert rejected == [(0, "resize to 50.0% is not among the job's declared shapes"),
                        (2, "1 x 20.0% is not among the job's declared shapes")]
    assert [r for r, _, _ in ok.place] == [1]
    assert check(Decision(resize=[(0, 60.0)], place=[(2, np.array([1]), 10.0)]), v)[1] == []


def test_a_rejected_relaunch_takes_its_preemption_with_it_and_what_needed_its_gpus():
    # job 0 on GPU 0 relaunched on GPUs 2-3 (not allowed: one GPU only); job 2 was to take GPU 0
    v = small_view({0: ([0], 100.0)}, K=1)
    d = Decision(preempt=[0], place=[(0, np.array([2, 3]), 100.0), (2, np.array([0]), 100.0)])
    ok, rejected = check(d, v)
    assert ok.preempt == [] and ok.place == []
    assert rejected == [(0, "gang of 2 GPUs: the job runs on 1"), (2, "no free tenant slot on GPU rows [0]")]
    # a relaunch that does not fit: withdrawn, and everything re-checked without its GPUs
    v = small_view({0: ([0], 100.0), 1: ([2], 100.0)}, K=1)
    d = Decision(preempt=[0], place=[(3, np.array([0]), 100.0), (0, np.array([2]), 100.0)])
    ok, rejected = check(d, v)
    assert (ok.preempt, ok.place) == ([], [])
    assert rejected == [(0, "no free tenant slot on GPU rows [2]"), (3, "no free tenant slot on GPU rows [0]")]


# --------------------------------------------------------------------------------------------------
# every policy honours every constraint of any view


class Case:
    """A drawn view, printed briefly when a property fails (a view's type table has no useful repr)."""

    def __init__(self, view: ClusterView):
        self.view = view

    def __repr__(self) -> str:
        v, j = self.view, self.view.jobs
        return (f"Case(nodes={v.topo.node_size.tolist()}, K={v.max_tenants}, now={v.now_s}, kind={j.kind.tolist()}, "
                f"type={j.type_idx.tolist()}, n={j.num_gpus.tolist()}, running={v.running.tolist()}, "
                f"gpus={[None if g is None else g.tolist() for g in j.gpus]}, share={j.share_pct.tolist()}, "
                f"allowed={None if j.allowed_gpus is None else [None if m is None else np.flatnonzero(m).tolist() for m in j.allowed_gpus]}, "
                f"sizes={j.gang_sizes}, declared={getattr(j, 'declared', None)})")


@st.composite
def views(draw) -> Case:
    """A random cluster: nodes of 1-8 GPUs, running and queued training jobs and services, some pinned to nodes,
    some with gang sizes of their own and (live-like views) declared shapes; the view read-only."""
    sizes = draw(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=4))
    topo = Topology.from_gpu_node(np.repeat(np.arange(len(sizes)), sizes))
    G, K = int(sum(sizes)), draw(st.sampled_from([1, 2, 4]))
    live = draw(st.booleans())  # explicit gang sizes and declared shapes, as the live allocator's view has
    N = draw(st.integers(1, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    gj, gs = np.full((G, K), -1, np.int64), np.zeros((G, K))
    f = table(N)
    f["remaining_est_s"] = np.where(rng.random(N) < 0.8, rng.uniform(60, 2e5, N), np.nan)
    f["attained_gpu_s"] = rng.uniform(0, 1e5, N)
    f["arrival_s"] = f["queued_since_s"] = rng.uniform(0, 5e4, N)
    declared, gang, allowed, running = [], [], [], []
    for j in range(N):
        inference = rng.random() < 0.2
        n = 1 if inference else int(rng.choice([1, 1, 2, 4, 8]))
        t = TYPES.inference_index if inference else int(rng.choice(TRAIN_TYPES))
        f["kind"][j], f["type_idx"][j] = (INFERENCE, t) if inference else (TRAINING, t)
        f["solo_util"][j] = float(rng.uniform(0.05, 0.6)) if inference else float(TYPES.solo_util[t])
        if inference:
            f["load_forecast"][j] = f["solo_util"][j]
        shapes: tuple = ()
        if live and rng.random() < 0.35:
            counts = [n] if inference or n == 1 or rng.random() < 0.5 else [n, n // 2]
            shapes = tuple(Shape(int(c), float(s), 1024) for c in counts
                           for s in rng.choice([10, 25, 30, 50, 60, 100], size=int(rng.integers(1, 3)), replace=False))
            n = max(s.num_gpus for s in shapes)
            f["solo_util"][j] = min(f["solo_util"][j], declared_util_cap(shapes))
        f["num_gpus"][j] = n
        menu = (1,) if inference else allowed_counts(n, TYPES.scale_measured[t])
        own = (tuple(sorted({s.num_gpus for s in shapes})) if shapes
               else tuple(sorted({n, *(c for c in menu if rng.random() < 0.3)})))
        declared.append(shapes)
        gang.append(own)
        mask = None
        if rng.random() < 0.3:
            mask = np.isin(topo.gpu_node, rng.choice(len(sizes), size=int(rng.integers(1, len(sizes) + 1)), replace=False))
        allowed.append(mask)
        if rng.random() < 0.5:  # try to start it somewhere valid
            c = int(rng.choice(own if live else menu))
            if shapes:
                opts = [s for s in shapes if s.num_gpus == c]
                share = float(opts[int(rng.integers(len(opts)))].compute_share_pct)
            else:
                share = float(rng.choice([5, 10, 20, 40]) if inference else rng.choice([25, 50, 75, 100]))
            ok = (gj < 0).any(axis=1) & (free_share(gs) >= share - 1e-9)
            g = pick_gang(rng.random(G), ok, c, topo, allowed=mask)
            if g is not None:
                for x in g:
                    k = int(np.flatnonzero(gj[x] < 0)[0])
                    gj[x, k], gs[x, k] = j, share
                f["gpus"][j], f["share_pct"][j] = g, share
                f["last_change_s"][j] = float(rng.uniform(0, 1e5))
                running.append(j)
    f["allowed_gpus"] = tuple(allowed) if any(m is not None for m in allowed) else None
    f["observed_norm"] = np.full(N, np.nan)
    if live:
        jobs = DeclaredJobTable(**f, gang_sizes=tuple(gang), declared=tuple(declared), any_declared=any(declared))
    else:
        jobs = JobTable(**f)
    pend = np.array([j for j in np.argsort(f["arrival_s"], kind="stable").tolist() if j not in running], np.int64)
    return Case(freeze(ClusterView(float(draw(st.sampled_from([1e5, 2e5]))), gj, gs, jobs, pend,
                                   np.array(sorted(running), np.int64), TYPES, topo)))


@pytest.mark.parametrize("policy", POLICY_NAMES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=views())
def test_every_policys_decision_passes_the_contract_whole(policy, case):
    view = case.view
    pol = make_policy(policy, MATRIX, KAPPA)
    for _ in range(2):  # a second round on the same view: policies keep state between rounds
        d = pol.decide(view)
        ok, rejected = check(d, view)
        assert rejected == [], (policy, rejected)
        assert len(ok.place) == len(d.place) and ok.preempt == list(dict.fromkeys(d.preempt))


def test_elastico_clears_no_node_for_a_shrunk_gang_outside_the_gpus_it_may_use():
    """A 4-GPU gang pinned to nodes 1-3 (four GPUs over three nodes) runs shrunk on one GPU: node 0 is empty and
    would take it whole, but it may not go there -- no move, no preemption (hypothesis found this case)."""
    topo = Topology.from_gpu_node(np.repeat(np.arange(4), [8, 1, 1, 2]))
    gj, gs = np.full((12, 1), -1, np.int64), np.zeros((12, 1))
    gj[8, 0], gs[8, 0] = 0, 100.0
    f = table(2, type_idx=np.array([16, 2]), num_gpus=np.array([4, 1]), share_pct=np.array([100.0, 0.0]),
              gpus=[np.array([8]), None], remaining_est_s=np.array([1e5, 1e5]))
    f["solo_util"] = TYPES.solo_util[f["type_idx"]].astype(float)
    f["allowed_gpus"] = (np.isin(np.arange(12), [8, 9, 10, 11]), np.isin(np.arange(12), [10, 11]))
    f["observed_norm"] = np.full(2, np.nan)
    view = freeze(ClusterView(1e5, gj, gs, JobTable(**f), np.array([1]), np.array([0]), TYPES, topo))
    d = make_policy("elastico", MATRIX, KAPPA).decide(view)
    assert check(d, view)[1] == [] and 0 not in d.preempt and all(j != 0 for j, _, _ in d.place)


@st.composite
def fragmented(draw) -> Case:
    """Nodes of 4 or 8 GPUs, 2 slots each, holding gangs running shrunk on part of a node, one-GPU jobs, services
    and scattered empty GPUs: what the node-clearing pass (``counts.defragment``) works on."""
    size, nodes = draw(st.sampled_from([4, 8])), draw(st.integers(2, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    G, K = size * nodes, 2
    gj, gs = np.full((G, K), -1, np.int64), np.zeros((G, K))
    jobs = []  # (kind, type, requested GPUs, GPUs held)
    for nd in range(nodes):
        free = (nd * size + rng.permutation(size)).tolist()
        while free and (rng.random() < 0.85 or not jobs):
            r = rng.random()
            n = int(rng.choice([size // 2, size]))
            held = max(1, int(rng.choice([n // 4, n // 2])))  # a halving of its request, as the policy shrinks gangs
            if r < 0.4 and held <= len(free):  # a gang shrunk to part of this node
                job = (TRAINING, int(rng.choice(TRAIN_TYPES)), n, free[:held])
            elif r < 0.85:
                job = (TRAINING, int(rng.choice(TRAIN_TYPES)), 1, free[:1])
            else:
                job = (INFERENCE, TYPES.inference_index, 1, free[:1])
            del free[:len(job[3])]
            for g in job[3]:
                gj[g, 0], gs[g, 0] = len(jobs), 100.0 if job[0] == TRAINING else 30.0
            jobs.append(job)
    N = len(jobs)
    kind = np.array([j[0] for j in jobs], np.int8)
    typ = np.array([j[1] for j in jobs])
    f = table(N, kind=kind, type_idx=typ, num_gpus=np.array([j[2] for j in jobs], np.int64),
              share_pct=np.where(kind == TRAINING, 100.0, 30.0), gpus=[np.array(j[3]) for j in jobs],
              solo_util=np.where(kind == TRAINING, TYPES.solo_util[np.where(kind == TRAINING, typ, 0)], 0.2),
              load_forecast=np.where(kind == INFERENCE, 0.2, np.nan), observed_norm=np.full(N, np.nan),
              remaining_est_s=rng.uniform(3600, 1e6, N), last_change_s=rng.uniform(0, 1e5, N))
    view = ClusterView(2e5, gj, gs, JobTable(**f), np.array([], np.int64), np.arange(N, dtype=np.int64), TYPES,
                       Topology.uniform(G, size))
    return Case(freeze(view))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=fragmented())
def test_elasticos_node_clearing_skips_only_offers_that_have_no_node_to_try(case):
    """``counts._may_clear`` is a shortcut: trying every offer of the node-clearing pass decides the same."""
    def everyone(nodes, order, offers, *_):
        return [True] * len(offers)

    fast = make_policy("elastico", MATRIX, KAPPA).decide(case.view)
    with mock.patch.object(counts, "_may_clear", everyone):
        slow = make_policy("elastico", MATRIX, KAPPA).decide(case.view)
    assert check(fast, case.view)[1] == []
    assert sorted(fast.preempt) == sorted(slow.preempt) and fast.resize == slow.resize
    assert [(j, g.tolist(), s) for j, g, s in fast.place] == [(j, g.tolist(), s) for j, g, s in slow.place]


# --------------------------------------------------------------------------------------------------
# the simulator: nothing is ever rejected


class Recording(Engine):
    """Engine that records what the contract said of every decision."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.checked = self.rejected = self.actions = 0

    def _apply(self, d, view, t):
        ok, rejected = check(d, view)
        self.checked += 1
        self.rejected += len(rejected)
        self.actions += len(ok.place) + len(ok.resize) + len(ok.preempt)
        super()._apply(d, view, t)


@pytest.fixture(scope="module")
def small_workload(tmp_path_factory):
    """The first 60 Philly jobs (at most 6 GPUs, 10 h) and the inference traces, on 8 GPUs in two nodes of 4."""
    out = write_small_trace(tmp_path_factory.mktemp("trace") / "small.csv")
    return build_workload(str(out), 8, [str(p) for p in INFERENCE_TRACES], seed=0, load=1.5, estimator="rule")


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_the_simulator_never_sees_a_rejection(small_workload, policy):
    w = small_workload
    e = Recording(make_policy(policy, w.estimate, w.truth.kappa), w.types, w.truth, w.train, w.inf,
                  SimConfig(gpus=8, node_gpus=4))
    e.run()
    assert e.checked > 0 and e.actions > 0 and e.rejected == 0


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_view_without_gpus_gets_an_empty_decision(policy):
    """No GPU in the view (live: every node stale, or none registered yet) with a service and a gang queued:
    nothing is placed and the round does not fail (ElastiCo's service placement took argmin of no GPUs)."""
    v = tiny_view([{"kind": 1, "load": 0.3}, {"type": 2, "n": 2}], gpus=0)
    for _ in range(2):
        d = make_policy(policy, tiny_matrix(1.0), 1.0).decide(v)
        assert (d.place, d.preempt, d.resize) == ([], [], [])
