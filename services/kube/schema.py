"""The shape of what the extender and the webhook read from a request body, checked before any handler runs.

kube-scheduler and the API server send well-formed objects; anything else that reaches these routes (a caller
with an allowed certificate and a broken client, or a hostile one) gets HTTP 400 naming the first field of the
wrong type, instead of a handler failing on it. Only the fields the handlers read are described (their JSON
types, ``null`` where Kubernetes may send it); everything else passes through unchecked. Validation is
jsonschema's (Draft 2020-12).
"""

from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match


def _t(*types: str) -> dict:
    return {"type": list(types)}


def _obj(**props: Any) -> dict:
    return {"type": ["object", "null"], "properties": props}


_STR = _t("string", "null")
_STR_MAP = {"type": ["object", "null"], "additionalProperties": {"type": "string"}}
_NAMED_LIST = {"type": ["array", "null"], "items": {"type": "object", "properties": {"name": _STR}}}
_CONTAINER = {"type": "object", "properties": {"name": _STR, "env": _NAMED_LIST, "volumeMounts": _NAMED_LIST,
                                               "resources": _obj(limits=_t("object", "null"), requests=_t("object", "null"))}}
POD = _obj(
    metadata=_obj(name=_STR, namespace=_STR, uid=_STR, generateName=_STR, labels=_STR_MAP, annotations=_STR_MAP,
                  ownerReferences={"type": ["array", "null"], "items": {"type": "object", "properties": {
                      "controller": _t("boolean", "null"), "kind": _STR, "name": _STR, "uid": _STR}}}),
    spec=_obj(nodeName=_STR, schedulerName=_STR, runtimeClassName=_STR, volumes=_NAMED_LIST,
              containers={"type": ["array", "null"], "items": _CONTAINER}),
    status=_obj(phase=_STR, conditions={"type": ["array", "null"], "items": {"type": "object"}}),
)
EXTENDER_ARGS = {"type": "object", "properties": {
    "Pod": POD,
    "NodeNames": {"type": ["array", "null"], "items": {"type": "string"}},
    "Nodes": _obj(items={"type": ["array", "null"], "items": {"type": "object", "properties": {"metadata": _obj(name=_STR)}}}),
}}
BINDING_ARGS = {"type": "object", "properties": {k: _STR for k in ("PodName", "PodNamespace", "PodUID", "Node")}}
ADMISSION_REVIEW = {"type": "object", "properties": {
    "kind": _STR, "apiVersion": _STR,
    "request": _obj(uid={"type": "string"}, operation=_STR, namespace=_STR, name=_STR, kind=_obj(kind=_STR),
                    object=POD),
}}

_VALIDATORS = {name: Draft202012Validator(s) for name, s in
               (("filter", EXTENDER_ARGS), ("prioritize", EXTENDER_ARGS), ("bind", BINDING_ARGS),
                ("mutate", ADMISSION_REVIEW))}


def check(route: str, body: Any) -> None:
    """Raise ValueError naming the first field of ``body`` of the wrong JSON type for ``route``."""
    error = best_match(_VALIDATORS[route].iter_errors(body))
    if error is not None:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path) or "(body)"
        want = error.validator_value if error.validator == "type" else error.message
        raise ValueError(f"{where.lstrip('.')}: must be {' or '.join(want) if isinstance(want, list) else want}")
