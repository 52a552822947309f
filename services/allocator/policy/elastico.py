"""The ElastiCo policy: shapes -> elastic shadow pricing -> interference-aware gang placement.

One round (:meth:`ElastiCo.decide`), the same for the simulator and the live allocator:

1. **Inference first, sized to demand.** Each running service's MPS share is re-sized to the smallest
   offered share that meets its SLO at its *forecast* load (the engine/allocator supplies it; the
   simulator uses the recent peak) given the *predicted* interference of its current co-tenants
   (:mod:`inference`). Growing evicts the lowest-utility training tenants of that GPU if needed (they
   requeue with their progress; restart cost applies). Shrinking waits ``shrink_after_s`` since the last
   change (each resize is a restart: MPS limits are fixed at launch). New services go to the GPU where they
   fit with all tenants above their floors, packing the fullest GPUs first.
2. **Pricing.** Queued training jobs (the ``max_candidates`` with the highest weight) offer their shape
   family (:mod:`shapes`: shares 25/50/75/100 % whose speed keeps the slowdown floor). Utility of a shape
   = normalised throughput x weight, with

       weight = priority x (1 + waiting_s / age_scale_s) / (1 + attained_gpu_s / las_scale_gpu_s)

   -- a waiting-age factor (no starvation) and a least-attained-service discount (non-clairvoyant
   short-job preference, as in Tiresias). Pools: free MPS share (percent, summed over GPUs) and free
   tenant slots. The pricer core solves "one shape or wait per job, maximise utility" and returns the
   shapes; its prices are warm-started across rounds.
3. **Placement.** In weight order, each priced job goes to the gang of GPUs that maximises predicted
   utility: its own predicted speed x weight minus the weighted speed its new co-tenants lose, among
   GPUs with a free slot and share where every tenant stays above its floor (training: ``train_floor``
   of isolated speed or no worse than now; inference: SLO at forecast). If the priced share does not
   fit anywhere, the job's other shapes are tried. Multi-GPU jobs are gang-placed and run at their
   slowest GPU's pace (the engine enforces it; the placement scores each GPU).

State across rounds: only the warm-start prices (an optimisation; decisions do not depend on it
beyond solver convergence).
"""

from __future__ import annotations

import numpy as np

from services.allocator.policy.baselines import Policy
from services.allocator.policy.inference import required_share_pct, slo_margin
from services.allocator.policy.placement import TenantState, pick_gang, predict_join, weighted_loss
from services.allocator.policy.pricing import choose_shapes
from services.allocator.policy.shapes import SHARES_PCT, shape_speed_table
from services.allocator.policy.view import INFERENCE, TRAINING, ClusterView, Decision, occupy, vacate


