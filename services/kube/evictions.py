"""The eviction controller (in the extender process, next to its reaper): preemption and resize through Kubernetes.

The allocator never releases a pod job for preemption: it sets the job's reason ``EVICTION_REQUESTED`` and keeps
its slices booked. Each pass (``ELASTICO_EVICT_INTERVAL_S``) this controller

* POSTs the ``eviction`` subresource (policy/v1) of every such job's pod -- all the bound members of its gang
  when it is a gang member (a gang runs whole or not at all). 201: an Event ``ElastiCoPreempted`` on the pod;
  429 (a PodDisruptionBudget refuses now): an Event ``ElastiCoEvictionBlocked`` (at most once per pod per
  minute) and a retry next pass, the slices staying booked meanwhile (safe: nothing else uses them);
* frees gangs with a failed member: a bound member whose pod Failed while the others held their slices has the
  others evicted (``ElastiCoGangMemberFailed``).

The pod's owner recreates it; the new pod is a new job the policy places. The jobs release when their pods are
gone (the node agent reports the containers' end, or the reaper sees the pod deleted). A bare pod (no controller
ownerReference) is never evicted: the allocator never asks, and this controller refuses if asked.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from elastico.client import AllocatorError
from elastico.domain import GANG_LABEL, POD_LABEL, POD_UID_LABEL, Job, JobState, StateReason, label, pod_evictable
from elastico.errors import InvalidSpec
from elastico.logging import get_logger
from services.kube import annotations as a

if TYPE_CHECKING:
    from services.kube.extender import Extender

log = get_logger(component="evictions")

PREEMPTED = "ElastiCoPreempted"
BLOCKED = "ElastiCoEvictionBlocked"
GANG_FAILED = "ElastiCoGangMemberFailed"
BLOCKED_EVENT_PERIOD_S = 60.0  # at most one ElastiCoEvictionBlocked Event per pod per minute


class EvictionController:
    """Evicts the pods of EVICTION_REQUESTED jobs and the rest of a gang whose member failed."""

    def __init__(self, ext: Extender) -> None:
        self.ext = ext
        self._blocked_at: dict[str, float] = {}  # pod uid -> when its last ElastiCoEvictionBlocked Event was recorded

    async def evict_once(self) -> dict[str, int]:
        """One pass. Returns {pod "<ns>/<name>": HTTP status of its eviction} for the evictions it POSTed."""
        holding = [j async for j in self.ext.allocator.list(states=(JobState.PLACED, JobState.RUNNING), page_size=1000)
                   if label(j.spec, POD_UID_LABEL)]
        wanted: dict[str, tuple[str, str, str]] = {}  # pod uid -> (ns/name, reason, message); first reason wins
        gangs: dict[str, list[Job]] = {}
        for j in holding:
            gang = label(j.spec, GANG_LABEL)
            if gang:
                gangs.setdefault(gang, []).append(j)
        for j in holding:
            if j.reason is not StateReason.EVICTION_REQUESTED:
                continue
            if not pod_evictable(j.spec):
                log.warning("eviction requested for a bare pod: refused (bare pods are never preempted)",
                            job_id=j.job_id, pod=label(j.spec, POD_LABEL))
                continue
            gang = label(j.spec, GANG_LABEL)
            why = f"ElastiCo preempted job {j.job_id}" + (f" ({j.message})" if j.message else "") + \
                "; its owner recreates the pod, which the policy places anew"
            wanted.setdefault(label(j.spec, POD_UID_LABEL), (label(j.spec, POD_LABEL), PREEMPTED, why))
            for m in gangs.get(gang, []) if gang else []:  # a gang runs whole or not at all
                wanted.setdefault(label(m.spec, POD_UID_LABEL), (
                    label(m.spec, POD_LABEL), PREEMPTED, f"ElastiCo preempted job {j.job_id} of gang {gang}: the gang "
                    "runs whole or not at all; its owner recreates the pods"))
        for gang, members in gangs.items():
            for uid, (ref, reason, why) in (await self._failed_gang(gang, members)).items():
                wanted.setdefault(uid, (ref, reason, why))
        out: dict[str, int] = {}
        for uid, (ref, reason, why) in wanted.items():
            status = await self._evict(uid, ref, reason, why)
            if status:
                out[ref] = status
        return out

    async def _failed_gang(self, gang: str, members: list[Job]) -> dict[str, tuple[str, str, str]]:
        """The other members of ``gang`` to evict when one of its bound pods Failed while they held their slices."""
        pods: list[dict[str, Any]] = []
        for j in members:  # which label names the gang: read it off a member pod
            ns, name = label(j.spec, POD_LABEL).split("/", 1)
            pod = await self.ext.kube.get_pod(ns, name)
            try:
                g = a.gang_of(pod) if pod is not None else None
            except InvalidSpec:
                g = None
            if g is not None and g.name == gang:
                pods = await self.ext.kube.list_pods(ns, g.selector)
                break
        failed = [p for p in pods if (p.get("status") or {}).get("phase") == "Failed" and (p.get("spec") or {}).get("nodeName")]
        if not failed:
            return {}
        since = min((j.placement.committed_at_s for j in members if j.placement is not None), default=0.0)
        culprit = ""
        for p in failed:
            job_id = ((p.get("metadata") or {}).get("annotations") or {}).get(a.JOB_ID, "")
            if not job_id:
                continue
            try:
                fj = await self.ext.allocator.get(job_id)
            except AllocatorError:  # retention expired: an old incarnation's pod
                continue
            # it failed while the others held their slices: its job was still active, or ended after they were placed
            if not fj.state.terminal or fj.updated_at_s >= since:
                culprit = a.pod_ref(p)[1]
                break
        if not culprit:
            return {}
        why = f"member pod {culprit} of gang {gang} failed: the gang is freed (its owner recreates the pods)"
        return {label(j.spec, POD_UID_LABEL): (label(j.spec, POD_LABEL), GANG_FAILED, why) for j in members
                if label(j.spec, POD_LABEL) != f"{gang.split('/', 1)[0]}/{culprit}" and pod_evictable(j.spec)}

    async def _evict(self, uid: str, ref: str, reason: str, why: str) -> int:
        """Evict one pod (unless it is gone, unbound or already going); 0 when nothing was POSTed."""
        ns, name = ref.split("/", 1)
        kube = self.ext.kube
        pod = await kube.get_pod(ns, name)
        if pod is None or a.pod_ref(pod)[2] != uid or a.going(pod) or a.finished(pod):
            return 0  # gone or going: the reaper / the node agent release its job
        if not a.owner(pod):
            log.warning("not evicting a bare pod", pod=ref)
            return 0
        status, message = await kube.evict(ns, name, uid)
        if status in (200, 201):
            self._blocked_at.pop(uid, None)
            log.info("pod evicted", pod=ref, reason=reason, why=why)
            await self._event(pod, reason, why, "Warning" if reason == GANG_FAILED else "Normal")
        elif status == 429:
            now = time.monotonic()
            if now - self._blocked_at.get(uid, -BLOCKED_EVENT_PERIOD_S) >= BLOCKED_EVENT_PERIOD_S:
                self._blocked_at[uid] = now
                await self._event(pod, BLOCKED, f"{why}; the eviction is refused for now ({message or 'a PodDisruptionBudget'}), "
                                                f"retried every pass; its GPU slice stays booked meanwhile", "Warning")
            log.info("eviction blocked", pod=ref, message=message)
        return status

    async def _event(self, pod: dict[str, Any], reason: str, message: str, type_: str) -> None:
        try:
            await self.ext.kube.create_event(pod, reason, message, type_)
        except Exception as exc:  # an Event is best effort: the eviction itself happened (or is retried)
            log.warning("event not recorded", pod=a.pod_ref(pod)[1], reason=reason, error=repr(exc))

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.ext.s.evict_interval_s)
            try:
                await self.evict_once()
            except Exception as exc:  # allocator or API server down: try again next period
                log.warning("eviction pass failed", error=repr(exc))
