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

Inference services (optional, :func:`service_jobs`): service i -> ``SubmitJob`` of an INFERENCE job with
declared 1-GPU shapes at the policy's inference shares (``throughput = mu_full x share / 100``, one fixed memory
footprint), ``latency_slo_ms = slo_factor x 1000 / mu_full`` and ``demand_rps`` = the simulator's forecast at its
start. Services are submitted ``service_lead_s`` wall seconds before their start (model time 0 for the demo's:
up and serving when the slice begins, as in the simulator, whose first round places them at t = 0), driven by a
:class:`devtools.loadgen.LoadGenerator` that replays their demand profile (the looped profile's past during the
lead), and cancelled at their end. A sampler reads each service's committed share (``GetJob``) and scrapes its
``/metrics`` (vLLM names); :func:`devtools.service_metrics.service_windows` turns that into per-bin rate, mean and p99 latency and SLO
attainment: the fraction of the service's lifetime in ``BIN_S`` windows (model time) whose mean latency of the
requests completed in it is within ``latency_slo_ms`` -- the live reading of the simulator's criterion (the
M/M/1 mean sojourn at the bin's demand within the SLO); a window in which the service had no serving replica,
or lost an arrival for want of one, is violated.

:func:`live_result` turns what was observed into the simulator's ``SimResult`` so that the *same*
``simulator.metrics.summarise`` / ``simulator.report.table`` print both.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from devtools.loadgen import LoadGenerator, ProfileArrivals
from devtools.service_metrics import ServiceObserved, ServiceSample, scrape_metrics, service_windows
from elastico import domain as d
from elastico.client import AllocatorClient, AllocatorError, NodeAgentClient
from elastico.rpc.convert import state_to_pb
from elastico.v1 import types_pb2 as tpb
from services.allocator.estimate import split_type_name
from services.allocator.policy import training_shapes
from services.allocator.policy.forecast import looped_forecast, window_bins
from services.allocator.policy.shapes import count_speed, relative_tput
from services.node_agent.coloc import DEFAULT_ISOLATED_STEPS_PER_S, ColocationTruth
from simulator.traces import BIN_S

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
    scale_curve: np.ndarray | None = None  # its type's throughput curve (TypeTable.scale_tput row), None = linear


def trace_jobs(workload, *, train_floor: float, gpu_type: str = "v100", gpu_mem_mib: int = 16384,
               min_speed: float | None = None) -> list[TraceJob]:
    """The workload's training jobs as API specs (see the module docstring for the mapping); their shapes keep
    ``min_speed`` of their speed, by default ``train_floor`` (the live allocator's). A lower ``min_speed`` (the
    ElastiCo policy's ``slack_floor``) declares the policy's whole share menu, as the simulator offers it: the
    policy itself keeps ``train_floor`` for ordinary co-location and the slack floor in a service's slack."""
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
        floor = train_floor if min_speed is None else min_speed
        shapes = training_shapes(n, float(types.solo_util[t]), rate, min_speed=floor, gpu_type=gpu_type,
                                 gpu_mem_mib=gpu_mem_mib)
        spec = tpb.JobSpec(
            name=f"trace-{i}", tenant="trace", kind=tpb.JOB_KIND_TRAINING, model_family=model, batch_size=bs,
            training=tpb.TrainingWork(total_steps=max(1, int(round(dur * rate)))),
            shapes=[tpb.Shape(num_gpus=s.num_gpus, compute_share_pct=s.compute_share_pct, mem_mib=s.mem_mib,
                              batch_size=bs, gpu_type=s.gpu_type, throughput=s.throughput) for s in shapes])
        curve = np.asarray(types.scale_tput[t], float) if types.scale_tput is not None else None
        out.append(TraceJob(i, float(tr.arrival_s[i]), n, dur, name, float(types.solo_util[t]), rate, spec, curve))
    return out


