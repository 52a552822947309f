"""The campaign's workloads and its plan: which points, in which order, how long each is expected to take.

Points are ordered by what the issue needs most (solo baselines, then training+inference and training+training
pairs at two share splits, the isolation checks, client priority, the share curve, extra splits); the runner
skips whatever no longer fits the budget, so a short budget drops the tail of this list, never its head.

A point's tenants are prepared while the point before it measures (``prepared_after``): their start-up up to the
warm-up is hidden behind that point's warm-up, window, tail and teardown, and ``estimate_s`` counts only the rest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Workload:
    """One measured job: a training loop or a served model (``kind`` "train"/"serve"), or a test client."""

    name: str
    kind: str  # "train", "serve", or "probe" (memory hog, fault injector)
    model: str  # model name in the derived tables (Gavel's spelling where it has one)
    batch_size: int  # training batch, or a service's largest batch
    precision: str  # "amp" (bf16 autocast) or "fp32"
    description: str
    fake_rate: float  # --dry-run: steps/s (train) or requests/s capacity (serve) at MPS 100
    fake_util: float  # --dry-run: solo utilisation u, so a fake rate follows min(1, share / u)
    startup_s: float  # expected spawn-to-ready seconds on the GPU (torch import, context, build, warm-up)
    warmup_s: float  # the part of startup_s after the start line: model to the GPU, warm-up, calibration

    @property
    def prepare_s(self) -> float:
        """Spawn to prepared (torch import, CUDA context, model built on the CPU): what can be done ahead."""
        return self.startup_s - self.warmup_s


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("resnet50_amp", "train", "ResNet-50", 64, "amp",
             "ResNet-50 training, batch 64, 224x224 synthetic images, bf16 autocast, channels-last, SGD+momentum",
             400.0, 0.9, 13.0, 9.5),
    Workload("gpt2_amp", "train", "GPT-2", 8, "amp",
             "GPT-2-small LM training (12 layers, d 768, 12 heads, seq 1024), batch 8, bf16 autocast, AdamW",
             300.0, 0.95, 10.5, 6.0),
    Workload("gpt2_fp32", "train", "GPT-2", 4, "fp32",
             "GPT-2-small LM training (12 layers, d 768, 12 heads, seq 512), batch 4, fp32, AdamW", 250.0, 0.7, 11.5, 6.0),
    Workload("bert_serve", "serve", "BERT-base", 16, "amp",
             "BERT-base encoder (12 layers, d 768, seq 128) serving Poisson requests, batches of <= 16, bf16",
             4000.0, 0.5, 6.5, 2.5),
    Workload("decoder_serve", "serve", "GPT-2", 8, "amp",
             "GPT-2-small decoder serving Poisson requests: 64-token prompt + 16 generated tokens (KV cache), "
             "batches of <= 8, bf16", 1500.0, 0.3, 15.5, 11.0),
    Workload("cnn_serve", "serve", "ResNet-18", 8, "amp",
             "ResNet-18 small-batch image inference serving Poisson requests, batches of <= 8, bf16", 8000.0, 0.25,
             8.5, 5.0),
    Workload("memhog", "probe", "memhog", 0, "fp32",
             "tries to allocate twice its pinned MPS memory limit (the limit must fail it, alone)", 0.0, 0.1, 4.0, 0.2),
    Workload("fault", "probe", "fault", 0, "fp32",
             "raises a fatal GPU fault (device-side assert) a third into the window", 0.0, 0.1, 4.0, 0.2),
)}

TRAIN = tuple(w for w, x in WORKLOADS.items() if x.kind == "train")
SERVE = tuple(w for w, x in WORKLOADS.items() if x.kind == "serve")
PAIR_TRAIN = ("resnet50_amp", "gpt2_amp")  # the training side of training+inference pairs
TT_PAIRS = (("resnet50_amp", "gpt2_amp"), ("gpt2_amp", "gpt2_fp32"))
CORE_SPLITS = ((100, 100), (50, 50))
EXTRA_SPLITS = ((70, 30), (30, 70))
SOLO_SHARES = (100, 50, 25, 10, 75)  # 100 is the solo baseline; 75 runs last (the curve's least informative point)
MEMHOG_LIMIT_MIB = 2048  # pinned limit of the memory hog; it asks for twice as much
DEFAULT_WINDOW_S, QUICK_WINDOW_S, DRY_WINDOW_S = 2.5, 1.5, 0.05
SEARCH_STEPS = 3  # rate-search sub-windows of a serving tenant after its window
DRY_STARTUP_SCALE = 0.05  # --dry-run: a fake worker sleeps this fraction of its prepare_s before 'prepared'
TEARDOWN_S, DRY_TEARDOWN_S = 1.5, 0.1  # result, process and CUDA context exit after the tail
FAULT_TAIL_S = 1.0  # the fault point's co-tenants keep running this long past the window (unless the fault ends them)
DRY_SPAWN_S = 0.1  # --dry-run: a fake worker's interpreter start before its prepare sleep


@dataclass(frozen=True)
class Point:
    """One planned measurement: its stage, label, tenants ``(workload, MPS share, client priority or None)``."""

    stage: str
    label: str
    tenants: tuple[tuple[str, int, int | None], ...]
    kind: str = "measure"  # "measure", "memlimit", "fault", "recovery"

    @property
    def serves(self) -> bool:
        return any(WORKLOADS[w].kind == "serve" for w, _, _ in self.tenants)

    def tail_s(self, tail: float) -> float:
        """Seconds the tenants run past the window: ``tail`` for a service's rate search; at least
        ``FAULT_TAIL_S`` beside a fault, so the fault (the dry run's simulated one too) lands while they run."""
        if self.serves:
            return tail
        return max(tail, FAULT_TAIL_S) if self.kind == "fault" else 0.0


def _pair(stage: str, a: str, b: str, sa: int, sb: int, prio: bool = False) -> Point:
    pa, pb = (1, 0) if prio else (None, None)
    tag = " prio train=1 serve=0" if prio else ""
    return Point(stage, f"{a}+{b} @{sa}/{sb}{tag}", ((a, sa, pa), (b, sb, pb)))


def build_plan(quick: bool) -> list[Point]:
    """Every point in running order (``quick``: a smoke subset of each stage)."""
    pts = [Point("solo", f"{w} @100", ((w, 100, None),)) for w in TRAIN + SERVE]
    train_side = PAIR_TRAIN[:1] if quick else PAIR_TRAIN
    for sa, sb in CORE_SPLITS:
        pts += [_pair("pairs", t, s, sa, sb) for t in train_side for s in SERVE]
        pts += [_pair("pairs", a, b, sa, sb) for a, b in (TT_PAIRS[:1] if quick else TT_PAIRS)]
    pts += [Point("isolation", f"memhog @50 (limit {MEMHOG_LIMIT_MIB} MiB) + resnet50_amp @50",
                  (("memhog", 50, None), ("resnet50_amp", 50, None)), "memlimit"),
            Point("isolation", "fault @50 + resnet50_amp @50", (("fault", 50, None), ("resnet50_amp", 50, None)),
                  "fault"),
            Point("isolation", "recovery cnn_serve @100", (("cnn_serve", 100, None),), "recovery")]
    pts += [_pair("priority", "gpt2_amp", "bert_serve", 100, 100, prio=True)]
    if not quick:
        pts += [_pair("priority", "resnet50_amp", "cnn_serve", 100, 100, prio=True)]
    for share in SOLO_SHARES[1:2] if quick else SOLO_SHARES[1:]:
        pts += [Point("shares", f"{w} @{share}", ((w, share, None),)) for w in TRAIN + SERVE]
    if not quick:
        pts += [_pair("splits", t, s, sa, sb) for sa, sb in EXTRA_SPLITS for t in PAIR_TRAIN[:1] for s in SERVE]
    return pts


def select_plan(quick: bool, points: str | None) -> list[Point]:
    """:func:`build_plan`'s points whose ``"STAGE LABEL"`` matches the regular expression ``points`` (``re.search``;
    None: all); ``re.error`` for an invalid expression."""
    return [p for p in build_plan(quick) if points is None or re.search(points, f"{p.stage} {p.label}")]


def prepared_after(prev: Point | None) -> bool:
    """Whether a point's tenants are started while ``prev`` measures: not the first, not after a fault point
    (a fatal fault ends every client of the GPU's MPS server, prepared ones too; the recovery client comes after)."""
    return prev is not None and prev.kind != "fault"


def _startup_parts(p: Point, dry: bool) -> tuple[float, float]:
    """(prepare, warm-up) seconds of a point's slowest tenants."""
    prep = max(DRY_SPAWN_S + DRY_STARTUP_SCALE * WORKLOADS[w].prepare_s if dry else WORKLOADS[w].prepare_s
               for w, _, _ in p.tenants)
    return prep, (0.05 if dry else max(WORKLOADS[w].warmup_s for w, _, _ in p.tenants))


def estimate_s(p: Point, window: float, tail: float, dry: bool, prev: Point | None = None) -> float:
    """Expected seconds of one point: the start-up not hidden behind ``prev``, warm-up, window, tail, teardown.

    Prepared during ``prev`` (``prepared_after``), a point waits only for what of its prepare time outlasts
    ``prev``'s own warm-up, window, tail and teardown; otherwise (``prev`` None or a fault) for all of it.
    """
    prep, warm = _startup_parts(p, dry)
    teardown = DRY_TEARDOWN_S if dry else TEARDOWN_S
    if prepared_after(prev):
        assert prev is not None
        busy = _startup_parts(prev, dry)[1] + window + prev.tail_s(tail) + teardown
        prep = max(0.0, prep - busy)
    return round(prep + warm + window + p.tail_s(tail) + teardown, 2)


def tenant_rate(t: dict[str, Any]) -> float | None:
    """A measured tenant's rate (a report's tenant record): steps/s, or for a service the highest rate it served
    within its SLO (None: within it at no rate searched, or the tenant failed)."""
    if t.get("error") or t.get("steps_per_s") is None:
        return None
    if WORKLOADS[t["workload"]].kind == "serve":
        return (t.get("detail") or {}).get("max_rps_within_slo")
    return float(t["steps_per_s"])
