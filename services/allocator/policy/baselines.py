"""Baseline policies, each implemented from its published description and named as such.

Shared conventions (documented once):

* **Inference services** are latency-sensitive and go first in every queue. Exclusive baselines
  (FIFO, backfill, Tiresias, Lucid) give each one whole GPU for its lifetime (static allocation sized for
  its peak, never preempted); ``mps-equal-share`` gives it one MPS replica like any pod.
* **Gang placement**: a multi-GPU job starts only when all its GPUs are available at once, inside one node
  when it fits one, else on whole nodes plus at most one partial node (:func:`placement.pick_gang`: the
  first node with room, lowest GPUs first).
* **Declared shapes**: a job that declares its shapes (``JobSpec.shapes``, live jobs only) is placed with
  one of them, never with the policy's own share (:func:`shapes.declared_share`): whole-GPU policies give
  it its largest declared share on a GPU of its own, ``mps-equal-share`` the declared share nearest its
  replica's 50 % on a replica, Lucid the one nearest 50 % when packing it (a declaring resident keeps a
  declared share).
* **Options**: each policy's options are one frozen dataclass (``Policy.Params``: :class:`TiresiasParams`,
  :class:`MpsEqualShareParams`, :class:`LucidParams`; the exclusive ones have none), typed and range-checked
  when built (:class:`PolicyParams`); ``make_policy`` refuses any other option.
* **Runtime estimates**: EASY backfilling and Lucid need job-duration estimates. They receive the true
  remaining isolated run time (``JobTable.remaining_est_s``), i.e. *perfect* estimates -- generous to the
  baselines, never the reverse. Tiresias and ElastiCo are non-clairvoyant.

Policies:

* :class:`ExclusiveFifo` -- static isolated allocation (the paper's reference): whole GPUs, strict
  first-come-first-served; the head job blocks the queue until enough GPUs are free.
* :class:`ExclusiveBackfill` -- EASY backfilling (Lifka 1995; Mu'alem & Feitelson 2001): the head job gets
  a reservation at the earliest time enough GPUs free up; later jobs may start now if they fit in the free
  GPUs and either finish before that reservation or use only GPUs the reservation does not need.
* :class:`Tiresias` -- Tiresias discretised 2D-LAS (Gu et al., NSDI'19): priority = attained service in
  GPU-seconds, discretised into queues by thresholds (default 1 h and 10 h of GPU time); within a queue the
  running jobs first, then the queued ones by arrival; preemptive (a job in a higher queue displaces running
  lower ones, and only when it takes their GPUs; restart cost applies); starvation guard: a job queued longer
  than ``starve_factor`` x its executed time returns to queue 0 while it waits (the policy keeps no state
  between rounds, so unlike the authors' simulator it does not restart its queue climb there once it runs).
* :class:`MpsEqualShare` -- NVIDIA k8s device plugin with MPS ``replicas=2``: every GPU exposes two
  replicas of 50 %; pods take replicas first-fit in submission order, interference-blind; like the
  Kubernetes scheduler, a pod that does not fit does not block later ones.
* :class:`LucidPacking` -- Lucid-style (Hu et al., ASPLOS'23) interference-aware packing without shapes
  or pricing: shortest-(estimated)-job-first queue; a job takes free whole GPUs when there are enough;
  otherwise (indolent packing: only under queueing) it is paired with a GPU hosting exactly one training
  job when the *predicted* speed of both stays above ``pack_floor``, choosing the pair with the highest
  predicted combined throughput. At most two tenants; no MPS limits (shares are accounting only).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar, cast

import numpy as np

from services.allocator.policy.placement import TenantState, first_free_gpus, pick_gang
from services.allocator.policy.shapes import any_declared, declared_share, shapes_of
from services.allocator.policy.view import (
    INFERENCE,
    TRAINING,
    ClusterView,
    Decision,
    JobTable,
    free_share,
    gpu_mask,
    occupy,
    vacate,
)

# --------------------------------------------------------------------------------------------------
# Typed options: every policy's options are one frozen dataclass, checked when it is built


class OptionError(ValueError):
    """A policy option of the wrong type or out of its range (the message names the field)."""

    def __init__(self, params: str, field: str, value, reason: str):
        super().__init__(f"{params}.{field}={value!r}: {reason}")
        self.field, self.reason = field, reason


def option(default, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
           hi_open: bool = False, ascending: bool = False):
    """A params field: its default and the range its value (each element, for a tuple) must lie in;
    ``ascending``: a tuple's elements strictly increase. Checked by :class:`PolicyParams`."""
    return dataclasses.field(default=default, metadata={"range": (lo, hi, lo_open, hi_open), "ascending": ascending})


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_a(value, kind) -> bool:
    """``value`` has option type ``kind`` (bool, int, or float: an int also counts, NaN does not)."""
    if kind is bool:
        return isinstance(value, (bool, np.bool_))
    if isinstance(value, (bool, np.bool_)):
        return False
    if kind is int:
        return isinstance(value, (int, np.integer))
    if kind is float:
        return isinstance(value, (int, float, np.integer, np.floating)) and not math.isnan(value)
    raise TypeError(f"unsupported option type {kind!r}")


