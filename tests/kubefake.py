"""A faithful in-memory Kubernetes API server, a kubelet that runs real processes, and a ReplicaSet controller.

``FakeKube`` serves (aiohttp) the part of the core/v1 and policy/v1 API that ElastiCo uses, in the wire format the
official ``kubernetes`` client speaks: pods list and watch (all namespaces or one; ``labelSelector``,
``fieldSelector``; ``watch=true`` from a ``resourceVersion``, ``timeoutSeconds``, an ERROR event with code 410
when the version is older than the kept history), create / get / merge-patch / graceful delete, the ``status``,
``binding`` (409 when already bound) and ``eviction`` subresources (PodDisruptionBudgets with ``minAvailable`` or
``maxUnavailable``, integer or percent; 429 when the budget refuses; the ``DisruptionTarget`` condition and a
graceful delete when it allows), events, PodDisruptionBudgets. Every write bumps one global resourceVersion.

``FakeKubelet`` plays a node's kubelet: each container of a pod bound to its node runs as a real process with the
environment a kubelet resolves (``resolve_env``: values and the downward API), in a cgroup named like a pod's --
a real one when this process may create cgroups, else an equivalent ``/proc`` overlay (``proc_root``) whose
``<pid>/cgroup`` names the pod's cgroup and whose other entries link to the real ``/proc/<pid>``. Exits set the
container statuses and the phase (``restartPolicy`` honoured); a graceful deletion stops the containers
(SIGTERM, SIGKILL after the grace period) and then removes the object.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import json
import math
import os
import re
import shutil
import signal
import sys
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from elastico.tasks import cancel_until_done, wait_event

FAKE_READY = True
HISTORY = 2000  # watch events kept; a watch from an older resourceVersion gets 410 Expired


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def cancel(task: asyncio.Task | None) -> None:
    """Cancel a background loop and wait until it has ended."""
    if task is not None:
        await cancel_until_done([task])


def status_body(code: int, reason: str, message: str, details: dict | None = None) -> dict:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success" if code < 300 else "Failure",
            "message": message, "reason": reason, "code": code}
    if details:
        body["details"] = details
    return body


def merge_patch(doc: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (strategic-merge patches of maps behave the same)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(doc) if isinstance(doc, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def dotted(obj: dict, path: str) -> str:
    cur: Any = obj
    for part in path.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    return "" if cur is None else str(cur)


def field_match(obj: dict, selector: str) -> bool:
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if dotted(obj, k.strip()) == v.strip():
                return False
        else:
            k, v = re.split(r"==?", term, maxsplit=1)
            if dotted(obj, k.strip()) != v.strip():
                return False
    return True


def label_match(labels: dict, selector: str) -> bool:
    """Equality (``=``, ``==``, ``!=``), existence (``k``, ``!k``) and set (``k in (a,b)``, ``notin``) terms."""
    terms = re.findall(r"[^,(]+(?:\([^)]*\))?", selector or "")
    for term in (t.strip() for t in terms):
        if not term:
            continue
        m = re.match(r"^(\S+)\s+(in|notin)\s+\((.*)\)$", term)
        if m:
            values = {v.strip() for v in m.group(3).split(",")}
            inside = labels.get(m.group(1)) in values
            if inside != (m.group(2) == "in"):
                return False
        elif "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = re.split(r"==?", term, maxsplit=1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def selector_matches(selector: dict, labels: dict) -> bool:
    """A LabelSelector object (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        k, op, values = e["key"], e["operator"], set(e.get("values") or [])
        ok = {"In": labels.get(k) in values, "NotIn": labels.get(k) not in values, "Exists": k in labels,
              "DoesNotExist": k not in labels}[op]
        if not ok:
            return False
    return True


def int_or_percent(value: Any, total: int) -> int:
    if isinstance(value, str) and value.endswith("%"):
        return math.ceil(int(value[:-1]) * total / 100)
    return int(value)


def ready(pod: dict) -> bool:
    return (pod.get("status") or {}).get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp") and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in (pod.get("status") or {}).get("conditions") or [])


class FakeKube:
    """The API server's state and HTTP front end. ``token``: when set, every request needs that bearer token."""

    def __init__(self, token: str = "") -> None:
        self.token = token
        self.rv = 1
        self.pods: dict[tuple[str, str], dict] = {}
        self.pdbs: dict[tuple[str, str], dict] = {}
        self.event_objs: list[dict] = []
        self.history: deque[tuple[int, str, dict]] = deque(maxlen=HISTORY)
        self.bindings: list[tuple[str, str, str]] = []  # (ns, name, node) of every accepted Binding
        self.evictions: list[tuple[str, str, int]] = []  # (ns, name, HTTP code) of every eviction request
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request
        self.changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self._closing = False
        self.url = ""

    # ------------------------------------------------------------------ Python-side API (tests, kubelet)
    async def start(self) -> str:
        app = web.Application(middlewares=[self._auth])
        r = app.router
        r.add_get("/api/v1/pods", self._list_pods)
        r.add_get("/api/v1/namespaces/{ns}/pods", self._list_pods)
        r.add_post("/api/v1/namespaces/{ns}/pods", self._create_pod)
        r.add_get("/api/v1/namespaces/{ns}/pods/{name}", self._get_pod)
        r.add_patch("/api/v1/namespaces/{ns}/pods/{name}", self._patch_pod)
        r.add_delete("/api/v1/namespaces/{ns}/pods/{name}", self._delete_pod)
        r.add_get("/api/v1/namespaces/{ns}/pods/{name}/status", self._get_pod)
        r.add_put("/api/v1/namespaces/{ns}/pods/{name}/status", self._put_status)
        r.add_patch("/api/v1/namespaces/{ns}/pods/{name}/status", self._patch_status)
        r.add_post("/api/v1/namespaces/{ns}/pods/{name}/binding", self._bind)
        r.add_post("/api/v1/namespaces/{ns}/bindings", self._bind)
        r.add_post("/api/v1/namespaces/{ns}/pods/{name}/eviction", self._evict)
        r.add_post("/api/v1/namespaces/{ns}/events", self._create_event)
        r.add_get("/api/v1/namespaces/{ns}/events", self._list_events)
        r.add_get("/api/v1/events", self._list_events)
        r.add_post("/apis/events.k8s.io/v1/namespaces/{ns}/events", self._create_event)
        r.add_post("/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets", self._create_pdb)
        r.add_get("/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets", self._list_pdbs)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        self._closing = True  # open watches end at once (the server waits for their handlers)
        async with self.changed:
            self.changed.notify_all()
        if self._runner is not None:
            await self._runner.cleanup()

    def pod(self, ns: str, name: str) -> dict | None:
        p = self.pods.get((ns, name))
        return copy.deepcopy(p) if p is not None else None

    def pod_by_uid(self, uid: str) -> dict | None:
        return next((copy.deepcopy(p) for p in self.pods.values() if p["metadata"]["uid"] == uid), None)

    async def create_pod(self, pod: dict) -> dict:
        meta = pod.setdefault("metadata", {})
        ns = meta.setdefault("namespace", "default")
        if not meta.get("name"):
            meta["name"] = meta.get("generateName", "pod-") + uuid.uuid4().hex[:5]
        if (ns, meta["name"]) in self.pods:
            raise KeyError(f"pods {meta['name']!r} already exists")
        meta["uid"] = meta.get("uid") or str(uuid.uuid4())
        meta.setdefault("creationTimestamp", now_iso())
        pod.setdefault("kind", "Pod")
        pod.setdefault("apiVersion", "v1")
        pod.setdefault("spec", {})
        pod.setdefault("status", {"phase": "Pending"})
        await self._write(pod, "ADDED")
        return copy.deepcopy(pod)

    async def update(self, ns: str, name: str, fn: Callable[[dict], None]) -> dict | None:
        """Apply ``fn`` to the stored pod (a MODIFIED event); None when it does not exist."""
        p = self.pods.get((ns, name))
        if p is None:
            return None
        p = copy.deepcopy(p)
        fn(p)
        await self._write(p, "MODIFIED")
        return copy.deepcopy(p)

    async def set_status(self, ns: str, name: str, status: dict) -> dict | None:
        return await self.update(ns, name, lambda p: p.__setitem__("status", merge_patch(p.get("status") or {}, status)))

    async def remove(self, ns: str, name: str) -> None:
        """The object goes (what the kubelet's final delete does once the containers stopped)."""
        p = self.pods.pop((ns, name), None)
        if p is not None:
            self.rv += 1
            p = copy.deepcopy(p)
            p["metadata"]["resourceVersion"] = str(self.rv)
            self.history.append((self.rv, "DELETED", p))
            async with self.changed:
                self.changed.notify_all()

    async def delete(self, ns: str, name: str, grace_s: int | None = None) -> dict | None:
        """Graceful deletion: deletionTimestamp set; an unbound or finished pod, or grace 0, goes at once."""
        p = self.pods.get((ns, name))
        if p is None:
            return None
        phase = (p.get("status") or {}).get("phase")
        if grace_s == 0 or not (p.get("spec") or {}).get("nodeName") or phase in ("Succeeded", "Failed"):
            await self.remove(ns, name)
            return p
        if p["metadata"].get("deletionTimestamp"):
            return p
        grace = grace_s if grace_s is not None else int((p.get("spec") or {}).get("terminationGracePeriodSeconds", 30))

        def mark(q: dict) -> None:
            q["metadata"]["deletionTimestamp"] = now_iso()
            q["metadata"]["deletionGracePeriodSeconds"] = grace
        return await self.update(ns, name, mark)

    def add_pdb(self, ns: str, name: str, match_labels: dict, min_available: int | str | None = None,
                max_unavailable: int | str | None = None) -> dict:
        spec: dict[str, Any] = {"selector": {"matchLabels": dict(match_labels)}}
        if min_available is not None:
            spec["minAvailable"] = min_available
        if max_unavailable is not None:
            spec["maxUnavailable"] = max_unavailable
        self.rv += 1
        pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
               "metadata": {"name": name, "namespace": ns, "uid": str(uuid.uuid4()), "resourceVersion": str(self.rv)},
               "spec": spec, "status": {}}
        self.pdbs[(ns, name)] = pdb
        return pdb

    def events(self, ns: str | None = None, pod: str | None = None) -> list[dict]:
        return [e for e in self.event_objs if (ns is None or e["metadata"]["namespace"] == ns)
                and (pod is None or (e.get("involvedObject") or e.get("regarding") or {}).get("name") == pod)]

    def compact(self) -> None:
        """Forget the watch history: a watch from any earlier version now gets 410 Expired."""
        self.history.clear()
        self.rv += 1

    async def wait_for(self, cond: Callable[[], Any], timeout_s: float = 10.0) -> Any:
        """Wait until ``cond()`` is truthy (re-checked at every write); returns its value."""
        async def loop() -> Any:
            async with self.changed:
                while not (v := cond()):
                    await self.changed.wait()
                return v
        async with asyncio.timeout(timeout_s):
            return await loop()

    # ------------------------------------------------------------------ internals
    async def _write(self, obj: dict, kind: str) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        m = obj["metadata"]
        self.pods[(m["namespace"], m["name"])] = obj
        self.history.append((self.rv, kind, copy.deepcopy(obj)))
        async with self.changed:
            self.changed.notify_all()

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        self.requests.append((request.method, request.path))
        if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(status_body(401, "Unauthorized", "Unauthorized"), status=401)
        return await handler(request)

    def _missing(self, name: str, kind: str = "pods") -> web.Response:
        return web.json_response(status_body(404, "NotFound", f'{kind} "{name}" not found',
                                             {"name": name, "kind": kind}), status=404)

    async def _list_pods(self, request: web.Request) -> web.StreamResponse:
        ns = request.match_info.get("ns")
        q = request.query
        lsel, fsel = q.get("labelSelector", ""), q.get("fieldSelector", "")

        def wanted(p: dict) -> bool:
            return ((ns is None or p["metadata"]["namespace"] == ns) and label_match(p["metadata"].get("labels") or {}, lsel)
                    and field_match(p, fsel))
        if q.get("watch") in ("true", "1", "True"):
            return await self._watch(request, wanted, int(q.get("resourceVersion") or 0), float(q.get("timeoutSeconds") or 60))
        items = [copy.deepcopy(p) for p in self.pods.values() if wanted(p)]
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.rv)},
                                  "items": items})

    async def _watch(self, request: web.Request, wanted: Callable[[dict], bool], since: int, timeout_s: float
                     ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        await resp.prepare(request)
        try:
            oldest = self.history[0][0] if self.history else self.rv + 1
            if since and since < oldest - 1:
                err = status_body(410, "Expired", f"too old resource version: {since} ({oldest - 1})")
                await resp.write((json.dumps({"type": "ERROR", "object": err}) + "\n").encode())
                return resp
            sent = since or self.rv
            deadline = asyncio.get_running_loop().time() + timeout_s
            while True:
                for rv, kind, obj in list(self.history):
                    if rv > sent:
                        sent = rv
                        if wanted(obj):
                            await resp.write((json.dumps({"type": kind, "object": obj}) + "\n").encode())
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0 or self._closing:
                    return resp
                async with self.changed:
                    if not any(rv > sent for rv, _, _ in self.history):
                        await wait_event(self.changed, left)
        except (ConnectionResetError, asyncio.CancelledError):
            return resp

    async def _create_pod(self, request: web.Request) -> web.Response:
        body = await request.json()
        body.setdefault("metadata", {})["namespace"] = request.match_info["ns"]
        try:
            return web.json_response(await self.create_pod(body), status=201)
        except KeyError as exc:
            return web.json_response(status_body(409, "AlreadyExists", str(exc)), status=409)

    async def _get_pod(self, request: web.Request) -> web.Response:
        p = self.pod(request.match_info["ns"], request.match_info["name"])
        return web.json_response(p) if p is not None else self._missing(request.match_info["name"])

    async def _patch_pod(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        if request.content_type == "application/json-patch+json":
            return web.json_response(status_body(415, "UnsupportedMediaType", "json-patch is not served here"), status=415)
        patch = await request.json()
        patch.pop("status", None)  # the main resource ignores status (the status subresource writes it)
        out = await self.update(ns, name, lambda p: p.update(merge_patch(p, patch)))
        return web.json_response(out) if out is not None else self._missing(name)

    async def _put_status(self, request: web.Request) -> web.Response:
        body = await request.json()
        out = await self.update(request.match_info["ns"], request.match_info["name"],
                                lambda p: p.__setitem__("status", body.get("status") or {}))
        return web.json_response(out) if out is not None else self._missing(request.match_info["name"])

    async def _patch_status(self, request: web.Request) -> web.Response:
        body = await request.json()
        out = await self.set_status(request.match_info["ns"], request.match_info["name"], body.get("status") or {})
        return web.json_response(out) if out is not None else self._missing(request.match_info["name"])

    async def _delete_pod(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        grace = request.query.get("gracePeriodSeconds")
        if request.can_read_body:
            with contextlib.suppress(json.JSONDecodeError):
                body = await request.json()
                if isinstance(body, dict) and body.get("gracePeriodSeconds") is not None:
                    grace = body["gracePeriodSeconds"]
        out = await self.delete(ns, name, int(grace) if grace is not None else None)
        return web.json_response(out) if out is not None else self._missing(name)

    async def _bind(self, request: web.Request) -> web.Response:
        ns = request.match_info["ns"]
        body = await request.json()
        meta = body.get("metadata") or {}
        name = request.match_info.get("name") or meta.get("name", "")
        node = (body.get("target") or {}).get("name", "")
        p = self.pods.get((ns, name))
        if p is None:
            return self._missing(name)
        if meta.get("uid") and meta["uid"] != p["metadata"]["uid"]:
            return web.json_response(status_body(409, "Conflict", f"Precondition failed: UID in precondition: "
                                                 f"{meta['uid']}, UID in object meta: {p['metadata']['uid']}"), status=409)
        if (p.get("spec") or {}).get("nodeName"):
            return web.json_response(status_body(409, "Conflict", f'Operation cannot be fulfilled on pods/binding '
                                                 f'"{name}": pod {name} is already assigned to node "{p["spec"]["nodeName"]}"'),
                                     status=409)
        if not node:
            return web.json_response(status_body(400, "BadRequest", "target.name is required"), status=400)

        def bind(q: dict) -> None:
            q["spec"]["nodeName"] = node
            conds = [c for c in q["status"].get("conditions") or [] if c.get("type") != "PodScheduled"]
            q["status"]["conditions"] = [*conds, {"type": "PodScheduled", "status": "True", "lastTransitionTime": now_iso()}]
        await self.update(ns, name, bind)
        self.bindings.append((ns, name, node))
        return web.json_response(status_body(201, "", ""), status=201)

    async def _evict(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        p = self.pods.get((ns, name))
        if p is None:
            self.evictions.append((ns, name, 404))
            return self._missing(name)
        if p["metadata"].get("deletionTimestamp"):
            self.evictions.append((ns, name, 200))
            return web.json_response(status_body(200, "", "pod is already being deleted"))
        phase = (p.get("status") or {}).get("phase")
        labels = p["metadata"].get("labels") or {}
        budgets = [b for (bns, _), b in self.pdbs.items() if bns == ns and selector_matches(b["spec"]["selector"], labels)]
        if len(budgets) > 1:
            self.evictions.append((ns, name, 500))
            return web.json_response(status_body(500, "InternalError", "This pod has more than one PodDisruptionBudget, "
                                                 "which the eviction subresource does not support."), status=500)
        if budgets and phase not in ("Pending", "Succeeded", "Failed"):
            b = budgets[0]
            members = [q for (qns, _), q in self.pods.items() if qns == ns
                       and selector_matches(b["spec"]["selector"], q["metadata"].get("labels") or {})
                       and (q.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
            healthy = sum(1 for q in members if ready(q))
            if "minAvailable" in b["spec"]:
                need = int_or_percent(b["spec"]["minAvailable"], len(members))
            else:
                need = len(members) - int_or_percent(b["spec"].get("maxUnavailable", 0), len(members))
            if healthy - need <= 0 and ready(p):
                self.evictions.append((ns, name, 429))
                return web.json_response(status_body(
                    429, "TooManyRequests", "Cannot evict pod as it would violate the pod's disruption budget.",
                    {"causes": [{"reason": "DisruptionBudget", "message": f"The disruption budget {b['metadata']['name']} "
                                 f"needs {need} healthy pods and has {healthy} currently"}]}), status=429)

        def target(q: dict) -> None:
            conds = [c for c in q["status"].get("conditions") or [] if c.get("type") != "DisruptionTarget"]
            q["status"]["conditions"] = [*conds, {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
                                                  "message": "Eviction API: evicting", "lastTransitionTime": now_iso()}]
        await self.update(ns, name, target)
        await self.delete(ns, name)
        self.evictions.append((ns, name, 201))
        return web.json_response(status_body(201, "", ""), status=201)

    async def _create_event(self, request: web.Request) -> web.Response:
        body = await request.json()
        meta = body.setdefault("metadata", {})
        meta["namespace"] = request.match_info["ns"]
        meta.setdefault("name", meta.get("generateName", "event.") + uuid.uuid4().hex[:8])
        self.rv += 1
        meta["resourceVersion"] = str(self.rv)
        meta.setdefault("uid", str(uuid.uuid4()))
        self.event_objs.append(body)
        async with self.changed:
            self.changed.notify_all()
        return web.json_response(body, status=201)

    async def _list_events(self, request: web.Request) -> web.Response:
        ns = request.match_info.get("ns")
        fsel = request.query.get("fieldSelector", "")
        items = [e for e in self.event_objs if (ns is None or e["metadata"]["namespace"] == ns) and field_match(e, fsel)]
        return web.json_response({"kind": "EventList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.rv)},
                                  "items": items})

    async def _create_pdb(self, request: web.Request) -> web.Response:
        body = await request.json()
        spec = body.get("spec") or {}
        pdb = self.add_pdb(request.match_info["ns"], body["metadata"]["name"], (spec.get("selector") or {}).get("matchLabels") or {},
                           spec.get("minAvailable"), spec.get("maxUnavailable"))
        return web.json_response(pdb, status=201)

    async def _list_pdbs(self, request: web.Request) -> web.Response:
        ns = request.match_info["ns"]
        return web.json_response({"kind": "PodDisruptionBudgetList", "apiVersion": "policy/v1",
                                  "metadata": {"resourceVersion": str(self.rv)},
                                  "items": [b for (bns, _), b in self.pdbs.items() if bns == ns]})


# ---------------------------------------------------------------------------------------------- kubelet

def resolve_env(pod: dict, container: dict) -> dict[str, str]:
    """A container's environment as a kubelet resolves it: ``value``, and ``valueFrom.fieldRef`` (downward API:
    metadata.name/namespace/uid, ``metadata.annotations['k']``, ``metadata.labels['k']``, spec.nodeName,
    status.podIP, ...); a missing annotation resolves to ""."""
    env: dict[str, str] = {}
    for e in container.get("env") or []:
        if "value" in e:
            env[e["name"]] = str(e["value"])
            continue
        ref = ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
        if ref is None:
            continue
        m = re.match(r"^metadata\.(annotations|labels)\['(.+)'\]$", ref)
        if m:
            env[e["name"]] = str((pod["metadata"].get(m.group(1)) or {}).get(m.group(2), ""))
        else:
            env[e["name"]] = dotted(pod, ref)
    return env


def _writable_cgroup_root() -> Path | None:
    """A cgroup hierarchy this process may create groups in and move processes into (root on cgroupfs), or None."""
    if os.geteuid() != 0:
        return None
    for root in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
        probe = root / f"elastico-probe-{uuid.uuid4().hex[:6]}"
        try:
            if not (root / "cgroup.procs").exists():
                continue
            probe.mkdir()
            probe.rmdir()
            return root
        except OSError:
            continue
    return None


class _Container:
    def __init__(self, name: str, cid: str) -> None:
        self.name, self.cid = name, cid
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self.oom = False
        self.exit_code: int | None = None


class FakeKubelet:
    """Runs the containers of the pods bound to ``node`` as real processes (see the module docstring).

    A container's ``command + args`` is its argv; a leading ``python`` is this interpreter. ``cgroups``: True uses
    real cgroups (when possible), False always the proc overlay."""

    def __init__(self, kube: FakeKube, node: str, workdir: Path, *, cgroups: bool = True, pod_ip: str = "127.0.0.1") -> None:
        self.kube, self.node, self.workdir = kube, node, Path(workdir)
        self.cg_root = _writable_cgroup_root() if cgroups else None
        self.overlay = self.workdir / "proc"
        self.proc_root = "/proc" if self.cg_root is not None else str(self.overlay)
        self.pod_ip = pod_ip
        self.running: dict[str, dict[str, _Container]] = {}  # pod uid -> container name -> container
        self._task: asyncio.Task | None = None
        self._cgroups: list[Path] = []
        self._stopping: set[str] = set()
        self._terminating: set[asyncio.Task] = set()  # held: the loop keeps only weak references to tasks

    async def start(self) -> None:
        self.overlay.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        await cancel(self._task)
        await cancel_until_done(self._terminating)
        for conts in self.running.values():
            for c in conts.values():
                if c.proc is not None and c.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        c.proc.kill()
                    await c.proc.wait()
        for cg in reversed(self._cgroups):
            with contextlib.suppress(OSError):
                cg.rmdir()

    def pids(self, uid: str) -> list[int]:
        return [c.proc.pid for c in self.running.get(uid, {}).values() if c.proc is not None and c.proc.returncode is None]

    def oom_kill(self, uid: str, container: str | None = None) -> None:
        """What the kernel's OOM killer does to a container: SIGKILL, and the kubelet reports ``OOMKilled``."""
        for c in self.running.get(uid, {}).values():
            if (container is None or c.name == container) and c.proc is not None and c.proc.returncode is None:
                c.oom = True
                c.proc.kill()

    def cgroup_path(self, pod: dict, cid: str) -> str:
        qos = ((pod.get("status") or {}).get("qosClass") or "BestEffort").lower()
        return f"/kubepods/{qos}/pod{pod['metadata']['uid']}/{cid}"

    async def _loop(self) -> None:
        while True:
            for p in [copy.deepcopy(p) for p in self.kube.pods.values() if (p.get("spec") or {}).get("nodeName") == self.node]:
                await self._sync(p)
            for uid in list(self.running):
                if self.kube.pod_by_uid(uid) is None:
                    await self._kill_all(uid)
                    self.running.pop(uid, None)
            async with self.kube.changed:
                await wait_event(self.kube.changed, 0.05)

    async def _sync(self, pod: dict) -> None:
        uid, ns, name = pod["metadata"]["uid"], pod["metadata"]["namespace"], pod["metadata"]["name"]
        phase = (pod.get("status") or {}).get("phase")
        if pod["metadata"].get("deletionTimestamp"):
            if uid not in self._stopping:
                self._stopping.add(uid)
                task = asyncio.create_task(self._terminate(pod))
                self._terminating.add(task)
                task.add_done_callback(self._terminating.discard)
            return
        if phase in ("Succeeded", "Failed"):
            return
        conts = self.running.get(uid)
        if conts is None:
            conts = self.running[uid] = {c["name"]: _Container(c["name"], uuid.uuid4().hex) for c in pod["spec"].get("containers") or []}
            for spec in pod["spec"].get("containers") or []:
                await self._run(pod, spec, conts[spec["name"]])
            await self._report(ns, name, uid)
            return
        changed = False
        policy = pod["spec"].get("restartPolicy", "Always")
        for spec in pod["spec"].get("containers") or []:
            c = conts[spec["name"]]
            if c.proc is not None and c.proc.returncode is not None and c.exit_code is None:
                c.exit_code = c.proc.returncode if c.proc.returncode >= 0 else 128 - c.proc.returncode
                self._forget(c)
                changed = True
                if policy == "Always" or (policy == "OnFailure" and c.exit_code != 0):
                    c.restarts += 1
                    c.exit_code, c.oom = None, False
                    await self._run(pod, spec, c)
        if changed:
            await self._report(ns, name, uid)

    async def _run(self, pod: dict, spec: dict, c: _Container) -> None:
        argv = [*(spec.get("command") or []), *(spec.get("args") or [])]
        if argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOSTNAME": pod["metadata"]["name"],
               "KUBERNETES_POD_UID": pod["metadata"]["uid"], **resolve_env(pod, spec)}
        if self.cg_root is not None:
            cg = self.cg_root / self.cgroup_path(pod, c.cid).lstrip("/")
            for parent in [*reversed(cg.relative_to(self.cg_root).parents), cg.relative_to(self.cg_root)]:
                d = self.cg_root / parent
                if str(parent) != "." and not d.exists():
                    d.mkdir()
                    self._cgroups.append(d)
            procs = cg / "cgroup.procs"
            # the shell enters the cgroup, then execs the container's command (same pid): no Python code between
            # fork and exec, which can crash the child of a process with threads (gRPC's)
            argv = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs), *argv]
        c.proc = await asyncio.create_subprocess_exec(*argv, env=env, cwd=str(self.workdir),
                                                      stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                                                      start_new_session=True)
        if self.cg_root is not None:  # reported running only once inside its cgroup, as the kubelet's are
            while c.proc.returncode is None and str(c.proc.pid) not in procs.read_text().split():
                await asyncio.sleep(0.005)
        else:
            d = self.overlay / str(c.proc.pid)
            d.mkdir(parents=True, exist_ok=True)
            (d / "cgroup").write_text(f"0::{self.cgroup_path(pod, c.cid)}\n")
            for entry in ("stat", "environ", "cmdline", "status"):
                with contextlib.suppress(FileExistsError):
                    (d / entry).symlink_to(f"/proc/{c.proc.pid}/{entry}")

    async def _report(self, ns: str, name: str, uid: str, deleted: bool = False) -> None:
        pod = self.kube.pod(ns, name)
        if pod is None or pod["metadata"]["uid"] != uid:
            return
        policy = pod["spec"].get("restartPolicy", "Always")
        statuses = []
        for spec in pod["spec"].get("containers") or []:
            c = self.running[uid][spec["name"]]
            st: dict[str, Any] = {"name": c.name, "containerID": f"containerd://{c.cid}", "restartCount": c.restarts,
                                  "image": spec.get("image", ""), "started": c.exit_code is None}
            if c.exit_code is None:
                st.update(ready=True, state={"running": {"startedAt": now_iso()}})
            else:
                reason = "OOMKilled" if c.oom else ("Completed" if c.exit_code == 0 else "Error")
                st.update(ready=False, state={"terminated": {"exitCode": c.exit_code, "reason": reason, "finishedAt": now_iso(),
                                                             "containerID": f"containerd://{c.cid}"}})
            statuses.append(st)
        done = [s for s in statuses if "terminated" in s["state"]]
        if (policy == "Never" or deleted) and len(done) == len(statuses):
            phase = "Succeeded" if all(s["state"]["terminated"]["exitCode"] == 0 for s in done) else "Failed"
        elif policy == "OnFailure" and len(done) == len(statuses) and all(s["state"]["terminated"]["exitCode"] == 0 for s in done):
            phase = "Succeeded"
        else:
            phase = "Running"
        all_ready = phase == "Running" and not done
        conds = [c for c in pod["status"].get("conditions") or [] if c.get("type") not in ("Ready", "ContainersReady", "Initialized")]
        conds += [{"type": t, "status": "True" if (all_ready or t == "Initialized") else "False", "lastTransitionTime": now_iso()}
                  for t in ("Initialized", "Ready", "ContainersReady")]
        await self.kube.set_status(ns, name, {"phase": phase, "podIP": self.pod_ip, "hostIP": self.pod_ip,
                                              "containerStatuses": statuses, "conditions": conds,
                                              "startTime": pod["status"].get("startTime") or now_iso()})

    async def _kill_all(self, uid: str, sig: int = signal.SIGKILL) -> None:
        for c in self.running.get(uid, {}).values():
            if c.proc is not None and c.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(sig)

    async def _terminate(self, pod: dict) -> None:
        """Graceful deletion: SIGTERM, SIGKILL after the grace period, final statuses, then the object goes."""
        uid, ns, name = pod["metadata"]["uid"], pod["metadata"]["namespace"], pod["metadata"]["name"]
        grace = float(pod["metadata"].get("deletionGracePeriodSeconds") or 0)
        await self._kill_all(uid, signal.SIGTERM)
        procs = [c.proc for c in self.running.get(uid, {}).values() if c.proc is not None]
        try:
            async with asyncio.timeout(max(grace, 0.01)):
                await asyncio.gather(*(p.wait() for p in procs))
        except TimeoutError:
            await self._kill_all(uid, signal.SIGKILL)
            await asyncio.gather(*(p.wait() for p in procs))
        for c in self.running.get(uid, {}).values():
            if c.proc is not None and c.exit_code is None:
                rc = c.proc.returncode or 0
                c.exit_code = rc if rc >= 0 else 128 - rc
                self._forget(c)
        if uid in self.running:
            await self._report(ns, name, uid, deleted=True)
        self.running.pop(uid, None)
        await self.kube.remove(ns, name)

    def _forget(self, c: _Container) -> None:
        """Drop an exited container's overlay entry (its pid may be reused by an unrelated process)."""
        if c.proc is not None:
            shutil.rmtree(self.overlay / str(c.proc.pid), ignore_errors=True)


class FakeReplicaSet:
    """Keeps ``replicas`` pods of ``template`` (with a controller ownerReference) alive in ``ns``: a deleted or
    evicted one is recreated under a new name, as a ReplicaSet controller does."""

    def __init__(self, kube: FakeKube, ns: str, name: str, template: dict, replicas: int = 1) -> None:
        self.kube, self.ns, self.name, self.template, self.replicas = kube, ns, name, template, replicas
        self.uid = str(uuid.uuid4())
        self.created: list[str] = []
        self._task: asyncio.Task | None = None

    def owned(self) -> list[dict]:
        return [p for (ns, _), p in self.kube.pods.items() if ns == self.ns and not p["metadata"].get("deletionTimestamp")
                and any(r.get("uid") == self.uid for r in p["metadata"].get("ownerReferences") or [])]

    async def start(self) -> None:
        await self._fill()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        await cancel(self._task)

    async def _fill(self) -> None:
        while len(self.owned()) < self.replicas:
            pod = copy.deepcopy(self.template)
            meta = pod.setdefault("metadata", {})
            meta.update(namespace=self.ns, name="", generateName=f"{self.name}-", uid="")
            meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": self.name, "uid": self.uid,
                                        "controller": True, "blockOwnerDeletion": True}]
            made = await self.kube.create_pod(pod)
            self.created.append(made["metadata"]["name"])

    async def _loop(self) -> None:
        while True:
            await self._fill()
            async with self.kube.changed:
                await wait_event(self.kube.changed, 0.1)
