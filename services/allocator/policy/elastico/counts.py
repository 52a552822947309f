"""ElastiCo's GPU-count shapes (``elastic_gpus``; step 6 of the package docstring): the counts a job type
may run at and their speeds, queued gangs on halvings, gangs grown onto idle GPUs and given back."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from services.allocator.policy.elastico.cache import PolicyMemo
from services.allocator.policy.elastico.params import ElastiCoParams
from services.allocator.policy.placement import pick_gang, sub_gang
from services.allocator.policy.shapes import (
    any_declared,
    count_options,
    count_speed,
    declared_counts,
    declared_shares,
    grow_options,
    min_count,
    shapes_of,
    size_allowed,
)
from services.allocator.policy.view import (
    TRAINING,
    ClusterView,
    Decision,
    gpu_mask,
    occupy,
    slot_all,
    vacate,
)


def count_shapes_on(p: ElastiCoParams, view: ClusterView) -> bool:
    """GPU-count shapes are on and the type table has the scaling curves they need."""
    return p.elastic_gpus and view.types.scale_tput is not None


def count_table(memo: PolicyMemo, view: ClusterView, type_idx: int,
                req: int) -> tuple[tuple[int, ...], dict[int, float], tuple[int, ...], tuple[float, ...]]:
    """(allowed counts, count -> speed, allowed counts ascending, their speeds) of a job type at a requested
    gang size, cached per type table."""
    def build() -> tuple:
        measured, scale = view.types.scale_measured, view.types.scale_tput
        assert scale is not None, "GPU-count tables need the type table's scaling curves (count_shapes_on)"
        counts = count_options(req) + grow_options(req, measured[type_idx] if measured is not None else None)
        sp = count_speed(scale[type_idx], np.asarray(counts, float), req)
        speed = dict(zip(counts, sp.tolist()))
        ascending = tuple(sorted(counts))
        return counts, speed, ascending, tuple(speed[c] for c in ascending)

    return memo.count((type_idx, req), build)


def count_tables(memo: PolicyMemo, view: ClusterView, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The count tables of jobs ``idx``: [U, K] counts ascending (0 pads: never a job's count) and their speeds
    (1 pads), one row per (type, requested count) seen so far, and per job the index of its own."""
    jobs = view.jobs
    (cnt, spd), row = memo.tables.lookup(jobs.type_idx[idx], jobs.num_gpus[idx],
                                         lambda t, n: count_table(memo, view, t, n)[2:])
    return cnt, spd, row


def shrink_row(memo: PolicyMemo, view: ClusterView, type_idx: int, req: int, min_count_speed: float) -> tuple:
    """(counts [4], feasible [4], GPU-count speed [4]) of a job type's gang and its halvings (a repeat of the
    gang where there are fewer than three); ``memo.shrinks`` keeps them per type table, type and requested size."""
    counts, speed, _, _ = count_table(memo, view, type_idx, req)
    opts = [c for c in counts if c <= req]  # the gang and its halvings, as count_options gives them
    cnt = opts + [req] * (4 - len(opts))
    ok = [i == 0 or (i < len(opts) and speed[c] >= min_count_speed - 1e-9) for i, c in enumerate(cnt)]
    return cnt, ok, [speed[c] for c in cnt]


def min_gpus(p: ElastiCoParams, view: ClusterView, idx: np.ndarray) -> np.ndarray:
    """Fewest GPUs each job of ``idx`` may start on (its requested gang unless GPU-count shapes are on)."""
    n = view.jobs.num_gpus[idx]
    out = min_count(n) if count_shapes_on(p, view) and p.shrink_gpus else n
    if any_declared(view.jobs):  # a declaring job: its smallest declared count
        out = np.array([min(declared_counts(view.jobs, j)) if shapes_of(view.jobs, j) else o
                        for j, o in zip(np.asarray(idx).tolist(), np.asarray(out).tolist())], np.int64)
    return out


def relaunch(view: ClusterView, gj, gs, d: Decision, j: int, target: np.ndarray) -> None:
    """Restart running job ``j`` on GPUs ``target`` at its share: a preemption and a placement in one round,
    which the engine and the live allocator apply as a resize (one restart)."""
    share = float(view.jobs.share_pct[j])
    vacate(gj, gs, j, view.jobs.gpus[j])
    occupy(gj, gs, j, target, share)
    d.preempt.append(j)
    d.place.append((j, target, share))


