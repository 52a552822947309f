"""Files other processes read while they may change: written whole or not at all."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def replace_file(path: str | Path, data: bytes, mode: int = 0o666, *, group: int | None = None,
                 sync: bool = False) -> None:
    """Write-then-rename: a reader (a reloading service, a supervisor polling for the file, a workload reading
    its rate) sees the old file or the new one, never half of one.

    The file gets ``mode`` less the umask from the start (a stale ``.tmp`` of an earlier crash is replaced, not
    reused with its bits); with ``group``, that group and exactly ``mode`` (what the group must read whatever
    the umask). ``sync``: on disk before the rename, so a crash leaves the old file or the new one."""
    tmp = f"{path}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        if group is not None:
            os.fchown(fd, -1, group)
            os.fchmod(fd, mode)
        f.write(data)
        if sync:
            f.flush()
            os.fsync(fd)
    os.replace(tmp, path)
    if sync:  # the rename itself
        try:
            dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:  # pragma: no cover - some filesystems refuse directory fsync
            pass
