"""The ElastiCo policy: shapes -> elastic shadow pricing -> interference-aware gang placement.

One round (:meth:`ElastiCo.decide`), the same for the simulator and the live allocator. Gangs always keep
the node topology (:func:`placement.pick_gang`). Measurements behind every default: ``docs/results.md``.

1. **Inference first, training in the slack.** Each running service's MPS share is re-sized (in
   ``inference_shares_pct`` steps) to the smallest share that meets its SLO at its *forecast* load given
   the *predicted* interference of its current co-tenants (:mod:`inference`). A service alone on its GPU
   is sized for one training co-tenant instead, when that leaves at least the smallest training share
   free (``slack``): the share it then holds costs nothing, since the GPU's rest would idle, and a
   training job can join without breaking its SLO. Growing evicts the lowest-weight training tenants of
   the GPU (they requeue with their progress; restart cost applies) -- never the service. Shrinking waits
   ``shrink_after_s`` since the last change (MPS limits are fixed at launch). New services go to the GPU
   where they fit with every tenant above its floor, fullest GPU first.
2. **Pricing.** Queued training jobs (the ``max_candidates`` heaviest) offer their shape family
   (:mod:`shapes`: MPS shares 25/50/75/100 % whose speed keeps ``train_floor``, on their requested gang
   and on its halvings, ``shrink_gpus``). Utility of a shape = normalised speed x weight,

       weight = priority x (1 + waiting_s / age_scale_s) x size_term,
       size_term = 1 / (1 + num_gpus ** gang_exponent x remaining_s / size_scale_gpu_s)

   -- shortest remaining GPU-work first (a big gang counted super-linearly: it needs that many GPUs free
   at once), with a waiting-age factor that grows without bound (no starvation). Without runtime
   estimates the size term is least attained service (``las_scale_gpu_s``). Pools: free MPS share and
   free tenant slots; the pricer core solves "one shape or wait per job, maximise utility" and its prices
   are warm-started; only the head of the queue is priced (``price_depth``), and prices are re-solved at
   most every ``reprice_interval_s`` (in between, jobs best-respond to the posted prices).
3. **Placement.** In weight order, each priced job goes to the gang that maximises its predicted speed x
   weight minus the weighted speed its new training co-tenants lose (a service's slowdown is bounded by
   its SLO check instead), among GPUs where every tenant keeps its floor (training: ``train_floor`` of
   isolated speed or no worse than now; inference: SLO at forecast). A full gang is tried before a
   shrunk one; ties go to the fullest GPU, keeping whole GPUs free for gangs.
4. **Preemption by value, with hysteresis.** A waiting job that outweighs running ones by
   ``preempt_ratio`` empties the cheapest gang of GPUs whose tenants all ran ``min_run_s`` since their
   last change (victims keep their progress and pay ``restart_s``).
5. **Slack.** Jobs still waiting, lightest first, take the share services leave on GPUs hosting only
   services, as long as they keep ``slack_floor`` of their speed there (at most every
   ``slack_interval_s``: the slack moves with the services' forecasts, slowly).
6. **Elastic expand.** When nobody waits, share-capped jobs grow their share in place, and gangs grow
   onto idle GPUs up to their type's largest measured count (``elastic_gpus``; measured scaling curves,
   read pessimistically: :func:`shapes.count_speed`), most speed-up per added GPU first, when the time
   saved exceeds ``expand_gain`` restarts. When jobs wait, grown gangs lighter than them are given back,
   lightest first and only as many GPUs as the waiting jobs need, not within ``min_run_s`` of their last
   change.
7. **Observed interference corrects the estimate** (``learn_observed``, :meth:`ElastiCo.learn`): a
   training pair seen running together slower than estimated is not co-located again on the estimate's
   word.

Declared shapes (live jobs with ``JobSpec.shapes``, see :mod:`shapes`): such a job is priced and placed
in its declared shapes only -- its declared (GPU count, share) pairs replace the share menu and the
GPU-count shapes for it, in every pass (inference sizing, pricing, preemption, slack, share growth; gangs
never grow beyond what it declares).

State across rounds (all driven by the view's clock, so simulated runs stay deterministic): the posted
prices and when they were solved, when the preemption pass last ran, the estimate as corrected by
observations, and skip caches of rounds that would decide the same again.
"""

from __future__ import annotations

import math

import numpy as np

from services.allocator.policy.baselines import Policy
from services.allocator.policy.inference import required_share_pct, slo_margin
from elastico.coloc.rates import utilisation_rule
from services.allocator.policy.placement import (
    TenantState,
    pick_gang,
    predict_join,
    sub_gang,
    tenant_weights,
    weighted_loss,
)
from services.allocator.policy.pricing import choose_shapes
from services.allocator.policy.shapes import SHARES_PCT, any_declared, count_options, count_speed, declared_counts, declared_options, declared_share, declared_shares, grow_options, min_count, shape_speed_table, shapes_of
from elastico.coloc.rates import share_speed
from services.allocator.policy.view import INFERENCE, TRAINING, ClusterView, Decision, occupy, slot_all, slot_any, slot_max, vacate
from elastico.coloc.rates import slot_sum


