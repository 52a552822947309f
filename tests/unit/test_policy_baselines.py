"""Baseline behaviour, table-driven."""

import dataclasses

import numpy as np
import pytest

from services.allocator.policy import make_policy
from services.allocator.policy.view import Topology

from ._policy_builders import rule_matrix, view


def placed_ids(d):
    return [p[0] for p in d.place]


@pytest.mark.parametrize("policy,expected", [
    ("exclusive-fifo", [0]),  # head (job 1, 4 GPUs) blocks job 2
    ("exclusive-backfill", [0, 2]),  # job 2 finishes before the head's reservation
    ("mps-equal-share", [0, 1, 2]),  # 2 replicas per GPU: everything fits
], ids=["fifo-blocks", "easy-backfills", "mps-replicas"])
def test_queue_disciplines(policy, expected):
    jobs = [{"type": 0, "n": 2, "remaining": 100}, {"type": 0, "n": 4, "remaining": 100},
            {"type": 0, "n": 1, "remaining": 50}, {"type": 0, "n": 1, "remaining": 1000}]
    v = view(jobs, gpus=4, placed={3: ([3], 100.0)})
    v2 = view(jobs[:3], gpus=4)
    d = make_policy(policy, rule_matrix(), 0.9).decide(v if policy == "exclusive-backfill" else v2)
    assert placed_ids(d) == expected


def test_backfill_refuses_a_job_that_would_delay_the_head():
    jobs = [{"type": 0, "n": 4, "remaining": 100}, {"type": 0, "n": 1, "remaining": 500},
            {"type": 0, "n": 1, "remaining": 50}]
    v = view(jobs, gpus=4, placed={2: ([0], 100.0)})
    d = make_policy("exclusive-backfill", rule_matrix(), 0.9).decide(v)
    assert placed_ids(d) == []  # job 1 (500 s) would end after the head's reservation at 50 s


def test_tiresias_preempts_job_in_lower_queue():
    jobs = [{"type": 0, "attained": 1e6}, {"type": 0, "attained": 0.0}]
    v = view(jobs, gpus=1, placed={0: ([0], 100.0)}, now=10.0)
    d = make_policy("tiresias", rule_matrix(), 0.9).decide(v)
    assert d.preempt == [0] and placed_ids(d) == [1]


def test_tiresias_keeps_running_job_in_same_queue():
    jobs = [{"type": 0, "attained": 10.0, "arrival": 0}, {"type": 0, "attained": 0.0, "arrival": 5}]
    v = view(jobs, gpus=1, placed={0: ([0], 100.0)}, now=10.0)
    d = make_policy("tiresias", rule_matrix(), 0.9).decide(v)
    assert d.preempt == [] and placed_ids(d) == []


def test_tiresias_never_displaces_a_running_job_for_one_of_the_same_queue():
    """Same queue, whichever arrived first: the running job keeps its GPU (no restart every round)."""
    jobs = [{"type": 0, "attained": 10.0, "arrival": 0}, {"type": 0, "attained": 10.0, "arrival": 0}]
    for running in (0, 1):
        v = view(jobs, gpus=1, placed={running: ([0], 100.0)}, now=10.0)
        d = make_policy("tiresias", rule_matrix(), 0.9).decide(v)
        assert d.preempt == [] and placed_ids(d) == []
    jobs[0]["arrival"] = -5  # the queued job arrived first
    d = make_policy("tiresias", rule_matrix(), 0.9).decide(view(jobs, gpus=1, placed={1: ([0], 100.0)}, now=10.0))
    assert d.preempt == [] and placed_ids(d) == []


def test_tiresias_preempts_only_for_a_gang_that_then_finds_a_node():
    """Nodes of 2 GPUs, two services and a low-queue job on three GPUs: the top-queue 2-GPU gang fits by count
    once the low-queue job is displaced, and displaces it only when that frees a whole node."""
    jobs = [{"kind": 1, "load": 0.3}, {"kind": 1, "load": 0.3}, {"type": 0, "attained": 1e6, "arrival": 0},
            {"type": 0, "n": 2, "attained": 0.0, "arrival": 5}]

    def decide(svc_gpus: tuple[int, int], low_gpu: int):
        v = view(jobs, gpus=4, placed={0: ([svc_gpus[0]], 100.0), 1: ([svc_gpus[1]], 100.0), 2: ([low_gpu], 100.0)},
                 now=10.0)
        return make_policy("tiresias", rule_matrix(), 0.9).decide(dataclasses.replace(v, topology=Topology.uniform(4, 2)))

    d = decide((0, 2), 1)  # displaced, it would leave GPUs 1 and 3 free: one per node
    assert d.preempt == [] and placed_ids(d) == []
    d = decide((0, 1), 2)  # displaced, it frees node {2, 3}
    assert d.preempt == [2] and placed_ids(d) == [3] and d.place[0][1].tolist() == [2, 3]


