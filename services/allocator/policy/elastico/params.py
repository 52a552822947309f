"""The options of the ElastiCo policy: one frozen dataclass, checked when it is built (step numbers: the
package docstring)."""

from __future__ import annotations

from dataclasses import dataclass

from services.allocator.policy.baselines import PolicyParams, option
from services.allocator.policy.shapes import SHARES_PCT


@dataclass(frozen=True)
class ElastiCoParams(PolicyParams):
    """Every option of :class:`~services.allocator.policy.elastico.ElastiCo`, with its default and range."""

    # --- floors and SLOs -----------------------------------------------------------------------------
    train_floor: float = option(0.7, 0.0, 1.0, lo_open=True)  # training floor, fraction of isolated speed (1 / max slowdown)
    slo_factor: float = option(10.0, 1.0)  # inference SLO, multiple of the unloaded full-GPU service time
    # --- 1. inference first ----------------------------------------------------------------------------
    shrink_after_s: float = option(1800.0, 0.0)  # minimum time between an inference resize and a shrink, s
    inference_headroom: float = option(1.0, 0.0, lo_open=True)  # multiplier on the forecast load when sizing
    # shares a service is sized in, percent (ascending)
    inference_shares_pct: tuple[int, ...] = option(tuple(range(5, 101, 5)), 0, 100, lo_open=True, ascending=True)
    # --- 2. pricing: weights, the shape menu, the priced head of the queue -------------------------------
    shares_pct: tuple[int, ...] = option(SHARES_PCT, 0, 100, lo_open=True, ascending=True)  # training share menu, percent
    age_scale_s: float = option(86400.0, 0.0, lo_open=True)  # waiting time that doubles a queued job's weight, s
    las_scale_gpu_s: float = option(3600.0, 0.0, lo_open=True)  # attained GPU-seconds that halve a job's weight
    use_estimates: bool = option(True)  # use JobTable.remaining_est_s where finite (information parity)
    size_scale_gpu_s: float = option(3600.0, 0.0, lo_open=True)  # remaining GPU-seconds that halve a job's weight
    gang_exponent: float = option(1.5, 0.0)  # the size term counts a job's GPUs as num_gpus ** this
    # the objective knob: 0 weighs a job by its size term (JCT first), 1 by its requested GPUs (its work per
    # unit of speed: work done first); between, the geometric mix size_term ** (1 - w) x num_gpus ** w. The
    # default, halfway, keeps the JCT lead and widens the thin work/h and utilisation leads (docs/results.md)
    work_weight: float = option(0.5, 0.0, 1.0)
    max_candidates: int = option(256, 1)  # queued jobs priced per round at most
    price_depth: float = option(4.0, 0.0, lo_open=True)  # priced queue head: minimal demand up to this x the free share
    pricing: bool = option(True)  # shadow prices choose the shapes; False = each job its best shape (ablation)
    reprice_interval_s: float = option(3600.0, 0.0)  # re-solve prices at most this often; 0 = every round, s
    # --- 3. placement ----------------------------------------------------------------------------------
    max_attempts: int = option(8, 1)  # placement predictions per round at most (bounds a round's cost)
    # training without a service on its GPUs runs with no compute limit, its share the slice it books (at least
    # shapes.UNLIMITED_MIN_SHARE_PCT); False: every training share is a compute limit (isolation between
    # training tenants, at the throughput the measured pairs give up under limits)
    unlimited_training: bool = option(True)
    # --- 4. preemption ---------------------------------------------------------------------------------
    preempt_ratio: float = option(2.0, 0.0)  # a waiting job must outweigh a victim by this factor (> 1; 0 = off)
    min_run_s: float = option(1800.0, 0.0)  # a job placed/resized less than this ago is never preempted or resized, s
    max_preempt_jobs: int = option(4, 0)  # waiting jobs served by preemption per round at most (0 = off)
    preempt_interval_s: float = option(300.0, 0.0)  # run the preemption pass at most this often, s
    restart_s: float = option(60.0, 0.0)  # restart cost of a resize/preemption the policy assumes, s
    # --- 5. slack --------------------------------------------------------------------------------------
    slack: bool = option(True)  # size lone services for a training co-tenant and fill that slack with waiting jobs
    slack_floor: float = option(0.25, 0.0, 1.0)  # a job placed in a service's slack keeps at least this of its speed
    slack_interval_s: float = option(1800.0, 0.0)  # the slack pass runs at most this often, s
    # --- 6. elastic expand (GPU-count shapes) ------------------------------------------------------------
    elastic_gpus: bool = option(True)  # GPU-count shapes: grow gangs onto idle GPUs, give them back
    shrink_gpus: bool = option(True)  # also offer queued jobs shapes on halvings of their gang (needs elastic_gpus)
    # a shrunk gang keeps at least this of its isolated speed; 0.125 lets a linearly scaling gang take every offered
    # halving down to an eighth (docs/results.md: the work it adds at load 2)
    min_count_speed: float = option(0.125, 0.0, 1.0, lo_open=True)
    keep_heavy_growth: bool = option(True)  # give back only grown gangs lighter than a waiting job
    defrag_moves: int = option(4, 0)  # jobs moved per round at most to clear nodes for shrunk gangs (0 = off)
    expand_gain: float = option(4.0, 0.0)  # expand only if the predicted saving exceeds this x restart_s
    # --- 7. observed interference ----------------------------------------------------------------------
    # lower the estimate of pairs seen running together slower (ElastiCo.learn); the engine computes
    # JobTable.observed_norm only for a policy that uses it
    learn_observed: bool = option(True)
