"""ElastiCo's memo caches, in one place: what a pass may reuse from an earlier round instead of recomputing.

Each entry is keyed on what the cached answer reads, so a hit returns what the computation would (the
inference pass's names its co-tenants by row only: see :meth:`PolicyMemo.new_round`): the signatures of the
last pass that decided nothing (a repeat of it would decide nothing again), the placement state of the last
training pass (joins included), and the GPU-count tables of the type table in use. Keys name jobs by their
rows, so :meth:`PolicyMemo.new_round` drops the training passes' memos when a row holds another job than last
round (the live allocator's rows are positions) and the count tables when the type table's content differs;
:meth:`PolicyMemo.estimate_changed` drops what a corrected estimate invalidates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from services.allocator.policy.placement import TenantState


class TypeRows:
    """A table with one row per (job type, requested GPU count), built once per row and stacked, so that a
    pass reads the rows of many jobs with one fancy index instead of a lookup per distinct pair."""

    def __init__(self, pads: tuple) -> None:
        self.pads = pads  # per column: the value padding a row shorter than the widest (its dtype: the column's)
        self.clear()

    def clear(self) -> None:
        """Forget every row (the type table changed)."""
        self.index = np.full((0, 0), -1, np.int64)  # [type, requested count] -> row; -1 = not built
        self.built: list[tuple] = []
        self.stack: tuple[np.ndarray, ...] | None = None

    def lookup(self, types: np.ndarray, reqs: np.ndarray,
               build: Callable[[int, int], tuple]) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
        """(the stacked columns [R, K], the row of each job): ``build(type, req)`` gives a row's columns."""
        types, reqs = np.asarray(types, np.int64), np.asarray(reqs, np.int64)
        if len(types):
            shape = (max(self.index.shape[0], int(types.max()) + 1), max(self.index.shape[1], int(reqs.max()) + 1))
            if shape != self.index.shape:
                grown = np.full(shape, -1, np.int64)
                grown[: self.index.shape[0], : self.index.shape[1]] = self.index
                self.index = grown
        rows = self.index[types, reqs]
        if (rows < 0).any():
            for t, n in sorted(set(zip(types[rows < 0].tolist(), reqs[rows < 0].tolist()))):
                self.index[t, n] = len(self.built)
                self.built.append(build(t, n))
            self.stack = None
            rows = self.index[types, reqs]
        if self.stack is None:
            width = max((len(b[0]) for b in self.built), default=0)
            self.stack = tuple(np.array([list(b[k]) + [pad] * (width - len(b[k])) for b in self.built],
                                        np.asarray(pad).dtype).reshape(len(self.built), width)
                               for k, pad in enumerate(self.pads))
        return self.stack, rows


@dataclass
class PolicyMemo:
    """Memo caches of one policy instance (driven by the view's clock, so simulated runs stay deterministic)."""

    counts: dict = field(default_factory=dict)  # (type, requested GPUs) -> count table / shrink row of `types`
    # the count tables (counts ascending, speeds) and shrink rows (counts, feasible, speeds) of `counts`, stacked
    tables: TypeRows = field(default_factory=lambda: TypeRows((0, 1.0)))
    shrinks: TypeRows = field(default_factory=lambda: TypeRows((0, False, 1.0)))
    types: object = None  # the type table the count tables were built from
    types_key: tuple | None = None  # its content (the live allocator's views arrive as copies, one a round)
    job_ids: tuple | None = None  # the rows' job identities the pass memos were keyed on (JobTable.job_ids)
    idle: tuple | None = None  # (raw, filtered) state of the last round whose training pass placed nothing
    services: tuple | None = None  # (whole cluster, services' GPUs) of the last round whose inference pass changed nothing
    services_recheck_s: float = np.inf  # when a deferred inference shrink becomes due (the services key expires), s
    slack: tuple | None = None  # state of the last slack pass that placed nobody
    defrag: tuple | None = None  # state of the last defragmentation pass that moved nobody
    regrow: tuple | None = None  # (state, remaining times) of the last growth pass with no offer
    state: tuple[tuple, TenantState] | None = None  # (inputs, TenantState) of the last training placement state

    def new_round(self, view) -> None:
        """Drop what the round's view invalidates: the training passes' memos when a row holds another job than
        when they were keyed, the count tables (and the growth pass's memo, which reads them) when the type
        table's content differs. The inference pass's memo is kept across identity changes (why, and what is
        open about it: docs/results.md, "Row identities in the live view")."""
        ids = view.jobs.job_ids
        if ids is not None and ids != self.job_ids:
            self.idle = self.slack = self.defrag = self.regrow = None
            self.job_ids = ids
        types = view.types
        if types is self.types:
            return
        key = (types.names, None if types.scale_tput is None else types.scale_tput.tobytes(),
               None if types.scale_measured is None else types.scale_measured.tobytes())
        if key != self.types_key:
            self.counts.clear()
            self.tables.clear()
            self.shrinks.clear()
            self.regrow = None
            self.types_key = key
        self.types = types

    def estimate_changed(self) -> None:
        """The pair estimate was corrected: the passes that placed nothing may place now."""
        self.idle = self.services = None

    def count(self, key: tuple, build: Callable[[], tuple]) -> tuple:
        """The count-table entry ``key``, built once."""
        hit = self.counts.get(key)
        if hit is None:
            hit = self.counts[key] = build()
        return hit

    def tenant_state(self, M: np.ndarray, kappa: float, jobs, rows: np.ndarray, gj_rows: np.ndarray,
                     gs_rows: np.ndarray, unlimited_training: bool = True) -> TenantState:
        """Placement state of GPUs ``rows`` (tenant slots ``gj_rows``, ``gs_rows``).

        A :class:`TenantState` and its cached joins are a function of the tenants' ids, types, kinds,
        utilisations, forecasts and shares (and of the estimate ``M``): when they are all as when the last
        state was built and it has not placed anyone since (:meth:`state_changed`) -- a round after an
        arrival or after a round that placed nobody -- that state is returned again, joins included.
        """
        tj = np.where(gj_rows >= 0, gj_rows, 0)
        key = (rows.tobytes(), gj_rows.tobytes(), gs_rows.tobytes(), jobs.type_idx[tj].tobytes(),
               jobs.kind[tj].tobytes(), jobs.solo_util[tj].tobytes(), jobs.load_forecast[tj].tobytes())
        hit = self.state
        same_model = hit is not None and hit[1].jobs is jobs and hit[1].M is M and hit[1].kappa == kappa
        if same_model and hit is not None and hit[0] == key:  # (same_model implies hit; restated for mypy)
            return hit[1]
        state = TenantState(M, kappa, gj_rows, gs_rows, jobs, True, unlimited_training)
        self.state = (key, state)
        return state

    def state_changed(self) -> None:
        """The cached placement state placed a job: no longer what its key says."""
        self.state = None
