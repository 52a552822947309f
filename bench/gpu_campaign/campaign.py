"""The campaign run: the device check's environment, NVML and MPS machinery, then the planned points in order.

Every point is one :meth:`Runner.measure` (tenants as child processes, one common window, NVML/GPM counters
sampled inside it, MPS health); a serving tenant's rate search runs in the tail after the window while its
co-tenants keep their load. Rates are normalised to the same workload alone at MPS 100 (a service's rate is the
highest rate it served within its SLO); its offered rate and SLO are fixed by its first solo run and kept for every
later point, so its latencies compare across points.

Prepare-ahead: an MPS share is fixed when a client creates its CUDA context, so every point has fresh processes,
but the next point's are spawned as soon as the current one's tenants start (``prepared_after``): they import
torch, create their context and build their models on the CPU, then wait, idle -- no kernel, no copy to the GPU --
for their start line, sent when the current point is over; only their warm-up is then waited for. During a window
the prepared tenants are MPS clients with a context and no work: they show in MPS and NVML process lists
(``prepared_next`` names them) and use CPU cores for their start-up, not SMs.
"""

from __future__ import annotations

import contextlib
import functools
import json
from typing import Any

from bench.device_check.host import find_tool
from bench.device_check.measurement import Child, TenantSpec
from bench.device_check.stages import DeviceCheck
from bench.gpu_campaign.stats import fit_share_curve
from bench.gpu_campaign.workloads import (
    DEFAULT_WINDOW_S,
    DRY_WINDOW_S,
    MEMHOG_LIMIT_MIB,
    QUICK_WINDOW_S,
    WORKLOADS,
    Point,
    estimate_s,
    prepared_after,
    select_plan,
    tenant_rate,
)

SCHEMA = "elastico.gpu_campaign/1"
JSON_NAME = "gpu_campaign.json"
STAGES = ("solo", "pairs", "isolation", "priority", "shares", "splits")  # the plan's stages, in running order