@dataclass
class ServiceJob:
    """One inference service as submitted (times in model seconds, rates in requests per model second)."""

    index: int
    name: str
    start_s: float
    end_s: float
    rates_rps: np.ndarray  # [P] request rate per BIN_S bin of its looped profile
    phase_bin: int  # the profile bin at model time 0
    mu_full: float  # requests/s one whole, uncontended GPU serves
    slo_ms: float  # latency objective (model time), ms
    spec: tpb.JobSpec

    def rate_at(self, t: float) -> float:
        """Demand at model time ``t`` (the simulator's indexing: bin ``(phase + floor(t / BIN_S)) % P``)."""
        return float(self.rates_rps[(self.phase_bin + math.floor(t / BIN_S)) % len(self.rates_rps)])


def service_jobs(inf, *, mu_full: float, slo_factor: float, shares_pct, mem_mib: int = 2048,
                 forecast_window_s: float = 3600.0, gpu_type: str = "v100") -> list[ServiceJob]:
    """The simulator's inference services (``simulator.traces.InferenceServices``) as API specs.

    Demand = ``inf.demand(i)`` (fraction of one GPU) x ``mu_full``; every service declares 1-GPU shapes at
    ``shares_pct`` with ``throughput = mu_full x share / 100`` and the same ``mem_mib`` (a service's memory
    footprint does not follow its compute share); ``demand_rps`` is the simulator's forecast at its start (the
    shared forecaster's peak over ``forecast_window_s`` of the looped profile), so both front ends start from
    the same number.
    """
    if not (math.isfinite(mu_full) and mu_full > 0):
        raise ValueError(f"mu_full must be a finite number > 0, got {mu_full!r}")
    if not (math.isfinite(slo_factor) and slo_factor >= 1):
        raise ValueError(f"slo_factor must be a finite number >= 1, got {slo_factor!r}")
    shares = sorted(float(x) for x in shares_pct)
    if not shares or shares[0] <= 0 or shares[-1] > 100:
        raise ValueError(f"shares_pct must be shares in (0, 100], got {tuple(shares_pct)!r}")
    out = []
    for i in range(len(inf.start_s)):
        load = np.asarray(inf.demand(i), float)
        phase = int(inf.phase_bin[i])
        start = float(inf.start_s[i])
        fc = looped_forecast(load, window_bins(forecast_window_s, BIN_S))
        demand = float(fc[(phase + math.floor(start / BIN_S)) % len(fc)]) * mu_full
        name = str(inf.names[int(inf.profile[i])]).replace("azure2023_llm_inference_", "")
        slo_ms = slo_factor * 1000.0 / mu_full
        spec = tpb.JobSpec(
            name=f"svc-{i}-{name}", tenant="services", kind=tpb.JOB_KIND_INFERENCE, model_family="inference",
            inference=tpb.InferenceWork(demand_rps=max(demand, 1e-6), latency_slo_ms=slo_ms),
            shapes=[tpb.Shape(num_gpus=1, compute_share_pct=sh, mem_mib=mem_mib, gpu_type=gpu_type,
                              throughput=mu_full * sh / 100.0) for sh in shares])
        out.append(ServiceJob(i, name, start, float(inf.end_s[i]), load * mu_full, phase, float(mu_full), slo_ms, spec))
    return out


class InvariantViolation(AssertionError):
    """Something the allocator must never do was observed."""


@dataclass
class Observed:
    """What a replay saw (wall-clock times, seconds since the replay's model time 0: the first training arrival)."""

    submitted: dict[int, float] = field(default_factory=dict)
    job_ids: dict[int, str] = field(default_factory=dict)
    first_start: dict[int, float] = field(default_factory=dict)
    completed: dict[int, float] = field(default_factory=dict)
    terminal: dict[int, int] = field(default_factory=dict)  # index -> final JobState
    why_not_succeeded: dict[int, str] = field(default_factory=dict)  # index -> "STATE REASON: message" of a job that ended otherwise
    restarts: dict[int, int] = field(default_factory=dict)
    samples: list[tuple[float, float, float]] = field(default_factory=list)  # (t, allocated fraction, effective fraction)
    work_at: tuple[float, float] | None = None  # (t, isolated GPU-seconds done) at the first sample after the last arrival
    violations: list[str] = field(default_factory=list)
    max_share_seen: float = 0.0
    wall_s: float = 0.0
    duplicate_submits: int = 0
    services: dict[int, ServiceObserved] = field(default_factory=dict)  # service index -> what was seen of it


SERVING = (d.JobState.PLACED, d.JobState.RUNNING)
RATE_WINDOW_S = 1.0  # wall seconds over which a workload's progress rate is read


