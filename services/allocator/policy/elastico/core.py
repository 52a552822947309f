"""The :class:`ElastiCo` policy object: its state across rounds and one round's order of passes."""

from __future__ import annotations

import numpy as np

from elastico.coloc.rates import share_speed
from services.allocator.policy.baselines import Policy
from services.allocator.policy.elastico.cache import PolicyMemo
from services.allocator.policy.elastico.counts import count_shapes_on, defragment, give_back, regrow
from services.allocator.policy.elastico.learning import corrected_estimate
from services.allocator.policy.elastico.params import ElastiCoParams
from services.allocator.policy.elastico.preemption import preempt
from services.allocator.policy.elastico.serving import fill_slack, service_slots, size_services
from services.allocator.policy.elastico.training import place_training, waiting_training
from services.allocator.policy.shapes import UNLIMITED_MIN_SHARE_PCT, any_declared, declared_shares, shapes_of
from services.allocator.policy.view import INFERENCE, TRAINING, ClusterView, Decision


class ElastiCo(Policy[ElastiCoParams]):
    """Shapes + shadow pricing + interference-aware placement (:mod:`services.allocator.policy.elastico`).

    State across rounds, all driven by the view's clock so simulated runs stay deterministic: the estimate
    as corrected by observations (``M``), the posted prices and when they were solved, when the
    preemption and slack passes last ran, and the memo caches (:class:`PolicyMemo`).
    """

    name = "elastico"
    Params = ElastiCoParams
    mps_limits = True
    needs_periodic_rounds = True

    def __init__(self, estimate: np.ndarray, kappa: float, params: ElastiCoParams | None = None, solver=None):
        super().__init__(params)
        self.M = estimate  # [T, T] estimated pair matrix (NaN = utilisation rule), as corrected by learn()
        self.kappa = kappa  # contention factor of the rule
        self.solver = solver  # pricing solver with the signature of services.pricer.core.solve; None = in-process
        self.uses_observations = self.params.learn_observed
        self.unlimited_training = self.params.unlimited_training  # (the engine reads it: Policy.unlimited_training)
        self.memo = PolicyMemo()
        self.prices: np.ndarray | None = None  # the posted prices (warm start of the next solve)
        self.priced_at_s = -np.inf  # when the posted prices were last solved, s
        self.preempt_checked_s = -np.inf  # when the preemption pass last ran, s
        self.slack_checked_s = -np.inf  # when the slack pass last ran (at most every slack_interval_s), s
        self.learn_due = False  # this round's readings not yet learnt (learn)

    @classmethod
    def build(cls, params: ElastiCoParams, estimate: np.ndarray, kappa: float, solver=None) -> ElastiCo:
        return cls(estimate, kappa, params, solver)

    # ------------------------------------------------------------------------------------------------
    def weights(self, view: ClusterView, idx: np.ndarray) -> np.ndarray:
        """Utility weight of jobs ``idx`` (step 2 of the package docstring): priority x ageing x the size term,
        the size term mixed with the requested GPUs by ``work_weight`` (0: JCT first, 1: work done first)."""
        p, j = self.params, view.jobs
        wait = np.where(j.share_pct[idx] > 0, 0.0, np.maximum(view.now_s - j.queued_since_s[idx], 0.0))
        size = 1.0 / (1.0 + j.attained_gpu_s[idx] / p.las_scale_gpu_s)
        if p.use_estimates:
            rem = j.remaining_est_s[idx]
            known = np.isfinite(rem)
            if known.any():
                gpus = j.num_gpus[idx] ** p.gang_exponent
                srpt = 1.0 / (1.0 + gpus * np.maximum(np.where(known, rem, 0.0), 0.0) / p.size_scale_gpu_s)
                size = np.where(known, srpt, size)
        if p.work_weight:
            size = size ** (1.0 - p.work_weight) * j.num_gpus[idx].astype(float) ** p.work_weight
        return j.priority[idx] * (1.0 + wait / p.age_scale_s) * size

    def learn(self, view: ClusterView) -> int:
        """Lower the estimate of each training pair seen running together slower than predicted
        (:func:`learning.corrected_estimate`); returns the number of entries changed.

        The training pass calls it once a round, only when it is about to try placements (a round that
        repeats one that placed nobody needs no new estimate): same decisions as every round, at a fraction
        of the cost.
        """
        M, changed = corrected_estimate(self.M, view)
        if changed:
            self.M = M
            self.memo.estimate_changed()
        return changed

    def decide(self, view: ClusterView) -> Decision:
        p = self.params
        d = Decision()
        self.memo.new_round(view)
        self.learn_due = self.uses_observations  # once per round, when the training pass first looks at the cluster
        jobs = view.jobs
        gj, gs = view.scratch()
        W = np.zeros(len(jobs.kind))  # read at the round's running and pending rows only
        act = np.concatenate([view.running, view.pending])
        if len(act):
            W[act] = self.weights(view, act)
            W[act[jobs.kind[act] == INFERENCE]] = 1e6  # inference is never the tenant to sacrifice
        size_services(self, view, gj, gs, W, d)
        queued = view.pending[jobs.kind[view.pending] == TRAINING]
        queued = queued[jobs.num_gpus[queued] <= view.num_gpus]  # queued training jobs that fit the cluster
        place_training(self, view, gj, gs, W, d, queued)
        waiting = waiting_training(queued, d)
        if len(waiting) and count_shapes_on(p, view) and give_back(p, view, gj, gs, W, d, waiting):
            self.memo.idle = None
            place_training(self, view, gj, gs, W, d, queued)
            waiting = waiting_training(queued, d)
        if len(waiting) and view.now_s - self.preempt_checked_s >= p.preempt_interval_s:
            self.preempt_checked_s = view.now_s
            preempted = preempt(p, view, gj, gs, W, d, waiting)
        else:
            preempted = False
        if preempted:
            self.memo.idle = None
            place_training(self, view, gj, gs, W, d, queued)  # fill what the victims left beyond the served gangs
            waiting = waiting_training(queued, d)
        if len(waiting) and p.slack and view.now_s - self.slack_checked_s >= p.slack_interval_s:
            self.slack_checked_s = view.now_s
            fill_slack(self, view, gj, gs, W, d, waiting)
            waiting = waiting_training(queued, d)
        if len(waiting) == 0:
            self._expand(view, gj, gs, d)
        elif p.keep_heavy_growth and count_shapes_on(p, view):
            # GPUs left empty with jobs waiting are fragments the waiting gangs cannot use: jobs heavier than
            # every waiting one may grow onto them (they would keep them at the next give-back), and so may
            # gangs running shrunk below their request
            run = view.running[jobs.kind[view.running] == TRAINING]
            shrunk = view.held[run] < jobs.num_gpus[run]
            regrow(p, self.memo, view, gj, gs, d, run[(W[run] > W[waiting].max()) | shrunk])
        if count_shapes_on(p, view):
            defragment(p, self.memo, view, gj, gs, d)
        return d

    def _expand(self, view: ClusterView, gj, gs, d: Decision) -> None:
        """Nobody waits: gangs grow onto idle GPUs (:func:`counts.regrow`), and training jobs a share caps next
        to a service grow their share in place when the time saved exceeds ``expand_gain`` restarts (step 6); a
        job still under the limit of a service that has left its GPU, alone there, is relaunched without one."""
        p = self.params
        jobs = view.jobs
        run = view.running[jobs.kind[view.running] == TRAINING]
        if count_shapes_on(p, view):
            regrow(p, self.memo, view, gj, gs, d, run)  # also offers growth to the jobs placed this round
        if len(run) == 0:
            return
        u = np.maximum(jobs.solo_util[run], 1e-6)
        cur = jobs.share_pct[run]
        capped = (cur > 0) & (cur < 100.0) & (cur / 100.0 < u - 1e-9)
        capped &= view.now_s - jobs.last_change_s[run] >= p.min_run_s
        if p.unlimited_training and jobs.limited is not None:
            # a job its share does not limit has nothing to grow (a service never joins it): only limited jobs and
            # declaring ones (their shares are their shapes) are candidates -- most of a loaded cluster's are not
            keep = jobs.limited[run]
            if any_declared(jobs):
                keep = keep | np.fromiter((bool(shapes_of(jobs, int(j))) for j in run.tolist()), bool, len(run))
            capped &= keep
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
            declared = bool(shapes_of(jobs, j))
            unlimited = p.unlimited_training and not declared and not service_slots(jobs, gj[g]).any()
            room = float((100.0 - gs[g].sum(axis=1)).min()) + float(cur[k])
            if unlimited:
                # no service beside it, yet flagged (above): it launched next to one that has left; alone, relaunched
                # on an unlimited slice (the smallest that fits, at least its share), it runs at full speed
                if jobs.limited is None or ((gj[g] >= 0).sum(axis=1) > 1).any():
                    continue
                best = next((float(s) for s in p.shares_pct
                             if max(UNLIMITED_MIN_SHARE_PCT, cur[k]) <= s <= room + 1e-9), float(cur[k]))
            else:
                best = float(cur[k])
                for s in (p.shares_pct if not declared else declared_shares(jobs, j, len(g))):
                    if best < s <= room + 1e-9:
                        best = float(s)
                        if float(share_speed(s, u[k])) >= 1.0 - 1e-9:
                            break
                if best <= cur[k]:
                    continue
            old_sp = float(share_speed(cur[k], u[k]))
            new_sp = 1.0 if unlimited else float(share_speed(best, u[k]))
            if rem[k] * (1.0 - old_sp / new_sp) <= p.expand_gain * p.restart_s:
                continue
            gs[g] = np.where(slot, best, gs[g])
            d.resize.append((j, best))
