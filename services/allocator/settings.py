"""Allocator configuration (``ELASTICO_*`` environment variables, validated at start-up)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from elastico.config import Settings
from elastico.errors import ConfigError

ESTIMATORS = ("predictor", "rule")


def _policy_default(name: str):
    """The ElastiCo policy's own default of ``name``: one source for the simulator and the live allocator."""
    from services.allocator.policy import ElastiCoParams

    return getattr(ElastiCoParams(), name)


#: the ElastiCo options the allocator sets, each from the setting of the same name (ELASTICO_ + it, upper case);
#: ``max_attempts`` comes from ``policy_max_attempts`` when that is set
_POLICY_OPTIONS = ("train_floor", "elastic_gpus", "min_count_speed", "work_weight", "unlimited_training")


@dataclass(frozen=True)
class AllocatorSettings(Settings):
    service_name: str = "allocator"
    port: int = 50050
    max_request_mib: float = 1.0  # the largest valid SubmitJob is ~33 KiB (32 KiB spec)
    redis_namespace: str = "elastico"  # key namespace in Redis; lets clusters share one Redis
    pricer_address: str = ""  # host:port of the pricer; "" = price in-process (the pricer core, said so in logs)
    predictor_address: str = ""  # host:port of the predictor; "" with estimator=predictor = degraded (no co-location)
    node_stale_s: float = 15.0  # a node whose heartbeat is older than this gets no new placements (shown not ready)
    watch_poll_s: float = 1.0  # how long WatchJobs blocks on the event stream per poll
    # --- scheduling rounds -----------------------------------------------------------------------------
    schedule: bool = True  # run scheduling rounds when leader (False = job API only, e.g. a read replica)
    replica_id: str = ""  # this replica's name in the leader lease; "" = <host>-<pid>
    policy: str = "elastico"  # policy of services.allocator.policy.POLICY_NAMES
    round_interval_s: float = 5.0  # a round at least this often (time-driven policies age queued jobs), s
    round_min_gap_s: float = 0.02  # coalescing: events arriving within this gap share one round, s
    report_poll_s: float = 0.25  # how often node agents' reports and heartbeats are checked for changes, s
    node_grace_s: float = 30.0  # after node_stale_s + this, a silent node's jobs are requeued (NODE_LOST), s
    lease_ttl_s: float = 10.0  # leader lease time-to-live; renewed every ttl/3, s
    pricer_timeout_s: float = 1.0  # deadline of each ComputeAllocation call, s
    predictor_timeout_s: float = 3.0  # deadline of each PredictInterference call, s
    sync_timeout_s: float = 2.0  # deadline of each best-effort Sync nudge to a node agent, s
    estimator: str = "predictor"  # interference estimate: "predictor" (service) or "rule" (utilisation rule, calibrated)
    estimate_refresh_s: float = 300.0  # how often the pair matrix is re-fetched from the predictor, s
    max_tenants: int = 4  # MPS tenants per GPU at most
    # training co-location floor, fraction of isolated speed: the ElastiCo policy's own default, so the live
    # allocator runs the configuration the simulator measures
    train_floor: float = _policy_default("train_floor")
    # ElastiCo GPU-count shapes: grow gangs onto idle GPUs, shrink queued gangs to halvings that fit (measured
    # scaling curves), give grown GPUs back when jobs wait. On by default, as in the simulator: a job only
    # ever runs at the gang sizes its explicit shapes declare (fit.allowed_gang_sizes), so a workload that
    # cannot restart at another data-parallel size declares one size and is never resized
    elastic_gpus: bool = _policy_default("elastic_gpus")
    # the least fraction of its isolated speed a queued gang may shrink to (lower: more work per GPU where
    # scaling is sub-linear; higher: each job finishes sooner)
    min_count_speed: float = _policy_default("min_count_speed")
    # the objective knob between JCT and work done: 0 weighs jobs for JCT (shortest remaining GPU-work
    # first), 1 by their requested GPUs (the most work per round); between, a geometric mix
    work_weight: float = _policy_default("work_weight")
    # training on a GPU without a service runs with no MPS compute limit (its share books memory and capacity;
    # pairs at most); off: every training share is a compute limit -- isolation between training tenants at
    # the co-location throughput the measured pairs give up under limits
    unlimited_training: bool = _policy_default("unlimited_training")
    policy_max_attempts: int = 0  # ElastiCo: placement attempts per round at most (bounds a round's cost); 0 = the policy's default
    time_scale: float = 1.0  # policy clock = wall clock x this (demo replays: matches the node agents' scale)
    # inference demand forecast (services/allocator/policy/forecast.py, the simulator's forecaster): the peak
    # measured request rate over this past window, policy seconds (the simulator's SimConfig.forecast_window_s)
    forecast_window_s: float = 3600.0
    # the Allocator API's bearer tokens (hashed; python -m elastico.auth): required unless ELASTICO_INSECURE=1
    auth_tokens_file: str = ""
    # a tenant's jobs queued or running at most: a submission beyond answers RESOURCE_EXHAUSTED (one tenant cannot
    # flood the store and every round's view); 0 = no limit
    max_live_jobs_per_tenant: int = 10_000
    # GPUs one tenant's inference services may take in all, "TENANT=GPUS,...,*=GPUS" (* = every tenant not named;
    # each service counts its gang, the most it is ever sized to: services/allocator/quota.py); "" = no quota. Set it
    # where several tenants share the cluster: a service outranks training and is sized to its own tenant's demand
    service_quota_gpus: str = ""
    # WatchJobs streams open at once (each holds a Redis connection while it waits): per caller identity, and
    # in all; a stream beyond answers RESOURCE_EXHAUSTED
    max_watches_per_caller: int = 32
    max_watches: int = 1024
    decide_worker: str = "process"  # where policy.decide runs: "process" (own core, loop keeps serving) or "thread"
    # a worker process that has not answered a round's decide after this long is killed and the round skipped (a
    # fresh worker decides the next one): a stuck worker would otherwise hold scheduling while the lease renews, s
    decide_timeout_s: float = 60.0
    # --- finished-job retention: the leader's sweep (Store.sweep_finished_jobs) -------------------------------
    job_retention_s: float = 7 * 86400.0  # a finished job (succeeded/failed/cancelled) is deleted this long after, s
    job_retention_max: int = 100_000  # finished jobs kept at most; beyond, the oldest-finished are deleted first
    job_retention_sweep_s: float = 60.0  # how often the leader sweeps, s; 0 = never (finished jobs kept forever)

    def validate(self) -> None:
        super().validate()
        self.require_redis()
        from services.allocator.policy import POLICY_NAMES

        if self.node_stale_s <= 0:
            raise ConfigError(f"ELASTICO_NODE_STALE_S={self.node_stale_s}: must be > 0")
        if not 0 < self.watch_poll_s <= 4:
            raise ConfigError(f"ELASTICO_WATCH_POLL_S={self.watch_poll_s}: must be in (0, 4]")
        if self.policy not in POLICY_NAMES:
            raise ConfigError(f"ELASTICO_POLICY={self.policy!r}: must be one of {', '.join(POLICY_NAMES)}")
        if self.decide_worker not in ("process", "thread"):
            raise ConfigError(f"ELASTICO_DECIDE_WORKER={self.decide_worker!r}: must be process or thread")
        if self.estimator not in ESTIMATORS:
            raise ConfigError(f"ELASTICO_ESTIMATOR={self.estimator!r}: must be one of {', '.join(ESTIMATORS)}")
        for name in ("round_interval_s", "report_poll_s", "lease_ttl_s", "pricer_timeout_s", "predictor_timeout_s",
                     "sync_timeout_s", "estimate_refresh_s", "time_scale", "forecast_window_s", "decide_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"ELASTICO_{name.upper()}={getattr(self, name)}: must be > 0")
        if not 0 <= self.round_min_gap_s <= self.round_interval_s:
            raise ConfigError(f"ELASTICO_ROUND_MIN_GAP_S={self.round_min_gap_s}: must be in [0, round_interval_s]")
        if self.node_grace_s < 0:
            raise ConfigError(f"ELASTICO_NODE_GRACE_S={self.node_grace_s}: must be >= 0")
        if not 1 <= self.max_tenants <= 16:
            raise ConfigError(f"ELASTICO_MAX_TENANTS={self.max_tenants}: must be in [1, 16]")
        for name in ("job_retention_s", "job_retention_max", "job_retention_sweep_s", "max_live_jobs_per_tenant"):
            if getattr(self, name) < 0:
                raise ConfigError(f"ELASTICO_{name.upper()}={getattr(self, name)}: must be >= 0")
        for name in ("max_watches_per_caller", "max_watches"):
            if not 1 <= getattr(self, name) <= 100_000:
                raise ConfigError(f"ELASTICO_{name.upper()}={getattr(self, name)}: must be in [1, 100000]")
        if self.policy_max_attempts < 0:
            raise ConfigError(f"ELASTICO_POLICY_MAX_ATTEMPTS={self.policy_max_attempts}: must be >= 0")
        self._validate_policy_options()
        self.service_quotas()

    def validate_security(self) -> None:
        super().validate_security()
        if self.auth_tokens_file:
            if not os.path.isfile(self.auth_tokens_file):
                raise ConfigError(f"ELASTICO_AUTH_TOKENS_FILE={self.auth_tokens_file!r}: no such file")
        elif not self.insecure:
            raise ConfigError("ELASTICO_AUTH_TOKENS_FILE is required: every Allocator API call carries a bearer token "
                              "(python -m elastico.auth issue ...), unless ELASTICO_INSECURE=1")

    def _validate_policy_options(self) -> None:
        """The policy options these settings give ElastiCo, checked by its params dataclass (one statement of
        each range); a bad one is a ConfigError naming its variable."""
        from services.allocator.policy import ElastiCoParams, OptionError

        opts = self.policy_options()
        if self.policy_max_attempts:
            opts["max_attempts"] = self.policy_max_attempts
        for name, value in opts.items():
            try:
                ElastiCoParams(**{name: value})
            except OptionError as exc:
                setting = "policy_max_attempts" if name == "max_attempts" else name
                raise ConfigError(f"ELASTICO_{setting.upper()}={getattr(self, setting)}: {exc.reason}") from None

    def policy_options(self) -> dict:
        """The options the policy runs with (the simulator's runs of the live configuration use the same)."""
        return {name: getattr(self, name) for name in _POLICY_OPTIONS}

    def service_quotas(self) -> dict[str, int]:
        """ELASTICO_SERVICE_QUOTA_GPUS parsed (tenant or ``*`` -> GPUs); a malformed value is a ConfigError."""
        from services.allocator.quota import parse_quotas

        return parse_quotas(self.service_quota_gpus)

    @property
    def effective_replica_id(self) -> str:
        return self.replica_id or f"{socket.gethostname()}-{os.getpid()}"
