"""Security on loopback with real TLS handshakes and a real redis-server: mTLS, tokens, tenants, peers, audit.

Every refused call is checked to leave the Redis keyspace exactly as it was.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import random
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis
from cryptography.hazmat.primitives import serialization

from elastico import auth, pki
from elastico.client import ClientConfig
from elastico.config import Settings
from elastico.errors import ConfigError
from elastico.rpc.security import Access, ClientTLS, PeerPolicy, ReloadingStub, TLSFiles, roles
from elastico.rpc.server import ServiceBinding, create_server
from elastico.state.keys import Keys
from elastico.state.redis_store import RedisStore
from elastico.v1 import allocator_pb2 as apb
from elastico.v1 import allocator_pb2_grpc, predictor_pb2, predictor_pb2_grpc, pricer_pb2, pricer_pb2_grpc
from elastico.v1 import types_pb2 as tpb
from services.allocator.servicer import AllocatorServicer
from services.allocator.settings import AllocatorSettings
from services.pricer.servicer import PricerServicer
from services.pricer.settings import PricerSettings

NAMES = ["allocator", "pricer", "predictor", "operator", "kube", "node/node-1", "node/node-2"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("pki")
    out = pki.throwaway(d / "ca", NAMES)
    out["other-ca"] = pki.throwaway(d / "other", ["operator"])["operator"]
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=10)
    shutil.copytree(d / "ca", d / "expired")
    out["expired"] = pki.issue(d / "expired", "operator", days=1, not_before=past)
    return out


def client(issued: pki.Issued | None, token: str = "", ca: str | None = None) -> ClientTLS:
    if issued is None:
        return ClientTLS(None, token)
    return ClientTLS(TLSFiles(issued.cert_file, issued.key_file, ca or issued.ca_file), token)


def no_cert_channel(ca_file: str, address: str) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(Path(ca_file).read_bytes()))


async def code_of(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


# --- transport --------------------------------------------------------------------------------------
@pytest.fixture
async def pricer(certs) -> AsyncIterator[str]:
    settings = PricerSettings.from_env({}, port=0, **pki.tls_settings(certs["pricer"]))
    binding = ServiceBinding("elastico.v1.Pricer", PricerServicer(settings), pricer_pb2_grpc.add_PricerServicer_to_server,
                             Access(PeerPolicy(roles("allocator", "operator"))))
    server, port = await create_server(settings, [binding])
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


def compute(channel: grpc.aio.Channel):
    return pricer_pb2_grpc.PricerStub(channel).ComputeAllocation(pricer_pb2.ComputeAllocationRequest(), timeout=5)


async def test_handshake_fails_without_a_valid_client_certificate(certs, pricer):
    ca = certs["pricer"].ca_file
    async with client(certs["allocator"]).aio_channel(pricer) as ch:  # reaches the servicer: empty request refused
        assert await code_of(compute(ch)) is grpc.StatusCode.INVALID_ARGUMENT
    async with no_cert_channel(ca, pricer) as ch:
        assert await code_of(compute(ch)) is grpc.StatusCode.UNAVAILABLE
    for bad in ("other-ca", "expired"):
        async with client(certs[bad], ca=ca).aio_channel(pricer) as ch:
            assert await code_of(compute(ch)) is grpc.StatusCode.UNAVAILABLE, bad
    async with grpc.aio.insecure_channel(pricer) as ch:
        assert await code_of(compute(ch)) is grpc.StatusCode.UNAVAILABLE


async def test_peer_roles_are_enforced_per_service(certs, pricer):
    async with client(certs["node/node-1"]).aio_channel(pricer) as ch:
        assert await code_of(compute(ch)) is grpc.StatusCode.PERMISSION_DENIED


async def _pricer_on_copies(identity, live: Path):
    """A started pricer reading copies of ``identity``'s certificate, key and CA in ``live`` (pricer.crt,
    pricer.key, ca.crt: a test rotates them there); returns (server, address)."""
    live.mkdir()
    for src, dst in ((identity.cert_file, "pricer.crt"), (identity.key_file, "pricer.key"), (identity.ca_file, "ca.crt")):
        shutil.copy(src, live / dst)
    settings = PricerSettings.from_env({}, port=0, tls_cert_file=str(live / "pricer.crt"),
                                       tls_key_file=str(live / "pricer.key"), tls_ca_file=str(live / "ca.crt"))
    server, port = await create_server(settings, [ServiceBinding(
        "elastico.v1.Pricer", PricerServicer(settings), pricer_pb2_grpc.add_PricerServicer_to_server)])
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_a_rotated_server_certificate_is_served_without_restart(certs, tmp_path):
    own = pki.throwaway(tmp_path / "a", ["pricer", "operator"])
    live = tmp_path / "live"
    server, addr = await _pricer_on_copies(own["pricer"], live)
    try:
        new = pki.throwaway(tmp_path / "b", ["pricer", "operator"])  # a new CA: old and new clients tell them apart
        async with client(own["operator"]).aio_channel(addr) as ch:
            assert await code_of(compute(ch)) is grpc.StatusCode.INVALID_ARGUMENT
        shutil.copy(new["pricer"].cert_file, live / "pricer.crt.tmp")
        shutil.copy(new["pricer"].key_file, live / "pricer.key.tmp")
        shutil.copy(new["pricer"].ca_file, live / "ca.crt.tmp")
        for name in ("pricer.crt", "pricer.key", "ca.crt"):
            (live / f"{name}.tmp").replace(live / name)
        async with client(new["operator"]).aio_channel(addr) as ch:  # new connection: the new certificate
            assert await code_of(compute(ch)) is grpc.StatusCode.INVALID_ARGUMENT
        async with client(own["operator"]).aio_channel(addr) as ch:  # the old CA's clients are refused now
            assert await code_of(compute(ch)) is grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


async def test_a_long_lived_client_presents_its_rotated_certificate(certs, pricer, tmp_path):
    live = tmp_path / "client"
    live.mkdir()
    shutil.copy(certs["other-ca"].cert_file, live / "c.crt")  # a certificate the server does not trust
    shutil.copy(certs["other-ca"].key_file, live / "c.key")
    shutil.copy(certs["pricer"].ca_file, live / "ca.crt")
    stub = ReloadingStub(ClientTLS(TLSFiles(str(live / "c.crt"), str(live / "c.key"), str(live / "ca.crt"))), pricer,
                         pricer_pb2_grpc.PricerStub)
    try:
        assert await code_of(stub.ComputeAllocation(pricer_pb2.ComputeAllocationRequest(), timeout=5)) is grpc.StatusCode.UNAVAILABLE
        old = stub._channel
        for src, dst in ((certs["operator"].cert_file, "c.crt"), (certs["operator"].key_file, "c.key")):
            shutil.copy(src, live / f"{dst}.tmp")
            (live / f"{dst}.tmp").replace(live / dst)
        assert await code_of(stub.ComputeAllocation(pricer_pb2.ComputeAllocationRequest(), timeout=5)) is grpc.StatusCode.INVALID_ARGUMENT
        for _ in range(100):  # the old channel is closed in the background, its calls having ended
            if old.get_state() is grpc.ChannelConnectivity.SHUTDOWN and not stub._retiring:
                break
            await asyncio.sleep(0.05)
        assert old.get_state() is grpc.ChannelConnectivity.SHUTDOWN and not stub._retiring
    finally:
        await stub.close()


def bad_tls_files(certs, tmp_path: Path) -> dict[str, tuple[dict[str, str], str]]:
    """Unusable TLS settings for the pricer, each with the variable its error must name."""
    good = pki.tls_settings(certs["pricer"])
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    locked = tmp_path / "locked.key"
    key = serialization.load_pem_private_key(Path(good["tls_key_file"]).read_bytes(), None)
    locked.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.BestAvailableEncryption(b"secret")))
    return {
        "garbage CA": ({**good, "tls_ca_file": str(garbage)}, "ELASTICO_TLS_CA_FILE"),
        "garbage certificate": ({**good, "tls_cert_file": str(garbage)}, "ELASTICO_TLS_CERT_FILE"),
        "another certificate's key": ({**good, "tls_key_file": certs["operator"].key_file}, "ELASTICO_TLS_KEY_FILE"),
        "encrypted key": ({**good, "tls_key_file": str(locked)}, "ELASTICO_TLS_KEY_FILE"),
        "certificate of another CA": ({**good, "tls_cert_file": certs["other-ca"].cert_file,
                                       "tls_key_file": certs["other-ca"].key_file}, "ELASTICO_TLS_CERT_FILE"),
        "expired certificate": ({**good, "tls_cert_file": certs["expired"].cert_file,
                                 "tls_key_file": certs["expired"].key_file}, "ELASTICO_TLS_CERT_FILE"),
    }


@pytest.mark.parametrize("case", ["garbage CA", "garbage certificate", "another certificate's key", "encrypted key",
                                  "certificate of another CA", "expired certificate"])
async def test_unusable_tls_files_are_refused_at_start_naming_the_file(certs, tmp_path, case):
    # grpc takes any bytes as a CA bundle and fails only at each handshake; a server and a client check at start
    files, var = bad_tls_files(certs, tmp_path)[case]
    settings = PricerSettings.from_env({}, port=0, **files)
    with pytest.raises(ConfigError, match=var):
        await create_server(settings, [ServiceBinding(
            "elastico.v1.Pricer", PricerServicer(settings), pricer_pb2_grpc.add_PricerServicer_to_server)])
    with pytest.raises(ConfigError, match=var):
        ClientTLS.from_settings(settings)
    with pytest.raises(ValueError, match=var):
        ClientConfig.from_env({f"ELASTICO_{k.upper()}": v for k, v in files.items()})
    assert TLSFiles(**{k[4:]: v for k, v in pki.tls_settings(certs["pricer"]).items()}).checked_read()


async def test_a_rotation_to_unusable_files_keeps_serving_the_previous_certificate(certs, tmp_path):
    live = tmp_path / "live"
    server, addr = await _pricer_on_copies(certs["pricer"], live)
    try:
        def put(src: str, name: str) -> None:
            shutil.copy(src, live / "tmp")
            (live / "tmp").replace(live / name)

        # a CA bundle without the issuer of the server's certificate (half a rotation, or the wrong file), then an
        # expired certificate: new connections still get the previous certificate and CA
        steps = ([(certs["other-ca"].ca_file, "ca.crt")],
                 [(certs["pricer"].ca_file, "ca.crt"), (certs["expired"].cert_file, "pricer.crt"),
                  (certs["expired"].key_file, "pricer.key")])
        for step in steps:
            for src, name in step:
                put(src, name)
            async with client(certs["operator"]).aio_channel(addr) as ch:
                assert await code_of(compute(ch)) is grpc.StatusCode.INVALID_ARGUMENT, step
    finally:
        await server.stop(0)


def test_plaintext_needs_an_explicit_opt_out_and_loopback():
    with pytest.raises(ConfigError, match="ELASTICO_TLS_CERT_FILE"):
        Settings.from_env({})
    with pytest.raises(ConfigError, match="loopback"):
        Settings.from_env({"ELASTICO_INSECURE": "1", "ELASTICO_HOST": "0.0.0.0"})
    assert Settings.from_env({"ELASTICO_INSECURE": "1"}).insecure


def test_redis_without_password_is_refused_and_passwords_are_never_echoed(certs):
    tls = pki.tls_settings(certs["pricer"])
    with pytest.raises(ConfigError, match="no password"):
        Settings.from_env({}, redis_url="redis://127.0.0.1:6390/0", **tls)
    assert Settings.from_env({}, redis_url="redis://u:s3cret@127.0.0.1:6390/0", **tls).redis_url
    assert Settings.from_env({}, redis_url="redis://127.0.0.1:6390/0", redis_allow_no_auth=True, **tls).redis_allow_no_auth
    with pytest.raises(ConfigError) as exc:
        Settings.from_env({}, redis_url="redis://u:s3cret@127.0.0.1:6390/0", metrics_port=-7, **tls)
    assert "s3cret" not in str(exc.value)


# --- the Allocator API: tokens and tenants ----------------------------------------------------------
@pytest.fixture
async def api(certs, redis_server, tmp_path) -> AsyncIterator[dict]:
    tokens_file = tmp_path / "tokens.json"
    tok = {
        "a": auth.issue(tokens_file, "alice", "tenant", tenant="team-a"),
        "b": auth.issue(tokens_file, "bob", "tenant", tenant="team-b", commands=["/bin/echo"], max_priority=50),
        "op": auth.issue(tokens_file, "ops", "operator", commands=["*"]),
        "node": auth.issue(tokens_file, "agent", "node"),
        "revoked": auth.issue(tokens_file, "mallory", "tenant", tenant="team-a"),
    }
    auth.revoke(tokens_file, "mallory")
    ns = f"sec-{uuid.uuid4().hex[:8]}"
    store = RedisStore.from_url(redis_server.url, namespace=ns)
    settings = AllocatorSettings.from_env({}, redis_url=redis_server.url, port=0, watch_poll_s=0.2,
                                          auth_tokens_file=str(tokens_file),
                                          **pki.tls_settings(certs["allocator"]))
    binding = ServiceBinding("elastico.v1.Allocator", AllocatorServicer(store, settings), allocator_pb2_grpc.add_AllocatorServicer_to_server,
                             Access(PeerPolicy(roles(*("allocator", "kube", "operator"))), auth.TokenStore(tokens_file)))
    server, port = await create_server(settings, [binding])
    await server.start()
    addr = f"127.0.0.1:{port}"
    channels = {k: client(certs["operator"], t).aio_channel(addr) for k, t in tok.items()}
    channels["none"] = client(certs["operator"]).aio_channel(addr)
    raw = aioredis.Redis.from_url(redis_server.url)
    yield {"stub": {k: allocator_pb2_grpc.AllocatorStub(c) for k, c in channels.items()}, "store": store, "addr": addr,
           "redis": raw, "prefix": Keys(ns).prefix, "certs": certs, "tokens": tok, "tokens_file": tokens_file}
    for c in channels.values():
        await c.close()
    await server.stop(0)
    await store.close()
    await raw.aclose()


async def keyspace(api) -> dict[bytes, bytes]:
    """Every key of the test's namespace with its serialized value."""
    r = api["redis"]
    keys = sorted([k async for k in r.scan_iter(match=api["prefix"] + "*")])
    out = {}
    for k in keys:
        out[k] = (await r.hgetall(k)) if (await r.type(k)) == b"hash" else await r.dump(k)
    return out


