"""RSS of every process, GetClusterState latency with many finished jobs in the store, health after everything.

The finished jobs are written straight to the store (``RedisStore.create_jobs`` as the admin user, state SUCCEEDED),
so the live scheduler never sees them; RSS growth is judged from the start to after the load phases.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import time
import uuid
from pathlib import Path

import redis

from bench.reliability.live import CHANNEL_OPTIONS, NAMESPACE, Run, say, section
from elastico.domain import Job, JobKind, JobSpec, JobState, StateReason, TrainingWork
from elastico.healthcheck import health_status
from elastico.state.redis_store import RedisStore
from elastico.v1 import allocator_pb2 as apb
from elastico.v1 import allocator_pb2_grpc

CLUSTER_STATE_CALLS = 200
TARGET_CS_P50_S = 0.020
RSS_BOUND_MB = {"allocator": 300.0}  # every other process: RSS_BOUND_OTHER_MB
RSS_BOUND_OTHER_MB = 200.0


def rss(run: Run) -> dict[str, tuple[int, float]]:
    """name -> (pid, VmRSS MiB) of every process of the cluster."""
    run.refresh()
    out = {}
    for p in run.state["procs"]:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p['pid']}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    out[p["name"]] = (p["pid"], int(line.split()[1]) / 1024)
    return out


def print_rss(start: dict, loaded: dict, end: dict, smoke: bool) -> list[tuple[str, float, float, bool]]:
    """Growth from start to after the load phases (same processes), judged against the bounds; the end column
    is shown too (a process restarted by the faults starts over there)."""
    section("4. RSS (VmRSS, MiB): start -> after hostile input + concurrency -> after the faults")
    rows = []
    for name, (pid, a) in start.items():
        b = loaded.get(name, (pid, math.nan))[1]
        epid, e = end.get(name, (0, math.nan))
        bound = RSS_BOUND_MB.get(name, RSS_BOUND_OTHER_MB)
        growth = max(b, e) - a if epid == pid else b - a
        ok = growth <= bound
        restarted = " (restarted during the faults)" if epid != pid else ""
        say(f"  {name:<10} {a:7.1f} -> {b:7.1f} -> {e:7.1f}{restarted}   growth {growth:+7.1f} MiB (bound <= {bound:.0f})"
            f"  [{'smoke: not judged' if smoke else ('PASS' if ok else 'FAIL')}]")
        rows.append((name, growth, bound, ok))
    return rows


async def _insert_finished(admin_url: str, n: int) -> float:
    store = RedisStore.from_url(admin_url, namespace=NAMESPACE)
    spec = JobSpec(kind=JobKind.TRAINING, tenant="archive", model_family="ResNet-18", batch_size=64, training=TrainingWork(1000))
    tag = uuid.uuid4().hex[:8]
    t0 = time.perf_counter()
    try:
        for start in range(0, n, 500):
            # written finished from the start (the same create_jobs transaction, state SUCCEEDED): never in the active
            # set, so the live scheduler never sees them pending
            await store.create_jobs([Job(job_id=f"fin-{tag}-{i}", request_id=f"fin-{tag}-{i}", spec=spec, state=JobState.SUCCEEDED,
                                         reason=StateReason.COMPLETED, progress_steps=1000.0)
                                     for i in range(start, min(n, start + 500))])
    finally:
        await store.close()
    return time.perf_counter() - t0


def cluster_state_latency(run: Run, finished: int) -> tuple[float, float, int]:
    section(f"5. GetClusterState latency with {finished} finished jobs written to the store")
    secs = asyncio.run(_insert_finished(run.admin_url, finished))
    total = redis.Redis.from_url(run.admin_url).zcard("{" + NAMESPACE + "}:jobs")
    lat = []
    with run.operator().channel(run.addr("allocator"), options=CHANNEL_OPTIONS) as ch:
        stub = allocator_pb2_grpc.AllocatorStub(ch)
        stub.GetClusterState(apb.GetClusterStateRequest(), timeout=30)  # warm the channel
        for _ in range(CLUSTER_STATE_CALLS):
            t0 = time.perf_counter()
            stub.GetClusterState(apb.GetClusterStateRequest(), timeout=30)
            lat.append(time.perf_counter() - t0)
    lat.sort()
    p50, p99 = statistics.median(lat), lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    say(f"  inserted {finished} in {secs:.1f} s (store holds {total} jobs in all); {CLUSTER_STATE_CALLS} calls: "
        f"p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, max {lat[-1] * 1e3:.1f} ms (target p50 <= {TARGET_CS_P50_S * 1e3:.0f} ms)")
    return p50, p99, total


def health(run: Run) -> dict[str, str]:
    section("6. health after everything")
    run.refresh()
    out = {}
    for p in run.state["procs"]:
        if p["name"] == "redis":
            try:
                out["redis"] = "PONG" if redis.Redis.from_url(run.admin_url, socket_timeout=2).ping() else "NO PONG"
            except redis.exceptions.RedisError as exc:
                out["redis"] = f"UNREACHABLE ({exc})"
        else:
            out[p["name"]] = health_status(p["address"], timeout_s=5, tls=run.cert_only())
    say("  " + "  ".join(f"{k} {v}" for k, v in out.items()))
    return out
