"""Ground truth of co-location: what co-located jobs *actually* achieve. Measured data, not our predictor.

The simulator's engine and the simulated GPU backend of the node agent both read it.

* Training x training on one GPU: the measured pair (``coloc_gavel_pairs.csv``, rows of the cluster's GPU
  type): ``norm_tput_a`` for (a next to b) and ``norm_tput_b`` for (b next to a). Pairs Gavel could not
  run together (``coloc_failed``, probably out of memory) get :data:`FAILED_PAIR_NORM` (a near-stall
  stand-in for an OOM/restart loop) -- policies that co-locate them pay for it.
* A measurement campaign's GPU type (``campaign_dir``, :func:`elastico.coloc.profiles.campaign_tables`): its
  training pairs at MPS 100/100 enter the matrix as Gavel's do (a pair measured in several runs: the mean of
  its runs); its training + inference pairs at 100/100 (no client priority) give the training row next to
  the inference pseudo-type (``norm_tput_train``) and the inference row next to the training type
  (``norm_capacity_service``: the rate served within the SLO, relative to alone; 0, held at no rate tried,
  counts as :data:`FAILED_PAIR_NORM`), each the mean over the measured services and runs, since one
  pseudo-type stands for every service. Points at other shares or with client
  priorities are kept in :attr:`GroundTruth.share_points` (what measures the share model), never mixed into
  the 100/100 matrix.
* Pairs without a measurement (including the ~20% withheld from ``data/`` and every other pair involving an
  inference service): the conservative utilisation rule of
  :func:`elastico.coloc.rates.utilisation_rule`, with ``kappa`` calibrated as the 25th
  percentile of measured / processor-sharing ratios (:func:`calibrate_kappa`).
* k > 2 tenants: additive composition of the pairwise values (``compose_additive``).
* MPS shares: a training tenant's speed is additionally capped by ``share_speed(share, solo_util)`` when the
  policy enforces MPS limits, and a tenant its cap holds below its co-located pace steals proportionally less
  from its co-tenants (``compose_capped``; the H200 campaign's pairs at 50/50 shares ran faster than the
  full-share pairs capped by each share: results.md).
* Inference: serving capacity = share x interference factor; its utilisation in the rule is its mean
  load (constant per service, so a segment's capacity is constant between placement changes).

Per-tenant entry point for everything that is not the engine (the node agent's simulated GPUs):
:meth:`GroundTruth.speeds` (one GPU's tenants by type row; the same rules as the engine's per-GPU speeds)
and :func:`tenant_speeds` (``gpu_type``, ``[(job_type, share_pct)]`` -> normalised speeds), with
:func:`type_index` mapping a workload's model family + batch size to a type the way trace rows are mapped.
"""

from __future__ import annotations

import csv
import functools
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np

from elastico.coloc.profiles import (
    DATA_DIR,
    INFERENCE_TYPE,
    CampaignTables,
    TraceError,
    TypeTable,
    at_full_shares,
    campaign_number,
    campaign_tables,
    csv_text,
    default_campaign_dir,
    load_type_table,
)
from elastico.coloc.rates import calibrate_kappa, compose_additive, compose_capped, share_speed, utilisation_rule

#: Columns of a measured-pairs file (``coloc_gavel_pairs.csv`` schema) that the ground truth reads.
PAIR_COLUMNS = ("gpu_type", "job_type_a", "job_type_b", "norm_tput_a", "norm_tput_b", "coloc_failed")

#: Normalised throughput assigned to measured pairs that failed to co-locate (OOM stand-in).
FAILED_PAIR_NORM = 0.05


class SharePoint(NamedTuple):
    """One campaign pair measured at MPS shares other than 100/100 or with client priorities (not in the matrix)."""

    job_a: str  # training type (a training + inference point: the training tenant)
    job_b: str  # co-tenant: a training type or the service's name
    share_a_pct: float
    share_b_pct: float
    norm_a: float  # normalised throughput of a (NaN: failed)
    norm_b: float  # of b (a service: its capacity within the SLO, relative to alone)
    priorities: str  # "" or the client priorities, "train=<p> service=<p>"