class Campaign(DeviceCheck):
    """One campaign run (see the package docstring); the report is rewritten after every point."""

    worker_module = "bench.gpu_campaign"
    schema = SCHEMA
    json_name = JSON_NAME
    workload_docs = {name: w.description for name, w in WORKLOADS.items()}
    windows = (DEFAULT_WINDOW_S, QUICK_WINDOW_S, DRY_WINDOW_S)

    def _plan(self) -> dict[str, Any]:
        self.tail_s = self.window  # a service's rate search after the window
        self.solo: dict[str, dict[int, float]] = {}  # workload -> MPS share -> solo rate
        self.cal: dict[str, dict[str, float]] = {}  # service -> offered rate and SLO fixed by its first solo run
        self.points = select_plan(bool(self.args.quick), self.args.points)  # (--points checked in main)
        self.ahead: tuple[Point, list[Child]] | None = None  # the next point's tenants, started while one measures
        fixed = 1.0 if self.dry else 20.0  # environment, NVML, MPS start and its probe client
        rows, cum = [], fixed
        for k, p in enumerate(self.points):
            prev = self.points[k - 1] if k else None
            est = estimate_s(p, self.window, self.tail_s, self.dry, prev)
            cum += est
            rows.append({"stage": p.stage, "label": p.label, "kind": p.kind, "est_s": est, "cum_s": round(cum, 1),
                         "prepared_ahead": prepared_after(prev), "fits_budget": cum <= self.budget,
                         "tenants": [{"workload": w, "share_pct": s, "priority": pr} for w, s, pr in p.tenants]})
        return {"measurements": len(rows), "estimated_s": round(cum, 1), "fixed_s": fixed, "tail_s": self.tail_s,
                "points": rows, "expected_to_fit": sum(r["fits_budget"] for r in rows)}

    def banner(self) -> str:
        p = self.report["plan"]
        lines = [f"ElastiCo GPU campaign ({self.report['mode']}): window {self.window:g} s + {p['tail_s']:g} s rate "
                 f"search for services, budget {self.budget:g} s; {p['measurements']} points, ~{p['estimated_s']:.0f} s "
                 f"with each point's tenants prepared during the one before (* not prepared ahead; "
                 f"{p['expected_to_fit']} expected within the budget; the rest is skipped); JSON -> "
                 f"{self.out / self.json_name}",
                 f"  {'#':>3} {'stage':<10} {'est s':>6} {'cum s':>6}  point"]
        for i, r in enumerate(p["points"], 1):
            lines.append(f"  {i:>3} {r['stage']:<10} {r['est_s']:>6.1f} {r['cum_s']:>6.0f} "
                         f"{' ' if r['prepared_ahead'] else '*'}{r['label']}"
                         + ("" if r["fits_budget"] else "   (beyond budget)"))
        return "\n".join(lines)

    # --- stages -------------------------------------------------------------------------------------
    def stage_list(self) -> list[tuple[str, Any, float]]:
        out: list[tuple[str, Any, float]] = [("environment", self.stage_environment, 1.0 if self.dry else 10.0),
                                             ("nvml", self.open_backend, 0.5 if self.dry else 3.0),
                                             ("mps", self.stage_mps_start, self.measurement_cost(0.3))]
        for st in STAGES:
            pts = [p for p in self.points if p.stage == st]
            if pts:  # a stage starts only when its cheapest point would pass measure()'s own budget check
                out.append((st, lambda res, pts=pts: self.run_points(pts, res), self.measurement_cost(self.window)))
        return out

    def stage_mps_start(self, res: dict[str, Any]) -> None:
        """The daemon for the whole run (quit in ``cleanup``) and one light client through it."""
        ctl = self.start_mps(res)
        res["pinned_mem_limit_mib"] = self._mps_mem_mib()
        probe = self.measure("mps probe (memhog, 1 MiB)", "mps", [TenantSpec(
            "probe", "memhog", 100, dict(ctl.client_env((0,), 100, self._mps_mem_mib())),
            start_line="start " + json.dumps({"alloc_mib": 1}))], min(0.3, self.window), mps=ctl)
        res["probe"] = probe
        if probe["error"]:
            res["reason"] = f"first MPS client failed: {probe['error']}"
            raise RuntimeError(res["reason"] + "; the points run time-sliced, shares and limits unenforced")
        self.mps_ok = res["available"] = True
        res["client_env_example"] = dict(ctl.client_env((0,), 50, self._mps_mem_mib()))
        res["client_priority"] = self.priority_offered()

    def priority_offered(self) -> dict[str, Any]:
        """Whether this driver's MPS knows client priorities (its control binary names the command)."""
        if self.dry:
            return {"offered": True, "how": "simulated MPS (dry run)"}
        binary = find_tool("nvidia-cuda-mps-control")
        try:
            data = open(binary, "rb").read() if binary else b""  # noqa: SIM115 - a one-shot read
        except OSError as exc:
            return {"offered": False, "how": f"cannot read {binary}: {exc}"}
        found = b"client_priority" in data or b"CLIENT_PRIORITY" in data
        return {"offered": found, "how": f"'client_priority' {'found' if found else 'absent'} in {binary}"}

    def cleanup(self) -> None:
        self._discard_ahead()
        if self.mps_ctl is not None:
            res = self.report["stages"].get("mps", {}).setdefault("result", {})
            self._stop_mps(self.mps_ctl, res)
            self.mps_ctl = None

    def _spec(self, p: Point, i: int) -> TenantSpec:
        w, share, prio = p.tenants[i]
        names = [t[0] for t in p.tenants]
        label = f"{w}#{i + 1}" if names.count(w) > 1 else w
        wl = WORKLOADS[w]
        env: dict[str, str] = {}
        if self.mps_ok:
            mem = MEMHOG_LIMIT_MIB if p.kind == "memlimit" and w == "memhog" else self._mps_mem_mib()
            env = dict(self.mps_ctl.client_env((0,), share, mem))
        if prio is not None:
            env["CUDA_MPS_CLIENT_PRIORITY"] = str(prio)
        params: dict[str, Any] = {"tail_s": p.tail_s(self.tail_s), "seed": 1 + i}
        if wl.kind == "serve" and w in self.cal:
            params.update(self.cal[w])
        if w == "memhog":
            params["alloc_mib"] = 2 * MEMHOG_LIMIT_MIB
        # the settings travel on the start line: a service's offered rate may come from the point just measured
        return TenantSpec(label, w, share if self.mps_ok else None, env, start_line="start " + json.dumps(params))

    def _discard_ahead(self) -> None:
        if self.ahead is not None:
            for c in self.ahead[1]:
                c.discard()
            self.ahead = None

    def _take_prepared(self, p: Point) -> list[Child] | None:
        """The tenants prepared for ``p`` (None: spawn them now); prepared ones for another point are discarded."""
        if self.ahead is not None and self.ahead[0] is p:
            children = self.ahead[1]
            self.ahead = None
            return children
        self._discard_ahead()
        return None

    def _prepare_after(self, p: Point, rec: dict[str, Any]) -> None:
        """Spawn the tenants of the point after ``p`` (they stop, idle, before their warm-up; see the docstring)."""
        k = next(i for i, q in enumerate(self.points) if q is p)
        nxt = self.points[k + 1] if k + 1 < len(self.points) else None
        if nxt is None or not prepared_after(p) or self._skip_reason(nxt):
            return
        specs = [self._spec(nxt, i) for i in range(len(nxt.tenants))]
        children = [self.spawn(s.label, s.workload, self.window, self.child_env(s.env), s.args) for s in specs]
        self.ahead = (nxt, children)
        rec["prepared_next"] = {"point": nxt.label, "pids": {c.label: c.proc.pid for c in children}}

    def _skip_reason(self, p: Point) -> str | None:
        if self.mps_ok:
            return None
        if any(s != 100 for _, s, _ in p.tenants) or any(pr is not None for _, _, pr in p.tenants):
            return "MPS unavailable: shares and priorities cannot be enforced"
        if p.kind == "memlimit":
            return "MPS unavailable: no pinned memory limit"
        return None

    def run_points(self, pts: list[Point], res: dict[str, Any]) -> None:
        recs: list[dict[str, Any]] = []
        res["points"] = recs
        for p in pts:
            why = self._skip_reason(p)
            if why:
                recs.append({"label": p.label, "stage": p.stage, "point_kind": p.kind, "skipped": True,
                             "error": f"skipped: {why}", "tenants": []})
                continue
            specs = [self._spec(p, i) for i in range(len(p.tenants))]
            ctl = self.mps_ctl if self.mps_ok else None
            prepared = self._take_prepared(p)
            nxt: dict[str, Any] = {}
            rec = self.measure(p.label, "mps" if self.mps_ok else "time-slicing", specs, self.window, mps=ctl,
                               tail_s=p.tail_s(self.tail_s), per_tenant=True,
                               during=self._fault_probe if p.kind == "fault" and ctl is not None else None,
                               result_grace_s=15.0 if p.kind == "fault" else 60.0,
                               prepared=prepared, on_start=functools.partial(self._prepare_after, p, nxt))
            if rec.get("skipped") and prepared:
                for c in prepared:
                    c.discard()
            rec.update(nxt)
            rec.update(stage=p.stage, point_kind=p.kind, shares=[s for _, s, _ in p.tenants],
                       priorities=[pr for _, _, pr in p.tenants])
            self._derive(p, rec)
            recs.append(rec)
            self.write()
        if pts[0].stage == "shares":
            res["fits"] = self.fits()
        failed = [r["label"] for r in recs if r.get("error") and r.get("point_kind") not in ("fault",)]
        if failed:
            raise RuntimeError(f"{len(failed)} point(s) failed or skipped: {'; '.join(failed)}")

    def _fault_probe(self) -> dict[str, Any]:
        """Inside the fault point's window: the fault as the node agent sees it (``fault_events``) and MPS health."""
        ctl = self.mps_ctl
        if self.dry:
            ctl.inject_fault(0)  # the simulated daemon then ends every client of GPU 0, as a real fatal fault does
        events = ctl.fault_events()
        h = ctl.health()
        return {"fault_events": [{"client_pids": sorted(e.client_pids), "detail": e.detail} for e in events],
                "health": {"state": h.state, "servers": list(h.server_pids), "clients": sorted(h.client_pids),
                           "detail": h.detail}}

    def _derive(self, p: Point, rec: dict[str, Any]) -> None:
        """Baselines and calibration from solo points; every tenant's rate normalised to its solo MPS 100 rate."""
        for t in rec["tenants"]:
            rate = tenant_rate(t)
            t["rate"] = rate
            w = t["workload"]
            if p.stage in ("solo", "shares") and rate is not None:
                self.solo.setdefault(w, {})[t["share_pct"] or 100] = rate
            if p.stage == "solo" and WORKLOADS[w].kind == "serve" and w not in self.cal and t.get("ready_detail"):
                self.cal[w] = {"rate": t["ready_detail"]["rate_rps"], "slo_ms": t["ready_detail"]["slo_ms"]}
            base = self.solo.get(w, {}).get(100)
            t["norm"] = rate / base if rate is not None and base else None
        norms = [t["norm"] for t in rec["tenants"] if WORKLOADS[t["workload"]].kind != "probe"]
        rec["combined_norm"] = sum(norms) if norms and all(n is not None for n in norms) else None
        if p.kind == "memlimit":
            hog = next((t for t in rec["tenants"] if t["workload"] == "memhog"), {})
            other = [t for t in rec["tenants"] if t["workload"] != "memhog"]
            rec["limit_enforced"] = bool((hog.get("detail") or {}).get("alloc_failed"))
            rec["cotenant_unharmed"] = all(not t.get("error") for t in other)
        if p.kind == "fault":
            rec["cotenants"] = [{"label": t["label"], "survived": not t.get("error"), "error": t.get("error")}
                                for t in rec["tenants"] if t["workload"] != "fault"]
            if self.mps_ctl is not None:
                with contextlib.suppress(Exception):
                    h = self.mps_ctl.health()
                    rec["health_after"] = {"state": h.state, "clients": sorted(h.client_pids), "detail": h.detail}
        if p.kind == "recovery":
            rec["recovered"] = rec["error"] is None

    def fits(self) -> dict[str, Any]:
        """``speed = min(1, share/u)`` fitted per workload to its solo points (normalised to MPS 100)."""
        out = {}
        for w, by_share in self.solo.items():
            base = by_share.get(100)
            if not base:
                continue
            pts = [(float(s), r / base) for s, r in sorted(by_share.items())]
            out[w] = {**fit_share_curve(pts), "points": [[s, round(y, 4)] for s, y in pts]}
        return out

    def summary(self) -> list[str]:
        return summary_lines(self.report)


