"""Pricer over gRPC: a real solve through the wire, and INVALID_ARGUMENT naming the field for bad input."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

from elastico import limits
from elastico.errors import ConfigError
from elastico.rpc.server import ServiceBinding, create_server
from elastico.v1 import pricer_pb2 as ppb
from elastico.v1 import pricer_pb2_grpc
from services.pricer.servicer import PricerServicer
from services.pricer.settings import PricerSettings


@contextlib.asynccontextmanager
async def serving_pricer(**settings) -> AsyncIterator[pricer_pb2_grpc.PricerStub]:
    """A pricer, insecure on a free port, with ``settings``; yields a stub to it."""
    s = PricerSettings.from_env({}, insecure=True, port=0, **settings)
    server, port = await create_server(s, [ServiceBinding("elastico.v1.Pricer", PricerServicer(s), pricer_pb2_grpc.add_PricerServicer_to_server)])
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield pricer_pb2_grpc.PricerStub(ch)
    finally:
        await server.stop(0)


@pytest.fixture
async def pricer() -> AsyncIterator[pricer_pb2_grpc.PricerStub]:
    async with serving_pricer(max_jobs=1000, max_cells=100_000) as stub:
        yield stub


def request(jobs: int = 30, seed: int = 0) -> ppb.ComputeAllocationRequest:
    rng = np.random.default_rng(seed)
    req = ppb.ComputeAllocationRequest(pools=[ppb.ResourcePool(name="v100/gpus", capacity=8), ppb.ResourcePool(name="v100/mem_mib", capacity=8 * 16384)])
    for j in range(jobs):
        job = req.jobs.add(job_id=f"j{j}")
        for g in (1, 2, 4):
            job.shapes.add(utility=float(rng.uniform(0.5, 1.0) * g ** 0.8), demand=[g, g * float(rng.integers(2000, 16000))])
    return req


async def test_solves_within_capacity_with_certificate(pricer):
    req = request()
    resp = await pricer.ComputeAllocation(req, timeout=10)
    assert [a.job_id for a in resp.assignments] == [j.job_id for j in req.jobs]
    load, value = np.zeros(2), 0.0
    for job, a in zip(req.jobs, resp.assignments, strict=True):
        if a.shape_index >= 0:
            load += np.array(job.shapes[a.shape_index].demand)
            value += job.shapes[a.shape_index].utility
    assert (load <= np.array([p.capacity for p in req.pools]) + 1e-9).all()
    assert any(a.shape_index >= 0 for a in resp.assignments) and resp.primal_value == pytest.approx(value)
    assert resp.dual_bound >= resp.primal_value - 1e-9
    assert resp.relative_gap == pytest.approx((resp.dual_bound - resp.primal_value) / resp.dual_bound, abs=1e-12)
    # the request leaves gap_tolerance at 0: the pricer's default (0.1 %) decides OPTIMAL vs FEASIBLE
    assert resp.status == (ppb.SOLVER_STATUS_OPTIMAL if resp.relative_gap <= 1e-3 else ppb.SOLVER_STATUS_FEASIBLE)
    assert len(resp.prices) == 2 and all(p >= 0 for p in resp.prices)


def _bad(mutate) -> ppb.ComputeAllocationRequest:
    req = request(jobs=3)
    mutate(req)
    return req


BAD = [
    (lambda r: r.ClearField("pools"), "pools"),
    (lambda r: setattr(r.pools[1], "name", "v100/gpus"), "pools[1].name"),
    (lambda r: setattr(r.pools[0], "capacity", math.nan), "pools[0].capacity"),
    (lambda r: setattr(r.pools[1], "capacity", -1.0), "pools[1].capacity"),
    (lambda r: [setattr(p, "capacity", 0.0) for p in r.pools], "pools"),
    (lambda r: setattr(r.jobs[2], "job_id", "j0"), "jobs[2].job_id"),
    (lambda r: setattr(r.jobs[1], "job_id", ""), "jobs[1].job_id"),
    (lambda r: r.jobs[1].shapes[2].demand.append(1.0), "jobs[1].shapes[2].demand"),
    (lambda r: setattr(r.jobs[0].shapes[1], "utility", math.nan), "jobs[0].shapes[1].utility"),
    (lambda r: setattr(r.jobs[0].shapes[0], "utility", math.inf), "jobs[0].shapes[0].utility"),
    (lambda r: setattr(r.jobs[0].shapes[0], "utility", 1e308), "jobs[0].shapes[0].utility"),  # its sums overflowed to inf
    (lambda r: r.pools[0].__setattr__("capacity", 1e300), "pools[0].capacity"),
    (lambda r: r.jobs[2].shapes[0].demand.__setitem__(1, -5.0), "jobs[2].shapes[0].demand[1]"),
    (lambda r: r.warm_start_prices.extend([1.0]), "warm_start_prices"),
    (lambda r: r.warm_start_prices.extend([1.0, math.nan]), "warm_start_prices[1]"),
    (lambda r: setattr(r, "gap_tolerance", 2.0), "gap_tolerance"),
    # size limits (elastico.limits), checked before any array is built
    (lambda r: [r.jobs[1].shapes.add(utility=1.0, demand=[1.0, 1.0]) for _ in range(limits.SHAPES_PER_JOB_MAX)], "jobs[1].shapes"),
    (lambda r: r.pools.extend(ppb.ResourcePool(name=f"p{i}", capacity=1) for i in range(limits.PRICER_POOLS_MAX)), "pools"),
    (lambda r: setattr(r.pools[0], "name", "n" * (limits.POOL_NAME_MAX_CHARS + 1)), "pools[0].name"),
    (lambda r: setattr(r.jobs[2], "job_id", "j" * (limits.JOB_ID_MAX_CHARS + 1)), "jobs[2].job_id"),
    # text an operator reads in logs: no control characters (terminal escapes, NUL, bidi overrides)
    (lambda r: setattr(r.pools[0], "name", "v100\x1b[31m"), "pools[0].name"),
    (lambda r: setattr(r.jobs[1], "job_id", "j\x00"), "jobs[1].job_id"),
    (lambda r: setattr(r.jobs[1], "job_id", "j\u202e"), "jobs[1].job_id"),
]


async def test_a_bad_number_is_quoted_as_a_plain_number(pricer):
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await pricer.ComputeAllocation(_bad(lambda r: setattr(r.pools[0], "capacity", 1e308)), timeout=10)
    assert exc.value.details().endswith("got 1e+308"), exc.value.details()


@pytest.mark.parametrize(("mutate", "field"), BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
async def test_malformed_requests_are_invalid_argument_naming_the_field(pricer, mutate, field):
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await pricer.ComputeAllocation(_bad(mutate), timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details().startswith(field + ":"), exc.value.details()


async def test_too_many_jobs_is_invalid_argument(pricer):
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await pricer.ComputeAllocation(request(jobs=1001), timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.value.details().startswith("jobs:")


async def test_padded_size_over_max_cells_is_invalid_argument_naming_the_job(pricer):
    req = request(jobs=900)  # 900 jobs x 3 shapes x 2 pools = 5,400 cells: fine
    assert len((await pricer.ComputeAllocation(req, timeout=10)).assignments) == 900
    for _ in range(60):  # one job of 63 shapes pads all 900 to 113,400 cells > max_cells (100,000)
        req.jobs[500].shapes.add(utility=0.1, demand=[1.0, 1.0])
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await pricer.ComputeAllocation(req, timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.value.details().startswith("jobs[500].shapes:")


def test_max_cells_setting_is_validated():
    assert PricerSettings.from_env({}, insecure=True).max_cells == limits.PRICER_MAX_CELLS
    assert PricerSettings.from_env({"ELASTICO_MAX_CELLS": "1000"}, insecure=True).max_cells == 1000
    with pytest.raises(ConfigError, match="ELASTICO_MAX_CELLS"):
        PricerSettings.from_env({"ELASTICO_MAX_CELLS": "0"}, insecure=True)


async def test_empty_job_list_is_fine(pricer):
    resp = await pricer.ComputeAllocation(ppb.ComputeAllocationRequest(pools=[ppb.ResourcePool(name="g", capacity=4)]), timeout=5)
    assert resp.status == ppb.SOLVER_STATUS_OPTIMAL and list(resp.assignments) == []


async def test_requests_beyond_max_concurrent_wait_their_turn(monkeypatch):
    """At most ``ELASTICO_MAX_CONCURRENT`` requests are solved at once (each can hold ~800 MB at the cell limit);
    the others wait and are answered."""
    import asyncio
    import threading
    import time

    from services.pricer import servicer as pricer_servicer

    running, peak, lock = [0], [0], threading.Lock()
    solve = pricer_servicer._solve_to_pb

    def slow_solve(*args):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.2)
        try:
            return solve(*args)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(pricer_servicer, "_solve_to_pb", slow_solve)
    async with serving_pricer(max_concurrent=2) as stub:
        answers = await asyncio.gather(*[stub.ComputeAllocation(request(seed=k), timeout=20) for k in range(5)])
    assert len(answers) == 5 and all(len(a.assignments) == 30 for a in answers)
    assert peak[0] == 2