def spec(tenant: str = "", command: str = "") -> tpb.JobSpec:
    return tpb.JobSpec(name="t", tenant=tenant, kind=tpb.JOB_KIND_TRAINING, model_family="ResNet-50", batch_size=32,
                       training=tpb.TrainingWork(total_steps=100), command=command)


async def submit(stub, tenant: str = "", command: str = ""):
    return (await stub.SubmitJob(apb.SubmitJobRequest(request_id=uuid.uuid4().hex, spec=spec(tenant, command)), timeout=5)).job


async def expect(call, code: grpc.StatusCode, field: str | None = None) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call
    assert exc.value.code() is code, exc.value.details()
    if field is not None:
        assert exc.value.details().startswith(field + ":"), exc.value.details()


async def test_missing_wrong_and_revoked_tokens_are_unauthenticated_and_change_nothing(api):
    await submit(api["stub"]["a"])
    before = await keyspace(api)
    wrong = allocator_pb2_grpc.AllocatorStub(client(api["certs"]["operator"], "elastico_" + "x" * 43).aio_channel(api["addr"]))
    for stub in (api["stub"]["none"], api["stub"]["revoked"], wrong):
        await expect(stub.SubmitJob(apb.SubmitJobRequest(request_id="r-1", spec=spec()), timeout=5), grpc.StatusCode.UNAUTHENTICATED)
        await expect(stub.ListJobs(apb.ListJobsRequest(), timeout=5), grpc.StatusCode.UNAUTHENTICATED)
    assert await keyspace(api) == before


