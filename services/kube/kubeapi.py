"""The few Kubernetes API calls the extender makes, through the official ``kubernetes`` client.

The client is synchronous (urllib3), so each call runs in a worker thread with a per-call timeout. Responses are
read raw (``_preload_content=False``): the Binding subresource answers with a ``Status``, which the generated
``V1Binding`` model cannot deserialise.
"""

from __future__ import annotations

import asyncio
import json

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from services.kube.settings import KubeSettings


class KubeApi:
    """get pod, patch its annotations, create its Binding (RBAC: pods get/list/patch, pods/binding create)."""

    def __init__(self, settings: KubeSettings) -> None:
        cfg = client.Configuration()
        if settings.kube_api_url:
            cfg.host = settings.kube_api_url
        else:
            try:
                config.load_incluster_config(client_configuration=cfg)
            except config.ConfigException:
                config.load_kube_config(client_configuration=cfg)
        self._api = client.ApiClient(cfg)
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

    async def annotate(self, namespace: str, name: str, annotations: dict[str, str]) -> None:
        """Merge-patch the pod's annotations."""
        body = {"metadata": {"annotations": annotations}}
        await asyncio.to_thread(lambda: self.core.patch_namespaced_pod(
            name, namespace, body, _content_type="application/merge-patch+json", _preload_content=False,
            _request_timeout=self.timeout_s))

    async def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        """POST the pod's ``binding`` subresource: what kube-scheduler's default binder does."""
        body = client.V1Binding(api_version="v1", kind="Binding",
                                metadata=client.V1ObjectMeta(name=name, namespace=namespace, uid=uid),
                                target=client.V1ObjectReference(api_version="v1", kind="Node", name=node))
        await asyncio.to_thread(lambda: self.core.create_namespaced_pod_binding(
            name, namespace, body, _preload_content=False, _request_timeout=self.timeout_s))

    def close(self) -> None:
        self._api.close()
