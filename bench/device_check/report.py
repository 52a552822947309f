"""The readable end-of-run summary, built from the report alone (it is stored in the JSON too)."""

from __future__ import annotations

from typing import Any

from bench.device_check.workloads import MPS_SHARES, PAIR_SHARES, WORKLOADS


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


def _pair_line(rec: dict[str, Any]) -> str:
    if rec.get("error") and not rec.get("tenants"):
        return f"  {rec.get('pair', rec['label']):<22} {str(rec['error'])[:90]}"
    parts = [f"{t['label']} {_f(t['steps_per_s'])}/s ({_f(t.get('norm'), '{:.2f}')})" for t in rec["tenants"]]
    total = _f(rec.get("combined_norm"), "{:.2f}")
    return f"  {rec.get('pair', rec['label']):<22} " + "  +  ".join(parts) + f"   sum {total}"


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The readable end-of-run summary (also stored in the JSON)."""
    st = report["stages"]
    title = (f"ElastiCo device check -- {report['mode']}, status {report['status']}, "
             f"{report['elapsed_s']:.0f} s, window {report['window_s']:g} s")
    out = ["", "=" * 100, title, "=" * 100]
    for name, s in st.items():
        out.append(f"  {name:<12} {s['status']:<11} {_f(s.get('elapsed_s'))} s"
                   + (f"  {str(s['error'])[:150]}" if s.get("error") else ""))
    env = (st.get("environment") or {}).get("result", {})
    if env:
        tr = env.get("torch_runtime") or {}
        torch_v = tr.get("torch") or env.get("packages", {}).get("torch")
        out.append(f"GPU: {tr.get('device', '?')} ({tr.get('sm_count', '?')} SMs)  torch {torch_v} "
                   f"CUDA {tr.get('cuda', '?')}  mps-control {env.get('mps_control')}")
        if env.get("smi_query"):
            out.append("nvidia-smi: " + " | ".join(env["smi_query"].splitlines()[-1:]))
    nv = (st.get("nvml") or {}).get("result", {})
    if nv.get("comparison"):
        c = nv["comparison"]
        out.append(f"NVML ({nv.get('backend')}, gpu_type {nv.get('gpu_type')}, GPM {nv.get('gpm_supported')}): "
                   + ", ".join(f"{k} {_f(v['idle'])} -> {_f(v['load'])}" for k, v in c.items())
                   + f"; higher under load: {nv.get('util_higher_under_load')}")
    solo = (st.get("solo") or {}).get("result", {}).get("runs", {})
    mps = (st.get("mps") or {}).get("result", {})
    if solo or mps.get("solo"):
        out.append(f"{'steps/s':<12} {'no MPS':>10} " + " ".join(f"{'MPS ' + str(s):>10}" for s in MPS_SHARES)
                   + "   share limit 50 / 25 (vs MPS 100)")
        for w in WORKLOADS:
            plain = (solo.get(w) or {}).get("tenants") or [{}]
            row = [f"{w:<12} {_f(plain[0].get('steps_per_s')):>10}"]
            for s in MPS_SHARES:
                t = (((mps.get("solo") or {}).get(w) or {}).get(str(s)) or {}).get("tenants") or [{}]
                row.append(f"{_f(t[0].get('steps_per_s')):>10}")
            lim = (mps.get("share_limit") or {}).get(w) or {}
            out.append(" ".join(row) + f"   {_f(lim.get('50'), '{:.2f}')} / {_f(lim.get('25'), '{:.2f}')}")
    if mps:
        out.append(f"MPS: available={mps.get('available')}" + (f" ({mps.get('reason')})" if mps.get("reason") else "")
                   + f", pid file found={mps.get('daemon_pid_from_pid_file') is not None}"
                   + f", quit ok={(mps.get('shutdown') or {}).get('daemon_gone')}")
    for share in PAIR_SHARES:
        rows = [r for r in mps.get("pairs", []) if r.get("shares") == [share, share]]
        if rows:
            out.append(f"MPS pairs @{share}/{share} -- steps/s (normalised to solo MPS 100), sum of normalised:")
            out.extend(_pair_line(r) for r in rows)
    ts = (st.get("timeslice") or {}).get("result", {})
    if ts.get("pairs"):
        out.append("time-sliced pairs, no MPS -- steps/s (normalised to solo without MPS), sum:")
        out.extend(_pair_line(r) for r in ts["pairs"])
    out.append("(the simulator's pair figures are Gavel's measured V100/P100/K80 pairs; compare the sums above)")
    return out
