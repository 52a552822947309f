"""Mutating admission webhook (AdmissionReview ``admission.k8s.io/v1``) for pods that opt in to ElastiCo.

For an opted-in pod the answer is a base64 JSONPatch that:

* sets ``spec.schedulerName`` (``ELASTICO_SCHEDULER_NAME``; "" leaves it, for a cluster whose default scheduler
  has the extender registered) and ``spec.runtimeClassName`` when unset (``ELASTICO_RUNTIME_CLASS``);
* gives every container ``CUDA_MPS_PIPE_DIRECTORY`` and, through the downward API, ``NVIDIA_VISIBLE_DEVICES``,
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` from the annotations
  ``elastico.io/gpu-indices``, ``-mps-active-thread-pct``, ``-mps-pinned-mem-limit``: the slice the policy chose,
  which the extender's bind writes before the Binding, so the kubelet resolves them when it starts the containers;
* mounts the node's MPS pipe directory (hostPath) at the same path in every container.

A malformed opt-in annotation is rejected (``allowed: false``, HTTP-style code 400) with a message that starts
with the annotation's name. Pods that did not opt in, other kinds and other operations are allowed unchanged.
The pure half (:func:`review`) is separate from the HTTP handler so it is tested without a server.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Any

from elastico.errors import InvalidSpec
from services.kube import annotations as a
from services.kube.settings import KubeSettings

MPS_VOLUME = "elastico-mps-pipe"


def _env_patch(path: str, current: list[dict] | None, wanted: list[dict]) -> list[dict]:
    """Ops that make ``wanted`` (by name) present in the list at ``path``, replacing same-named entries."""
    if current is None:
        return [{"op": "add", "path": path, "value": wanted}]
    ops = []
    names = [e.get("name") for e in current]
    for item in wanted:
        if item["name"] in names:
            ops.append({"op": "replace", "path": f"{path}/{names.index(item['name'])}", "value": item})
        else:
            ops.append({"op": "add", "path": f"{path}/-", "value": item})
    return ops


def container_env(pipe_dir: str) -> list[dict]:
    """The env entries every container of an opted-in pod gets (the MPS pipe, and the slice via the downward API)."""
    env: list[dict] = [{"name": "CUDA_MPS_PIPE_DIRECTORY", "value": pipe_dir}]
    env += [{"name": var, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{key}']"}}}
            for var, key in a.DOWNWARD_ENV.items()]
    return env


def pod_patch(pod: Mapping[str, Any], settings: KubeSettings) -> list[dict]:
    """The JSONPatch (RFC 6902 ops) that prepares an opted-in pod for ElastiCo."""
    spec = pod.get("spec") or {}
    ops: list[dict] = []
    if settings.scheduler_name and spec.get("schedulerName") != settings.scheduler_name:
        ops.append({"op": "add", "path": "/spec/schedulerName", "value": settings.scheduler_name})
    if settings.runtime_class and not spec.get("runtimeClassName"):
        ops.append({"op": "add", "path": "/spec/runtimeClassName", "value": settings.runtime_class})
    volume = {"name": MPS_VOLUME, "hostPath": {"path": settings.mps_pipe_dir, "type": "Directory"}}
    volumes = spec.get("volumes")
    if volumes is None:
        ops.append({"op": "add", "path": "/spec/volumes", "value": [volume]})
    elif not any(v.get("name") == MPS_VOLUME for v in volumes):
        ops.append({"op": "add", "path": "/spec/volumes/-", "value": volume})
    env = container_env(settings.mps_pipe_dir)
    mount = {"name": MPS_VOLUME, "mountPath": settings.mps_pipe_dir}
    for i, c in enumerate(spec.get("containers") or []):
        ops += _env_patch(f"/spec/containers/{i}/env", c.get("env"), env)
        mounts = c.get("volumeMounts")
        if mounts is None:
            ops.append({"op": "add", "path": f"/spec/containers/{i}/volumeMounts", "value": [mount]})
        elif not any(m.get("name") == MPS_VOLUME for m in mounts):
            ops.append({"op": "add", "path": f"/spec/containers/{i}/volumeMounts/-", "value": mount})
    return ops


def check_unplaced(pod: Mapping[str, Any]) -> None:
    """An opted-in pod is created unplaced: the extender's bind chooses its node and writes its slice annotations
    (which the patched environment reads). A pod created with a node or with any of those annotations would get GPUs
    no allocator decision committed.

    Raises:
        InvalidSpec: naming the annotation, or ``spec.nodeName``.
    """
    ann = (pod.get("metadata") or {}).get("annotations") or {}
    for key in a.BIND_ANNOTATIONS:
        if key in ann:
            raise InvalidSpec(key, "is written by ElastiCo's scheduler extender at bind; a pod cannot be created "
                                   "with it")
    if (pod.get("spec") or {}).get("nodeName"):
        raise InvalidSpec("spec.nodeName", "must be unset: ElastiCo's scheduler extender places the pod on a node "
                                           "and a GPU slice together")


def review(body: Mapping[str, Any], settings: KubeSettings) -> dict:
    """Answer one AdmissionReview (the whole response object, same apiVersion/kind, the request's uid).

    Raises:
        ValueError: the body is not an AdmissionReview with a request (the HTTP handler answers 400).
    """
    request = body.get("request") if isinstance(body, Mapping) else None
    if body.get("kind") != "AdmissionReview" or not isinstance(request, Mapping) or "uid" not in request:
        raise ValueError("expected an admission.k8s.io/v1 AdmissionReview with request.uid")
    response: dict[str, Any] = {"uid": request["uid"], "allowed": True}
    out = {"apiVersion": body.get("apiVersion", "admission.k8s.io/v1"), "kind": "AdmissionReview", "response": response}
    kind = (request.get("kind") or {}).get("kind")
    pod = request.get("object")
    if kind != "Pod" or request.get("operation") != "CREATE" or not isinstance(pod, Mapping) or not a.opted_in(pod):
        return out
    pod = dict(pod)
    meta = dict(pod.get("metadata") or {})
    meta.setdefault("namespace", request.get("namespace") or "default")
    meta.setdefault("name", request.get("name") or meta.get("generateName") or "")
    pod["metadata"] = meta
    try:
        check_unplaced(pod)
        a.pod_request(pod)  # validation only: the shape is the policy's choice, made at bind
    except InvalidSpec as exc:
        response["allowed"] = False
        response["status"] = {"code": 400, "reason": "BadRequest",
                              "message": f"ElastiCo rejected the pod: {exc.message}"}
        return out
    response["patchType"] = "JSONPatch"
    response["patch"] = base64.b64encode(json.dumps(pod_patch(pod, settings)).encode()).decode()
    return out