async def test_a_token_revoked_while_serving_stops_working(api):
    await submit(api["stub"]["b"])
    auth.revoke(api["tokens_file"], "bob")
    await asyncio.sleep(auth.RELOAD_CHECK_S + 0.1)
    await expect(api["stub"]["b"].ListJobs(apb.ListJobsRequest(), timeout=5), grpc.StatusCode.UNAUTHENTICATED)


async def test_a_tenant_is_its_identity(api):
    a, b = api["stub"]["a"], api["stub"]["b"]
    job = await submit(a)  # spec.tenant left empty: the identity's tenant
    assert job.spec.tenant == "team-a"
    before = await keyspace(api)
    await expect(a.SubmitJob(apb.SubmitJobRequest(request_id="x-1", spec=spec("team-b")), timeout=5),
                 grpc.StatusCode.PERMISSION_DENIED, "spec.tenant")
    # another tenant's job is NOT_FOUND, exactly like an id that does not exist (no probing of job ids)
    await expect(b.GetJob(apb.GetJobRequest(job_id=job.job_id), timeout=5), grpc.StatusCode.NOT_FOUND)
    await expect(b.CancelJob(apb.CancelJobRequest(job_id=job.job_id), timeout=5), grpc.StatusCode.NOT_FOUND)
    await expect(b.ListJobs(apb.ListJobsRequest(tenant="team-a"), timeout=5), grpc.StatusCode.PERMISSION_DENIED, "tenant")
    await expect(api["stub"]["node"].ListJobs(apb.ListJobsRequest(), timeout=5), grpc.StatusCode.PERMISSION_DENIED)
    after = await keyspace(api)
    assert after == before, {k: (before.get(k), after.get(k)) for k in set(after) | set(before) if after.get(k) != before.get(k)}
    mine = await submit(b)
    listed = (await b.ListJobs(apb.ListJobsRequest(), timeout=5)).jobs
    assert [j.job_id for j in listed] == [mine.job_id]
    everyone = {j.job_id for j in (await api["stub"]["op"].ListJobs(apb.ListJobsRequest(), timeout=5)).jobs}
    assert {job.job_id, mine.job_id} <= everyone
    state = await b.GetClusterState(apb.GetClusterStateRequest(), timeout=5)
    assert [t.tenant for t in state.tenants] == ["team-b"]
    assert (await a.CancelJob(apb.CancelJobRequest(job_id=job.job_id), timeout=5)).job.state == tpb.JOB_STATE_CANCELLED


