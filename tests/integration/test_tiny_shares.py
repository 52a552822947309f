"""Jobs at a tiny declared share hold a GPU's slots, not its compute (the ninth session's probe: a tenant's
1 %-share jobs kept every other job off their GPUs): the real allocator Scheduler places another tenant's job
beside them, and the simulated GPUs run it at nearly its full speed."""

from __future__ import annotations

from elastico.coloc.truth import tenant_speeds
from elastico.domain import Shape, TrainingWork
from elastico.state.memory import MemoryStore
from services.allocator.rounds import Scheduler
from tests.conftest import make_job, make_spec
from tests.integration.test_allocator_rounds import agent_reports, heartbeat, leader, settings

LONG = TrainingWork(total_steps=10**9)
R50 = {"model_family": "ResNet-50", "batch_size": 64}  # saturates a V100 alone (solo utilisation 1.0)


async def test_jobs_at_a_tiny_share_leave_their_gpus_to_another_tenant():
    store = MemoryStore()
    await heartbeat(store, "n1", gpus=2)
    lease, epoch = await leader(store, "a")
    sch = Scheduler(store, settings(elastic_gpus=False), lease)
    tiny = Shape(num_gpus=1, compute_share_pct=1.0, mem_mib=1024)
    held = [(await store.create_job(make_job(spec=make_spec(tenant="team-a", shapes=(tiny,), training=LONG, **R50))))[0]
            for _ in range(2)]
    rep = await sch.round(epoch)
    assert sorted(rep.placed) == sorted(j.job_id for j in held)
    await agent_reports(store, "n1")
    gpu_of = {j.job_id: (await store.get_job(j.job_id)).placement.slices[0].gpu_index for j in held}
    assert len(set(gpu_of.values())) == 1  # they barely slow each other: one GPU holds both, the other stays free
    others = [(await store.create_job(make_job(spec=make_spec(tenant="team-b", training=LONG, **R50))))[0]
              for _ in range(2)]
    rep = await sch.round(epoch)
    assert sorted(rep.placed) == sorted(j.job_id for j in others)  # one on the free GPU, one beside the 1 % jobs
    beside = [j for j in others if (await store.get_job(j.job_id)).placement.slices[0].gpu_index in gpu_of.values()]
    assert len(beside) == 1
    share = (await store.get_job(beside[0].job_id)).placement.slices[0].compute_share_pct
    # what the node's simulated GPU then runs it at: next to the two 1 % jobs, nearly its speed alone at that share
    r50 = "ResNet-50 (batch size 64)"
    alone = tenant_speeds("v100", [(r50, share)])[0]
    assert tenant_speeds("v100", [(r50, share), (r50, 1.0), (r50, 1.0)])[0] > 0.95 * alone
