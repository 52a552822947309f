"""Campaign JSON -> the derived CSV tables in the project's data schemas, plus a provenance file.

``python3 -m bench.gpu_campaign.derive RUN.json [RUN.json ...] --out DIR`` writes, prefixed with the GPU type
(``h200_...``), from one run or several on one GPU type (a later run measuring what an earlier one could not fit
in its budget); every row names its ``run``, and every rate is normalised by :func:`baselines`; ``--train-only
RUN.json`` (one of the runs, repeatable) keeps only that run's points without a service. The tables:

* ``isolated_throughputs.csv`` -- ``data/gavel_isolated_throughputs.csv``'s columns (training jobs alone at MPS
  100, ``scale_factor`` 1) plus ``precision`` and the solo NVML/GPM counters (the predictor's profile fields);
* ``coloc_pairs.csv`` -- ``data/coloc_gavel_pairs.csv``'s columns for the training+training points, plus their
  MPS shares (``share_a_pct``/``share_b_pct``) and ``env`` (``campaign``);
* ``train_infer_pairs.csv`` -- training+inference points: the training tenant's normalised throughput, the
  service's normalised capacity within its SLO, its p50/p99 at the offered rate, shares and client priorities;
* ``share_curves.csv`` -- every solo point (workload, share, rate, normalised) with the fitted ``u`` of
  ``speed = min(1, share/u)`` and its error;
* ``point_counters.csv`` -- the device counters sampled inside every point's window;
* ``provenance.json`` -- GPU, driver, CUDA, torch, date, the campaign's command and this converter's; per run
  its command, source hash and the points it measured.

Job types follow Gavel's ``"<model> (batch size <n>)"``, with `` [amp]`` appended for bf16-autocast jobs (the
family and batch size still parse the way ``services.predictor.datasets.parse_gavel_job_type`` reads them).
Standard library only.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import shlex
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.gpu_campaign.stats import fit_share_curve
from bench.gpu_campaign.workloads import WORKLOADS, tenant_rate

ISOLATED_COLUMNS = ("worker_type", "job_type", "model", "batch_size", "scale_factor", "isolated_tput", "precision",
                    "sm_util_pct", "mem_bw_util_pct", "tensor_util_pct", "mem_used_mib")
PAIR_COLUMNS = ("gpu_type", "job_type_a", "job_type_b", "model_a", "batch_size_a", "model_b", "batch_size_b",
                "same_type", "isolated_tput_a", "isolated_tput_b", "coloc_tput_a", "coloc_tput_b", "norm_tput_a",
                "norm_tput_b", "norm_tput_sum", "coloc_failed", "a_equals_isolated", "b_equals_isolated",
                "share_a_pct", "share_b_pct", "env", "run")
TI_COLUMNS = ("gpu_type", "stage", "job_type_train", "service", "share_train_pct", "share_service_pct",
              "priority_train", "priority_service", "isolated_tput_train", "coloc_tput_train", "norm_tput_train",
              "solo_max_rps_within_slo", "coloc_max_rps_within_slo", "norm_capacity_service", "offered_rps",
              "served_frac", "p50_ms", "p99_ms", "slo_ms", "failed", "run")
CURVE_COLUMNS = ("gpu_type", "workload", "job_type", "kind", "share_pct", "rate", "norm", "u_fit", "fit_rmse", "fit_n",
                 "run")
COUNTER_COLUMNS = ("gpu_type", "stage", "label", "sm_util_pct", "mem_bw_util_pct", "tensor_util_pct", "mem_used_mib",
                   "run")
FILES = ("isolated_throughputs.csv", "coloc_pairs.csv", "train_infer_pairs.csv", "share_curves.csv",
         "point_counters.csv", "provenance.json")


def job_type(workload: str) -> str:
    """A workload's job-type name in the derived tables."""
    w = WORKLOADS[workload]
    if w.kind == "serve":
        return f"{w.model} serving (max batch {w.batch_size})"
    return f"{w.model} (batch size {w.batch_size})" + (" [amp]" if w.precision == "amp" else "")