async def test_request_ids_are_each_tenants_own(api):
    """Another tenant's request id is no answer and no obstacle: it names a job of the caller's own (a global
    namespace told a tenant which ids others had used, and let it take them first)."""
    req = apb.SubmitJobRequest(request_id="shared-id", spec=spec())
    first = await api["stub"]["a"].SubmitJob(req, timeout=5)
    other = await api["stub"]["b"].SubmitJob(req, timeout=5)
    again = await api["stub"]["b"].SubmitJob(req, timeout=5)
    assert first.created and other.created and not again.created
    assert other.job.job_id == again.job.job_id != first.job.job_id and other.job.spec.tenant == "team-b"


async def test_a_tenant_watch_sees_only_its_jobs(api):
    a, b = api["stub"]["a"], api["stub"]["b"]
    watch = b.WatchJobs(apb.WatchJobsRequest(), timeout=10)
    seen: list[str] = []

    async def read() -> None:
        async for ev in watch:
            seen.append(ev.job_id)
            if ev.job_id == mine.job_id:
                return

    await asyncio.sleep(0.3)  # the watch starts from the stream's end
    theirs = await submit(a)
    mine = await submit(b)
    async with asyncio.timeout(10):
        await read()
    watch.cancel()
    assert mine.job_id in seen and theirs.job_id not in seen