def _train_eff(j: TraceJob, n_run: int, frac: float) -> float:
    """Effective utilisation one GPU of training job ``j`` adds, running on ``n_run`` GPUs at ``frac`` of its
    isolated speed at its requested count -- the simulator's rule (``simulator.engine``): solo utilisation x
    co-location factor (the speed over the count's own speed, at most 1) x per-GPU scaling efficiency at ``n_run``."""
    if j.scale_curve is None:
        return j.solo_util * min(frac, 1.0)
    cs = float(count_speed(j.scale_curve, n_run, j.num_gpus)) if n_run != j.num_gpus else 1.0
    peff = min(1.0, cs * float(relative_tput(j.scale_curve, j.num_gpus)) / n_run)
    return j.solo_util * min(frac / cs, 1.0) * peff if cs > 0 else 0.0


def work_done_gpu_s(jobs: dict[int, TraceJob], steps: dict[int, float], completed: set[int]) -> float:
    """Isolated GPU-seconds of work the training jobs have done: a completed job its whole duration, any other the
    most progress its workloads have shown (``steps``), so that one relaunched, or finished but not yet reported
    complete, at the moment of reading keeps the work it did."""
    done = 0.0
    for i in completed | steps.keys():
        j = jobs[i]
        ran = j.duration_s if i in completed else min(j.duration_s, steps[i] / j.rate if j.rate > 0 else 0.0)
        done += j.num_gpus * ran
    return done