class ElastiCo(Policy):
    """Shapes + shadow pricing + interference-aware placement. See module docstring."""

    name = "elastico"
    mps_limits = True
    needs_periodic_rounds = True

    def __init__(self, estimate: np.ndarray, kappa: float, train_floor: float = 0.5, slo_factor: float = 10.0,
                 age_scale_s: float = 3600.0, las_scale_gpu_s: float = 3600.0, max_candidates: int = 256,
                 max_attempts: int = 16, shrink_after_s: float = 1800.0, inference_headroom: float = 1.0,
                 shares_pct: tuple[int, ...] = SHARES_PCT, solver=None):
        self.M = estimate  # [T, T] estimated pair matrix (NaN = utilisation rule)
        self.kappa = kappa  # contention factor of the rule
        self.train_floor = train_floor  # training floor, fraction of isolated speed (1 / max slowdown)
        self.slo_factor = slo_factor  # inference SLO, multiple of the unloaded full-GPU service time
        self.age_scale_s = age_scale_s  # waiting time that doubles a queued job's weight, s
        self.las_scale_gpu_s = las_scale_gpu_s  # attained GPU-seconds that halve a job's weight
        self.max_candidates = max_candidates  # queued jobs priced per round at most
        self.max_attempts = max_attempts  # placement attempts per round at most (bounded round cost)
        self.shrink_after_s = shrink_after_s  # minimum time between an inference resize and a shrink, s
        self.inference_headroom = inference_headroom  # multiplier on the forecast load when sizing
        self.shares_pct = shares_pct
        self.solver = solver  # pricing solver with the signature of services.pricer.core.solve; None = in-process
        self._prices: np.ndarray | None = None
        self._idle_sig: tuple | None = None  # state of the last round whose training pass placed nothing

    # ------------------------------------------------------------------------------------------------
    def weights(self, view: ClusterView, idx: np.ndarray) -> np.ndarray:
        """Utility weight of jobs ``idx`` (see module docstring)."""
        j = view.jobs
        wait = np.where(j.share_pct[idx] > 0, 0.0, np.maximum(view.now_s - j.queued_since_s[idx], 0.0))
        return j.priority[idx] * (1.0 + wait / self.age_scale_s) / (1.0 + j.attained_gpu_s[idx] / self.las_scale_gpu_s)

    def decide(self, view: ClusterView) -> Decision:
        d = Decision()
        jobs = view.jobs
        gj, gs = view.scratch()
        N = len(jobs.kind)
        W = np.zeros(N)
        act = np.concatenate([view.running, view.pending])
        if len(act):
            W[act] = self.weights(view, act)
        W[jobs.kind == INFERENCE] = 1e6  # inference is never the tenant to sacrifice
        self._inference(view, gj, gs, W, d)
        self._training(view, gj, gs, W, d)
        return d

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
        if len(run):
            pred = predict_join(self.M, self.kappa, gj, gs, jobs, view.types.inference_index, 0.0, 100.0,
                                True, 0.0, self.slo_factor)
            g_of = np.array([int(jobs.gpus[j][0]) for j in run])
            slot_mask = gj[g_of] == run[:, None]
            has = slot_mask.any(axis=1)
            slot = np.argmax(slot_mask, axis=1)
            nu = pred.before[g_of, slot]
            cur = gs[g_of, slot]
            reqs = required_share_pct(jobs.load_forecast[run] * self.inference_headroom, self.slo_factor, nu,
                                      self.shares_pct)
            grow = has & (reqs > cur + 1e-9)
            shrink = has & (reqs < cur - 1e-9) & (view.now_s - jobs.last_change_s[run] >= self.shrink_after_s)
            for k in np.flatnonzero(grow | shrink):
                j, g, sl, req = int(run[k]), int(g_of[k]), int(slot[k]), float(reqs[k])
                if grow[k]:
                    c = float(cur[k])
                    gs[g, sl] = 0.0
                    if not self._evict_for(view, gj, gs, W, g, req, d):
                        req = max(c, min(req, 100.0 - float(gs[g].sum())))
                    gs[g, sl] = req
                    if req != c:
                        d.resize.append((j, req))
                else:
                    gs[g, sl] = req
                    d.resize.append((j, req))
        pend = view.pending[jobs.kind[view.pending] == INFERENCE]
        for j in pend:
            j = int(j)
            load = float(jobs.load_forecast[j] * self.inference_headroom)
            placed = False
            for share in self.shares_pct:
                if share / 100.0 - load < slo_margin(self.slo_factor) - 1e-9:
                    continue
                pred = predict_join(self.M, self.kappa, gj, gs, jobs, view.types.inference_index, load, share,
                                    True, self.train_floor, self.slo_factor)
                cap_ok = share / 100.0 * pred.new_norm - load >= slo_margin(self.slo_factor) - 1e-9
                ok = pred.slot_free & (pred.share_free >= share - 1e-9) & pred.tenant_ok & cap_ok
                g = pick_gang(-pred.share_free + pred.new_norm, ok, 1)
                if g is not None:
                    occupy(gj, gs, j, g, float(share))
                    d.place.append((j, g, float(share)))
                    placed = True
                    break
            if not placed:  # LS service first: clear the GPU whose training tenants weigh least
                req = float(required_share_pct(load, self.slo_factor, 1.0, self.shares_pct))
                tw = np.where(gj >= 0, W[np.maximum(gj, 0)], 0.0).sum(axis=1)
                tw[(gj >= 0).any(axis=1) & (np.where(gj >= 0, jobs.kind[np.maximum(gj, 0)], 0) == INFERENCE).any(axis=1)] = np.inf
                g = int(np.argmin(tw))
                if np.isfinite(tw[g]):
                    for t in [int(t) for t in gj[g] if t >= 0]:
                        d.preempt.append(t)
                        vacate(gj, gs, t, jobs.gpus[t])
                    occupy(gj, gs, j, np.array([g]), req)
                    d.place.append((j, np.array([g]), req))

    def _training(self, view: ClusterView, gj, gs, W, d: Decision) -> None:
        jobs = view.jobs
        pend = view.pending[jobs.kind[view.pending] == TRAINING]
        pend = pend[jobs.num_gpus[pend] <= view.num_gpus]
        if len(pend) == 0:
            return
        free_share = float(np.clip(100.0 - gs.sum(axis=1), 0, None).sum())
        free_slots = int((gj < 0).sum())
        if free_share < min(self.shares_pct) or free_slots == 0:
            return
        # nothing changed since a round that could place nobody: the same attempt would fail again
        sig = (gj.tobytes(), gs.tobytes(), pend.tobytes())
        if sig == self._idle_sig:
            return
        placed_before = len(d.place)
        w = W[pend]
        top = np.argsort(-w, kind="stable")[: self.max_candidates]
        cand = pend[top]
        wc = w[top]
        n = jobs.num_gpus[cand].astype(float)
        speed, ok = shape_speed_table(jobs.solo_util[cand], self.train_floor, self.shares_pct)
        sh = np.asarray(self.shares_pct, float)
        utility = wc[:, None] * speed
        demand = np.stack([n[:, None] * sh[None, :], np.broadcast_to(n[:, None], speed.shape)], axis=2)
        cap = np.array([free_share, float(free_slots)])
        best = np.argmax(np.where(ok, utility, -1.0), axis=1)  # ties -> smallest share (shares ascending)
        if (demand[np.arange(len(cand)), best].sum(axis=0) <= cap + 1e-9).all():
            # uncontested: every job's best shape fits, so all prices are 0 and the solver would agree
            choice = best
        else:
            choice, prices, info = choose_shapes(utility, demand, ok, cap, warm_prices=self._prices,
                                                solver=self.solver)
            if prices is not None and len(prices) == 2 and np.all(np.isfinite(prices)):
                self._prices = prices
            d.info["pricing"] = info
        attempts = 0
        failed: set = set()
        state = TenantState(self.M, self.kappa, gj, gs, jobs, True)
        for c in np.flatnonzero(choice >= 0):
            if attempts >= self.max_attempts or free_slots == 0 or free_share < min(self.shares_pct):
                break
            j = int(cand[c])
            nj = int(n[c])
            t = int(jobs.type_idx[j])
            tries = [int(choice[c])] + [s for s in np.argsort(-speed[c], kind="stable") if ok[c, s] and s != choice[c]]
            for s in tries:
                share = float(sh[s])
                key = (t, nj, share)
                if key in failed or nj * share > free_share + 1e-9:
                    continue
                # capacity precheck (no prediction needed): enough GPUs with a free slot and this share?
                if int(((state.share.sum(axis=1) <= 100.0 - share + 1e-9) & ~state.mask.all(axis=1)).sum()) < nj:
                    failed.add(key)
                    continue
                attempts += 1
                pred = state.join(t, float(jobs.solo_util[j]), share, self.train_floor, self.slo_factor)
                feas = (pred.slot_free & (pred.share_free >= share - 1e-9) & pred.tenant_ok
                        & (pred.new_norm >= self.train_floor - 1e-9))
                gain = wc[c] * pred.new_norm - weighted_loss(pred, gj, W)
                feas &= gain > 0
                # ties (e.g. many empty GPUs) go to the fullest GPU: keeps whole GPUs free for gangs
                g = pick_gang(gain - 1e-6 * pred.share_free, feas, nj)
                if g is None:
                    failed.add(key)
                    continue
                occupy(gj, gs, j, g, share)
                state.refresh(g, gj, gs)
                d.place.append((j, g, share))
                free_share -= nj * share
                free_slots -= nj
                break
        self._idle_sig = sig if len(d.place) == placed_before else None
