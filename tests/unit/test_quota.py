"""Per-tenant service quotas: parsing and which queued services wait (services/allocator/quota.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from elastico.domain import JobKind, JobState, Shape
from elastico.errors import ConfigError
from services.allocator.quota import held_by_quota, parse_quotas
from tests.conftest import make_job, make_spec


def test_quotas_parse_tenants_and_the_default():
    assert parse_quotas("") == {}
    assert parse_quotas(" team-a=16, team.b = 4 ,*=0,") == {"team-a": 16, "team.b": 4, "*": 0}


@pytest.mark.parametrize("text", ["team-a", "team-a=", "=3", "team a=3", "team-a=1.5", "team-a=-1", "team-a=inf",
                                  "team-a=2,team-a=3", "t\x1b=1", "team-a=10000001"])
def test_a_malformed_quota_is_refused_naming_the_variable(text):
    with pytest.raises(ConfigError, match="ELASTICO_SERVICE_QUOTA_GPUS"):
        parse_quotas(text)


def _service(i: int, tenant: str, state=JobState.PENDING, gpus: int = 1):
    shapes = (Shape(num_gpus=gpus, compute_share_pct=100.0, mem_mib=1024, throughput=10.0),)
    job = make_job(spec=make_spec(kind=JobKind.INFERENCE, tenant=tenant, shapes=shapes))
    return replace(job, job_id=f"s{i}", state=state, submitted_at_s=float(i))


def test_running_services_count_first_then_queued_ones_in_submission_order():
    jobs = [_service(5, "a"), _service(1, "a", JobState.RUNNING), _service(3, "a"), _service(4, "a", gpus=2),
            _service(2, "a", JobState.SUCCEEDED), _service(6, "b"), _service(7, "c"), make_job(spec=make_spec(tenant="a"))]
    held = held_by_quota(jobs, {"a": 3, "*": 0})
    # a: s1 runs (1 GPU); s3 fits (2), s4 needs 2 more (4 > 3) and waits, s5 still fits (3); b and c get 0 GPUs
    assert sorted(held) == ["s4", "s6", "s7"]
    assert held["s4"] == ("the services of tenant a take 2 of its 3 GPUs of service quota (ELASTICO_SERVICE_QUOTA_GPUS); "
                          "this one needs 2 more")
    assert held_by_quota(jobs, {"b": 0}) == {"s6": held["s6"]}  # tenants not named have no quota without *
    assert held_by_quota(jobs, {}) == {}


def test_running_services_past_a_lowered_quota_keep_running():
    jobs = [_service(1, "a", JobState.RUNNING), _service(2, "a", JobState.PLACED), _service(3, "a")]
    assert sorted(held_by_quota(jobs, {"a": 1})) == ["s3"]
