"""ElastiCo: MPS-share and GPU-count shapes, priced by elastic shadow prices, placed interference-aware.

One round (:meth:`ElastiCo.decide`) is the same for the simulator and the live allocator; gangs always keep
the node topology (:func:`placement.pick_gang`). Options and defaults: :class:`ElastiCoParams`; the
measurements behind them: ``docs/results.md`` (its ElastiCo sections and "Measurement history by component").

1. **Inference first** (:mod:`.serving`). Services are re-sized to the smallest share meeting their SLO at
   their *forecast* load next to the *predicted* interference of their co-tenants; a lone service is sized
   for one training co-tenant when that leaves a training share free (that share would idle otherwise).
   Growing evicts the lightest training tenants, never a service; shrinking waits ``shrink_after_s``.
2. **Pricing** (:mod:`.training`). The heaviest queued jobs offer their shapes (shares keeping
   ``train_floor``, on their gang and its halvings). Utility = normalised speed x weight, with
   ``weight = priority x (1 + waiting_s / age_scale_s) / (1 + num_gpus ** gang_exponent x remaining_s /
   size_scale_gpu_s)``: shortest remaining GPU-work first (a gang needs all its GPUs at once), and an ageing
   term without bound (no starvation); least attained service without runtime estimates. ``work_weight``
   (the objective knob, 0.5 by default) mixes that size term with the requested GPUs: at 1 the utility is the
   job's rate of work (GPUs x speed), and the round does the most work it can. The pricer core
   chooses "one shape or wait per job" within free share and tenant slots; prices are warm-started and
   re-solved at most every ``reprice_interval_s`` (jobs best-respond to the posted ones in between).
3. **Placement** (:mod:`.training`). In weight order, each priced job takes the gang that maximises its
   predicted speed x weight minus what its new co-tenants lose, where every tenant keeps its floor; full
   gang before a shrunk one, ties to the fullest GPU (whole GPUs stay free for gangs).
4. **Preemption by value** (:mod:`.preemption`). A waiting job that outweighs running ones by
   ``preempt_ratio`` empties the cheapest gang whose tenants all ran ``min_run_s`` (hysteresis: victims pay
   ``restart_s``, so churn must buy clearly more value).
5. **Slack** (:mod:`.serving`). Jobs still waiting, lightest first, take the share services leave, keeping
   ``slack_floor`` of their speed: a long job gains most from slow progress.
6. **Elastic expand** (:mod:`.counts`). With nobody waiting, capped jobs grow their share (a job alone under the
   limit of a service that has left is relaunched without one) and gangs grow onto idle GPUs (measured scaling
   curves, read pessimistically) when the time saved exceeds ``expand_gain`` restarts; when jobs wait, grown
   gangs lighter than them give the GPUs back, and gangs running shrunk may grow onto the empty GPUs as the
   heavier ones may. A one-node gang still shrunk gets a node cleared for it: the few settled training jobs on
   the node with fewest tenants move to empty GPUs elsewhere (never a service; at most ``defrag_moves`` jobs a
   round, when the time saved pays for every restart).
7. **Observed interference** (:mod:`.learning`). A training pair seen running slower than estimated is
   not co-located again on the estimate's word.

A job that declares its shapes (``JobSpec.shapes``) is priced and placed in those only, in every pass.
Rounds that would decide the same as an earlier one are skipped (:mod:`.cache`).
"""

from services.allocator.policy.elastico.core import ElastiCo
from services.allocator.policy.elastico.params import ElastiCoParams

__all__ = ["ElastiCo", "ElastiCoParams"]
