"""Bearer tokens of the Allocator API: who a caller is (identity, role, tenant) and what it may run.

Tokens live hashed (SHA-256 of a 256-bit random secret, so a plain hash suffices) in a JSON file the operator
manages with ``python -m elastico.auth issue|revoke|list --file FILE``. The file is re-read when it changes,
so issuing or revoking a token needs no restart. Roles:

- ``tenant``: submits, sees, watches and cancels only its own tenant's jobs;
- ``scheduler``: acts for any tenant (the Kubernetes extender); ``operator``: everything;
- ``node``: no Allocator API call (agents work through their own Redis user).

A job's free ``command`` runs only for an identity whose allow-list admits it (``commands``: executables or
argv prefixes; ``"*"`` = any command).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import secrets
import shlex
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from elastico import limits as L
from elastico.errors import ConfigError, Unauthenticated
from elastico.files import replace_file

ROLES = ("tenant", "scheduler", "operator", "node")
TOKEN_PREFIX = "elastico_"
MAX_TOKEN_CHARS = 256  # a longer ``authorization`` value is refused before hashing
RELOAD_CHECK_S = 1.0  # the file's mtime is checked at most this often


@dataclass(frozen=True)
class Identity:
    """An authenticated caller of the Allocator API."""

    name: str
    role: str
    tenant: str = ""  # the tenant a ``tenant`` identity acts as
    commands: tuple[str, ...] = ()  # allow-list of commands (argv prefixes); "*" = any
    # highest job priority a ``tenant`` identity may submit (its token's ``max_priority``, default 0: only the
    # operator raises a tenant's jobs above normal); operators and the scheduler are not bounded
    max_priority: int = 0

    @property
    def any_tenant(self) -> bool:
        return self.role in ("operator", "scheduler")

    def may_run(self, command: str) -> bool:
        """Whether ``command`` (split like the node agent splits it) starts with an allowed argv prefix."""
        if "*" in self.commands:
            return True
        try:
            argv = shlex.split(command)
        except ValueError:
            return False
        for allowed in self.commands:
            prefix = shlex.split(allowed)
            if prefix and argv[:len(prefix)] == prefix:
                return True
        return False


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def _identity(entry: dict, where: str) -> Identity:
    role = entry.get("role")
    if role not in ROLES:
        raise ConfigError(f"{where}: role {role!r} must be one of {', '.join(ROLES)}")
    tenant = str(entry.get("tenant", ""))
    if role == "tenant" and not tenant:
        raise ConfigError(f"{where}: a tenant token needs a tenant")
    commands = entry.get("commands", [])
    if not isinstance(commands, list) or not all(isinstance(c, str) and c.strip() for c in commands):
        raise ConfigError(f"{where}: commands must be a list of non-empty strings")
    max_priority = entry.get("max_priority", 0)
    if isinstance(max_priority, bool) or not isinstance(max_priority, int) or not 0 <= max_priority <= L.PRIORITY_MAX:
        raise ConfigError(f"{where}: max_priority must be an integer in [0, {L.PRIORITY_MAX}]")
    return Identity(name=str(entry["name"]), role=role, tenant=tenant, commands=tuple(commands),
                    max_priority=max_priority)


def load_tokens(path: str | Path) -> dict[str, Identity]:
    """sha256 -> identity of every unrevoked token in ``path``.

    Raises:
        ConfigError: the file is missing or malformed (the message names the entry).
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"tokens file {path}: {exc}") from None
    out: dict[str, Identity] = {}
    for i, entry in enumerate(data.get("tokens", [])):
        where = f"tokens file {path}: tokens[{i}]"
        if not isinstance(entry, dict) or not entry.get("name") or len(str(entry.get("sha256", ""))) != 64:
            raise ConfigError(f"{where}: needs a name and a 64-hex-digit sha256")
        if not entry.get("revoked"):
            out[entry["sha256"]] = _identity(entry, where)
    return out