def test_inference_goes_first_in_exclusive_baselines():
    jobs = [{"type": 0, "arrival": 0}, {"kind": 1, "load": 0.3, "arrival": 5}]
    d = make_policy("exclusive-fifo", rule_matrix(), 0.9).decide(view(jobs, gpus=1))
    assert placed_ids(d) == [1]


def test_gang_needs_all_gpus_at_once():
    d = make_policy("exclusive-fifo", rule_matrix(), 0.9).decide(view([{"type": 0, "n": 3}], gpus=2))
    assert d.place == []


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="unknown"):
        make_policy("nope", np.zeros((4, 4)), 0.9)


@pytest.mark.parametrize("policy", ["exclusive-fifo", "exclusive-backfill", "tiresias", "mps-equal-share", "lucid"])
def test_declared_jobs_are_placed_in_a_declared_share(policy):
    """A job declaring its shapes gets one of its shares on one of its GPU counts -- never the policy's whole
    GPU or 50 % replica; a job without shapes keeps the policy's own share."""
    from elastico.domain import Shape

    from .test_policy_shapes import with_declared

    declared = {0: (Shape(1, 10.0, 1024),), 1: (Shape(1, 30.0, 3000), Shape(1, 100.0, 15000)),
                2: (Shape(2, 40.0, 5000), Shape(1, 60.0, 7000))}
    jobs = [{"type": 0, "remaining": 10.0 + i} for i in range(2)] + [{"type": 0, "n": 2, "remaining": 12.0},
                                                                        {"type": 0, "remaining": 13.0}]
    v = with_declared(view(jobs, gpus=5), declared)
    d = make_policy(policy, rule_matrix(), 0.9).decide(v)
    assert sorted(placed_ids(d)) == [0, 1, 2, 3]
    own = {"mps-equal-share": 50.0}.get(policy, 100.0)
    for j, g, share in d.place:
        if j in declared:
            assert (len(g), share) in {(s.num_gpus, s.compute_share_pct) for s in declared[j]}
        else:
            assert share == own
    # nearest the policy's own share from above, else the largest: whole-GPU policies -> largest, replicas -> >= 50 %
    want = {0: 10.0, 1: 100.0, 2: 40.0}
    assert {j: share for j, _, share in d.place if j in declared} == want


def test_mps_equal_share_puts_a_declared_share_where_it_fits():
    """A replica is free on both GPUs, but a 100 % declared job only fits the empty one (first fit would take
    GPU 0, next to a 50 % tenant)."""
    from elastico.domain import Shape

    from .test_policy_shapes import with_declared

    v = with_declared(view([{"type": 0}, {"type": 0}], gpus=2, placed={0: ([0], 50.0)}), {1: (Shape(1, 100.0, 16000),)})
    d = make_policy("mps-equal-share", rule_matrix(), 0.9).decide(v)
    assert [(j, list(g), s) for j, g, s in d.place] == [(1, [1], 100.0)]


def test_lucid_packs_declared_tenants_at_declared_shares_only():
    """Packing splits a GPU 50/50; declaring tenants take their declared shares nearest 50 % instead (the resident
    60 %, the newcomer 30 %), and only if both fit the GPU."""
    from elastico.domain import Shape

    from .test_policy_shapes import with_declared

    res, new = (Shape(1, 10.0, 1024), Shape(1, 60.0, 8000)), (Shape(1, 30.0, 3000),)
    jobs = [{"type": 0, "remaining": 1.0}, {"type": 0, "remaining": 5.0}]
    d = make_policy("lucid", rule_matrix(), 0.9).decide(with_declared(view(jobs, gpus=1, placed={0: ([0], 10.0)}),
                                                                      {0: res, 1: new}))
    assert [(j, s) for j, _, s in d.place] == [(1, 30.0)] and d.resize == [(0, 60.0)]
    too_big = (Shape(1, 50.0, 3000),)  # 60 % + 50 % > 100 %: no packing
    d = make_policy("lucid", rule_matrix(), 0.9).decide(with_declared(view(jobs, gpus=1, placed={0: ([0], 10.0)}),
                                                                      {0: res, 1: too_big}))
    assert d.place == [] and d.resize == []
