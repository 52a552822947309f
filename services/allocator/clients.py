"""gRPC clients the allocator uses for the pricer and the predictor.

Each returns the same pure result types the in-process cores return, so the policy code that the
simulator runs in-process runs unchanged in the live allocator. Every call carries a deadline; a
failed or late call degrades explicitly instead of guessing: the pricer solver falls back to the last
good prices itself, the predictor client raises ``Unavailable`` and the caller stops new co-location.
"""

from __future__ import annotations

import grpc
import numpy as np

from elastico.errors import Unavailable
from elastico.rpc.security import ClientTLS, ReloadingStub
from elastico.v1 import node_agent_pb2 as npb
from elastico.v1 import node_agent_pb2_grpc, predictor_pb2_grpc, pricer_pb2_grpc
from elastico.v1 import predictor_pb2 as prpb
from elastico.v1 import pricer_pb2 as ppb
from elastico.v1 import types_pb2 as tpb
from services.pricer.core import PricingProblem, PricingResult, SolveStatus, relative_gap

_STATUS = {
    ppb.SOLVER_STATUS_OPTIMAL: SolveStatus.OPTIMAL,
    ppb.SOLVER_STATUS_FEASIBLE: SolveStatus.FEASIBLE,
    ppb.SOLVER_STATUS_INFEASIBLE_INPUT: SolveStatus.INFEASIBLE_INPUT,
}

_POOL_NAMES = ("gpu_share_pct", "tenant_slots")


def pool_names(count: int) -> tuple[str, ...]:
    """Names of the ElastiCo policy's pricing pools (free MPS share summed over GPUs, free tenant slots)."""
    return _POOL_NAMES[:count] if count <= len(_POOL_NAMES) else tuple(f"pool{i}" for i in range(count))


def _request(problem: PricingProblem, options, warm_prices) -> tuple[ppb.ComputeAllocationRequest, list[np.ndarray]]:
    """Serialise any masked problem; returns the request and, per job, the original index of each sent shape."""
    names = pool_names(len(problem.capacity))
    req = ppb.ComputeAllocationRequest(
        pools=[ppb.ResourcePool(name=n, capacity=float(c)) for n, c in zip(names, problem.capacity, strict=True)],
        gap_tolerance=float(getattr(options, "gap_tolerance", 0.0) or 0.0),
        max_iterations=int(getattr(options, "max_iterations", 0) or 0),
    )
    if warm_prices is not None:
        req.warm_start_prices.extend(float(p) for p in warm_prices)
    u, d, m = np.asarray(problem.utility, float), np.asarray(problem.demand, float), np.asarray(problem.mask, bool)
    index_maps = []
    for j in range(u.shape[0]):
        valid = np.flatnonzero(m[j])
        index_maps.append(valid)
        job = req.jobs.add(job_id=str(j))
        for s in valid:
            job.shapes.add(utility=float(u[j, s]), demand=d[j, s].tolist())
    return req, index_maps


