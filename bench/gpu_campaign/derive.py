"""Campaign JSON -> the derived CSV tables in the project's data schemas, plus a provenance file.

``python3 -m bench.gpu_campaign.derive RUN.json --out DIR`` writes, prefixed with the GPU type (``h200_...``):

* ``isolated_throughputs.csv`` -- ``data/gavel_isolated_throughputs.csv``'s columns (training jobs alone at MPS
  100, ``scale_factor`` 1) plus ``precision`` and the solo NVML/GPM counters (the predictor's profile fields);
* ``coloc_pairs.csv`` -- ``data/coloc_gavel_pairs.csv``'s columns for the training+training points, plus their
  MPS shares (``share_a_pct``/``share_b_pct``) and ``env`` (``campaign``);
* ``train_infer_pairs.csv`` -- training+inference points: the training tenant's normalised throughput, the
  service's normalised capacity within its SLO, its p50/p99 at the offered rate, shares and client priorities;
* ``share_curves.csv`` -- every solo point (workload, share, rate, normalised) with the fitted ``u`` of
  ``speed = min(1, share/u)`` and its error;
* ``point_counters.csv`` -- the device counters sampled inside every point's window;
* ``provenance.json`` -- GPU, driver, CUDA, torch, date, the campaign's command and this converter's.

Job types follow Gavel's ``"<model> (batch size <n>)"``, with `` [amp]`` appended for bf16-autocast jobs (the
family and batch size still parse the way ``services.predictor.datasets.parse_gavel_job_type`` reads them).
Standard library only.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.gpu_campaign.workloads import WORKLOADS

ISOLATED_COLUMNS = ("worker_type", "job_type", "model", "batch_size", "scale_factor", "isolated_tput", "precision",
                    "sm_util_pct", "mem_bw_util_pct", "tensor_util_pct", "mem_used_mib")
PAIR_COLUMNS = ("gpu_type", "job_type_a", "job_type_b", "model_a", "batch_size_a", "model_b", "batch_size_b",
                "same_type", "isolated_tput_a", "isolated_tput_b", "coloc_tput_a", "coloc_tput_b", "norm_tput_a",
                "norm_tput_b", "norm_tput_sum", "coloc_failed", "a_equals_isolated", "b_equals_isolated",
                "share_a_pct", "share_b_pct", "env")
TI_COLUMNS = ("gpu_type", "stage", "job_type_train", "service", "share_train_pct", "share_service_pct",
              "priority_train", "priority_service", "isolated_tput_train", "coloc_tput_train", "norm_tput_train",
              "solo_max_rps_within_slo", "coloc_max_rps_within_slo", "norm_capacity_service", "offered_rps",
              "served_frac", "p50_ms", "p99_ms", "slo_ms", "failed")
CURVE_COLUMNS = ("gpu_type", "workload", "job_type", "kind", "share_pct", "rate", "norm", "u_fit", "fit_rmse", "fit_n")
COUNTER_COLUMNS = ("gpu_type", "stage", "label", "sm_util_pct", "mem_bw_util_pct", "tensor_util_pct", "mem_used_mib")
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


def provenance(report: dict[str, Any], source: Path, argv: Sequence[str]) -> dict[str, Any]:
    env = (report["stages"].get("environment") or {}).get("result") or {}
    nvml = (report["stages"].get("nvml") or {}).get("result") or {}
    tr = env.get("torch_runtime") or {}
    smi = (env.get("smi_query") or "").splitlines()
    smi_row = dict(zip([c.strip() for c in smi[0].split(",")], [c.strip() for c in smi[-1].split(",")])) if len(smi) > 1 else {}
    inv = (nvml.get("inventory") or [{}])[0]
    args = report.get("args") or {}
    cmd = ["python3", "-m", "bench.gpu_campaign"] + [
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in args.items()
        if v not in (None, False) and k != "params"]
    return {
        "gpu": tr.get("device") or smi_row.get("name"), "gpu_uuid": inv.get("uuid"), "gpu_type": nvml.get("gpu_type"),
        "driver": smi_row.get("driver_version"), "cuda": tr.get("cuda"),
        "torch": tr.get("torch") or (env.get("packages") or {}).get("torch"),
        "date": report.get("started_at"), "finished_at": report.get("finished_at"), "mode": report.get("mode"),
        "status": report.get("status"), "schema": report.get("schema"), "command": " ".join(cmd),
        "window_s": report.get("window_s"), "budget_s": report.get("budget_s"),
        "source": str(source), "source_sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
        "derived_by": " ".join(["python3", "-m", "bench.gpu_campaign.derive", *argv]),
        "workloads": report.get("workloads"),
    }


def derive(report: dict[str, Any], source: Path, out: Path, argv: Sequence[str] = ()) -> dict[str, int]:
    """Write every table of the module docstring into ``out``; rows written per file."""
    prov = provenance(report, source, argv)
    gpu = prov["gpu_type"] or "unknown"
    out.mkdir(parents=True, exist_ok=True)
    solo = {p["tenants"][0]["workload"]: p for p in _points(report, "solo") if p.get("tenants")}
    base = {w: p["tenants"][0].get("rate") for w, p in solo.items()}
    iso = []
    for w, p in solo.items():
        wl, c = WORKLOADS[w], _gpu0(p)
        if wl.kind != "train" or base.get(w) is None:
            continue
        iso.append({"worker_type": gpu, "job_type": job_type(w), "model": wl.model, "batch_size": wl.batch_size,
                    "scale_factor": 1, "isolated_tput": base[w], "precision": wl.precision, **c})
    tt, ti = [], []
    for stage in ("pairs", "priority", "splits"):
        for p in _points(report, stage):
            ts = p.get("tenants") or []
            if len(ts) != 2:
                continue
            kinds = [WORKLOADS[t["workload"]].kind for t in ts]
            if kinds == ["train", "train"]:
                a, b = ts
                failed = bool(a.get("error") or b.get("error"))
                na, nb = a.get("norm"), b.get("norm")
                tt.append({"gpu_type": gpu, "job_type_a": job_type(a["workload"]), "job_type_b": job_type(b["workload"]),
                           "model_a": WORKLOADS[a["workload"]].model, "batch_size_a": WORKLOADS[a["workload"]].batch_size,
                           "model_b": WORKLOADS[b["workload"]].model, "batch_size_b": WORKLOADS[b["workload"]].batch_size,
                           "same_type": int(a["workload"] == b["workload"]), "isolated_tput_a": base.get(a["workload"]),
                           "isolated_tput_b": base.get(b["workload"]), "coloc_tput_a": a.get("rate"),
                           "coloc_tput_b": b.get("rate"), "norm_tput_a": na, "norm_tput_b": nb,
                           "norm_tput_sum": (na + nb) if na is not None and nb is not None else None,
                           "coloc_failed": int(failed), "a_equals_isolated": 0, "b_equals_isolated": 0,
                           "share_a_pct": a.get("share_pct"), "share_b_pct": b.get("share_pct"), "env": "campaign"})
            elif sorted(kinds) == ["serve", "train"]:
                tr, sv = (ts[0], ts[1]) if kinds[0] == "train" else (ts[1], ts[0])
                pr = dict(zip([t["workload"] for t in ts], p.get("priorities") or [None, None]))
                det, lat = sv.get("detail") or {}, sv.get("latency_ms") or {}
                ti.append({"gpu_type": gpu, "stage": stage, "job_type_train": job_type(tr["workload"]),
                           "service": job_type(sv["workload"]), "share_train_pct": tr.get("share_pct"),
                           "share_service_pct": sv.get("share_pct"), "priority_train": pr.get(tr["workload"]),
                           "priority_service": pr.get(sv["workload"]), "isolated_tput_train": base.get(tr["workload"]),
                           "coloc_tput_train": tr.get("rate"), "norm_tput_train": tr.get("norm"),
                           "solo_max_rps_within_slo": base.get(sv["workload"]),
                           "coloc_max_rps_within_slo": det.get("max_rps_within_slo"),
                           "norm_capacity_service": sv.get("norm"), "offered_rps": det.get("rate_rps"),
                           "served_frac": det.get("served_frac"), "p50_ms": lat.get("p50"), "p99_ms": lat.get("p99"),
                           "slo_ms": det.get("slo_ms"), "failed": int(bool(tr.get("error") or sv.get("error")))})
    fits = ((report["stages"].get("shares") or {}).get("result") or {}).get("fits") or {}
    curves = []
    for p in _points(report, "solo") + _points(report, "shares"):
        for t in p.get("tenants") or []:
            f = fits.get(t["workload"]) or {}
            curves.append({"gpu_type": gpu, "workload": t["workload"], "job_type": job_type(t["workload"]),
                           "kind": WORKLOADS[t["workload"]].kind, "share_pct": t.get("share_pct"),
                           "rate": t.get("rate"), "norm": t.get("norm"), "u_fit": f.get("u"),
                           "fit_rmse": f.get("rmse"), "fit_n": f.get("n")})
    counters = [{"gpu_type": gpu, "stage": st, "label": p["label"], **_gpu0(p)}
                for st in report["stages"] for p in _points(report, st)]
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
    ap.add_argument("json", type=Path, help="the campaign's gpu_campaign.json")
    ap.add_argument("--out", type=Path, default=Path("."), help="folder for the tables (default .)")
    args = ap.parse_args(argv)
    try:
        report = json.loads(args.json.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"derive: cannot read {args.json}: {exc}", file=sys.stderr)
        return 2
    if report.get("schema") != "elastico.gpu_campaign/1" or "stages" not in report:
        print(f"derive: {args.json} is not a campaign report (schema {report.get('schema')!r}, needs stages)",
              file=sys.stderr)
        return 2
    n = derive(report, args.json, args.out, argv)
    print("  ".join(f"{k}: {v} rows" for k, v in n.items() if k != "provenance.json") + f"  -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
