"""Shared fixtures: a real redis-server on a free port (never the machine's shared 6379), stores, builders."""

from __future__ import annotations

import contextlib
import itertools
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from elastico.domain import GpuInfo, InferenceWork, Job, JobKind, JobSpec, NodeInfo, Shape, TrainingWork
from elastico.redis_acl import ADMIN_RULES, new_password
from elastico.redis_embedded import EmbeddedRedis
from elastico.state.memory import MemoryStore
from elastico.state.redis_store import RedisStore

# property tests check correctness, not speed: on a shared CI machine a slow draw or example is noise, not a failure
settings.register_profile("elastico", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("elastico")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A private redis-server with AOF on, for the whole test session: the default user is off, ``url`` is the
    ``admin`` user's (full access, generated password), ``url_for(user)`` any other user's."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), users={"admin": (new_password(), ADMIN_RULES)})
    server.start()
    yield server
    server.stop()


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[MemoryStore | RedisStore]:
    """Each contract test runs against both backends; Redis gets a fresh namespace per test."""
    if request.param == "memory":
        s: MemoryStore | RedisStore = MemoryStore()
    else:
        server: EmbeddedRedis = request.getfixturevalue("redis_server")
        s = RedisStore.from_url(server.url, namespace=f"t-{uuid.uuid4().hex[:8]}")
    yield s
    await s.close()


_ids = itertools.count(1)


def make_spec(kind: JobKind = JobKind.TRAINING, **kw: object) -> JobSpec:
    """A valid JobSpec with overridable fields."""
    base: dict[str, object] = {"kind": kind, "name": "job", "tenant": "team-a", "model_family": "ResNet-50", "batch_size": 32}
    if kind is JobKind.TRAINING:
        base["training"] = TrainingWork(total_steps=1000)
    else:
        base["inference"] = InferenceWork(demand_rps=50.0, latency_slo_ms=100.0)
    base.update(kw)
    return JobSpec(**base)  # type: ignore[arg-type]


def make_job(**kw: object) -> Job:
    n = next(_ids)
    spec = kw.pop("spec", None) or make_spec()
    return Job(job_id=str(kw.pop("job_id", f"job-{n}")), request_id=str(kw.pop("request_id", f"req-{n}-{uuid.uuid4().hex[:6]}")), spec=spec, **kw)  # type: ignore[arg-type]


def make_node(node_id: str = "node-1", gpus: int = 2, mem_mib: int = 16384, gpu_type: str = "v100") -> NodeInfo:
    return NodeInfo(node_id=node_id, address="127.0.0.1:1", gpu_backend="simulated",
                    gpus=tuple(GpuInfo(index=i, uuid=f"GPU-{node_id}-{i}", gpu_type=gpu_type, mem_total_mib=mem_mib) for i in range(gpus)))


def half_gpu_shape() -> Shape:
    return Shape(num_gpus=1, compute_share_pct=50.0, mem_mib=8192)


@contextlib.contextmanager
def reachable_dir() -> Iterator[Path]:
    """A fresh temporary directory every user can enter (mode 0755, parents included), removed afterwards.

    Agents run as root drop their workloads to ``nobody``, which must reach their state and run directories;
    pytest's own ``tmp_path`` lies under a 0700 directory.
    """
    d = Path(tempfile.mkdtemp(prefix="elastico-test-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """``reachable_dir`` as a fixture."""
    with reachable_dir() as d:
        yield d
