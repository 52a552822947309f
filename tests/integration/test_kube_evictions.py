"""The eviction controller (services/kube/evictions.py) against the fake API server (tests/kubefake.py) and the real
allocator with rounds: a pod job with reason EVICTION_REQUESTED (written through the store, fenced, as the rounds
write it) has its pod evicted with an Event, its owner's replacement is placed; a PodDisruptionBudget refusal is an
ElastiCoEvictionBlocked Event and a retry while the slice stays booked; a bare pod is never evicted; a gang whose
bound member Failed has its other members evicted."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from elastico.domain import POD_OWNER_LABEL, JobState, StateReason
from services.kube import annotations as a
from services.kube.evictions import BLOCKED, GANG_FAILED, PREEMPTED, EvictionController
from tests.integration import test_kube_gangs
from tests.integration.test_kube_gangs import GPU_NODES, NS, bind, member, pod_jobs
from tests.kubefake import FakeReplicaSet

kube_cluster = test_kube_gangs.kube_cluster  # the same allocator + fake API server + two extenders


def single(name: str = "", owned: bool = True) -> dict:
    p = member(name or "solo")
    del p["metadata"]["annotations"][a.GANG_SIZE]
    p["metadata"]["labels"] = {a.OPT_IN_LABEL: "true", "app": "trainer"}
    if not owned:
        del p["metadata"]["ownerReferences"]
    return p


async def request_eviction(c: dict, uid: str) -> None:
    """What a scheduling round writes for a pod job the policy preempted (one fenced update)."""
    job = (await pod_jobs(c["ext"][0]))[uid]
    job = await c["store"].get_job(job.job_id)
    await c["store"].update_job(job, replace(job, reason=StateReason.EVICTION_REQUESTED, message="preempted for job j-x"),
                                epoch=c["lease"].epoch)


async def running(fake, name: str) -> None:
    await fake.set_status(NS, name, {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]})


async def test_preempted_pod_is_evicted_with_an_event_and_its_replacement_placed(kube_cluster):
    c = kube_cluster
    fake, ext = c["fake"], c["ext"][0]
    template = single()
    del template["metadata"]["ownerReferences"]
    rs = FakeReplicaSet(fake, NS, "trainer", template, replicas=1)
    await rs.start()
    try:
        (first,) = rs.owned()
        assert await bind(ext, first, GPU_NODES[0]) == {"Error": ""}
        await running(fake, first["metadata"]["name"])
        await request_eviction(c, first["metadata"]["uid"])
        out = await EvictionController(ext).evict_once()
        assert out == {f"{NS}/{first['metadata']['name']}": 201}
        (ev,) = fake.events(NS, first["metadata"]["name"])
        assert ev["reason"] == PREEMPTED and ev["type"] == "Normal" and ev["source"]["component"] == "elastico-extender"
        assert ev["involvedObject"]["uid"] == first["metadata"]["uid"] and ev["count"] == 1
        assert "preempted for job j-x" in ev["message"] and ev["firstTimestamp"] and ev["lastTimestamp"]
        # the slice stays booked while the pod terminates; the pod being gone releases it (reaper)
        job = (await pod_jobs(ext))[first["metadata"]["uid"]]
        assert job.state in (JobState.PLACED, JobState.RUNNING)
        await fake.remove(NS, first["metadata"]["name"])
        assert await ext.reap_once() == [job.job_id]
        reaped = await c["store"].get_job(job.job_id)  # the reaper completes the policy's preemption
        assert (reaped.state, reaped.reason, reaped.message) == (JobState.CANCELLED, StateReason.PREEMPTED, "preempted for job j-x")
        # the owner's replacement is a new pod, a new job, placed by the policy
        await fake.wait_for(lambda: len(rs.owned()) == 1 and rs.owned()[0]["metadata"]["uid"] != first["metadata"]["uid"])
        (second,) = rs.owned()
        assert await bind(ext, second, GPU_NODES[1]) == {"Error": ""}
        assert (await pod_jobs(ext))[second["metadata"]["uid"]].state in (JobState.PLACED, JobState.RUNNING)
    finally:
        await rs.stop()


async def test_pdb_refusal_records_one_blocked_event_and_retries_with_the_slice_booked(kube_cluster):
    c = kube_cluster
    fake, ext = c["fake"], c["ext"][0]
    p = await fake.create_pod(single("guarded"))
    assert await bind(ext, p, GPU_NODES[0]) == {"Error": ""}
    await running(fake, "guarded")
    fake.add_pdb(NS, "keep-one", {"app": "trainer"}, min_available=1)
    await request_eviction(c, p["metadata"]["uid"])
    ctl = EvictionController(ext)
    assert await ctl.evict_once() == {f"{NS}/guarded": 429}
    assert await ctl.evict_once() == {f"{NS}/guarded": 429}  # retried every pass
    events = fake.events(NS, "guarded")
    assert [e["reason"] for e in events] == [BLOCKED] and events[0]["type"] == "Warning"  # once per minute at most
    job = (await pod_jobs(ext))[p["metadata"]["uid"]]
    assert job.state in (JobState.PLACED, JobState.RUNNING) and job.reason is StateReason.EVICTION_REQUESTED
    fake.pdbs.clear()  # the budget allows it now
    assert await ctl.evict_once() == {f"{NS}/guarded": 201}
    assert fake.pod(NS, "guarded")["metadata"].get("deletionTimestamp")


async def test_a_bare_pod_is_never_evicted(kube_cluster):
    c = kube_cluster
    fake, ext = c["fake"], c["ext"][0]
    p = await fake.create_pod(single("bare", owned=False))
    assert await bind(ext, p, GPU_NODES[0]) == {"Error": ""}
    job = (await pod_jobs(ext))[p["metadata"]["uid"]]
    assert POD_OWNER_LABEL not in dict(job.spec.labels)
    await request_eviction(c, p["metadata"]["uid"])
    assert await EvictionController(ext).evict_once() == {}
    assert fake.evictions == [] and fake.pod(NS, "bare") is not None


async def test_a_failed_gang_member_frees_the_gang(kube_cluster):
    c = kube_cluster
    fake, (e1, e2) = c["fake"], c["ext"]
    pods = [await fake.create_pod(member(f"g-{i}", gang="g", size=2)) for i in range(2)]
    answers = await asyncio.gather(*(bind((e1, e2)[i], p, GPU_NODES[i]) for i, p in enumerate(pods)))
    assert answers == [{"Error": ""}] * 2
    for p in pods:
        await running(fake, p["metadata"]["name"])
    ctl = EvictionController(e1)
    assert await ctl.evict_once() == {}  # a healthy gang is left alone
    await fake.set_status(NS, "g-0", {"phase": "Failed", "containerStatuses": [
        {"name": "main", "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}]})
    assert await ctl.evict_once() == {f"{NS}/g-1": 201}
    (ev,) = fake.events(NS, "g-1")
    assert ev["reason"] == GANG_FAILED and "member pod g-0 of gang team-a/g failed" in ev["message"]
    assert fake.pod(NS, "g-1")["metadata"].get("deletionTimestamp")
