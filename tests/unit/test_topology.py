"""Node topology: the gang rule, the gang picker (and a job's allowed GPUs), and every policy keeping both on random
clusters."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastico.coloc.profiles import load_type_table
from services.allocator.policy import POLICY_NAMES, ClusterView, JobTable, make_policy
from services.allocator.policy.contract import check
from services.allocator.policy.placement import first_free_gpus, pick_gang, sub_gang
from services.allocator.policy.view import INFERENCE, TRAINING, Topology, occupy

TOPO = Topology.uniform(12, 4)  # three nodes of four GPUs


@pytest.mark.parametrize(("gpus", "ok"), [
    ([5], True), ([0, 1, 2, 3], True), ([3, 4], False), ([4, 5, 6, 7, 8, 9, 10, 11], True),
    ([0, 1, 2, 3, 4, 5], True), ([0, 1, 2, 4, 5, 6], False), ([0, 1, 4, 5, 8], False), ([2, 3, 4, 5, 6, 7], True),
], ids=["one", "whole-node", "split-small", "two-whole", "whole+partial", "two-partial", "three-partial",
        "partial+whole"])
def test_gang_rule(gpus, ok):
    assert TOPO.gang_ok(gpus) is ok


def test_topology_from_node_labels():
    t = Topology.from_gpu_node(["a", "a", "b", "b", "b"])
    assert t.node_size.tolist() == [2, 3] and t.max_node == 3 and t.gpu_node.tolist() == [0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="contiguous"):
        Topology.from_gpu_node(["a", "b", "a"])
    assert Topology.uniform(8, 8).flat and Topology.uniform(8, 8).gang_ok([0, 7])


@pytest.mark.parametrize(("score", "feasible", "n", "expected"), [
    ([0, 0, 0, 0, 5, 5, 0, 0, 1, 1, 1, 1], [1] * 12, 2, [4, 5]),
    ([9, 9, 9, 0, 1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 0] + [1] * 8, 4, [4, 5, 6, 7]),
    ([0] * 12, [1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 0], 4, None),
    ([0] * 12, [1] * 12, 6, [0, 1, 2, 3, 4, 5]),
    ([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2], [1] * 12, 6, [4, 5, 6, 7, 8, 9, 10, 11][:2] + [8, 9, 10, 11]),
    ([0] * 12, [1, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1], 8, None),
], ids=["best-node", "node-with-room", "no-node-fits", "whole+partial-first-fit", "whole+partial-by-score",
        "not-enough-whole-nodes"])
def test_pick_gang_keeps_the_topology(score, feasible, n, expected):
    g = pick_gang(np.array(score, float), np.array(feasible, bool), n, TOPO)
    if expected is None:
        assert g is None
    else:
        assert sorted(g.tolist()) == sorted(expected) and TOPO.gang_ok(g)


def test_pick_gang_on_a_subset_of_rows():
    rows = np.array([2, 3, 4, 5, 6])  # candidates: the last two GPUs of node 0, three of node 1
    g = pick_gang(np.zeros(5), np.ones(5, bool), 3, TOPO, rows)
    assert rows[g].tolist() == [4, 5, 6]


def test_first_free_gpus_skips_a_split():
    gj = np.full((12, 2), -1)
    gj[[0, 5, 6], 0] = 7  # node 0 has 3 free GPUs, node 1 has 2, node 2 has 4
    assert first_free_gpus(gj, 3, TOPO).tolist() == [1, 2, 3]
    assert first_free_gpus(gj, 4, TOPO).tolist() == [8, 9, 10, 11]
    assert first_free_gpus(gj, 3) is not None and first_free_gpus(gj, 12, TOPO) is None


def test_the_gang_picker_keeps_to_a_jobs_allowed_gpus():
    allowed = np.zeros(12, bool)
    allowed[[2, 3, 8, 9, 10, 11]] = True  # half of node 0, all of node 2
    gj = np.full((12, 2), -1)
    assert first_free_gpus(gj, 1, TOPO, allowed).tolist() == [2]
    assert first_free_gpus(gj, 3, TOPO, allowed).tolist() == [8, 9, 10]
    assert first_free_gpus(gj, 5, TOPO, allowed).tolist() == [2, 8, 9, 10, 11]  # whole node 2, part of node 0
    assert first_free_gpus(gj, 7, TOPO, allowed) is None  # node 0 has only two allowed GPUs
    score = np.arange(12, dtype=float)
    assert pick_gang(score, np.ones(12, bool), 2, TOPO, allowed=allowed).tolist() == [10, 11]
    rows = np.array([0, 1, 2, 4])
    assert rows[pick_gang(np.zeros(4), np.ones(4, bool), 1, TOPO, rows, allowed=allowed)].tolist() == [2]
    assert sub_gang(np.array([4, 5, 6, 7]), 2, TOPO).tolist() == [4, 5]


TYPES = load_type_table()
TRAIN_TYPES = [i for i in range(len(TYPES.names)) if i != TYPES.inference_index]


#: shares a policy's own running jobs hold (a state it could have produced)
OWN_SHARES = {"elastico": (25.0, 50.0, 100.0), "mps-equal-share": (50.0,)}


def random_view(seed: int, shares=(100.0,)) -> ClusterView:
    """A cluster of three 4-GPU nodes with a random, topology-valid set of running jobs at ``shares`` and a
    random queue."""
    rng = np.random.default_rng(seed)
    G, K = 12, 4
    gj, gs = np.full((G, K), -1, np.int64), np.zeros((G, K))
    n_jobs = int(rng.integers(4, 16))
    kind = (rng.random(n_jobs) < 0.2).astype(np.int8)
    ngpu = np.where(kind == INFERENCE, 1, rng.choice([1, 1, 2, 3, 4, 6, 8], n_jobs))
    types = np.where(kind == INFERENCE, TYPES.inference_index, rng.choice(TRAIN_TYPES, n_jobs))
    util = np.where(kind == INFERENCE, rng.uniform(0.05, 0.6, n_jobs), TYPES.solo_util[types])
    share = np.zeros(n_jobs)
    gl: list = [None] * n_jobs
    for j in range(n_jobs):
        if rng.random() < 0.5:
            continue
        s = float(rng.choice(shares))
        room = ((gj < 0).any(axis=1)) & (100.0 - gs.sum(axis=1) >= s)
        g = pick_gang(rng.random(G), room, int(ngpu[j]), TOPO)
        if g is None:
            continue
        occupy(gj, gs, j, g, s)
        gl[j], share[j] = g, s
    running = np.array([j for j in range(n_jobs) if gl[j] is not None], np.int64)
    pending = np.array([j for j in range(n_jobs) if gl[j] is None], np.int64)
    jobs = JobTable(kind=kind, type_idx=types.astype(np.int64), num_gpus=ngpu.astype(np.int64),
                    arrival_s=np.arange(n_jobs, dtype=float), priority=np.ones(n_jobs),
                    attained_gpu_s=rng.uniform(0, 1e5, n_jobs), share_pct=share, solo_util=util,
                    load_forecast=np.where(kind == INFERENCE, util, np.nan), gpus=gl,
                    restarts=np.zeros(n_jobs, np.int64), queued_since_s=np.zeros(n_jobs),
                    remaining_est_s=np.where(kind == TRAINING, rng.uniform(60, 1e5, n_jobs), np.nan),
                    last_change_s=np.zeros(n_jobs), observed_norm=np.full(n_jobs, np.nan))
    for a in (gj, gs, pending, running, *(g for g in gl if g is not None),
              *(v for v in vars(jobs).values() if isinstance(v, np.ndarray))):
        a.setflags(write=False)  # read-only, as the front ends hand a view over: a policy writing into it fails
    return ClusterView(now_s=1e6, gpu_job=gj, gpu_share=gs, jobs=jobs, pending=pending, running=running,
                       types=TYPES, topology=TOPO)


@pytest.mark.parametrize("name", POLICY_NAMES)
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_every_policy_keeps_the_topology_and_leaves_the_view_unmodified(name, seed):
    view = random_view(seed, OWN_SHARES.get(name, (100.0,)))
    gpus = list(view.jobs.gpus)
    M = np.full((len(TYPES.names),) * 2, 0.8)
    d = make_policy(name, M, 0.8).decide(view)  # the view's arrays are read-only: a write raises
    assert all(a is b for a, b in zip(gpus, view.jobs.gpus, strict=True))
    assert check(d, view)[1] == []  # topology, capacity and every other rule of the decision contract
