"""The gang barrier: the member pods of one gang bind all together, or none (docs/kubernetes.md "Gangs").

A gang member is a pod with a gang name label and ``elastico.io/gang-size`` (:func:`annotations.gang_of`); each
member is its own allocator job pinned to its node (labels ``elastico.io/gang``, ``-gang-size``). The barrier
lives in the API server, so several extender replicas (and concurrent bind calls) agree without talking:

1. a member's bind *arrives*: it annotates its pod ``elastico.io/gang-node: <node>`` and a fresh
   ``elastico.io/gang-arrival`` token;
2. every waiting bind lists the gang's live pods (label selector); the one that sees all ``size`` members arrived
   *coordinates*: it submits every member's job (request id ``<pod uid>.<node>.<arrival>``: concurrent
   coordinators submit the same jobs), waits until each has a committed slice, then for each member re-reads
   the pod (an arrival that changed meanwhile aborts: a newer bind owns it), writes its slice annotations and
   POSTs its Binding (409 = another coordinator did; fine when it is bound to that node);
3. the other binds wait for their own pod to be bound.

Nothing is held on failure: a coordinator that times out (``ELASTICO_GANG_TIMEOUT_S``) or sees a job end cancels
the jobs of every member not yet bound and withdraws their (spent) arrivals, so binds still waiting arrive afresh
with new request ids; a bind that times out before all arrived withdraws its arrival. The answer is then
``Error`` and kube-scheduler retries. The reaper backs this up (jobs of never-bound pods, and of
pods bound with another job's slice).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, Any

from elastico.domain import Job, Placement
from elastico.errors import InvalidSpec
from elastico.logging import get_logger
from services.kube import annotations as a
from services.kube.extender import BindFailed

if TYPE_CHECKING:
    from services.kube.extender import Extender

log = get_logger(component="gangs")


def arrived(pod: dict[str, Any]) -> bool:
    """The member has arrived at the barrier (its bind annotated its node) or is bound already."""
    return bool(((pod.get("metadata") or {}).get("annotations") or {}).get(a.GANG_NODE)
                or (pod.get("spec") or {}).get("nodeName"))


def member_node(pod: dict[str, Any]) -> str:
    """The node a member is bound to, else the one its bind arrived with."""
    return (pod.get("spec") or {}).get("nodeName") or (pod["metadata"].get("annotations") or {}).get(a.GANG_NODE, "")


def request_id(pod: dict[str, Any]) -> str:
    """The member's job request id for its current arrival: the same for every coordinator that reads it."""
    _, _, uid = a.pod_ref(pod)
    arrival = (pod["metadata"].get("annotations") or {}).get(a.GANG_ARRIVAL, "")
    return f"{uid}.{member_node(pod)}.{arrival}"[:128]


async def live_members(ext: Extender, gang: a.Gang) -> list[dict[str, Any]]:
    """The gang's pods that count: not finished, not being deleted or evicted, carrying the same gang name."""
    ns = gang.name.split("/", 1)[0]
    out = []
    for p in await ext.kube.list_pods(ns, gang.selector):
        if a.finished(p) or a.going(p):
            continue
        try:
            g = a.gang_of(p)
        except InvalidSpec:
            continue
        if g is not None and g.name == gang.name:
            out.append(p)
    return out


async def bind_member(ext: Extender, req: a.PodRequest, node: str) -> None:
    """Bind one gang member to ``node`` through the barrier; returns once its pod is bound.

    Raises:
        BindFailed: the gang did not come together, or not every member got a slice, within the gang timeout.
        InvalidSpec: a member's annotations are malformed (the message names the member).
    """
    gang = req.gang
    assert gang is not None
    deadline = time.monotonic() + ext.s.gang_timeout_s
    token = uuid.uuid4().hex[:12]
    await ext.kube.annotate(req.namespace, req.name, {a.GANG_NODE: node, a.GANG_ARRIVAL: token})
    count = 0
    while True:
        members = await live_members(ext, gang)
        me = next((p for p in members if a.pod_ref(p)[2] == req.uid), None)
        if me is None:
            raise BindFailed(f"elastico: pod {req.namespace}/{req.name} of gang {gang.name} is gone or ending")
        bound = (me.get("spec") or {}).get("nodeName")
        if bound:
            if bound != node:
                raise BindFailed(f"elastico: gang {gang.name}: pod {req.name} was bound to node {bound}, not {node}")
            return
        mine = (me["metadata"].get("annotations") or {}).get(a.GANG_ARRIVAL)
        if mine != token:
            if mine:  # a newer bind of this pod arrived: it owns the pod now
                raise BindFailed(f"elastico: gang {gang.name}: a newer bind of pod {req.name} took over")
            token = uuid.uuid4().hex[:12]  # a failed coordination withdrew us while we wait: arrive again
            await ext.kube.annotate(req.namespace, req.name, {a.GANG_NODE: node, a.GANG_ARRIVAL: token})
            continue
        if len(members) > gang.size:
            raise BindFailed(f"elastico: gang {gang.name} has {len(members)} live member pods, more than its "
                             f"{a.GANG_SIZE} {gang.size}")
        ready = [p for p in members if arrived(p)]
        count = len(ready)
        if count == gang.size:
            await coordinate(ext, gang, ready, deadline)
            continue  # re-read: our own pod is bound now (or a newer arrival took it over)
        if time.monotonic() >= deadline:
            await _withdraw(ext, req, token)
            raise BindFailed(f"elastico: gang {gang.name}: {count} of {gang.size} member pods arrived within "
                             f"{ext.s.gang_timeout_s:g}s; nothing is held, kube-scheduler will retry")
        await asyncio.sleep(ext.s.bind_poll_s)


