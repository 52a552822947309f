"""Baseline policies, each implemented from its published description and named as such.

Shared conventions (documented once):

* **Inference services** are latency-sensitive and go first in every queue. Exclusive baselines
  (FIFO, backfill, Tiresias, Lucid) give each one whole GPU for its lifetime (static allocation sized for
  its peak, never preempted); ``mps-equal-share`` gives it one MPS replica like any pod.
* **Gang placement**: a multi-GPU job starts only when all its GPUs are available at once, inside one node
  when it fits one, else on whole nodes plus at most one partial node (:func:`placement.pick_gang`: the
  first node with room, lowest GPUs first).
* **Declared shapes**: a job that declares its shapes (``JobSpec.shapes``, live jobs only) is placed with
  one of them, never with the policy's own share (:func:`shapes.declared_share`): whole-GPU policies give
  it its largest declared share on a GPU of its own, ``mps-equal-share`` the declared share nearest its
  replica's 50 % on a replica, Lucid the one nearest 50 % when packing it (a declaring resident keeps a
  declared share).
* **Runtime estimates**: EASY backfilling and Lucid need job-duration estimates. They receive the true
  remaining isolated run time (``JobTable.remaining_est_s``), i.e. *perfect* estimates -- generous to the
  baselines, never the reverse. Tiresias and ElastiCo are non-clairvoyant.

Policies:

* :class:`ExclusiveFifo` -- static isolated allocation (the paper's reference): whole GPUs, strict
  first-come-first-served; the head job blocks the queue until enough GPUs are free.
* :class:`ExclusiveBackfill` -- EASY backfilling (Lifka 1995; Mu'alem & Feitelson 2001): the head job gets
  a reservation at the earliest time enough GPUs free up; later jobs may start now if they fit in the free
  GPUs and either finish before that reservation or use only GPUs the reservation does not need.
* :class:`Tiresias` -- Tiresias discretised 2D-LAS (Gu et al., NSDI'19): priority = attained service in
  GPU-seconds, discretised into queues by thresholds (default 1 h and 10 h of GPU time); FIFO within a
  queue; preemptive (a job in a higher queue displaces running lower ones; restart cost applies);
  starvation guard: a job queued longer than ``starve_factor`` x its executed time returns to queue 0.
* :class:`MpsEqualShare` -- NVIDIA k8s device plugin with MPS ``replicas=2``: every GPU exposes two
  replicas of 50 %; pods take replicas first-fit in submission order, interference-blind; like the
  Kubernetes scheduler, a pod that does not fit does not block later ones.
* :class:`LucidPacking` -- Lucid-style (Hu et al., ASPLOS'23) interference-aware packing without shapes
  or pricing: shortest-(estimated)-job-first queue; a job takes free whole GPUs when there are enough;
  otherwise (indolent packing: only under queueing) it is paired with a GPU hosting exactly one training
  job when the *predicted* speed of both stays above ``pack_floor``, choosing the pair with the highest
  predicted combined throughput. At most two tenants; no MPS limits (shares are accounting only).
"""

from __future__ import annotations

import numpy as np

from services.allocator.policy.placement import TenantState, first_free_gpus, pick_gang
from services.allocator.policy.shapes import any_declared, declared_share, shapes_of
from services.allocator.policy.view import INFERENCE, TRAINING, ClusterView, Decision, free_share, occupy, vacate


class Policy:
    """Base of every policy: ``decide(view) -> Decision``. Stateless across rounds unless stated."""

    name = "policy"
    mps_limits = False  # True when the shares it grants are enforced MPS limits (speed is capped by them)
    needs_periodic_rounds = False  # True when decisions change with time alone (ages, attained service)
    uses_observations = False  # True when it reads JobTable.observed_norm (the caller may skip computing it)

    def decide(self, view: ClusterView) -> Decision:  # pragma: no cover - interface
        raise NotImplementedError


def _inference_first(view: ClusterView, order: np.ndarray) -> np.ndarray:
    """Stable re-order putting inference services before training jobs."""
    k = view.jobs.kind[order]
    return np.concatenate([order[k == INFERENCE], order[k != INFERENCE]])


class ExclusiveFifo(Policy):
    """Strict FCFS on whole GPUs (head-of-line blocking). See module docstring."""

    name = "exclusive-fifo"

    def decide(self, view: ClusterView) -> Decision:
        d = Decision()
        gj, gs = view.scratch()
        free = int((gj < 0).all(axis=1).sum())
        topo = view.topo
        for j in _inference_first(view, view.pending):
            n = int(view.jobs.num_gpus[j])
            gpus = first_free_gpus(gj, n, topo) if n <= free else None
            if gpus is None:
                break
            share = declared_share(view.jobs, int(j), n, 100.0)  # a whole GPU: 100 % or its largest declared share
            occupy(gj, gs, j, gpus, share)
            free -= n
            d.place.append((int(j), gpus, share))
        return d


