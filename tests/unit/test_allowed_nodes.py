"""JobSpec.allowed_nodes: validation, wire conversion, and every policy placing a pinned job on its nodes only (the
view carries its allowed GPUs)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from elastico.domain import GpuSlice, JobState, Placement, Shape, StateReason, validate_job_spec
from elastico.errors import InvalidSpec
from elastico.rpc.convert import job_spec_from_pb, job_spec_to_pb
from elastico.state import codec
from services.allocator.estimate import TypeResolver, default_kappa, default_types, exclusive_matrix, rule_matrix
from services.allocator.plan import build_view, translate
from services.allocator.policy import POLICY_NAMES, make_policy
from tests.conftest import make_job, make_node, make_spec

NOW = 1_000_000.0
TYPES = default_types()
RESOLVE = TypeResolver(TYPES)
KAPPA = default_kappa(TYPES.gpu_type)
MATRIX = rule_matrix(TYPES, KAPPA)
HALF = Shape(num_gpus=1, compute_share_pct=50.0, mem_mib=8192)


def node(node_id: str, gpus: int = 2, used_share: dict[int, float] | None = None):
    n = replace(make_node(node_id, gpus=gpus), last_heartbeat_s=NOW)
    used = used_share or {}
    return replace(n, gpus=tuple(replace(g, allocated_share_pct=used.get(g.index, 0.0),
                                         allocated_mem_mib=int(16384 * used.get(g.index, 0.0) // 100)) for g in n.gpus))


def pinned(*nodes: str, shapes=(HALF,), **kw):
    return make_job(spec=make_spec(shapes=tuple(shapes), allowed_nodes=tuple(nodes), **kw))


def running_on(node_id: str, gpu: int, share: float):
    job = make_job(spec=make_spec(model_family="ResNet-18", batch_size=64))
    p = Placement(job.job_id, 0, Shape(1, share, int(16384 * share // 100)),
                  (GpuSlice(node_id, gpu, share, int(16384 * share // 100)),), epoch=1, committed_at_s=NOW - 5)
    return replace(job, state=JobState.RUNNING, reason=StateReason.STARTED, placement=p)


@pytest.mark.parametrize(("nodes", "field"), [
    (("n1", ""), "spec.allowed_nodes[1]"),
    (("  ",), "spec.allowed_nodes[0]"),
    (("n1", "a/b"), "spec.allowed_nodes[1]"),
    (("-n1",), "spec.allowed_nodes[0]"),
    (("n 1",), "spec.allowed_nodes[0]"),
], ids=["empty", "blank", "slash", "leading-dash", "space"])
def test_malformed_node_ids_are_invalid_and_named(nodes, field):
    with pytest.raises(InvalidSpec) as exc:
        validate_job_spec(make_spec(allowed_nodes=nodes))
    assert exc.value.field == field


def test_allowed_nodes_survive_the_wire_and_the_store_codec():
    spec = make_spec(allowed_nodes=("gpu-node-7", "unknown-node"))
    assert job_spec_from_pb(job_spec_to_pb(spec)) == spec
    assert codec.loads(type(spec), codec.dumps(spec)) == spec
    assert make_spec().allowed_nodes == ()


def decide(policy: str, view, matrix=MATRIX, **options):
    return make_policy(policy, matrix, KAPPA, **options).decide(view)


def test_pinned_jobs_are_offered_to_the_policy_with_their_nodes_gpus():
    free, pin = make_job(), pinned("n2")
    view, idx = build_view([free, pin], [node("n1"), node("n2")], TYPES, RESOLVE, NOW, 15)
    rows = {idx.jobs[int(r)].job_id: int(r) for r in view.pending}
    assert set(rows) == {free.job_id, pin.job_id}
    assert view.jobs.allowed_gpus[rows[free.job_id]] is None
    assert view.jobs.allowed_gpus[rows[pin.job_id]].tolist() == [False, False, True, True]
    assert build_view([free], [node("n1")], TYPES, RESOLVE, NOW, 15)[0].jobs.allowed_gpus is None


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_places_a_pinned_job_on_its_node_only_in_a_committable_placement(policy):
    pin = pinned("n2")
    view, idx = build_view([pin], [node("n1"), node("n2")], TYPES, RESOLVE, NOW, 15)
    plan = translate(decide(policy, view), view, idx)
    assert [j.job_id for j, _ in plan.place] == [pin.job_id] and not plan.dropped
    (slice_,) = plan.place[0][1].slices
    assert (slice_.node_id, slice_.compute_share_pct, slice_.mem_mib) == ("n2", 50.0, 8192)


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize(("nodes", "used"), [
    (("no-such-node",), {}),
    (("n2",), {0: 70.0, 1: 70.0}),
], ids=["unknown-node", "node-full"])
def test_pinned_job_stays_pending_when_its_nodes_cannot_take_it(policy, nodes, used):
    pin = pinned(*nodes)
    tenants = [running_on("n2", g, share) for g, share in used.items()]
    view, idx = build_view([pin, *tenants], [node("n1"), node("n2", used_share=used)], TYPES, RESOLVE, NOW, 15)
    plan = translate(decide(policy, view), view, idx)
    assert pin.job_id not in {j.job_id for j, _ in plan.place} and not plan.dropped


def test_pinned_job_shares_its_node_with_the_other_jobs_and_existing_tenants():
    tenant = running_on("n1", 0, 50.0)
    other, pin = make_job(spec=make_spec(shapes=(HALF,))), pinned("n1")
    view, idx = build_view([tenant, other, pin], [node("n1", gpus=2, used_share={0: 50.0}), node("n2", gpus=2)], TYPES,
                           RESOLVE, NOW, 15)
    plan = translate(decide("elastico", view, train_floor=0.1), view, idx)
    assert not plan.dropped
    where = {j.job_id: {(s.node_id, s.gpu_index) for s in p.slices} for j, p in plan.place}
    assert set(where) == {other.job_id, pin.job_id} and {n for n, _ in where[pin.job_id]} == {"n1"}


def test_without_an_estimate_pinned_jobs_only_take_empty_gpus():
    """The allocator's degraded mode (predictor down): the policy on whole GPUs with a matrix that forbids sharing."""
    tenant = running_on("n1", 0, 50.0)
    pin = pinned("n1")
    view, idx = build_view([tenant, pin], [node("n1", gpus=2, used_share={0: 50.0})], TYPES, RESOLVE, NOW, 15)
    plan = translate(decide("elastico", view, exclusive_matrix(TYPES), shares_pct=(100,), learn_observed=False), view, idx)
    assert [(s.node_id, s.gpu_index) for s in plan.place[0][1].slices] == [("n1", 1)]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_pinned_job_without_shapes_runs_on_its_node(policy):
    pin = make_job(spec=make_spec(allowed_nodes=("n2",)))
    view, idx = build_view([pin], [node("n1"), node("n2")], TYPES, RESOLVE, NOW, 15)
    plan = translate(decide(policy, view), view, idx)
    (p,) = [p for _, p in plan.place]
    assert {s.node_id for s in p.slices} == {"n2"} and not plan.dropped
    if policy.startswith("exclusive") or policy in ("tiresias", "lucid"):
        assert p.slices[0].compute_share_pct == 100.0
