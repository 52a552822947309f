"""The one validator of a :class:`Decision` against the :class:`ClusterView` it answers. Pure, no I/O.

Both front ends call :func:`check` first and apply only what it accepts: the simulator
(``simulator.engine.Engine``) and the live allocator (``services.allocator.plan.translate``, which then
re-checks memory and share against the store's committed usage, something the view does not carry). Every
constraint checked here is in the view, and every policy honours it, so a policy's decision is accepted
whole; a rejection is a policy bug (the simulator refuses to go on, the live allocator logs and drops it).

Application order, as both front ends apply it: preemptions, then resizes, then placements in order.

* preemption: a running job (duplicates are one);
* resize: a running job not preempted by the same decision, to a share in (0, 100] that is one of its declared
  shares on its GPUs (a job declaring shapes), fitting each of its GPUs next to the other tenants (a resize to
  the share it has is nothing to do and is left out);
* placement: a pending job (or one the decision preempts: a relaunch), once; distinct GPU rows of the view, all
  among the job's allowed GPUs (``JobTable.allowed_gpus``); a GPU count it may run at
  (:func:`shapes.sizes_of`); a gang that keeps the node topology (:meth:`Topology.gang_ok`); a share in (0, 100]
  that is a declared shape on that count (a job declaring shapes); a free tenant slot and the share free on every
  GPU after the preemptions, the resizes and the placements before it.

A rejected relaunch (a placement of a job the decision also preempts) takes its preemption with it: the job keeps
running where it is rather than being requeued, and whatever was to use its GPUs is checked without them.
"""

from __future__ import annotations

import math

import numpy as np

from services.allocator.policy.shapes import declared_matches, shapes_of, sizes_of
from services.allocator.policy.view import ClusterView, Decision

_TOL = 1e-6  # share percent a GPU may exceed 100 by (float sums of several tenants)


def check(decision: Decision, view: ClusterView) -> tuple[Decision, list[tuple[int, str]]]:
    """Split ``decision`` into what may be applied to ``view`` and what may not (see the module docstring).

    Returns:
        (the accepted decision, in the given order, with the same ``info``; [(job row, why)] of what is not).
    """
    if not (decision.preempt or decision.resize or decision.place):
        return decision, []
    jobs = view.jobs
    N = len(jobs.kind)
    rejected: list[tuple[int, str]] = []
    running = np.zeros(N, bool)
    running[view.running] = True
    pending = np.zeros(N, bool)
    pending[view.pending] = True

    def row_ok(r) -> bool:
        return isinstance(r, (int, np.integer)) and 0 <= int(r) < N

    preempt: list[int] = []
    for r in dict.fromkeys(decision.preempt):
        if not row_ok(r):
            rejected.append((r, "preempted job row out of range"))
        elif not running[int(r)]:
            rejected.append((int(r), "preempted while not running"))
        else:
            preempt.append(int(r))
    gone = set(preempt)
    resize: list[tuple[int, float]] = []
    for r, sh in dict(decision.resize).items():
        why = _resize_error(view, r, sh, row_ok(r) and running[int(r)], gone)
        if why:
            rejected.append((int(r) if row_ok(r) else r, why))
        elif abs(float(jobs.share_pct[int(r)]) - float(sh)) >= 1e-9:
            resize.append((int(r), float(sh)))
    place: list = []
    placed: set[int] = set()
    for p in decision.place:
        r, g, sh = p
        why = _place_error(view, r, g, sh, row_ok(r) and (pending[int(r)] or int(r) in gone), placed)
        if why:
            rejected.append((int(r) if row_ok(r) else r, why))
            if row_ok(r) and int(r) in gone and int(r) not in placed:
                preempt.remove(int(r))  # the relaunch is off: the job keeps running where it is
                gone.discard(int(r))
            continue
        placed.add(int(r))
        place.append(p)
    while True:  # capacity, in application order; a refused relaunch reruns without its preemption
        ok_resize, ok_place, refused, withdrawn = _capacity(view, preempt, resize, place)
        if withdrawn is None:
            break
        preempt.remove(withdrawn)
        place = [p for p in place if int(p[0]) != withdrawn]
        rejected.append((withdrawn, refused[-1][1]))
    rejected.extend(refused)
    return Decision(preempt=preempt, resize=ok_resize, place=ok_place, info=decision.info), rejected


def _share_error(sh) -> str:
    """Why ``sh`` is no share a job may hold ("" when it is one)."""
    try:
        v = float(sh)
    except (TypeError, ValueError):
        return f"share {sh!r} is not a number"
    return "" if math.isfinite(v) and 0.0 < v <= 100.0 + _TOL else f"share {v}% outside (0, 100]"


