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

       weight = priority x (1 + waiting_s / age_scale_s) x size_term

   -- a waiting-age factor that grows without bound while a job waits (no starvation: any queued job
   eventually outweighs every running one) times a short-job preference:

   * **information parity** (``use_estimates=True``, default): when the caller supplies
     ``JobTable.remaining_est_s`` (the simulator hands the *same* numbers to EASY backfilling and Lucid;
     the live allocator fills it from its estimator), ``size_term = 1 / (1 + num_gpus ** gang_exponent x
     remaining_est_s / size_scale_gpu_s)`` -- shortest remaining GPU-work first, with a gang counted
     super-linearly (``gang_exponent = 1.5``): a big gang costs more than its area, because it needs that
     many GPUs free at once and, once preempted, waits long for them again (at 512 GPUs @ load 1, 2000
     jobs, 8-GPU victims waited 14 h on average before restarting). Measured (predictor estimate before
     its monotone encoding constraint, seed 0, avg JCT at exponent 1 -> 1.5): 64 GPUs, 400 jobs, @ 0.25/
     0.5/1/2: 99.24/117.92/162.15/248.07 -> 99.54/117.76/159.39/249.13 h; 512 GPUs, 2000 jobs: 44.75/49.01/
     64.43/99.20 -> 44.75/48.78/63.97/98.74 h; 512 @ 1 with inference seed 1: 64.47 -> 64.44 h; jobs
     arriving 1000-3000 h: 512 @ 1 24.58 -> 24.72 h, 64 @ 1 28.04 -> 27.14 h (better in 7 of 11 cells by
     0.1-3.2 %, worse in 3 by 0.3-0.6 %).
     Exponent 0.5 / 0.75 / 1.25 / 2 at 512 @ 1: 66.28 / 64.80 / 64.16 / 64.40 h; 2 at 512 @ 2: 100.53 h.
     Rows with NaN fall back to
   * **non-clairvoyant** ``size_term = 1 / (1 + attained_gpu_s / las_scale_gpu_s)`` (least attained
     service, as in Tiresias).

   Starvation bound with the defaults (``age_scale_s`` = 1 day, ``size_scale_gpu_s`` = 1 GPU-hour): a
   queued job of size S = num_gpus ** 1.5 x remaining hours outranks every freshly arrived job once it has
   waited about S days (its weight ``(1 + wait/1 d) / (1 + S)`` reaches 1, the most a fresh job can
   have); the day-scale ageing keeps the shortest-remaining-work order intact over normal queueing times
   (an hour-scale ageing measured 352 h vs 333 h avg JCT at 64 GPUs, load 2, 300 jobs).

   Pools: free MPS share (percent, summed over GPUs) and free tenant slots. The pricer core solves "one shape or wait per job, maximise utility" and returns the
   shapes; its prices are warm-started across rounds. Only the head of the weight-ordered queue is
   priced (candidates whose minimal demand covers ``price_depth`` x the free share, at most
   ``max_candidates``): jobs further back cannot win capacity this round, and leaving them out keeps a
   512-GPU round cheap. Prices are re-solved at most every ``reprice_interval_s`` of (virtual or wall)
   time; in between, jobs best-respond to the posted prices (``argmax utility - prices . demand``, the
   market's decentralised step), and jobs priced out keep their best shape but queue behind every job
   with positive surplus, so stale prices never leave capacity idle. Default interval 30 min (was 1 h):
   predictor estimate, seed 0, avg JCT 3600 -> 1800 / 900 s: 512 GPUs @ 1, 2000 jobs, inference seeds
   0/1/2: 64.18/64.44/64.21 -> 63.95/64.21/63.83 / 63.96/64.18/63.94 h; 64 GPUs, 400 jobs, @ 0.25/0.5/1/2:
   99.54/117.76/159.39/249.13 -> 99.54/117.76/159.43/248.60 h (900 s: 159.48/248.39); 512 @ 0.25/0.5/2:
   44.75/48.77/98.85 h (was 44.75/48.78/98.89). Each re-solve costs: the whole trace at 512 GPUs took
   85 / 98 / 130 s at 3600 / 1800 / 900 s, measured one after the other.
3. **Placement.** In weight order, each priced job goes to the gang of GPUs that maximises predicted
   utility: its own predicted speed x weight minus the weighted speed its new co-tenants lose, among
   GPUs with a free slot and share where every tenant stays above its floor (training: ``train_floor``
   of isolated speed or no worse than now; inference: SLO at forecast). If the priced share does not
   fit anywhere, the job's other shapes are tried. Multi-GPU jobs are gang-placed and run at their
   slowest GPU's pace (the engine enforces it; the placement scores each GPU). Default
   ``train_floor = 0.85``: a co-location that leaves a training tenant below 85 % of its isolated speed
   rarely pays for itself -- two such tenants together barely beat one GPU of work, and with GPU-count
   shapes (6) a slowed job is better off waiting for, or growing onto, whole GPUs. Measured (predictor
   estimate, seed 0, avg JCT at 0.7 -> 0.85): 64 GPUs, 400 jobs, @ load 0.25/0.5/1/2: 99.17/121.98/169.21/
   254.09 -> 99.15/120.60/165.45/253.73 h; 512 GPUs, 2000 jobs: 44.87/49.23/65.98/103.18 -> 44.74/48.97/
   64.44/101.31 h; 512 @ 1 with inference seed 1: 66.01 -> 64.58 h; jobs arriving 1000-3000 h: 512 @ 1
   25.23 -> 24.73 h, 64 @ 1 28.08 -> 28.37 h (the one cell of eleven where it is worse). Other floors at
   512 @ 1: 0.6 70.94, 0.8 64.72, 0.9 64.81, 0.95 65.14 h. (Older, without GPU-count shapes: 64 GPUs @ load
   2, 300 jobs, 333 h at 0.5 vs 314 h at 0.7.) Predictions are made
   only on GPUs with room for the smallest share (under contention a handful of the 512).

4. **Preemption by value (elastic shrink to zero), with hysteresis.** If the highest-weight queued
   training jobs still wait, running training jobs whose weight is below ``1 / preempt_ratio`` of the
   waiting job's and that have run at least ``min_run_s`` since their last placement/resize are
   preempted to empty the ``num_gpus`` GPUs whose tenants weigh least (every tenant of such a GPU must be
   such a victim, and all victims together must still weigh under ``1 / preempt_ratio`` of the waiting
   job); the waiting job is placed there at its full-speed share, and GPUs its victims leave elsewhere are
   refilled by a second placement pass in the same round. The victim keeps
   its progress and pays ``restart_s`` (checkpoint/relaunch) when it runs again. The ratio (default 2)
   and the minimum run time are the hysteresis: a job just (re)started is never displaced, and a
   preempted job must out-age the ratio before it can displace its displacer, so shapes do not thrash.
   Ratio 4 -> 2 (with ``train_floor`` 0.85; predictor estimate, seed 0, avg JCT): 64 GPUs, 400 jobs, @
   0.25/0.5/1/2: 99.15/120.60/165.45/253.73 -> 99.24/117.92/162.15/248.07 h; 512 GPUs, 2000 jobs:
   44.74/48.97/64.44/101.31 -> 44.75/49.01/64.43/99.20 h; 512 @ 1, inference seed 1: 64.58 -> 64.47 h;
   jobs arriving 1000-3000 h, 512 @ 1: 24.73 -> 24.58 h, 64 @ 1: 28.37 -> 28.04 h (better in 7 of 11
   cells by 0.2-2.2 %, within 0.1 % in the other 4).
   At most ``max_preempt_jobs`` waiting jobs are served this way per pass, and the pass runs at most every
   ``preempt_interval_s`` (its triggers -- ageing, minimum run time -- move slowly).
5. **Elastic expand.** A running training job whose MPS share caps its speed (placed small under
   contention) is resized up to the smallest share at which it runs at full speed (or the largest that
   fits) when its GPUs have the free share, no waiting job was left unplaced this round, it ran
   ``min_run_s`` since its last change, and the predicted saving ``remaining x (1 - old/new speed)``
   exceeds ``expand_gain`` x ``restart_s`` (the resize restarts it).
6. **GPU-count shapes (elastic gangs, ``elastic_gpus``).** The GPU count is a shape dimension too
   (:func:`shapes.count_speed`: measured scaling curves of each job type, read pessimistically). Running
   jobs are relaunched on more GPUs -- up to their type's largest measured count (8) -- onto GPUs left
   empty by the round: all jobs when nobody waits, else only jobs heavier than every waiting job (shortest
   remaining work first applied to GPUs: the short job finishing sooner is worth more than the long one
   starting). A job is offered the count with the most time saved per added GPU, only when the saving
   exceeds ``expand_gain`` restarts, and offers go in decreasing *speed-up per added GPU* (``(T(c)/T(cur) -
   1) / (c - cur)``, from the measured curve): idle GPUs go where they add the most throughput each,
   whatever the job's length. (Ordering by time saved per added GPU, which grows with the remaining
   time, handed idle GPUs to the longest jobs, which then hold them longest; predictor estimate, seed 0,
   400/2000 jobs, avg JCT before -> after: 64 GPUs @ 0.25/0.5/1/2: 100.4/121.9/169.0/257.2 ->
   99.2/122.0/169.1/255.5 h; 512 GPUs: 45.3/50.1/66.6/103.5 -> 44.8/49.1/65.4/103.2 h.) GPUs still idle
   then upgrade the offered jobs further. When jobs wait, gangs grown beyond their request that weigh
   less than the heaviest waiting job are given back to their requested size (one restart each; which
   ones and when: below) and the queue is placed again. Only empty GPUs are added, so no co-tenant is
   affected. Measured (rule estimator, seed 0, avg JCT without -> with): 64 GPUs @ load 1, 300 jobs:
   235.5 -> 199.3 h; @ load 2: 304.6 -> 293.3 h; 512 GPUs @ load 1, 1200 jobs: 102.0 -> 70.7 h; @ load 2:
   98.4 h; 512 @ 0.25: 89.4 -> 50.5 h (exclusive backfill 89.6 h). Giving back every grown gang as soon as
   anyone waits, and growing only when nobody waits: 220.3 h (64 @ 1), 308.7 h (64 @ 2), 73.8 h (512 @ 1).

   Jobs placed in a round that leaves GPUs empty (nobody waits) are offered the same growth before they
   start, and start on the larger gang: no restart, and no ``min_run_s`` at the requested size first.
   Measured (predictor estimate, seed 0, avg JCT growing only after launch -> also at launch): 64 GPUs, 400
   jobs, @ 0.25/0.5/1/2: 96.60/115.23/158.96/248.27 -> 96.20/115.13/158.25/248.27 h; 512 GPUs, 2000 jobs:
   44.67/47.82/61.98/94.49 -> 44.44/47.42/61.74/94.41 h, @ 1 with inference seeds 1/2: 62.09/62.12 ->
   62.12/61.54 h; jobs arriving 1000-3000 h @ 1: 64 GPUs 26.63 -> 26.46 h, 512 GPUs 23.08 -> 22.88 h; the
   resampled trace below, 64 / 512 GPUs @ 1: 26.82/23.04 -> 26.03/22.79 h, @ 2: 41.26/33.44 -> 41.27/33.23
   h (better in 13 of 16 cells, the other 3 within 0.05 %), restarts -4..-49 % (512 @ 0.25: 1645 -> 845).

   *Give-back, which and when.* A grown gang is given back only once it has run ``min_run_s`` since it
   last grew or restarted -- the hysteresis preemption and growth use (a job placed or resized less than
   ``min_run_s`` ago is not changed). Without it a gang grown onto GPUs idle for a moment was shrunk at
   the next arrival and grew back when that job ended: grow/give-back pairs were 86 % of all restarts at
   512 GPUs @ load 1. Measured (predictor estimate, seed 0, avg JCT without -> with the hold): 512 GPUs,
   2000 jobs, @ 0.25/0.5/1/2: 44.75/48.77/63.95/98.85 -> 44.74/48.69/63.28/98.59 h, @ 1 with inference
   seeds 1/2: 64.21/63.83 -> 63.98/63.49 h; 64 GPUs, 400 jobs: 99.54/117.76/159.43/248.60 -> 99.57/117.87/
   159.18/247.79 h; jobs arriving 1000-3000 h @ 1: 512 GPUs 24.75 -> 24.38 h, 64 GPUs 27.14 -> 27.45 h; a
   resampled trace (3000 Philly rows drawn with replacement, Poisson arrivals), 64 / 512 GPUs @ 1: 28.77/
   26.05 -> 28.03/25.23 h, @ 2: 40.86/34.82 -> 40.76/34.22 h (better in 13 of 16 cells, worse by 0.03/0.1/
   1.1 % in 3), with 5-21 % fewer restarts in each loaded cell; a one-hour hold: 63.41 h at 512 @ 1 (seeds
   1/2: 63.32/63.07 h). Then, lightest first, gangs are shrunk only as many as the waiting jobs need: a
   gang is given back only while the empty and already freed GPUs do not cover the gangs of the waiting
   jobs heavier than it. Giving back *every* such gang whenever anyone waited freed, for one waiting 1-GPU
   job, dozens of GPUs that then idled or went to other growth. Measured (same setup, with the hold, avg
   JCT every -> needed): 64 GPUs @ 0.25/0.5/1/2: 99.57/117.87/159.18/247.79 -> 96.60/115.23/158.96/248.27
   h; 512 GPUs: 44.74/48.69/63.28/98.59 -> 44.67/47.82/61.98/94.49 h, @ 1 with inference seeds 1/2: 63.98/
   63.49 -> 62.09/62.12 h; jobs arriving 1000-3000 h @ 1: 64 GPUs 27.45 -> 26.63 h, 512 GPUs 24.38 -> 23.08
   h; the resampled trace, 64 / 512 GPUs @ 1: 28.03/25.23 -> 26.82/23.04 h, @ 2: 40.76/34.22 -> 41.26/33.44
   h (better in 14 of 16 cells, worse by 0.2/1.2 % in 2), with 25-45 % fewer restarts in the loaded cells
   (512 @ 1: 6825 -> 4401).
   ``shrink_gpus`` also offers queued jobs halvings of their gang (tried after every full-gang shape): it
   raises work done per hour where scaling is sub-linear (64 @ 2: 50.9 -> 55.4 GPU-h/h) but costs average
   JCT (64 @ 1: 227.8 h, 64 @ 2: 312.9 h; 512 @ 1: 77.3 h), because the shrunk jobs are mostly long ones
   that then run slowly for most of their lives; so it is off by default.