def _interval(lo, hi, lo_open: bool, hi_open: bool) -> str:
    if hi is None:
        return f"{'>' if lo_open else '>='} {lo}"
    if lo is None:
        return f"{'<' if hi_open else '<='} {hi}"
    return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


@dataclass(frozen=True)
class PolicyParams:
    """Options of a policy (this base: none). Subclasses declare typed fields (bool, int, float, or a tuple of
    int / float), with :func:`option` ranges; a wrong type or value raises :class:`OptionError` (a ValueError)
    naming the field."""

    def __post_init__(self) -> None:
        cls = type(self).__name__
        own: type = type(self)  # as a plain ``type``: mypy checks a dataclass's class object against Hashable wrongly
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), _field_types(own)[f.name]
            elem = typing.get_args(kind)[0] if typing.get_origin(kind) is tuple else None
            if elem is not None and not (isinstance(value, tuple) and value):
                raise OptionError(cls, f.name, value, "must be a non-empty tuple")
            items = value if elem is not None else (value,)
            if not all(_is_a(x, elem or kind) for x in items):
                what = f"a tuple of {elem.__name__}" if elem is not None else kind.__name__
                raise OptionError(cls, f.name, value, f"must be {what}")
            lo, hi, lo_open, hi_open = f.metadata.get("range", (None, None, False, False))
            for x in items:
                if (lo is not None and not (x > lo if lo_open else x >= lo)) or (
                        hi is not None and not (x < hi if hi_open else x <= hi)):
                    raise OptionError(cls, f.name, value, f"must be {_interval(lo, hi, lo_open, hi_open)}")
            if f.metadata.get("ascending") and any(b <= a for a, b in itertools.pairwise(items)):
                raise OptionError(cls, f.name, value, "must be strictly ascending")


P = TypeVar("P", bound=PolicyParams)  # a policy's params class (``Policy.Params``)


