"""The stages around MPS (environment, NVML, solo, time-sliced pairs) and the run that chains all five."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.device_check.host import Terminated, as_dict, find_tool, mps_processes, now, pkg_version, run_cmd
from bench.device_check.measurement import TenantSpec
from bench.device_check.mps_stage import MpsStage
from bench.device_check.project import FakeNvml
from bench.device_check.report import summary_lines
from bench.device_check.workloads import PAIRS, SHORT, WORKLOADS

SMI_KEYS = ("Driver Version", "CUDA Version", "Product Name", "Product Brand", "Product Architecture",
            "Compute Mode", "Persistence Mode", "Virtualization Mode", "Host VGPU Mode", "Addressing Mode",
            "GPU UUID", "Bus Id", "Total", "Power Limit", "Max Clocks", "SM ")
PACKAGES = ("torch", "nvidia-ml-py", "grpcio", "protobuf", "numpy", "structlog")  # versions recorded
SMI_QUERY = "name,driver_version,compute_mode,mig.mode.current,memory.total,clocks.max.sm,power.limit"


class DeviceCheck(MpsStage):
    """One run: the five stages in order, each recorded in the report; children and MPS cleaned up after."""

    def stage_environment(self, res: dict[str, Any]) -> None:
        res["python"] = sys.version.split()[0]
        res["platform"] = platform.platform()
        res["packages"] = {d: pkg_version(d) for d in PACKAGES}
        res["env"] = {k: v for k, v in os.environ.items()
                      if k.startswith(("CUDA_", "NVIDIA_")) or k in ("LD_LIBRARY_PATH",)}
        res["mps_control"] = find_tool("nvidia-cuda-mps-control")
        res["mps_server"] = find_tool("nvidia-cuda-mps-server")
        res["default_mps_pipe_dir_exists"] = Path("/tmp/nvidia-mps").exists()  # a system MPS daemon already up?
        res["mps_processes_before"] = mps_processes()
        smi = find_tool("nvidia-smi")
        res["nvidia_smi"] = smi
        if smi and not self.dry:
            try:
                q = run_cmd([smi, "-q"], 60)
                lines = q.stdout.splitlines()
                excerpt = [ln.rstrip() for ln in lines if ln.strip().startswith(SMI_KEYS)]
                for i, ln in enumerate(lines):
                    if ln.strip().startswith("MIG Mode"):
                        excerpt.extend(x.rstrip() for x in lines[i:i + 3])
                res["smi_q_excerpt"] = excerpt[:80]
                res["smi_q_rc"] = q.returncode
            except Exception as exc:  # noqa: BLE001
                res["smi_q_error"] = f"{type(exc).__name__}: {exc}"
            try:
                q = run_cmd([smi, f"--query-gpu={SMI_QUERY}", "--format=csv"], 60)
                res["smi_query"] = q.stdout.strip() or q.stderr.strip()
            except Exception as exc:  # noqa: BLE001
                res["smi_query_error"] = f"{type(exc).__name__}: {exc}"
        if self.dry:
            res["torch_runtime"] = {"skipped": "dry-run"}
            return
        c = self.spawn("torch-info", "info", 0, self.child_env({}))
        try:
            ev = c.wait_event("info", 150)
            ev.pop("event", None)
            res["torch_runtime"] = ev
        finally:
            c.finish()

    def open_backend(self, res: dict[str, Any]) -> None:
        """The node agent's ``NvmlBackend`` (on a stand-in pynvml in a dry run): inventory and idle counters."""
        res["module"] = self.gpu_mod.__file__
        nvml = FakeNvml(lambda: set(self.measuring)) if self.dry else None
        self.backend = self.gpu_mod.NvmlBackend(nvml=nvml)
        res["backend"] = f"{type(self.backend).__module__}.{type(self.backend).__qualname__}"
        res["gpm_supported"] = list(getattr(self.backend, "_gpm", []))
        nap = 0.05 if self.dry else 1.0
        first = self.backend.gpus()
        time.sleep(nap)
        idle = self.backend.gpus()
        res["inventory"] = [as_dict(g) for g in idle]
        res["gpu_type"] = idle[0].gpu_type if idle else None
        self.mem_total_mib = int(idle[0].mem_total_mib) if idle else None
        res["idle"] = {"first_read": as_dict(first[0].counters) if first else None,
                       "counters": as_dict(idle[0].counters) if idle else None,
                       "raw_utilization": self._raw_util(), "processes": {
                           str(p): as_dict(c) for p, c in self.backend.process_counters().items()}}
        self.write()

    def stage_nvml(self, res: dict[str, Any]) -> None:
        self.open_backend(res)
        load_s = self.window if self.dry else max(4.0, self.window)
        rec = self.measure("nvml load (mlp_bf16, no MPS)", "plain", [TenantSpec("mlp_bf16", "mlp_bf16", None, {})],
                           load_s)
        res["load"] = rec
        if rec["error"]:
            raise RuntimeError(f"load run failed: {rec['error']}")
        res["load_raw_utilization_after"] = self._raw_util()  # after the child exits: should fall back
        idle_c, load_c = res["idle"]["counters"] or {}, (rec["counters"] or {}).get("gpu0") or {}
        res["comparison"] = {k: {"idle": idle_c.get(k), "load": load_c.get(k)}
                             for k in ("sm_util_pct", "mem_bw_util_pct", "tensor_util_pct", "mem_used_mib")}
        i_sm, l_sm = idle_c.get("sm_util_pct"), load_c.get("sm_util_pct")
        res["util_higher_under_load"] = (i_sm is not None and l_sm is not None and l_sm > i_sm)
        res["load_pid_in_process_counters"] = any((rec["counters"] or {}).get("tenant_pids_seen", {}).values())
        if not res["util_higher_under_load"]:
            raise RuntimeError(f"sm_util_pct not higher under load: idle {i_sm}, load {l_sm}")

    def _raw_util(self) -> dict[str, Any] | None:
        """``nvmlDeviceGetUtilizationRates`` directly (the backend replaces it with GPM where supported)."""
        try:
            nv, h = self.backend._nvml, self.backend._handles[0]
            u = nv.nvmlDeviceGetUtilizationRates(h)
            return {"gpu": float(u.gpu), "memory": float(u.memory)}
        except Exception as exc:  # noqa: BLE001
            return {"error": f"{type(exc).__name__}: {exc}"}

    def stage_solo(self, res: dict[str, Any]) -> None:
        runs: dict[str, Any] = {}
        res["runs"] = runs
        for w in WORKLOADS:
            rec = self.measure(f"solo {w} (no MPS)", "plain", [TenantSpec(w, w, None, {})], self.window)
            runs[w] = rec
            if rec["tenants"]:
                self.solo_plain[w] = rec["tenants"][0]["steps_per_s"]
            self.write()
        failed = [w for w, r in runs.items() if r["error"]]
        if failed:
            raise RuntimeError(f"solo runs failed or skipped: {', '.join(failed)}")

    def stage_timeslice(self, res: dict[str, Any]) -> None:
        res["required"] = not self.mps_ok
        res["reason"] = ("MPS unavailable: pairs run with plain time-slicing" if not self.mps_ok
                         else "MPS worked: time-sliced pairs for comparison, as far as the budget allows")
        pairs: list[dict[str, Any]] = []
        res["pairs"] = pairs
        for a, b in PAIRS:
            if self.mps_ok and self.remaining() < self.measurement_cost(self.window) + 15:
                res["stopped_early"] = f"budget ({self.remaining():.0f} s left)"
                break
            la, lb = (f"{a}#1", f"{b}#2") if a == b else (a, b)
            rec = self.measure(f"time-sliced pair {SHORT[a]}+{SHORT[b]} {a}+{b} (no MPS)", "time-slicing",
                               [TenantSpec(la, a, None, {}), TenantSpec(lb, b, None, {})], self.window)
            rec.update(pair=f"{a}+{b}", shares=[None, None])
            self.normalise(rec, self.solo_plain, None)
            pairs.append(rec)
            self.write()
        bad = [r["label"] for r in pairs if r["error"]]
        if bad and res["required"]:
            raise RuntimeError(f"{len(bad)} time-sliced pair(s) failed or skipped: {'; '.join(bad)}")

    def stage_list(self) -> list[tuple[str, Callable[[dict[str, Any]], None], float]]:
        """(name, stage, seconds it needs at least) in running order."""
        per = self.measurement_cost(self.window)
        return [("environment", self.stage_environment, 1.0 if self.dry else 10.0), ("nvml", self.stage_nvml, per),
                ("solo", self.stage_solo, per), ("mps", self.stage_mps, per), ("timeslice", self.stage_timeslice, per)]

    def banner(self) -> str:
        p = self.report["plan"]
        return (f"ElastiCo device check ({self.report['mode']}): window {self.window:g} s, budget {self.budget:g} s, "
                f"{p['measurements']} measurements planned, ~{p['estimated_s']:.0f} s; JSON -> {self.out / self.json_name}")

    def summary(self) -> list[str]:
        return summary_lines(self.report)

    def cleanup(self) -> None:
        """Whatever a stage may have left running (the MPS daemon is quit by the stage that started it)."""

    def run(self) -> int:
        """Every stage in order, then the summary; the exit status (0 complete, 1 partial, 143 terminated)."""
        self.say(self.banner())
        self.write()
        try:
            for name, fn, min_s in self.stage_list():
                self.stage(name, fn, min_s)
            bad = [n for n, s in self.report["stages"].items() if s["status"] != "ok"]
            self.report["status"] = "complete" if not bad else "partial"
            rc = 0 if not bad else 1
        except Terminated:
            self.report["status"] = "interrupted"
            rc = 143
        finally:
            for c in list(self.live):
                c.finish()
            with contextlib.suppress(Exception):
                self.cleanup()
            if self.backend is not None:
                with contextlib.suppress(Exception):
                    self.backend.close()
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.report["finished_at"] = now()
            self.report["elapsed_s"] = round(self.elapsed(), 2)
            try:
                self.report["summary"] = self.summary()
            except Exception as exc:  # noqa: BLE001
                self.report["summary"] = [f"(summary failed: {type(exc).__name__}: {exc})"]
            self.write()
        print("\n".join(self.report["summary"]), flush=True)
        return rc
