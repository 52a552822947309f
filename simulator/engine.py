"""Discrete-event engine: virtual clock, events, ground-truth speeds, and the policy called each round.

Events (heap ordered by time, then kind, then sequence number -- deterministic):
``ARRIVAL`` (a job is queued), ``INF_END`` (an inference service is deleted), ``COMPLETE`` (a training
job finishes; stale completions are skipped by a per-job version), ``LOAD`` (inference demand changes:
the forecast the policy sees moves), ``WINDOW_END`` (snapshot of work done when arrivals end), ``ROUND``
(periodic scheduling round, for policies whose decisions change with time alone).
All events at one instant are processed first, then at most one scheduling round runs (coalesced).
Beside them, a restarting training job's ready time (end of its ``restart_s``) is kept on a heap of its own,
read only by the effective-utilisation accounting: the job does no work, and is credited none, until then.

Speeds are ground truth (:mod:`elastico.coloc.truth`); the policy sees only its estimate matrix.
A resize or a restart after preemption costs ``restart_s`` of zero progress for training (MPS limits are
fixed at launch: checkpoint, relaunch); inference resizes are make-before-break (no downtime, counted
as restarts). Every decision goes through the decision contract
(:func:`services.allocator.policy.contract.check`: a GPU never holds more than 100 % share or K tenants, a gang
keeps the node topology, ``SimConfig.node_gpus``, and runs at a GPU count its job allows...); a decision it
rejects any part of is a policy bug and stops the run (``OversubscribedError``; tests rely on it) rather than
being measured half-applied. The view handed to the policy is read-only: views of the engine's own arrays,
made once.
"""

from __future__ import annotations

import heapq
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from elastico.coloc.profiles import TypeTable, scaling_curve
from elastico.coloc.rates import compose_additive, compose_capped, share_speed, slot_sum
from elastico.coloc.truth import GroundTruth
from services.allocator.policy.baselines import Policy
from services.allocator.policy.contract import check
from services.allocator.policy.forecast import looped_forecast, window_bins
from services.allocator.policy.inference import slo_margin
from services.allocator.policy.shapes import count_speed, relative_tput
from services.allocator.policy.view import INFERENCE, TRAINING, ClusterView, JobTable, Topology, read_only
from simulator.traces import BIN_S, InferenceServices, TrainingJobs

ARRIVAL, INF_END, COMPLETE, LOAD, WINDOW_END, ROUND = range(6)
FUTURE, PENDING, RUNNING, DONE = range(4)


class OversubscribedError(AssertionError):
    """The decision contract rejected part of a decision (e.g. more than 100 % share or K tenants on a GPU)."""


@dataclass
class SimConfig:
    """Knobs of one simulation."""

    gpus: int  # cluster size
    node_gpus: int = 8  # GPUs per node: a gang that fits one node runs inside one, larger ones take whole nodes
    max_tenants: int = 4  # tenant slots per GPU (MPS share 25 % is the smallest shape)
    restart_s: float = 60.0  # training restart cost after preemption or resize, s
    round_interval_s: float = 300.0  # periodic rounds for time-driven policies, s
    load_tick_s: float = 300.0  # how often the inference forecast is refreshed, s
    forecast_window_s: float = 3600.0  # forecast = peak demand over this past window (about one Azure-profile period), s
    slo_factor: float = 10.0  # inference SLO, multiple of unloaded full-GPU service time
    max_sim_s: float = math.inf  # stop (jobs left are reported unfinished) after this virtual time
    # stop when no training job has run for this long after the last arrival and service end (the jobs
    # left can never start: reported unfinished), s
    stall_s: float = 30 * 86400.0
    timeline_points: int = 2000  # utilisation samples kept for plots
    progress: bool = False  # progress text on stderr