7. **Observed interference corrects the estimate** (``learn_observed``, :meth:`ElastiCo.learn`). The
   estimate is a model's; a pair it overrates slows both tenants for as long as they share the GPU, and
   without feedback the policy would make the same mistake with every later job of those types. Each
   round, a training job alone on one GPU with one other training job is a measurement of that pair (the
   simulator supplies the ground-truth interference; live, the node agents' ``norm_throughput``), and a
   value below the estimate replaces it. Measured (predictor estimate, seed 0, avg JCT without -> with),
   with the ground truth the predictor was trained on (Gavel's ``coloc_gavel_pairs.csv``): 64 GPUs, 400
   jobs, @ 0.25/0.5/1/2: 96.20/115.13/158.25/248.27 -> 96.20/115.13/158.73/248.54 h; 512 GPUs, 2000 jobs:
   44.44/47.42/61.74/94.41 -> 44.44/47.58/61.53/94.18 h (within 0.3 % either way: the estimate is close to
   that truth); with Gavel's *other* measurement campaign as ground truth (``--pairs
   data/coloc_gavel_oracle_pairs.csv``, where many pairs the first campaign stored as exactly isolated
   speed run at 0.45-0.8): 64 GPUs 96.37/115.20/162.18/256.89 -> 96.27/115.07/160.16/255.58 h, 512 GPUs
   45.39/49.45/67.57/104.69 -> 44.77/48.36/65.05/101.17 h (better in all 8 cells, up to 3.7 %; an oracle
   estimate, the measured values themselves, gives 64.33 h at 512 @ 1). Raising estimates too (pairs that
   run better than predicted): 64 @ 1 159.25 h, 512 @ 1 61.54 h with the first truth, the same 160.16 /
   65.05 h with the second -- not adopted.

State across rounds: the posted prices and when they were solved, when the preemption pass last ran,
the estimate as corrected by observations, and two skip caches (the state of the last round whose
training pass placed nothing / whose inference pass changed nothing, which would decide the same again). All of it is driven by the view's clock, so
simulated runs stay deterministic.

Tried, measured, not adopted (rule estimator, seed 0; avg JCT, this version in brackets):

* observed-speed feedback -- move a running training job whose *observed* speed is < 0.95 to idle whole
  GPUs when nobody waits and the time saved exceeds 4 restarts -- together with placing new inference
  services on the GPU that loses the least predicted training speed: 64 GPUs @ load 1: 235.7 h [235.5],
  @ load 2: 308.3 h [304.6]; 512 GPUs @ load 0.25, 1200 jobs: 89.4 h [89.4];
* displacing a gang only for a gang at least as large: 64 GPUs @ load 1: 240.8 h [235.5];
* refusing a slowed start (predicted speed < 1) when waiting for whole GPUs (EASY's shadow time from the
  same estimates) would finish sooner, plus moving a growing inference service to an idle GPU instead of
  evicting training: 64 GPUs @ 1: 234.4 h [235.5], @ 2: 306.3 h [304.6]; 512 @ 0.25: 89.38 h [89.37];
* a minimum wait before a job may displace others (30 min / 2 h): 512 @ 0.25: 89.37 / 89.41 h [89.37];
* predictor estimate, 2000 jobs, 512 GPUs @ load 1 [66.56 h before the speed-up ordering of 6]: *moving*
  a running job slowed by co-tenants or its share cap onto empty GPUs at its full-speed share (as a
  GPU-count offer next to growing): 65.75 h there, but 0.2-0.6 % worse at 64 GPUs; shrinking a preempted
  gang onto its GPUs outside the preemptor's instead of requeueing it: 66.51 h (it then runs slowly for
  the rest of its long life, worse than waiting ~15 h for a whole gang again); weighting a GPU's
  preemption cost by its tenants' gang sizes: 68.25 h (x GPUs) / 71.70 h (x GPUs^2); preempt_ratio 2 / 8 /
  16: 65.60 / 66.95 / 67.28 h (2 adopted later, with train_floor 0.85: see 4); max_preempt_jobs 16:
  65.80 h; min_run_s 600: 65.74 h; no preemption:
  74.67 h; inference shares in 10 % / 5 % steps: 65.93 / 65.84 h (the freed fragments sit on GPUs that
  training gangs cannot use); ordering growth by waiting weight (shortest first): 67.13 h. In that cell
  every GPU is busy whenever a growable job is below its largest count (time-average of min(empty GPUs,
  growth headroom) 1.5 GPUs), so the remaining JCT there is capacity, not idle GPUs;
  no preemption at all: 89.51 h (that cell is bound by run times: every scheduler's queueing delay there
  is under 0.6 h of ~89 h).