def regrow(p: ElastiCoParams, memo: PolicyMemo, view: ClusterView, gj, gs, d: Decision, run: np.ndarray) -> None:
    """Give gangs more GPUs while whole GPUs idle and nobody waits.

    A job running on fewer GPUs than it may use (shrunk under contention, or a scalable type below its
    largest measured count) is relaunched on its GPUs plus empty ones when the time saved
    ``remaining / old speed - remaining / new speed`` exceeds ``expand_gain x restart_s``. Jobs go in
    decreasing speed-up per added GPU; only empty GPUs are added, so no co-tenant is affected. A job placed
    in this same round is offered the same, and then starts on the larger gang (no restart).
    """
    jobs = view.jobs
    run = run[view.now_s - jobs.last_change_s[run] >= p.min_run_s]
    # jobs placed this round and not running yet (share 0) may start grown: {job: (index in d.place, GPUs)}
    fresh = {int(j): (k, np.asarray(g)) for k, (j, g, _) in enumerate(d.place)
             if jobs.kind[j] == TRAINING and jobs.share_pct[j] == 0}
    if len(run) == 0 and not fresh:
        return
    empty = slot_all(gj < 0)  # [G] the GPUs with no tenant (recomputed below after each placement)
    n_empty = int(empty.sum())
    if n_empty == 0:
        return
    gone = set(d.preempt) | {int(j) for j, _ in d.resize}
    cand = np.concatenate([run, np.fromiter(fresh, np.int64, len(fresh))])
    ngpu = np.concatenate([view.held[run], [len(g) for _, g in fresh.values()]]).astype(np.int64)
    # the same jobs on the same gangs as a pass with no offer, none with more work left: none again
    # (a saving only shrinks with the remaining time)
    rem = view.jobs.remaining_est_s[cand]
    key = (cand.tobytes(), ngpu.tobytes(), n_empty, tuple(sorted(gone)), np.isfinite(rem).tobytes())
    if memo.regrow is not None and memo.regrow[0] == key and not (rem > memo.regrow[1]).any():
        return
    offers = _growth_offers(p, memo, view, cand, ngpu, gone, n_empty)
    memo.regrow = None if offers.jobs else (key, rem)
    # pass 1: each job its best saving per added GPU; pass 2: GPUs still idle upgrade jobs, same order
    plan: dict[int, int] = {}
    at: dict[int, int] = {}
    free = n_empty
    for i, (j, cur, best) in enumerate(zip(offers.jobs, offers.cur, offers.best)):
        if free == 0:
            break
        if best - cur <= free:
            plan[j], at[j] = best, i
            free -= best - cur
    for j in plan:
        good = offers.counts[at[j]][offers.good[at[j]]].tolist()
        up = [c for c in good if plan[j] < c <= plan[j] + free]
        if up:
            free -= max(up) - plan[j]
            plan[j] = max(up)
    topo = view.topo
    one_node = topo is not None and not topo.flat
    node_empty = None  # empty GPUs per node, of `empty`
    stale = False  # a placement changed the empty GPUs
    for j, n in plan.items():
        if stale:
            empty, node_empty, stale = slot_all(gj < 0), None, False
        own = fresh[j][1] if j in fresh else np.asarray(jobs.gpus[j])
        allowed = gpu_mask(jobs, j)
        if one_node and allowed is None and n <= topo.max_node:
            # a gang of one node needs a node with n of its own and empty GPUs: without one, no placement
            if node_empty is None:
                node_empty = np.bincount(topo.gpu_node[empty], minlength=topo.num_nodes)
            own_nodes, own_n = np.unique(topo.gpu_node[own], return_counts=True)
            if max(int(node_empty.max()), int((node_empty[own_nodes] + own_n).max())) < n:
                continue
        # its own GPUs plus empty ones, kept in the topology (own GPUs first: the gang stays where it is
        # when its node has room)
        mask = empty.copy()
        mask[own] = True
        keep = np.zeros(len(mask))
        keep[own] = 1.0
        target = pick_gang(keep, mask, n, topo, allowed=allowed)
        if target is None:
            continue
        stale = True
        if j in fresh:  # placed this round: launch it on the larger gang straight away (no restart)
            k = fresh[j][0]
            share = float(d.place[k][2])
            vacate(gj, gs, j, own)
            occupy(gj, gs, j, target, share)
            d.place[k] = (j, target, share)
            continue
        relaunch(view, gj, gs, d, j, target)