class ElastiCo(Policy):
    """Shapes + shadow pricing + interference-aware placement. See module docstring."""

    name = "elastico"
    mps_limits = True
    needs_periodic_rounds = True

    def __init__(self, estimate: np.ndarray, kappa: float, train_floor: float = 0.7, slo_factor: float = 10.0,
                 age_scale_s: float = 86400.0, las_scale_gpu_s: float = 3600.0, max_candidates: int = 256,
                 max_attempts: int = 8, shrink_after_s: float = 1800.0, inference_headroom: float = 1.0,
                 shares_pct: tuple[int, ...] = SHARES_PCT, solver=None, use_estimates: bool = True,
                 size_scale_gpu_s: float = 3600.0, price_depth: float = 4.0, preempt_ratio: float = 2.0,
                 min_run_s: float = 1800.0, max_preempt_jobs: int = 4, restart_s: float = 60.0,
                 expand_gain: float = 4.0, reprice_interval_s: float = 3600.0, preempt_interval_s: float = 300.0,
                 elastic_gpus: bool = True, shrink_gpus: bool = True, min_count_speed: float = 0.25,
                 keep_heavy_growth: bool = True, gang_exponent: float = 1.5, learn_observed: bool = True,
                 pricing: bool = True, inference_shares_pct: tuple[int, ...] = tuple(range(5, 101, 5)),
                 slack: bool = True, slack_floor: float = 0.25, slack_interval_s: float = 1800.0):
        self.M = estimate  # [T, T] estimated pair matrix (NaN = utilisation rule)
        self.kappa = kappa  # contention factor of the rule
        self.train_floor = train_floor  # training floor, fraction of isolated speed (1 / max slowdown)
        self.slo_factor = slo_factor  # inference SLO, multiple of the unloaded full-GPU service time
        self.age_scale_s = age_scale_s  # waiting time that doubles a queued job's weight, s
        self.las_scale_gpu_s = las_scale_gpu_s  # attained GPU-seconds that halve a job's weight
        self.max_candidates = max_candidates  # queued jobs priced per round at most
        # placement predictions per round at most (bounded round cost): 8 measured the same avg JCT as 16
        # (64 GPUs @ 1: 198.0 vs 199.3 h; 512 @ 2: 99.0 vs 98.4 h) with 8 % less simulation time
        self.max_attempts = max_attempts
        self.shrink_after_s = shrink_after_s  # minimum time between an inference resize and a shrink, s
        self.inference_headroom = inference_headroom  # multiplier on the forecast load when sizing
        self.shares_pct = shares_pct
        self.solver = solver  # pricing solver with the signature of services.pricer.core.solve; None = in-process
        self.use_estimates = use_estimates  # use JobTable.remaining_est_s where finite (information parity)
        self.size_scale_gpu_s = size_scale_gpu_s  # remaining GPU-seconds that halve a job's weight
        self.price_depth = price_depth  # priced queue head: minimal demand up to this x the free share
        self.preempt_ratio = preempt_ratio  # a waiting job must outweigh a victim by this factor (> 1)
        self.min_run_s = min_run_s  # a job placed/resized less than this ago is never preempted or resized, s
        self.max_preempt_jobs = max_preempt_jobs  # waiting jobs served by preemption per round at most
        self.restart_s = restart_s  # restart cost of a resize/preemption the policy assumes, s
        self.expand_gain = expand_gain  # expand only if the predicted saving exceeds this x restart_s
        self.reprice_interval_s = reprice_interval_s  # re-solve prices at most this often; 0 = every round, s
        self.preempt_interval_s = preempt_interval_s  # run the preemption pass at most this often, s
        self.elastic_gpus = elastic_gpus  # GPU-count shapes: grow gangs onto idle GPUs, give them back (6)
        self.shrink_gpus = shrink_gpus  # also offer queued jobs shapes on halvings of their gang (needs elastic_gpus)
        self.min_count_speed = min_count_speed  # a shrunk gang must keep at least this of its isolated speed
        self.keep_heavy_growth = keep_heavy_growth  # give back only grown gangs lighter than a waiting job
        self.gang_exponent = gang_exponent  # size term counts a job's GPUs as num_gpus ** this (see 2.)
        # learn_observed: lower estimates of pairs seen running together slower (:meth:`learn`); the engine
        # computes JobTable.observed_norm only for a policy that uses it
        self.uses_observations = learn_observed
        self.pricing = pricing  # shadow prices choose the shapes; False = each job its best shape (ablation)
        self.inference_shares_pct = inference_shares_pct  # shares a service is sized in, percent (ascending)
        self.slack = slack  # size lone services for a training co-tenant and fill that slack with waiting jobs
        self.slack_floor = slack_floor  # a job placed in a service's slack keeps at least this of its speed
        self.slack_interval_s = slack_interval_s  # the slack pass runs at most this often, s
        self._counts_cache: dict = {}  # (type table, type, requested GPUs) -> (allowed counts, speeds)
        self._prices: np.ndarray | None = None
        self._priced_at_s = -np.inf  # when the posted prices were last solved, s
        self._preempt_checked_s = -np.inf  # when the preemption pass last ran, s
        self._idle_sig: tuple | None = None  # (raw, filtered) state of the last round whose training pass placed nothing
        self._inf_key: tuple | None = None  # (whole cluster, services' GPUs) of the last round whose inference pass changed nothing
        self._inf_recheck_s = np.inf  # when a deferred inference shrink becomes due, s
        self._state_cache: tuple | None = None  # (inputs, TenantState) of the last training placement state
        self._learn_due = False  # this round's readings not yet learnt (:meth:`learn`)
        self._slack_sig: tuple | None = None  # state of the last slack pass that placed nobody
        self._slack_checked_s = -np.inf  # when the slack pass last ran (at most every slack_interval_s), s

    # ------------------------------------------------------------------------------------------------
    def weights(self, view: ClusterView, idx: np.ndarray) -> np.ndarray:
        """Utility weight of jobs ``idx`` (see module docstring)."""
        j = view.jobs
        wait = np.where(j.share_pct[idx] > 0, 0.0, np.maximum(view.now_s - j.queued_since_s[idx], 0.0))
        size = 1.0 / (1.0 + j.attained_gpu_s[idx] / self.las_scale_gpu_s)
        if self.use_estimates:
            rem = j.remaining_est_s[idx]
            known = np.isfinite(rem)
            if known.any():
                gpus = j.num_gpus[idx] ** self.gang_exponent
                srpt = 1.0 / (1.0 + gpus * np.maximum(np.where(known, rem, 0.0), 0.0) / self.size_scale_gpu_s)
                size = np.where(known, srpt, size)
        return j.priority[idx] * (1.0 + wait / self.age_scale_s) * size

    def learn(self, view: ClusterView) -> int:
        """Lower the estimate of each training pair seen running together slower than predicted.

        A job alone on one GPU next to one other training job is a clean measurement of the pair (a next to
        b): when its observed interference factor (``JobTable.observed_norm``) is below ``M[a, b]`` (or
        there is no estimate), it replaces ``M[a, b]`` for every later prediction, so a pair the predictor
        overrates is co-located once, not again and again. Only downwards: a pair that runs better than
        predicted was already placed, so raising it mostly re-shuffles placements (measured: neutral to
        0.3 % worse avg JCT with the bench's estimate). GPUs with more tenants or an inference service, and
        jobs on several GPUs, are not decomposed. The matrix is replaced, never written in place: the
        caller's estimate (shared with other policies) is untouched and cached placement states keyed on
        it go stale. The training pass calls it once a round, only when it is about to try placements (a
        round that repeats one that placed nobody needs no new estimate): same decisions as every round,
        at a fraction of the cost. Returns the number of entries changed.
        """
        obs = view.jobs.observed_norm
        if obs is None:
            return 0
        jobs, gj = view.jobs, view.gpu_job
        two = slot_sum((gj >= 0).view(np.int8)) == 2
        if not two.any():
            return 0
        pair = np.sort(gj[two], axis=1)[:, -2:]
        pair = pair[(jobs.kind[pair] == TRAINING).all(axis=1)]
        x = np.concatenate([pair[:, 0], pair[:, 1]])  # observed job
        y = np.concatenate([pair[:, 1], pair[:, 0]])  # its co-tenant
        keep = np.isfinite(obs[x])
        keep[keep] = [len(jobs.gpus[i]) == 1 for i in x[keep]]  # alone on one GPU
        ta, tb, v = jobs.type_idx[x[keep]], jobs.type_idx[y[keep]], obs[x[keep]]
        new = ~(self.M[ta, tb] <= v + 1e-9)  # overrated, or no estimate (NaN)
        if not new.any():
            return 0
        M = self.M.copy()
        M[ta[new], tb[new]] = v[new]
        self.M = M
        self._idle_sig = self._inf_key = None
        return int(new.sum())

    def decide(self, view: ClusterView) -> Decision:
        d = Decision()
        self._learn_due = self.uses_observations  # once per round, when the training pass first looks at the cluster
        jobs = view.jobs
        gj, gs = view.scratch()
        N = len(jobs.kind)
        W = np.zeros(N)
        act = np.concatenate([view.running, view.pending])
        if len(act):
            W[act] = self.weights(view, act)
        W[jobs.kind == INFERENCE] = 1e6  # inference is never the tenant to sacrifice
        self._inference(view, gj, gs, W, d)
        queued = view.pending[jobs.kind[view.pending] == TRAINING]
        queued = queued[jobs.num_gpus[queued] <= view.num_gpus]  # queued training jobs that fit the cluster
        self._training(view, gj, gs, W, d, queued)
        waiting = self._waiting_training(queued, d)
        if len(waiting) and self._count_shapes(view) and self._give_back(view, gj, gs, W, d, waiting):
            self._idle_sig = None
            self._training(view, gj, gs, W, d, queued)
            waiting = self._waiting_training(queued, d)
        if len(waiting) and view.now_s - self._preempt_checked_s >= self.preempt_interval_s:
            self._preempt_checked_s = view.now_s
            preempted = self._preempt(view, gj, gs, W, d, waiting)
        else:
            preempted = False
        if preempted:
            self._idle_sig = None
            self._training(view, gj, gs, W, d, queued)  # fill what the victims left beyond the served gangs
            waiting = self._waiting_training(queued, d)
        if len(waiting) and self.slack and view.now_s - self._slack_checked_s >= self.slack_interval_s:
            self._slack_checked_s = view.now_s
            self._fill_slack(view, gj, gs, W, d, waiting)
            waiting = self._waiting_training(queued, d)
        if len(waiting) == 0:
            self._expand(view, gj, gs, d)
        elif self.keep_heavy_growth and self._count_shapes(view):
            # GPUs left empty with jobs waiting (gangs too big for them): jobs heavier than every waiting
            # one may grow onto them, as they would keep them at the next give-back
            run = view.running[jobs.kind[view.running] == TRAINING]
            self._regrow(view, gj, gs, d, run[W[run] > W[waiting].max()])
        return d

    @staticmethod
    def _waiting_training(queued: np.ndarray, d: Decision) -> np.ndarray:
        """Queued training jobs (``queued``: those that fit the cluster) left unplaced by this round so far."""
        if d.place and len(queued):
            placed = np.zeros(int(max(queued.max(), max(p[0] for p in d.place))) + 1, bool)
            placed[[p[0] for p in d.place]] = True
            return queued[~placed[queued]]
        return queued

    # ------------------------------------------------------------------------------------------------
    def _evict_for(self, view, gj, gs, W, g: int, need_pct: float, d: Decision) -> bool:
        """Preempt lowest-weight training tenants of GPU ``g`` until ``need_pct`` share is free."""
        jobs = view.jobs
        ten = [int(t) for t in gj[g] if t >= 0 and jobs.kind[t] == TRAINING]
        ten.sort(key=lambda t: W[t])
        for t in ten:
            if 100.0 - gs[g].sum() >= need_pct - 1e-9 and (gj[g] < 0).any():
                break
            d.preempt.append(t)
            vacate(gj, gs, t, jobs.gpus[t])
        return 100.0 - gs[g].sum() >= need_pct - 1e-9 and bool((gj[g] < 0).any())

    def _inference(self, view: ClusterView, gj, gs, W, d: Decision) -> None:
        jobs = view.jobs
        run = view.running[jobs.kind[view.running] == INFERENCE]
        pend = view.pending[jobs.kind[view.pending] == INFERENCE]
        # same services on the same GPUs, next to the same tenants with the same shares and forecasts, as a
        # round that changed nothing, before any deferred shrink is due: the pass would decide the same
        # (nothing) again. Such a round had no service queued, and with none queued the pass reads only the
        # services' own GPUs (tenants' weights only order evictions, which are a change), so changes on
        # other GPUs do not invalidate it.
        # (Checked on the whole cluster first, which is cheaper and usually enough.)
        forecasts = jobs.load_forecast[run].tobytes()
        whole = (gj.tobytes(), gs.tobytes(), run.tobytes(), forecasts, pend.tobytes())
        key = None
        if self._inf_key is not None and view.now_s < self._inf_recheck_s:
            if whole == self._inf_key[0]:
                return
            key = self._services_key(jobs, gj, gs, run, forecasts, pend)
            if key == self._inf_key[1]:
                return
        n_before = len(d.place) + len(d.resize) + len(d.preempt)
        recheck = np.inf
        if len(run):
            g_of = np.fromiter((jobs.gpus[j][0] for j in run.tolist()), np.int64, len(run))
            rows = np.unique(g_of)
            # interference of the current co-tenants, on the services' GPUs only (an inference slot's
            # predicted speed is 1 / (1 + sum of its co-tenants' extra time); no MPS cap on inference)
            st = TenantState(self.M, self.kappa, gj[rows], gs[rows], jobs, True)
            pos = np.searchsorted(rows, g_of)
            slot_mask = gj[g_of] == run[:, None]
            has = slot_mask.any(axis=1)
            slot = np.argmax(slot_mask, axis=1)
            nu = 1.0 / (1.0 + st.extra[pos, slot])
            cur = gs[g_of, slot]
            load = jobs.load_forecast[run] * self.inference_headroom
            reqs = required_share_pct(load, self.slo_factor, nu, self.inference_shares_pct)
            alone = has & (st.extra[pos, slot] == 0)
            if self.slack and alone.any():
                room = self._slack_share(load[alone], jobs.solo_util[run][alone])
                reqs[alone] = np.where(np.isfinite(room), np.maximum(reqs[alone], room), reqs[alone])
            if any_declared(jobs):  # a declaring service: its smallest declared share meeting the SLO, else its largest
                for k, j in enumerate(run.tolist()):
                    if shapes_of(jobs, j):
                        own = declared_shares(jobs, j, 1)
                        reqs[k] = required_share_pct(load[k:k + 1], self.slo_factor, nu[k:k + 1], own)[0] if own else cur[k]
            grow = has & (reqs > cur + 1e-9)
            shrink = has & (reqs < cur - 1e-9) & (view.now_s - jobs.last_change_s[run] >= self.shrink_after_s)
            later = has & (reqs < cur - 1e-9) & ~shrink
            if later.any():
                recheck = float((jobs.last_change_s[run][later] + self.shrink_after_s).min())
            for k in np.flatnonzero(grow | shrink):
                j, g, sl, req = int(run[k]), int(g_of[k]), int(slot[k]), float(reqs[k])
                if grow[k]:
                    c = float(cur[k])
                    gs[g, sl] = 0.0
                    if not self._evict_for(view, gj, gs, W, g, req, d):
                        req = max(c, min(req, 100.0 - float(gs[g].sum())))
                        if shapes_of(jobs, j):  # the largest declared share that fits, else the current one
                            req = max((x for x in declared_shares(jobs, j, 1) if c <= x <= req + 1e-9), default=c)
                    gs[g, sl] = req
                    if req != c:
                        d.resize.append((j, req))
                else:
                    gs[g, sl] = req
                    d.resize.append((j, req))
        for j in pend:
            j = int(j)
            load = float(jobs.load_forecast[j] * self.inference_headroom)
            placed = False
            own = shapes_of(jobs, j) != ()  # a declaring service: its declared shares (on one GPU) only
            menu = self.inference_shares_pct if not own else declared_shares(jobs, j, 1)
            if not menu:
                continue
            for share in menu:
                if share / 100.0 - load < slo_margin(self.slo_factor) - 1e-9:
                    continue
                pred = predict_join(self.M, self.kappa, gj, gs, jobs, view.types.inference_index, load, share,
                                    True, self.train_floor, self.slo_factor)
                cap_ok = share / 100.0 * pred.new_norm - load >= slo_margin(self.slo_factor) - 1e-9
                ok = pred.slot_free & (pred.share_free >= share - 1e-9) & pred.tenant_ok & cap_ok
                g = pick_gang(-pred.share_free + pred.new_norm, ok, 1)
                if g is not None:
                    if self.slack and not own and not (gj[g[0]] >= 0).any():  # alone: leave room for a training co-tenant
                        room = float(self._slack_share(np.array([load]), jobs.solo_util[[j]])[0])
                        share = max(share, room) if np.isfinite(room) else share
                    occupy(gj, gs, j, g, float(share))
                    d.place.append((j, g, float(share)))
                    placed = True
                    break
            if not placed:  # LS service first: clear the GPU whose training tenants weigh least
                req = float(required_share_pct(load, self.slo_factor, 1.0, menu))
                tw = np.where(gj >= 0, W[np.maximum(gj, 0)], 0.0).sum(axis=1)
                tw[(gj >= 0).any(axis=1) & (np.where(gj >= 0, jobs.kind[np.maximum(gj, 0)], 0) == INFERENCE).any(axis=1)] = np.inf
                g = int(np.argmin(tw))
                if np.isfinite(tw[g]):
                    for t in [int(t) for t in gj[g] if t >= 0]:
                        d.preempt.append(t)
                        vacate(gj, gs, t, jobs.gpus[t])
                    occupy(gj, gs, j, np.array([g]), req)
                    d.place.append((j, np.array([g]), req))
        unchanged = len(d.place) + len(d.resize) + len(d.preempt) == n_before
        if unchanged and len(pend) == 0:
            self._inf_key = (whole, key or self._services_key(jobs, gj, gs, run, forecasts, pend))
        else:
            self._inf_key = None
        self._inf_recheck_s = recheck

    def _slack_share(self, load: np.ndarray, util: np.ndarray) -> np.ndarray:
        """[n] smallest inference share keeping the SLO at ``load`` next to one training co-tenant of at most
        the complement's utilisation (the estimate's rule for an unmeasured inference pair), where that
        complement is at least the smallest training share; NaN where there is none (the service then gets
        what it needs alone)."""
        sh = np.asarray(self.inference_shares_pct, float) / 100.0
        comp = 1.0 - sh
        nu = utilisation_rule(np.asarray(util, float)[:, None], comp[None, :], self.kappa)
        ok = ((sh[None, :] * nu - np.asarray(load, float)[:, None] >= slo_margin(self.slo_factor) - 1e-9)
              & (comp[None, :] * 100.0 >= min(self.shares_pct) - 1e-9))
        return np.where(ok.any(axis=1), sh[np.argmax(ok, axis=1)] * 100.0, np.nan)

    def _fill_slack(self, view: ClusterView, gj, gs, W, d: Decision, waiting: np.ndarray) -> None:
        """Waiting training jobs, lightest first, take the share services leave on GPUs hosting only services:
        the largest training share that fits, where the services keep their SLO and the job at least
        ``slack_floor`` of its speed (that share would idle otherwise). Lightest first: a long job that would
        wait long anyway gains most from slow progress, while a short one waits for a full-speed place."""
        jobs = view.jobs
        occ = gj >= 0
        svc = occ & (jobs.kind[np.where(occ, gj, 0)] == INFERENCE)
        free = 100.0 - slot_sum(gs)
        small = float(min(self.shares_pct))
        rows = np.flatnonzero(slot_any(svc) & ~slot_any(occ & ~svc) & slot_any(~occ) & (free >= small - 1e-9))
        if len(rows) == 0:
            return
        # the same slack next to the same services, offered to the same queue, as a pass that placed nobody
        sig = (rows.tobytes(), gj[rows].tobytes(), gs[rows].tobytes(), waiting.tobytes(),
               jobs.load_forecast[np.where(gj[rows] >= 0, gj[rows], 0)].tobytes())
        if sig == self._slack_sig:
            return
        placed_before = len(d.place)
        state = TenantState(self.M, self.kappa, gj[rows], gs[rows], jobs, True)
        failed: set = set()
        attempts = 0
        shares = sorted(self.shares_pct, reverse=True)

        def rooms() -> dict:  # slack GPUs with room for each share
            return {sh: int((free[rows] >= sh - 1e-9).sum()) for sh in shares}

        n_room = rooms()
        for j in waiting[np.argsort(W[waiting], kind="stable")].tolist():
            if attempts >= self.max_attempts or n_room[small] == 0:
                break
            n, t, u = int(jobs.num_gpus[j]), int(jobs.type_idx[j]), float(jobs.solo_util[j])
            own = shapes_of(jobs, j) != ()  # a declaring job: its declared shares on its gang, largest first
            for share in (shares if not own else sorted(declared_shares(jobs, j, n), reverse=True)):
                key = (t, n, share)
                room_n = n_room[share] if not own else int((free[rows] >= share - 1e-9).sum())
                if key in failed or room_n < n or share / 100.0 < self.slack_floor * u - 1e-9:
                    continue
                attempts += 1
                pred = state.join(t, u, float(share), self.train_floor, self.slo_factor)
                feas = (pred.slot_free & (pred.share_free >= share - 1e-9) & pred.tenant_ok
                        & (pred.new_norm >= self.slack_floor - 1e-9))
                gl = pick_gang(pred.new_norm, feas, n, view.topo, rows)
                if gl is None:
                    failed.add(key)
                    continue
                g = rows[gl]
                occupy(gj, gs, j, g, float(share))
                d.place.append((j, g, float(share)))
                free[g] -= share
                n_room = rooms()
                state.refresh(gl, gj[rows], gs[rows])
                break
        self._slack_sig = sig if len(d.place) == placed_before else None

    @staticmethod
    def _services_key(jobs, gj, gs, run: np.ndarray, forecasts: bytes, pend: np.ndarray) -> tuple:
        """What the inference pass reads when no service is queued (see :meth:`_inference`)."""
        occ = gj >= 0
        inf_rows = slot_any(occ & (jobs.kind[np.where(occ, gj, 0)] == INFERENCE)).nonzero()[0]
        return (run.tobytes(), inf_rows.tobytes(), gj[inf_rows].tobytes(), gs[inf_rows].tobytes(), forecasts,
                pend.tobytes())

    def _training(self, view: ClusterView, gj, gs, W, d: Decision, queued: np.ndarray) -> None:
        jobs = view.jobs
        pend = self._waiting_training(queued, d)
        if len(pend) == 0:
            return
        # nothing changed since a round that could place nobody (same tenants, same queue): skip even the
        # filters below -- most rounds of a busy cluster are such repeats
        tenants = (gj.tobytes(), gs.tobytes())
        early = (*tenants, pend.tobytes())
        if self._idle_sig is not None and early == self._idle_sig[0]:
            return  # (a reading taken meanwhile is learnt when something changes: only a placement needs it)
        if self._learn_due:
            self._learn_due = False
            self.learn(view)
        unused = 100.0 - slot_sum(gs)  # [G] unallocated share, percent
        slot_open = slot_any(gj < 0)  # [G] GPUs with a free tenant slot
        gfree = np.maximum(unused, 0.0)
        # smallest share any queued job may take: the menu's, or a declared one below it
        decl = any_declared(jobs)
        dmin = self._declared_min_share(jobs, pend) if decl else None
        min_sh = min(self.shares_pct) if dmin is None else min(min(self.shares_pct), dmin)
        open_gpu = (gfree >= min_sh - 1e-9) & slot_open
        free_share = float(gfree[open_gpu].sum())
        free_slots = int((gj < 0).sum())
        n_open = int(open_gpu.sum())
        if n_open == 0 or free_slots == 0:
            return
        nmin = self._min_gpus(view, pend)
        keep = nmin <= n_open  # a gang larger than the GPUs with room cannot start now
        pend, nmin = pend[keep], nmin[keep]
        if len(pend) == 0:
            return
        # a job fits only if enough GPUs have a free slot and room for its smallest feasible share (shares
        # ascend, so no larger share fits either): drops, cheaply, every job that cannot start this round
        sh = np.asarray(self.shares_pct, float)
        room = np.where(slot_open, gfree, 0.0)
        n_room = (room[None, :] >= sh[:, None] - 1e-9).sum(axis=1)  # [S] GPUs with room for each share
        _, okp = shape_speed_table(jobs.solo_util[pend], self.train_floor, self.shares_pct)
        fits_now = n_room[np.argmax(okp, axis=1)] >= nmin
        if decl:  # a declaring job: room for its smallest declared share on as many GPUs as its smallest count
            for i, j in enumerate(pend.tolist()):
                if shapes_of(jobs, j):
                    smallest = min(s.compute_share_pct for s in shapes_of(jobs, j))
                    fits_now[i] = int((room >= smallest - 1e-9).sum()) >= nmin[i]
        pend = pend[fits_now]
        if len(pend) == 0:
            return
        # nothing changed since a round that could place nobody: the same attempt would fail again
        sig = (*tenants, pend.tobytes())
        if self._idle_sig is not None and sig == self._idle_sig[1]:
            return
        placed_before = len(d.place)
        w = W[pend]
        top = np.argsort(-w, kind="stable")[: self.max_candidates]
        # price only the head of the queue: candidates whose minimal demand covers price_depth x the free
        # share (the rest cannot win capacity this round)
        sh_all = np.asarray(self.shares_pct, float)
        fs = sh_all[np.minimum(np.searchsorted(sh_all / 100.0 + 1e-9, jobs.solo_util[pend[top]]), len(sh_all) - 1)]
        if decl:  # a declaring job's minimal demand: its smallest declared share
            for i, j in enumerate(pend[top].tolist()):
                if shapes_of(jobs, j):
                    fs[i] = min(s.compute_share_pct for s in shapes_of(jobs, j))
        need = np.cumsum(self._min_gpus(view, pend[top]) * fs)
        top = top[: max(1, int(np.searchsorted(need, self.price_depth * free_share)) + 1)]
        cand = pend[top]
        wc = w[top]
        n, sh, speed, ok, cnt_sp = self._shape_family(view, cand)  # [J, S'] over (GPU count, share)
        utility = wc[:, None] * speed
        demand = np.stack([n * sh[None, :], n], axis=2)
        cap = np.array([free_share, float(free_slots)])
        best = np.argmax(np.where(ok, utility, -1.0), axis=1)  # ties -> smallest share (shares ascending)
        if not self.pricing or (demand[np.arange(len(cand)), best].sum(axis=0) <= cap + 1e-9).all():
            # uncontested: every job's best shape fits, so all prices are 0 and the solver would agree (without
            # pricing, each job simply offers its best shape, in weight order: the greedy ablation)
            choice = best
        elif self._prices is not None and view.now_s - self._priced_at_s < self.reprice_interval_s:
            # posted prices still fresh: each job best-responds to them (the market's decentralised step);
            # jobs priced out keep their best shape but queue behind every job with positive surplus, so
            # stale prices never leave capacity idle
            surplus = np.where(ok, utility - demand @ self._prices, -np.inf)
            pick = np.argmax(surplus, axis=1)
            pos = surplus[np.arange(len(cand)), pick] > 0
            choice = np.where(pos, pick, best)
            order = np.concatenate([np.flatnonzero(pos), np.flatnonzero(~pos)])
            cand, wc, n, speed, ok, choice = cand[order], wc[order], n[order], speed[order], ok[order], choice[order]
            cnt_sp = cnt_sp[order]
            d.info["pricing"] = {"status": "posted_prices", "age_s": view.now_s - self._priced_at_s}
        else:
            choice, prices, info = choose_shapes(utility, demand, ok, cap, warm_prices=self._prices,
                                                solver=self.solver)
            if prices is not None and len(prices) == 2 and np.all(np.isfinite(prices)):
                self._prices = prices
                self._priced_at_s = view.now_s
            d.info["pricing"] = info
        # a service's slowdown is bounded by its SLO check (tenant_ok), not weighed as lost utility
        Wt = np.where(jobs.kind == INFERENCE, 0.0, W)
        attempts = 0
        failed: set = set()
        state = None  # built on the first prediction (most rounds fail the capacity precheck first)
        room = unused.copy()  # the tenants have not changed since (pricing only)
        open_ = slot_open.copy()
        col_shares = set(self.shares_pct) | set(sh.tolist())  # the menu's shares and any declared ones
        room_cnt = {float(x): int(((room >= x - 1e-9) & open_).sum()) for x in col_shares}
        # predictions are made on the GPUs with room for the smallest share only (under contention a
        # handful of 512): same decisions, a fraction of the work
        rows = np.flatnonzero((room >= float(min_sh) - 1e-9) & open_)
        try_order = np.argsort(-speed, axis=1, kind="stable")  # [J, S'] shapes by speed, once for all
        topo = view.topo
        shrunk_shapes = speed.shape[1] > len(self.shares_pct)
        # the loop reads the candidates' shapes one by one (often all 256 of them, most failing the
        # capacity precheck): as Python lists, without a numpy scalar per read
        cand_l, type_l, choice_l = cand.tolist(), jobs.type_idx[cand].tolist(), choice.tolist()
        order_l, ok_l, n_l, sh_l = try_order.tolist(), ok.tolist(), n.tolist(), sh.tolist()
        for c in np.flatnonzero(choice >= 0).tolist():
            if attempts >= self.max_attempts or free_slots == 0 or free_share < min_sh:
                break
            j, t, first, n_c = cand_l[c], type_l[c], choice_l[c], n_l[c]
            tries = [first] + [s for s in order_l[c] if ok_l[c][s] and s != first]
            if shrunk_shapes:  # a shrunk gang only when no full-gang shape fits
                full = [x == n_c[0] for x in n_c]
                tries = [s for s in tries if full[s]] + [s for s in tries if not full[s]]
            for s in tries:
                share = sh_l[s]
                nj = int(n_c[s])
                key = (t, nj, share)
                # capacity precheck (no prediction needed): enough GPUs with a free slot and this share?
                if key in failed or nj * share > free_share + 1e-9 or room_cnt[share] < nj:
                    continue
                attempts += 1
                if state is None:
                    gj_rows = gj[rows]
                    state = self._tenant_state(jobs, rows, gj_rows, gs[rows])
                    tw = tenant_weights(gj_rows, Wt)
                pred = state.join(t, float(jobs.solo_util[j]), share, self.train_floor, self.slo_factor)
                feas = (pred.slot_free & (pred.share_free >= share - 1e-9) & pred.tenant_ok
                        & (pred.new_norm >= self.train_floor - 1e-9))
                gain = wc[c] * pred.new_norm * cnt_sp[c, s] - weighted_loss(pred, tw)
                feas &= gain > 0
                # ties (e.g. many empty GPUs) go to the fullest GPU: keeps whole GPUs free for gangs
                gl = pick_gang(gain - 1e-6 * pred.share_free, feas, nj, topo, rows)
                if gl is None:
                    failed.add(key)
                    continue
                g = rows[gl]
                occupy(gj, gs, j, g, share)
                gj_rows = gj[rows]
                self._state_cache = None  # changed below: no longer what its key says
                state.refresh(gl, gj_rows, gs[rows])
                tw[gl] = tenant_weights(gj_rows[gl], Wt)
                d.place.append((j, g, share))
                free_share -= nj * share
                free_slots -= nj
                room[g] -= share
                open_[g] = (gj[g] < 0).any(axis=1)
                room_cnt = {float(x): int(((room >= x - 1e-9) & open_).sum()) for x in col_shares}
                break
        self._idle_sig = (early, sig) if len(d.place) == placed_before else None

    def _tenant_state(self, jobs, rows: np.ndarray, gj_rows: np.ndarray, gs_rows: np.ndarray) -> TenantState:
        """Placement state of GPUs ``rows`` (tenant slots ``gj_rows``, ``gs_rows``).

        A :class:`TenantState` and its cached joins are a function of the tenants' ids, types, kinds,
        utilisations, forecasts and shares (and of the policy's estimate matrix): when they are all as
        when the last state was built and it has not placed anyone since -- a round after an arrival or
        after a round that placed nobody -- that state is returned again, joins included.
        """
        tj = np.where(gj_rows >= 0, gj_rows, 0)
        key = (rows.tobytes(), gj_rows.tobytes(), gs_rows.tobytes(), jobs.type_idx[tj].tobytes(),
               jobs.kind[tj].tobytes(), jobs.solo_util[tj].tobytes(), jobs.load_forecast[tj].tobytes())
        hit = self._state_cache
        same_model = hit is not None and hit[1].jobs is jobs and hit[1].M is self.M and hit[1].kappa == self.kappa
        if same_model and hit[0] == key:
            return hit[1]
        state = TenantState(self.M, self.kappa, gj_rows, gs_rows, jobs, True)
        self._state_cache = (key, state)
        return state

    def _min_gpus(self, view: ClusterView, idx: np.ndarray) -> np.ndarray:
        """Fewest GPUs each job of ``idx`` may start on (its requested gang unless GPU-count shapes are on)."""
        n = view.jobs.num_gpus[idx]
        out = min_count(n) if self._count_shapes(view) and self.shrink_gpus else n
        if any_declared(view.jobs):  # a declaring job: its smallest declared count
            out = np.array([min(declared_counts(view.jobs, j)) if shapes_of(view.jobs, j) else o
                            for j, o in zip(np.asarray(idx).tolist(), np.asarray(out).tolist())], np.int64)
        return out

    @staticmethod
    def _declared_min_share(jobs, idx: np.ndarray) -> float | None:
        """Smallest share any declaring job of ``idx`` declares; None when none of them declares shapes."""
        return min((s.compute_share_pct for j in idx.tolist() for s in shapes_of(jobs, j)), default=None)

    def _count_shapes(self, view: ClusterView) -> bool:
        return self.elastic_gpus and view.types.scale_tput is not None

    def _shape_family(self, view: ClusterView, cand: np.ndarray):
        """Shapes of the candidates, flattened over (GPU count, MPS share): counts first (requested, then
        halvings), shares ascending within a count, so ties prefer the full gang and the smaller share.

        Returns:
            (gpus [J, S'], share pct [S'], speed [J, S'], feasible [J, S'], GPU-count speed [J, S']) with
            speed = share speed x GPU-count speed (:func:`shapes.count_speed`); a shrunk shape is feasible
            when its share is and its count keeps at least ``min_count_speed``.
        """
        jobs = view.jobs
        sp, okp = shape_speed_table(jobs.solo_util[cand], self.train_floor, self.shares_pct)  # [J, S]
        req = jobs.num_gpus[cand].astype(np.int64)
        S = len(self.shares_pct)
        C = 4 if self._count_shapes(view) and self.shrink_gpus else 1
        if C > 1:
            rows = [self._shrink_row(view, t, r) for t, r in zip(jobs.type_idx[cand].tolist(), req.tolist())]
            cnt = np.array([r[0] for r in rows], np.int64).reshape(len(cand), C)
            valid = np.array([r[1] for r in rows], bool).reshape(len(cand), C)
            cspeed = np.array([r[2] for r in rows], float).reshape(len(cand), C)
        else:
            cnt, valid, cspeed = req[:, None], np.ones((len(cand), 1), bool), np.ones((len(cand), 1))
        speed = (cspeed[:, :, None] * sp[:, None, :]).reshape(len(cand), C * S)
        ok = (valid[:, :, None] & okp[:, None, :]).reshape(len(cand), C * S)
        gpus = np.repeat(cnt, S, axis=1).astype(float)
        share = np.tile(np.asarray(self.shares_pct, float), C)
        cnt_sp = np.repeat(cspeed, S, axis=1)
        if any_declared(jobs):
            return self._declared_columns(view, cand, gpus, share, speed, ok, cnt_sp)
        return gpus, share, speed, ok, cnt_sp

    def _declared_columns(self, view: ClusterView, cand: np.ndarray, gpus, share, speed, ok, cnt_sp):
        """:meth:`_shape_family` with the declaring candidates' declared shapes as their only ones: a column
        per declared (GPU count, share) of any candidate (counts descending, shares ascending), feasible for
        the jobs that declare it only; a declaring job's menu columns are infeasible. A declared shape is
        feasible when its share keeps ``train_floor`` of the job's speed, or it is the job's largest declared
        share on that count (as the 100 % shape always is for the menu). Its speed is the share speed x
        the GPU-count speed of the declared count (measured curve, pessimistic; linear without one)."""
        jobs = view.jobs
        mine = {i: set(declared_options(jobs, j)) for i, j in enumerate(cand.tolist()) if shapes_of(jobs, j)}
        if not mine:
            return gpus, share, speed, ok, cnt_sp
        cols = sorted(set().union(*mine.values()), key=lambda o: (-o[0], o[1]))
        J, E = len(cand), len(cols)
        g_x = np.tile(np.array([c for c, _ in cols], float), (J, 1))
        s_x = np.array([s for _, s in cols], float)
        sp_x, ok_x, c_x = np.zeros((J, E)), np.zeros((J, E), bool), np.ones((J, E))
        scale = view.types.scale_tput
        for i, opts in mine.items():
            j = int(cand[i])
            u, req = max(float(jobs.solo_util[j]), 1e-6), int(jobs.num_gpus[j])
            top = {}
            for c, s in opts:
                top[c] = max(top.get(c, 0.0), s)
            for e, (c, s) in enumerate(cols):
                if (c, s) not in opts:
                    continue
                if c == req:
                    cs = 1.0
                elif scale is not None:
                    cs = float(count_speed(scale[int(jobs.type_idx[j])], c, req))
                else:
                    cs = c / max(req, 1)
                ssp = float(share_speed(s, u))
                sp_x[i, e], c_x[i, e] = ssp * cs, cs
                ok_x[i, e] = ssp + 1e-9 >= self.train_floor or s == top[c]
            ok[i, :] = False  # none of the menu's shapes for a job that declares its own
        return (np.concatenate([gpus, g_x], axis=1), np.concatenate([share, s_x]),
                np.concatenate([speed, sp_x], axis=1), np.concatenate([ok, ok_x], axis=1),
                np.concatenate([cnt_sp, c_x], axis=1))

    def _shrink_row(self, view: ClusterView, type_idx: int, req: int) -> tuple:
        """(counts [4], feasible [4], GPU-count speed [4]) of a job type's gang and its halvings (a repeat of
        the gang where there are fewer than three), cached per type table, type and requested size."""
        key = ("shrink", id(view.types), type_idx, req)
        hit = self._counts_cache.get(key)
        if hit is None:
            counts, speed, _ = self._count_table(view, type_idx, req)
            opts = [c for c in counts if c <= req]  # the gang and its halvings, as count_options gives them
            cnt = opts + [req] * (4 - len(opts))
            ok = [i == 0 or (i < len(opts) and speed[c] >= self.min_count_speed - 1e-9) for i, c in enumerate(cnt)]
            hit = self._counts_cache[key] = (cnt, ok, [speed[c] for c in cnt])
        return hit

    # ------------------------------------------------------------------------------------------------
    def _preempt(self, view: ClusterView, gj, gs, W, d: Decision, waiting: np.ndarray) -> bool:
        """Serve the heaviest waiting jobs by preempting much lighter running ones (module docstring, 4)."""
        jobs = view.jobs
        if self.max_preempt_jobs <= 0 or self.preempt_ratio <= 0:
            return False
        run = view.running[jobs.kind[view.running] == TRAINING]
        if len(run) == 0:
            return False
        gone = set(d.preempt)
        run = run[(view.now_s - jobs.last_change_s[run] >= self.min_run_s)]
        if gone:
            run = run[~np.isin(run, np.fromiter(gone, np.int64, len(gone)))]
        if len(run) == 0:
            return False
        wv = W[run]
        wq = W[waiting]
        if wq.max() <= self.preempt_ratio * wv.min():  # cheap exit: nobody outweighs anybody enough
            return False
        any_done = False
        served = 0
        # per GPU: can it be emptied (every tenant an eligible victim) and at what weight
        elig_job = np.zeros(len(jobs.kind), bool)
        elig_job[run] = True
        occ = gj >= 0
        tj = np.maximum(gj, 0)
        ten_ok = ~occ | elig_job[tj]
        wt = np.where(occ, W[tj], 0.0)
        gpu_max = np.where(slot_all(ten_ok), slot_max(wt), np.inf)  # heaviest tenant (inf: not emptiable)
        gpu_cost = slot_sum(wt)
        order_q = waiting[np.argsort(-wq, kind="stable")][: 4 * self.max_preempt_jobs]
        # waiting jobs come in decreasing weight, so a gang size that failed fails for every later job
        fail_n = np.inf
        for c in order_q:
            if served >= self.max_preempt_jobs:
                break
            c = int(c)
            n = int(jobs.num_gpus[c])
            if n >= fail_n:
                continue
            ok = gpu_max * self.preempt_ratio < W[c]
            if int(ok.sum()) < n:
                fail_n = n
                continue
            target = pick_gang(-gpu_cost, ok, n, view.topo)  # the n cheapest of them, kept in the topology
            if target is None:
                fail_n = n
                continue
            if (gpu_max[target] <= 0).all():
                continue  # enough empty GPUs already: placement's concern, not preemption's
            if gpu_cost[target].max() * self.preempt_ratio >= W[c]:
                fail_n = n
                continue  # one GPU's victims alone already weigh too much
            vic = np.unique(gj[target])
            vic = vic[vic >= 0]
            # the victims' weight together must also be clearly below the waiting job's
            if W[vic].sum() * self.preempt_ratio >= W[c]:
                fail_n = n
                continue
            share = declared_share(jobs, c, n, self._full_speed_share(float(jobs.solo_util[c])))
            if share is None:
                continue
            victims = sorted(vic.tolist(), key=lambda t: W[t])
            touched = set(target.tolist())
            for t in victims:
                d.preempt.append(t)
                touched.update(int(g) for g in jobs.gpus[t])
                vacate(gj, gs, t, jobs.gpus[t])
            occupy(gj, gs, c, target, share)
            d.place.append((c, target, share))
            rows = np.fromiter(touched, np.int64, len(touched))
            occ_r = gj[rows] >= 0
            tj_r = np.maximum(gj[rows], 0)
            wt_r = np.where(occ_r, W[tj_r], 0.0)
            gpu_max[rows] = np.where((~occ_r | elig_job[tj_r]).all(axis=1) & ~np.isin(gj[rows], [c]).any(axis=1),
                                     wt_r.max(axis=1), np.inf)
            gpu_cost[rows] = wt_r.sum(axis=1)
            served += 1
            any_done = True
        if served:
            d.info["preempted_for"] = served
        return any_done

    @staticmethod
    def _ngpu(view: ClusterView, idx: np.ndarray) -> np.ndarray:
        """GPUs each job of ``idx`` holds now (0 when not running)."""
        held = view.gpu_job[view.gpu_job >= 0]
        return np.bincount(held, minlength=len(view.jobs.kind))[idx] if len(held) else np.zeros(len(idx), np.int64)

    def _count_table(self, view: ClusterView, type_idx: int,
                     req: int) -> tuple[tuple[int, ...], dict[int, float], tuple[int, ...]]:
        """(allowed counts, count -> speed, allowed counts ascending) of a job type at a requested gang size,
        cached per type table."""
        key = (id(view.types), type_idx, req)
        hit = self._counts_cache.get(key)
        if hit is None:
            measured = view.types.scale_measured
            counts = count_options(req) + grow_options(req, measured[type_idx] if measured is not None else None)
            sp = count_speed(view.types.scale_tput[type_idx], np.asarray(counts, float), req)
            hit = self._counts_cache[key] = (counts, dict(zip(counts, sp.tolist())), tuple(sorted(counts)))
        return hit

    def _regrow(self, view: ClusterView, gj, gs, d: Decision, run: np.ndarray) -> None:
        """Give gangs more GPUs while whole GPUs idle and nobody waits (module docstring, 6).

        A job running on fewer GPUs than it may use (shrunk under contention, or a scalable type below
        its largest measured count) is relaunched on its GPUs plus empty ones when the time saved
        ``remaining / old speed - remaining / new speed`` exceeds ``expand_gain x restart_s``. Jobs go in
        decreasing speed-up per added GPU; only empty GPUs are added, so no co-tenant is affected. A job
        placed in this same round is offered the same, and then starts on the larger gang (no restart).
        """
        jobs = view.jobs
        run = run[view.now_s - jobs.last_change_s[run] >= self.min_run_s]
        # jobs placed this round and not running yet (share 0) may start grown: {job: (index in d.place, GPUs)}
        fresh = {int(j): (k, np.asarray(g)) for k, (j, g, _) in enumerate(d.place)
                 if jobs.kind[j] == TRAINING and jobs.share_pct[j] == 0}
        if len(run) == 0 and not fresh:
            return
        empty = np.flatnonzero(slot_all(gj < 0))
        if len(empty) == 0:
            return
        gone = set(d.preempt) | {int(j) for j, _ in d.resize}
        cand = np.concatenate([run, np.fromiter(fresh, np.int64, len(fresh))])
        ngpu = np.concatenate([self._ngpu(view, run), [len(g) for _, g in fresh.values()]]).astype(np.int64)
        cost = self.expand_gain * self.restart_s
        offers = []  # (best saving per added GPU, job, current count, [(count, saving)] ascending)
        for j, cur, req, rem, t in zip(cand.tolist(), ngpu.tolist(), jobs.num_gpus[cand].tolist(),
                                       jobs.remaining_est_s[cand].tolist(), jobs.type_idx[cand].tolist()):
            if cur == 0 or j in gone or not math.isfinite(rem) or shapes_of(jobs, j):
                continue  # (a declaring job never grows beyond the gangs it declares)
            _, speed, ascending = self._count_table(view, t, req)
            if ascending[-1] <= cur or cur not in speed:
                continue
            bigger = [c for c in ascending if cur < c <= cur + len(empty)]
            if not bigger:
                continue
            good = [(c, v) for c in bigger if (v := rem / speed[cur] - rem / speed[c] - cost) > 0]
            if good:  # ordered by the speed-up per added GPU, whatever the job's length
                offers.append((-max((speed[c] / speed[cur] - 1.0) / (c - cur) for c, _ in good), j, cur, good))
        offers.sort()
        # pass 1: each job its best saving per added GPU; pass 2: GPUs still idle upgrade jobs, same order
        plan = {}
        free = len(empty)
        for _, j, cur, good in offers:
            c = max(good, key=lambda cv: cv[1] / (cv[0] - cur))[0]
            if c - cur <= free:
                plan[j] = c
                free -= c - cur
        for _, j, cur, good in offers:
            if j in plan:
                up = [c for c, _ in good if plan[j] < c <= plan[j] + free]
                if up:
                    free -= max(up) - plan[j]
                    plan[j] = max(up)
        topo = view.topo
        for _, j, cur, _ in offers:
            if j not in plan:
                continue
            own = fresh[j][1] if j in fresh else np.asarray(jobs.gpus[j])
            # its own GPUs plus empty ones, kept in the topology (own GPUs first: the gang stays where it is
            # when its node has room)
            mask = slot_all(gj < 0)
            mask[own] = True
            keep = np.zeros(len(mask))
            keep[own] = 1.0
            target = pick_gang(keep, mask, plan[j], topo)
            if target is None:
                continue
            if j in fresh:  # placed this round: launch it on the larger gang straight away (no restart)
                k = fresh[j][0]
                share = float(d.place[k][2])
                vacate(gj, gs, j, own)
                occupy(gj, gs, j, target, share)
                d.place[k] = (j, target, share)
                continue
            self._relaunch(view, gj, gs, d, j, target)

    @staticmethod
    def _relaunch(view: ClusterView, gj, gs, d: Decision, j: int, target: np.ndarray) -> None:
        """Restart running job ``j`` on GPUs ``target`` at its share: a preemption and a placement in one
        round, which the engine and the live allocator apply as a resize (one restart)."""
        share = float(view.jobs.share_pct[j])
        vacate(gj, gs, j, view.jobs.gpus[j])
        occupy(gj, gs, j, target, share)
        d.preempt.append(j)
        d.place.append((j, target, share))

    def _give_back(self, view: ClusterView, gj, gs, W, d: Decision, waiting: np.ndarray) -> bool:
        """Jobs are waiting: shrink gangs grown beyond their request back to it (their first GPUs) -- those
        that weigh less than the waiting jobs they make room for (a short job keeps its extra GPUs over long
        ones) and that have run ``min_run_s`` since their last change, lightest first, and only until the
        empty and freed GPUs cover the gangs of the waiting jobs heavier than the next one to shrink
        (module docstring, 6)."""
        jobs = view.jobs
        run = view.running[jobs.kind[view.running] == TRAINING]
        if len(run) == 0:
            return False
        extra = self._ngpu(view, run) - jobs.num_gpus[run]  # GPUs held beyond the request
        keep = (extra > 0) & (view.now_s - jobs.last_change_s[run] >= self.min_run_s)  # hysteresis, as for preemption
        if self.keep_heavy_growth:
            keep &= W[run] < W[waiting].max()
        grown, extra = run[keep], extra[keep]
        order = np.argsort(W[grown], kind="stable")
        grown, extra = grown[order], extra[order].tolist()
        wq, nq = W[waiting], self._min_gpus(view, waiting)
        room = int(slot_all(gj < 0).sum())  # empty GPUs, then also those given back
        gone = set(d.preempt)
        done = False
        for j, x in zip(grown.tolist(), extra):
            if j in gone:
                continue
            need = int(nq[wq > W[j]].sum()) if self.keep_heavy_growth else int(nq.sum())
            if room >= need:
                continue  # the waiting jobs this gang would make room for fit already
            target = sub_gang(jobs.gpus[j], int(jobs.num_gpus[j]), view.topo)  # its first GPUs in the topology
            if target is None:
                continue
            self._relaunch(view, gj, gs, d, j, target)
            room += x
            done = True
        return done

    def _full_speed_share(self, util: float) -> float:
        """Smallest offered share at which a job of solo utilisation ``util`` runs at full speed."""
        for s in self.shares_pct:
            if float(share_speed(s, max(util, 1e-6))) >= 1.0 - 1e-9:
                return float(s)
        return float(max(self.shares_pct))

    def _expand(self, view: ClusterView, gj, gs, d: Decision) -> None:
        """Grow share-capped running training jobs into free share (module docstring, 5)."""
        jobs = view.jobs
        run = view.running[jobs.kind[view.running] == TRAINING]
        if self._count_shapes(view):
            self._regrow(view, gj, gs, d, run)  # also offers growth to the jobs placed this round
        if len(run) == 0:
            return
        u = np.maximum(jobs.solo_util[run], 1e-6)
        cur = jobs.share_pct[run]
        capped = (cur > 0) & (cur < 100.0) & (cur / 100.0 < u - 1e-9)
        capped &= view.now_s - jobs.last_change_s[run] >= self.min_run_s
        if not capped.any():
            return
        gone = set(d.preempt) | {int(j) for j, _ in d.resize}
        rem = jobs.remaining_est_s[run]
        rem = np.where(np.isfinite(rem), rem, jobs.attained_gpu_s[run] / np.maximum(jobs.num_gpus[run], 1))
        for k in np.flatnonzero(capped):
            j = int(run[k])
            if j in gone:
                continue
            g = jobs.gpus[j]
            slot = gj[g] == j
            if not slot.any(axis=1).all():
                continue
            room = float((100.0 - gs[g].sum(axis=1)).min()) + float(cur[k])
            best = float(cur[k])
            for s in (self.shares_pct if not shapes_of(jobs, j) else declared_shares(jobs, j, len(g))):
                if best < s <= room + 1e-9:
                    best = float(s)
                    if float(share_speed(s, u[k])) >= 1.0 - 1e-9:
                        break
            if best <= cur[k]:
                continue
            old_sp, new_sp = float(share_speed(cur[k], u[k])), float(share_speed(best, u[k]))
            if rem[k] * (1.0 - old_sp / new_sp) <= self.expand_gain * self.restart_s:
                continue
            gs[g] = np.where(slot, best, gs[g])
            d.resize.append((j, best))
