"""Transport security of every gRPC server and client of the suite: mTLS with reloadable files, peer identities.

A process's identity is the common name (CN) of its certificate: ``allocator``, ``pricer``, ``predictor``,
``kube``, ``operator`` or ``node/<node id>``. Servers require a client certificate from the same CA (unless
``tls_require_client_cert`` is off, for a public API port whose callers hold only tokens) and may restrict
each method to some peer roles (``PeerPolicy``). The certificate, key and CA files are re-read when their
modification time changes: the server at its next TLS handshake, clients at their next channel
(``ClientTLS.channel`` and the pools built on it), so a rotation needs no restart.

``ELASTICO_INSECURE=1`` turns all of this off (plaintext, no peer identity) and binds loopback only.
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime as dt
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from elastico.errors import ConfigError, PermissionDenied, Unauthenticated
from elastico.logging import get_logger

log = get_logger(component="security")

PEER_ROLES = ("allocator", "pricer", "predictor", "kube", "operator", "node")


@dataclass(frozen=True)
class TLSFiles:
    """Paths of one process's certificate, key and CA bundle; ``None`` where plaintext is configured."""

    cert_file: str
    key_file: str
    ca_file: str

    @classmethod
    def from_settings(cls, settings) -> TLSFiles | None:
        if settings.insecure:
            return None
        return cls(settings.tls_cert_file, settings.tls_key_file, settings.tls_ca_file)

    def stamp(self) -> tuple[int, ...]:
        """Modification times of the three files (what tells a reload is due)."""
        return file_stamp((self.cert_file, self.key_file, self.ca_file))

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(certificate chain, private key, CA bundle) as PEM bytes."""
        with open(self.cert_file, "rb") as c, open(self.key_file, "rb") as k, open(self.ca_file, "rb") as a:
            return c.read(), k.read(), a.read()

    def checked_read(self) -> tuple[bytes, bytes, bytes]:
        """:meth:`read`, refusing files grpc would take and fail on only at a handshake (:func:`tls_problem`).

        Raises:
            ConfigError: naming the variable and the file (an unreadable file included).
        """
        try:
            data = self.read()
        except OSError as exc:
            raise ConfigError(f"TLS files unreadable: {exc}") from None
        problem = tls_problem(self, *data)
        if problem is not None:
            raise ConfigError(problem)
        return data


def tls_problem(files: TLSFiles, chain: bytes, key: bytes, ca: bytes) -> str | None:
    """What makes the files' bytes unusable, naming the variable and the file, or None: each parses as PEM, the
    key is the certificate's, the certificate (or the top of its chain) is issued by a certificate of the CA
    bundle, and it has not expired."""
    where = {"cert": f"ELASTICO_TLS_CERT_FILE={files.cert_file!r}", "key": f"ELASTICO_TLS_KEY_FILE={files.key_file!r}",
             "ca": f"ELASTICO_TLS_CA_FILE={files.ca_file!r}"}
    try:
        certs = x509.load_pem_x509_certificates(chain)
    except ValueError:
        return f"{where['cert']}: not a PEM certificate"
    try:
        cas = x509.load_pem_x509_certificates(ca)
    except ValueError:
        return f"{where['ca']}: not a PEM CA certificate bundle"
    try:
        private = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError):  # TypeError: the key needs a password
        return f"{where['key']}: not an unencrypted PEM private key"
    spki = serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    if private.public_key().public_bytes(*spki) != certs[0].public_key().public_bytes(*spki):
        return f"{where['key']}: not the key of the certificate in {files.cert_file!r}"
    if certs[0].not_valid_after_utc <= dt.datetime.now(dt.UTC):
        return f"{where['cert']}: expired on {certs[0].not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
    if not any(_issued_by(certs[-1], c) for c in cas):
        return f"{where['cert']}: not issued by a certificate of {files.ca_file!r}"
    return None


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    if cert == ca:
        return True
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def file_stamp(paths: Sequence[str]) -> tuple[int, ...]:
    """Modification times (ns) of ``paths``, -1 for a missing file: a change means the files were rotated."""
    out = []
    for p in paths:
        try:
            out.append(os.stat(p).st_mtime_ns)
        except OSError:
            out.append(-1)
    return tuple(out)


def server_credentials(files: TLSFiles, require_client_cert: bool = True) -> grpc.ServerCredentials:
    """Server credentials that re-read ``files`` at the first handshake after one of them changed."""
    lock = threading.Lock()
    state = {"stamp": files.stamp()}

    def config(chain: bytes, key: bytes, ca: bytes):
        return grpc.ssl_server_certificate_configuration([(key, chain)], root_certificates=ca)

    initial = config(*files.checked_read())

    def fetch():
        stamp = files.stamp()
        with lock:
            if stamp == state["stamp"]:
                return None
            try:
                new = config(*files.checked_read())
            except ConfigError as exc:  # a rotation in progress, or a bad file: keep serving the old certificate
                log.warning("TLS files unusable; keeping the previous certificate", error=str(exc))
                return None
            state["stamp"] = stamp
        log.info("TLS certificate reloaded", cert_file=files.cert_file)
        return new

    return grpc.dynamic_ssl_server_credentials(initial, fetch, require_client_authentication=require_client_cert)


@dataclass
class ClientTLS:
    """How this process dials the suite's servers: its certificate (mTLS) and an optional bearer token.

    ``channel``/``aio_channel`` build channels with the files as they are now; ``stale(stamp)`` tells a
    long-lived pool that a rotation happened and its channels should be rebuilt.
    """

    files: TLSFiles | None
    token: str = ""  # bearer token sent as ``authorization`` metadata (the Allocator API's callers)
    target_name: str = ""  # expected server name when it differs from the dialled host (ssl_target_name_override)
    _cache: tuple = field(default=(), init=False, repr=False, compare=False)

    @classmethod
    def from_settings(cls, settings, token: str = "") -> ClientTLS:
        """The process's own files, checked (:meth:`TLSFiles.checked_read`: ConfigError names a bad one)."""
        files = TLSFiles.from_settings(settings)
        if files is not None:
            files.checked_read()
        return cls(files, token=token)

    def __getstate__(self) -> dict:  # picklable (the allocator's decide worker): credentials are rebuilt there
        return {**self.__dict__, "_cache": ()}

    def stamp(self) -> tuple[float, ...]:
        return self.files.stamp() if self.files is not None else ()

    def _credentials(self) -> grpc.ChannelCredentials | None:
        if self.files is None:
            return None
        stamp = self.files.stamp()
        if self._cache and self._cache[0] == stamp:
            return self._cache[1]
        chain, key, ca = self.files.read()
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=chain)
        self._cache = (stamp, creds)
        return creds

    def _options(self, options: Sequence[tuple[str, object]]) -> list[tuple[str, object]]:
        opts = list(options)
        if self.target_name:
            opts.append(("grpc.ssl_target_name_override", self.target_name))
        return opts

    # The token goes as metadata added by an interceptor, not as call credentials: grpc's access-token
    # credentials are a Python plugin whose destructor runs on a gRPC core thread under the GIL, and a channel
    # closed from Python meanwhile deadlocks the process (grpc/grpc#42247: seen here, a test hung in close()).
    def channel(self, address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        creds = self._credentials()
        ch = (grpc.insecure_channel(address, options=self._options(options)) if creds is None
              else grpc.secure_channel(address, creds, options=self._options(options)))
        return grpc.intercept_channel(ch, _TokenInterceptor(self.token)) if self.token else ch

    def aio_channel(self, address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
        creds = self._credentials()
        interceptors = [_AioUnaryToken(self.token), _AioStreamToken(self.token)] if self.token else None
        if creds is None:
            return grpc.aio.insecure_channel(address, options=self._options(options), interceptors=interceptors)
        return grpc.aio.secure_channel(address, creds, options=self._options(options), interceptors=interceptors)


class _BearerToken:
    """The ``authorization`` metadata the interceptors below add to each call's details."""

    def __init__(self, token: str) -> None:
        self._md = ("authorization", f"Bearer {token}")

    def _details(self, details):
        return details._replace(metadata=[*(details.metadata or ()), self._md])


class _TokenInterceptor(_BearerToken, grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the bearer token to every call (the suite's RPCs are unary or server-streaming)."""

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


class _AioUnaryToken(_BearerToken, grpc.aio.UnaryUnaryClientInterceptor):
    """The token on unary calls of an aio channel (which files an interceptor under its first matching kind)."""

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _AioStreamToken(_BearerToken, grpc.aio.UnaryStreamClientInterceptor):
    """The token on server-streaming calls of an aio channel."""

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


def read_token(path: str) -> str:
    """A bearer token from a file (one line; a Kubernetes Secret mounted as a file)."""
    with open(path) as f:
        token = f.read().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


# --- peer identity on the server side ---------------------------------------------------------------
@dataclass(frozen=True)
class Peer:
    """The authenticated process at the other end of a call (from its certificate's common name)."""

    name: str  # the CN, e.g. "node/node-1"

    @property
    def role(self) -> str:
        return self.name.split("/", 1)[0]

    @property
    def node_id(self) -> str:
        """The node an agent's certificate names ("" for other roles)."""
        return self.name.split("/", 1)[1] if self.role == "node" and "/" in self.name else ""


def certificate_name(cert_file: str) -> str:
    """The common name of the PEM certificate in ``cert_file`` (a process checks its own identity at start)."""
    with open(cert_file, "rb") as f:
        cert = x509.load_pem_x509_certificate(f.read())
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def peer_of(context: grpc.aio.ServicerContext) -> Peer | None:
    """The verified client certificate's identity, or None on a plaintext (insecure) or certificate-less call."""
    names = context.auth_context().get("x509_common_name")
    if not names:
        return None
    return Peer(names[0].decode(errors="replace"))


@dataclass(frozen=True)
class PeerPolicy:
    """Which peer roles may call which methods of one server (mTLS); methods not listed allow ``default``.

    ``rules`` maps a method's short name (``"Sync"``) to the roles allowed; ``default`` applies to the others.
    Health checks and reflection are always allowed to any certificate of the CA.
    """

    default: frozenset[str]
    rules: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def check(self, method: str, peer: Peer | None, secure: bool) -> Peer | None:
        """Raise unless ``peer`` may call ``method`` (full name ``/pkg.Service/Method``)."""
        if not secure or not method.startswith("/elastico."):
            return peer
        if peer is None:
            raise Unauthenticated("a client certificate of the cluster's CA is required")
        allowed = self.rules.get(method.rsplit("/", 1)[-1], self.default)
        if peer.role not in allowed:
            raise PermissionDenied(f"peer {peer.name!r} (role {peer.role}) may not call {method}")
        return peer


def roles(*names: str) -> frozenset[str]:
    unknown = set(names) - set(PEER_ROLES)
    if unknown:  # pragma: no cover - programming error
        raise ValueError(f"unknown peer roles {sorted(unknown)}")
    return frozenset(names)


# --- what the interceptor checks per call -----------------------------------------------------------
ANY_PEER = frozenset(PEER_ROLES)


@dataclass(frozen=True)
class Access:
    """Who may call one service: peer roles by certificate (mTLS) and, for the Allocator API, bearer tokens."""

    peers: PeerPolicy = field(default_factory=lambda: PeerPolicy(ANY_PEER))
    tokens: object | None = None  # an ``elastico.auth.TokenStore``: every call needs a valid token


@dataclass(frozen=True)
class Caller:
    """The authenticated caller of the current RPC (``current_caller()`` inside a servicer)."""

    peer: Peer | None = None
    identity: object | None = None  # ``elastico.auth.Identity`` when the service takes tokens

    def describe(self) -> dict[str, str]:
        out = {"peer": self.peer.name if self.peer else "-"}
        if self.identity is not None:
            out.update(identity=self.identity.name, role=self.identity.role, tenant=self.identity.tenant)
        return out


_CALLER: contextvars.ContextVar[Caller] = contextvars.ContextVar("elastico_caller", default=Caller())  # noqa: B039 - Caller is frozen


def current_caller() -> Caller:
    return _CALLER.get()


def authorize(access: Access, method: str, context: grpc.aio.ServicerContext, secure: bool) -> Caller:
    """Check the call's certificate and token against ``access``; returns the caller, raises the domain error."""
    peer = access.peers.check(method, peer_of(context) if secure else None, secure)
    identity = None
    if access.tokens is not None and method.startswith("/elastico."):
        values = [v for k, v in (context.invocation_metadata() or ()) if k == "authorization"]
        identity = access.tokens.authenticate([v if isinstance(v, str) else v.decode(errors="replace") for v in values])
    return Caller(peer, identity)


def bind_caller(caller: Caller) -> contextvars.Token:
    return _CALLER.set(caller)


class ReloadingStub:
    """An aio stub whose channel is rebuilt when the certificate files change (long-lived clients).

    Each attribute access compares the files' modification times (three ``stat`` calls); after a rotation the
    next call goes over a new channel with the new certificate, and the old channel closes once its calls end.
    """

    def __init__(self, tls: ClientTLS, address: str, stub_class: type) -> None:
        self._tls, self._address, self._stub_class = tls, address, stub_class
        self._retiring: set[asyncio.Task] = set()  # old channels' closes (the loop holds tasks only weakly)
        self._connect()

    def _connect(self) -> None:
        self._stamp = self._tls.stamp()
        self._channel = self._tls.aio_channel(self._address)
        self._stub = self._stub_class(self._channel)

    def __getattr__(self, name: str):
        if self._tls.files is not None and self._tls.stamp() != self._stamp:
            old = self._channel
            self._connect()
            task = asyncio.get_running_loop().create_task(old.close(grace=30.0))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        return getattr(self._stub, name)

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)
