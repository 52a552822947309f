"""The fake API server and kubelet of tests/kubefake.py behave as the real ones do for what ElastiCo uses: through
the official ``kubernetes`` client (list, watch from a resourceVersion, 410, Binding, Eviction with PDBs, events)
and real processes in a pod's cgroup with the downward-API environment."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from tests.kubefake import FakeKube, FakeKubelet, FakeReplicaSet, resolve_env


def pod(name: str, *, labels: dict | None = None, ann: dict | None = None, command: list[str] | None = None,
        restart: str = "Never") -> dict:
    return {"metadata": {"name": name, "namespace": "ns1", "labels": labels or {"app": "x"}, "annotations": ann or {}},
            "spec": {"restartPolicy": restart, "terminationGracePeriodSeconds": 1, "containers": [{
                "name": "main", "image": "img", "command": command or ["python", "-c", "import time; time.sleep(60)"],
                "env": [{"name": "PLAIN", "value": "1"},
                        {"name": "SHARE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['elastico.io/x']"}}},
                        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]}]}}


def api(url: str) -> client.CoreV1Api:
    cfg = client.Configuration()
    cfg.host = url
    return client.CoreV1Api(client.ApiClient(cfg))


async def test_list_watch_resume_and_expiry():
    kube = FakeKube()
    url = await kube.start()
    try:
        core = api(url)
        await kube.create_pod(pod("a"))
        listed = await asyncio.to_thread(lambda: core.list_pod_for_all_namespaces(field_selector="metadata.name=a"))
        assert [p.metadata.name for p in listed.items] == ["a"]
        rv = listed.metadata.resource_version
        await kube.create_pod(pod("b", labels={"app": "y"}))
        await kube.update("ns1", "a", lambda p: p["metadata"]["annotations"].update({"k": "v"}))

        def events(selector: str, since: str) -> list[tuple[str, str]]:
            w = watch.Watch()
            return [(e["type"], e["object"].metadata.name)
                    for e in w.stream(core.list_namespaced_pod, "ns1", label_selector=selector, resource_version=since,
                                      timeout_seconds=1)]
        assert await asyncio.to_thread(events, "app=x", rv) == [("MODIFIED", "a")]
        assert await asyncio.to_thread(events, "app in (x,y)", rv) == [("ADDED", "b"), ("MODIFIED", "a")]
        kube.compact()

        def expired() -> int:
            w = watch.Watch()
            try:
                list(w.stream(core.list_namespaced_pod, "ns1", resource_version=rv, timeout_seconds=1))
            except ApiException as exc:
                return exc.status
            return 0
        assert await asyncio.to_thread(expired) == 410
    finally:
        await kube.stop()


async def test_binding_eviction_budget_and_events():
    kube = FakeKube()
    url = await kube.start()
    try:
        core = api(url)
        policy = client.PolicyV1Api(core.api_client)
        for n in ("a", "b"):
            await kube.create_pod(pod(n))
        body = client.V1Binding(metadata=client.V1ObjectMeta(name="a"), target=client.V1ObjectReference(kind="Node", name="n1"))
        await asyncio.to_thread(lambda: core.create_namespaced_pod_binding("a", "ns1", body, _preload_content=False))
        with pytest.raises(ApiException) as again:
            await asyncio.to_thread(lambda: core.create_namespaced_pod_binding("a", "ns1", body, _preload_content=False))
        assert again.value.status == 409 and "already assigned" in again.value.body
        for n in ("a", "b"):
            await kube.set_status("ns1", n, {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]})
        await asyncio.to_thread(lambda: policy.create_namespaced_pod_disruption_budget("ns1", client.V1PodDisruptionBudget(
            metadata=client.V1ObjectMeta(name="keep2"), spec=client.V1PodDisruptionBudgetSpec(
                min_available=2, selector=client.V1LabelSelector(match_labels={"app": "x"})))))
        evict = client.V1Eviction(metadata=client.V1ObjectMeta(name="a", namespace="ns1"))
        with pytest.raises(ApiException) as refused:
            await asyncio.to_thread(lambda: core.create_namespaced_pod_eviction("a", "ns1", evict))
        assert refused.value.status == 429 and "disruption budget" in refused.value.body
        kube.pdbs.clear()
        kube.add_pdb("ns1", "keep1", {"app": "x"}, max_unavailable="50%")
        await asyncio.to_thread(lambda: core.create_namespaced_pod_eviction("a", "ns1", evict))
        a = kube.pod("ns1", "a")
        assert a["metadata"]["deletionTimestamp"] and any(c["type"] == "DisruptionTarget" for c in a["status"]["conditions"])
        ev = client.CoreV1Event(metadata=client.V1ObjectMeta(generate_name="a."), reason="R", message="m", type="Normal",
                                involved_object=client.V1ObjectReference(kind="Pod", name="a", namespace="ns1"))
        await asyncio.to_thread(lambda: core.create_namespaced_event("ns1", ev))
        assert [e["reason"] for e in kube.events("ns1", pod="a")] == ["R"]
    finally:
        await kube.stop()


@pytest.mark.parametrize("cgroups", [True, False], ids=["cgroup-or-overlay", "overlay"])
async def test_kubelet_runs_real_processes_in_the_pods_cgroup(tmp_path, cgroups):
    kube = FakeKube()
    await kube.start()
    kubelet = FakeKubelet(kube, "n1", tmp_path, cgroups=cgroups)
    await kubelet.start()
    try:
        p = await kube.create_pod(pod("a", ann={"elastico.io/x": "40"}))
        uid = p["metadata"]["uid"]
        await kube.update("ns1", "a", lambda q: q["spec"].__setitem__("nodeName", "n1"))
        await kube.wait_for(lambda: (kube.pod("ns1", "a") or {}).get("status", {}).get("phase") == "Running")
        [pid] = kubelet.pids(uid)
        cgroup = open(f"{kubelet.proc_root}/{pid}/cgroup").read()
        assert f"pod{uid}" in cgroup
        environ = dict(kv.split("=", 1) for kv in open(f"{kubelet.proc_root}/{pid}/environ").read().split("\0") if "=" in kv)
        assert environ["SHARE"] == "40" and environ["NODE"] == "n1" and environ["PLAIN"] == "1"
        kubelet.oom_kill(uid)
        done = await kube.wait_for(lambda: (kube.pod("ns1", "a") or {}).get("status", {}).get("phase") == "Failed"
                                   and kube.pod("ns1", "a"))
        term = done["status"]["containerStatuses"][0]["state"]["terminated"]
        assert term["reason"] == "OOMKilled" and term["exitCode"] == 137
    finally:
        await kubelet.stop()
        await kube.stop()


async def test_graceful_deletion_and_replicaset_recreation(tmp_path):
    kube = FakeKube()
    await kube.start()
    kubelet = FakeKubelet(kube, "n1", tmp_path)
    await kubelet.start()
    rs = FakeReplicaSet(kube, "ns1", "web", pod("tmpl", restart="Always"))
    await rs.start()
    try:
        [first] = rs.owned()
        name = first["metadata"]["name"]
        assert resolve_env(first, first["spec"]["containers"][0])["SHARE"] == ""
        await kube.update("ns1", name, lambda q: q["spec"].__setitem__("nodeName", "n1"))
        await kube.wait_for(lambda: kubelet.pids(first["metadata"]["uid"]))
        await kube.delete("ns1", name)
        assert kube.pod("ns1", name)["metadata"]["deletionTimestamp"]  # still there while its containers stop
        await kube.wait_for(lambda: kube.pod("ns1", name) is None)
        assert not kubelet.pids(first["metadata"]["uid"])
        await kube.wait_for(lambda: len(rs.owned()) == 1 and rs.owned()[0]["metadata"]["name"] != name)
        assert len(rs.created) == 2 and str(uuid.UUID(rs.owned()[0]["metadata"]["uid"]))
    finally:
        await rs.stop()
        await kubelet.stop()
        await kube.stop()