* with the needed-only give-back of 6 (predictor estimate, seed 0; 64 GPUs @ 1 / 512 GPUs @ 1 [158.96 /
  61.98 h]): shrinking a gang only down to the largest allowed count that frees enough, not to its
  request: 158.92 / 61.97 h; leaving 1 % / 3 % of the GPUs empty when growing (room for the next
  arrivals): 160.04 / 66.75 h, 163.26 / 67.10 h -- growth onto idle GPUs is most of the gain at 512 @ 1;
  lifting the give-back hold for a waiting job 16x heavier: 157.48 / 61.76 h, but mixed over the 16 cells
  of 6 (-1.8 % to +1.2 %); preempt_ratio 1.5: 157.36 / 61.65 h, better in 11 of the 16 cells (up to
  -2.7 %), worse in 4 (up to +0.7 %), with 5-30 % more restarts (64 @ 2: 1508 -> 1932) -- not worth the
  churn a real restart costs; min_run_s 900 / 3600: 158.05 / 62.08 h, 158.85 / 61.86 h; gang_exponent
  1.25 / 2: 159.69 / 62.45 h, 161.31 / 62.25 h; age_scale_s 2 days: 159.04 / 62.11 h.
* with growth at launch (6; [158.25 / 61.74 h]): while jobs wait, letting a job placed this round start
  grown only if it is heavier than every waiting job, as for running jobs: 158.21 / 61.78 h, and 64 @ 2
  249.51 h [248.27], 512 @ 0.5 / 2 47.56 / 94.72 h [47.42 / 94.41], resampled 64 @ 2 40.91 h [41.27] --
  mixed, slightly worse, so a job placed this round may grow onto GPUs left empty whatever its weight.

