"""``python -m elastico.healthcheck HOST:PORT [SERVICE]``: exit 0 iff the gRPC health check says SERVING.

Used as the container healthcheck in docker-compose.yml and by Kubernetes exec probes, so images need
no extra probe binary. It dials with the process's own ``ELASTICO_TLS_*`` certificate (the container's
service identity), or plaintext with ``ELASTICO_INSECURE=1``.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from elastico.config import Settings
from elastico.errors import ConfigError
from elastico.rpc.security import ClientTLS

#: Health-service name a scheduling allocator answers SERVING while it reaches the store (Redis), NOT_SERVING while
#: it does not: a node agent cut off from the store asks it whether the outage is everyone's (no allocator can then
#: declare the node lost) or only its own (services/node_agent/liveness.py).
STORE_SERVICE = "elastico.store"


def health_status(address: str, service: str = "", timeout_s: float = 1.0, tls: ClientTLS | None = None) -> str:
    """SERVING / NOT_SERVING / UNREACHABLE for ``service`` ("" = the whole server) at ``address``."""
    try:
        with (tls or ClientTLS(None)).channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    except grpc.RpcError:
        return "UNREACHABLE"


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print("usage: python -m elastico.healthcheck HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    try:
        tls = ClientTLS.from_settings(Settings.from_env(service_name="healthcheck"))
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    status = health_status(argv[0], argv[1] if len(argv) == 2 else "", timeout_s=3.0, tls=tls)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
