"""Replay a training-trace slice through a running ElastiCo suite's gRPC API, in accelerated time.

Used by ``make demo`` and the end-to-end tests. The slice is loaded with the simulator's own trace loader
(``simulator.run.build_workload``), so the live run and the simulation see exactly the same jobs:

* job i -> ``SubmitJob`` at wall time ``arrival_i / time_scale`` with ``request_id = <run>-<i>``, spec
  ``model_family``/``batch_size`` of its (mapped) type, its gang size and shape family
  (``policy.training_shapes``), and ``total_steps = duration_i x`` the isolated steps/s the simulated
  GPUs give that model on that many GPUs (``node_agent.coloc``), so that alone on whole GPUs it runs for
  exactly its trace duration;
* a watcher follows ``WatchJobs`` (placement and completion times), a sampler polls ``GetClusterState``
  and every node agent's ``ListWorkloads`` (allocated share, effective utilisation, work done) and checks
  the invariants on every sample: no GPU above 100 % share or its memory, no job running twice.

:func:`live_result` turns what was observed into the simulator's ``SimResult`` so that the *same*
``simulator.metrics.summarise`` / ``simulator.report.table`` print both.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from elastico.v1 import allocator_pb2 as apb
from elastico.v1 import allocator_pb2_grpc, node_agent_pb2, node_agent_pb2_grpc
from elastico.v1 import types_pb2 as tpb
from services.allocator.estimate import split_type_name
from services.allocator.policy import training_shapes
from services.node_agent.coloc import DEFAULT_ISOLATED_STEPS_PER_S, ColocationTruth

TERMINAL = (tpb.JOB_STATE_SUCCEEDED, tpb.JOB_STATE_FAILED, tpb.JOB_STATE_CANCELLED)


@dataclass
class TraceJob:
    """One trace row as submitted."""

    index: int
    arrival_s: float  # trace time, s (first kept arrival = 0)
    num_gpus: int
    duration_s: float  # isolated run time at num_gpus whole GPUs, s
    type_name: str
    solo_util: float
    rate: float  # isolated steps/s the simulated GPUs give it at num_gpus (wall, time scale 1)
    spec: tpb.JobSpec


def trace_jobs(workload, *, train_floor: float, gpu_type: str = "v100", gpu_mem_mib: int = 16384) -> list[TraceJob]:
    """The workload's training jobs as API specs (see the module docstring for the mapping); their shapes keep
    ``train_floor`` (the live allocator's)."""
    truth = ColocationTruth.default()
    types, tr = workload.types, workload.train
    out = []
    for i in range(len(tr.arrival_s)):
        t = int(tr.type_idx[i])
        name = types.names[t]
        model, bs = split_type_name(name)
        n = int(tr.num_gpus[i])
        rate = truth.isolated(model, bs, gpu_type, n) or DEFAULT_ISOLATED_STEPS_PER_S * n
        dur = float(tr.duration_s[i])
        shapes = training_shapes(n, float(types.solo_util[t]), rate, min_speed=train_floor, gpu_type=gpu_type,
                                 gpu_mem_mib=gpu_mem_mib)
        spec = tpb.JobSpec(
            name=f"trace-{i}", tenant="trace", kind=tpb.JOB_KIND_TRAINING, model_family=model, batch_size=bs,
            training=tpb.TrainingWork(total_steps=max(1, int(round(dur * rate)))),
            shapes=[tpb.Shape(num_gpus=s.num_gpus, compute_share_pct=s.compute_share_pct, mem_mib=s.mem_mib,
                              batch_size=bs, gpu_type=s.gpu_type, throughput=s.throughput) for s in shapes])
        out.append(TraceJob(i, float(tr.arrival_s[i]), n, dur, name, float(types.solo_util[t]), rate, spec))
    return out


class InvariantViolation(AssertionError):
    """Something the allocator must never do was observed."""


@dataclass
class Observed:
    """What a replay saw (wall-clock times, seconds since the replay started)."""

    submitted: dict[int, float] = field(default_factory=dict)
    job_ids: dict[int, str] = field(default_factory=dict)
    first_start: dict[int, float] = field(default_factory=dict)
    completed: dict[int, float] = field(default_factory=dict)
    terminal: dict[int, int] = field(default_factory=dict)  # index -> final JobState
    restarts: dict[int, int] = field(default_factory=dict)
    samples: list[tuple[float, float, float]] = field(default_factory=list)  # (t, allocated fraction, effective fraction)
    work_at: tuple[float, float] | None = None  # (t, isolated GPU-seconds done) at the first sample after the last arrival
    violations: list[str] = field(default_factory=list)
    max_share_seen: float = 0.0
    wall_s: float = 0.0
    duplicate_submits: int = 0


class Replay:
    """Drives one replay against an allocator and its node agents (all through gRPC)."""

    def __init__(self, allocator: str | list[str], node_agents: list[str], jobs: list[TraceJob], time_scale: float,
                 run_id: str, sample_every_s: float = 0.25, progress_every_s: float = 3.0, out=print,
                 on_tick=None, tls=None) -> None:
        """``tls``: the caller's ``ClientTLS`` (certificate and token; ``cluster.client_tls()``); None = plaintext."""
        from elastico.rpc.security import ClientTLS

        self.tls = tls or ClientTLS(None)
        self.allocators = [allocator] if isinstance(allocator, str) else list(allocator)
        self.on_tick = on_tick  # called with the wall seconds since start on every loop (fault injection in tests)
        self._current = 0
        self.allocator, self.agents, self.jobs, self.scale, self.run_id = allocator, node_agents, jobs, time_scale, run_id
        self.sample_every_s, self.progress_every_s, self.out = sample_every_s, progress_every_s, out
        self.obs = Observed()
        self._by_id: dict[str, int] = {}
        self._stop = threading.Event()
        self._last_progress: dict[tuple[str, str], tuple[float, float]] = {}  # (job, placement) -> (t, steps)
        self._lock = threading.Lock()

    # --- threads ------------------------------------------------------------------------------------
    def _stub(self):
        """A stub of the current allocator replica (clients fail over between replicas)."""
        return self._stubs[self._current % len(self._stubs)]

    def _call(self, method: str, req, timeout: float = 5.0, attempts: int = 40):
        """Unary call with a deadline, retried on UNAVAILABLE/DEADLINE_EXCEEDED against the next replica."""
        for k in range(attempts):
            try:
                return getattr(self._stub(), method)(req, timeout=timeout)
            except grpc.RpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or k == attempts - 1:
                    raise
                self._current += 1
                time.sleep(min(0.5, 0.05 * (k + 1)))
        raise AssertionError("unreachable")

    def _watch(self, stub, t0: float) -> None:
        req = apb.WatchJobsRequest(after_event_id="0")
        while not self._stop.is_set():
            try:
                for ev in self._stub().WatchJobs(req, timeout=5.0):
                    req.after_event_id = ev.event_id
                    with self._lock:
                        i = self._by_id.get(ev.job_id)
                    if i is None:
                        continue
                    t = ev.time_unix_s - t0
                    if ev.state == tpb.JOB_STATE_PLACED:
                        self.obs.first_start.setdefault(i, t)
                    elif ev.state in TERMINAL:
                        self.obs.terminal[i] = ev.state
                        if ev.state == tpb.JOB_STATE_SUCCEEDED:
                            self.obs.completed[i] = t
                    if self._stop.is_set():
                        return
            except grpc.RpcError as exc:
                if exc.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                    raise
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self._current += 1
                    time.sleep(0.1)  # resumes after the last event seen (WatchJobs is resumable)

    def _sample(self, stub, agents, t0: float) -> None:
        window_end = max(j.arrival_s for j in self.jobs) / self.scale
        info = {j.index: j for j in self.jobs}
        while not self._stop.wait(self.sample_every_s):
            t = time.time() - t0
            try:
                cs = self._stub().GetClusterState(apb.GetClusterStateRequest(), timeout=2)
                lists = [a.ListWorkloads(node_agent_pb2.ListWorkloadsRequest(), timeout=5) for a in agents]
            except grpc.RpcError:
                continue
            gpus = [(n.node_id, g) for n in cs.nodes for g in n.gpus]
            alloc = 0.0
            for node_id, g in gpus:
                self.obs.max_share_seen = max(self.obs.max_share_seen, g.allocated_share_pct)
                if g.allocated_share_pct > 100.0 + 1e-6 or g.allocated_mem_mib > g.mem_total_mib:
                    self.obs.violations.append(f"GPU {node_id}:{g.index} oversubscribed: {g.allocated_share_pct}% "
                                               f"{g.allocated_mem_mib}/{g.mem_total_mib} MiB")
                alloc += min(g.allocated_share_pct, 100.0) / 100.0
            eff: dict[tuple[str, int], float] = {}
            share_run: dict[tuple[str, int], float] = {}
            running_where: dict[str, set] = {}
            done_gpu_s = 0.0
            seen_running: set[int] = set()
            for node_name, resp in zip(self.agents, lists, strict=True):
                for w in resp.workloads:
                    if w.status not in ("starting", "running"):
                        continue
                    running_where.setdefault(w.job_id, set()).add(node_name)
                    with self._lock:
                        i = self._by_id.get(w.job_id)
                    for gi in w.gpu_indices:
                        key = (node_name, gi)
                        share_run[key] = share_run.get(key, 0.0) + w.compute_share_pct
                    if i is None:
                        continue
                    j = info[i]
                    # achieved fraction of isolated speed from the progress made since the previous sample
                    key = (w.job_id, w.placement_id)
                    prev = self._last_progress.get(key)
                    self._last_progress[key] = (t, w.progress_steps)
                    if prev is None or t <= prev[0] or j.rate <= 0:
                        frac = 0.0
                    else:
                        frac = min(1.0, (w.progress_steps - prev[1]) / ((t - prev[0]) * j.rate * self.scale))
                    for gi in w.gpu_indices:
                        eff[(node_name, gi)] = eff.get((node_name, gi), 0.0) + j.solo_util * frac
                    if i not in seen_running:
                        seen_running.add(i)
                        done_gpu_s += j.num_gpus * min(j.duration_s, w.progress_steps / j.rate if j.rate > 0 else 0.0)
            for key, sh in share_run.items():
                if sh > 100.0 + 1e-6:
                    self.obs.violations.append(f"GPU {key} runs workloads with {sh}% share in total")
            for job_id, where in running_where.items():
                with self._lock:
                    i = self._by_id.get(job_id)
                if i is not None and info[i].num_gpus == 1 and len(where) > 1:
                    self.obs.violations.append(f"job {job_id} runs on {sorted(where)} at once")
            G = max(len(gpus), 1)
            self.obs.samples.append((t, alloc / G, sum(min(1.0, v) for v in eff.values()) / G))
            if self.obs.work_at is None and t >= window_end:
                done_gpu_s += sum(info[i].num_gpus * info[i].duration_s for i in list(self.obs.completed))
                self.obs.work_at = (t, done_gpu_s)

    # --- run ----------------------------------------------------------------------------------------
    def run(self, timeout_s: float) -> Observed:
        """Submit every job on schedule, wait until all are terminal (or ``timeout_s``), return what was seen.

        Raises:
            InvalidViolation: an invariant failed (also listed in ``Observed.violations``).
        """
        chs = [self.tls.channel(a) for a in self.allocators]
        self._stubs = [allocator_pb2_grpc.AllocatorStub(c) for c in chs]
        stub = self._stubs[0]
        agent_tls = dataclasses.replace(self.tls, token="")  # agents take certificates only; the token stays with the allocator
        agent_chs = [agent_tls.channel(a) for a in self.agents]
        agents = [node_agent_pb2_grpc.NodeAgentStub(c) for c in agent_chs]
        t0 = time.time()
        threads = [threading.Thread(target=self._watch, args=(stub, t0), daemon=True),
                   threading.Thread(target=self._sample, args=(stub, agents, t0), daemon=True)]
        for th in threads:
            th.start()
        last_print = 0.0
        pending = sorted(self.jobs, key=lambda j: (j.arrival_s, j.index))
        try:
            while True:
                now = time.time() - t0
                while pending and pending[0].arrival_s / self.scale <= now:
                    j = pending.pop(0)
                    rid = f"{self.run_id}-{j.index}"
                    req = apb.SubmitJobRequest(request_id=rid, spec=j.spec)
                    resp = self._call("SubmitJob", req, timeout=2.0)
                    again = self._call("SubmitJob", req, timeout=2.0)  # a client retry: must return the same job
                    if again.created or again.job.job_id != resp.job.job_id:
                        self.obs.violations.append(f"retried submit {rid} created a second job")
                    self.obs.duplicate_submits += 1
                    with self._lock:
                        self._by_id[resp.job.job_id] = j.index
                    self.obs.job_ids[j.index] = resp.job.job_id
                    self.obs.submitted[j.index] = time.time() - t0
                if self.on_tick is not None:
                    self.on_tick(now)
                done = len(self.obs.terminal)
                if now - last_print >= self.progress_every_s:
                    last_print = now
                    s = self.obs.samples[-1] if self.obs.samples else (0, 0, 0)
                    self.out(f"  t={now * self.scale / 3600:6.2f} h (wall {now:5.1f} s)  submitted {len(self.obs.submitted):3d}/"
                             f"{len(self.jobs)}  started {len(self.obs.first_start):3d}  done {done:3d}  "
                             f"GPU share allocated {s[1]:5.1%}  effective {s[2]:5.1%}")
                if not pending and done >= len(self.jobs):
                    break
                if now > timeout_s:
                    self.out(f"  timeout after {now:.0f} s: {len(self.jobs) - done} jobs not finished")
                    break
                time.sleep(0.05)
            for i, job_id in self.obs.job_ids.items():
                job = self._call("GetJob", apb.GetJobRequest(job_id=job_id)).job
                self.obs.restarts[i] = job.restarts
                if job.state in TERMINAL:
                    self.obs.terminal[i] = job.state
            listed, token = [], ""
            while True:
                resp = self._call("ListJobs", apb.ListJobsRequest(page_size=1000, page_token=token), timeout=10)
                listed += [j.job_id for j in resp.jobs]
                token = resp.next_page_token
                if not token:
                    break
            mine = [x for x in listed if x in self._by_id]
            if len(mine) != len(set(mine)) or len(set(mine)) != len(self.obs.job_ids):
                self.obs.violations.append(f"ListJobs holds {len(mine)} of our jobs, {len(set(mine))} distinct, "
                                           f"{len(self.obs.job_ids)} submitted")
        finally:
            self._stop.set()
            for th in threads:
                th.join(timeout=6)
            for c in [*chs, *agent_chs]:
                c.close()
        self.obs.wall_s = time.time() - t0
        return self.obs


def live_result(policy: str, jobs: list[TraceJob], obs: Observed, time_scale: float, gpus: int):
    """What a replay observed as a ``simulator.engine.SimResult`` (virtual seconds), for ``summarise``."""
    from simulator.engine import SimResult

    n = len(jobs)
    sc = time_scale
    t_first = min(obs.submitted.values()) if obs.submitted else 0.0
    arrival = np.array([(obs.submitted.get(j.index, math.nan) - t_first) * sc for j in jobs])
    start = np.array([(obs.first_start.get(j.index, math.nan) - t_first) * sc for j in jobs])
    done = np.array([(obs.completed.get(j.index, math.nan) - t_first) * sc for j in jobs])
    window_end = float(np.nanmax(arrival)) if n else 0.0
    alloc = eff = 0.0
    s = [(t, a, e) for t, a, e in obs.samples]
    for (ta, aa, ea), (tb, _, _) in zip(s, s[1:], strict=False):  # piecewise constant over [first submit, last arrival]
        lo, hi = max(ta - t_first, 0.0) * sc, min(tb - t_first, window_end / sc) * sc
        if hi > lo:
            alloc += aa * gpus * (hi - lo)
            eff += ea * gpus * (hi - lo)
    work = obs.work_at[1] if obs.work_at else float("nan")
    return SimResult(policy=policy, arrival_s=arrival, first_start_s=start, completion_s=done,
                     num_gpus=np.array([j.num_gpus for j in jobs]), duration_s=np.array([j.duration_s for j in jobs]),
                     restarts_training=int(sum(obs.restarts.values())), restarts_inference=0, alloc_gpu_s=alloc,
                     eff_gpu_s=eff, window_end_s=window_end, work_in_window_gpu_s=work, slo_ok_s=0.0, slo_total_s=0.0,
                     timeline=np.array(obs.samples) if obs.samples else np.zeros((0, 3)), wall_s=obs.wall_s, rounds=0,
                     events=0, gpus=gpus)
