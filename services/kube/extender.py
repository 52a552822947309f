"""Scheduler extender (``k8s.io/kube-scheduler/extender/v1``): filter, prioritize and bind over HTTP JSON.

The extender's Go structs have no JSON tags, so the keys are the Go field names: ``ExtenderArgs`` {``Pod``,
``Nodes``, ``NodeNames``}, ``ExtenderFilterResult`` {``Nodes``, ``NodeNames``, ``FailedNodes``,
``FailedAndUnresolvableNodes``, ``Error``}, ``HostPriorityList`` [{``Host``, ``Score``}],
``ExtenderBindingArgs`` {``PodName``, ``PodNamespace``, ``PodUID``, ``Node``}, ``ExtenderBindingResult`` {``Error``}.

Design (docs/kubernetes.md): kube-scheduler picks the node, the allocator picks the GPU slice on it.

* **filter** keeps the candidate nodes whose ElastiCo agent is ready and has the pod's gang of GPUs with the share
  and memory free (``Allocator.GetClusterState``);
* **prioritize** scores them with the predictor (``Predictor.PredictInterference`` of the pod against each GPU's
  tenants, from ``Allocator.ListJobs``) and packing;
* **bind** submits the pod as an allocator job pinned to the chosen node (``JobSpec.allowed_nodes``, request id
  from the pod UID and the node: a retried bind finds the same job; no command: the pod's containers are the
  workload) with the pod's shape family (the policy picks the share), waits up to ``ELASTICO_BIND_TIMEOUT_S`` for
  a scheduling round to commit its slice through the allocator's atomic Redis path, records the slice and its MPS
  limits on the pod (annotations, *before* the Binding so the kubelet resolves them at container start), then
  creates the Binding. A gang member's bind goes through the gang barrier (:mod:`services.kube.gangs`).

Safe answers: a pod that did not opt in is passed through (filter keeps every node, prioritize scores 0, bind
only binds). For an opted-in pod, an unreachable or slow allocator makes filter answer ``Error`` (fail closed:
kube-scheduler retries the pod later; it is never placed without a slice); malformed annotations make every node
"failed and unresolvable" with the annotation named; prioritize without the predictor scores by packing only;
a bind whose slice is not committed in time cancels the job (no slice leaks) and answers ``Error``, so
kube-scheduler retries. A reaper cancels the jobs of pods that were deleted, finished, never bound, or bound with
another job's slice; the eviction controller (:mod:`services.kube.evictions`) evicts the pods the policy preempted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import grpc

from elastico.client import AllocatorError, AsyncAllocatorClient
from elastico.domain import POD_LABEL, POD_UID_LABEL, Job, JobKind, JobState, Placement, label
from elastico.errors import InvalidSpec
from elastico.logging import get_logger
from elastico.v1 import predictor_pb2, types_pb2
from services.kube import annotations as a
from services.kube import slices
from services.kube.settings import KubeSettings

log = get_logger(component="extender")

_ACTIVE = (JobState.PENDING, JobState.PLACED, JobState.RUNNING)
_HOLDING = (JobState.PLACED, JobState.RUNNING)
_KIND_PB = {JobKind.TRAINING: types_pb2.JOB_KIND_TRAINING, JobKind.INFERENCE: types_pb2.JOB_KIND_INFERENCE}


def state_name(state: JobState) -> str:
    """The proto name of a state ("JOB_STATE_CANCELLED"), as bind errors have always quoted it."""
    return f"JOB_STATE_{state.name}"


class BindFailed(Exception):
    """Bind could not obtain or record a slice; the message is the ``Error`` kube-scheduler logs."""


def candidate_names(args: Mapping[str, Any]) -> list[str]:
    """Node names of ExtenderArgs: ``NodeNames`` (nodeCacheCapable extenders) or ``Nodes.items[].metadata.name``."""
    if args.get("NodeNames") is not None:
        return [str(n) for n in args["NodeNames"]]
    return [str((n.get("metadata") or {}).get("name", "")) for n in ((args.get("Nodes") or {}).get("items") or [])]


def filter_result(args: Mapping[str, Any], keep: list[str], failed: Mapping[str, str] | None = None,
                  unresolvable: Mapping[str, str] | None = None, error: str = "") -> dict:
    """An ExtenderFilterResult in the same form as the request (names, or full Node objects)."""
    out: dict[str, Any] = {"FailedNodes": dict(failed or {}), "FailedAndUnresolvableNodes": dict(unresolvable or {}),
                           "Error": error}
    if args.get("NodeNames") is not None:
        out["NodeNames"] = keep
        out["Nodes"] = None
    else:
        wanted = set(keep)
        items = [n for n in ((args.get("Nodes") or {}).get("items") or []) if (n.get("metadata") or {}).get("name") in wanted]
        out["Nodes"] = {**{k: v for k, v in (args.get("Nodes") or {}).items() if k != "items"}, "items": items}
        out["NodeNames"] = None
    return out


class Extender:
    """The three verbs and the reaper, over the allocator client, the predictor stub and the Kubernetes API."""

    def __init__(self, settings: KubeSettings, allocator, predictor=None, kube=None) -> None:
        """``allocator``: an ``AsyncAllocatorClient`` (or an aio ``AllocatorStub``, wrapped in one that does not
        retry, each call within ``allocator_timeout_s``); ``predictor``: a PredictorStub or None."""
        self.s = settings
        self.allocator = allocator if isinstance(allocator, AsyncAllocatorClient) else \
            AsyncAllocatorClient.over(allocator, deadline_s=settings.allocator_timeout_s, retries=0)
        self.predictor = predictor
        self.kube = kube  # services.kube.kubeapi.KubeApi (or a test double with the same methods)
        self._finished_since: dict[str, float] = {}  # job id -> when the reaper first saw its pod finished (monotonic)

    # ------------------------------------------------------------------------------------------- filter
    async def filter(self, args: Mapping[str, Any]) -> dict:
        pod = args.get("Pod") or {}
        names = candidate_names(args)
        if not a.opted_in(pod):
            return filter_result(args, names)
        try:
            req = a.pod_request(pod)
        except InvalidSpec as exc:
            return filter_result(args, [], unresolvable={n: f"elastico: {exc.message}" for n in names})
        try:
            state = await self.allocator.cluster_state()
        except AllocatorError as exc:
            log.warning("filter: allocator unavailable, failing closed", pod=req.spec.name, code=exc.code.name)
            return filter_result(args, [], error=f"elastico: allocator unavailable ({exc.code.name}: {exc.message}); "
                                                 f"pods with {a.OPT_IN_LABEL}=true wait until it answers")
        nodes = {n.node_id: n for n in state.nodes}
        ok, failed = slices.feasible(nodes, req.shape, names)
        return filter_result(args, [n for n in names if n in ok], failed)

    # --------------------------------------------------------------------------------------- prioritize
    async def prioritize(self, args: Mapping[str, Any]) -> list[dict]:
        pod = args.get("Pod") or {}
        names = candidate_names(args)
        zero = [{"Host": n, "Score": 0} for n in names]
        if not a.opted_in(pod):
            return zero
        try:
            req = a.pod_request(pod)
            state, tenants = await asyncio.gather(self.allocator.cluster_state(), self._tenants())
        except (InvalidSpec, AllocatorError) as exc:
            log.warning("prioritize: neutral scores", error=str(exc))
            return zero
        nodes = {n.node_id: n for n in state.nodes}
        ok, _ = slices.feasible(nodes, req.shape, names)
        pairs: list[tuple[tuple[str, int], slices.Tenant, str]] = []
        for node, gpus in ok.items():
            for g in gpus:
                for t in tenants.get((node, g.index), ()):
                    pairs.append(((node, g.index), t, g.gpu_type))
        norms = await self._predict(req, pairs)  # (node, gpu) -> (pod's worst, tenants' worst)
        out = []
        for n in names:
            if n not in ok:
                out.append({"Host": n, "Score": 0})
                continue
            scores = [slices.gpu_score(*norms.get((n, g.index), (1.0, 1.0)), g.allocated_share_pct, req.shape) for g in ok[n]]
            out.append({"Host": n, "Score": slices.node_score(scores, req.shape.num_gpus)})
        return out

    async def _tenants(self) -> dict[tuple[str, int], list[slices.Tenant]]:
        out: dict[tuple[str, int], list[slices.Tenant]] = {}
        async for j in self.allocator.list(states=_HOLDING, page_size=1000):
            for s in j.placement.slices if j.placement is not None else ():
                out.setdefault((s.node_id, s.gpu_index), []).append(
                    slices.Tenant(j.spec.model_family, j.spec.batch_size, _KIND_PB[j.spec.kind], s.compute_share_pct))
        return out

    async def _predict(self, req: a.PodRequest, pairs) -> dict[tuple[str, int], tuple[float, float]]:
        """Worst predicted normalised throughput of the pod and of the tenants per GPU; {} without the predictor."""
        if not pairs or self.predictor is None:
            return {}
        spec = req.spec
        kind = _KIND_PB[spec.kind]
        queries = [predictor_pb2.PairQuery(
            a=predictor_pb2.TaskProfile(model_family=spec.model_family, batch_size=spec.batch_size, precision=spec.precision,
                                        kind=kind, gpu_type=gtype, mps_share_pct=req.shape.compute_share_pct),
            b=predictor_pb2.TaskProfile(model_family=t.model_family, batch_size=t.batch_size, kind=t.kind, gpu_type=gtype,
                                        mps_share_pct=t.share_pct)) for _, t, gtype in pairs]
        try:
            resp = await self.predictor.PredictInterference(predictor_pb2.PredictInterferenceRequest(pairs=queries),
                                                            timeout=self.s.predictor_timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.warning("prioritize: predictor unavailable, scoring by packing only", code=exc.code().name)
            return {}
        out: dict[tuple[str, int], tuple[float, float]] = {}
        for (key, _, _), p in zip(pairs, resp.predictions, strict=True):
            pod_w, ten_w = out.get(key, (1.0, 1.0))
            out[key] = (min(pod_w, p.norm_tput_a), min(ten_w, p.norm_tput_b))
        return out

    # --------------------------------------------------------------------------------------------- bind
    async def bind(self, args: Mapping[str, Any]) -> dict:
        ns, name, uid, node = (str(args.get(k) or "") for k in ("PodNamespace", "PodName", "PodUID", "Node"))
        if not (ns and name and uid and node):
            return {"Error": "elastico: ExtenderBindingArgs needs PodName, PodNamespace, PodUID and Node"}
        try:
            pod = await self.kube.get_pod(ns, name)
            if pod is None or (pod.get("metadata") or {}).get("uid") != uid:
                return {"Error": f"elastico: pod {ns}/{name} with uid {uid} no longer exists"}
            if not a.opted_in(pod):
                await self.kube.bind(ns, name, uid, node)
                return {"Error": ""}
            bound = (pod.get("spec") or {}).get("nodeName")
            if bound:  # a retried bind, or a gang coordinator bound it
                return {"Error": "" if bound == node else f"elastico: pod {ns}/{name} is already bound to node {bound}"}
            req = a.pod_request(pod)
            if req.gang is not None:
                from services.kube.gangs import bind_member  # the barrier uses this class's placement helpers

                await bind_member(self, req, node)
                return {"Error": ""}
            placement = await self._place(req, node)
            try:
                await self.record_and_bind(req, placement)
            except Exception as exc:
                await self._cancel(placement.job_id, f"binding {ns}/{name} to {node} failed")
                raise BindFailed(f"elastico: binding {ns}/{name} to {node} failed ({exc}); its slice was released") from exc
            return {"Error": ""}
        except InvalidSpec as exc:
            return {"Error": f"elastico: {exc.message}"}
        except BindFailed as exc:
            log.warning("bind failed", pod=f"{ns}/{name}", node=node, error=str(exc))
            return {"Error": str(exc)}
        except AllocatorError as exc:
            return {"Error": f"elastico: allocator unavailable ({exc.code.name}: {exc.message})"}
        except Exception as exc:  # the Kubernetes API (get/bind of a pass-through pod), network
            log.warning("bind failed", pod=f"{ns}/{name}", node=node, error=repr(exc))
            return {"Error": f"elastico: bind of {ns}/{name} to {node} failed: {exc}"}

    async def record_and_bind(self, req: a.PodRequest, placement: Placement) -> None:
        """Write the slice annotations (MPS limits included), then POST the Binding; a 409 is success only when the
        pod is bound to the slice's node.

        Raises:
            BindFailed: the pod is bound elsewhere. Kubernetes API errors propagate.
        """
        node = placement.slices[0].node_id
        await self.kube.annotate(req.namespace, req.name, a.slice_annotations(placement))
        if not await self.kube.bind(req.namespace, req.name, req.uid, node):
            pod = await self.kube.get_pod(req.namespace, req.name)
            bound = (pod or {}).get("spec", {}).get("nodeName")
            if bound != node:
                raise BindFailed(f"elastico: pod {req.namespace}/{req.name} is bound to node {bound!r}, not {node}")
        log.info("pod bound", pod=f"{req.namespace}/{req.name}", node=node, job_id=placement.job_id,
                 gpus=[s.gpu_index for s in placement.slices], share_pct=placement.slices[0].compute_share_pct)

    def pinned_spec(self, req: a.PodRequest, node: str):
        """The pod's job pinned to ``node``, without a command (the pod's containers are the workload)."""
        return replace(req.spec, allowed_nodes=(node,), command="")

    async def _place(self, req: a.PodRequest, node: str) -> Placement:
        """Submit the pod's job pinned to ``node`` and wait for its committed slice; cancel it on timeout."""
        spec = self.pinned_spec(req, node)
        rid = f"{req.uid}.{node}"[:128]
        job = await self.allocator.submit(spec, request_id=rid)
        if job.state.terminal:  # an earlier attempt on this node was cancelled: a new job, a new key
            rid = f"{req.uid}.{node}.{time.time_ns()}"[:128]
            job = await self.allocator.submit(spec, request_id=rid)
        deadline = time.monotonic() + self.s.bind_timeout_s
        while True:
            p = await self.holding(job, node)
            if p is not None:
                return p
            if time.monotonic() >= deadline:
                await self._cancel(job.job_id, "bind timeout")
                why = job.reason.value
                raise BindFailed(f"elastico: no GPU slice on node {node} within {self.s.bind_timeout_s:g}s "
                                 f"(job {job.job_id} {why}{': ' + job.message if job.message else ''}); job cancelled, "
                                 f"kube-scheduler will retry")
            await asyncio.sleep(self.s.bind_poll_s)
            job = await self.allocator.get(job.job_id)

    async def holding(self, job: Job, node: str) -> Placement | None:
        """The job's committed placement on ``node``; None while it waits.

        Raises:
            BindFailed: it ended, or was placed off ``node`` (then it is cancelled).
        """
        if job.state in _HOLDING and job.placement is not None:
            p = job.placement
            if {s.node_id for s in p.slices} != {node}:  # cannot happen while the allocator honours allowed_nodes
                await self._cancel(job.job_id, "placed off the bound node")
                raise BindFailed(f"elastico: job {job.job_id} was placed off node {node}; cancelled")
            return p
        if job.state.terminal:
            raise BindFailed(f"elastico: job {job.job_id} ended ({state_name(job.state)}: {job.message})")
        return None

    async def _cancel(self, job_id: str, why: str) -> None:
        try:
            await self.allocator.cancel(job_id)
            log.info("pod job cancelled", job_id=job_id, why=why)
        except AllocatorError as exc:
            if exc.code is not grpc.StatusCode.FAILED_PRECONDITION:  # already finished: nothing held
                log.warning("cancel failed; the reaper retries", job_id=job_id, why=why, code=exc.code.name)

    # ------------------------------------------------------------------------------------------- reaper
    async def reap_once(self) -> list[str]:
        """Cancel active pod jobs whose pod is gone, finished for ``reap_finished_grace_s`` (its node agent reports
        the outcome first), (placed but) still unbound after twice the bind or gang timeout, or bound with another
        job's slice (a superseded gang coordination).

        Returns:
            the cancelled job ids.
        """
        cancelled: list[str] = []
        now, mono = time.time(), time.monotonic()
        unbound_grace_s = 2 * max(self.s.bind_timeout_s, self.s.gang_timeout_s)
        finished_since, self._finished_since = self._finished_since, {}
        async for j in self.allocator.list(states=_ACTIVE, page_size=1000):
            uid, ref = label(j.spec, POD_UID_LABEL), label(j.spec, POD_LABEL)
            if not uid or not ref or "/" not in ref:
                continue
            ns, name = ref.split("/", 1)
            pod = await self.kube.get_pod(ns, name)
            why = ""
            if pod is None or (pod.get("metadata") or {}).get("uid") != uid:
                why = "pod deleted"
            elif a.finished(pod):
                since = self._finished_since[j.job_id] = finished_since.get(j.job_id, mono)
                if mono - since >= self.s.reap_finished_grace_s:
                    why = f"pod {pod['status']['phase'].lower()} and no outcome reported"
            elif not (pod.get("spec") or {}).get("nodeName"):
                if now - int(j.submitted_at_s) > unbound_grace_s:
                    why = "pod never bound"
            elif ((pod.get("metadata") or {}).get("annotations") or {}).get(a.JOB_ID, j.job_id) != j.job_id:
                why = "pod bound with the slice of job " + pod["metadata"]["annotations"][a.JOB_ID]
            if why:
                await self._cancel(j.job_id, why)
                cancelled.append(j.job_id)
        return cancelled

    async def reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.s.reap_interval_s)
            try:
                await self.reap_once()
            except Exception as exc:  # allocator or API server down: try again next period
                log.warning("reaper pass failed", error=repr(exc))
