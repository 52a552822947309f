"""Concurrency: many SubmitJob at once from the tenant tokens, duplicates among them, and the audit afterwards.

A fifth of the request ids are sent 2-3 times at the same moment; afterwards each request id must map to exactly one
job (``duplicated`` 0) and every acknowledged job must exist (``lost`` 0).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace

import grpc

from bench.reliability.live import CHANNEL_OPTIONS, TENANTS, Run, retry, say, section
from elastico.v1 import allocator_pb2 as apb
from elastico.v1 import allocator_pb2_grpc
from elastico.v1 import types_pb2 as tpb


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
                resp = retry(lambda tenant=tenant, token=token: stub.ListJobs(
                    apb.ListJobsRequest(tenant=tenant, page_size=1000, page_token=token), timeout=30))
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
                    found[job_id] = retry(lambda job_id=job_id: stub.GetJob(apb.GetJobRequest(job_id=job_id), timeout=10)).job
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