def _points(report: dict[str, Any], stage: str) -> list[dict[str, Any]]:
    return [p for p in ((report["stages"].get(stage) or {}).get("result") or {}).get("points") or []
            if not p.get("skipped")]


def _gpu0(rec: dict[str, Any]) -> dict[str, Any]:
    return ((rec.get("counters") or {}).get("gpu0")) or {}


def _write(path: Path, columns: Sequence[str], rows: Iterable[dict[str, Any]]) -> int:
    n = 0
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(columns))
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})
            n += 1
    return n


def _runtime(report: dict[str, Any]) -> dict[str, Any]:
    """GPU, driver, CUDA and torch of one run."""
    env = (report["stages"].get("environment") or {}).get("result") or {}
    nvml = (report["stages"].get("nvml") or {}).get("result") or {}
    tr = env.get("torch_runtime") or {}
    smi = (env.get("smi_query") or "").splitlines()
    smi_row = dict(zip([c.strip() for c in smi[0].split(",")], [c.strip() for c in smi[-1].split(",")])) if len(smi) > 1 else {}
    inv = (nvml.get("inventory") or [{}])[0]
    return {"gpu": tr.get("device") or smi_row.get("name"), "gpu_uuid": inv.get("uuid"), "gpu_type": nvml.get("gpu_type"),
            "driver": smi_row.get("driver_version"), "cuda": tr.get("cuda"),
            "torch": tr.get("torch") or (env.get("packages") or {}).get("torch")}


def _command(report: dict[str, Any]) -> str:
    args = report.get("args") or {}
    return " ".join(["python3", "-m", "bench.gpu_campaign"] + [
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {shlex.quote(str(v))}") for k, v in args.items()
        if v not in (None, False) and k != "params"])


def provenance(runs: Sequence[tuple[dict[str, Any], Path]], argv: Sequence[str]) -> dict[str, Any]:
    """The first run's machine, and per run its date, status, command, source hash and the points it measured."""
    first = runs[0][0]
    return {
        **_runtime(first), "date": first.get("started_at"), "finished_at": runs[-1][0].get("finished_at"),
        "mode": first.get("mode"), "status": first.get("status"), "schema": first.get("schema"),
        "command": _command(first), "window_s": first.get("window_s"), "budget_s": first.get("budget_s"),
        "source": str(runs[0][1]), "source_sha256": hashlib.sha256(runs[0][1].read_bytes()).hexdigest(),
        "derived_by": " ".join(["python3", "-m", "bench.gpu_campaign.derive", *argv]),
        "workloads": first.get("workloads"),
        "runs": [{"run": i, **_runtime(r), "date": r.get("started_at"), "status": r.get("status"),
                  "command": _command(r), "window_s": r.get("window_s"), "source": str(src),
                  "source_sha256": hashlib.sha256(src.read_bytes()).hexdigest(),
                  "points": [p["label"] for st in r["stages"] for p in _points(r, st)]}
                 for i, (r, src) in enumerate(runs, 1)],
    }