class TokenStore:
    """The tokens file, re-read when it changes; ``authenticate`` maps an ``authorization`` value to an identity.

    A file that becomes unreadable or malformed keeps the last good table (and logs why), so a half-written
    edit cannot lock every caller out; a token revoked in a good edit is refused from the next check on.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._table = load_tokens(self.path)
        self._mtime = self._stat()
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    def _stat(self) -> int:
        try:
            return self.path.stat().st_mtime_ns
        except OSError:
            return -1

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked < RELOAD_CHECK_S:
            return
        with self._lock:
            self._checked = now
            mtime = self._stat()
            if mtime == self._mtime:
                return
            try:
                self._table = load_tokens(self.path)
            except ConfigError as exc:
                from elastico.logging import get_logger

                get_logger(component="auth").error("tokens file not reloaded; keeping the previous tokens", error=str(exc))
            self._mtime = mtime

    def authenticate(self, values: Sequence[str]) -> Identity:
        """The identity of the one ``authorization: Bearer <token>`` value in ``values``.

        Raises:
            Unauthenticated: none, several, malformed, unknown or revoked (the message never echoes the value).
        """
        if not values:
            raise Unauthenticated("missing 'authorization: Bearer <token>' metadata")
        if len(values) > 1:
            raise Unauthenticated("exactly one authorization value is allowed")
        value = values[0]
        if len(value) > MAX_TOKEN_CHARS + 7 or not value.startswith("Bearer "):
            raise Unauthenticated("authorization must be 'Bearer <token>'")
        self._refresh()
        identity = self._table.get(token_hash(value[7:].strip()))
        if identity is None:
            raise Unauthenticated("unknown or revoked token")
        return identity


# --- the operator's command: issue / revoke / list ----------------------------------------------------
def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"version": 1, "tokens": []}


def _write(path: Path, data: dict) -> None:
    """Write-then-rename, mode 0600: the file holds only hashes, but who exists is still the operator's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, json.dumps(data, indent=1).encode(), 0o600)


def issue(path: str | Path, name: str, role: str, tenant: str = "", commands: Sequence[str] = (),
          max_priority: int = 0) -> str:
    """Add a token for ``name`` to the file and return it (the only time it is shown)."""
    path = Path(path)
    data = _read(path)
    if any(t["name"] == name and not t.get("revoked") for t in data["tokens"]):
        raise ConfigError(f"{path}: an active token named {name!r} exists (revoke it first)")
    token = new_token()
    entry = {"name": name, "role": role, "tenant": tenant, "commands": list(commands), "max_priority": max_priority,
             "sha256": token_hash(token), "created_unix_s": round(time.time(), 3)}
    _identity(entry, f"token {name!r}")  # validate before writing
    data["tokens"].append(entry)
    _write(path, data)
    return token


def revoke(path: str | Path, name: str) -> int:
    """Mark every token named ``name`` revoked; returns how many were."""
    path = Path(path)
    data = _read(path)
    n = 0
    for t in data["tokens"]:
        if t["name"] == name and not t.get("revoked"):
            t["revoked"], t["revoked_unix_s"] = True, round(time.time(), 3)
            n += 1
    _write(path, data)
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m elastico.auth", description="Manage the Allocator API's bearer tokens.")
    ap.add_argument("--file", required=True, help="the tokens file (ELASTICO_AUTH_TOKENS_FILE of the allocator)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("issue", help="create a token and print it once")
    p.add_argument("--name", required=True)
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--tenant", default="")
    p.add_argument("--allow-command", action="append", default=[], metavar="PREFIX",
                   help="an executable or argv prefix this identity may run ('*' = any); repeatable")
    p.add_argument("--max-priority", type=int, default=0,
                   help=f"highest job priority a tenant token may submit, 0-{L.PRIORITY_MAX} (default 0: normal at most)")
    r = sub.add_parser("revoke", help="revoke every token of a name")
    r.add_argument("--name", required=True)
    sub.add_parser("list", help="names, roles and tenants (never the tokens)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "issue":
            print(issue(args.file, args.name, args.role, args.tenant, args.allow_command, args.max_priority))
        elif args.cmd == "revoke":
            n = revoke(args.file, args.name)
            print(f"revoked {n} token(s) named {args.name!r}")
            return 0 if n else 1
        else:
            for t in _read(Path(args.file))["tokens"]:
                state = "revoked" if t.get("revoked") else "active"
                print(f"{t['name']:<20} {t['role']:<9} {t.get('tenant', ''):<16} {state:<8} commands={t.get('commands', [])} max_priority={t.get('max_priority', 0)}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
