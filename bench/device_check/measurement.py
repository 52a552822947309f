"""One measurement: tenants started as child processes, warmed up, measured over one common window, sampled.

``Runner`` holds what every stage shares: the budget (checked before every stage and measurement, skipping what
no longer fits), the live children (killed, by pid, on the way out), the report rewritten as JSON after every
step, and the solo rates the co-located ones are normalised to.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from queue import Empty, Queue
from typing import Any

from bench.device_check.host import JSON_NAME, REPO, SCHEMA, TOOL_DIRS, Terminated, WorkerError, as_dict, now, tail
from bench.device_check.workloads import MPS_SHARES, PAIR_SHARES, PAIRS, WORKLOADS

DEFAULT_WINDOW_S = 5.0
QUICK_WINDOW_S = 2.0
DRY_WINDOW_S = 0.1


class Child:
    """One worker process: JSON events from its stdout on a queue, stderr in a file."""

    def __init__(self, label: str, workload: str, seconds: float, env: dict[str, str], fake: bool, tmp: Path,
                 module: str = "bench.device_check", extra_args: tuple[str, ...] = ()) -> None:
        self.label = label
        self.workload = workload
        self.stderr_path = tmp / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', label)}-{time.monotonic_ns()}.stderr"
        # fake workers need only the standard library: -S skips site-packages (5x faster start, quick tests)
        cmd = [sys.executable, *(["-S"] if fake else []), "-m", module, "--worker", workload,
               "--seconds", f"{seconds:g}", *(["--fake"] if fake else []), *extra_args]
        self.t_spawn = time.monotonic()
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True, bufsize=1)
        self.events: Queue[dict[str, Any]] = Queue()
        self.noise: list[str] = []
        self.prepared_s: float | None = None  # spawn to a ``prepared`` event (a worker that can be prepared ahead)
        threading.Thread(target=self._read, daemon=True, name=f"read-{label}").start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                try:
                    ev = json.loads(line)
                    if isinstance(ev, dict) and ev.get("event") == "prepared":
                        self.prepared_s = round(time.monotonic() - self.t_spawn, 3)
                    self.events.put(ev)
                    continue
                except json.JSONDecodeError:
                    pass
            if line:
                self.noise.append(line[:300])
        self.events.put({"event": "exit"})

    def stderr_tail(self) -> str:
        return tail(self.stderr_path, 1500).strip()

    def wait_event(self, kind: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"{self.label}: no '{kind}' within {timeout:.0f} s")
            try:
                ev = self.events.get(timeout=min(left, 0.5))
            except Empty:
                continue
            if ev.get("event") == kind:
                return ev
            if ev.get("event") == "error":
                raise WorkerError(f"{self.label}: {ev.get('error')}\n{ev.get('traceback', '')[-1200:]}")
            if ev.get("event") == "exit":
                try:
                    rc = self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    rc = None
                raise WorkerError(f"{self.label} exited (rc {rc}) before '{kind}'; stderr: "
                                  f"{self.stderr_tail()[-800:] or '(empty)'}")

    def send(self, line: str) -> None:
        """One line to the child's stdin (``go``, or the start line a prepared worker waits on)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.rstrip("\n") + "\n")
        self.proc.stdin.flush()

    def go(self, t_go: float) -> None:
        self.send(f"go {t_go:.6f}")

    def discard(self) -> None:
        """Kill (ours, by pid) and reap a child that will not be measured (a prepared tenant of a skipped point)."""
        self.proc.kill()
        self.finish()

    def finish(self) -> None:
        """Reap the child; kill it (it is ours, by pid) if it has not exited within a few seconds."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


@dataclass(frozen=True)
class TenantSpec:
    """One co-tenant of a measurement: its label, workload, MPS share and extra environment."""

    label: str
    workload: str
    share_pct: int | None  # MPS active-thread percentage; None = no MPS
    env: dict[str, str]
    args: tuple[str, ...] = ()  # extra worker arguments
    start_line: str | None = None  # written to stdin when the measurement starts (a prepared worker waits on it)


class Runner:
    """Budget, children, measurements and the JSON report of one run (the stages are its subclasses').

    A subclass for another campaign overrides the class attributes: its worker module, schema, JSON file name,
    workload descriptions and (normal, quick, dry-run) measurement windows.
    """

    worker_module = "bench.device_check"
    schema = SCHEMA
    json_name = JSON_NAME
    workload_docs: dict[str, str] = WORKLOADS
    windows = (DEFAULT_WINDOW_S, QUICK_WINDOW_S, DRY_WINDOW_S)

    def __init__(self, args: argparse.Namespace, gpu_mod: types.ModuleType, mps_mod: types.ModuleType) -> None:
        self.args = args
        self.gpu_mod, self.mps_mod = gpu_mod, mps_mod  # services.node_agent.gpu and .mps (project.load_project)
        self.dry = bool(args.dry_run)
        self.window = float(args.seconds if args.seconds is not None else
                            self.windows[2] if self.dry else self.windows[1] if args.quick else self.windows[0])
        self.budget = float(args.budget_s)
        self.out = Path(args.out)
        self.t0 = time.monotonic()
        self.tmp = Path(tempfile.mkdtemp(prefix="elastico-device-check-"))
        self.go_delay = 0.02 if self.dry else 0.3
        self.startup_est = 1.0 if self.dry else 20.0  # seconds from spawn to 'ready'; first one imports torch cold
        self.ready_timeout = 20.0 if self.dry else 90.0
        self.live: list[Child] = []
        self.measuring: set[int] = set()
        self.backend: Any = None
        self.mps_ctl: Any = None  # the MPS controller while a daemon may be up (MpsStage.start_mps)
        self.mem_total_mib: int | None = None
        self.solo_plain: dict[str, float] = {}
        self.solo_mps: dict[str, dict[int, float]] = {}
        self.mps_ok = False
        self.n_meas = 0
        plan = self._plan()
        self.report: dict[str, Any] = {
            "schema": self.schema, "status": "running", "mode": "dry-run" if self.dry else "gpu",
            "started_at": now(), "finished_at": None, "elapsed_s": 0.0, "budget_s": self.budget,
            "window_s": self.window, "args": {k: v for k, v in vars(args).items() if k not in ("worker", "fake")},
            "workloads": self.workload_docs, "plan": plan, "stages": {}, "summary": [],
        }

    # --- bookkeeping -------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def remaining(self) -> float:
        return self.budget - self.elapsed()

    def say(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)

    def _plan(self) -> dict[str, Any]:
        n = 1 + len(WORKLOADS) + 1 + len(WORKLOADS) * len(MPS_SHARES) + len(PAIRS) * len(PAIR_SHARES)
        per = self.window + (1.0 if self.dry else 5.0) + self.go_delay
        return {"measurements": n, "optional_timeslice_pairs": len(PAIRS),
                "estimated_s": round(n * per + (1 if self.dry else 25), 1),
                "assumes_startup_s": 1.0 if self.dry else 5.0}

    def write(self) -> None:
        self.report["elapsed_s"] = round(self.elapsed(), 2)
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            path = self.out / self.json_name
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.report, indent=1, default=str))
            os.replace(tmp, path)
        except OSError as exc:
            print(f"{self.worker_module}: cannot write {self.out / self.json_name}: {exc}", file=sys.stderr, flush=True)

    def stage(self, name: str, fn: Callable[[dict[str, Any]], None], min_s: float) -> None:
        res: dict[str, Any] = {}
        entry: dict[str, Any] = {"status": "running", "started_s": round(self.elapsed(), 2), "elapsed_s": None,
                                 "error": None, "result": res}
        self.report["stages"][name] = entry
        if self.remaining() < min_s:
            entry.update(status="skipped", error=f"budget: {self.remaining():.0f} s left, stage needs ~{min_s:.0f} s")
            self.say(f"stage {name}: SKIPPED ({entry['error']})")
            self.write()
            return
        self.say(f"stage {name} ...")
        self.write()
        t = time.monotonic()
        try:
            fn(res)
            entry["status"] = "ok"
        except Terminated:
            entry.update(status="interrupted", error="terminated (SIGTERM/SIGINT)")
            raise
        except Exception as exc:  # noqa: BLE001 - recorded; the next stage runs
            entry.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
        finally:
            entry["elapsed_s"] = round(time.monotonic() - t, 2)
            self.say(f"stage {name}: {entry['status'].upper()} in {entry['elapsed_s']:.1f} s"
                     + (f" -- {entry['error']}" if entry["error"] else ""))
            self.write()

    def spawn(self, label: str, workload: str, seconds: float, env: dict[str, str],
              extra_args: tuple[str, ...] = ()) -> Child:
        """One worker child of this run's worker module (``extra_args`` appended to its command line)."""
        return Child(label, workload, seconds, env, self.dry, self.tmp, self.worker_module, extra_args)

    def measurement_cost(self, seconds: float) -> float:
        return self.startup_est + seconds + self.go_delay + 1.0

    def _grace(self, timeout: float) -> float:
        """A child's wait, shortened near the end of the budget (the run must end well inside its limit)."""
        return min(timeout, max(15.0 if not self.dry else timeout, self.remaining() + 30.0))

    def child_env(self, extra: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["PYTHONUNBUFFERED"] = "1"
        env["PATH"] = os.pathsep.join([env.get("PATH", "")] + list(TOOL_DIRS))
        env.update(extra)
        return env

    # --- one measurement ------------------------------------------------------------------------------
    def measure(self, label: str, mode: str, tenants: list[TenantSpec], seconds: float,
                ready_timeout: float | None = None, mps: Any = None, tail_s: float = 0.0, per_tenant: bool = False,
                during: Callable[[], dict[str, Any]] | None = None, result_grace_s: float = 60.0,
                prepared: list[Child] | None = None, on_start: Callable[[], None] | None = None) -> dict[str, Any]:
        """Start every tenant, wait until all are warm, measure them over one common window.

        ``tail_s``: the workers run that much longer after the window (``result`` comes after it).
        ``per_tenant``: a failed tenant is recorded in its own entry (``error``, no rate) and the others are
        kept; otherwise the first failure fails the measurement. ``during`` is called once after the counters
        are sampled (three quarters into the window); what it returns is stored as ``during``. ``result_grace_s``:
        how long past the window and tail a tenant's result may take. ``prepared``: children already spawned for
        ``tenants`` (same order), released by their ``start_line``; the caller discards them if this is skipped.
        ``on_start`` is called once the tenants are started, while they warm up (the campaign spawns the next
        point's tenants there). ``startup_s`` is the wait from start to every tenant ready: what was not hidden.
        """
        rec: dict[str, Any] = {"label": label, "mode": mode, "window_s": seconds, "tenants": [], "counters": None,
                               "error": None}
        cost = self.measurement_cost(seconds + tail_s)
        if self.remaining() < cost:
            rec["error"] = f"skipped: budget ({self.remaining():.0f} s left, needs ~{cost:.0f} s)"
            rec["skipped"] = True
            self.say(f"  {label}: SKIPPED (budget)")
            return rec
        t = time.monotonic()
        children: list[Child] = []
        try:
            for i, tn in enumerate(tenants):
                c = prepared[i] if prepared else self.spawn(tn.label, tn.workload, seconds,
                                                             self.child_env(tn.env), tn.args)
                children.append(c)
                self.live.append(c)
                if tn.start_line is not None:
                    c.send(tn.start_line)
            t_started = time.monotonic()
            rec["prepared_ahead"] = bool(prepared)
            if on_start is not None:
                on_start()
            deadline = time.monotonic() + self._grace(ready_timeout or self.ready_timeout)
            readies = [c.wait_event("ready", max(0.1, deadline - time.monotonic())) for c in children]
            startup = time.monotonic() - (t_started if prepared else min(c.t_spawn for c in children))
            rec["startup_s"] = round(startup, 3)
            self.startup_est = max(1.0 if self.dry else 3.0, startup + 1.0)
            t_go = time.time() + self.go_delay
            for c in children:
                c.go(t_go)
                self.measuring.add(c.proc.pid)
            rec["counters"] = self.sample(t_go, seconds, {c.label: c.proc.pid for c in children}, mps)
            if during is not None:
                rec["during"] = during()
            results: list[dict[str, Any] | None] = []
            errors: list[str] = []
            for c in children:
                try:
                    results.append(c.wait_event("result", seconds + tail_s + self._grace(result_grace_s)))
                except WorkerError as exc:
                    if not per_tenant:
                        raise
                    results.append(None)
                    errors.append(str(exc))
            for tn, c, ready, res in zip(tenants, children, readies, results):
                if res is None:
                    rec["tenants"].append({"label": tn.label, "workload": tn.workload, "share_pct": tn.share_pct,
                                           "pid": c.proc.pid, "steps_per_s": None, "error": errors.pop(0),
                                           "ready_detail": ready.get("detail")})
                    continue
                rec["tenants"].append({
                    "label": tn.label, "workload": tn.workload, "share_pct": tn.share_pct, "pid": c.proc.pid,
                    "steps_per_s": res["steps_per_s"], "steps": res["steps"], "seconds": res["seconds"],
                    "start_lag_s": res.get("start_lag_s"), "startup_s": ready.get("startup_s"),
                    "prepare_s": ready.get("prepare_s"), "spawn_to_prepared_s": c.prepared_s,
                    "warmup_s": ready.get("warmup_s"),
                    "sm_count_seen": ready.get("sm_count"), "share_env_seen": ready.get("share_env"),
                    "peak_mem_mib": res.get("peak_mem_mib"), "latency_ms": res.get("latency_ms"),
                    **({"detail": res["detail"], "ready_detail": ready.get("detail")} if "detail" in res else {}),
                })
            failed = [t["label"] for t in rec["tenants"] if t.get("error")]
            if failed:
                rec["error"] = f"tenant(s) failed: {', '.join(failed)}"
        except Terminated:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded with the measurement
            rec["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            for c in children:
                self.measuring.discard(c.proc.pid)
                c.finish()
                if c in self.live:
                    self.live.remove(c)
            rec["wall_s"] = round(time.monotonic() - t, 2)
            self.n_meas += 1
        rates = "  ".join(f"{x['label']} " + (f"{x['steps_per_s']:.1f}/s" if x.get("steps_per_s") is not None
                                               else "FAILED") for x in rec["tenants"])
        self.say(f"  {label}: {rates or 'FAILED: ' + str(rec['error'])[:300]}")
        return rec

    def sample(self, t_go: float, seconds: float, pids: dict[str, int], mps: Any) -> dict[str, Any] | None:
        """NVML device and per-process counters inside the window (GPM needs two samples), MPS health."""
        if self.backend is None and mps is None:
            return None
        out: dict[str, Any] = {}
        try:
            time.sleep(max(0.0, t_go + 0.25 * seconds - time.time()))
            if self.backend is not None:
                self.backend.gpus()
            time.sleep(max(0.0, t_go + 0.75 * seconds - time.time()))
            if self.backend is not None:
                gpus = self.backend.gpus()
                out["gpu0"] = as_dict(gpus[0].counters) if gpus else None
                procs = self.backend.process_counters()
                out["processes"] = {str(pid): as_dict(c) for pid, c in procs.items()}
                out["tenant_pids_seen"] = {label: str(pid) in out["processes"] for label, pid in pids.items()}
            if mps is not None:
                h = mps.health()
                out["mps_health"] = {"state": h.state, "servers": list(h.server_pids),
                                     "clients": sorted(h.client_pids), "detail": h.detail}
        except Exception as exc:  # noqa: BLE001
            out["error"] = f"{type(exc).__name__}: {exc}"
        return out

    @staticmethod
    def normalise(rec: dict[str, Any], base: dict[str, float] | dict[str, float | None],
                  same_share: dict[str, float | None] | None) -> None:
        """Each tenant's rate over its solo rate in ``base`` (and ``same_share``); their sum as ``combined_norm``."""
        total: float | None = 0.0
        for t in rec["tenants"]:
            b = base.get(t["workload"])
            t["norm"] = t["steps_per_s"] / b if b and t.get("steps_per_s") is not None else None
            if same_share is not None:
                s = same_share.get(t["workload"])
                t["norm_vs_solo_same_share"] = t["steps_per_s"] / s if s and t.get("steps_per_s") is not None else None
            total = total + t["norm"] if (total is not None and t["norm"] is not None) else None
        rec["combined_norm"] = total if rec["tenants"] else None