class Policy(Generic[P]):
    """Base of every policy: ``decide(view) -> Decision``. Stateless across rounds unless stated.

    Generic over its params class ``P``; a subclass names it twice: ``class X(Policy[XParams])`` for the type
    checker and ``Params = XParams`` for the runtime (a ClassVar cannot hold a type variable)."""

    name = "policy"
    Params: ClassVar[type[PolicyParams]] = PolicyParams  # its options (make_policy accepts exactly these fields)
    mps_limits = False  # True when the shares it grants are enforced MPS limits (speed is capped by them)
    # with mps_limits: True when a training job's share limits it only where it launched next to a service
    # (elastico.coloc.rates.limited_slots), else everywhere
    unlimited_training = False
    needs_periodic_rounds = False  # True when decisions change with time alone (ages, attained service)
    uses_observations = False  # True when it reads JobTable.observed_norm (the caller may skip computing it)

    def __init__(self, params: P | None = None):
        # self.Params is P's class (each subclass pairs them; the type is checked just below)
        self.params: P = cast(P, self.Params()) if params is None else params
        if type(self.params) is not self.Params:
            raise TypeError(f"{type(self).__name__}: params must be {self.Params.__name__}, got "
                            f"{type(self.params).__name__}")

    @classmethod
    def build(cls, params: P, estimate: np.ndarray, kappa: float, solver=None) -> Policy[P]:
        """The policy with options ``params``; the interference estimate, ``kappa`` and the pricing solver go
        to the policies that use them (this base uses none)."""
        return cls(params)

    def decide(self, view: ClusterView) -> Decision:  # pragma: no cover - interface
        raise NotImplementedError


def _request_share(jobs: JobTable, j: int, n: int, want: float) -> float:
    """:func:`shapes.declared_share` of job ``j`` on ``n`` = its requested GPU count, which is never None: a
    declaring job's request is one of its declared counts (its largest; ``JobTable.gang_sizes``)."""
    share = declared_share(jobs, j, n, want)
    assert share is not None, f"job {j} declares no shape on its requested {n} GPUs"
    return share


def _inference_first(view: ClusterView, order: np.ndarray) -> np.ndarray:
    """Stable re-order putting inference services before training jobs."""
    k = view.jobs.kind[order]
    return np.concatenate([order[k == INFERENCE], order[k != INFERENCE]])


class ExclusiveFifo(Policy[PolicyParams]):
    """Strict FCFS on whole GPUs (head-of-line blocking). See module docstring."""

    name = "exclusive-fifo"

    def decide(self, view: ClusterView) -> Decision:
        d = Decision()
        gj, gs = view.scratch()
        free = int((gj < 0).all(axis=1).sum())
        topo = view.topo
        for j in _inference_first(view, view.pending):
            n = int(view.jobs.num_gpus[j])
            gpus = first_free_gpus(gj, n, topo, gpu_mask(view.jobs, int(j))) if n <= free else None
            if gpus is None:
                break
            share = _request_share(view.jobs, int(j), n, 100.0)  # a whole GPU: 100 % or its largest declared share
            occupy(gj, gs, j, gpus, share)
            free -= n
            d.place.append((int(j), gpus, share))
        return d


class ExclusiveBackfill(Policy[PolicyParams]):
    """EASY backfilling on whole GPUs, with perfect runtime estimates. See module docstring."""

    name = "exclusive-backfill"

    def decide(self, view: ClusterView) -> Decision:
        d = Decision()
        gj, gs = view.scratch()
        jobs = view.jobs
        free = int((gj < 0).all(axis=1).sum())
        order = _inference_first(view, view.pending)
        topo = view.topo
        i = 0
        # start jobs in order while they fit
        while i < len(order) and jobs.num_gpus[order[i]] <= free:
            j = order[i]
            n = int(jobs.num_gpus[j])
            gpus = first_free_gpus(gj, n, topo, gpu_mask(jobs, int(j)))
            if gpus is None:
                break
            share = _request_share(jobs, int(j), n, 100.0)
            occupy(gj, gs, j, gpus, share)
            free -= n
            d.place.append((int(j), gpus, share))
            i += 1
        if i >= len(order) or free == 0:
            return d
        head = order[i]
        need = int(jobs.num_gpus[head])
        # shadow time: when running jobs (and those just started) release enough GPUs for the head
        run = np.concatenate([view.running, np.array([p[0] for p in d.place], dtype=int)])
        run = run[jobs.kind[run] == TRAINING] if len(run) else run
        ends = np.nan_to_num(jobs.remaining_est_s[run], nan=np.inf)
        o = np.argsort(ends, kind="stable")
        cum = free + np.cumsum(jobs.num_gpus[run][o])
        k = int(np.searchsorted(cum, need))
        if k >= len(o):
            shadow, extra = np.inf, free  # head can never start from running releases alone
        else:
            shadow, extra = float(ends[o][k]), int(cum[k] - need)
        rest = order[i + 1:]
        rest = rest[jobs.num_gpus[rest] <= free]
        for j in rest:
            n = int(jobs.num_gpus[j])
            if n > free:
                continue
            est = jobs.remaining_est_s[j]
            if (np.isfinite(est) and est <= shadow) or n <= extra:
                gpus = first_free_gpus(gj, n, topo, gpu_mask(jobs, int(j)))
                if gpus is None:
                    continue
                if not (np.isfinite(est) and est <= shadow):
                    extra -= n
                share = _request_share(jobs, int(j), n, 100.0)
                occupy(gj, gs, j, gpus, share)
                free -= n
                d.place.append((int(j), gpus, share))
                if free == 0:
                    break
        return d


