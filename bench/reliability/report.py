"""The summary table and the verdict: correctness gates the exit status, speed and memory are judged in full runs."""

from __future__ import annotations

from dataclasses import dataclass

from bench.reliability.faults import Faults
from bench.reliability.hostile import HostileResult
from bench.reliability.jobs import Audit
from bench.reliability.live import say
from bench.reliability.probes import TARGET_CS_P50_S
from bench.reliability.sampler import SamplerCounts


@dataclass
class Outcome:
    """What every phase of one run measured."""

    hostile: dict[str, HostileResult]
    first: Audit  # the audit right after the concurrent submissions
    faults: Faults
    counts: SamplerCounts
    rss_rows: list[tuple[str, float, float, bool]]  # (process, growth MiB, bound MiB, within the bound)
    p50: float
    p99: float
    total_jobs: int
    healthy: dict[str, str]


def summary(o: Outcome, mode: str, smoke: bool, elapsed_s: float) -> bool:
    """Print the table; True when no UNKNOWN, lost, duplicated, oversubscribed or twice-running was seen."""
    hostile, first, f, counts = o.hostile, o.first, o.faults, o.counts
    assert f.final is not None  # faults() always ends with an audit
    unknown = sum(r.codes["UNKNOWN"] for r in hostile.values())
    internal = sum(r.codes["INTERNAL"] for r in hostile.values())
    lost = max(first.lost, f.final.lost)
    duplicated = max(first.duplicated, f.final.duplicated)
    judge = (lambda ok: "smoke: not judged") if smoke else (lambda ok: "PASS" if ok else "FAIL")
    gate = lambda ok: "PASS" if ok else "FAIL"  # noqa: E731 - correctness: judged in both modes, sets the exit code
    rows = [
        ("hostile: UNKNOWN (all services)", str(unknown), "0", gate(unknown == 0)),
        ("hostile: INTERNAL (all services)", str(internal), "0", judge(internal == 0) if internal else "PASS"),
        ("concurrency: duplicated request ids", str(duplicated), "0", gate(duplicated == 0)),
        ("concurrency: lost acknowledged jobs", str(lost), "0", gate(lost == 0)),
        ("concurrency: created=true twice", str(first.created_twice), "0", gate(first.created_twice == 0)),
        ("faults: oversubscribed GPU-samples", str(counts.oversubscribed), "0", gate(counts.oversubscribed == 0)),
        ("faults: workloads running twice", str(counts.running_twice), "0", gate(counts.running_twice == 0)),
        ("faults: all jobs terminal or running", "yes" if f.settled_s is not None else "no", "yes",
         judge(f.settled_s is not None)),
        *((f"RSS growth {name}", f"{g:+.1f} MiB", f"<= {b:.0f} MiB", judge(ok)) for name, g, b, ok in o.rss_rows),
        (f"GetClusterState p50 ({o.total_jobs} jobs)", f"{o.p50 * 1e3:.1f} ms", f"<= {TARGET_CS_P50_S * 1e3:.0f} ms",
         judge(o.p50 <= TARGET_CS_P50_S)),
        ("GetClusterState p99", f"{o.p99 * 1e3:.1f} ms", "-", "info"),
        ("health after everything", ", ".join(sorted(set(o.healthy.values()))), "SERVING/PONG",
         judge(all(v in ("SERVING", "PONG") for v in o.healthy.values()))),
    ]
    say(f"\nSUMMARY [{mode}] ({elapsed_s:.0f} s)")
    say(f"  {'check':<42} {'value':>16}  {'target':>14}  verdict")
    for name, value, target, verdict in rows:
        say(f"  {name:<42} {value:>16}  {target:>14}  {verdict}")
    correct = unknown == 0 and lost == 0 and duplicated == 0 and counts.oversubscribed == 0 and counts.running_twice == 0
    say(f"correctness: {'PASS' if correct else 'FAIL'} (UNKNOWN, lost, duplicated, oversubscribed, running twice)")
    return correct
