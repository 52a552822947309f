"""Baseline behaviour, table-driven."""

import numpy as np
import pytest

from services.allocator.policy import make_policy

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