async def test_commands_run_only_inside_the_callers_allow_list(api):
    before = await keyspace(api)
    await expect(api["stub"]["a"].SubmitJob(apb.SubmitJobRequest(request_id="c-1", spec=spec(command="sh -c 'id > m'")), timeout=5),
                 grpc.StatusCode.PERMISSION_DENIED, "spec.command")
    await expect(api["stub"]["b"].SubmitJob(apb.SubmitJobRequest(request_id="c-2", spec=spec(command="sh -c 'id > m'")), timeout=5),
                 grpc.StatusCode.PERMISSION_DENIED, "spec.command")
    await expect(api["stub"]["none"].SubmitJob(apb.SubmitJobRequest(request_id="c-3", spec=spec(command="/bin/echo hi")), timeout=5),
                 grpc.StatusCode.UNAUTHENTICATED)
    assert await keyspace(api) == before
    assert (await submit(api["stub"]["b"], command="/bin/echo hi")).spec.command == "/bin/echo hi"
    assert (await submit(api["stub"]["op"], tenant="team-c", command="python3 train.py")).spec.tenant == "team-c"


async def test_a_tenant_raises_its_jobs_priority_only_as_far_as_its_token_allows(api):
    """A tenant token submits priority 0 at most unless its operator gave it a ``max_priority``; lower priorities
    are free; beyond [-1000, 1000] is malformed for everyone. A refusal writes nothing."""
    def prio(p: int, rid: str) -> apb.SubmitJobRequest:
        s = spec()
        s.priority = p
        return apb.SubmitJobRequest(request_id=rid, spec=s)

    before = await keyspace(api)
    await expect(api["stub"]["a"].SubmitJob(prio(1, "p-1"), timeout=5), grpc.StatusCode.PERMISSION_DENIED, "spec.priority")
    await expect(api["stub"]["b"].SubmitJob(prio(51, "p-2"), timeout=5), grpc.StatusCode.PERMISSION_DENIED, "spec.priority")
    await expect(api["stub"]["op"].SubmitJob(prio(2**31 - 1, "p-3"), timeout=5), grpc.StatusCode.INVALID_ARGUMENT, "spec.priority")
    assert await keyspace(api) == before
    assert (await api["stub"]["a"].SubmitJob(prio(-5, "p-4"), timeout=5)).job.spec.priority == -5
    assert (await api["stub"]["b"].SubmitJob(prio(50, "p-5"), timeout=5)).job.spec.priority == 50
    assert (await api["stub"]["op"].SubmitJob(prio(1000, "p-6"), timeout=5)).job.spec.priority == 1000