@dataclass(frozen=True)
class TiresiasParams(PolicyParams):
    """Options of :class:`Tiresias`."""

    # queue boundaries in attained GPU-seconds (the paper's 1 h and 10 h of GPU time), ascending
    thresholds_gpu_s: tuple[float, ...] = option((3600.0, 36000.0), 0.0, lo_open=True, ascending=True)
    starve_factor: float = option(8.0, 0.0, lo_open=True)  # queued time > factor x executed time -> back to queue 0


class Tiresias(Policy[TiresiasParams]):
    """Discretised 2D-LAS, preemptive, exclusive GPUs. See module docstring."""

    name = "tiresias"
    Params = TiresiasParams
    needs_periodic_rounds = True

    def __init__(self, params: TiresiasParams | None = None):
        super().__init__(params)
        self.thresholds_gpu_s = np.asarray(self.params.thresholds_gpu_s, float)

    def decide(self, view: ClusterView) -> Decision:
        d = Decision()
        jobs = view.jobs
        G = view.num_gpus
        cand = np.concatenate([view.running, view.pending])
        if len(cand) == 0:
            return d
        level = np.searchsorted(self.thresholds_gpu_s, jobs.attained_gpu_s[cand], side="right").astype(float)
        executed = jobs.attained_gpu_s[cand] / np.maximum(jobs.num_gpus[cand], 1)
        waiting = view.now_s - jobs.queued_since_s[cand]
        is_pending = np.arange(len(cand)) >= len(view.running)
        starving = is_pending & (executed > 0) & (waiting > self.params.starve_factor * executed)
        level = np.where(starving, 0.0, level)
        level = np.where(jobs.kind[cand] == INFERENCE, -1.0, level)
        # queue level; within a queue the running jobs first, then the queued ones by arrival (as the Tiresias
        # simulator orders a queue: only a job of a higher queue displaces a running one)
        o = np.lexsort((jobs.arrival_s[cand], is_pending, level))
        cand = cand[o]
        # greedy in priority order, skipping what does not fit: the head that fits whole at once, then the rest
        n = jobs.num_gpus[cand]
        total = np.cumsum(n)
        head = int(np.searchsorted(total, G, side="left"))
        head += int(head < len(cand) and total[head] == G)
        keep = np.zeros(len(cand), bool)
        keep[:head] = True
        left = G - (int(total[head - 1]) if head else 0)
        if left > 0:
            rest = head + np.flatnonzero(n[head:] <= left)  # (what does not fit now never will: left only shrinks)
            for idx, nj in zip(rest.tolist(), n[rest].tolist()):
                if nj <= left:
                    keep[idx] = True
                    left -= nj
                    if left == 0:
                        break
        is_running = np.zeros(len(jobs.kind), bool)
        is_running[view.running] = True
        gj, gs = view.scratch()
        out = cand[~keep]
        displaced = out[is_running[out] & (jobs.kind[out] == TRAINING)].tolist()
        for j in displaced:
            vacate(gj, gs, j, jobs.gpus[j])
        new = cand[keep]
        for j in new[~is_running[new]].tolist():
            g = first_free_gpus(gj, int(jobs.num_gpus[j]), view.topo, gpu_mask(jobs, j))
            if g is None:
                continue
            share = _request_share(jobs, j, int(jobs.num_gpus[j]), 100.0)
            occupy(gj, gs, j, g, share)
            d.place.append((j, g, share))
        # a displaced job is preempted only when a placed job took one of its GPUs: the count above ignores
        # nodes, and a higher-priority gang that found no node must not idle GPUs by restarting their holder
        for j in displaced:
            g = jobs.gpus[j]
            if (gj[g] < 0).all():
                occupy(gj, gs, j, g, float(jobs.share_pct[j]))
            else:
                d.preempt.append(j)
        return d