Not done (yet): inference forecasts tighter than the engine's one-hour peak; growing a gang onto GPUs that
have tenants (only empty GPUs are added; at 512 GPUs @ load 1 the free share on occupied GPUs while nobody
waits and some job could grow averages 6.6 GPU-equivalents, about 1 % of the cluster).
"""

from __future__ import annotations

import math

import numpy as np

from services.allocator.policy.baselines import Policy
from services.allocator.policy.inference import required_share_pct, slo_margin
from services.allocator.policy.placement import TenantState, pick_gang, predict_join, tenant_weights, weighted_loss
from services.allocator.policy.pricing import choose_shapes
from services.allocator.policy.shapes import (
    SHARES_PCT,
    count_options,
    count_speed,
    grow_options,
    min_count,
    shape_speed_table,
    share_speed,
)
from services.allocator.policy.view import (
    INFERENCE,
    TRAINING,
    ClusterView,
    Decision,
    occupy,
    slot_all,
    slot_any,
    slot_max,
    slot_sum,
    vacate,
)


class ElastiCo(Policy):
    """Shapes + shadow pricing + interference-aware placement. See module docstring."""

    name = "elastico"
    mps_limits = True
    needs_periodic_rounds = True

    def __init__(self, estimate: np.ndarray, kappa: float, train_floor: float = 0.75, slo_factor: float = 10.0,
                 age_scale_s: float = 86400.0, las_scale_gpu_s: float = 3600.0, max_candidates: int = 256,
                 max_attempts: int = 8, shrink_after_s: float = 1800.0, inference_headroom: float = 1.0,
                 shares_pct: tuple[int, ...] = SHARES_PCT, solver=None, use_estimates: bool = True,
                 size_scale_gpu_s: float = 3600.0, price_depth: float = 4.0, preempt_ratio: float = 2.0,
                 min_run_s: float = 1800.0, max_preempt_jobs: int = 4, restart_s: float = 60.0,
                 expand_gain: float = 4.0, reprice_interval_s: float = 1800.0, preempt_interval_s: float = 300.0,
                 elastic_gpus: bool = True, shrink_gpus: bool = True, min_count_speed: float = 0.25,
                 keep_heavy_growth: bool = True, gang_exponent: float = 1.5, learn_observed: bool = True,
                 pricing: bool = True):
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
        self._counts_cache: dict = {}  # (type table, type, requested GPUs) -> (allowed counts, speeds)
        self._prices: np.ndarray | None = None
        self._priced_at_s = -np.inf  # when the posted prices were last solved, s
        self._preempt_checked_s = -np.inf  # when the preemption pass last ran, s
        self._idle_sig: tuple | None = None  # (raw, filtered) state of the last round whose training pass placed nothing
        self._inf_key: tuple | None = None  # (whole cluster, services' GPUs) of the last round whose inference pass changed nothing
        self._inf_recheck_s = np.inf  # when a deferred inference shrink becomes due, s
        self._state_cache: tuple | None = None  # (inputs, TenantState) of the last training placement state
        self._learn_due = False  # this round's readings not yet learnt (:meth:`learn`)

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
            reqs = required_share_pct(jobs.load_forecast[run] * self.inference_headroom, self.slo_factor, nu,
                                      self.shares_pct)
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
        unchanged = len(d.place) + len(d.resize) + len(d.preempt) == n_before
        if unchanged and len(pend) == 0:
            self._inf_key = (whole, key or self._services_key(jobs, gj, gs, run, forecasts, pend))
        else:
            self._inf_key = None
        self._inf_recheck_s = recheck

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
        open_gpu = (gfree >= min(self.shares_pct) - 1e-9) & slot_open
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
        pend = pend[n_room[np.argmax(okp, axis=1)] >= nmin]
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
        room_cnt = {float(x): int(((room >= x - 1e-9) & open_).sum()) for x in self.shares_pct}
        # predictions are made on the GPUs with room for the smallest share only (under contention a
        # handful of 512): same decisions, a fraction of the work
        rows = np.flatnonzero((room >= float(min(self.shares_pct)) - 1e-9) & open_)
        try_order = np.argsort(-speed, axis=1, kind="stable")  # [J, S'] shapes by speed, once for all
        topo = view.topo
        shrunk_shapes = speed.shape[1] > len(self.shares_pct)
        # the loop reads the candidates' shapes one by one (often all 256 of them, most failing the
        # capacity precheck): as Python lists, without a numpy scalar per read
        cand_l, type_l, choice_l = cand.tolist(), jobs.type_idx[cand].tolist(), choice.tolist()
        order_l, ok_l, n_l, sh_l = try_order.tolist(), ok.tolist(), n.tolist(), sh.tolist()
        for c in np.flatnonzero(choice >= 0).tolist():
            if attempts >= self.max_attempts or free_slots == 0 or free_share < min(self.shares_pct):
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
                room_cnt = {float(x): int(((room >= x - 1e-9) & open_).sum()) for x in self.shares_pct}
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
        return min_count(n) if self._count_shapes(view) and self.shrink_gpus else n

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
        cnt = np.repeat(req[:, None], C, axis=1)
        valid = np.zeros((len(cand), C), bool)
        valid[:, 0] = True
        if C > 1:
            for i, r in enumerate(req):
                opts = count_options(int(r), C - 1)
                cnt[i, :len(opts)] = opts
                valid[i, :len(opts)] = True
            cspeed = count_speed(view.types.scale_tput[jobs.type_idx[cand]], cnt, req[:, None])
        else:
            cspeed = np.ones((len(cand), 1))
        valid &= cspeed >= self.min_count_speed - 1e-9
        valid[:, 0] = True
        speed = (cspeed[:, :, None] * sp[:, None, :]).reshape(len(cand), C * S)
        ok = (valid[:, :, None] & okp[:, None, :]).reshape(len(cand), C * S)
        gpus = np.repeat(cnt, S, axis=1).astype(float)
        share = np.tile(np.asarray(self.shares_pct, float), C)
        return gpus, share, speed, ok, np.repeat(cspeed, S, axis=1)

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
            victims = sorted(vic.tolist(), key=lambda t: W[t])
            touched = set(target.tolist())
            for t in victims:
                d.preempt.append(t)
                touched.update(int(g) for g in jobs.gpus[t])
                vacate(gj, gs, t, jobs.gpus[t])
            share = self._full_speed_share(float(jobs.solo_util[c]))
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
            if cur == 0 or j in gone or not math.isfinite(rem):
                continue
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
            own = np.asarray(jobs.gpus[j])
            first = np.zeros(len(gj))
            first[own] = -np.arange(len(own))  # its first GPUs that keep the topology
            mask = np.zeros(len(gj), bool)
            mask[own] = True
            target = pick_gang(first, mask, int(jobs.num_gpus[j]), view.topo)
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
            for s in self.shares_pct:
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