def test_a_tokens_max_priority_is_checked_when_issued(tmp_path):
    with pytest.raises(ConfigError, match="max_priority"):
        auth.issue(tmp_path / "t.json", "x", "tenant", tenant="t", max_priority=1001)
    auth.issue(tmp_path / "t.json", "y", "tenant", tenant="t", max_priority=7)
    assert auth.load_tokens(tmp_path / "t.json").popitem()[1].max_priority == 7


async def test_hostile_authorization_metadata_never_yields_unknown(api):
    stub = allocator_pb2_grpc.AllocatorStub(client(api["certs"]["operator"]).aio_channel(api["addr"]))
    rng = random.Random(7)
    values = ["", "Bearer", "Bearer ", "bearer " + api["tokens"]["a"], "Basic dXNlcjpwdw==", "Bearer " + "A" * 300,
              "Bearer " + "x" * 7000, "Bearer" + api["tokens"]["a"], "Bearer " + api["tokens"]["a"] + "x"]
    values += ["Bearer " + "".join(rng.choice("abcXYZ019-_.~+/=") for _ in range(rng.randint(1, 400))) for _ in range(40)]
    before = await keyspace(api)
    codes = set()
    for v in values:
        codes.add(await code_of(stub.ListJobs(apb.ListJobsRequest(), metadata=[("authorization", v)], timeout=5)))
    for n in (2, 5, 50):  # repeated values, even valid ones
        md = [("authorization", "Bearer " + api["tokens"]["a"])] * n
        codes.add(await code_of(stub.SubmitJob(apb.SubmitJobRequest(request_id="h", spec=spec()), metadata=md, timeout=5)))
    huge = [("authorization", "Bearer " + "y" * 20000)]
    codes.add(await code_of(stub.ListJobs(apb.ListJobsRequest(), metadata=huge, timeout=5)))
    assert grpc.StatusCode.UNKNOWN not in codes and grpc.StatusCode.OK not in codes, codes
    assert await keyspace(api) == before