class GrowthOffers(NamedTuple):
    """:func:`regrow`'s offers in their order: per job, its current count, the count of best saving per added
    GPU, and its count table (ascending) with the counts worth growing to marked."""

    jobs: list[int]
    cur: list[int]
    best: list[int]
    counts: np.ndarray  # [O, K]
    good: np.ndarray  # [O, K] bool


NO_OFFERS = GrowthOffers([], [], [], np.zeros((0, 0), np.int64), np.zeros((0, 0), bool))


def _growth_offers(p: ElastiCoParams, memo: PolicyMemo, view: ClusterView, cand: np.ndarray, cur: np.ndarray,
                   gone: set, n_empty: int) -> GrowthOffers:
    """:func:`regrow`'s offers: each job of ``cand`` (running on ``cur`` GPUs) that saves more than ``expand_gain``
    restarts on at most ``n_empty`` more GPUs, in decreasing speed-up per added GPU (then job id).

    A gang's saving on ``c`` GPUs is ``remaining / speed(cur) - remaining / speed(c)`` minus the restart
    cost; all candidates are judged at once on their count tables (:func:`count_table`) side by side.
    """
    jobs = view.jobs
    rem = jobs.remaining_est_s[cand]
    ok = (cur > 0) & np.isfinite(rem)
    if gone:
        ok &= ~np.isin(cand, np.fromiter(gone, np.int64, len(gone)))
    if not ok.any():
        return NO_OFFERS
    cnt_u, spd_u, row = count_tables(memo, view, cand)
    ok &= cnt_u.max(axis=1)[row] > cur  # room to grow at all
    if not ok.any():
        return NO_OFFERS
    keep = np.flatnonzero(ok)
    cand, cur, rem, row = cand[keep], cur[keep], rem[keep], row[keep]
    cnt, spd = cnt_u[row], spd_u[row]
    at_cur = cnt == cur[:, None]
    ok = at_cur.any(axis=1)
    bigger = ok[:, None] & (cnt > cur[:, None]) & (cnt <= cur[:, None] + n_empty)
    if jobs.gang_sizes is not None:
        bigger &= np.array([[size_allowed(jobs, j, c) for c in counts] for j, counts in zip(cand.tolist(), cnt.tolist())],
                           bool).reshape(cnt.shape)
    if any_declared(jobs):  # a declaring job grows only to a count on which it declares the share it runs at
        for i, j in enumerate(cand.tolist()):
            if shapes_of(jobs, j):
                share = float(jobs.share_pct[j])  # (0 for a job placed this round: it starts as placed)
                bigger[i] &= [share > 0 and any(abs(x - share) < 1e-6 for x in declared_shares(jobs, j, c))
                              for c in cnt[i].tolist()]
    s_cur = np.where(at_cur, spd, 0.0).sum(axis=1)
    s_cur[~ok] = 1.0
    r = np.where(ok, rem, 0.0)[:, None]
    added = np.where(bigger, cnt - cur[:, None], 1)
    saving = r / s_cur[:, None] - r / spd - p.expand_gain * p.restart_s
    good = bigger & (saving > 0)
    offer = np.flatnonzero(good.any(axis=1))
    if len(offer) == 0:
        return NO_OFFERS
    per_gpu = np.where(good, (spd / s_cur[:, None] - 1.0) / added, -np.inf).max(axis=1)
    best = np.argmax(np.where(good, saving / added, -np.inf), axis=1)
    offer = offer[np.lexsort((cand[offer], -per_gpu[offer]))]
    return GrowthOffers(cand[offer].tolist(), cur[offer].tolist(), cnt[offer, best[offer]].tolist(), cnt[offer],
                        good[offer])


