"""Step 1 of a reconcile pass (``reconcile.py``): the MPS control daemon's health, and the GPUs an MPS fault drains.

A dead daemon is restarted; while it is dead or stuck the node is reported not ready and no process workload
starts. A fault drains the GPUs it hit -- the faulted clients' GPUs, and those of every running workload sharing
them -- and marks those workloads' ends as co-tenant faults; a drained GPU is reported unhealthy (the store then
gives it no capacity) until no workload of ours runs on it and the hold-down has passed. Drains live in the
ledger, so a restarted agent keeps them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

from elastico.domain import NodeInfo
from elastico.logging import get_logger
from services.node_agent.mps import MpsController, MpsFault
from services.node_agent.runner import LedgerEntry, LedgerFile

log = get_logger(component="reconcile")


class MpsHealth:
    """The MPS daemon's state (``state``: ok / dead / stuck) and the drained GPUs of the agent's ``ledger``."""

    def __init__(self, mps: MpsController, ledger: LedgerFile, holddown_s: float) -> None:
        self.mps, self.ledger, self.holddown_s = mps, ledger, holddown_s
        self.state = "ok"
        self._clear_at: dict[int, float] = {}  # gpu -> when its last faulted client was seen gone

    async def check(self, now: float, client_pids: Callable[[LedgerEntry], set[int | None]]) -> None:
        """Probe the daemon (restart it when dead) and apply its fault events; ``client_pids(e)``: the processes
        of running workload ``e`` that are MPS clients."""
        health = await asyncio.to_thread(self.mps.health)
        if health.state == "dead":
            log.warning("MPS control daemon is dead; restarting it", detail=health.detail)
            try:
                await asyncio.to_thread(self.mps.start)
                health = await asyncio.to_thread(self.mps.health)
            except Exception as exc:  # noqa: BLE001 - reported through state and readiness
                log.error("MPS control daemon restart failed", error=str(exc))
        elif health.state == "stuck":
            log.error("MPS control daemon is stuck; starting no workloads until it answers", detail=health.detail)
        self.state = health.state if health.state != "off" else "ok"
        for fault in await asyncio.to_thread(self.mps.fault_events):
            self._apply_fault(fault, now, client_pids)

    def _apply_fault(self, fault: MpsFault, now: float, client_pids: Callable[[LedgerEntry], set[int | None]]) -> None:
        entries = self.ledger.entries
        gpus = set(fault.gpu_indices)
        for e in entries.values():
            if not e.running:
                continue
            if gpus & set(e.gpu_indices) or (not fault.gpu_indices and client_pids(e) & fault.client_pids):
                gpus.update(e.gpu_indices)
        for e in list(entries.values()):
            if e.running and gpus & set(e.gpu_indices):
                entries[e.job_id] = replace(e, cotenant_fault=True)
        for g in gpus:
            self.ledger.drained.setdefault(g, now)
            self._clear_at.pop(g, None)
        log.error("MPS server fault: draining GPUs", gpus=sorted(gpus), detail=fault.detail,
                  victims=sorted(e.job_id for e in entries.values() if e.cotenant_fault and e.running))

    def update_drains(self, now: float) -> None:
        """A drained GPU returns once no workload of ours runs on it and the hold-down has passed."""
        for g in list(self.ledger.drained):
            busy = any(e.running and g in e.gpu_indices for e in self.ledger.entries.values()) or any(
                g in e.gpu_indices for e in self.ledger.lingering.values())
            if busy:
                self._clear_at.pop(g, None)
                continue
            clear_at = self._clear_at.setdefault(g, now)
            if now - clear_at >= self.holddown_s:
                del self.ledger.drained[g]
                del self._clear_at[g]
                log.info("GPU back in service after MPS fault", gpu=g)

    def holds(self, gpus: tuple[int, ...]) -> bool:
        """No process workload may start on ``gpus`` now: MPS is not ready, or one of them is drained."""
        return self.state != "ok" or any(g in self.ledger.drained for g in gpus)

    def apply(self, node: NodeInfo) -> NodeInfo:
        """Mark drained GPUs unhealthy and the node not ready while MPS is dead or stuck."""
        drained = frozenset(self.ledger.drained)
        gpus = tuple(replace(g, healthy=False) if g.index in drained else g for g in node.gpus)
        return replace(node, gpus=gpus, ready=node.ready and self.state == "ok")
