"""Faults while the jobs run: ``kill -9`` of a node agent, the allocator leader and Redis, each restarted.

An agent comes back with the environment the cluster gave it (read from ``/proc/<pid>/environ``: ``cluster.spawn``
knows only the services), the allocator through ``cluster.spawn``, Redis from its own command line (same port, data
dir with the AOF, ACL file; the line says how many keys it held before and after, and, when it lost some, the AOF
replay errors of its log). Then the probe waits until every job is terminal or running, and audits again.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
import redis

from bench.reliability.jobs import Audit, Submitted, audit_jobs
from bench.reliability.live import CHANNEL_OPTIONS, REPO_ROOT, TENANTS, Run, kill9, proc_env, retry, save_pid, say, section
from devtools import cluster
from elastico.redis_embedded import EmbeddedRedis
from elastico.v1 import allocator_pb2 as apb
from elastico.v1 import allocator_pb2_grpc, node_agent_pb2_grpc
from elastico.v1 import node_agent_pb2 as npb
from elastico.v1 import types_pb2 as tpb


@dataclass
class Faults:
    lines: list[str] = field(default_factory=list)
    settled_s: float | None = None  # seconds until no job of the probe was PENDING or PLACED (None: not within the timeout)
    final: Audit | None = None


def kill_agent(run: Run, name: str) -> str:
    pid = run.pid(name)
    env = proc_env(pid)  # the environment the cluster gave it (cluster.spawn knows only the services)
    running = _count_running(run, name)
    t0 = time.monotonic()
    kill9(pid)
    with open(run.run_dir / "logs" / f"{name}.log", "ab") as log:
        p = subprocess.Popen([sys.executable, "-m", "services.node_agent"], env=env, cwd=str(REPO_ROOT),
                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    save_pid(run, name, p.pid)
    cluster.wait_serving({"procs": [next(q for q in run.state["procs"] if q["name"] == name)], "client": run.state["client"]}, 60)
    return (f"kill -9 {name} (pid {pid}, {running} workloads running): restarted with its recorded environment, "
            f"SERVING after {time.monotonic() - t0:.1f} s, now running {_count_running(run, name)} (re-adopted)")


def _count_running(run: Run, name: str) -> int | str:
    try:
        with run.cert_only().channel(run.agents[name]) as ch:
            return len(node_agent_pb2_grpc.NodeAgentStub(ch).ListWorkloads(
                npb.ListWorkloadsRequest(statuses=["starting", "running"]), timeout=5).workloads)
    except grpc.RpcError as exc:
        return f"? ({exc.code().name})"


def _leader(run: Run) -> tuple[int, str]:
    with run.operator().channel(run.addr("allocator")) as ch:
        cs = allocator_pb2_grpc.AllocatorStub(ch).GetClusterState(apb.GetClusterStateRequest(), timeout=10)
    return cs.leader_epoch, cs.leader_id


def kill_allocator(run: Run) -> str:
    epoch, leader = retry(lambda: _leader(run))
    pid = run.pid("allocator")
    t0 = time.monotonic()
    kill9(pid)
    cluster.spawn("allocator", "allocator", timeout_s=60)
    run.refresh()
    t_serving = time.monotonic() - t0
    new_epoch = epoch
    while time.monotonic() - t0 < 60:
        with contextlib.suppress(grpc.RpcError):
            new_epoch, _ = _leader(run)
            if new_epoch > epoch:
                break
        time.sleep(0.2)
    return (f"kill -9 allocator leader (pid {pid}, epoch {epoch}, {leader}): cluster.spawn restarted it, SERVING after "
            f"{t_serving:.1f} s, leading under epoch {new_epoch} after {time.monotonic() - t0:.1f} s")


def kill_redis(run: Run) -> str:
    pid = run.pid("redis")
    port = int(run.addr("redis").rsplit(":", 1)[1])
    # the command line cluster.up ran (redis-server rewrites its own argv, so it is rebuilt, not read): same binary,
    # port, data dir with the AOF and ACL file (the users' hashes are already there and stay as they are)
    cmd = EmbeddedRedis(run.run_dir / "redis", port=port).command()
    client = redis.Redis.from_url(run.admin_url, socket_timeout=2)
    keys_before = client.dbsize()
    client.close()
    t0 = time.monotonic()
    kill9(pid)
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    save_pid(run, "redis", p.pid)
    client = redis.Redis.from_url(run.admin_url, socket_timeout=1)
    while True:
        with contextlib.suppress(redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError):
            if client.ping():
                break
        if time.monotonic() - t0 > 30 or p.poll() is not None:
            raise RuntimeError("redis-server did not come back after kill -9")
        time.sleep(0.05)
    t_pong = time.monotonic() - t0
    keys_after = client.dbsize()
    client.close()
    line = (f"kill -9 redis (pid {pid}, {keys_before} keys): restarted from its command line (AOF replayed), PONG after "
            f"{t_pong:.1f} s with {keys_after} keys")
    if keys_after < keys_before:  # say why, from the restarted server's own log
        log = (run.run_dir / "redis" / "redis.log").read_text(errors="replace")
        replay = log[log.rfind(f"pid={p.pid}"):]
        errors = [ln for ln in replay.splitlines() if "CRITICAL" in ln or "NOPERM" in ln]
        line += (f"\n             !! Redis lost {keys_before - keys_after} keys in the restart; its log shows {len(errors)} "
                 f"AOF replay errors" + (f", e.g. {errors[0].split('# ', 1)[-1][:260]}" if errors else ""))
    return line


def unsettled(run: Run, sub: Submitted) -> tuple[int, int]:
    """(acknowledged jobs still PENDING or PLACED, acknowledged jobs the store no longer lists)."""
    waiting, listed = 0, set()
    with run.operator().channel(run.addr("allocator"), options=CHANNEL_OPTIONS) as ch:
        stub = allocator_pb2_grpc.AllocatorStub(ch)
        for tenant in TENANTS:
            token = ""
            while True:
                resp = stub.ListJobs(apb.ListJobsRequest(tenant=tenant, page_size=1000, page_token=token), timeout=30)
                for j in resp.jobs:
                    if j.request_id in sub.request_ids:
                        listed.add(j.job_id)
                        waiting += j.state in (tpb.JOB_STATE_PENDING, tpb.JOB_STATE_PLACED)
                token = resp.next_page_token
                if not token:
                    break
    return waiting, len(sub.job_ids - listed)


def faults(run: Run, sub: Submitted, settle_s: float) -> Faults:
    """Section 3: the three kills, one after another while the jobs run; then wait until the jobs settle."""
    section("3. faults while the jobs run (the sampler checks the invariants throughout)")
    f = Faults()
    t0 = time.monotonic()
    for fault in (lambda: kill_agent(run, "node-1"), lambda: kill_allocator(run), lambda: kill_redis(run)):
        line = fault()
        f.lines.append(line)
        say(f"  t={time.monotonic() - t0:5.1f} s  {line}")
        time.sleep(1.0)
    t_settle = time.monotonic()
    waiting = missing = None
    while time.monotonic() - t_settle < settle_s:
        with contextlib.suppress(grpc.RpcError):
            waiting, missing = unsettled(run, sub)
            if waiting == 0:  # nothing left that can still start (a missing job never comes back)
                if missing == 0:
                    f.settled_s = time.monotonic() - t0
                break
        time.sleep(1.0)
    f.final = audit_jobs(run, sub)
    if f.settled_s is not None:
        settled = f"all {len(sub.job_ids)} jobs terminal or running {f.settled_s:.1f} s after the first kill"
    elif waiting == 0:
        settled = (f"NOT settled: {missing} of {len(sub.job_ids)} acknowledged jobs are gone from the store (none is left "
                   f"pending or placed)")
    else:
        settled = (f"NOT settled within {settle_s:.0f} s: {waiting} still pending or placed, {missing} gone from the store "
                   f"(of {len(sub.job_ids)} acknowledged)")
    say(f"  {settled}")
    say(f"  audit after the faults: {f.final.listed} jobs; duplicated={f.final.duplicated} lost={f.final.lost}; "
        f"states {dict(f.final.states)}")
    return f