def give_back(p: ElastiCoParams, view: ClusterView, gj, gs, W, d: Decision, waiting: np.ndarray) -> bool:
    """Jobs are waiting: shrink gangs grown beyond their request back to it (their first GPUs) -- those that
    weigh less than the waiting jobs they make room for (a short job keeps its extra GPUs over long ones)
    and that have run ``min_run_s`` since their last change, lightest first, and only until the empty and
    freed GPUs cover the gangs of the waiting jobs heavier than the next one to shrink. True when any did."""
    jobs = view.jobs
    run = view.running[jobs.kind[view.running] == TRAINING]
    if len(run) == 0:
        return False
    extra = view.held[run] - jobs.num_gpus[run]  # GPUs held beyond the request
    keep = (extra > 0) & (view.now_s - jobs.last_change_s[run] >= p.min_run_s)  # hysteresis, as for preemption
    if p.keep_heavy_growth:
        keep &= W[run] < W[waiting].max()
    grown, extra = run[keep], extra[keep]
    order = np.argsort(W[grown], kind="stable")
    grown, extra = grown[order], extra[order].tolist()
    wq, nq = W[waiting], min_gpus(p, view, waiting)
    room = int(slot_all(gj < 0).sum())  # empty GPUs, then also those given back
    gone = set(d.preempt)
    done = False
    for j, x in zip(grown.tolist(), extra):
        if j in gone:
            continue
        need = int(nq[wq > W[j]].sum()) if p.keep_heavy_growth else int(nq.sum())
        if room >= need:
            continue  # the waiting jobs this gang would make room for fit already
        target = sub_gang(jobs.gpus[j], int(jobs.num_gpus[j]), view.topo)  # its first GPUs in the topology
        if target is None:
            continue
        relaunch(view, gj, gs, d, j, target)
        room += x
        done = True
    return done


def defragment(p: ElastiCoParams, memo: PolicyMemo, view: ClusterView, gj, gs, d: Decision) -> None:
    """Clear whole nodes for one-node gangs running shrunk, by moving the few training jobs in the way.

    A gang of at most a node's GPUs shrunk to fit fragments stays shrunk while the cluster's empty GPUs are
    scattered over nodes (regrow adds GPUs on one node only). For each such gang, heaviest saving first, the
    node whose other tenants are fewest -- training jobs held inside that node, settled (``min_run_s``) and
    not touched this round; a node with a service is never cleared -- is emptied by moving each of those jobs
    to empty GPUs on other nodes (fullest node first, its share kept), and the gang is relaunched on the node
    at its requested count. Done only when its time saved exceeds ``expand_gain x restart_s`` per restart it
    costs (the moved jobs' and its own), and at most ``defrag_moves`` jobs move per round.
    """
    topo = view.topo
    if topo is None or topo.flat or p.defrag_moves == 0:
        return
    jobs = view.jobs
    run = view.running[jobs.kind[view.running] == TRAINING]
    if len(run) == 0:
        return
    held = np.bincount(gj[gj >= 0], minlength=len(jobs.kind))
    req = jobs.num_gpus
    settled = view.now_s - jobs.last_change_s >= p.min_run_s
    cand = run[(held[run] < req[run]) & (held[run] > 0) & (req[run] <= topo.max_node) & settled[run]]
    if len(cand) == 0 or not slot_all(gj < 0).any():  # (no empty GPU: nowhere to move anyone to)
        return
    touched = set(d.preempt) | {int(j) for j, _ in d.resize} | {int(j) for j, _, _ in d.place}
    occupied = gj >= 0
    settled_slots = occupied & settled[np.where(occupied, gj, 0)]
    key = (gj.tobytes(), settled_slots.tobytes(), cand.tobytes(), tuple(sorted(touched)))
    if memo.defrag == key:
        return  # the same cluster as a pass that moved nobody (savings only shrink): nobody moves again
    cost = p.expand_gain * p.restart_s
    offers = _defrag_offers(memo, view, cand, held[cand], touched, cost)
    node_of = topo.gpu_node
    budget = p.defrag_moves
    moved = False
    nodes = None  # the nodes' tenants (_node_tenants), recomputed after each move
    for k, (neg_saving, j, n) in enumerate(offers):
        if j in touched:  # moved out of the way of an earlier gang of this pass
            continue
        if nodes is None:
            nodes = _node_tenants(view, gj, settled, touched)
            ntenants, need, node_empty = nodes.ntenants.tolist(), nodes.need.tolist(), nodes.node_empty.tolist()
            clearable = nodes.clearable.tolist()
            n_empty = sum(node_empty)
            # (moves, GPUs out, node) of the clearable nodes within the move budget whose tenants fit the empty
            # GPUs of the other nodes, ascending; a node whose tenants find no room leaves it until a move
            order = sorted((ntenants[nd], need[nd], nd) for nd in range(topo.num_nodes)
                           if clearable[nd] and ntenants[nd] <= budget and need[nd] <= n_empty - node_empty[nd])
            # fewest moves any node may cost (a gang's own node counts one tenant less); none: nobody moves
            low = min((ntenants[nd] - 1 for nd in range(topo.num_nodes) if clearable[nd]), default=math.inf)
            may = _may_clear(nodes, order, offers, held, budget, n_empty)
        if not may[k]:
            continue  # no node to try (below): nothing to do, and no state changes until a move
        saving = -neg_saving
        if saving <= cost * (1 + max(low, 0)):
            break  # (offers come by decreasing saving: no later gang pays for a move either)
        home = int(nodes.job_node[j])
        if home < 0:  # (spread over nodes)
            home = int(node_of[jobs.gpus[j][0]])
        # the nodes the gang might take: its own node without it counted
        tries = [t for t in order if t[2] != home]
        if clearable[home] and need[home] - held[j] <= n_empty - node_empty[home] and ntenants[home] - 1 <= budget:
            tries.append((ntenants[home] - 1, need[home] - held[j], home))
            tries.sort()
        allowed = gpu_mask(jobs, j)
        for t in tries:
            moves, nd = t[0], t[2]
            lo = int(topo.node_start[nd])
            if topo.node_size[nd] < n or (allowed is not None and not allowed[lo:lo + n].all()):
                continue  # too small, or GPUs the gang is not allowed on
            if saving <= cost * (1 + moves):
                break
            plan = _evacuate(nodes, jobs, topo, nd, [o for o in nodes.tenants(nd) if o != j])
            if plan is None:  # (the same for every other gang of the pass, until something moves)
                if nd != home:
                    order.remove(t)
                continue
            for o, target in plan:
                relaunch(view, gj, gs, d, o, target)
            relaunch(view, gj, gs, d, j, np.arange(lo, lo + n))
            touched.update([j, *nodes.tenants(nd)])
            budget -= moves
            moved = True
            nodes = None
            break
        if budget <= 0:
            break
    memo.defrag = None if moved else key


