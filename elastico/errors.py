"""Domain exceptions: the one error channel of ElastiCo.

Pure code raises these; the gRPC interceptor (``elastico.rpc.interceptors``) maps each to exactly one
status code, so no servicer builds statuses by hand and nothing escapes as UNKNOWN. "Unschedulable now"
(``ResourceExhausted``) and "can never be scheduled" (``Infeasible``) are different errors on purpose:
a client should retry the first and change its request after the second.
"""

from __future__ import annotations


class ElasticoError(Exception):
    """Base of every error that crosses a service boundary."""

    #: gRPC status code name this error maps to (``grpc.StatusCode[name]``).
    code_name = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidSpec(ElasticoError):
    """A request or configuration field is malformed. ``field`` names it (dotted path)."""

    code_name = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class NotFound(ElasticoError):
    """The named object does not exist."""

    code_name = "NOT_FOUND"


class Infeasible(ElasticoError):
    """The request can never be satisfied in the current system (for example: no GPU is large enough)."""

    code_name = "FAILED_PRECONDITION"


class WrongState(ElasticoError):
    """The object exists but its state forbids the operation (for example: cancelling a finished job)."""

    code_name = "FAILED_PRECONDITION"


class StaleEpoch(ElasticoError):
    """A write carried a leader epoch (fencing token) older than the current one; nothing was changed."""

    code_name = "ABORTED"


class Conflict(ElasticoError):
    """An optimistic-concurrency check failed (version moved, capacity taken); nothing was changed."""

    code_name = "ABORTED"


class ResourceExhausted(ElasticoError):
    """No capacity right now; retrying later may succeed."""

    code_name = "RESOURCE_EXHAUSTED"


class Unavailable(ElasticoError):
    """A dependency (Redis, another service) cannot be reached; retry with backoff."""

    code_name = "UNAVAILABLE"


class NotImplementedYet(ElasticoError):
    """The method is part of the v1 API but this build does not serve it yet."""

    code_name = "UNIMPLEMENTED"


class Unauthenticated(ElasticoError):
    """The caller presented no credentials, or credentials that are unknown, revoked or malformed."""

    code_name = "UNAUTHENTICATED"


class PermissionDenied(ElasticoError):
    """The caller is known but its identity does not allow this call. ``field`` names the request field, if any."""

    code_name = "PERMISSION_DENIED"

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class ConfigError(ValueError):
    """Start-up configuration is invalid. Raised by ``Settings.from_env``; the process exits with it."""