class GroundTruth:
    """Measured pair matrix plus the calibrated rule for everything unmeasured."""

    def __init__(self, types: TypeTable, data_dir: Path | str = DATA_DIR, pairs_file: str = "coloc_gavel_pairs.csv",
                 kappa_quantile: float = 0.25, campaign_dir: Path | str | None = None):
        T = len(types.names)
        self.types = types
        self.matrix = np.full((T, T), np.nan)  # [T, T] measured normalised throughput, NaN = rule
        measured: list[tuple[str, str, float, float]] = []
        path = Path(data_dir) / pairs_file  # an absolute ``pairs_file`` replaces ``data_dir``
        with csv_text(path) as fh:
            rows = csv.DictReader(fh)
            missing = [c for c in PAIR_COLUMNS if c not in (rows.fieldnames or [])]
            if missing:
                raise TraceError(f"{path}:1: measured-pairs file lacks column(s) {', '.join(missing)}")
            for r in rows:
                if r["gpu_type"] == types.gpu_type:
                    self._add_pair(r, f"{path}:{rows.line_num}", measured)
        self.share_points: list[SharePoint] = []  # campaign points off 100/100 (module docstring)
        self.train_infer_pairs = 0  # measured training + inference points in the matrix
        for ct in campaign_tables(campaign_dir):
            if ct.gpu_type == types.gpu_type:
                self._add_campaign(ct, measured)
        self.measured_pairs = len(measured)  # number of measured (successful) training pairs
        self.kappa = calibrate_kappa(measured, types, kappa_quantile)  # contention factor of the rule

    def _add_pair(self, r: dict[str, str], where: str, measured: list[tuple[str, str, float, float]]) -> None:
        """One measured training pair (``coloc_gavel_pairs.csv`` schema) into the matrix; ``where`` = file:line."""
        types = self.types
        try:
            a, b = types.index(r["job_type_a"]), types.index(r["job_type_b"])
        except KeyError:
            return
        if r["coloc_failed"] == "1":
            self.matrix[a, b] = self.matrix[b, a] = FAILED_PAIR_NORM
            return
        try:
            na, nb = float(r["norm_tput_a"]), float(r["norm_tput_b"])
        except (TypeError, ValueError):
            na = nb = float("nan")
        if not (na > 0 and nb > 0 and np.isfinite(na + nb)):
            raise TraceError(f"{where}: norm_tput_a/norm_tput_b must be positive numbers, "
                             f"got {r['norm_tput_a']!r}/{r['norm_tput_b']!r}")
        self.matrix[a, b], self.matrix[b, a] = min(na, 1.0), min(nb, 1.0)
        measured.append((r["job_type_a"], r["job_type_b"], na, nb))

    def _add_campaign(self, ct: CampaignTables, measured: list[tuple[str, str, float, float]]) -> None:
        """One campaign table set of this GPU type: training pairs, training + inference pairs, share points."""
        pt = "coloc_pairs.csv"
        repeats: dict[tuple[str, str], list[dict[str, str]]] = {}  # one pair measured in several runs
        for r in ct.rows(pt):
            sa, sb = campaign_number(ct, pt, r, "share_a_pct"), campaign_number(ct, pt, r, "share_b_pct")
            if r["gpu_type"] != ct.gpu_type:
                continue
            if at_full_shares(sa, sb):
                repeats.setdefault((r["job_type_a"], r["job_type_b"]), []).append(r)
            else:
                failed = r["coloc_failed"].strip() == "1"
                na, nb = (np.nan, np.nan) if failed else (campaign_number(ct, pt, r, "norm_tput_a"),
                                                          campaign_number(ct, pt, r, "norm_tput_b"))
                self.share_points.append(SharePoint(r["job_type_a"], r["job_type_b"], sa, sb, na, nb, ""))
        for rows in repeats.values():  # the mean of the runs that ran the pair; failed only if every run failed
            ok = [r for r in rows if r["coloc_failed"].strip() != "1"]
            mean = {c: str(float(np.mean([campaign_number(ct, pt, r, c) for r in ok])))
                    for c in ("norm_tput_a", "norm_tput_b")} if ok else {}
            first = (ok or rows)[0]
            self._add_pair({**first, **mean}, f"{ct.path(pt)}:{first['_line']}", measured)
        ti = "train_infer_pairs.csv"
        inf = self.types.inference_index
        by_type: dict[int, list[tuple[float, float]]] = {}
        for r in ct.rows(ti):
            if r["gpu_type"] != ct.gpu_type:
                continue
            failed = r["failed"].strip() == "1"
            st, ss = campaign_number(ct, ti, r, "share_train_pct"), campaign_number(ct, ti, r, "share_service_pct")
            nt, ns = campaign_number(ct, ti, r, "norm_tput_train"), campaign_number(ct, ti, r, "norm_capacity_service")
            prio = (f"train={r['priority_train']} service={r['priority_service']}"
                    if (r["priority_train"] or r["priority_service"]).strip() else "")
            if not failed and not (nt > 0 and ns >= 0):
                raise TraceError(f"{ct.path(ti)}:{r['_line']}: norm_tput_train must be a positive number and "
                                 f"norm_capacity_service one >= 0, got {r['norm_tput_train']!r}/"
                                 f"{r['norm_capacity_service']!r}")
            if prio or not at_full_shares(st, ss):
                self.share_points.append(SharePoint(r["job_type_train"], r["service"], st, ss,
                                                    np.nan if failed else nt, np.nan if failed else ns, prio))
                continue
            try:
                a = self.types.index(r["job_type_train"])
            except KeyError:
                continue
            # a service that held its SLO at no rate tried (capacity 0) gets the failed-pair floor
            pair = ((FAILED_PAIR_NORM, FAILED_PAIR_NORM) if failed
                    else (min(nt, 1.0), min(max(ns, FAILED_PAIR_NORM), 1.0)))
            by_type.setdefault(a, []).append(pair)
        for a, vals in by_type.items():
            self.matrix[a, inf], self.matrix[inf, a] = np.mean(vals, axis=0)
            self.train_infer_pairs += len(vals)

    # ---- per-tenant lookup (one GPU) ---------------------------------------------------------------
    def speeds(self, type_idx, share_pct=None, util=None, training=None) -> np.ndarray:
        """Ground-truth normalised speed of each tenant of ONE GPU (before any gang minimum).

        The simulator's rules, as ``simulator.engine.Engine._gpu_norms`` applies them: a lone tenant keeps
        1.0; otherwise the ``[k, k]`` pair matrix (measured value, :data:`FAILED_PAIR_NORM` for failed
        pairs, the calibrated utilisation rule where unmeasured) composed additively. With ``share_pct``
        (MPS limits enforced), a training tenant's speed is capped by ``share_speed(share, u)``, and what it
        steals from its co-tenants scaled by how far the cap holds it back (:func:`compose_capped`).

        Args:
            type_idx: [k] row of each tenant in this truth's ``TypeTable``.
            share_pct: [k] MPS share of each tenant on this GPU, percent; None = no MPS limits.
            util: [k] utilisation of each tenant (fraction of one GPU); None = the types' fitted
                ``solo_util`` (inference tenants need it given: their type has none).
            training: [k] bool, True for training tenants (only they are capped by their share); None = all.

        Returns:
            [k] normalised throughputs in (0, 1].
        """
        tt = np.asarray(type_idx, dtype=np.int64).reshape(-1)
        k = len(tt)
        if k == 0:
            return np.zeros(0)
        uu = self.types.solo_util[tt].astype(float) if util is None else np.asarray(util, float).reshape(-1)
        cap = None
        if share_pct is not None:
            sh = np.asarray(share_pct, float).reshape(-1)
            tr = np.ones(k, bool) if training is None else np.asarray(training, bool).reshape(-1)
            cap = np.where(tr, share_speed(sh, np.maximum(uu, 1e-6)), 1.0)
        if k == 1:
            return np.ones(1) if cap is None else np.minimum(1.0, cap)
        pm = self.pairs(tt, uu)
        return compose_additive(pm) if cap is None else compose_capped(pm, cap)[0]

    def pairs(self, type_idx: np.ndarray, util: np.ndarray) -> np.ndarray:
        """``[k, k]`` pairwise speeds of one GPU's tenants (type rows, utilisations): the measured value, else the
        calibrated rule; 1 on the diagonal (what :func:`compose_capped` reads)."""
        pm = self.matrix[type_idx[:, None], type_idx[None, :]]
        pm = np.where(np.isnan(pm), utilisation_rule(util[:, None], util[None, :], self.kappa), pm)
        np.fill_diagonal(pm, 1.0)
        return pm