def _defrag_offers(memo: PolicyMemo, view: ClusterView, cand: np.ndarray, cur: np.ndarray, touched: set,
                   cost: float) -> list[tuple[float, int, int]]:
    """:func:`defragment`'s offers: (-saving, job, requested count) of each gang of ``cand`` (running shrunk on
    ``cur`` GPUs) whose time saved back on its requested count exceeds ``cost``, by decreasing saving then
    job id; all judged at once on their count tables, as :func:`_growth_offers` does."""
    jobs = view.jobs
    rem = jobs.remaining_est_s[cand]
    ok = np.isfinite(rem)
    if touched:
        ok &= ~np.isin(cand, np.fromiter(touched, np.int64, len(touched)))
    if any_declared(jobs) or jobs.gang_sizes is not None:
        ok &= np.array([not shapes_of(jobs, j) and size_allowed(jobs, j, int(jobs.num_gpus[j])) for j in cand.tolist()], bool)
    keep = np.flatnonzero(ok)
    if len(keep) == 0:
        return []
    cand, cur, rem = cand[keep], cur[keep], rem[keep]
    cnt_u, spd_u, row = count_tables(memo, view, cand)
    cnt, spd = cnt_u[row], spd_u[row]
    req = jobs.num_gpus[cand].astype(np.int64)
    at_cur, at_req = cnt == cur[:, None], cnt == req[:, None]
    has = at_cur.any(axis=1) & at_req.any(axis=1)  # both counts in the job's table
    s_cur = np.where(at_cur, spd, 0.0).sum(axis=1)
    s_req = np.where(at_req, spd, 0.0).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        saving = rem / s_cur - rem / s_req
    good = np.flatnonzero(has & (saving > cost))
    good = good[np.lexsort((cand[good], -saving[good]))]
    return list(zip((-saving[good]).tolist(), cand[good].tolist(), req[good].tolist()))


class NodeTenants(NamedTuple):
    """The planning arrays seen per node, for :func:`defragment` (valid until something moves)."""

    clearable: np.ndarray  # [Nn] bool, every tenant a settled training job held inside it, not pinned or touched
    pair_node: np.ndarray  # [P] the (node, tenant) pairs of the planning arrays, by node then job
    pair_job: np.ndarray
    ntenants: np.ndarray  # [Nn] int, tenants per node
    need: np.ndarray  # [Nn] float, the GPUs they hold
    empty: np.ndarray  # [G] bool, GPUs with no tenant
    node_empty: np.ndarray  # [Nn] int, empty GPUs per node
    job_node: np.ndarray  # [N] int, the node holding each job; -1: none, -2: several

    def tenants(self, nd: int) -> list[int]:
        """The tenants of node ``nd``, ascending."""
        lo = int(np.searchsorted(self.pair_node, nd))
        return self.pair_job[lo:lo + int(self.ntenants[nd])].tolist()