# --- node identities on the predictor -------------------------------------------------------------------
async def test_an_agent_reports_observations_for_its_own_node_only(certs):
    from services.predictor.__main__ import ACCESS
    from services.predictor.observations import MemoryObservationLog
    from services.predictor.servicer import PredictorServicer, load_or_train
    from services.predictor.settings import PredictorSettings

    settings = PredictorSettings.from_env({}, port=0, refresh_interval_s=0, **pki.tls_settings(certs["predictor"]))
    log = MemoryObservationLog()
    servicer = PredictorServicer(settings, await asyncio.to_thread(load_or_train, settings), log)
    server, port = await create_server(settings, [ServiceBinding(
        "elastico.v1.Predictor", servicer, predictor_pb2_grpc.add_PredictorServicer_to_server, ACCESS)])
    await server.start()
    addr = f"127.0.0.1:{port}"

    def report(node_id: str) -> predictor_pb2.ReportObservationRequest:
        prof = predictor_pb2.TaskProfile(model_family="ResNet-50", batch_size=32, kind=tpb.JOB_KIND_TRAINING,
                                         gpu_type="v100", mps_share_pct=50.0)
        return predictor_pb2.ReportObservationRequest(observations=[predictor_pb2.Observation(
            a=prof, b=prof, norm_tput_a=0.8, norm_tput_b=0.7, node_id=node_id)])

    try:
        async with client(certs["node/node-1"]).aio_channel(addr) as ch:
            stub = predictor_pb2_grpc.PredictorStub(ch)
            assert (await stub.ReportObservation(report("node-1"), timeout=5)).accepted == 1
            await expect(stub.ReportObservation(report("node-2"), timeout=5), grpc.StatusCode.PERMISSION_DENIED,
                         "observations[0].node_id")
            await expect(stub.PredictInterference(predictor_pb2.PredictInterferenceRequest(), timeout=5),
                         grpc.StatusCode.PERMISSION_DENIED)
        assert await log.pending() == 1  # the refused report wrote nothing
    finally:
        await server.stop(0)


async def test_only_the_allocator_may_serve_token_only_callers(certs, redis_server, tmp_path):
    with pytest.raises(ConfigError, match="only the allocator"):
        PricerSettings.from_env({}, tls_require_client_cert=False, **pki.tls_settings(certs["pricer"]))
    tokens_file = tmp_path / "tokens.json"
    token = auth.issue(tokens_file, "carol", "tenant", tenant="team-c")
    settings = AllocatorSettings.from_env({}, redis_url=redis_server.url, port=0, auth_tokens_file=str(tokens_file),
                                          tls_require_client_cert=False, **pki.tls_settings(certs["allocator"]))
    store = RedisStore.from_url(redis_server.url, namespace=f"sec-{uuid.uuid4().hex[:8]}")
    from services.allocator.servicer import api_access

    server, port = await create_server(settings, [ServiceBinding(
        "elastico.v1.Allocator", AllocatorServicer(store, settings), allocator_pb2_grpc.add_AllocatorServicer_to_server,
        api_access(settings))])
    await server.start()
    ca = Path(certs["allocator"].ca_file).read_bytes()
    try:  # a caller with the CA only (no certificate): its token is all it needs, and it is still required
        creds = grpc.composite_channel_credentials(grpc.ssl_channel_credentials(ca), grpc.access_token_call_credentials(token))
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as ch:
            assert (await submit(allocator_pb2_grpc.AllocatorStub(ch))).spec.tenant == "team-c"
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca)) as ch:
            await expect(allocator_pb2_grpc.AllocatorStub(ch).ListJobs(apb.ListJobsRequest(), timeout=5),
                         grpc.StatusCode.UNAUTHENTICATED)
    finally:
        await server.stop(0)
        await store.close()