@dataclass(frozen=True)
class MpsEqualShareParams(PolicyParams):
    """Options of :class:`MpsEqualShare`."""

    replicas: int = option(2, 1)  # MPS replicas per GPU (NVIDIA device plugin ``sharing.mps.replicas``)


class MpsEqualShare(Policy[MpsEqualShareParams]):
    """MPS replicas (2 x 50 %) per GPU, first-fit, interference-blind, non-blocking. See module docstring."""

    name = "mps-equal-share"
    Params = MpsEqualShareParams
    mps_limits = True

    def decide(self, view: ClusterView) -> Decision:
        d = Decision()
        gj, gs = view.scratch()
        replicas = self.params.replicas
        replica = 100.0 / replicas
        free_rep = replicas - (gj >= 0).sum(axis=1)
        total = int(free_rep.sum())
        # shares other than a replica's (declared, or held since another policy ran): a replica must also have the room
        declared = any_declared(view.jobs) or bool((gs > replica + 1e-9).any())
        for j in _inference_first(view, view.pending):
            if total == 0:
                break
            n = int(view.jobs.num_gpus[j])
            share = _request_share(view.jobs, int(j), n, replica)  # a declaring job: its share nearest a replica's
            ok = (free_rep > 0) & (gj < 0).any(axis=1)  # a replica left, and a tenant slot for it
            if declared:
                ok &= free_share(gs) >= share - 1e-9
            g = pick_gang(np.zeros(len(free_rep)), ok, n, view.topo, allowed=gpu_mask(view.jobs, int(j)))
            if g is None:
                continue
            occupy(gj, gs, int(j), g, share)
            free_rep[g] -= 1
            total -= n
            d.place.append((int(j), g, share))
        return d


@dataclass(frozen=True)
class LucidParams(PolicyParams):
    """Options of :class:`LucidPacking`."""

    pack_floor: float = option(0.6, 0.0, 1.0)  # both tenants must keep at least this predicted normalised speed
    slo_factor: float = option(10.0, 1.0)  # inference SLO, multiple of the unloaded full-GPU service time