def _node_tenants(view: ClusterView, gj, settled: np.ndarray, touched: set) -> NodeTenants:
    """:class:`NodeTenants` of the planning arrays ``gj``."""
    jobs, topo = view.jobs, view.topo
    node_of = topo.gpu_node
    occupied = gj >= 0
    rows, _ = np.nonzero(occupied)
    who = gj[occupied]
    pairs = np.unique(node_of[rows].astype(np.int64) * len(jobs.kind) + who)
    p_node, p_job = pairs // len(jobs.kind), pairs % len(jobs.kind)
    # a tenant that is a service, unsettled, touched this round, without GPUs in the view, pinned to nodes or
    # spread over nodes (an untouched job's rows in gj are its GPUs) keeps its node as it is
    spread = np.bincount(p_job)[p_job] > 1
    bad = (jobs.kind[p_job] != TRAINING) | ~settled[p_job] | spread | (view.held[p_job] == 0)
    if touched:
        bad |= np.isin(p_job, np.fromiter(touched, np.int64, len(touched)))
    if jobs.allowed_gpus is not None:
        bad |= np.array([gpu_mask(jobs, j) is not None for j in p_job.tolist()], bool)
    held = np.bincount(who, minlength=len(jobs.kind))
    job_node = np.full(len(jobs.kind), -1, np.int64)
    job_node[p_job] = np.where(spread, -2, p_node)
    empty = slot_all(gj < 0)
    return NodeTenants(clearable=np.bincount(p_node[bad], minlength=topo.num_nodes) == 0, pair_node=p_node,
                       pair_job=p_job, ntenants=np.bincount(p_node, minlength=topo.num_nodes),
                       need=np.bincount(p_node, weights=held[p_job], minlength=topo.num_nodes), empty=empty,
                       node_empty=np.bincount(node_of[empty], minlength=topo.num_nodes), job_node=job_node)


def _may_clear(nodes: NodeTenants, order: list, offers: list, held: np.ndarray, budget: int, n_empty: int) -> list:
    """Per offer of :func:`defragment`, whether it has a node to try: another node of ``order`` or its own node
    cleared. A superset of the offers that may move anyone while ``nodes`` holds (the pass only shrinks ``order``
    and the budget), so the pass skips the others at no cost."""
    if len(order) > 1 or not offers:
        return [True] * len(offers)
    js = np.fromiter((o[1] for o in offers), np.int64, len(offers))
    home = nodes.job_node[js]
    at = np.maximum(home, 0)
    may = (home < 0) | (nodes.clearable[at] & (nodes.ntenants[at] - 1 <= budget)
                        & (nodes.need[at] - held[js] <= n_empty - nodes.node_empty[at]))
    if order:
        may |= home != order[0][2]
    return may.tolist()


def _evacuate(nodes: NodeTenants, jobs, topo, nd: int, occ: list[int]) -> list[tuple[int, np.ndarray]] | None:
    """Targets on empty GPUs outside node ``nd`` for each job of ``occ``, largest gang first, each on the node
    with the fewest empty GPUs that has room for it (lowest node, then lowest GPUs, on ties: what
    :func:`placement.pick_gang` picks with the fullness score); None when one finds no room."""
    empty = nodes.empty
    room = nodes.node_empty.copy()
    room[nd] = -1  # the node being cleared takes nobody
    taken = np.zeros(topo.num_nodes, np.int64)
    out = []
    for o in sorted(occ, key=lambda o: -len(jobs.gpus[o])):
        k = len(jobs.gpus[o])
        fits = np.flatnonzero(room >= k)
        if len(fits) == 0:
            return None
        m = int(fits[np.argmin(room[fits])])
        rows = np.flatnonzero(empty[topo.node_start[m]:topo.node_start[m] + topo.node_size[m]]) + topo.node_start[m]
        out.append((o, rows[taken[m]:taken[m] + k]))
        taken[m] += k
        room[m] -= k
    return out