class ExclusiveBackfill(Policy):
    """EASY backfilling on whole GPUs, with perfect runtime estimates. See module docstring."""

    name = "exclusive-backfill"

    def decide(self, view: ClusterView) -> Decision:
        d = Decision()
        gj, gs = view.scratch()
        jobs = view.jobs
        free = int((gj < 0).all(axis=1).sum())
        order = _inference_first(view, view.pending)
        topo = view.topo
        i = 0
        # start jobs in order while they fit
        while i < len(order) and jobs.num_gpus[order[i]] <= free:
            j = order[i]
            n = int(jobs.num_gpus[j])
            gpus = first_free_gpus(gj, n, topo)
            if gpus is None:
                break
            share = declared_share(jobs, int(j), n, 100.0)
            occupy(gj, gs, j, gpus, share)
            free -= n
            d.place.append((int(j), gpus, share))
            i += 1
        if i >= len(order) or free == 0:
            return d
        head = order[i]
        need = int(jobs.num_gpus[head])
        # shadow time: when running jobs (and those just started) release enough GPUs for the head
        run = np.concatenate([view.running, np.array([p[0] for p in d.place], dtype=int)])
        run = run[jobs.kind[run] == TRAINING] if len(run) else run
        ends = np.nan_to_num(jobs.remaining_est_s[run], nan=np.inf)
        o = np.argsort(ends, kind="stable")
        cum = free + np.cumsum(jobs.num_gpus[run][o])
        k = int(np.searchsorted(cum, need))
        if k >= len(o):
            shadow, extra = np.inf, free  # head can never start from running releases alone
        else:
            shadow, extra = float(ends[o][k]), int(cum[k] - need)
        rest = order[i + 1:]
        rest = rest[jobs.num_gpus[rest] <= free]
        for j in rest:
            n = int(jobs.num_gpus[j])
            if n > free:
                continue
            est = jobs.remaining_est_s[j]
            if (np.isfinite(est) and est <= shadow) or n <= extra:
                gpus = first_free_gpus(gj, n, topo)
                if gpus is None:
                    continue
                if not (np.isfinite(est) and est <= shadow):
                    extra -= n
                share = declared_share(jobs, int(j), n, 100.0)
                occupy(gj, gs, j, gpus, share)
                free -= n
                d.place.append((int(j), gpus, share))
                if free == 0:
                    break
        return d


class Tiresias(Policy):
    """Discretised 2D-LAS, preemptive, exclusive GPUs. See module docstring."""

    name = "tiresias"
    needs_periodic_rounds = True

    def __init__(self, thresholds_gpu_s: tuple[float, ...] = (3600.0, 36000.0), starve_factor: float = 8.0):
        self.thresholds_gpu_s = np.asarray(thresholds_gpu_s, float)  # queue boundaries, GPU-seconds
        self.starve_factor = starve_factor  # queued time > factor x executed time -> back to queue 0

    def decide(self, view: ClusterView) -> Decision:
        d = Decision()
        jobs = view.jobs
        G = view.num_gpus
        cand = np.concatenate([view.running, view.pending])
        if len(cand) == 0:
            return d
        level = np.searchsorted(self.thresholds_gpu_s, jobs.attained_gpu_s[cand], side="right").astype(float)
        executed = jobs.attained_gpu_s[cand] / np.maximum(jobs.num_gpus[cand], 1)
        waiting = view.now_s - jobs.queued_since_s[cand]
        is_pending = np.arange(len(cand)) >= len(view.running)
        starving = is_pending & (executed > 0) & (waiting > self.starve_factor * executed)
        level = np.where(starving, 0.0, level)
        level = np.where(jobs.kind[cand] == INFERENCE, -1.0, level)
        # queue level, then arrival (FIFO within a queue); running first on ties to avoid churn
        o = np.lexsort((~is_pending, jobs.arrival_s[cand], level))
        cand = cand[o]
        n = jobs.num_gpus[cand]
        keep = np.zeros(len(cand), bool)
        left = G
        for idx in range(len(cand)):  # greedy in priority order (skip what does not fit)
            if n[idx] <= left:
                keep[idx] = True
                left -= int(n[idx])
                if left == 0:
                    break
        running = set(view.running.tolist())
        gj, gs = view.scratch()
        for j in cand[~keep]:
            if int(j) in running and jobs.kind[j] == TRAINING:
                d.preempt.append(int(j))
                vacate(gj, gs, int(j), jobs.gpus[j])
        for j in cand[keep]:
            if int(j) not in running:
                g = first_free_gpus(gj, int(jobs.num_gpus[j]), view.topo)
                if g is None:
                    continue
                share = declared_share(jobs, int(j), int(jobs.num_gpus[j]), 100.0)
                occupy(gj, gs, int(j), g, share)
                d.place.append((int(j), g, share))
        return d