@dataclass
class SimResult:
    """Raw outcome of one run (metrics are computed in :mod:`simulator.metrics`)."""

    policy: str
    arrival_s: np.ndarray
    first_start_s: np.ndarray
    completion_s: np.ndarray  # NaN = unfinished
    num_gpus: np.ndarray
    duration_s: np.ndarray
    restarts_training: int
    restarts_inference: int
    alloc_gpu_s: float  # integral of allocated GPU fraction (GPUs x s) over [0, window_end]: compute granted
    eff_gpu_s: float  # integral of effective utilisation (GPUs x s) over [0, window_end]; useful work only
    window_end_s: float  # last arrival time (the loaded period)
    work_in_window_gpu_s: float  # isolated GPU-seconds of training work done in [0, window_end]
    slo_ok_s: float  # inference service time within SLO, s
    slo_total_s: float  # inference service lifetime, s
    timeline: np.ndarray  # [n, 3] (t, allocated fraction, effective fraction)
    wall_s: float
    rounds: int
    events: int
    gpus: int
    pricing_gaps: list = field(default_factory=list)
    cpu_s: float = float("nan")  # process CPU time of the run, s (wall_s inflates when the machine is shared)


class Engine:
    """One simulation of one policy on one workload."""

    def __init__(self, policy: Policy, types: TypeTable, truth: GroundTruth, train: TrainingJobs,
                 inf: InferenceServices | None, cfg: SimConfig):
        self.p, self.types, self.truth, self.cfg = policy, types, truth, cfg
        G, K = cfg.gpus, cfg.max_tenants
        Jt = len(train.arrival_s)
        Ji = 0 if inf is None else len(inf.start_s)
        N = Jt + Ji
        self.Jt, self.N, self.inf = Jt, N, inf
        self.kind = np.concatenate([np.zeros(Jt, np.int8), np.ones(Ji, np.int8)])
        self.type_idx = np.concatenate([train.type_idx, np.full(Ji, types.inference_index)]).astype(np.int64)
        self.num_gpus = np.concatenate([train.num_gpus, np.ones(Ji, int)]).astype(np.int64)
        self.arrival = np.concatenate([train.arrival_s, inf.start_s if Ji else np.zeros(0)])
        self.duration = np.concatenate([train.duration_s, np.full(Ji, np.nan)])
        self.end_inf = np.concatenate([np.full(Jt, np.nan), inf.end_s if Ji else np.zeros(0)])
        util = types.solo_util[self.type_idx].copy()
        if Ji:
            self.prof_scaled = [inf.demand(i) for i in range(Ji)]
            util[Jt:] = inf.mean_load()
            W = window_bins(cfg.forecast_window_s, BIN_S)
            # the shared forecaster on each looped profile (its previous period is the history before t=0), padded
            # into one array [Ji, longest profile] so a LOAD tick reads every live service's forecast at once
            self.roll_len = np.array([len(p) for p in self.prof_scaled], np.int64)
            self.roll_pad = np.zeros((Ji, int(self.roll_len.max())))
            for i, p in enumerate(self.prof_scaled):
                self.roll_pad[i, :len(p)] = looped_forecast(p, W)
        self.util = util
        # GPU-count shapes: a training job may run on another gang size (``shapes.allowed_counts``: halvings,
        # or growth between measured counts); its speed is then ``count_speed`` and each of its GPUs is busy
        # ``util x T(n)/n`` (per-GPU scaling efficiency, capped at 1) -- a 1-GPU profile's utilisation
        # diluted by the communication a larger gang waits on.
        self.scale = (types.scale_tput[self.type_idx] if types.scale_tput is not None
                      else np.tile(scaling_curve({}), (N, 1)))
        self.ngpu_run = np.zeros(N, np.int64)  # GPUs held while running (0 otherwise)
        self.cspeed = np.ones(N)  # speed factor of the running GPU count vs the requested one
        self.peff = np.ones(N)  # per-GPU scaling efficiency at the running count, <= 1
        self.work = np.nan_to_num(self.duration)  # isolated seconds of work (progress is in the same unit)
        self.progress = np.zeros(N)
        self.rate = np.zeros(N)  # progress seconds per wall second (= ground-truth normalised speed)
        self.norm = np.zeros(N)
        # interference factor each co-located training job is seen to run at (NaN: alone, or not running),
        # the figure node agents report live; only computed for policies that learn from it
        self.observe = bool(getattr(policy, "uses_observations", False))
        self.observed = np.full(N, np.nan)
        self.last_t = np.zeros(N)
        self.ready_at = np.zeros(N)
        self.state = np.full(N, FUTURE, np.int8)
        self.version = np.zeros(N, np.int64)
        self.first_start = np.full(N, np.nan)
        self.completion = np.full(N, np.nan)
        self.attained = np.zeros(N)
        self.att_t = np.zeros(N)
        self.share = np.zeros(N)
        self.queued_since = self.arrival.copy()
        self.last_change = np.zeros(N)
        self.restarts = np.zeros(N, np.int64)
        self.need_restart = np.zeros(N, bool)
        # a training job's share is its MPS compute limit (fixed at launch); under a policy with
        # ``unlimited_training`` only when it launched next to a service (elastico.coloc.rates.limited_slots);
        # the policy sees it (JobTable.limited)
        self.limited = np.ones(N, bool)
        self.unlimited_training = bool(getattr(policy, "unlimited_training", False))
        self.forecast = np.full(N, np.nan)
        self.gpus: list = [None] * N
        self.topo = Topology.uniform(G, cfg.node_gpus)
        for a in (self.topo.gpu_node, self.topo.node_start, self.topo.node_size):
            a.setflags(write=False)
        self.gpu_job = np.full((G, K), -1, np.int64)
        self.gpu_share = np.zeros((G, K))
        # the compute each tenant is granted (allocation): its share, 100 % for a training job without a limit
        self.gpu_grant = np.zeros((G, K))
        self._gpu_job_ro, self._gpu_share_ro = read_only(self.gpu_job), read_only(self.gpu_share)
        self.gpu_eff = np.zeros(G)  # effective utilisation of each GPU now (a restarting job adds 0)
        # (ready time, job) of restarting training jobs, for the effective-utilisation accounting alone: not
        # events (no round, no decision reads it); entries the job's state has since moved on from are skipped
        self.ready_heap: list = []
        self.ready_max = 0.0  # latest ready time set: from then on no training job is restarting
        self.pending: dict[int, None] = {}  # insertion-ordered set; re-queued jobs go by arrival (sorted per round)
        self.running: set[int] = set()
        # (running sorted, pending by arrival, their training jobs) as arrays, until either set changes
        # (set to None wherever they do): most rounds are periodic and see the same jobs
        self._members: tuple | None = None
        self.slo_seg_t = np.zeros(N)  # start of the current SLO accounting segment
        self.slo_cap = np.zeros(N)  # capacity (fraction of a full GPU) in the current segment
        self.slo_ok = 0.0
        self.slo_total = 0.0
        self.t = 0.0
        self.heap: list = []
        self.seq = 0
        self.alloc_int = 0.0
        self.eff_int = 0.0
        self.int_t = 0.0
        self.eff_t = 0.0
        self.window_end = float(train.arrival_s.max()) if Jt else 0.0
        self.work_window = None
        self.timeline: list = []
        self.restarts_inf = 0
        self.rounds = 0
        self.events = 0
        self.gaps: list = []
        self.remaining_est = np.full(N, np.nan)  # what the policy sees of each job's remaining work (see _round)
        # the policy's view of the jobs: read-only views of the arrays above (the engine keeps writing them);
        # nothing pinned to GPUs, every gang size of the policy's own menu allowed
        self.view_jobs = JobTable(*(read_only(a) for a in (
            self.kind, self.type_idx, self.num_gpus, self.arrival, np.ones(N), self.attained, self.share, self.util,
            self.forecast)), self.gpus, *(read_only(a) for a in (
                self.restarts, self.queued_since, self.remaining_est, self.last_change, self.observed)),
            limited=read_only(self.limited))
        self.margin = slo_margin(cfg.slo_factor)
        self._factors_memo: dict = {}  # (type, requested GPUs, count) -> (count speed, per-GPU efficiency)

    # ---- event plumbing -----------------------------------------------------------------------------
    def push(self, t: float, kind: int, j: int = -1, ver: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, j, ver))

    def _integrate(self, t: float) -> None:
        if t > self.int_t:
            hi = min(t, self.window_end)
            if hi > self.int_t:
                self.alloc_int += np.minimum(slot_sum(self.gpu_grant), 100.0).sum() / 100.0 * (hi - self.int_t)
            self.int_t = t
        self._integrate_eff(t)

    def _integrate_eff(self, t: float) -> None:
        """Effective utilisation up to t (its own cursor: ready times split it, never the allocation's)."""
        if t > self.eff_t:
            hi = min(t, self.window_end)
            if hi > self.eff_t:
                self.eff_int += self.gpu_eff.sum() * (hi - self.eff_t)
            self.eff_t = t

    def _set_ready(self, j: int, t: float) -> None:
        """Training job j restarts at t: no progress (:meth:`_advance`) nor effective utilisation until then."""
        self.ready_at[j] = t
        self.ready_max = max(self.ready_max, t)
        heapq.heappush(self.ready_heap, (t, j))

    def _ready_upto(self, t: float) -> None:
        """Start crediting every restarting job whose ready time is <= t: integrate up to that time, then
        recompute its GPUs' effective utilisation. Changes nothing a decision or a job's progress reads."""
        h = self.ready_heap
        while h and h[0][0] <= t:
            tr, j = heapq.heappop(h)
            if self.state[j] == RUNNING and self.ready_at[j] == tr:  # else stale: removed, or restart moved
                self._integrate_eff(tr)
                self._gpu_eff_of(self.gpus[j].tolist(), tr)

    # ---- inference demand and SLO accounting -------------------------------------------------------
    def _forecast_at(self, i, t: float):
        """Forecast load of inference service(s) ``i`` (index among the services, int or array) at ``t``."""
        return self.roll_pad[i, (self.inf.phase_bin[i] + int(t // BIN_S)) % self.roll_len[i]]

    def _slo_close(self, j: int, t: float) -> None:
        """Account [segment start, t) of service j at its segment capacity, and start a new segment."""
        t0 = self.slo_seg_t[j]
        if t > t0:
            i = j - self.Jt
            p = self.prof_scaled[i]
            ok = (self.slo_cap[j] - p >= self.margin - 1e-12).astype(float)
            ok = np.roll(ok, -int(self.inf.phase_bin[i]))
            P = len(ok)
            cum = np.concatenate([[0.0], np.cumsum(ok)])

            def F(x: float) -> float:
                k = int(math.floor(x))
                q, r = divmod(k, P)
                return q * cum[P] + cum[r] + (x - k) * ok[r]

            # integrated bin by bin: kept within the segment, so a rounding never lifts attainment past 1
            self.slo_ok += min(t - t0, BIN_S * (F(t / BIN_S) - F(t0 / BIN_S)))
            self.slo_total += t - t0
        self.slo_seg_t[j] = t

    # ---- ground truth speeds -----------------------------------------------------------------------
    def _gpu_norms(self, g: int, raw: dict | None = None) -> dict[int, float]:
        """Ground-truth normalised speed of each tenant of GPU g (before the gang min); with ``raw``, also
        ``raw[(g, job)]`` = its interference factor alone (before its MPS share's cap) where g is shared."""
        ten = self.gpu_job[g]
        m = ten >= 0
        js = ten[m]
        if len(js) == 0:
            return {}
        cap = None
        if self.p.mps_limits:
            lim = (self.kind[js] == TRAINING) & self.limited[js]
            if lim.any():
                cap = np.where(lim, share_speed(self.gpu_share[g][m], np.maximum(self.util[js], 1e-6)), 1.0)
        if len(js) == 1:
            out = np.ones(1)
        else:
            pm = self.truth.pairs(self.type_idx[js], self.util[js])
            out = compose_additive(pm) if cap is None else compose_capped(pm, cap)[1]
            if raw is not None:
                raw.update(((g, j), v) for j, v in zip(js.tolist(), out.tolist()))
        if cap is not None:
            out = np.minimum(out, cap)
        return dict(zip(js.tolist(), out.tolist()))

    def _refresh(self, gpus_touched: set[int], t: float) -> None:
        """Recompute ground-truth speeds of every job on the touched GPUs (and their gang pace)."""
        raw = {} if self.observe else None
        per_gpu = {g: self._gpu_norms(g, raw) for g in gpus_touched}
        jobs = set()
        for d in per_gpu.values():
            jobs.update(d)
        extra_gpus = set()
        for j in jobs:
            for g in self.gpus[j]:
                if g not in per_gpu:
                    per_gpu[g] = self._gpu_norms(int(g), raw)
                    extra_gpus.add(int(g))
        for j in jobs:
            nrm = min(per_gpu[int(g)][j] for g in self.gpus[j])
            if self.kind[j] == TRAINING:
                self._advance(j, t)
                self.norm[j] = nrm * self.cspeed[j]
                self._schedule_completion(j, t)
                if raw is not None:
                    seen = [raw[(int(g), j)] for g in self.gpus[j] if (int(g), j) in raw]
                    self.observed[j] = min(seen) if seen else np.nan
            else:
                if self.inf is not None:
                    self._slo_close(j, t)
                cap = self.share[j] / 100.0 * nrm if self.p.mps_limits else nrm
                self.norm[j] = nrm
                self.slo_cap[j] = cap
        self._gpu_eff_of(per_gpu, t)

    def _gpu_eff_of(self, gpus, t: float) -> None:
        """Recompute the effective utilisation of GPUs ``gpus`` at t: a training job's utilisation at its
        speed and scaling efficiency, 0 while it restarts (``ready_at > t``: no useful work); an inference
        service's load up to its capacity."""
        restarting = t < self.ready_max  # else no job restarts now: skip the mask
        for g in gpus:
            ten = self.gpu_job[g]
            js = ten[ten >= 0]
            if len(js) == 0:
                self.gpu_eff[g] = 0.0
                continue
            train = self.util[js] * self.norm[js] / self.cspeed[js] * self.peff[js]
            if restarting:
                train = train * (self.ready_at[js] <= t)
            contrib = np.where(self.kind[js] == TRAINING, train, np.minimum(self.util[js], self.slo_cap[js]))
            self.gpu_eff[g] = min(1.0, float(contrib.sum()))

    def _advance(self, j: int, t: float) -> None:
        """Bring training job j's progress up to time t."""
        if self.state[j] == RUNNING:
            t0 = max(self.last_t[j], self.ready_at[j])
            if t > t0:
                self.progress[j] = min(self.work[j], self.progress[j] + self.norm[j] * (t - t0))
        self.last_t[j] = t

    def _schedule_completion(self, j: int, t: float) -> None:
        self.version[j] += 1
        if self.norm[j] <= 0:
            return
        start = max(t, self.ready_at[j])
        eta = start + (self.work[j] - self.progress[j]) / self.norm[j]
        self.push(eta, COMPLETE, j, int(self.version[j]))

    # ---- applying a decision ------------------------------------------------------------------------
    def _remove(self, j: int, t: float) -> set[int]:
        gs = self.gpus[j]
        if self.kind[j] == TRAINING:
            self._advance(j, t)
        elif self.inf is not None:
            self._slo_close(j, t)
        self.attained[j] += self.ngpu_run[j] * max(0.0, t - self.att_t[j])
        for g in gs:
            row = self.gpu_job[g] == j
            self.gpu_job[g, row] = -1
            self.gpu_share[g, row] = 0.0
            self.gpu_grant[g, row] = 0.0
        self.gpus[j] = None
        self.ngpu_run[j] = 0
        self.share[j] = 0.0
        self.norm[j] = 0.0
        self.observed[j] = np.nan
        self.slo_cap[j] = 0.0
        self.version[j] += 1
        self.running.discard(j)
        self._members = None
        return set(int(g) for g in gs)

    def _place(self, j: int, gpus: np.ndarray, share: float, t: float) -> set[int]:
        """Start pending job ``j`` on ``gpus`` at ``share`` (accepted by the decision contract)."""
        gpus = np.array(gpus, np.int64)
        gpus.setflags(write=False)  # the policy sees it as JobTable.gpus[j]
        self._set_limit(j, gpus)
        for g in gpus:
            slot = np.flatnonzero(self.gpu_job[g] < 0)[0]
            self.gpu_job[g, slot] = j
            self.gpu_share[g, slot] = share
            self.gpu_grant[g, slot] = self._granted(j, share)
        self.pending.pop(j, None)
        self.running.add(j)
        self._members = None
        self.state[j] = RUNNING
        self.gpus[j] = gpus
        self.ngpu_run[j] = n = len(gpus)
        if self.kind[j] == TRAINING:
            self.cspeed[j], self.peff[j] = self._count_factors(j, n)
        self.share[j] = share
        self.last_change[j] = t
        self.att_t[j] = t
        self.last_t[j] = t
        if math.isnan(self.first_start[j]):
            self.first_start[j] = t
        if self.need_restart[j] and self.kind[j] == TRAINING:
            self._set_ready(j, t + self.cfg.restart_s)
            self.need_restart[j] = False
        if self.kind[j] == INFERENCE and self.inf is not None:
            self._slo_close(j, t)  # the pending segment (capacity 0) ends here
        return set(gpus.tolist())

    def _set_limit(self, j: int, gpus: np.ndarray) -> None:
        """Whether training job ``j``, launching on ``gpus``, runs under its share as a compute limit."""
        if self.unlimited_training and self.kind[j] == TRAINING:
            ten = self.gpu_job[gpus]
            self.limited[j] = bool((self.kind[ten[ten >= 0]] == INFERENCE).any())

    def _granted(self, j: int, share: float) -> float:
        """Compute job ``j`` is granted on each of its GPUs at ``share`` (allocation): a whole GPU without a limit."""
        return share if self.limited[j] or self.kind[j] != TRAINING else 100.0

    def _count_factors(self, j: int, n: int) -> tuple[float, float]:
        """(speed factor vs the requested count, per-GPU scaling efficiency) of training job ``j`` on ``n``
        GPUs, memoised per job type, request and count (the scaling curve is the type's)."""
        key = (int(self.type_idx[j]), int(self.num_gpus[j]), n)
        hit = self._factors_memo.get(key)
        if hit is None:
            cs = float(count_speed(self.scale[j], n, int(self.num_gpus[j])))
            hit = self._factors_memo[key] = (cs, min(1.0, cs * float(relative_tput(self.scale[j], self.num_gpus[j])) / n))
        return hit

    def _apply(self, d, view: ClusterView, t: float) -> None:
        """Apply decision ``d`` the policy took on ``view``: preemptions, resizes, placements."""
        d, rejected = check(d, view)
        if rejected:
            raise OversubscribedError("decision rejected: " + "; ".join(f"job {r}: {why}" for r, why in rejected))
        touched: set[int] = set()
        for j in d.preempt:
            touched |= self._remove(j, t)
            self.state[j] = PENDING
            self.pending[j] = None
            self._members = None
            self.queued_since[j] = t
            self.restarts[j] += 1
            self.need_restart[j] = True
        for j, sh in d.resize:
            if self.kind[j] == TRAINING:
                self._advance(j, t)
            self._set_limit(j, self.gpus[j])
            for g in self.gpus[j]:
                self.gpu_share[g, self.gpu_job[g] == j] = sh
                self.gpu_grant[g, self.gpu_job[g] == j] = self._granted(j, sh)
            self.share[j] = sh
            if self.p.mps_limits:
                self.restarts[j] += 1
                self.last_change[j] = t
                if self.kind[j] == TRAINING:
                    self._set_ready(j, t + self.cfg.restart_s)
                else:
                    self.restarts_inf += 1
            touched |= set(int(g) for g in self.gpus[j])
        for j, gpus, sh in d.place:
            touched |= self._place(int(j), gpus, float(sh), t)
        if touched:
            self._refresh(touched, t)
        if d.info.get("pricing", {}).get("gap") is not None:
            self.gaps.append(float(d.info["pricing"]["gap"]))

    # ---- the loop -----------------------------------------------------------------------------------
    def _round(self, t: float) -> None:
        if self._members is None:  # the sets changed since the last round
            run = np.fromiter(self.running, np.int64, len(self.running))
            run.sort()
            pend = np.fromiter(self.pending, np.int64, len(self.pending))
            if len(pend):
                pend = pend[np.lexsort((pend, self.arrival[pend]))]
            act = np.concatenate([run, pend])
            for a in (run, pend):
                a.flags.writeable = False  # handed to the policy, kept for the next rounds
            self._members = (run, pend, act[self.kind[act] == TRAINING])
        run, pend, tr = self._members
        if len(run):
            self.attained[run] += self.ngpu_run[run] * np.maximum(0.0, t - self.att_t[run])
            self.att_t[run] = t
        if len(tr):
            self.remaining_est[tr] = self.work[tr] - self.progress[tr]
        view = ClusterView(t, self._gpu_job_ro, self._gpu_share_ro, self.view_jobs, pend, run, self.types, self.topo)
        d = self.p.decide(view)
        self.rounds += 1
        self._apply(d, view, t)
        if not self.timeline or t - self.timeline[-1][0] > 0:
            G = self.cfg.gpus
            self.timeline.append((t, float(np.minimum(slot_sum(self.gpu_grant), 100).sum() / 100 / G),
                                  float(self.gpu_eff.sum() / G)))

    def run(self) -> SimResult:
        w0 = time.perf_counter()
        c0 = time.process_time()
        cfg = self.cfg
        for j in range(self.N):
            if self.kind[j] == TRAINING and self.num_gpus[j] > cfg.gpus:
                continue  # never schedulable on this cluster: reported unfinished
            self.push(float(self.arrival[j]), ARRIVAL, j)
            if self.kind[j] == INFERENCE and np.isfinite(self.end_inf[j]):
                self.push(float(self.end_inf[j]), INF_END, j)
        if self.inf is not None and len(self.inf.start_s):
            self.push(0.0, LOAD)
        self.push(self.window_end, WINDOW_END)
        train_left = int(((self.kind == TRAINING) & (self.num_gpus <= cfg.gpus)).sum())
        fixed_left = sum(1 for e in self.heap if e[1] in (ARRIVAL, INF_END))  # events no decision can move
        busy_t = 0.0  # last time a training job ran or a fixed event was still ahead
        last_print = time.perf_counter()
        next_round = math.inf
        while self.heap and train_left > 0:
            t = self.heap[0][0]
            # an arrival or service end ahead, or a running training job's completion, however far: not a stall
            if t > cfg.max_sim_s or (t - busy_t > cfg.stall_s and not fixed_left and not any(
                    self.kind[j] == TRAINING and self.norm[j] > 0 for j in self.running)):
                break
            if self.ready_heap:
                self._ready_upto(t)
            self._integrate(t)
            self.t = t
            dirty = False
            while self.heap and self.heap[0][0] == t:
                _, kind, _, j, ver = heapq.heappop(self.heap)
                self.events += 1
                fixed_left -= kind in (ARRIVAL, INF_END)
                if kind == ARRIVAL:
                    self.state[j] = PENDING
                    self.pending[j] = None
                    self._members = None
                    self.queued_since[j] = t
                    if self.kind[j] == INFERENCE:
                        self.slo_seg_t[j] = t
                        self.slo_cap[j] = 0.0
                        self.forecast[j] = self._forecast_at(j - self.Jt, t)
                    dirty = True
                elif kind == COMPLETE:
                    if ver != self.version[j] or self.state[j] != RUNNING:
                        continue
                    touched = self._remove(j, t)
                    self.progress[j] = self.work[j]
                    self.state[j] = DONE
                    self.completion[j] = t
                    train_left -= 1
                    self._refresh(touched, t)
                    dirty = True
                elif kind == INF_END:
                    if self.state[j] == RUNNING:
                        self._refresh(self._remove(j, t), t)
                    elif self.state[j] == PENDING:
                        self._slo_close(j, t)
                        self.pending.pop(j, None)
                        self._members = None
                    self.state[j] = DONE
                    dirty = True
                elif kind == LOAD:
                    st = self.state[self.Jt:]
                    live = np.flatnonzero((st == PENDING) | (st == RUNNING))
                    self.forecast[self.Jt + live] = self._forecast_at(live, t)
                    self.push(t + cfg.load_tick_s, LOAD)
                    # forecasts moved; periodic policies see them at their next ROUND (same 300-s grid)
                elif kind == WINDOW_END:
                    self._snapshot_work(t)
                elif kind == ROUND:
                    next_round = math.inf
                    dirty = True
            if dirty:
                self._round(t)
            if fixed_left or any(self.kind[j] == TRAINING for j in self.running):
                busy_t = t
            if self.p.needs_periodic_rounds and (self.pending or self.inf is not None) and next_round == math.inf:
                next_round = t + cfg.round_interval_s
                self.push(next_round, ROUND)
            if cfg.progress and time.perf_counter() - last_print > 2.0:
                last_print = time.perf_counter()
                done = self.Jt - train_left
                print(f"  [{self.p.name}] t={t / 3600:9.1f} h  done {done}/{self.Jt}  queued {len(self.pending)}  "
                      f"rounds {self.rounds}  {last_print - w0:5.1f} s", file=sys.stderr, flush=True)
        end = self.t
        if self.work_window is None:
            self._snapshot_work(min(end, self.window_end))
        self._ready_upto(max(end, self.window_end))
        self._integrate(max(end, self.window_end))
        if self.inf is not None:
            for j in range(self.Jt, self.N):
                if self.state[j] in (PENDING, RUNNING):
                    self._slo_close(j, end)
        tl = np.array(self.timeline) if self.timeline else np.zeros((0, 3))
        if len(tl) > cfg.timeline_points:
            tl = tl[np.linspace(0, len(tl) - 1, cfg.timeline_points).astype(int)]
        tr = self.kind == TRAINING
        return SimResult(
            policy=self.p.name, arrival_s=self.arrival[tr], first_start_s=self.first_start[tr],
            completion_s=self.completion[tr], num_gpus=self.num_gpus[tr], duration_s=self.duration[tr],
            restarts_training=int(self.restarts[tr].sum()), restarts_inference=self.restarts_inf,
            alloc_gpu_s=self.alloc_int, eff_gpu_s=self.eff_int, window_end_s=self.window_end,
            work_in_window_gpu_s=float(self.work_window), slo_ok_s=self.slo_ok, slo_total_s=self.slo_total,
            timeline=tl, wall_s=time.perf_counter() - w0, rounds=self.rounds, events=self.events,
            gpus=cfg.gpus, pricing_gaps=self.gaps, cpu_s=time.process_time() - c0)

    def _snapshot_work(self, t: float) -> None:
        for j in list(self.running):
            if self.kind[j] == TRAINING:
                self._advance(j, t)
        tr = self.kind == TRAINING
        self.work_window = float((self.num_gpus[tr] * self.progress[tr]).sum())
