"""Files other processes read while they may change: written whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


def replace_file(path: str | Path, data: bytes, mode: int = 0o666) -> None:
    """Write-then-rename, with ``mode`` (less the umask) from the start: a reader (a reloading service, a
    supervisor polling for the file) sees the old file or the new one, never half of one."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
