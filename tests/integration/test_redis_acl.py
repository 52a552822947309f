"""Redis ACL users per role (elastico.redis_acl) against a real redis-server >= 7: the real store calls each
service makes succeed under its own user, anything else is refused (NOPERM) and leaves the keyspace as it
was; no password or a wrong one gets no access; rediss:// with a CA from the URL works."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from elastico import pki, redis_acl
from elastico.domain import GpuSlice, JobState, Placement, Shape, StateReason, Workload
from elastico.errors import Unavailable
from elastico.redis_embedded import EmbeddedRedis
from elastico.state.keys import Keys
from elastico.state.redis_store import RedisStore
from services.predictor.observations import RedisObservationLog
from tests.conftest import make_job, make_node

NS = "acl"
SCRIPT_KEY_REFUSED = "NOPERM|can't access|No permissions"  # Redis 6 / Redis 7 / Valkey wording of a refused key
K = Keys(NS)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    s = EmbeddedRedis(tmp_path / "redis", users=redis_acl.cluster_users(["node-1", "node-2"], NS))
    s.start()
    yield s
    s.stop()


def admin(server: EmbeddedRedis) -> redis.Redis:
    return redis.Redis.from_url(server.url_for("admin"))


def keyspace(server: EmbeddedRedis) -> dict[bytes, bytes]:
    with admin(server) as r:
        return {k: r.dump(k) for k in r.scan_iter("*")}


def assert_refused(server: EmbeddedRedis, user: str, *commands: tuple) -> None:
    """Each raw command as ``user`` is NOPERM and the keyspace stays as it was."""
    before = keyspace(server)
    with redis.Redis.from_url(server.url_for(user)) as r:
        for cmd in commands:
            with pytest.raises(redis.exceptions.NoPermissionError):
                r.execute_command(*cmd)
    assert keyspace(server) == before


def placement(node: str, gpu: int) -> Placement:
    shape = Shape(num_gpus=1, compute_share_pct=50.0, mem_mib=4096)
    return Placement(job_id="", shape_index=0, shape=shape, slices=(GpuSlice(node, gpu, 50.0, 4096),))


async def test_no_password_or_a_wrong_one_gets_nothing(server):
    for kwargs in ({}, {"username": "default", "password": "x"}, {"username": "admin", "password": "wrong"},
                   {"username": "node.node-1", "password": server.users["node.node-2"][0]}):
        no_retry = Retry(NoBackoff(), 0)  # redis-py retries connection errors, authentication ones included
        with redis.Redis(host=server.host, port=server.port, retry=no_retry, **kwargs) as r, \
                pytest.raises(redis.exceptions.AuthenticationError):
            r.set(K.leader, "intruder")
    store = RedisStore.from_url(f"redis://{server.host}:{server.port}/0", namespace=NS)
    with pytest.raises(Unavailable, match="uthentication"):
        await store.put_node(make_node())
    await store.close()
    assert keyspace(server) == {}
    acl = server.acl_file.read_text()
    assert server.acl_file.stat().st_mode & 0o777 == 0o600
    assert not any(password in acl for password, _ in server.users.values())  # hashes only


async def test_node_user_runs_the_agent_store_calls_on_its_own_keys(server):
    alloc = RedisStore.from_url(server.url_for("allocator"), namespace=NS)
    node = RedisStore.from_url(server.url_for(redis_acl.node_user("node-1")), namespace=NS)
    try:
        assert await node.ping()
        await node.put_node(make_node("node-1"))
        epoch = await alloc.acquire_leadership("alloc", 5)
        job, _ = await alloc.create_job(make_job())
        await alloc.commit_placements(epoch, [(job, placement("node-1", 0))])
        gen, desired = await node.get_desired("node-1")
        assert set(desired) == {job.job_id} and gen >= 1
        assert (await node.get_job(job.job_id)).state is JobState.PLACED
        assert (await node.get_node("node-1")).gpus[0].allocated_share_pct == 50.0
        running = Workload(job_id=job.job_id, gpu_indices=(0,), compute_share_pct=50.0, mem_mib=4096, status="running")
        await node.report_workloads("node-1", gen, [running])
        await node.put_node(make_node("node-1"))  # heartbeat: SADD of a member already there
        assert await alloc.get_all_workloads(["node-1"]) == {"node-1": (gen, {job.job_id: running})}
        assert [n.node_id for n in await alloc.list_nodes()] == ["node-1"]
    finally:
        await node.close()
        await alloc.close()


async def test_node_user_cannot_write_another_nodes_gpus_desired_state_jobs_or_the_lease(server):
    admin_store = RedisStore.from_url(server.url_for("admin"), namespace=NS)
    await admin_store.put_node(make_node("node-2"))
    job, _ = await admin_store.create_job(make_job())
    await admin_store.close()
    assert_refused(server, "node.node-1",
                   ("HSET", K.gpu("node-2", 0), "share_used", 0), ("SET", K.node("node-2"), "{}"),
                   ("HSET", K.desired("node-1"), "j", "{}"), ("INCR", K.desired_gen("node-1")), ("DEL", K.desired("node-1")),
                   ("HSET", K.job(job.job_id), "state", "cancelled"), ("DEL", K.job(job.job_id)),
                   ("SET", K.leader, "node-1"), ("INCR", K.epoch), ("SREM", K.nodes, "node-2"), ("DEL", K.nodes),
                   ("HSET", K.workloads("node-2"), "j", "{}"), ("XADD", K.events, "*", "f", "v"),
                   ("EVAL", "return redis.call('SET', KEYS[1], 'x')", 1, K.leader), ("KEYS", "*"), ("FLUSHALL",),
                   ("SUBSCRIBE", "x"), ("CONFIG", "GET", "*"))
    node1 = RedisStore.from_url(server.url_for("node.node-1"), namespace=NS)
    before = keyspace(server)
    with pytest.raises(redis.exceptions.NoPermissionError):
        await node1.put_node(make_node("node-2"))  # one MULTI/EXEC: refused as a whole
    with pytest.raises(redis.exceptions.NoPermissionError):
        await node1.report_workloads("node-2", 1, [])
    await node1.close()
    assert keyspace(server) == before


async def test_predictor_user_has_the_observation_stream_only(server):
    log = RedisObservationLog(server.url_for("predictor"), namespace=NS)
    await log.append(["a", "b"])
    entries, last = await log.read_after("0-0")
    assert entries == ["a", "b"] and await log.pending() == 2
    await log.mark_consumed(last)
    assert await log.consumed() == last and await log.pending() == 0
    await log.close()
    assert_refused(server, "predictor", ("HSET", K.job("j1"), "state", "x"), ("SET", K.observations, "x"),
                   ("DEL", K.observations), ("XADD", K.events, "*", "f", "v"), ("GET", K.leader), ("KEYS", "*"))


async def test_allocator_user_runs_the_store_but_no_admin_commands_or_other_keys(server):
    store = RedisStore.from_url(server.url_for("allocator"), namespace=NS)
    try:
        await store.put_node(make_node("node-1", gpus=1))
        epoch = await store.acquire_leadership("alloc", 5)
        created = await store.create_jobs([make_job(), make_job()])
        (a, _), (b, _) = created
        (placed,) = await store.commit_placements(epoch, [(a, placement("node-1", 0))])
        assert {j.job_id for j in await store.list_active_jobs()} == {a.job_id, b.job_id}
        page, _ = await store.list_jobs(page_size=10)
        assert [j.job_id for j in page] == [b.job_id, a.job_id]
        await store.release_job(epoch, placed, JobState.PENDING, StateReason.PREEMPTED, "resize")
        assert (await store.get_desired("node-1"))[1] == {}
        (updated,) = await store.update_jobs([(b, b.__class__(**{**b.__dict__, "message": "m"}))], epoch=epoch)
        assert updated.message == "m"
        assert len(await store.read_events()) >= 3 and await store.last_event_id() != "0-0"
        await store.put_status("allocator", "{}")
        assert await store.get_status("allocator") == "{}"
        await store.release_leadership("alloc")
        assert (await store.current_leader())[0] is None
        await store.remove_node("node-1")
    finally:
        await store.close()
    assert_refused(server, "allocator", ("CONFIG", "SET", "appendonly", "no"), ("FLUSHALL",), ("FLUSHDB",),
                   ("ACL", "SETUSER", "x", "on", ">x", "+@all"), ("ACL", "LIST"), ("KEYS", "*"), ("REPLICAOF", "127.0.0.1", "1"), ("SAVE",),
                   ("SHUTDOWN",), ("SCRIPT", "FLUSH"), ("SET", "elsewhere", "x"), ("SET", "{other}:leader", "x"),
                   ("EVAL", "return 1", 0), ("SUBSCRIBE", "x"))


async def test_lua_scripts_are_checked_against_the_callers_acl(server):
    """The scripts build key names from ARGV, yet Redis checks each redis.call's key: an allocator user of
    one namespace cannot reach another namespace through them, and nothing is written."""
    before = keyspace(server)
    other = RedisStore.from_url(server.url_for("allocator"), namespace="other")
    with pytest.raises(redis.exceptions.ResponseError, match=SCRIPT_KEY_REFUSED):
        await other.create_job(make_job())
    with pytest.raises(redis.exceptions.ResponseError, match=SCRIPT_KEY_REFUSED):
        await other.list_nodes()
    await other.close()
    assert keyspace(server) == before


def test_rules_refuse_names_that_would_widen_a_key_pattern():
    for bad in ("node-*", "a:b", "a b", "n[1]"):
        with pytest.raises(ValueError):
            redis_acl.node_rules(bad, NS)


# --- rediss:// ----------------------------------------------------------------------------------------

async def _tls_front(cert: str, key: str, port: int) -> asyncio.Server:
    """A TLS endpoint on a free loopback port relaying each connection to the plain Redis on ``port`` (the
    embedded binaries are built without TLS; what is under test is the client side)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)

    async def relay(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            dst.close()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.gather(relay(reader, up_w), relay(up_r, writer))

    return await asyncio.start_server(serve, "127.0.0.1", 0, ssl=ctx)


async def test_rediss_url_with_the_ca_in_its_query_reaches_a_tls_redis(server, tmp_path):
    """redis-py takes ``?ssl_ca_certs=`` from a rediss:// URL: RedisStore and the predictor's log need no setting;
    without the CA (system CAs only) the certificate is refused as Unavailable."""
    issued = pki.throwaway(tmp_path / "pki", ["redis"])["redis"]  # make up's CA and certificates
    ca, cert, key = issued.ca_file, issued.cert_file, issued.key_file
    front = await _tls_front(cert, key, server.port)
    tls_port = front.sockets[0].getsockname()[1]

    def rediss(user: str, with_ca: bool = True) -> str:
        url = server.url_for(user).replace("redis://", "rediss://").replace(f":{server.port}/", f":{tls_port}/")
        return url + (f"?ssl_ca_certs={ca}" if with_ca else "")

    try:
        store = RedisStore.from_url(rediss("node.node-1"), namespace=NS)
        await store.put_node(make_node("node-1"))
        assert (await store.get_node("node-1")).node_id == "node-1"
        await store.close()
        log = RedisObservationLog(rediss("predictor"), namespace=NS)
        await log.append(["x"])
        assert await log.pending() == 1
        await log.close()
        untrusted = RedisStore.from_url(rediss("allocator", with_ca=False), namespace=NS)
        with pytest.raises(Unavailable, match="certificate verify failed"):
            await untrusted.ping()
        await untrusted.close()
    finally:
        front.close()
        await front.wait_closed()


async def test_junk_a_node_adds_to_the_node_set_is_dropped_by_the_next_listing(server):
    """A node user may add members to ``nodes`` (it registers itself so); members with no node record were never
    nodes: the allocator's listing removes them, so junk costs one listing, not every round."""
    node1 = RedisStore.from_url(server.url_for("node.node-1"), namespace=NS)
    alloc = RedisStore.from_url(server.url_for("allocator"), namespace=NS)
    try:
        await node1.put_node(make_node("node-1"))
        with redis.Redis.from_url(server.url_for("node.node-1")) as r:
            r.sadd(f"{{{NS}}}:nodes", *[f"ghost-{i}" for i in range(5000)])
        assert [n.node_id for n in await alloc.list_nodes()] == ["node-1"]
        with admin(server) as r:
            assert r.smembers(f"{{{NS}}}:nodes") == {b"node-1"}
    finally:
        await node1.close()
        await alloc.close()


async def test_a_busy_or_full_redis_is_unavailable_not_an_unexpected_error(server, monkeypatch):
    """Replies of a Redis that cannot serve now (a long script, out of memory) are retryable Unavailable, which
    the lease loop and the rounds wait out; other error replies stay what they are."""
    from elastico.errors import Unavailable
    from services.allocator.leader import LeaderLease

    store = RedisStore.from_url(server.url_for("allocator"), namespace=NS)
    replies = iter([redis.exceptions.ResponseError("BUSY Redis is busy running a script."),
                    redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")])

    async def refusing(*args, **kw):
        raise next(replies)

    try:
        monkeypatch.setattr(store._r, "get", refusing)
        for _ in range(2):
            with pytest.raises(Unavailable, match="cannot serve now"):
                await store.get_status("allocator")
        monkeypatch.undo()
        lease = LeaderLease(store, "a", ttl_s=0.3)
        monkeypatch.setattr(store, "acquire_leadership", refusing)  # an error the lease does not expect
        replies = iter([redis.exceptions.ResponseError("ERR something else")] * 10)
        task = asyncio.create_task(lease.run())
        await asyncio.sleep(0.25)
        assert not task.done()  # the renewal loop survives it
        monkeypatch.undo()
        for _ in range(20):
            if lease.epoch is not None:
                break
            await asyncio.sleep(0.1)
        assert lease.epoch is not None  # and leads again once the store answers
        task.cancel()
    finally:
        await store.close()
