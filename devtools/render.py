"""How the ``elastico`` command line prints: domain objects as JSON/YAML data, kubectl-style tables and ages, and
the job list (devtools.cli's commands call these; nothing here reads or writes anything but stdout)."""

from __future__ import annotations

import dataclasses
import enum
import json
import shutil
import time
from collections.abc import Iterable, Sequence
from typing import Any

import yaml

from elastico import domain as d


def plain(obj: Any) -> Any:
    """Domain objects as JSON/YAML-ready data (enums by value, labels as a mapping)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            out[f.name] = dict(v) if f.name == "labels" else plain(v)
        return out
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    return obj


def dump(data: Any, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(data, indent=2)
    return yaml.safe_dump(data, sort_keys=False).rstrip()


def width() -> int:
    return max(80, min(shutil.get_terminal_size((120, 24)).columns, 160))


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], flex: int = -1, limit: int | None = None) -> str:
    """Left-aligned columns two spaces apart, kubectl style; the ``flex`` column is cut so a line fits ``limit``."""
    rows = [[str(c) for c in r] for r in rows]
    cols = [list(header), *rows]
    widths = [max(len(r[i]) for r in cols) for i in range(len(header))]
    limit = limit or width()
    total = sum(widths) + 2 * (len(widths) - 1)
    if total > limit and rows:
        i = flex % len(widths)
        widths[i] = max(len(header[i]), widths[i] - (total - limit))
    lines = []
    for r in cols:
        cells = [c if len(c) <= w else c[:max(w - 1, 0)] + "~" for c, w in zip(r, widths, strict=True)]
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
    return "\n".join(lines)


def age(t: float, now: float | None = None) -> str:
    """Elapsed time since ``t`` as kubectl prints it: 45s, 12m, 5h, 3d."""
    if not t:
        return "-"
    s = max(0.0, (now or time.time()) - t)
    if s >= 2 * 86400:
        return f"{int(s // 86400)}d"
    if s >= 2 * 3600:
        return f"{int(s // 3600)}h"
    if s >= 120:
        return f"{int(s // 60)}m"
    return f"{int(s)}s"


def _gpus(job: d.Job) -> str:
    if job.placement is not None:
        s = job.placement.shape
        return f"{s.num_gpus}x{s.compute_share_pct:g}%"
    if job.spec.shapes:
        return "/".join(f"{s.num_gpus}x{s.compute_share_pct:g}%" for s in job.spec.shapes[:2]) + ("/..." if len(job.spec.shapes) > 2 else "")
    return "auto"


def _nodes_of(job: d.Job) -> str:
    if job.placement is None:
        return "-"
    return ",".join(sorted({f"{s.node_id}:{s.gpu_index}" for s in job.placement.slices}))


def job_rows(jobs: Iterable[d.Job], wide: bool) -> tuple[list[str], list[list[str]]]:
    header = ["JOB", "NAME", "TENANT", "KIND", "STATE", "REASON", "GPUS", "NODE", "AGE"]
    if wide:
        header += ["RESTARTS", "PROGRESS", "MESSAGE"]
    now = time.time()
    rows = []
    for j in jobs:
        row = [j.job_id, j.spec.name or "-", j.spec.tenant, j.spec.kind.value, j.state.value, j.reason.value, _gpus(j),
               _nodes_of(j), age(j.submitted_at_s, now)]
        if wide:
            prog = f"{j.progress_steps:.0f}/{j.spec.training.total_steps}" if j.spec.training else "-"
            row += [str(j.restarts), prog, j.message or "-"]
        rows.append(row)
    return header, rows


def print_jobs(jobs: list[d.Job], fmt: str) -> None:
    if fmt in ("json", "yaml"):
        print(dump([plain(j) for j in jobs], fmt))
        return
    header, rows = job_rows(jobs, fmt == "wide")
    print(table(header, rows, flex=-1 if fmt == "wide" else 1))
