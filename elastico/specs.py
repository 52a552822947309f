"""Job specs from plain data (YAML/JSON documents, mappings): typed field by field, then validated exactly as the
allocator validates a submitted spec; every problem an :class:`~elastico.errors.InvalidSpec` naming its field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from elastico import domain as d
from elastico.errors import InvalidSpec
from elastico.limits import field_key
from elastico.rpc import convert
from elastico.v1 import types_pb2 as pb

_SPEC_FIELDS = {"name": str, "tenant": str, "priority": int, "kind": str, "model_family": str, "batch_size": int,
                "precision": str, "shapes": list, "training": dict, "inference": dict, "command": str,
                "labels": dict, "allowed_nodes": list}
_SHAPE_FIELDS = {"num_gpus": int, "compute_share_pct": float, "mem_mib": int, "batch_size": int, "gpu_type": str,
                 "throughput": float}
_TRAINING_FIELDS = {"total_steps": int, "max_slowdown": float}
_INFERENCE_FIELDS = {"demand_rps": float, "latency_slo_ms": float, "metrics": dict}
_METRICS_FIELDS = {"port": int, "path": str, "format": str, "scrape_interval_s": float, "model": str}
# the integer fields' wire ranges (int32 priority, uint32 counts, uint64 sizes): beyond them protobuf cannot carry it
_INT_RANGE = {"priority": (-2**31, 2**31 - 1), "mem_mib": (-2**63, 2**64 - 1), "total_steps": (-2**63, 2**64 - 1)}
_UINT32 = (-2**31, 2**32 - 1)


def _typed(value: Any, want: type, path: str) -> Any:
    """``value`` as ``want`` (ints for int fields, any real number for float fields); InvalidSpec naming ``path``."""
    if want is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidSpec(path, f"must be a number, got {type(value).__name__} {value!r}"[:120])
        return float(value)
    if want is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise InvalidSpec(path, f"must be an integer, got {type(value).__name__} {value!r}"[:120])
        return int(value)
    if not isinstance(value, want):
        names = {str: "a string", list: "a list", dict: "a mapping"}
        raise InvalidSpec(path, f"must be {names.get(want, want.__name__)}, got {type(value).__name__}")
    return value


def _fields(data: Any, schema: Mapping[str, type], path: str) -> dict[str, Any]:
    """The keys of mapping ``data`` checked against ``schema`` (unknown keys and wrong types name the field)."""
    if not isinstance(data, Mapping):
        raise InvalidSpec(path, f"must be a mapping of field names to values, got {type(data).__name__}")
    out = {}
    for key, value in data.items():
        if key not in schema:
            raise InvalidSpec(f"{path}.{key}", f"unknown field (expected one of {', '.join(schema)})")
        if value is not None:
            out[key] = v = _typed(value, schema[key], f"{path}.{key}")
            lo, hi = _INT_RANGE.get(key, _UINT32)
            if schema[key] is int and not lo <= v <= hi:
                raise InvalidSpec(f"{path}.{key}", f"must be in [{lo}, {hi}], got {v}")
    return out


def parse_kind(value: str, path: str) -> d.JobKind:
    """"training" / "TRAINING" / "JOB_KIND_TRAINING" -> ``JobKind.TRAINING`` (likewise inference)."""
    v = value.strip().lower().removeprefix("job_kind_")
    try:
        return d.JobKind(v)
    except ValueError:
        raise InvalidSpec(path, f"must be training or inference, got {value[:64]!r}") from None


def parse_state(value: str | d.JobState, path: str = "states") -> d.JobState:
    """"running" / "RUNNING" / "JOB_STATE_RUNNING" -> ``JobState.RUNNING``."""
    if isinstance(value, d.JobState):
        return value
    v = str(value).strip().lower().removeprefix("job_state_")
    try:
        return d.JobState(v)
    except ValueError:
        raise InvalidSpec(path, f"must be one of {', '.join(s.value for s in d.JobState)}, got {str(value)[:64]!r}") from None


def spec_from_dict(data: Any, path: str = "spec") -> d.JobSpec:
    """A ``JobSpec`` from a plain mapping with its proto field names (a YAML or JSON document), validated.

    Raises InvalidSpec naming the field as a dotted path under ``path`` (``spec.shapes[1].mem_mib``).
    """
    f = _fields(data, _SPEC_FIELDS, path)
    if "kind" not in f:
        raise InvalidSpec(f"{path}.kind", "is required (training or inference)")
    kind = parse_kind(f["kind"], f"{path}.kind")
    shapes = []
    for i, s in enumerate(f.get("shapes", [])):
        sf = _fields(s, _SHAPE_FIELDS, f"{path}.shapes[{i}]")
        for req in ("num_gpus", "compute_share_pct", "mem_mib"):
            if req not in sf:
                raise InvalidSpec(f"{path}.shapes[{i}].{req}", "is required")
        shapes.append(d.Shape(**sf))
    training = inference = None
    if "training" in f:
        tf = _fields(f["training"], _TRAINING_FIELDS, f"{path}.training")
        if "total_steps" not in tf:
            raise InvalidSpec(f"{path}.training.total_steps", "is required")
        training = d.TrainingWork(**tf)
    if "inference" in f:
        inf = _fields(f["inference"], _INFERENCE_FIELDS, f"{path}.inference")
        for req in ("demand_rps", "latency_slo_ms"):
            if req not in inf:
                raise InvalidSpec(f"{path}.inference.{req}", "is required")
        metrics = None
        if "metrics" in inf:
            metrics = d.MetricsEndpoint(**_fields(inf.pop("metrics"), _METRICS_FIELDS, f"{path}.inference.metrics"))
        inference = d.InferenceWork(inf["demand_rps"], inf["latency_slo_ms"], metrics)
    labels = []
    for k, v in f.get("labels", {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidSpec(f"{path}.labels{field_key(str(k))}", "keys and values must be strings")
        labels.append((k, v))
    nodes = []
    for i, n in enumerate(f.get("allowed_nodes", [])):
        nodes.append(_typed(n, str, f"{path}.allowed_nodes[{i}]"))
    spec = d.JobSpec(kind=kind, name=f.get("name", ""), tenant=f.get("tenant") or "default",
                     priority=f.get("priority", 0), model_family=f.get("model_family", ""),
                     batch_size=f.get("batch_size", 0), precision=f.get("precision") or "fp32", shapes=tuple(shapes),
                     training=training, inference=inference, command=f.get("command", ""), labels=tuple(sorted(labels)),
                     allowed_nodes=tuple(nodes))
    return checked_spec(spec, path)


def checked_spec(spec: d.JobSpec | pb.JobSpec | Mapping[str, Any], path: str = "spec") -> d.JobSpec:
    """Any accepted spec form validated exactly as the allocator validates it (counts, fields, serialized size)."""
    if isinstance(spec, Mapping):
        return spec_from_dict(spec, path)
    if isinstance(spec, d.JobSpec):
        d.validate_job_spec(spec, path)  # first: a negative size would not even convert to its unsigned proto field
        try:
            spec = convert.job_spec_to_pb(spec)
        except ValueError as exc:
            raise InvalidSpec(path, f"a field is out of its protobuf range ({exc})") from None
    return convert.job_spec_from_pb(spec, path)