def _f(x: Any, fmt: str = "{:.2f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The readable end-of-run summary (also stored in the JSON)."""
    out = ["", "=" * 110, f"ElastiCo GPU campaign -- {report['mode']}, status {report['status']}, "
           f"{report['elapsed_s']:.0f} s, window {report['window_s']:g} s", "=" * 110]
    st = report["stages"]
    for name, s in st.items():
        out.append(f"  {name:<12} {s['status']:<11} {_f(s.get('elapsed_s'), '{:.1f}')} s"
                   + (f"  {str(s['error'])[:140]}" if s.get("error") else ""))
    for name in STAGES:
        recs = ((st.get(name) or {}).get("result") or {}).get("points") or []
        if recs:
            out.append(f"{name}: tenant rate (norm vs solo MPS 100) [service p50/p99 ms at offered rate]")
        for r in recs:
            parts = []
            for t in r.get("tenants", []):
                lat = t.get("latency_ms") or {}
                extra = f" [{_f(lat.get('p50'))}/{_f(lat.get('p99'))}]" if lat else ""
                parts.append(f"{t['label']} {_f(t.get('rate'), '{:.1f}')} ({_f(t.get('norm'))}){extra}"
                             if not t.get("error") else f"{t['label']} FAILED")
            tail = f"  sum {_f(r.get('combined_norm'))}" if r.get("combined_norm") is not None else ""
            flags = "".join(f"  {k}={r[k]}" for k in ("limit_enforced", "cotenant_unharmed", "recovered") if k in r)
            out.append(f"  {r['label']:<48} " + ("  +  ".join(parts) or str(r.get("error"))[:80]) + tail + flags)
    fits = ((st.get("shares") or {}).get("result") or {}).get("fits") or {}
    for w, f in fits.items():
        out.append(f"  fit {w:<14} u={_f(f.get('u'), '{:.3f}')} rmse={_f(f.get('rmse'), '{:.3f}')} n={f.get('n')}")
    return out
