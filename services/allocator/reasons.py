"""Why a pending job waits, as the round writes it on the job: NEVER_SCHEDULABLE (no healthy GPUs of the cluster
could host it), UNSCHEDULABLE_NOW with its tenant's service quota as message (:mod:`quota`), or UNSCHEDULABLE_NOW
for no capacity in the last round. Each is written on a change only, in one batch per kind; those events wake no
round (:mod:`triggers`)."""

from __future__ import annotations

from dataclasses import replace

from elastico.domain import Job, JobSpec, JobState, NodeInfo, StateReason
from elastico.errors import Conflict
from elastico.state.store import Store
from elastico.state.transaction import PreparedUpdates
from services.allocator.fit import healthy_gpus, placement_misfit

UNSCHEDULABLE_NOW_MESSAGE = "no capacity for it in the last round; retried every round"


async def write_reasons(store: Store, epoch: int, jobs: list[Job], reason: StateReason,
                        marks: list[tuple[int, Job, str]]) -> list[Job]:
    """``reason`` with each mark's message on ``jobs[i]``, in one batch; the written jobs replace theirs in
    ``jobs`` and are returned (a job changed meanwhile is left as the store has it)."""
    if not marks:
        return []
    results = await store.update_jobs([(j, replace(j, reason=reason, message=w)) for _, j, w in marks], epoch=epoch)
    written = []
    for (i, _, _), new in zip(marks, results, strict=True):
        if not isinstance(new, Conflict):
            jobs[i] = new
            written.append(new)
    return written


async def mark_never_schedulable(store: Store, epoch: int, jobs: list[Job], nodes: list[NodeInfo]) -> frozenset[str]:
    """A pending job that no healthy GPUs of the cluster as it is can host (:func:`fit.placement_misfit`: too
    large, memory or GPU type, its allowed nodes, a one-node gang) says so (NEVER_SCHEDULABLE) instead of waiting silently.

    Returns the ids of those jobs (UNSCHEDULABLE_NOW leaves them alone)."""
    if not nodes:
        return frozenset()
    healthy = healthy_gpus(nodes)
    memo: dict[tuple, str] = {}  # jobs asking for the same GPUs get the same answer (most pending jobs)

    def why(spec: JobSpec) -> str:
        key = (tuple((s.num_gpus, s.mem_mib, s.gpu_type) for s in spec.shapes), spec.allowed_nodes)
        if key not in memo:
            memo[key] = placement_misfit(spec, healthy)
        return memo[key]

    never = [(i, j, w) for i, j in enumerate(jobs) if j.state is JobState.PENDING and (w := why(j.spec))]
    await write_reasons(store, epoch, jobs, StateReason.NEVER_SCHEDULABLE,
                        [(i, j, w) for i, j, w in never if j.reason is not StateReason.NEVER_SCHEDULABLE])
    return frozenset(j.job_id for _, j, _ in never)


async def mark_held(store: Store, epoch: int, jobs: list[Job], held: dict[str, str]) -> list[Job]:
    """Queued services past their tenant's quota say so: UNSCHEDULABLE_NOW with the quota as message, written on a
    change of message only; returns those written."""
    return await write_reasons(store, epoch, jobs, StateReason.UNSCHEDULABLE_NOW, [
        (i, j, held[j.job_id]) for i, j in enumerate(jobs) if j.job_id in held
        and (j.reason is not StateReason.UNSCHEDULABLE_NOW or j.message != held[j.job_id])])


def mark_candidates(pending: list[Job], never: frozenset[str]) -> list[Job]:
    """Pending jobs that would get UNSCHEDULABLE_NOW if left queued: not marked so yet (or marked for another
    cause, such as a quota), and able to fit at all."""
    return [j for j in pending if (j.reason is not StateReason.UNSCHEDULABLE_NOW or j.message != UNSCHEDULABLE_NOW_MESSAGE)
            and j.job_id not in never]


def marked(jobs: list[Job]) -> list[tuple[Job, Job]]:
    return [(j, replace(j, reason=StateReason.UNSCHEDULABLE_NOW, message=UNSCHEDULABLE_NOW_MESSAGE)) for j in jobs]


async def mark_unschedulable_now(store: Store, epoch: int, left: list[Job], never: frozenset[str],
                                 prepared: PreparedUpdates | None = None) -> int:
    """Pending jobs this round leaves queued carry UNSCHEDULABLE_NOW: written once, on the transition (a job
    already marked, or one that can never fit, is left alone), in one batch; returns how many were written.
    ``prepared``: marks encoded during decide (:meth:`rounds.Scheduler._decide_and_prepare`)."""
    marks = mark_candidates(left, never)
    if not marks:
        return 0
    if prepared is None:
        prepared = store.prepare_updates(marked(marks), epoch=epoch)
    else:  # encoded during decide: keep the jobs left queued, encode any it did not cover
        prepared = prepared.only({j.job_id for j in marks})
        covered = {job.job_id for _, job in prepared.items}
        rest = [j for j in marks if j.job_id not in covered]
        if rest:
            prepared = PreparedUpdates(prepared.items + store.prepare_updates(marked(rest), epoch=epoch).items)
    results = await store.apply_updates(prepared)
    return sum(1 for r in results if not isinstance(r, Conflict))