async def _withdraw(ext: Extender, req: a.PodRequest, token: str) -> None:
    """Remove our arrival unless a newer bind of the same pod replaced it."""
    pod = await ext.kube.get_pod(req.namespace, req.name)
    ann = ((pod or {}).get("metadata") or {}).get("annotations") or {}
    if pod is not None and ann.get(a.GANG_ARRIVAL) == token and not (pod.get("spec") or {}).get("nodeName"):
        await ext.kube.annotate(req.namespace, req.name, {a.GANG_NODE: None, a.GANG_ARRIVAL: None})


async def coordinate(ext: Extender, gang: a.Gang, members: list[dict[str, Any]], deadline: float) -> None:
    """Give every member a committed slice, then annotate and bind them all; on failure cancel what it submitted.

    Raises:
        BindFailed: a slice was not committed in time, or a member's job ended.
    """
    reqs: list[tuple[dict[str, Any], a.PodRequest]] = []
    for p in members:
        try:
            reqs.append((p, a.pod_request(p)))
        except InvalidSpec as exc:
            raise InvalidSpec(exc.field, f"gang {gang.name}: member pod {a.pod_ref(p)[1]}: {exc.message}") from None
    jobs: list[Job] = []
    for p, r in reqs:
        existing = (p["metadata"].get("annotations") or {}).get(a.JOB_ID) if (p.get("spec") or {}).get("nodeName") else ""
        if existing:  # bound earlier (a replacement member joins a running gang): its job stays as it is
            jobs.append(await ext.allocator.get(existing))
        else:
            jobs.append(await ext.allocator.submit(ext.pinned_spec(r, member_node(p)), request_id=request_id(p)))
    unbound = [j.job_id for (p, _), j in zip(reqs, jobs, strict=True) if not (p.get("spec") or {}).get("nodeName")]
    placements: list[Placement | None] = [None] * len(jobs)
    try:
        while True:
            for i, ((p, _), j) in enumerate(zip(reqs, jobs, strict=True)):
                if placements[i] is None:
                    placements[i] = await ext.holding(j, member_node(p))
            if all(pl is not None for pl in placements):
                break
            if time.monotonic() >= deadline:
                waiting = [r.name for (_, r), pl in zip(reqs, placements, strict=True) if pl is None]
                raise BindFailed(f"elastico: gang {gang.name}: no GPU slice for member(s) {', '.join(waiting)} within "
                                 f"{ext.s.gang_timeout_s:g}s; every member's job cancelled, kube-scheduler will retry")
            await asyncio.sleep(ext.s.bind_poll_s)
            jobs = [await ext.allocator.get(j.job_id) if pl is None else j for j, pl in zip(jobs, placements, strict=True)]
    except BindFailed as exc:
        for job_id in unbound:
            await ext._cancel(job_id, f"gang {gang.name} incomplete")
        for p, r in reqs:  # the arrivals those jobs belong to are spent: members still waiting arrive afresh
            if not (p.get("spec") or {}).get("nodeName"):
                await _withdraw(ext, r, (p["metadata"].get("annotations") or {}).get(a.GANG_ARRIVAL, ""))
        prefix = f"elastico: gang {gang.name}: "
        if str(exc).startswith(prefix):
            raise
        raise BindFailed(prefix + str(exc).removeprefix("elastico: ") + "; every member's job cancelled, kube-scheduler "
                         "will retry") from exc
    for (p, r), pl in zip(reqs, placements, strict=True):
        assert pl is not None
        now = await ext.kube.get_pod(r.namespace, r.name)
        if now is None or a.pod_ref(now)[2] != r.uid or (now.get("spec") or {}).get("nodeName"):
            continue  # gone (the reaper frees its job) or already bound (by another coordinator)
        if request_id(now) != request_id(p):  # the member arrived again meanwhile: that newer bind owns it
            await ext._cancel(pl.job_id, f"gang {gang.name}: member {r.name} arrived again")
            continue
        await ext.record_and_bind(r, pl)
    log.info("gang bound", gang=gang.name, members=len(reqs))
