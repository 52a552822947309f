"""Configuration of the Kubernetes middleware (``python -m services.kube``): ``ELASTICO_*`` variables, validated at start."""

from __future__ import annotations

import os
from dataclasses import dataclass

from elastico.config import Settings
from elastico.errors import ConfigError

ROLES = ("extender", "webhook", "both")


@dataclass(frozen=True)
class KubeSettings(Settings):
    service_name: str = "kube"
    port: int = 8443  # HTTP(S) port of the extender / webhook endpoints
    role: str = "both"  # extender (scheduler extender verbs), webhook (admission), or both on one port
    tls_cert_file: str = ""  # PEM certificate; with tls_key_file the server speaks HTTPS (required for the webhook role)
    tls_key_file: str = ""  # PEM private key of tls_cert_file
    # --- client certificates of the HTTPS callers (services/kube/app.py, docs/security.md "Deployment") ---
    # the CA the callers' client certificates must chain to (kube-scheduler's, the API server's); "" = the
    # cluster CA, ELASTICO_TLS_CA_FILE. Checked whenever TLS is on and ELASTICO_INSECURE is off.
    http_client_ca_file: str = ""
    # /mutate demands a verified client certificate (the API server presents one only when an AdmissionConfiguration
    # gives it a kubeconfig for this webhook); may be off only for role webhook. The extender routes always demand one.
    http_require_client_cert: bool = True
    allocator_address: str = ""  # host:port of the allocator (required by the extender)
    # the extender's bearer token for the Allocator API (a "scheduler" token: python -m elastico.auth issue)
    client_token_file: str = ""
    predictor_address: str = ""  # host:port of the predictor; "" = prioritize without interference predictions
    allocator_timeout_s: float = 2.0  # deadline of each allocator call
    predictor_timeout_s: float = 1.0  # deadline of each PredictInterference call
    bind_timeout_s: float = 10.0  # how long bind waits for the allocator to commit the pod's slice
    bind_poll_s: float = 0.1  # GetJob period while bind waits
    kube_api_url: str = ""  # Kubernetes API base URL; "" = in-cluster service account (else ~/.kube/config)
    kube_timeout_s: float = 5.0  # deadline of each Kubernetes API call
    scheduler_name: str = "elastico-scheduler"  # injected as spec.schedulerName; "" = leave it (extender in the default scheduler)
    runtime_class: str = "nvidia"  # injected as spec.runtimeClassName when unset; "" = leave it
    mps_pipe_dir: str = "/tmp/nvidia-mps"  # the node's MPS pipe directory (hostPath), mounted at the same path
    # how long a gang member's bind waits for every member to arrive and get its slice (< the scheduler's httpTimeout)
    gang_timeout_s: float = 20.0
    reap_interval_s: float = 30.0  # how often jobs of deleted or finished pods are cancelled; 0 = never
    # how long a finished pod's job is left to its node agent, which reports SUCCEEDED / FAILED, before the reaper
    # cancels it (a node agent that never reports); shorter, a pass between the pod's end and that report loses it
    reap_finished_grace_s: float = 60.0
    # how often pod jobs the policy preempted or resized are evicted, and gangs with a failed member freed; 0 = never
    evict_interval_s: float = 5.0

    def validate(self) -> None:
        super().validate()
        if self.role not in ROLES:
            raise ConfigError(f"ELASTICO_ROLE={self.role!r}: must be one of {', '.join(ROLES)}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("ELASTICO_TLS_CERT_FILE and ELASTICO_TLS_KEY_FILE must be set together")
        if self.role == "webhook" and not self.tls_cert_file:
            raise ConfigError("ELASTICO_TLS_CERT_FILE/ELASTICO_TLS_KEY_FILE are required for the webhook role "
                              "(the API server calls admission webhooks over HTTPS only)")
        for var, path in (("ELASTICO_TLS_CERT_FILE", self.tls_cert_file), ("ELASTICO_TLS_KEY_FILE", self.tls_key_file),
                          ("ELASTICO_HTTP_CLIENT_CA_FILE", self.http_client_ca_file)):
            if path and not os.path.isfile(path):
                raise ConfigError(f"{var}={path!r}: no such file")
        if self.role in ("extender", "both") and not self.allocator_address:
            raise ConfigError("ELASTICO_ALLOCATOR_ADDRESS is required by the extender (role extender or both)")

        for var, v in (("ELASTICO_ALLOCATOR_TIMEOUT_S", self.allocator_timeout_s),
                       ("ELASTICO_PREDICTOR_TIMEOUT_S", self.predictor_timeout_s),
                       ("ELASTICO_BIND_TIMEOUT_S", self.bind_timeout_s), ("ELASTICO_BIND_POLL_S", self.bind_poll_s),
                       ("ELASTICO_KUBE_TIMEOUT_S", self.kube_timeout_s), ("ELASTICO_GANG_TIMEOUT_S", self.gang_timeout_s)):
            if not v > 0:
                raise ConfigError(f"{var}={v}: must be > 0")
        for var, v in (("ELASTICO_REAP_INTERVAL_S", self.reap_interval_s), ("ELASTICO_EVICT_INTERVAL_S", self.evict_interval_s),
                       ("ELASTICO_REAP_FINISHED_GRACE_S", self.reap_finished_grace_s)):
            if v < 0:
                raise ConfigError(f"{var}={v}: must be >= 0 (0 = never)")
        if not self.mps_pipe_dir.startswith("/"):
            raise ConfigError(f"ELASTICO_MPS_PIPE_DIR={self.mps_pipe_dir!r}: must be an absolute path")

    def validate_security(self) -> None:
        super().validate_security()
        if self.role in ("extender", "both") and not (self.client_token_file or self.insecure):
            raise ConfigError("ELASTICO_CLIENT_TOKEN_FILE is required by the extender: the Allocator API takes a "
                              "bearer token on every call (unless ELASTICO_INSECURE=1)")
        if not (self.insecure or self.http_require_client_cert) and self.role != "webhook":
            raise ConfigError("ELASTICO_HTTP_REQUIRE_CLIENT_CERT=0: only role webhook (an API server that cannot present a "
                              f"client certificate) may serve without one, not role {self.role}: the extender routes "
                              "always require kube-scheduler's certificate")
        if self.client_token_file and not os.path.isfile(self.client_token_file):
            raise ConfigError(f"ELASTICO_CLIENT_TOKEN_FILE={self.client_token_file!r}: no such file")
