"""Domain validation names the offending field; storage codec round-trips every domain type."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastico import limits as L
from elastico.domain import (
    GpuSlice,
    InferenceWork,
    Job,
    JobKind,
    JobState,
    NodeInfo,
    Placement,
    Shape,
    StateReason,
    TrainingWork,
    validate_job_spec,
    validate_request_id,
)
from elastico.errors import InvalidSpec
from elastico.limits import clip, field_key
from elastico.state import codec
from tests.conftest import make_node, make_spec

BAD_SPECS = [
    (make_spec(tenant=""), "spec.tenant"),
    (make_spec(tenant="a b"), "spec.tenant"),
    (make_spec(training=None), "spec.training"),
    (make_spec(training=TrainingWork(total_steps=0)), "spec.training.total_steps"),
    (make_spec(training=TrainingWork(total_steps=10, max_slowdown=0.5)), "spec.training.max_slowdown"),
    (make_spec(training=TrainingWork(total_steps=10, max_slowdown=math.nan)), "spec.training.max_slowdown"),
    (make_spec(inference=InferenceWork(1, 1)), "spec.inference"),
    (make_spec(JobKind.INFERENCE, inference=InferenceWork(demand_rps=math.nan, latency_slo_ms=10)), "spec.inference.demand_rps"),
    (make_spec(JobKind.INFERENCE, inference=InferenceWork(demand_rps=5, latency_slo_ms=-1)), "spec.inference.latency_slo_ms"),
    (make_spec(shapes=(Shape(0, 50, 100),)), "spec.shapes[0].num_gpus"),
    (make_spec(shapes=(Shape(1, 50, 100), Shape(1, 150, 100))), "spec.shapes[1].compute_share_pct"),
    (make_spec(shapes=(Shape(1, math.inf, 100),)), "spec.shapes[0].compute_share_pct"),
    (make_spec(shapes=(Shape(1, 50, 0),)), "spec.shapes[0].mem_mib"),
    (make_spec(shapes=(Shape(1, 50, 10, throughput=-1),)), "spec.shapes[0].throughput"),
    # rates and latencies beyond any real service (they overflowed the allocator's arithmetic)
    (make_spec(shapes=(Shape(1, 50, 10, throughput=1e-300),)), "spec.shapes[0].throughput"),
    (make_spec(shapes=(Shape(1, 50, 10, throughput=1e300),)), "spec.shapes[0].throughput"),
    (make_spec(JobKind.INFERENCE, inference=InferenceWork(demand_rps=1e300, latency_slo_ms=10)), "spec.inference.demand_rps"),
    (make_spec(JobKind.INFERENCE, inference=InferenceWork(demand_rps=1e-300, latency_slo_ms=10)), "spec.inference.demand_rps"),
    (make_spec(JobKind.INFERENCE, inference=InferenceWork(demand_rps=5, latency_slo_ms=1e-300)), "spec.inference.latency_slo_ms"),
    (make_spec(JobKind.INFERENCE, inference=InferenceWork(demand_rps=5, latency_slo_ms=1e300)), "spec.inference.latency_slo_ms"),
    (make_spec(model_family=""), "spec.model_family"),
    (make_spec(batch_size=-3), "spec.batch_size"),
    # beyond any real job (a hostile probe's values): a share no job runs at, typos of sizes and step counts
    (make_spec(shapes=(Shape(1, 1e-300, 10),)), "spec.shapes[0].compute_share_pct"),
    (make_spec(shapes=(Shape(1, 50, 10, batch_size=2**32 - 1),)), "spec.shapes[0].batch_size"),
    (make_spec(batch_size=2**32 - 1), "spec.batch_size"),
    (make_spec(shapes=(Shape(1, 50, 2**64 - 1),)), "spec.shapes[0].mem_mib"),
    (make_spec(shapes=(Shape(1, 50, (1 << 24) + 1),)), "spec.shapes[0].mem_mib"),
    (make_spec(training=TrainingWork(total_steps=2**64 - 1)), "spec.training.total_steps"),
    (make_spec(training=TrainingWork(total_steps=10, max_slowdown=1e308)), "spec.training.max_slowdown"),
    # control characters (terminal escapes) in text an operator reads
    (make_spec(name="\x1b[2J\x1b[31mPWNED\x1b]0;title\x07\rX"), "spec.name"),
    (make_spec(model_family="ResNet\x00"), "spec.model_family"),
    (make_spec(precision="fp\n32"), "spec.precision"),
    (make_spec(precision="fp64"), "spec.precision"),  # no precision the predictor knows
    (make_spec(command="/bin/echo\x1b[31m"), "spec.command"),
    # commands that could never start (the node agent splits them with shlex)
    (make_spec(command="   "), "spec.command"),
    (make_spec(command="/bin/echo 'unterminated"), "spec.command"),
    (make_spec(labels=(("k\x00", "v"),)), 'spec.labels["k\\u0000"]'),
    (make_spec(labels=(("k", "v\x1b"),)), 'spec.labels["k"]'),
    (make_spec(shapes=(Shape(1, 50, 10, gpu_type="\x00"),)), "spec.shapes[0].gpu_type"),
    (make_spec(allowed_nodes=("n\t1",)), "spec.allowed_nodes[0]"),
    (make_spec(tenant="bob\n"), "spec.tenant"),  # a regex "$" matches before a trailing newline: whole-string checks
    # size limits (elastico.limits)
    (make_spec(name="n" * (L.NAME_MAX_CHARS + 1)), "spec.name"),
    (make_spec(model_family="m" * (L.MODEL_FAMILY_MAX_CHARS + 1)), "spec.model_family"),
    (make_spec(precision="p" * (L.PRECISION_MAX_CHARS + 1)), "spec.precision"),
    (make_spec(command="c" * (L.COMMAND_MAX_CHARS + 1)), "spec.command"),
    (make_spec(labels=tuple((f"k{i:03d}", "v") for i in range(L.LABELS_MAX_COUNT + 1))), "spec.labels"),
    (make_spec(labels=(("team", "v" * (L.LABEL_VALUE_MAX_CHARS + 1)),)), 'spec.labels["team"]'),
    (make_spec(labels=(("k" * (L.LABEL_KEY_MAX_CHARS + 1), "v"),)), f'spec.labels["{"k" * 32}..."]'),
    (make_spec(shapes=(Shape(1, 50, 100),) * (L.SHAPES_PER_JOB_MAX + 1)), "spec.shapes"),
    (make_spec(shapes=(Shape(1, 50, 100, gpu_type="g" * (L.GPU_TYPE_MAX_CHARS + 1)),)), "spec.shapes[0].gpu_type"),
    (make_spec(allowed_nodes=tuple(f"n{i}" for i in range(L.ALLOWED_NODES_MAX_COUNT + 1))), "spec.allowed_nodes"),
    (make_spec(allowed_nodes=("n1", "n" * (L.NODE_ID_MAX_CHARS + 1))), "spec.allowed_nodes[1]"),
]


@pytest.mark.parametrize(("spec", "field"), BAD_SPECS, ids=[f"{i}-{f[:24]}" for i, (_, f) in enumerate(BAD_SPECS)])
def test_invalid_spec_names_field(spec, field):
    with pytest.raises(InvalidSpec) as exc:
        validate_job_spec(spec)
    assert exc.value.field == field
    assert len(str(exc.value)) <= 200  # never the offending value itself


def test_a_spec_at_every_limit_is_valid():
    validate_job_spec(make_spec(
        name="n" * L.NAME_MAX_CHARS, model_family="m" * L.MODEL_FAMILY_MAX_CHARS, precision="fp32".rjust(L.PRECISION_MAX_CHARS),
        command="c" * L.COMMAND_MAX_CHARS, labels=tuple((f"k{i:03d}", "v" * L.LABEL_VALUE_MAX_CHARS) for i in range(L.LABELS_MAX_COUNT)),
        shapes=(Shape(1, 50, 100, gpu_type="g" * L.GPU_TYPE_MAX_CHARS),) * L.SHAPES_PER_JOB_MAX,
        allowed_nodes=tuple("n" * L.NODE_ID_MAX_CHARS for _ in range(L.ALLOWED_NODES_MAX_COUNT))))
    validate_job_spec(make_spec(labels=(("k" * L.LABEL_KEY_MAX_CHARS, ""),)))


def test_clip_keeps_short_values_and_cuts_long_ones_with_their_length():
    assert clip("abc") == "abc" and clip("a" * 64) == "a" * 64
    assert clip("x" * 10_000) == "x" * 64 + "…(10000 chars)"
    assert clip("abcdef", 3) == "abc…(6 chars)" and clip(12345, 2) == "12…(5 chars)"


def test_field_key_is_short_printable_ascii():
    assert field_key("team") == '["team"]' and field_key('a"b') == '["a\\"b"]'
    for key in ("k" * 10_000, "é" * 400, "\x00\n" * 100, "🙂" * 50):
        sub = field_key(key)
        assert len(sub) <= 40 and sub.isascii() and sub.isprintable(), sub


def test_valid_specs_pass():
    validate_job_spec(make_spec())
    validate_job_spec(make_spec(JobKind.INFERENCE))
    validate_job_spec(make_spec(model_family="", shapes=(Shape(2, 50, 4096, throughput=3.0),)))


@pytest.mark.parametrize("rid", ["", "x" * 129, "x" * 10_000_000, "has space", "slash/no", "rqab\n"],
                         ids=["empty", "too-long", "huge", "space", "slash", "trailing-newline"])
def test_bad_request_ids(rid):
    with pytest.raises(InvalidSpec, match="request_id") as exc:
        validate_request_id(rid)
    assert len(str(exc.value)) <= 100


def test_terminal_states():
    assert {s for s in JobState if s.terminal} == {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}


shapes = st.builds(Shape, num_gpus=st.integers(1, 8), compute_share_pct=st.floats(1, 100), mem_mib=st.integers(1, 80_000),
                   batch_size=st.integers(0, 512), gpu_type=st.sampled_from(["", "v100", "k80"]),
                   throughput=st.one_of(st.just(0.0), st.floats(L.RATE_MIN, 1e4)))


@given(shape=shapes, state=st.sampled_from(list(JobState)), reason=st.sampled_from(list(StateReason)),
       steps=st.floats(0, 1e9), labels=st.dictionaries(st.text(min_size=1, max_size=5), st.text(max_size=5), max_size=3))
def test_job_codec_roundtrip(shape, state, reason, steps, labels):
    spec = make_spec(shapes=(shape,), labels=tuple(sorted(labels.items())))
    placement = Placement("j", 0, shape, (GpuSlice("n", 1, shape.compute_share_pct, shape.mem_mib),), epoch=3, committed_at_s=1.5)
    job = Job("j", "r", spec, state=state, reason=reason, placement=placement, progress_steps=steps, version=4)
    assert codec.loads(Job, codec.dumps(job)) == job
    assert codec.loads(Job, codec.dumps(replace(job, placement=None))).placement is None
    for value in (job, replace(job, placement=None)):  # the compiled encoder writes what a reflective walk writes
        assert codec.dumps(value) == json.dumps(_reflective(value), separators=(",", ":"), sort_keys=True)


def _reflective(value):
    """Reference encoding: walk the values with ``dataclasses.fields`` (what the codec must stay equal to)."""
    if dataclasses.is_dataclass(value):
        return {f.name: _reflective(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [_reflective(v) for v in value]
    return value


def test_workload_codec_matches_reflective_encoding_and_roundtrips():
    from elastico.domain import GpuCounters, Workload

    for w in (Workload("j", (0, 1), 50.0, 1024),
              Workload("j", (2,), 25.0, 512, status="failed", reason=StateReason.COTENANT_FAULT, exit_code=-9,
                       cotenants=("a", "b"), norm_throughput=0.5, counters=GpuCounters(sm_util_pct=3.0, mem_used_mib=1.0))):
        assert codec.dumps(w) == json.dumps(_reflective(w), separators=(",", ":"), sort_keys=True)
        assert codec.loads(Workload, codec.dumps(w)) == w


def test_node_codec_roundtrip():
    node: NodeInfo = make_node(gpus=3)
    assert codec.loads(NodeInfo, codec.dumps(node)) == node
    assert codec.dumps(node) == json.dumps(_reflective(node), separators=(",", ":"), sort_keys=True)
