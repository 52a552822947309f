"""elastico.client against a real in-process gRPC server whose fake Allocator fails on purpose.

The fake answers the first N calls of a method UNAVAILABLE (or too slowly), pages ListJobs, and drops the
WatchJobs stream after some events, so retries (same request id, bounded), paging and watch resumption are
exercised over the wire, for the blocking and the asyncio client alike.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from elastico import domain as d
from elastico.client import (
    AllocatorClient,
    AllocatorError,
    AsyncAllocatorClient,
    ClientConfig,
    split_field,
)
from elastico.errors import InvalidSpec
from elastico.rpc import convert
from elastico.rpc.security import ClientTLS
from elastico.specs import spec_from_dict
from elastico.v1 import allocator_pb2 as apb
from elastico.v1 import allocator_pb2_grpc
from elastico.v1 import types_pb2 as pb

SPEC = {"name": "t", "kind": "training", "model_family": "ResNet-50", "batch_size": 32,
        "training": {"total_steps": 100}}


class FakeAllocator(allocator_pb2_grpc.AllocatorServicer):
    def __init__(self) -> None:
        self.fail = {}  # method -> number of calls still to answer UNAVAILABLE
        self.slow = {}  # method -> number of calls still to answer after a 0.5 s sleep
        self.calls: dict[str, list] = {}
        self.jobs: dict[str, pb.Job] = {}
        self.events = [apb.JobEvent(event_id=str(i), job_id=f"j-{i % 3}", state=pb.JOB_STATE_PENDING, version=i)
                       for i in range(1, 11)]
        self.drop_after = 4  # the first watch stream breaks after this many events
        self.watch_afters: list[str] = []
        self._lock = threading.Lock()

    def _enter(self, method: str, request, context) -> None:
        with self._lock:
            self.calls.setdefault(method, []).append(request)
            fail = self.fail.get(method, 0)
            if fail:
                self.fail[method] = fail - 1
            slow = self.slow.get(method, 0)
            if slow:
                self.slow[method] = slow - 1
        if fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "allocator restarting")
        if slow:
            time.sleep(0.5)

    def SubmitJob(self, request, context):
        self._enter("SubmitJob", request, context)
        if request.spec.batch_size == 7:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "spec.batch_size: must not be 7")
        created = request.request_id not in self.jobs
        if created:
            self.jobs[request.request_id] = pb.Job(job_id=f"j-{len(self.jobs)}", request_id=request.request_id,
                                                   spec=request.spec, state=pb.JOB_STATE_PENDING,
                                                   reason=pb.STATE_REASON_SUBMITTED)
        return apb.SubmitJobResponse(job=self.jobs[request.request_id], created=created)

    def GetJob(self, request, context):
        self._enter("GetJob", request, context)
        for j in self.jobs.values():
            if j.job_id == request.job_id:
                return apb.GetJobResponse(job=j)
        context.abort(grpc.StatusCode.NOT_FOUND, f"job {request.job_id} not found")

    def CancelJob(self, request, context):
        self._enter("CancelJob", request, context)
        for j in self.jobs.values():
            if j.job_id == request.job_id:
                if j.state == pb.JOB_STATE_CANCELLED:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"job {request.job_id} is already cancelled")
                j.state, j.reason = pb.JOB_STATE_CANCELLED, pb.STATE_REASON_CANCELLED_BY_CLIENT
                return apb.CancelJobResponse(job=j)
        context.abort(grpc.StatusCode.NOT_FOUND, f"job {request.job_id} not found")

    def ListJobs(self, request, context):
        self._enter("ListJobs", request, context)
        jobs = [pb.Job(job_id=f"j-{i}", request_id=f"r-{i}", spec=convert.job_spec_to_pb(spec_from_dict(SPEC)),
                       state=pb.JOB_STATE_RUNNING) for i in range(25)]
        start = int(request.page_token or 0)
        end = start + request.page_size
        return apb.ListJobsResponse(jobs=jobs[start:end], next_page_token=str(end) if end < len(jobs) else "")

    def WatchJobs(self, request, context):
        self.watch_afters.append(request.after_event_id)
        after = int(request.after_event_id or 0)
        sent = 0
        for ev in self.events:
            if int(ev.event_id) <= after or (request.job_ids and ev.job_id not in request.job_ids):
                continue
            if len(self.watch_afters) == 1 and sent == self.drop_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "stream dropped")
            sent += 1
            yield ev
        while context.is_active():  # then idle, as the allocator's stream is, until the deadline or a cancel
            time.sleep(0.05)


@pytest.fixture
def server():
    fake = FakeAllocator()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    allocator_pb2_grpc.add_AllocatorServicer_to_server(fake, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        yield fake, f"127.0.0.1:{port}"
    finally:
        srv.stop(0)


def client(address: str, **kw) -> AllocatorClient:
    return AllocatorClient(address, deadline_s=kw.pop("deadline_s", 2.0), backoff_s=0.001, max_backoff_s=0.01, **kw)


def test_submit_retries_unavailable_with_the_same_request_id(server):
    fake, address = server
    fake.fail["SubmitJob"] = 2
    with client(address, retries=3) as c:
        job = c.submit(SPEC)
    rids = [r.request_id for r in fake.calls["SubmitJob"]]
    assert len(rids) == 3 and len(set(rids)) == 1 and rids[0]
    assert job.request_id == rids[0] and job.state is d.JobState.PENDING
    assert job.spec.training == d.TrainingWork(100) and job.spec.model_family == "ResNet-50"


def test_gives_up_after_the_retries(server):
    fake, address = server
    fake.fail["SubmitJob"] = 10
    with client(address, retries=2) as c, pytest.raises(AllocatorError) as err:
        c.submit(SPEC, request_id="r-1")
    assert err.value.code is grpc.StatusCode.UNAVAILABLE and "restarting" in err.value.message
    assert len(fake.calls["SubmitJob"]) == 3  # one attempt + 2 retries


def test_invalid_argument_is_not_retried_and_names_the_field(server):
    fake, address = server
    with client(address, retries=5) as c, pytest.raises(AllocatorError) as err:
        c.submit({**SPEC, "batch_size": 7})
    assert len(fake.calls["SubmitJob"]) == 1
    assert (err.value.code, err.value.field, err.value.message) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                                    "spec.batch_size", "must not be 7")


def test_bad_spec_is_refused_before_it_is_sent(server):
    fake, address = server
    with client(address) as c, pytest.raises(AllocatorError) as err:
        c.submit({**SPEC, "shapes": [{"num_gpus": 1, "compute_share_pct": 50, "mem_mib": 0}]})
    assert err.value.field == "spec.shapes[0].mem_mib" and err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "SubmitJob" not in fake.calls


def test_deadline_misses_are_retried_and_a_lost_cancel_reply_is_no_error(server):
    fake, address = server
    with client(address, retries=2, deadline_s=0.2) as c:
        job = c.submit(SPEC, request_id="r-9")
        fake.slow["GetJob"] = 1
        assert c.get(job.job_id).job_id == job.job_id
        assert len(fake.calls["GetJob"]) == 2  # the slow attempt missed its deadline, the retry answered
        fake.slow["CancelJob"] = 1  # the first attempt cancels, but its reply comes after the deadline
        assert c.cancel(job.job_id).state is d.JobState.CANCELLED
        assert len(fake.calls["CancelJob"]) == 2  # the retry was told "already cancelled": the job says by us
        with pytest.raises(AllocatorError) as err:
            c.cancel(job.job_id)  # a cancel of a finished job, no deadline involved: FAILED_PRECONDITION at once
        assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION and "already cancelled" in err.value.message
        assert len(fake.calls["CancelJob"]) == 3
        fake.slow["GetJob"] = 5
        with pytest.raises(AllocatorError) as err:
            c.get(job.job_id)
        assert err.value.code is grpc.StatusCode.DEADLINE_EXCEEDED  # bounded: 1 attempt + 2 retries
    with client(address, retries=2, deadline_s=0.2).options(deadline_s=2.0, retries=0) as c:
        assert c.get(job.job_id).job_id == job.job_id  # slower than 0.2 s: answered within the wider deadline


def test_list_reads_every_page_and_retries_a_page(server):
    fake, address = server
    with client(address) as c:
        fake.fail["ListJobs"] = 1
        jobs = list(c.list(states=["running"], page_size=10))
        assert [j.job_id for j in jobs] == [f"j-{i}" for i in range(25)]
        assert [r.page_token for r in fake.calls["ListJobs"]] == ["", "", "10", "20"]  # the failed first page again
        assert all(list(r.states) == [pb.JOB_STATE_RUNNING] for r in fake.calls["ListJobs"])
        with pytest.raises(AllocatorError) as err:
            c.list(page_size=0)
        assert err.value.field == "page_size"
        with pytest.raises(AllocatorError) as err:
            c.list(states=["sleeping"])
        assert err.value.field == "states[0]"


def test_watch_resumes_after_the_last_event_when_the_stream_drops(server):
    fake, address = server
    with client(address) as c:
        events = list(c.watch(after="0", stream_deadline_s=1.0, idle_stop=True))
    assert [e.event_id for e in events] == [str(i) for i in range(1, 11)]  # none lost, none twice
    assert fake.watch_afters == ["0", "4"]
    assert events[0].state is d.JobState.PENDING and events[3].version == 4


def test_history_filters_by_job(server):
    fake, address = server
    fake.drop_after = 100
    with client(address) as c:
        hist = c.history("j-1", idle_s=1.0)
    assert [e.event_id for e in hist] == ["1", "4", "7", "10"]


def test_watch_cancel_from_another_thread(server):
    fake, address = server
    fake.drop_after = 100
    with client(address) as c:
        w = c.watch(after="8")
        got = []
        threading.Timer(0.5, w.cancel).start()
        started = time.monotonic()
        for ev in w:
            got.append(ev.event_id)
    assert got == ["9", "10"] and time.monotonic() - started < 5


async def test_async_client_retries_pages_and_watches(server):
    fake, address = server
    fake.fail["SubmitJob"] = 1
    async with AsyncAllocatorClient(address, deadline_s=2.0, backoff_s=0.001, max_backoff_s=0.01) as c:
        job = await c.submit(SPEC)
        assert len({r.request_id for r in fake.calls["SubmitJob"]}) == 1 and len(fake.calls["SubmitJob"]) == 2
        assert (await c.get(job.job_id)).request_id == job.request_id
        assert len([j async for j in c.list(page_size=7)]) == 25
        events = [e.event_id async for e in c.watch(after="0", stream_deadline_s=1.0, idle_stop=True)]
        assert events == [str(i) for i in range(1, 11)]
        assert (await c.cancel(job.job_id)).state is d.JobState.CANCELLED
        with pytest.raises(AllocatorError) as err:
            await c.cancel(job.job_id)
        assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION


def test_failover_to_the_next_address(server):
    fake, address = server
    from elastico.redis_embedded import free_port

    dead = f"127.0.0.1:{free_port()}"
    with client([dead, address], retries=2) as c:
        assert c.submit(SPEC, request_id="r-f").request_id == "r-f"


def test_spec_from_dict_names_the_field():
    spec = spec_from_dict({"kind": "INFERENCE", "model_family": "BERT", "labels": {"team": "a"},
                           "inference": {"demand_rps": 5, "latency_slo_ms": 50, "metrics": {"port": 8000}},
                           "shapes": [{"num_gpus": 1, "compute_share_pct": 50, "mem_mib": 4096}]})
    assert spec.kind is d.JobKind.INFERENCE and spec.inference.metrics.port == 8000 and spec.labels == (("team", "a"),)
    cases = [({**SPEC, "colour": 1}, "spec.colour"), ({**SPEC, "batch_size": "big"}, "spec.batch_size"),
             ({**SPEC, "training": {"total_steps": 1.5}}, "spec.training.total_steps"),
             ({**SPEC, "kind": "batch"}, "spec.kind"), ({"name": "x"}, "spec.kind"),
             ({**SPEC, "shapes": [{"num_gpus": 1}]}, "spec.shapes[0].compute_share_pct"),
             ({**SPEC, "training": None}, "spec.training"), ({**SPEC, "tenant": "a b"}, "spec.tenant"),
             ({**SPEC, "allowed_nodes": [3]}, "spec.allowed_nodes[0]"), ([1, 2], "spec")]
    for doc, field in cases:
        with pytest.raises(InvalidSpec) as err:
            spec_from_dict(doc)
        assert err.value.field == field, (doc, err.value)


def test_split_field_and_config_from_env(tmp_path):
    assert split_field('spec.labels["k"]: key too long') == ('spec.labels["k"]', "key too long")
    assert split_field("job j-1 is already cancelled") == ("", "job j-1 is already cancelled")
    default = ClientTLS(None, token="from-state")
    cfg = ClientConfig.from_env({}, default_address="127.0.0.1:6000", default_tls=default)
    assert (cfg.address, cfg.tls.token, cfg.tls.files) == ("127.0.0.1:6000", "from-state", None)
    tok = tmp_path / "t"
    tok.write_text("s3cret\n")
    cfg = ClientConfig.from_env({"ELASTICO_ALLOCATOR_ADDRESS": "h:1", "ELASTICO_TOKEN_FILE": str(tok)}, default_tls=default)
    assert (cfg.address, cfg.tls.token) == ("h:1", "s3cret")
    with pytest.raises(ValueError, match="ELASTICO_TLS_KEY_FILE"):
        ClientConfig.from_env({"ELASTICO_TLS_CERT_FILE": str(tok)})
    with pytest.raises(ValueError, match="ELASTICO_TOKEN_FILE"):
        ClientConfig.from_env({"ELASTICO_TOKEN_FILE": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="ELASTICO_ALLOCATOR_ADDRESS"):
        ClientConfig.from_env({"ELASTICO_ALLOCATOR_ADDRESS": "::1:50050"})  # IPv6 goes in brackets


def test_a_spec_without_a_tenant_is_sent_without_one():
    """The server fills in the caller's own tenant for an unset ``spec.tenant`` (a tenant token naming another
    tenant, the default's "default" included, is refused), so the client sends it unset unless one was given."""
    fields = {"kind": "training", "model_family": "ResNet-50", "training": {"total_steps": 10}}
    for spec in (fields, d.JobSpec(kind=d.JobKind.TRAINING, model_family="ResNet-50", training=d.TrainingWork(10))):
        assert AllocatorClient.submit_call(spec, "r-1").request.spec.tenant == ""
    assert AllocatorClient.submit_call({**fields, "tenant": "team-a"}, "r-1").request.spec.tenant == "team-a"