# ---- job types of workloads that are not trace rows (node agent, live jobs) ------------------------------

#: Solo utilisation assumed for a training workload on a GPU type without any measured data (the default of
#: :func:`elastico.coloc.profiles.fit_solo_utilisation` when nothing can be fitted).
UNKNOWN_TYPE_UTIL = 0.75

#: A training type's name: Gavel's ``"<model> (batch size <n>)"``, a campaign's with `` [amp]`` for bf16 jobs.
_TYPE_NAME_RE = re.compile(r"^(?P<model>.+) \(batch size (?P<bs>\d+)\)(?: \[amp\])?$")


def _norm_model(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def _split_type_name(name: str) -> tuple[str, int]:
    m = _TYPE_NAME_RE.match(name)
    return (m.group("model"), int(m.group("bs"))) if m else (name, 0)


def type_index(types: TypeTable, model: str, batch_size: int) -> int | None:
    """Row of ``types`` for a training workload (model family + per-GPU batch size): the simulator's mapping.

    As ``simulator.traces.load_training`` maps trace rows (and the allocator's ``TypeResolver`` job specs):
    the type ``"<model> (batch size <batch_size>)"`` (a type without a batch size in its name, e.g. ``A3C``,
    has batch size 0); else the first type of the same model family; else -- a model the data does not
    know -- the type with the median solo utilisation, whose measured pairs and fitted utilisation then
    stand for it. Model names are compared ignoring case and punctuation. None only when the table has no
    training type at all (a GPU type without data).
    """
    lut = getattr(types, "_gt_model_lut", None)
    if lut is None:
        exact: dict[tuple[str, int], int] = {}
        family: dict[str, int] = {}
        for i, n in enumerate(types.names[:-1]):
            m, bs = _split_type_name(n)
            exact.setdefault((_norm_model(m), bs), i)
            family.setdefault(_norm_model(m), i)
        train = types.solo_util[:-1]
        med = int(np.argsort(train)[len(train) // 2]) if len(train) else None  # as traces.py (same ties)
        lut = (exact, family, med)
        object.__setattr__(types, "_gt_model_lut", lut)
    exact, family, med = lut
    m = _norm_model(model)
    hit = exact.get((m, int(batch_size or 0)))
    if hit is None:
        hit = family.get(m, med)
    return hit


@functools.cache
def default_truth(gpu_type: str = "v100", data_dir: Path | str = DATA_DIR) -> GroundTruth:
    """The shipped ground truth for one GPU type (type table + measured pairs, built once per process): the
    files of ``data_dir``, plus the campaign tables committed under it (:func:`default_campaign_dir`)."""
    campaign = default_campaign_dir(data_dir)
    return GroundTruth(load_type_table(data_dir, gpu_type, campaign_dir=campaign), data_dir, campaign_dir=campaign)


def tenant_speeds(gpu_type: str, tenants, data_dir: Path | str = DATA_DIR, mps_limits: bool = True) -> list[float]:
    """Ground-truth normalised speed of each tenant of one GPU of ``gpu_type`` (the simulator's rules).

    Args:
        gpu_type: GPU type whose measured pairs apply (``v100``, ``p100``, ``k80``, a campaign's ``h200``
            once its tables are committed under ``data_dir``; case-insensitive).
        tenants: ``(job_type, share_pct)`` or ``(job_type, share_pct, util)`` per tenant of the GPU.
            ``job_type`` is a type name (``"ResNet-50 (batch size 64)"``, ``"A3C"``), mapped by
            :func:`type_index` when the table does not hold it exactly, or ``"inference"`` for an
            inference service. ``util`` (fraction of one GPU) overrides the type's fitted solo
            utilisation; an inference tenant without it is assumed to use its whole share. A training
            tenant of a GPU type without data gets :data:`UNKNOWN_TYPE_UTIL` and the utilisation rule.
        data_dir: folder of the measured files.
        mps_limits: shares are enforced MPS limits (training speed capped by ``share_speed``).

    Returns:
        [k] normalised throughputs (co-located / isolated), in the order of ``tenants``.
    """
    truth = default_truth(str(gpu_type).lower().split("_")[0].strip(), data_dir)
    types = truth.types
    idx, shares, utils, training = [], [], [], []
    for t in tenants:
        name, share = t[0], float(t[1])
        util = t[2] if len(t) > 2 else None
        inf = name == INFERENCE_TYPE
        i: int | None
        if inf:
            i = types.inference_index
        else:
            try:
                i = types.index(name)
            except KeyError:
                i = type_index(types, *_split_type_name(name))
        if i is None:  # no training type known on this GPU type: NaN pair row -> utilisation rule
            i, default_u = types.inference_index, UNKNOWN_TYPE_UTIL
        else:
            default_u = share / 100.0 if inf else float(types.solo_util[i])
        idx.append(i)
        shares.append(share)
        utils.append(default_u if util is None else float(util))
        training.append(not inf)
    out = truth.speeds(idx, shares if mps_limits else None, utils, training)
    return [float(x) for x in out]
