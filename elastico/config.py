"""Typed, fail-fast configuration.

Each service declares a frozen dataclass subclass of ``Settings``; ``from_env()`` reads one environment
variable per field (``ELASTICO_<FIELD>`` upper-cased, e.g. ``ELASTICO_PORT``), converts it to the
field's type and validates it, raising ``ConfigError`` with the variable's name and the reason. A
service with a wrong setting refuses to start instead of misbehaving later. Units are in field names.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import typing
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from elastico.errors import ConfigError
from elastico.files import replace_file

ENV_PREFIX = "ELASTICO_"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "console")


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def redis_has_password(url: str) -> bool:
    """Whether a Redis URL carries credentials (``redis://[user]:password@...`` or ``?password=``)."""
    parts = urllib.parse.urlsplit(url)
    return bool(parts.password) or "password" in urllib.parse.parse_qs(parts.query)


def redis_url_problem(url: str) -> str | None:
    """Why ``url`` is no usable Redis URL, or None: redis:// and rediss:// name their host (an empty one would quietly
    mean localhost:6379) with a numeric port and database, unix:// a socket path."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return "must start with redis://, rediss:// or unix://"
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "unix":
        return None if parts.path else "unix:// needs the socket's path"
    try:
        parts.port  # noqa: B018 - parsing it is the check
    except ValueError:
        return "the port must be a number in [0, 65535]"
    if not parts.hostname:
        return "must name its host (redis://[user:password@]host:port/db)"
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        return f"the database must be a number, got {db[:16]!r}"
    return None


def address_problem(address: str) -> str | None:
    """Why ``address`` is no gRPC ``host:port`` to dial, or None: a host (an IPv6 one in brackets; a resolver
    prefix such as ``dns:///`` is kept) without blanks or control characters, and a port in [1, 65535]; or a
    ``unix:`` socket path."""
    if address.startswith("unix:"):
        path = address.removeprefix("unix:")
        return None if path.strip("/") and path.isprintable() and " " not in path else "a unix: address needs a socket path"
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        return "must be host:port"
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        return f"the port must be a number in [1, 65535], got {port[:16]!r}"
    if not host.isascii() or not host.isprintable() or " " in host:
        return "the host holds blanks, control or non-ASCII characters"
    if ":" in host.split("///")[-1] and not (host.endswith("]") and "[" in host):
        return "an IPv6 host goes in brackets ([::1]:50051)"
    return None


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs and error messages)."""
    parts = urllib.parse.urlsplit(url)
    if not parts.password:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _parse(raw: str, tp: Any, var: str) -> Any:
    try:
        if tp is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected one of 1/0/true/false/yes/no/on/off")
        if tp is int:
            return int(raw)
        if tp is float:
            x = float(raw)
            if not math.isfinite(x):  # every comparison with NaN is false, so no range check would refuse it
                raise ValueError("must be a finite number")
            return x
        if tp is str:
            return raw
    except ValueError as exc:
        raise ConfigError(f"{var}={raw!r}: not a valid {tp.__name__} ({exc})") from None
    raise ConfigError(f"{var}: unsupported setting type {tp!r}")  # pragma: no cover - programming error


@dataclass(frozen=True)
class Settings:
    """Settings every service shares."""

    service_name: str = "elastico"  # set by each subclass; names the service in logs and metrics
    host: str = "127.0.0.1"  # interface the gRPC server binds
    port: int = 0  # gRPC port; 0 = pick a free one (printed at start-up)
    metrics_port: int = -1  # Prometheus /metrics HTTP port; 0 = pick a free one; -1 = disabled
    log_level: str = "info"  # debug, info, warning, error
    log_format: str = "auto"  # json, console, or auto (console on a TTY, JSON otherwise)
    shutdown_grace_s: float = 5.0  # how long in-flight calls may finish after SIGTERM (after the drain)
    # after SIGTERM: NOT_SERVING and still answering this long, so load balancers and clients move away
    shutdown_drain_s: float = 1.0
    redis_url: str = ""  # redis://host:port/db of the shared state; "" = service does not use Redis
    port_file: str = ""  # if set, the bound gRPC port is written here (for supervisors using port 0)
    # largest request message accepted, MiB (each service sets its own: what its largest valid request needs)
    max_request_mib: float = 4.0
    # calls that may wait for the service to take them up; beyond it gRPC refuses new calls at random, all of them
    # beyond twice it (as CANCELLED). gRPC's own default, 1,000, refused ~1.5 % of a 1,300-call burst
    max_pending_rpcs: int = 10_000
    # --- transport security (docs/security.md) ---------------------------------------------------------
    # mTLS is the default: this process's certificate and key (its identity: the certificate's common name,
    # e.g. "allocator" or "node/<node id>") and the CA its peers' certificates must chain to. The files are
    # re-read when they change (rotation without restart).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    # the server demands a client certificate (mTLS); off only for a public API port whose callers
    # authenticate with tokens alone
    tls_require_client_cert: bool = True
    # plaintext gRPC and an unauthenticated Redis, for a loopback-only development run: logged as a warning
    # at start, and a non-loopback bind address is refused
    insecure: bool = False
    # accept a Redis URL without a password (a Redis reachable only by this suite); said so at start
    redis_allow_no_auth: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Self:
        """Build settings from ``ELASTICO_*`` variables (``env`` defaults to ``os.environ``).

        Raises:
            ConfigError: a variable does not parse or a value is out of range; the message names it.
        """
        env = os.environ if env is None else env
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            var = ENV_PREFIX + f.name.upper()
            if f.name in overrides:
                values[f.name] = overrides[f.name]
            elif var in env:
                values[f.name] = _parse(env[var], hints[f.name], var)
        settings = cls(**values)
        settings.validate()
        settings.validate_security()
        return settings

    def validate(self) -> None:
        """Check ranges; subclasses extend it and call ``super().validate()``."""
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"ELASTICO_PORT={self.port}: must be in [0, 65535]")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"ELASTICO_METRICS_PORT={self.metrics_port}: must be -1 (off) or in [0, 65535]")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"ELASTICO_LOG_LEVEL={self.log_level!r}: must be one of {', '.join(LOG_LEVELS)}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"ELASTICO_LOG_FORMAT={self.log_format!r}: must be one of {', '.join(LOG_FORMATS)}")
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"ELASTICO_SHUTDOWN_GRACE_S={self.shutdown_grace_s}: must be >= 0")
        if not 0 < self.max_request_mib <= 256:
            raise ConfigError(f"ELASTICO_MAX_REQUEST_MIB={self.max_request_mib}: must be in (0, 256]")
        if not 100 <= self.max_pending_rpcs <= 1_000_000:
            raise ConfigError(f"ELASTICO_MAX_PENDING_RPCS={self.max_pending_rpcs}: must be in [100, 1000000]")
        if not 0 <= self.shutdown_drain_s <= 300:
            raise ConfigError(f"ELASTICO_SHUTDOWN_DRAIN_S={self.shutdown_drain_s}: must be in [0, 300]")
        if self.redis_url:
            problem = redis_url_problem(self.redis_url)
            if problem:
                raise ConfigError(f"ELASTICO_REDIS_URL={redact_url(self.redis_url)!r}: {problem}")
        if self.port_file and not os.path.isdir(os.path.dirname(os.path.abspath(self.port_file))):
            raise ConfigError(f"ELASTICO_PORT_FILE={self.port_file!r}: its directory does not exist")
        # by name: a *_dir setting that exists must be a directory, a *_file or *_path one must not be; an *_address
        # is host:port, an *_addresses a comma-separated list of them
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, str) or not value:
                continue
            if f.name.endswith(("_address", "_addresses")):
                for a in value.split(",") if f.name.endswith("s") else [value]:
                    if a.strip() and (problem := address_problem(a.strip())):
                        raise ConfigError(f"ELASTICO_{f.name.upper()}={value!r}: {a.strip()!r}: {problem}")
            if f.name.endswith("_dir") and os.path.exists(value) and not os.path.isdir(value):
                raise ConfigError(f"ELASTICO_{f.name.upper()}={value!r}: exists and is not a directory")
            if f.name.endswith(("_file", "_path")) and os.path.isdir(value):
                raise ConfigError(f"ELASTICO_{f.name.upper()}={value!r}: is a directory, not a file")

    def validate_security(self) -> None:
        """Refuse plaintext and unauthenticated Redis unless explicitly allowed (checked after the fields' ranges)."""
        if self.insecure:
            if not is_loopback(self.host):
                raise ConfigError(f"ELASTICO_INSECURE=1 serves plaintext: it binds loopback only, not ELASTICO_HOST={self.host!r}")
        else:
            missing = [f"ELASTICO_{n.upper()}" for n in ("tls_cert_file", "tls_key_file", "tls_ca_file") if not getattr(self, n)]
            if missing:
                raise ConfigError(f"{', '.join(missing)} required: every ElastiCo server runs mTLS "
                                  "(or set ELASTICO_INSECURE=1 for plaintext on loopback)")
            for n in ("tls_cert_file", "tls_key_file", "tls_ca_file"):
                if not os.path.isfile(getattr(self, n)):
                    raise ConfigError(f"ELASTICO_{n.upper()}={getattr(self, n)!r}: no such file")
            if not self.tls_require_client_cert and self.service_name != "allocator":
                raise ConfigError(f"ELASTICO_TLS_REQUIRE_CLIENT_CERT=0: only the allocator (whose callers hold tokens) may "
                                  f"serve without client certificates, not the {self.service_name}")
        if self.redis_url and not (self.insecure or self.redis_allow_no_auth) and not redis_has_password(self.redis_url):
            raise ConfigError(f"ELASTICO_REDIS_URL={redact_url(self.redis_url)!r} carries no password: ElastiCo refuses an "
                              "unauthenticated Redis (redis://user:password@host:port/db), unless "
                              "ELASTICO_REDIS_ALLOW_NO_AUTH=1 says the Redis is private")

    def require_redis(self) -> None:
        """Fail fast for services that cannot work without shared state."""
        if not self.redis_url:
            raise ConfigError(f"ELASTICO_REDIS_URL is required by the {self.service_name} service")


def write_port_file(path: str, port: int) -> None:
    """The bound port for a supervisor (``port_file``), written whole: a reader polling for it never sees it empty."""
    replace_file(path, f"{port}\n".encode())
