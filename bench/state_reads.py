"""``python -m bench.state_reads [--smoke] [--active N]``: GetClusterState and ListJobs with a long job history.

A private redis-server (embedded) holds 10,000 finished jobs (succeeded, every 5th cancelled; two tenants) and
N active ones (half pending, half running on 16 nodes x 8 GPUs). The allocator's servicer is called in this
process (``ELASTICO_INSECURE=1`` settings, no gRPC transport, no scheduling round: every active record is
decoded on the first call, memoised by its stored JSON after) and each call timed: GetClusterState, ListJobs
unfiltered, by a terminal state, by PENDING and by tenant (pages of 100). Target: GetClusterState p50 <= 20 ms,
printed with PASS/FAIL. For reference, the pre-index path is timed too: every record read (batched here; before
the indexes it was one GET per record) and filtered in Python, as GetClusterState read the active jobs.
``--smoke`` runs reduced sizes for CI and judges nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

from elastico.argtypes import ranged
from elastico.domain import (
    GpuInfo,
    GpuSlice,
    Job,
    JobKind,
    JobSpec,
    JobState,
    NodeInfo,
    Placement,
    Shape,
    StateReason,
    TrainingWork,
)
from elastico.redis_embedded import EmbeddedRedis
from elastico.state.redis_store import RedisStore
from elastico.v1 import allocator_pb2 as apb
from elastico.v1 import types_pb2 as tpb
from services.allocator.servicer import AllocatorServicer
from services.allocator.settings import AllocatorSettings

TARGET_CLUSTER_STATE_P50_S = 0.020
NODES, GPUS = 16, 8
TENANTS = ("team-a", "team-b")


def _job(i: int) -> Job:
    spec = JobSpec(kind=JobKind.TRAINING, name=f"b{i}", tenant=TENANTS[i % 2], model_family="ResNet-50", batch_size=32,
                   training=TrainingWork(total_steps=1000))
    return Job(job_id=f"j-{uuid.uuid4().hex[:16]}", request_id=f"r-{uuid.uuid4().hex}", spec=spec)


async def fill(store: RedisStore, finished: int, active: int) -> None:
    for n in range(NODES):
        await store.put_node(NodeInfo(node_id=f"n{n:02d}", address="127.0.0.1:1", gpu_backend="simulated",
                                      last_heartbeat_s=time.time(),
                                      gpus=tuple(GpuInfo(index=g, uuid=f"GPU-{n}-{g}", gpu_type="v100", mem_total_mib=10 ** 6)
                                                 for g in range(GPUS))))
    epoch = await store.acquire_leadership("bench", 600)
    for start in range(0, finished, 500):
        made = [j for j, _ in await store.create_jobs([_job(i) for i in range(start, min(finished, start + 500))])]
        await store.update_jobs([(j, replace(j, state=JobState.CANCELLED if i % 5 == 0 else JobState.SUCCEEDED,
                                             reason=StateReason.CANCELLED_BY_CLIENT if i % 5 == 0 else StateReason.COMPLETED))
                                 for i, j in enumerate(made, start)])
    for start in range(0, active, 500):
        made = [j for j, _ in await store.create_jobs([_job(i) for i in range(start, min(active, start + 500))])]
        placing = made[::2]
        shape = Shape(1, 0.5, 10)
        placed = await store.commit_placements(epoch, [
            (j, Placement(job_id="", shape_index=0, shape=shape, slices=(GpuSlice(f"n{(start + i) % NODES:02d}", (start + i) // NODES % GPUS,
                                                                              0.5, 10),)))
            for i, j in enumerate(placing)])
        await store.update_jobs([(j, replace(j, state=JobState.RUNNING, reason=StateReason.STARTED)) for j in placed])


async def timed(call, n: int) -> tuple[float, float, float]:
    """(p50, p99, first call) of ``n`` calls after a first one."""
    t0 = time.perf_counter()
    await call()
    first = time.perf_counter() - t0
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return statistics.median(samples), samples[min(len(samples) - 1, int(len(samples) * 0.99))], first


async def bench(finished: int, active: int, calls: int) -> dict[str, tuple[float, float, float]]:
    server = EmbeddedRedis(Path(tempfile.mkdtemp(prefix="bench-reads-")) / "redis")
    server.start()
    namespace = f"bench-{uuid.uuid4().hex[:6]}"
    writer = RedisStore.from_url(server.url, namespace=namespace)
    store = RedisStore.from_url(server.url, namespace=namespace)  # the servicer's: nothing decoded before its calls
    try:
        t0 = time.perf_counter()
        await fill(writer, finished, active)
        print(f"stored {finished:,} finished + {active:,} active jobs in {time.perf_counter() - t0:.1f} s", flush=True)
        servicer = AllocatorServicer(store, AllocatorSettings.from_env({}, insecure=True, redis_url=server.url))
        out = {
            "GetClusterState": await timed(lambda: servicer.GetClusterState(apb.GetClusterStateRequest(), None), calls),
            "ListJobs (no filter)": await timed(lambda: servicer.ListJobs(apb.ListJobsRequest(page_size=100), None), calls),
            "ListJobs (SUCCEEDED)": await timed(lambda: servicer.ListJobs(
                apb.ListJobsRequest(states=[tpb.JOB_STATE_SUCCEEDED], page_size=100), None), calls),
            "ListJobs (PENDING)": await timed(lambda: servicer.ListJobs(
                apb.ListJobsRequest(states=[tpb.JOB_STATE_PENDING], page_size=100), None), calls),
            "ListJobs (tenant team-b)": await timed(lambda: servicer.ListJobs(
                apb.ListJobsRequest(tenant="team-b", page_size=100), None), calls),
        }
        active_states = {JobState.PENDING, JobState.PLACED, JobState.RUNNING}

        async def scan_all() -> None:  # the pre-index path: every record, filtered here, pages of 1,000
            token = None
            while True:
                jobs, nxt = await store._list_unindexed(active_states, "", 1000, token)
                if not nxt:
                    return
                token = int(nxt)

        out["reference: every record scanned for the active jobs (pre-index path)"] = await timed(scan_all, 3)
        return out
    finally:
        await store.close()
        await writer.close()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.state_reads", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="reduced sizes for CI (seconds); the target is not judged")
    ap.add_argument("--active", type=ranged(0, cast=int), default=None, help="active jobs (default 1,000; smoke 100)")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    finished, calls = (2_000, 30) if a.smoke else (10_000, 200)
    active = a.active if a.active is not None else (100 if a.smoke else 1_000)
    print(f"bench.state_reads: real redis-server, servicer called in process (insecure settings), {NODES} nodes x {GPUS} GPUs"
          f"{' [SMOKE: reduced sizes, target not judged]' if a.smoke else ''}", flush=True)
    res = asyncio.run(bench(finished, active, calls))
    for name, (p50, p99, first) in res.items():
        print(f"{name}: p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms (first call {first * 1e3:.2f} ms)")
    p50 = res["GetClusterState"][0]
    ok = p50 <= TARGET_CLUSTER_STATE_P50_S
    verdict = "smoke" if a.smoke else ("PASS" if ok else "FAIL")
    print(f"GetClusterState p50 {p50 * 1e3:.2f} ms with {finished:,} finished + {active:,} active jobs "
          f"(target <= {TARGET_CLUSTER_STATE_P50_S * 1e3:.0f} ms) [{verdict}]")
    return 0 if (a.smoke or ok) else 1


if __name__ == "__main__":
    sys.exit(main())
