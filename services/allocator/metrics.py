"""Prometheus metrics of the allocator (default registry; served at ``/metrics`` when ELASTICO_METRICS_PORT is set).

Defined once per process: several schedulers in one process (tests) share them. Rounds update them only through
:class:`services.allocator.round_metrics.RoundMetrics`.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

QUEUE_LENGTH = Gauge("elastico_allocator_queue_length", "Jobs waiting for a placement (PENDING)")
RUNNING_JOBS = Gauge("elastico_allocator_placed_jobs", "Jobs placed or running")
ROUND_SECONDS = Histogram("elastico_allocator_round_seconds", "Wall time of one scheduling round (read, decide, commit)",
                          buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))
DECIDE_SECONDS = Histogram("elastico_allocator_decide_seconds", "Wall time of the policy's decide() (pricer call included)",
                           buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2))
ROUNDS = Counter("elastico_allocator_rounds_total", "Scheduling rounds by outcome", ["outcome"])
PLACEMENTS = Counter("elastico_allocator_placements_total", "Jobs placed (rate() = placements/s)")
RELEASES = Counter("elastico_allocator_releases_total", "Jobs taken off their GPUs, by reason", ["reason"])
EVICTIONS = Counter("elastico_allocator_evictions_requested_total",
                    "Kubernetes pod jobs given EVICTION_REQUESTED instead of a release, by what the policy meant "
                    "(preempted, resized)", ["reason"])
GPU_ALLOCATED = Gauge("elastico_allocator_gpu_allocated_ratio",
                      "Compute handed out / GPUs of usable nodes: MPS shares, a whole GPU for training its share does not limit")
GPU_UTILISATION = Gauge("elastico_allocator_gpu_utilisation_ratio", "Mean SM utilisation the node agents report, 0-1")
GPU_EFFECTIVE = Gauge("elastico_allocator_gpu_effective_ratio",
                      "MPS share committed, each tenant's weighted by its observed normalised speed / GPUs of usable nodes")
PENDING_BY_REASON = Gauge("elastico_allocator_pending_jobs", "Pending jobs by the reason of their state", ["reason"])
NODES = Gauge("elastico_allocator_nodes", "Registered nodes: fresh (recent heartbeat, agent ready) or stale", ["state"])
DEGRADED = Gauge("elastico_allocator_degraded", "1 while a component is degraded", ["component"])
IS_LEADER = Gauge("elastico_allocator_is_leader", "1 while this replica holds the leader lease")
EPOCH = Gauge("elastico_allocator_leader_epoch", "Leader epoch (fencing token) this replica writes with")
STALE_WRITES = Counter("elastico_allocator_stale_epoch_rejections_total", "Writes rejected because a newer leader exists")
CONFLICTS = Counter("elastico_allocator_commit_conflicts_total", "Round commits rejected by a version or capacity check")
PRICING_GAP = Gauge("elastico_allocator_pricing_gap", "Relative optimality gap of the last priced round")
_NORM_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0, 1.1)
PREDICTED_NORM = Histogram("elastico_allocator_predicted_norm_throughput",
                           "Predicted normalised throughput of co-located running jobs", buckets=_NORM_BUCKETS)
OBSERVED_NORM = Histogram("elastico_allocator_observed_norm_throughput",
                          "Observed normalised throughput of co-located running jobs (node agents)", buckets=_NORM_BUCKETS)
SLOWDOWN_ERROR = Histogram("elastico_allocator_norm_throughput_error",
                           "Observed minus predicted normalised throughput of co-located running jobs",
                           buckets=(-0.5, -0.3, -0.2, -0.1, -0.05, 0, 0.05, 0.1, 0.2, 0.3, 0.5))
# predictor drift: the error above over a recent window (round_metrics.ERROR_WINDOW); NaN while it holds no sample
ERROR_MEAN_ABS = Gauge("elastico_allocator_norm_throughput_error_mean_abs",
                       "Mean |observed - predicted| normalised throughput of co-located jobs over the recent window")
ERROR_MEAN = Gauge("elastico_allocator_norm_throughput_error_mean",
                   "Mean observed - predicted normalised throughput of co-located jobs over the recent window (bias)")
# inference services (one series per running service, removed when it ends)
SERVICE_FORECAST = Gauge("elastico_allocator_service_forecast_rps",
                         "Demand forecast each inference service is sized to, policy requests/s", ["job_id"])
SERVICE_SHARE = Gauge("elastico_allocator_service_share_pct", "Committed MPS share of each placed inference service, percent",
                      ["job_id"])
SERVICE_P99 = Gauge("elastico_allocator_service_p99_latency_ms", "Last measured p99 latency of each inference service, ms",
                    ["job_id"])
SERVICE_SLO = Gauge("elastico_allocator_service_latency_slo_ms", "Latency SLO of each inference service, ms", ["job_id"])
DEMAND_REPORTS = Counter("elastico_allocator_demand_reports_total", "Demand windows stored, by source (api, node)", ["source"])