class GrpcSolver:
    """``services.pricer.core.solve`` over gRPC, for the policy's injected ``solver`` (runs in a worker thread).

    Synchronous on purpose: the policy calls it from ``asyncio.to_thread``. Each call has a deadline
    (``timeout_s``). On failure it degrades explicitly: shapes are chosen at the *last good prices*
    (best response per job, filled greedily within capacity), ``degraded`` says why, and the caller
    reports it in logs, metrics and GetClusterState. The next successful call clears it.
    """

    def __init__(self, address: str, timeout_s: float = 1.0, tls: ClientTLS | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.tls = tls or ClientTLS(None)
        self._stamp = self.tls.stamp()
        self._channel = self.tls.channel(address)
        self._stub = pricer_pb2_grpc.PricerStub(self._channel)
        self.last_prices: np.ndarray | None = None  # prices of the last successful solve
        self.last_capacity: np.ndarray | None = None
        self.last_gap: float | None = None
        self.degraded: str = ""  # "" = healthy; otherwise why the last call fell back

    def __call__(self, problem: PricingProblem, options=None, warm_prices: np.ndarray | None = None) -> PricingResult:
        req, maps = _request(problem, options, warm_prices)
        if self.tls.stamp() != self._stamp:  # certificates rotated: the next connection presents the new ones
            self._channel.close()
            self._stamp, self._channel = self.tls.stamp(), self.tls.channel(self.address)
            self._stub = pricer_pb2_grpc.PricerStub(self._channel)
        try:
            resp = self._stub.ComputeAllocation(req, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
            self.degraded = f"pricer unavailable at {self.address} ({code}): shapes chosen at the last good prices"
            return self._fallback(problem)
        choice = np.full(len(maps), -1, dtype=np.int64)
        for j, a in enumerate(resp.assignments):
            if 0 <= a.shape_index < len(maps[j]):
                choice[j] = int(maps[j][a.shape_index])
        prices = np.array(resp.prices, dtype=np.float64)
        self.degraded = ""
        self.last_prices, self.last_capacity = prices, np.asarray(problem.capacity, float)
        self.last_gap = relative_gap(resp.primal_value, resp.dual_bound)
        return PricingResult(choice=choice, prices=prices, primal_value=resp.primal_value, dual_bound=resp.dual_bound,
                             gap=self.last_gap, iterations=resp.iterations, wall_time_s=resp.wall_time_s,
                             status=_STATUS.get(resp.status, SolveStatus.FEASIBLE))

    def snapshot(self) -> tuple:
        """What callers read after a solve (``degraded``, last prices, capacity, gap): sent back by a worker process."""
        return (self.degraded, self.last_prices, self.last_capacity, self.last_gap)

    def restore(self, snapshot: tuple) -> None:
        """Adopt a ``snapshot`` taken where the solves ran (a decide worker process)."""
        self.degraded, self.last_prices, self.last_capacity, self.last_gap = snapshot

    def _fallback(self, problem: PricingProblem) -> PricingResult:
        u, d, m = np.asarray(problem.utility, float), np.asarray(problem.demand, float), np.asarray(problem.mask, bool)
        cap = np.asarray(problem.capacity, float).copy()
        prices = self.last_prices if self.last_prices is not None and len(self.last_prices) == len(cap) else np.zeros(len(cap))
        margin = np.where(m, u - (d * prices[None, None, :]).sum(axis=2), -np.inf)
        best = np.argmax(margin, axis=1)
        gain = margin[np.arange(len(best)), best]
        choice = np.full(len(best), -1, dtype=np.int64)
        for j in np.argsort(-gain, kind="stable"):  # highest surplus first, each within what is left
            if not np.isfinite(gain[j]) or gain[j] <= 0:
                continue
            need = d[j, best[j]]
            if (need <= cap + 1e-9).all():
                choice[j] = best[j]
                cap -= need
        value = float(u[np.flatnonzero(choice >= 0), choice[choice >= 0]].sum()) if (choice >= 0).any() else 0.0
        return PricingResult(choice=choice, prices=prices, primal_value=value, dual_bound=float("inf"), gap=float("nan"),
                             iterations=0, wall_time_s=0.0, status=SolveStatus.FEASIBLE)

    def close(self) -> None:
        self._channel.close()


class PredictorClient:
    """Pair matrix of the policy's type table from ``Predictor.PredictInterference`` (one batched call)."""

    def __init__(self, address: str, timeout_s: float = 3.0, tls: ClientTLS | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._stub = ReloadingStub(tls or ClientTLS(None), address, predictor_pb2_grpc.PredictorStub)

    async def pair_matrix(self, types, timeout_s: float | None = None) -> np.ndarray:
        """``[T, T]`` normalised throughput of row type next to column type (inference rows/columns NaN).

        Raises:
            Unavailable: the call failed or missed its deadline (UNIMPLEMENTED included).
        """
        from services.allocator.estimate import split_type_name

        train = [n for i, n in enumerate(types.names) if i != types.inference_index]
        req = prpb.PredictInterferenceRequest()
        idx = [(i, j) for i in range(len(train)) for j in range(i, len(train))]
        for i, j in idx:
            q = req.pairs.add()
            for prof, name in ((q.a, train[i]), (q.b, train[j])):
                model, bs = split_type_name(name)
                prof.model_family, prof.batch_size, prof.gpu_type = model, bs, types.gpu_type
                prof.kind, prof.mps_share_pct, prof.precision = tpb.JOB_KIND_TRAINING, 100.0, "fp32"
        try:
            resp = await self._stub.PredictInterference(req, timeout=timeout_s or self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"predictor at {self.address}: {exc.code().name}: {exc.details()}") from exc
        if len(resp.predictions) != len(idx):
            raise Unavailable(f"predictor at {self.address}: {len(resp.predictions)} predictions for {len(idx)} pairs")
        T = len(types.names)
        m = np.full((T, T), np.nan)
        for (i, j), p in zip(idx, resp.predictions, strict=True):
            m[i, j], m[j, i] = p.norm_tput_a, p.norm_tput_b
        return np.clip(m, 0.0, 1.0)

    async def close(self) -> None:
        await self._stub.close()


class AgentNudger:
    """Best-effort ``NodeAgent.Sync`` after a commit, with a deadline; the agents poll anyway (level-triggered)."""

    def __init__(self, timeout_s: float = 2.0, tls: ClientTLS | None = None) -> None:
        self.timeout_s = timeout_s
        self.tls = tls or ClientTLS(None)
        self._stamp = self.tls.stamp()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.failures = 0

    async def sync(self, address: str, min_generation: int = 0) -> bool:
        if not address:
            return False
        if self.tls.stamp() != self._stamp:  # certificates rotated: new channels present the new ones
            self._stamp = self.tls.stamp()
            await self.close()
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = self.tls.aio_channel(address)
        try:
            await node_agent_pb2_grpc.NodeAgentStub(ch).Sync(npb.SyncRequest(min_generation=min_generation),
                                                            timeout=self.timeout_s)
            return True
        except grpc.aio.AioRpcError:
            self.failures += 1
            return False

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
