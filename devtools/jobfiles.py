"""Job files of ``elastico submit -f``: YAML/JSON documents read safely and validated as the allocator
validates a spec, every problem a :class:`UsageError` saying ``FILE:LINE: FIELD: problem``."""

from __future__ import annotations

import json
import os
import stat
import sys

import yaml

from elastico import domain as d
from elastico.errors import InvalidSpec
from elastico.specs import spec_from_dict

MAX_SPEC_FILE_BYTES = 4 << 20  # a job file larger than this is refused (specs are a few KiB each)


class UsageError(Exception):
    """Bad input detected here (exit 2); the message says what and where."""


def _segments(field: str) -> list[str | int]:
    """``spec.shapes[0].mem_mib`` -> ["shapes", 0, "mem_mib"]; ``spec.labels["k"]`` -> ["labels", "k"]."""
    out: list[str | int] = []
    i, n = 0, len(field)
    token = ""
    while i < n:
        c = field[i]
        if c == ".":
            if token:
                out.append(token)
            token = ""
        elif c == "[":
            if token:
                out.append(token)
            token = ""
            j = field.index("]", i) if "]" in field[i:] else n
            inner = field[i + 1:j]
            out.append(int(inner) if inner.isdigit() else json.loads(inner) if inner.startswith('"') else inner)
            i = j
        else:
            token += c
        i += 1
    if token:
        out.append(token)
    return out[1:] if out and out[0] == "spec" else out


def _line_of(node: yaml.Node | None, field: str) -> int | None:
    """The 1-based line of ``field`` in the composed document (its deepest existing ancestor for a missing one)."""
    if node is None:
        return None
    line = node.start_mark.line + 1
    for seg in _segments(field):
        if isinstance(node, yaml.MappingNode):
            hit = next(((k, v) for k, v in node.value if k.value == seg or (isinstance(seg, int) and k.value == str(seg))), None)
            if hit is None:
                return line
            line, node = hit[0].start_mark.line + 1, hit[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(seg, int) and seg < len(node.value):
            node = node.value[seg]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _duplicate_keys(node: yaml.Node, path: str = "spec", visited: set[int] | None = None) -> tuple[str, int] | None:
    """The first repeated mapping key (YAML keeps the last silently; a job file should not). Each node is
    walked once: an alias shares its anchor's node, so a self-referring or nested-alias file stays linear."""
    visited = set() if visited is None else visited
    if id(node) in visited:
        return None
    visited.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for k, v in node.value:
            sub = f"{path}.{k.value}"
            if k.value in seen:
                return sub, k.start_mark.line + 1
            seen.add(k.value)
            dup = _duplicate_keys(v, sub, visited)
            if dup:
                return dup
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            dup = _duplicate_keys(v, f"{path}[{i}]", visited)
            if dup:
                return dup
    return None


def _read_spec_file(path: str) -> str:
    """A job file's text: a regular file (or stdin) of at most ``MAX_SPEC_FILE_BYTES``, UTF-8."""
    try:
        if path == "-":
            raw = sys.stdin.buffer.read(MAX_SPEC_FILE_BYTES + 1)
        else:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # opening a FIFO must not wait for a writer
            with os.fdopen(fd, "rb") as fh:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise UsageError(f"{path}: not a regular file")
                raw = fh.read(MAX_SPEC_FILE_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_SPEC_FILE_BYTES:
        raise UsageError(f"{path}: larger than {MAX_SPEC_FILE_BYTES >> 20} MiB; a job file holds specs, not data")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def load_specs(path: str) -> list[d.JobSpec]:
    """Every job spec of a YAML/JSON file (one per ``---`` document), validated as the allocator validates it.

    Raises:
        UsageError: ``FILE:LINE: FIELD: problem`` for the first bad field; syntax errors with their line.
    """
    text = _read_spec_file(path)
    name = "<stdin>" if path == "-" else path
    try:
        nodes = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
        docs = list(yaml.safe_load_all(text))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f":{mark.line + 1}" if mark is not None else ""
        raise UsageError(f"{name}{where}: not valid YAML/JSON: {exc.problem or exc}") from None
    except (yaml.YAMLError, RecursionError):
        raise UsageError(f"{name}: not valid YAML/JSON for a job file (nested too deep)") from None
    specs = []
    for node, doc in zip(nodes, docs, strict=True):
        if doc is None:
            continue
        dup = _duplicate_keys(node)
        if dup:
            raise UsageError(f"{name}:{dup[1]}: {dup[0]}: given twice")
        try:
            specs.append(spec_from_dict(doc))
        except InvalidSpec as exc:
            line = _line_of(node, exc.field)
            raise UsageError(f"{name}{f':{line}' if line else ''}: {exc}") from None
    if not specs:
        raise UsageError(f"{name}: no job spec in the file")
    return specs