async def test_a_service_reports_demand_for_itself_only(api):
    a, b = api["stub"]["a"], api["stub"]["b"]
    svc = (await a.SubmitJob(apb.SubmitJobRequest(request_id=uuid.uuid4().hex, spec=tpb.JobSpec(
        name="svc", kind=tpb.JOB_KIND_INFERENCE, model_family="inference",
        inference=tpb.InferenceWork(demand_rps=3.0, latency_slo_ms=100.0))), timeout=5)).job
    report = tpb.DemandReport(job_id=svc.job_id, window_s=10.0, request_rate_rps=4.0)
    report.window_end.FromNanoseconds(time.time_ns())
    before = await keyspace(api)
    await expect(b.ReportDemand(apb.ReportDemandRequest(report=report), timeout=5), grpc.StatusCode.NOT_FOUND)
    await expect(api["stub"]["node"].ReportDemand(apb.ReportDemandRequest(report=report), timeout=5), grpc.StatusCode.PERMISSION_DENIED)
    await expect(api["stub"]["none"].ReportDemand(apb.ReportDemandRequest(report=report), timeout=5), grpc.StatusCode.UNAUTHENTICATED)
    assert await keyspace(api) == before  # none of them wrote a report
    ok = await a.ReportDemand(apb.ReportDemandRequest(report=report), timeout=5)
    assert ok.accepted and ok.forecast_rps == 4.0
    hist = await api["store"].demand_history([svc.job_id], 0.0)
    assert [r.source for r in hist[svc.job_id]] == ["api:alice"]
    ok = await api["stub"]["op"].ReportDemand(apb.ReportDemandRequest(report=report), timeout=5)  # an operator may, once
    assert not ok.accepted


async def test_a_callers_answers_say_nothing_of_the_ids_it_may_not_see(api):
    """Another tenant's job and an id that does not exist get the same answer, word for word; a node identity
    (no Allocator API access) is refused before any id is looked up."""
    a, b, node = api["stub"]["a"], api["stub"]["b"], api["stub"]["node"]
    theirs = await submit(a)
    unknown = "j-" + "0" * 16

    async def details(call) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await call
        return exc.value.code(), exc.value.details().replace(theirs.job_id, "ID").replace(unknown, "ID")

    for method, request in (("GetJob", apb.GetJobRequest), ("CancelJob", apb.CancelJobRequest)):
        seen = await details(getattr(b, method)(request(job_id=theirs.job_id), timeout=5))
        assert seen == await details(getattr(b, method)(request(job_id=unknown), timeout=5))
        assert seen[0] is grpc.StatusCode.NOT_FOUND
        by_node = await details(getattr(node, method)(request(job_id=theirs.job_id), timeout=5))
        assert by_node == await details(getattr(node, method)(request(job_id=unknown), timeout=5))
        assert by_node[0] is grpc.StatusCode.PERMISSION_DENIED


async def test_out_of_range_ids_filters_and_times_are_invalid_arguments(api):
    """Values a hostile probe sent that escaped as INTERNAL (a stream id past 64 bits) or were accepted unchecked."""
    a, op = api["stub"]["a"], api["stub"]["op"]
    for bad in ("99999999999999999999-99999999999999999999", "18446744073709551616-0", "0-18446744073709551616"):
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            async for _ in a.WatchJobs(apb.WatchJobsRequest(after_event_id=bad), timeout=5):
                pass
        assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT and exc.value.details().startswith("after_event_id:")
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        async for _ in a.WatchJobs(apb.WatchJobsRequest(job_ids=["j-1", "j-\x1b[2J"]), timeout=5):
            pass
    assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT and exc.value.details().startswith("job_ids[1]:")
    for tenant in ("*", "team\x1b", "t" * 1_000_000):
        await expect(op.ListJobs(apb.ListJobsRequest(tenant=tenant), timeout=5), grpc.StatusCode.INVALID_ARGUMENT, "tenant")
    svc = (await a.SubmitJob(apb.SubmitJobRequest(request_id=uuid.uuid4().hex, spec=tpb.JobSpec(
        name="svc", kind=tpb.JOB_KIND_INFERENCE, model_family="inference",
        inference=tpb.InferenceWork(demand_rps=3.0, latency_slo_ms=100.0))), timeout=5)).job
    for nanos in (-1, 2_000_000_000):
        report = tpb.DemandReport(job_id=svc.job_id, window_s=10.0, request_rate_rps=4.0)
        report.window_end.seconds, report.window_end.nanos = int(time.time()) - 1, nanos
        await expect(a.ReportDemand(apb.ReportDemandRequest(report=report), timeout=5), grpc.StatusCode.INVALID_ARGUMENT,
                     "report.window_end.nanos")
    named = spec()
    named.name = "\x1b[2J\x1b[31mPWNED"
    await expect(a.SubmitJob(apb.SubmitJobRequest(request_id="esc-1", spec=named), timeout=5), grpc.StatusCode.INVALID_ARGUMENT,
                 "spec.name")