class LucidPacking(Policy[LucidParams]):
    """Lucid-style interference-aware pair packing (no shapes, no pricing). See module docstring."""

    name = "lucid"
    Params = LucidParams

    def __init__(self, estimate: np.ndarray, kappa: float, params: LucidParams | None = None):
        super().__init__(params)
        self.M = estimate  # [T, T] estimated pair matrix (policy's view, never ground truth)
        self.kappa = kappa  # contention factor for pairs without an estimate

    @classmethod
    def build(cls, params: LucidParams, estimate: np.ndarray, kappa: float, solver=None) -> LucidPacking:
        return cls(estimate, kappa, params)

    def decide(self, view: ClusterView) -> Decision:
        d = Decision()
        jobs = view.jobs
        gj, gs = view.scratch()
        pend = view.pending
        est = np.nan_to_num(jobs.remaining_est_s[pend], nan=np.inf)
        order = _inference_first(view, pend[np.argsort(est, kind="stable")])
        free = int((gj < 0).all(axis=1).sum())
        placed_now: dict[int, int] = {}
        state = None  # tenant interference state, built on the first packing attempt, refreshed on change
        failed: set = set()  # (type, gang size) that found no partner since the last change
        topo = view.topo
        declared = any_declared(jobs)
        share: float | None  # a job's share on this try (None: no declared share to pack it with)
        one: np.ndarray | None = None  # the GPUs a job may pack onto (below), until the tenants change
        res = np.zeros(0, np.int64)
        n_one = 0
        for j in order:
            j = int(j)
            n = int(jobs.num_gpus[j])
            mask = gpu_mask(jobs, j)
            g = first_free_gpus(gj, n, topo, mask) if n <= free else None
            if g is not None:
                share = _request_share(jobs, j, n, 100.0)
                occupy(gj, gs, j, g, share)
                free -= n
                placed_now[j] = len(d.place)
                d.place.append((j, g, share))
                if state is not None:
                    state.refresh(g, gj, gs * 0.0)
                failed.clear()
                one = None
                continue
            if jobs.kind[j] == INFERENCE:
                continue
            # pack next to exactly one training tenant, if both are predicted to keep >= pack_floor
            share = declared_share(jobs, j, n, 50.0)  # 50 %, or a declaring job's declared share nearest it
            if share is None:
                continue
            key = (int(jobs.type_idx[j]), n) if share == 50.0 else (int(jobs.type_idx[j]), n, share)
            key = key if mask is None else (*key, j)  # a pinned job's failure says nothing of other jobs
            if key in failed:
                continue
            if one is None:  # GPUs with one training tenant and a slot for a second, and that tenant
                one = ((gj >= 0).sum(axis=1) == 1) & (gj < 0).any(axis=1)
                res = np.where(one, gj.max(axis=1), -1)
                one &= (res >= 0) & (jobs.kind[np.maximum(res, 0)] == TRAINING)
                n_one = int(one.sum())
            if n_one < n:
                continue
            if state is None:
                state = TenantState(self.M, self.kappa, gj, gs * 0.0, jobs, False)
            pred = state.join(int(jobs.type_idx[j]), float(jobs.solo_util[j]), 100.0, 0.0, self.params.slo_factor)
            resident = pred.after.min(axis=1)
            floor = self.params.pack_floor
            ok = one & (pred.new_norm >= floor) & (resident >= floor)
            res_share = np.full(len(res), 50.0)
            if declared:  # a declaring resident goes to its declared share nearest 50 %; both must fit the GPU
                for gg in np.flatnonzero(ok):
                    r = int(res[gg])
                    if shapes_of(jobs, r):
                        cur = float(gs[gg, gj[gg] == r][0])
                        rs = declared_share(jobs, r, int(np.count_nonzero((gj == r).any(axis=1))), 50.0)
                        res_share[gg] = cur if rs is None else rs
                ok &= res_share + share <= 100.0 + 1e-9
            for gg in np.flatnonzero(ok & (res_share > gs.sum(axis=1) + 1e-9)):  # a resident that grows must fit
                mine = np.flatnonzero((gj == res[gg]).any(axis=1))  # every GPU it holds
                ok[gg] = bool((free_share(gs[mine]) + gs[mine][gj[mine] == res[gg]] >= res_share[gg] - 1e-9).all())
            g = pick_gang(pred.new_norm + resident, ok, n, topo, allowed=mask)
            if g is None:
                failed.add(key)
                continue
            for gg in g:  # accounting only: the two tenants split the GPU 50/50 (no MPS limits)
                r = int(res[gg])
                rs = float(res_share[gg])
                gs[gg, gj[gg] == r] = rs
                if r in placed_now:  # placed in this same round: place it at 50 % directly
                    k = placed_now[r]
                    d.place[k] = (r, d.place[k][1], rs)
                else:
                    d.resize.append((r, rs))
            occupy(gj, gs, j, g, share)
            d.place.append((j, g, share))
            state.refresh(g, gj, gs * 0.0)
            failed.clear()
            one = None
        return d
