"""Kubernetes pods as workloads, I/O part: the pods bound to this node (API server watch) and their processes (/proc).

* :func:`scan_pod_processes` reads ``<proc root>/<pid>/cgroup`` and ``stat`` of every process: {pod uid: live
  processes}. The DaemonSet runs with ``hostPID``, so ``/proc`` shows the pods' containers; the pod sandbox's
  ``pause`` process is left out (it is no container's, and lives until kubelet tears the sandbox down).
* :class:`PodWatcher` follows the pods with ``spec.nodeName=<node>`` through the official ``kubernetes`` client:
  list, then watch from the list's ``resourceVersion``, resuming from the last version seen when a watch ends or
  breaks, and listing afresh on ``410 Gone`` (the version is too old). Responses are read as raw JSON (the pods
  as the API server wrote them; the client's models would reject a status missing a field they require). It runs
  in a daemon thread (the client is synchronous); the asyncio side reads :meth:`PodWatcher.snapshot` and is
  nudged through ``on_change``.
  RBAC: pods get, list, watch (cluster-wide: a field selector is not a namespace).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

from elastico.kubeclient import api_client
from elastico.logging import get_logger
from services.node_agent.pods import SANDBOX_COMMS, PodProcess, parse_stat, pod_uid, pod_uid_from_cgroup

log = get_logger(component="podwatch")

WATCH_TIMEOUT_S = 60  # a watch call asks the server to end it after this long; the next resumes from its version
RETRY_MIN_S, RETRY_MAX_S = 0.5, 30.0  # back-off between failed API calls
ERROR_LOG_S = 60.0  # at most one logged API failure per this many seconds


def scan_pod_processes(proc_root: Path) -> dict[str, list[PodProcess]]:
    """{pod uid: its live (not zombie) processes} under ``proc_root`` (a /proc); processes of no pod are skipped."""
    out: dict[str, list[PodProcess]] = {}
    try:
        entries = list(os.scandir(proc_root))
    except OSError as exc:
        log.warning("cannot read the proc root; no pod processes found", proc_root=str(proc_root), error=str(exc))
        return out
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "cgroup")) as f:
                uid = pod_uid_from_cgroup(f.read())
            if uid is None:
                continue
            with open(os.path.join(entry.path, "stat")) as f:
                st = parse_stat(f.read())
        except OSError:  # exited while we read it
            continue
        if st is None or not st.alive or st.comm in SANDBOX_COMMS:
            continue
        out.setdefault(uid, []).append(PodProcess(int(entry.name), st.ppid, st.start_ticks, st.comm))
    return out


def core_api(api_url: str = "") -> client.CoreV1Api:
    """A CoreV1Api for ``api_url`` ("" = the in-cluster service account, else ``~/.kube/config``)."""
    return client.CoreV1Api(api_client(api_url))


class PodWatcher:
    """The pods bound to ``node``, kept current by list + watch in a daemon thread: {pod uid: pod JSON}."""

    def __init__(self, core: client.CoreV1Api, node: str, *, request_timeout_s: float = 5.0,
                 watch_timeout_s: int = WATCH_TIMEOUT_S) -> None:
        self.core = core
        self.node = node
        self.request_timeout_s = request_timeout_s
        self.watch_timeout_s = watch_timeout_s
        self._lock = threading.Lock()
        self._pods: dict[str, dict[str, Any]] = {}
        self._synced = False
        self._rv = ""  # resourceVersion to resume the watch from; "" = list first
        self._stop = threading.Event()
        self._resp: Any = None  # the open watch response (urllib3), to interrupt it from another thread
        self._thread: threading.Thread | None = None
        self._on_change: Callable[[], None] = lambda: None
        self._logged_at = -RETRY_MAX_S * 10
        self.lists = 0  # completed lists (the first, and every one after a 410)
        self.watches = 0  # watch calls made

    @property
    def selector(self) -> str:
        return f"spec.nodeName={self.node}"

    def start(self, on_change: Callable[[], None]) -> None:
        self._on_change = on_change
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"podwatch-{self.node}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self.interrupt()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def interrupt(self) -> None:
        """End the current watch call; the thread resumes from the last version it saw (as after a dropped connection).

        The socket is shut down, not closed: that unblocks the thread's read without racing its own clean-up (what
        the client's ``Watch.stop`` does)."""
        sock = getattr(getattr(self._resp, "connection", None), "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def snapshot(self) -> tuple[bool, dict[str, dict[str, Any]]]:
        """(a list has completed, a copy of {pod uid: pod JSON})."""
        with self._lock:
            return self._synced, dict(self._pods)

    # --- the thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        delay = RETRY_MIN_S
        while not self._stop.is_set():
            try:
                if not self._rv:
                    self._list()
                self._watch_once()
                delay = RETRY_MIN_S
            except ApiException as exc:
                if exc.status == 410:  # our version is older than the server keeps: list afresh
                    log.info("pod watch expired (410); listing again", node=self.node, detail=exc.reason)
                    self._rv = ""
                    continue
                self._failed(f"HTTP {exc.status}: {exc.reason}", delay)
                self._stop.wait(delay)
                delay = min(RETRY_MAX_S, delay * 2)
            except Exception as exc:  # noqa: BLE001 - connection errors of any kind: retry with back-off
                if self._stop.is_set():
                    break
                self._failed(f"{type(exc).__name__}: {exc}", delay)
                self._stop.wait(delay)
                delay = min(RETRY_MAX_S, delay * 2)

    def _failed(self, error: str, retry_s: float) -> None:
        now = time.monotonic()
        if now - self._logged_at >= ERROR_LOG_S:
            self._logged_at = now
            log.warning("pod watch failed; retrying (ends of pods are reported once it is back)", node=self.node,
                        error=error, retry_s=retry_s)

    @staticmethod
    def _check(resp: Any) -> None:
        """Raise ApiException for a non-2xx raw response (the client may hand one back unread)."""
        status = getattr(resp, "status", 200)
        if isinstance(status, int) and not 200 <= status <= 299:
            try:
                reason = json.loads(resp.data).get("message", "")
            except (ValueError, AttributeError):
                reason = ""
            raise ApiException(status=status, reason=reason or getattr(resp, "reason", ""))

    def _list(self) -> None:
        resp = self.core.list_pod_for_all_namespaces(field_selector=self.selector, _preload_content=False,
                                                     _request_timeout=self.request_timeout_s)
        self._check(resp)
        data = json.loads(resp.data)
        pods = {pod_uid(p): p for p in data.get("items") or [] if pod_uid(p)}
        with self._lock:
            self._pods, self._synced = pods, True
        self._rv = str((data.get("metadata") or {}).get("resourceVersion") or "")
        self.lists += 1
        log.debug("listed pods bound to this node", node=self.node, pods=len(pods), resource_version=self._rv)
        self._on_change()

    def _watch_once(self) -> None:
        """One watch call from ``self._rv`` until the server ends it (``timeoutSeconds``) or it breaks.

        Raises:
            ApiException: an HTTP error, or an ERROR event (410 when the version is too old).
        """
        self.watches += 1
        resp = self.core.list_pod_for_all_namespaces(
            field_selector=self.selector, resource_version=self._rv, timeout_seconds=self.watch_timeout_s,
            allow_watch_bookmarks=True, watch=True, _preload_content=False,
            _request_timeout=(self.request_timeout_s, self.watch_timeout_s + self.request_timeout_s))
        self._resp = resp
        try:
            self._check(resp)
            for line in iter_resp_lines(resp):
                if self._stop.is_set():
                    break
                if line.strip():
                    self._apply(json.loads(line))
        finally:
            self._resp = None
            with contextlib.suppress(Exception):
                resp.release_conn()

    def _apply(self, event: dict[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            raise ApiException(status=int(obj.get("code") or 500), reason=f"{obj.get('reason', '')}: {obj.get('message', '')}")
        rv = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        if kind == "BOOKMARK":
            self._rv = rv or self._rv
            return
        uid = pod_uid(obj)
        if kind not in ("ADDED", "MODIFIED", "DELETED") or not uid:
            return
        with self._lock:
            if kind == "DELETED":
                self._pods.pop(uid, None)
            else:
                self._pods[uid] = obj
        self._rv = rv or self._rv
        self._on_change()


class KubePods:
    """:class:`services.node_agent.pods.PodSource` of a real node: the watch of its pods and its /proc."""

    def __init__(self, watcher: PodWatcher, proc_root: Path) -> None:
        self.watcher = watcher
        self.proc_root = Path(proc_root)

    def start(self, on_change: Callable[[], None]) -> None:
        self.watcher.start(on_change)

    def stop(self) -> None:
        self.watcher.stop()

    def snapshot(self) -> tuple[bool, dict[str, dict[str, Any]]]:
        return self.watcher.snapshot()

    def processes(self) -> dict[str, list[PodProcess]]:
        return scan_pod_processes(self.proc_root)