def _resize_error(view: ClusterView, r, sh, running: bool, gone: set[int]) -> str:
    """Why resizing row ``r`` to ``sh`` is refused before capacity is looked at ("" when it is not)."""
    if not running:
        return "resized while not running"
    if int(r) in gone:
        return "resized and preempted in one decision"
    why = _share_error(sh)
    if why:
        return why
    shapes = shapes_of(view.jobs, int(r))
    if shapes and not declared_matches(shapes, len(view.jobs.gpus[int(r)]), float(sh)):
        return f"resize to {float(sh)}% is not among the job's declared shapes"
    return ""


def _place_error(view: ClusterView, r, g, sh, may_place: bool, placed: set[int]) -> str:
    """Why placing row ``r`` on GPU rows ``g`` at ``sh`` is refused before capacity is looked at ("" when it is
    not)."""
    if not may_place:
        return "placed while neither pending nor preempted by the same decision"
    r = int(r)
    if r in placed:
        return "placed twice in one decision"
    gpus = np.atleast_1d(np.asarray(g))
    if gpus.dtype.kind not in "iu" or gpus.ndim != 1 or len(gpus) == 0:
        return f"GPU rows {gpus.tolist()} are not a non-empty list of integers"
    rows = gpus.tolist()
    if min(rows) < 0 or max(rows) >= view.num_gpus:
        return f"GPU rows {rows} out of range (view of {view.num_gpus} GPUs)"
    if len(set(rows)) != len(rows):
        return f"GPU rows {rows} are not distinct"
    why = _share_error(sh)
    if why:
        return why
    jobs = view.jobs
    allowed = None if jobs.allowed_gpus is None else jobs.allowed_gpus[r]
    if allowed is not None and not allowed[gpus].all():
        return f"GPU rows {gpus[~allowed[gpus]].tolist()} are not among the job's allowed GPUs"
    sizes = sizes_of(jobs, view.types, r)
    if len(rows) not in sizes:
        return f"gang of {len(rows)} GPUs: the job runs on {' or '.join(map(str, sizes))}"
    if not view.topo.gang_ok(gpus):
        return f"gang {rows} breaks the node topology (one node, or whole nodes plus one partial)"
    shapes = shapes_of(jobs, r)
    if shapes and not declared_matches(shapes, len(rows), float(sh)):
        return f"{len(rows)} x {float(sh)}% is not among the job's declared shapes"
    return ""


def _capacity(view: ClusterView, preempt: list[int], resize: list[tuple[int, float]], place: list):
    """Apply ``preempt``, ``resize`` and ``place`` (each already valid on its own) to a copy of the tenant slots,
    in that order, keeping what fits.

    Returns:
        (resizes that fit, placements that fit, [(row, why)] refused, the row of the first refused relaunch or
        None): at a refused relaunch it stops, since its preemption must be withdrawn and everything re-checked.
    """
    jobs = view.jobs
    gj, gs = view.scratch()
    if preempt:
        gone = np.isin(gj, preempt)
        gj[gone], gs[gone] = -1, 0.0
    refused: list[tuple[int, str]] = []
    ok_resize = []
    for r, sh in resize:
        rows = jobs.gpus[r]
        mine = gj[rows] == r
        over = gs[rows].sum(axis=1) - np.where(mine, gs[rows], 0.0).sum(axis=1) + sh > 100.0 + _TOL
        if over.any():
            refused.append((r, f"resize to {sh}% oversubscribes GPU rows {rows[over].tolist()}"))
            continue
        sub = gs[rows]
        sub[mine] = sh
        gs[rows] = sub
        ok_resize.append((r, sh))
    withdrawn = set(preempt)
    ok_place: list = []  # as ``place``: the decision's entries, unchanged
    for p in place:
        r, rows, sh = int(p[0]), np.atleast_1d(np.asarray(p[1])), float(p[2])
        empty = gj[rows] < 0
        full = ~empty.any(axis=1)
        over = gs[rows].sum(axis=1) + sh > 100.0 + _TOL
        if full.any() or over.any():
            refused.append((r, f"no free tenant slot on GPU rows {rows[full].tolist()}" if full.any() else
                            f"{sh}% oversubscribes GPU rows {rows[over].tolist()}"))
            if r in withdrawn:
                return ok_resize, ok_place, refused, r
            continue
        k = np.argmax(empty, axis=1)  # the first empty slot of each GPU
        gj[rows, k], gs[rows, k] = r, sh
        ok_place.append(p)
    return ok_resize, ok_place, refused, None