class Replay:
    """Drives one replay against an allocator and its node agents (all through gRPC)."""

    def __init__(self, allocator: str | list[str], node_agents: list[str], jobs: list[TraceJob], time_scale: float,
                 run_id: str, sample_every_s: float = 0.25, progress_every_s: float = 3.0, out=print,
                 on_tick=None, tls=None, services: list[ServiceJob] | None = None, service_lead_s: float = 3.0,
                 history_s: float = 0.0, gateway_reports: bool = False, seed: int = 0) -> None:
        """``tls``: the caller's ``ClientTLS`` (certificate and token; ``cluster.client_tls()``); None = plaintext.
        ``services``: inference services to run beside the jobs (module docstring), submitted ``service_lead_s``
        wall seconds before their start, each with its demand over the ``history_s`` model seconds before that
        reported (:meth:`_report_history`; 0 = none); ``gateway_reports``: report each minute's arrivals of a
        running service as it ends, as its gateway would (:meth:`_report_bins`); ``seed`` seeds their arrivals."""
        from elastico.rpc.security import ClientTLS

        self.tls = tls or ClientTLS(None)
        self.allocators = [allocator] if isinstance(allocator, str) else list(allocator)
        self.on_tick = on_tick  # called with the wall seconds since start on every loop (fault injection in tests)
        self._watcher = None  # the current WatchJobs stream (cancelled at the end of the run)
        self.allocator, self.agents, self.jobs, self.scale, self.run_id = allocator, node_agents, jobs, time_scale, run_id
        self.sample_every_s, self.progress_every_s, self.out = sample_every_s, progress_every_s, out
        self.services = list(services or [])
        if not (math.isfinite(service_lead_s) and service_lead_s >= 0):
            raise ValueError(f"service_lead_s must be a finite number >= 0, got {service_lead_s!r}")
        self.service_lead_s = float(service_lead_s) if self.services else 0.0
        if not (math.isfinite(history_s) and history_s >= 0):
            raise ValueError(f"history_s must be a finite number >= 0, got {history_s!r}")
        self.history_s = float(history_s)
        self.gateway_reports = bool(gateway_reports)
        self._sources: dict[int, ProfileArrivals] = {}
        self.seed = seed
        self.obs = Observed()
        self._by_id: dict[str, int] = {}
        self._svc_by_id: dict[str, int] = {}
        self._endpoints: dict[str, str] = {}  # service job id -> endpoint of a workload of its current placement
        self._gens: dict[int, LoadGenerator] = {}
        self._stop = threading.Event()
        # (job, placement) -> recent (t, steps) samples: rates are read over a trailing window, as progress reaches
        # the agents in steps of the workloads' progress-file writes
        self._progress: dict[tuple[str, str], list[tuple[float, float]]] = {}
        self._steps: dict[int, float] = {}  # training job -> the most progress any of its workloads has shown, steps
        self._lock = threading.Lock()

    # --- threads ------------------------------------------------------------------------------------
    def _calls(self, timeout: float = 5.0, attempts: int = 40) -> AllocatorClient:
        """The allocator client with this deadline per attempt and ``attempts`` tries in all: UNAVAILABLE and
        deadline misses are retried against the next replica (clients fail over between replicas)."""
        return self._client.options(deadline_s=timeout, retries=attempts - 1)

    def _watch(self, t0: float) -> None:
        after = "0"
        while not self._stop.is_set():
            # each stream lives 5 s at most (then reopens after the last event seen: WatchJobs is resumable); an
            # outage longer than the client's retries is waited out here, as long as the replay runs
            self._watcher = self._client.watch(after=after, stream_deadline_s=5.0)
            try:
                for ev in self._watcher:
                    after = ev.event_id
                    with self._lock:
                        i = self._by_id.get(ev.job_id)
                    if i is None:
                        continue
                    t = ev.time_s - t0
                    if ev.state is d.JobState.PLACED:
                        self.obs.first_start.setdefault(i, t)
                    elif ev.state.terminal:
                        self.obs.terminal[i] = state_to_pb(ev.state)
                        if ev.state is d.JobState.SUCCEEDED:
                            self.obs.completed[i] = t
                    if self._stop.is_set():
                        return
            except AllocatorError as exc:
                if exc.code not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                    raise
                time.sleep(0.1)

    def _sample(self, agents: list[NodeAgentClient], t0: float) -> None:
        window_end = max(j.arrival_s for j in self.jobs) / self.scale
        info = {j.index: j for j in self.jobs}
        svc_info = {s.index: s for s in self.services}
        while not self._stop.wait(self.sample_every_s):
            t = time.time() - t0
            try:
                cs = self._calls(timeout=2, attempts=1).cluster_state()
                lists = [a.workloads() for a in agents]
            except AllocatorError:
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
            running_where: dict[str, dict[str, str]] = {}
            endpoints: dict[str, str] = {}
            for node_name, workloads in zip(self.agents, lists, strict=True):
                for w in workloads:
                    if w.status not in ("starting", "running"):
                        continue
                    running_where.setdefault(w.job_id, {})[node_name] = w.placement_id
                    with self._lock:
                        i = self._by_id.get(w.job_id)
                        si = self._svc_by_id.get(w.job_id)
                    for gi in w.gpu_indices:
                        key = (node_name, gi)
                        share_run[key] = share_run.get(key, 0.0) + w.compute_share_pct
                    key = (w.job_id, w.placement_id)
                    prev = self._trailing(key, t, w.progress_steps)
                    if si is not None:
                        if w.endpoint:
                            endpoints[w.job_id] = w.endpoint
                        # served requests as a fraction of one whole GPU's rate: its effective utilisation
                        sv = svc_info[si]
                        if prev is not None and t > prev[0]:
                            frac = max(0.0, (w.progress_steps - prev[1]) / ((t - prev[0]) * sv.mu_full * self.scale))
                            for gi in w.gpu_indices:
                                eff[(node_name, gi)] = eff.get((node_name, gi), 0.0) + frac
                        continue
                    if i is None:
                        continue
                    j = info[i]
                    # achieved fraction of isolated speed (at its requested count) over the trailing window
                    if prev is None or t <= prev[0] or j.rate <= 0:
                        frac = 0.0
                    else:
                        frac = max(0.0, (w.progress_steps - prev[1]) / ((t - prev[0]) * j.rate * self.scale))
                    for gi in w.gpu_indices:
                        eff[(node_name, gi)] = eff.get((node_name, gi), 0.0) + _train_eff(j, len(w.gpu_indices), frac)
                    self._steps[i] = max(self._steps.get(i, 0.0), w.progress_steps)
            with self._lock:
                self._endpoints = endpoints
            for key, sh in share_run.items():
                if sh > 100.0 + 1e-6:
                    self.obs.violations.append(f"GPU {key} runs workloads with {sh}% share in total")
            for job_id, where in running_where.items():
                with self._lock:
                    i = self._by_id.get(job_id)
                    si = self._svc_by_id.get(job_id)
                one_gpu = (i is not None and info[i].num_gpus == 1) or si is not None
                if one_gpu and len(where) > 1 and self._overlap(agents, job_id, where):
                    self.obs.violations.append(f"job {job_id} runs on {sorted(where)} at once")
            G = max(len(gpus), 1)
            self.obs.samples.append((t, alloc / G, sum(min(1.0, v) for v in eff.values()) / G))
            if self.obs.work_at is None and t >= window_end:
                self.obs.work_at = (t, work_done_gpu_s(info, self._steps, set(self.obs.completed)))

    def _overlap(self, agents: list[NodeAgentClient], job_id: str, where: dict[str, str]) -> bool:
        """Whether a job seen running on several nodes in one sample did run on two at one instant. The agents
        are read one after another, so a job stopped on the first read and started on a later one shows on both;
        a second read of every node but the last that still finds the same placement running proves it ran
        through the later read (an agent never runs a placement twice)."""
        order = [n for n in self.agents if n in where]
        for node in order[:-1]:
            try:
                again = agents[self.agents.index(node)].workloads()
            except AllocatorError:
                return False
            if any(w.job_id == job_id and w.placement_id == where[node] and w.status in ("starting", "running")
                   for w in again):
                return True
        return False

    def _trailing(self, key: tuple[str, str], t: float, steps: float) -> tuple[float, float] | None:
        """Record (t, steps) of a workload and return its oldest sample within ``RATE_WINDOW_S`` before t (None
        for a first sample)."""
        hist = self._progress.setdefault(key, [])
        hist.append((t, steps))
        while len(hist) > 2 and hist[1][0] <= t - RATE_WINDOW_S:
            hist.pop(0)
        return hist[0] if len(hist) > 1 else None

    def _sample_services(self, t0: float) -> None:
        """Every half bin of model time: each live service's committed share and a scrape of its /metrics."""
        every = max(0.05, min(self.sample_every_s, BIN_S / self.scale / 2))
        while not self._stop.wait(every):
            for si, so in list(self.obs.services.items()):
                if not so.job_id or math.isfinite(so.cancelled):
                    continue
                if self.gateway_reports:
                    self._report_bins(si, so, t0)
                try:
                    job = self._calls(timeout=2.0, attempts=2).get(so.job_id)
                except AllocatorError:
                    continue
                t = time.time() - t0  # the scrape's time (after the allocator call, which may take a while)
                placed = job.state in SERVING and job.placement is not None and len(job.placement.slices) > 0
                share = job.placement.slices[0].compute_share_pct if placed else 0.0
                with self._lock:
                    ep = self._endpoints.get(so.job_id, "")
                m = None
                if placed and ep:
                    try:
                        m = scrape_metrics(ep, so.job_id)
                    except (OSError, ValueError):
                        so.scrape_errors += 1
                # a failed scrape is no outage (the next scrape's counters cover the interval); no replica is
                if m is not None and not math.isfinite(so.first_up):
                    so.first_up = t
                so.samples.append(ServiceSample(t, share, bool(placed and ep), ep, m))

    # --- services -----------------------------------------------------------------------------------
    def _submit_service(self, svc: ServiceJob, t0: float) -> None:
        rid = f"{self.run_id}-svc-{svc.index}"
        job = self._calls(timeout=2.0).submit(svc.spec, request_id=rid)
        so = ServiceObserved(job_id=job.job_id, submitted=time.time() - t0)
        with self._lock:
            self._svc_by_id[so.job_id] = svc.index
        self.obs.services[svc.index] = so

        def resolve(job_id: str = so.job_id) -> str | None:
            with self._lock:
                return self._endpoints.get(job_id)

        src = ProfileArrivals(svc.rates_rps, phase_bin=svc.phase_bin, bin_s=BIN_S, seed=self.seed * 1000 + svc.index)
        self._sources[svc.index] = src
        self._report_history(svc, so, src, t0)
        self._gens[svc.index] = LoadGenerator(src, resolve, self.scale, t0_wall=t0,
                                              model_start_s=so.submitted * self.scale, model_end_s=svc.end_s,
                                              resolve_every_s=0.0, name=svc.name).start()

    def _report_history(self, svc: ServiceJob, so: ServiceObserved, src: ProfileArrivals, t0: float) -> None:
        """Report the service's demand in the ``history_s`` before its submission, bin by bin, through
        ``Allocator.ReportDemand`` (as its gateway would): the request counts of the same arrival process the
        generator replays, the looped profile's previous period, which is the history the simulator's forecast
        reads at t = 0. Measured on the wall clock, like every demand report (the allocator divides by its time
        scale)."""
        if not self.history_s > 0:
            return
        now_bin = math.floor(so.submitted * self.scale / BIN_S)
        for b in range(now_bin - window_bins(self.history_s, BIN_S), now_bin):
            self._report_bin(so, src, b, t0)
            so.history_reports += 1
        so.reported_bin = now_bin - 1

    def _report_bin(self, so: ServiceObserved, src: ProfileArrivals, b: int, t0: float) -> None:
        """``ReportDemand`` of model-time bin ``b``: its arrivals per wall second over the bin's wall window."""
        w_wall = BIN_S / self.scale
        rate = len(src.bin_arrivals(b)) / w_wall
        end = round((t0 + (b + 1) * w_wall) * 1e6) / 1e6  # whole microseconds: a repeated bin has the same window end
        self._calls(timeout=2.0, attempts=3).report_demand(
            d.DemandReport(job_id=so.job_id, window_end_s=end, window_s=w_wall, request_rate_rps=rate))

    def _report_bins(self, si: int, so: ServiceObserved, t0: float) -> None:
        """Report every bin of a running service that ended since the last report (the arrivals the generator
        sent or tried to send in it, which a gateway counts), so that each minute reaches the forecaster."""
        src = self._sources.get(si)
        if src is None or so.reported_bin is None:
            return
        done = math.floor((time.time() - t0) * self.scale / BIN_S) - 1  # the last bin that has ended
        for b in range(so.reported_bin + 1, done + 1):
            try:
                self._report_bin(so, src, b, t0)
            except AllocatorError:
                return  # the next pass retries from this bin
            so.reported_bin = b
            so.gateway_reports += 1

    def _end_service(self, svc: ServiceJob, t0: float) -> None:
        so = self.obs.services[svc.index]
        so.cancelled = time.time() - t0
        gen = self._gens.pop(svc.index, None)
        if gen is not None:
            so.load = gen.stop()
        try:
            self._calls(timeout=2.0).cancel(so.job_id)
        except AllocatorError as exc:
            if exc.code is not grpc.StatusCode.FAILED_PRECONDITION:  # already terminal
                raise

    # --- run ----------------------------------------------------------------------------------------
    def run(self, timeout_s: float) -> Observed:
        """Submit every job (and service) on schedule, wait until all jobs are terminal and every service has
        ended (or ``timeout_s``), return what was seen.

        Raises:
            InvalidViolation: an invariant failed (also listed in ``Observed.violations``).
        """
        self._client = AllocatorClient(self.allocators, tls=self.tls, deadline_s=5.0, retries=39, backoff_s=0.05,
                                       max_backoff_s=0.5)
        agents = [NodeAgentClient(a, tls=self.tls, deadline_s=5.0) for a in self.agents]  # certificates only, no token
        t0 = time.time() + self.service_lead_s  # model time 0 (the services start serving before it)
        threads = [threading.Thread(target=self._watch, args=(t0,), daemon=True),
                   threading.Thread(target=self._sample, args=(agents, t0), daemon=True)]
        if self.services:
            threads.append(threading.Thread(target=self._sample_services, args=(t0,), daemon=True))
        for th in threads:
            th.start()
        last_print = -math.inf
        pending = sorted(self.jobs, key=lambda j: (j.arrival_s, j.index))
        svc_pending = sorted(self.services, key=lambda s: (s.start_s, s.index))
        svc_live: list[ServiceJob] = []
        try:
            while True:
                now = time.time() - t0
                while svc_pending and svc_pending[0].start_s / self.scale - self.service_lead_s <= now:
                    svc = svc_pending.pop(0)
                    self._submit_service(svc, t0)
                    svc_live.append(svc)
                for svc in [s for s in svc_live if s.end_s / self.scale <= now]:
                    svc_live.remove(svc)
                    self._end_service(svc, t0)
                while pending and pending[0].arrival_s / self.scale <= now:
                    j = pending.pop(0)
                    rid = f"{self.run_id}-{j.index}"
                    resp = self._calls(timeout=2.0).submit_job(j.spec, request_id=rid)
                    again = self._calls(timeout=2.0).submit_job(j.spec, request_id=rid)  # a client retry: the same job
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
                    self.out(self._progress_line(now, done))
                if not pending and done >= len(self.jobs) and not svc_pending and not svc_live:
                    break
                if now > timeout_s:
                    self.out(f"  timeout after {now:.0f} s: {len(self.jobs) - done} jobs not finished")
                    break
                time.sleep(0.05)
            for svc in svc_live:  # a timeout: end the services still running
                self._end_service(svc, t0)
            for i, job_id in self.obs.job_ids.items():
                job = self._calls().get(job_id)
                self.obs.restarts[i] = job.restarts
                if job.state.terminal:
                    self.obs.terminal[i] = state_to_pb(job.state)
                    if job.state is not d.JobState.SUCCEEDED:
                        self.obs.why_not_succeeded[i] = f"{job.state.name} {job.reason.name}: {job.message}"
            listed = [j.job_id for j in self._calls(timeout=10).list(page_size=1000)]
            mine = [x for x in listed if x in self._by_id]
            if len(mine) != len(set(mine)) or len(set(mine)) != len(self.obs.job_ids):
                self.obs.violations.append(f"ListJobs holds {len(mine)} of our jobs, {len(set(mine))} distinct, "
                                           f"{len(self.obs.job_ids)} submitted")
        finally:
            self._stop.set()
            for gen in self._gens.values():
                gen.stop()
            if self._watcher is not None:
                self._watcher.cancel()
            for th in threads:
                th.join(timeout=6)
            self._client.close()
            for a in agents:
                a.close()
        self.obs.wall_s = time.time() - t0 + self.service_lead_s
        return self.obs

    def _progress_line(self, now: float, done: int) -> str:
        s = self.obs.samples[-1] if self.obs.samples else (0, 0, 0)
        line = (f"  t={now * self.scale / 3600:6.2f} h (wall {now:5.1f} s)  submitted {len(self.obs.submitted):3d}/"
                f"{len(self.jobs)}  started {len(self.obs.first_start):3d}  done {done:3d}  "
                f"GPU share allocated {s[1]:5.1%}  effective {s[2]:5.1%}")
        for si, so in sorted(self.obs.services.items()):
            if so.samples and not math.isfinite(so.cancelled):
                x = so.samples[-1]
                svc = self.services[[v.index for v in self.services].index(si)]
                line += f"  | {svc.name} {svc.rate_at(now * self.scale):5.2f} rps share {x.share_pct:3.0f}%"
        return line


