"""The few Kubernetes API calls the extender makes, through the official ``kubernetes`` client.

The client is synchronous (urllib3), so each call runs in a worker thread with a per-call timeout. Responses are
read raw (``_preload_content=False``): the Binding and Eviction subresources answer with a ``Status``, which the
generated models cannot deserialise. RBAC the calls need: pods get/list/patch, pods/binding create, pods/eviction
create, events create.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import time

from kubernetes import client
from kubernetes.client.rest import ApiException

from elastico.kubeclient import api_client
from services.kube.settings import KubeSettings

EVENT_SOURCE = "elastico-extender"  # source.component / reportingComponent of the Events the extender records


class KubeApi:
    """get/list pods, patch their annotations, create their Binding and Eviction, record Events on them."""

    def __init__(self, settings: KubeSettings) -> None:
        self._api = api_client(settings.kube_api_url)
        self.core = client.CoreV1Api(self._api)
        self.timeout_s = settings.kube_timeout_s

    async def get_pod(self, namespace: str, name: str) -> dict | None:
        """The pod as JSON, or None when it does not exist."""
        def call():
            try:
                r = self.core.read_namespaced_pod(name, namespace, _preload_content=False, _request_timeout=self.timeout_s)
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise
            return json.loads(r.data)
        return await asyncio.to_thread(call)

    async def list_pods(self, namespace: str, label_selector: str) -> list[dict]:
        """The pods of ``namespace`` matching ``label_selector`` (e.g. ``elastico.io/gang=g1``), as JSON."""
        def call():
            r = self.core.list_namespaced_pod(namespace, label_selector=label_selector, _preload_content=False,
                                              _request_timeout=self.timeout_s)
            return json.loads(r.data).get("items") or []
        return await asyncio.to_thread(call)

    async def annotate(self, namespace: str, name: str, annotations: dict[str, str | None]) -> None:
        """Merge-patch the pod's annotations (a None value removes that annotation)."""
        body = {"metadata": {"annotations": annotations}}
        await asyncio.to_thread(lambda: self.core.patch_namespaced_pod(
            name, namespace, body, _content_type="application/merge-patch+json", _preload_content=False,
            _request_timeout=self.timeout_s))

    async def bind(self, namespace: str, name: str, uid: str, node: str) -> bool:
        """POST the pod's ``binding`` subresource (what kube-scheduler's default binder does).

        Returns:
            True when this call bound it; False when the API server answered 409 (the pod is already bound:
            the caller checks to which node).
        """
        body = client.V1Binding(api_version="v1", kind="Binding",
                                metadata=client.V1ObjectMeta(name=name, namespace=namespace, uid=uid),
                                target=client.V1ObjectReference(api_version="v1", kind="Node", name=node))

        def call() -> bool:
            try:
                self.core.create_namespaced_pod_binding(name, namespace, body, _preload_content=False,
                                                        _request_timeout=self.timeout_s)
            except ApiException as exc:
                if exc.status == 409:
                    return False
                raise
            return True
        return await asyncio.to_thread(call)

    async def evict(self, namespace: str, name: str, uid: str) -> tuple[int, str]:
        """POST the pod's ``eviction`` subresource (policy/v1 Eviction, PodDisruptionBudgets apply).

        Returns:
            (HTTP status, message): 200/201 evicted; 429 a PodDisruptionBudget refuses it now; 404 the pod is gone;
            409 the pod with ``uid`` is no longer that name's pod. Other errors raise ``ApiException``.
        """
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace},
                "deleteOptions": {"preconditions": {"uid": uid}}}

        def call() -> tuple[int, str]:
            try:
                r = self.core.create_namespaced_pod_eviction(name, namespace, body, _preload_content=False,
                                                             _request_timeout=self.timeout_s)
            except ApiException as exc:
                if exc.status in (404, 409, 429):
                    return exc.status, _status_message(exc.body)
                raise
            return r.status, ""
        return await asyncio.to_thread(call)

    async def create_event(self, pod: dict, reason: str, message: str, type_: str = "Normal") -> None:
        """Record a core/v1 Event on ``pod`` (``kubectl describe pod`` shows it)."""
        meta = pod.get("metadata") or {}
        ns = meta.get("namespace") or "default"
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {"apiVersion": "v1", "kind": "Event",
                "metadata": {"name": f"{meta.get('name', 'pod')}.{time.time_ns():x}"[:253], "namespace": ns},
                "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": ns, "name": meta.get("name", ""),
                                   "uid": meta.get("uid", ""), "resourceVersion": meta.get("resourceVersion", "")},
                "reason": reason, "message": message[:1024], "type": type_,
                "source": {"component": EVENT_SOURCE}, "reportingComponent": EVENT_SOURCE,
                "firstTimestamp": now, "lastTimestamp": now, "count": 1}
        await asyncio.to_thread(lambda: self.core.create_namespaced_event(
            ns, body, _preload_content=False, _request_timeout=self.timeout_s))

    def close(self) -> None:
        self._api.close()


def _status_message(body: object) -> str:
    """The ``message`` of a metav1.Status error body ("" when it is none)."""
    try:
        return str(json.loads(body).get("message", "")) if body else ""  # type: ignore[arg-type]
    except (ValueError, AttributeError):
        return ""
