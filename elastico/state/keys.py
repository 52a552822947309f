"""Every Redis key name ElastiCo uses, in one module.

All keys share the hash tag ``{<namespace>}`` so that they live in one Redis Cluster slot: the atomic
Lua transaction touches jobs, GPUs and node desired state together, which Redis only allows within a
slot. ``namespace`` lets several independent clusters (or test runs) share one Redis.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    """Key builder for one namespace."""

    namespace: str = "elastico"

    @property
    def prefix(self) -> str:
        return "{" + self.namespace + "}:"

    def job(self, job_id: str) -> str:
        """Hash: data (JSON of Job), version, state; seq, tenant, request_id (written at creation, for the indexes)."""
        return f"{self.prefix}job:{job_id}"

    @property
    def job_index(self) -> str:
        """Sorted set: job_id scored by submission sequence (for paging, newest first)."""
        return f"{self.prefix}jobs"

    @property
    def job_seq(self) -> str:
        """Counter: submission sequence."""
        return f"{self.prefix}jobs:seq"

    @property
    def active_jobs(self) -> str:
        """Set: ids of jobs in a non-terminal state (kept by the APPLY script; what a scheduling round reads)."""
        return f"{self.prefix}jobs:active"

    def state_jobs(self, state: str) -> str:
        """Sorted set, terminal states only: job_id scored by submission sequence (ListJobs by that state)."""
        return f"{self.prefix}jobs:state:{state}"

    def tenant_jobs(self, tenant: str) -> str:
        """Sorted set: the tenant's job ids scored by submission sequence (ListJobs by tenant)."""
        return f"{self.prefix}jobs:tenant:{tenant}"

    def tenant_state_jobs(self, tenant: str, state: str) -> str:
        """Sorted set, terminal states only: the tenant's job ids in ``state`` scored by submission sequence."""
        return f"{self.prefix}jobs:tenant:{tenant}:state:{state}"

    @property
    def finished_jobs(self) -> str:
        """Sorted set: ids of terminal jobs scored by when they finished (unix s): the retention sweep's order."""
        return f"{self.prefix}jobs:finished"

    @property
    def jobs_indexed(self) -> str:
        """String: set once every job record carries the index fields and sits in the indexes above (a
        namespace created before them is backfilled by the retention sweep; until then filtered lists scan)."""
        return f"{self.prefix}jobs:indexed"

    @property
    def jobs_backfill(self) -> str:
        """String: the lowest submission sequence the index backfill has reached (it walks newest to oldest)."""
        return f"{self.prefix}jobs:backfill"

    def demand(self, job_id: str) -> str:
        """Sorted set: an inference job's demand reports (DemandReport JSON) scored by window end (unix s)."""
        return f"{self.prefix}demand:{job_id}"

    def status(self, name: str) -> str:
        """String: JSON status document written by a service (e.g. the allocator's last round)."""
        return f"{self.prefix}status:{name}"

    @property
    def requests(self) -> str:
        """Hash: request_id -> job_id (SubmitJob idempotency)."""
        return f"{self.prefix}requests"

    def gpu(self, node_id: str, gpu_index: int) -> str:
        """Hash: share_cap, mem_cap, share_used, mem_used (share in 1/100 percent, integers)."""
        return f"{self.prefix}gpu:{node_id}:{gpu_index}"

    def node(self, node_id: str) -> str:
        """String: JSON of NodeInfo as last reported by its agent."""
        return f"{self.prefix}node:{node_id}"

    @property
    def nodes(self) -> str:
        """Set: known node ids."""
        return f"{self.prefix}nodes"

    def desired(self, node_id: str) -> str:
        """Hash: job_id -> JSON of Placement that should run on the node."""
        return f"{self.prefix}desired:{node_id}"

    def desired_gen(self, node_id: str) -> str:
        """Counter: bumped on every change of the node's desired state."""
        return f"{self.prefix}desired:{node_id}:gen"

    def workloads(self, node_id: str) -> str:
        """Hash: job_id -> JSON of Workload, the node's actual state as its agent last reported it."""
        return f"{self.prefix}workloads:{node_id}"

    def workloads_gen(self, node_id: str) -> str:
        """String: desired-state generation the node's agent had applied when it last reported workloads."""
        return f"{self.prefix}workloads:{node_id}:gen"

    @property
    def leader(self) -> str:
        """String with TTL: holder id of the allocator leader lease."""
        return f"{self.prefix}leader"

    @property
    def epoch(self) -> str:
        """Counter: leader epoch (fencing token), incremented on every new lease."""
        return f"{self.prefix}leader:epoch"

    @property
    def events(self) -> str:
        """Stream: job state-change events."""
        return f"{self.prefix}events"

    @property
    def observations(self) -> str:
        """Stream: measured co-located throughput reported to the predictor (online learning)."""
        return f"{self.prefix}observations"

    @property
    def observations_consumed(self) -> str:
        """String: id of the last observation-stream entry folded into the served model."""
        return f"{self.prefix}observations:consumed"