def live_result(policy: str, jobs: list[TraceJob], obs: Observed, time_scale: float, gpus: int,
                services: list[ServiceJob] | None = None):
    """What a replay observed as a ``simulator.engine.SimResult`` (virtual seconds), for ``summarise``; the
    services' SLO time comes from :func:`service_windows`."""
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
    slo_ok = slo_total = 0.0
    for svc in services or []:
        so = obs.services.get(svc.index)
        if so is None:
            continue
        sw = service_windows(svc, so, time_scale)
        slo_ok += sw["ok_s"]
        slo_total += sw["lifetime_s"]
    timeline = np.array([((t - t_first) * sc, a, e) for t, a, e in obs.samples]) if obs.samples else np.zeros((0, 3))
    return SimResult(policy=policy, arrival_s=arrival, first_start_s=start, completion_s=done,
                     num_gpus=np.array([j.num_gpus for j in jobs]), duration_s=np.array([j.duration_s for j in jobs]),
                     restarts_training=int(sum(obs.restarts.values())), restarts_inference=0, alloc_gpu_s=alloc,
                     eff_gpu_s=eff, window_end_s=window_end, work_in_window_gpu_s=work, slo_ok_s=slo_ok,
                     slo_total_s=slo_total, timeline=timeline, wall_s=obs.wall_s, rounds=0, events=0, gpus=gpus)