def baselines(runs: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
    """Per run, each workload's rate alone at MPS 100 that its points are normalised by.

    A training job's is its fastest solo run over all runs (a repeat is only ever slowed, e.g. by another
    convolution algorithm chosen at warm-up); a service's stays its own run's, since each run fixes the service's
    offered rate and SLO from its own first solo point.
    """
    own = [{p["tenants"][0]["workload"]: tenant_rate(p["tenants"][0]) for p in _points(r, "solo") if p.get("tenants")}
           for r in runs]
    best: dict[str, float] = {}
    for b in own:
        for w, v in b.items():
            if v and WORKLOADS[w].kind == "train":
                best[w] = max(best.get(w, 0.0), v)
    return [{**{w: v for w, v in b.items() if v and WORKLOADS[w].kind == "serve"}, **best} for b in own]


def derive(runs: Sequence[tuple[dict[str, Any], Path]], out: Path, argv: Sequence[str] = (),
           train_only: Sequence[int] = ()) -> dict[str, int]:
    """Write every table of the module docstring into ``out`` from one or more runs on one GPU type; rows written
    per file. Each row carries its ``run`` (1-based, as in the provenance file's ``runs``). Runs numbered in
    ``train_only`` give their training-only points and nothing that involves a service (e.g. measured by a
    harness whose service figures are known to be wrong)."""
    prov = provenance(runs, argv)
    for r in prov["runs"]:
        r["services_used"] = r["run"] not in train_only
    gpu = prov["gpu_type"] or "unknown"
    others = {r["run"]: r["gpu_type"] for r in prov["runs"] if r["gpu_type"] != prov["gpu_type"]}
    if others:
        raise ValueError(f"runs on other GPU types than run 1's {prov['gpu_type']!r}: {others}")
    out.mkdir(parents=True, exist_ok=True)
    bases = baselines([r for r, _ in runs])

    def norm(t: dict[str, Any], base: dict[str, float]) -> float | None:
        rate, b = tenant_rate(t), base.get(t["workload"])
        if rate is None and WORKLOADS[t["workload"]].kind == "serve" and not t.get("error") and b:
            return 0.0  # the service met its SLO at no rate searched: below every rate it was offered
        return rate / b if rate is not None and b else None

    iso, tt, ti, curves, counters = [], [], [], [], []
    best = bases[0]
    for w, v in best.items():
        wl = WORKLOADS[w]
        if wl.kind != "train":
            continue
        solo = next(p for r, _ in runs for p in _points(r, "solo") if p["tenants"][0]["workload"] == w
                    and tenant_rate(p["tenants"][0]) == v)
        iso.append({"worker_type": gpu, "job_type": job_type(w), "model": wl.model, "batch_size": wl.batch_size,
                    "scale_factor": 1, "isolated_tput": v, "precision": wl.precision, **_gpu0(solo)})
    shares: dict[str, list[tuple[float, float]]] = {}
    for run, ((report, _), base) in enumerate(zip(runs, bases), 1):
        services = run not in train_only
        for stage in ("pairs", "priority", "splits"):
            for p in _points(report, stage):
                ts = p.get("tenants") or []
                if len(ts) != 2:
                    continue
                kinds = [WORKLOADS[t["workload"]].kind for t in ts]
                if "serve" in kinds and not services:
                    continue
                if kinds == ["train", "train"]:
                    a, b = ts
                    na, nb = norm(a, base), norm(b, base)
                    tt.append({"gpu_type": gpu, "job_type_a": job_type(a["workload"]),
                               "job_type_b": job_type(b["workload"]), "model_a": WORKLOADS[a["workload"]].model,
                               "batch_size_a": WORKLOADS[a["workload"]].batch_size,
                               "model_b": WORKLOADS[b["workload"]].model,
                               "batch_size_b": WORKLOADS[b["workload"]].batch_size,
                               "same_type": int(a["workload"] == b["workload"]),
                               "isolated_tput_a": base.get(a["workload"]), "isolated_tput_b": base.get(b["workload"]),
                               "coloc_tput_a": tenant_rate(a), "coloc_tput_b": tenant_rate(b), "norm_tput_a": na, "norm_tput_b": nb,
                               "norm_tput_sum": (na + nb) if na is not None and nb is not None else None,
                               "coloc_failed": int(bool(a.get("error") or b.get("error"))), "a_equals_isolated": 0,
                               "b_equals_isolated": 0, "share_a_pct": a.get("share_pct"),
                               "share_b_pct": b.get("share_pct"), "env": "campaign", "run": run})
                elif sorted(kinds) == ["serve", "train"]:
                    tr, sv = (ts[0], ts[1]) if kinds[0] == "train" else (ts[1], ts[0])
                    pr = dict(zip([t["workload"] for t in ts], p.get("priorities") or [None, None]))
                    det, lat = sv.get("detail") or {}, sv.get("latency_ms") or {}
                    ti.append({"gpu_type": gpu, "stage": stage, "job_type_train": job_type(tr["workload"]),
                               "service": job_type(sv["workload"]), "share_train_pct": tr.get("share_pct"),
                               "share_service_pct": sv.get("share_pct"), "priority_train": pr.get(tr["workload"]),
                               "priority_service": pr.get(sv["workload"]),
                               "isolated_tput_train": base.get(tr["workload"]), "coloc_tput_train": tenant_rate(tr),
                               "norm_tput_train": norm(tr, base), "solo_max_rps_within_slo": base.get(sv["workload"]),
                               "coloc_max_rps_within_slo": det.get("max_rps_within_slo"),
                               "norm_capacity_service": norm(sv, base), "offered_rps": det.get("rate_rps"),
                               "served_frac": det.get("served_frac"), "p50_ms": lat.get("p50"),
                               "p99_ms": lat.get("p99"), "slo_ms": det.get("slo_ms"),
                               "failed": int(bool(tr.get("error") or sv.get("error"))), "run": run})
        for p in _points(report, "solo") + _points(report, "shares"):
            for t in p.get("tenants") or []:
                if WORKLOADS[t["workload"]].kind == "serve" and not services:
                    continue
                y = norm(t, base)
                curves.append({"gpu_type": gpu, "workload": t["workload"], "job_type": job_type(t["workload"]),
                               "kind": WORKLOADS[t["workload"]].kind, "share_pct": t.get("share_pct"),
                               "rate": tenant_rate(t), "norm": y, "run": run})
                if y is not None:
                    shares.setdefault(t["workload"], []).append((float(t.get("share_pct") or 100), y))
        counters += [{"gpu_type": gpu, "stage": st, "label": p["label"], **_gpu0(p), "run": run}
                     for st in report["stages"] for p in _points(report, st)]
    fits = {w: fit_share_curve(pts) for w, pts in shares.items()}
    for c in curves:
        f = fits.get(c["workload"]) or {}
        c.update(u_fit=f.get("u"), fit_rmse=f.get("rmse"), fit_n=f.get("n"))
    n = {"isolated_throughputs.csv": _write(out / f"{gpu}_isolated_throughputs.csv", ISOLATED_COLUMNS, iso),
         "coloc_pairs.csv": _write(out / f"{gpu}_coloc_pairs.csv", PAIR_COLUMNS, tt),
         "train_infer_pairs.csv": _write(out / f"{gpu}_train_infer_pairs.csv", TI_COLUMNS, ti),
         "share_curves.csv": _write(out / f"{gpu}_share_curves.csv", CURVE_COLUMNS, curves),
         "point_counters.csv": _write(out / f"{gpu}_point_counters.csv", COUNTER_COLUMNS, counters)}
    (out / f"{gpu}_provenance.json").write_text(json.dumps(prov, indent=1, default=str) + "\n")
    n["provenance.json"] = 1
    return n


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python3 -m bench.gpu_campaign.derive", description=__doc__.split("\n\n")[0])
    ap.add_argument("json", type=Path, nargs="+", help="the campaign's gpu_campaign.json, one per run (same GPU type)")
    ap.add_argument("--out", type=Path, default=Path("."), help="folder for the tables (default .)")
    ap.add_argument("--train-only", type=Path, action="append", default=[], metavar="RUN.json",
                    help="one of the runs whose points with a service are left out (its training-only points are "
                         "kept); repeatable")
    args = ap.parse_args(argv)
    given, wanted = [p.resolve() for p in args.json], {p.resolve() for p in args.train_only}
    if wanted - set(given):
        print(f"derive: --train-only names a file that is not one of the runs: "
              f"{', '.join(sorted(map(str, wanted - set(given))))}", file=sys.stderr)
        return 2
    train_only = [i for i, p in enumerate(given, 1) if p in wanted]
    runs = []
    for path in args.json:
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"derive: cannot read {path}: {exc}", file=sys.stderr)
            return 2
        if report.get("schema") != "elastico.gpu_campaign/1" or "stages" not in report:
            print(f"derive: {path} is not a campaign report (schema {report.get('schema')!r}, needs stages)",
                  file=sys.stderr)
            return 2
        runs.append((report, path))
    try:
        n = derive(runs, args.out, argv, train_only)
    except ValueError as exc:
        print(f"derive: {exc}", file=sys.stderr)
        return 2
    print("  ".join(f"{k}: {v} rows" for k, v in n.items() if k != "provenance.json") + f"  -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