class MpsEqualShare(Policy):
    """MPS replicas (2 x 50 %) per GPU, first-fit, interference-blind, non-blocking. See module docstring."""

    name = "mps-equal-share"
    mps_limits = True

    def __init__(self, replicas: int = 2):
        self.replicas = replicas  # MPS replicas per GPU (NVIDIA device plugin ``sharing.mps.replicas``)

    def decide(self, view: ClusterView) -> Decision:
        d = Decision()
        gj, gs = view.scratch()
        replica = 100.0 / self.replicas
        free_rep = self.replicas - (gj >= 0).sum(axis=1)
        total = int(free_rep.sum())
        declared = any_declared(view.jobs)  # shares other than a replica's: a replica must also have the room
        for j in _inference_first(view, view.pending):
            if total == 0:
                break
            n = int(view.jobs.num_gpus[j])
            share = declared_share(view.jobs, int(j), n, replica)  # a declaring job: its share nearest a replica's
            ok = free_rep > 0
            if declared:
                ok &= free_share(gs) >= share - 1e-9
            g = pick_gang(np.zeros(len(free_rep)), ok, n, view.topo)
            if g is None:
                continue
            occupy(gj, gs, int(j), g, share)
            free_rep[g] -= 1
            total -= n
            d.place.append((int(j), g, share))
        return d


class LucidPacking(Policy):
    """Lucid-style interference-aware pair packing (no shapes, no pricing). See module docstring."""

    name = "lucid"

    def __init__(self, estimate: np.ndarray, kappa: float, pack_floor: float = 0.6, slo_factor: float = 10.0):
        self.M = estimate  # [T, T] estimated pair matrix (policy's view, never ground truth)
        self.kappa = kappa  # contention factor for pairs without an estimate
        self.pack_floor = pack_floor  # both tenants must keep at least this predicted normalised speed
        self.slo_factor = slo_factor

    def decide(self, view: ClusterView) -> Decision:
        d = Decision()
        jobs = view.jobs
        gj, gs = view.scratch()
        pend = view.pending
        est = np.nan_to_num(jobs.remaining_est_s[pend], nan=np.inf)
        order = _inference_first(view, pend[np.argsort(est, kind="stable")])
        free = int((gj < 0).all(axis=1).sum())
        placed_now: dict[int, int] = {}
        state = None  # tenant interference state, built on the first packing attempt, refreshed on change
        failed: set = set()  # (type, gang size) that found no partner since the last change
        topo = view.topo
        declared = any_declared(jobs)
        for j in order:
            j = int(j)
            n = int(jobs.num_gpus[j])
            g = first_free_gpus(gj, n, topo) if n <= free else None
            if g is not None:
                share = declared_share(jobs, j, n, 100.0)
                occupy(gj, gs, j, g, share)
                free -= n
                placed_now[j] = len(d.place)
                d.place.append((j, g, share))
                if state is not None:
                    state.refresh(g, gj, gs * 0.0)
                failed.clear()
                continue
            if jobs.kind[j] == INFERENCE:
                continue
            # pack next to exactly one training tenant, if both are predicted to keep >= pack_floor
            one = ((gj >= 0).sum(axis=1) == 1)
            res = np.where(one, gj.max(axis=1), -1)
            one &= (res >= 0) & (jobs.kind[np.maximum(res, 0)] == TRAINING)
            share = declared_share(jobs, j, n, 50.0)  # 50 %, or a declaring job's declared share nearest it
            if share is None:
                continue
            key = (int(jobs.type_idx[j]), n) if share == 50.0 else (int(jobs.type_idx[j]), n, share)
            if one.sum() < n or key in failed:
                continue
            if state is None:
                state = TenantState(self.M, self.kappa, gj, gs * 0.0, jobs, False)
            pred = state.join(int(jobs.type_idx[j]), float(jobs.solo_util[j]), 100.0, 0.0, self.slo_factor)
            resident = pred.after.min(axis=1)
            ok = one & (pred.new_norm >= self.pack_floor) & (resident >= self.pack_floor)
            res_share = np.full(len(res), 50.0)
            if declared:  # a declaring resident goes to its declared share nearest 50 %; both must fit the GPU
                for gg in np.flatnonzero(ok):
                    r = int(res[gg])
                    if shapes_of(jobs, r):
                        cur = float(gs[gg, gj[gg] == r][0])
                        rs = declared_share(jobs, r, int(np.count_nonzero((gj == r).any(axis=1))), 50.0)
                        res_share[gg] = cur if rs is None else rs
                ok &= res_share + share <= 100.0 + 1e-9
            g = pick_gang(pred.new_norm + resident, ok, n, topo)
            if g is None:
                failed.add(key)
                continue
            for gg in g:  # accounting only: the two tenants split the GPU 50/50 (no MPS limits)
                r = int(res[gg])
                rs = float(res_share[gg])
                gs[gg, gj[gg] == r] = rs
                if r in placed_now:  # placed in this same round: place it at 50 % directly
                    k = placed_now[r]
                    d.place[k] = (r, d.place[k][1], rs)
                else:
                    d.resize.append((r, rs))
            occupy(gj, gs, j, g, share)
            d.place.append((j, g, share))
            state.refresh(g, gj, gs * 0.0)
            failed.clear()
        return d
