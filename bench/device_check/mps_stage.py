"""The MPS stage: a control daemon started through the node agent's own MPS controller, solo and paired runs.

``RealMps`` (``SimulatedMps`` in a dry run) starts the daemon with fresh pipe and log directories; the clients get
``client_env`` exactly as the agent launches workloads. A probe client runs first (a failure there means MPS is
unavailable and the time-sliced pairs become required). The daemon is quit whatever happens.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.device_check.host import TOOL_DIRS, find_tool, mps_processes, run_cmd, tail
from bench.device_check.measurement import Runner, TenantSpec
from bench.device_check.workloads import MPS_SHARES, PAIRS, SHORT, WORKLOADS


class MpsStage(Runner):
    """``stage_mps`` and the daemon's shutdown."""

    def _mps_mem_mib(self) -> int:
        """Pinned memory limit per client: a third of the GPU (the workloads need ~1-2 GiB)."""
        return max(4096, (self.mem_total_mib or 3 * 16384) // 3)

    def start_mps(self, res: dict[str, Any]) -> Any:
        """A control daemon on fresh pipe/log folders: ``RealMps`` (``SimulatedMps`` in a dry run), facts in ``res``.

        The caller quits it with ``_stop_mps`` whatever happens, also when this raises (a failed start may have
        left a daemon behind): it is stored as ``self.mps_ctl`` before it is started.
        """
        res["available"] = False
        pipe = Path(tempfile.mkdtemp(prefix="elastico-mps-pipe-", dir="/tmp"))
        logd = Path(tempfile.mkdtemp(prefix="elastico-mps-log-", dir="/tmp"))
        res["pipe_dir"], res["log_dir"] = str(pipe), str(logd)
        if self.dry:
            ctl = self.mps_mod.SimulatedMps(pipe, logd)
        else:
            binary = find_tool("nvidia-cuda-mps-control")
            res["control_bin"] = binary
            if binary is None:
                res["reason"] = "nvidia-cuda-mps-control not found (PATH, " + ", ".join(TOOL_DIRS) + ")"
                raise RuntimeError(res["reason"])
            ctl = self.mps_mod.RealMps(pipe, logd, control_bin=binary, control_timeout_s=15.0)
        res["controller"] = f"{type(ctl).__module__}.{type(ctl).__qualname__}"
        self.mps_ctl = ctl
        try:
            ctl.start()
        except Exception as exc:
            res["reason"] = f"control daemon did not start: {type(exc).__name__}: {exc}"
            raise
        time.sleep(0.05 if self.dry else 0.5)
        res["daemon_pid_from_pid_file"] = ctl.daemon_pid()
        res["pipe_dir_files"] = sorted(p.name for p in pipe.iterdir())
        res["mps_processes_after_start"] = mps_processes()
        return ctl

    def stage_mps(self, res: dict[str, Any]) -> None:
        try:
            ctl = self.start_mps(res)
            mem = self._mps_mem_mib()
            res["pinned_mem_limit_mib"] = mem

            def spec(label: str, w: str, share: int) -> TenantSpec:
                return TenantSpec(label, w, share, dict(ctl.client_env((0,), share, mem)))

            probe = self.measure("mps probe (tiny_mlp @100)", "mps", [spec("probe", "tiny_mlp", 100)],
                                 min(0.5, self.window), ready_timeout=45.0 if not self.dry else None, mps=ctl)
            res["probe"] = probe
            if probe["error"]:
                res["reason"] = f"first MPS client failed: {probe['error']}"
                raise RuntimeError(res["reason"])
            self.mps_ok = res["available"] = True
            res["client_env_example"] = dict(ctl.client_env((0,), 50, mem))
            solo: dict[str, dict[str, Any]] = {w: {} for w in WORKLOADS}
            pairs: list[dict[str, Any]] = []
            res["solo"], res["pairs"] = solo, pairs

            def run_solo(share: int) -> None:
                for w in WORKLOADS:
                    rec = self.measure(f"mps solo {w} @{share}", "mps", [spec(w, w, share)], self.window, mps=ctl)
                    if rec["tenants"]:
                        self.solo_mps.setdefault(w, {})[share] = rec["tenants"][0]["steps_per_s"]
                        base = self.solo_mps[w].get(100)
                        rec["tenants"][0]["norm_vs_mps100"] = rec["tenants"][0]["steps_per_s"] / base if base else None
                    solo[w][str(share)] = rec
                    self.write()

            def run_pairs(share: int) -> None:
                for a, b in PAIRS:
                    la, lb = (f"{a}#1", f"{b}#2") if a == b else (a, b)
                    rec = self.measure(f"mps pair {SHORT[a]}+{SHORT[b]} {a}+{b} @{share}/{share}", "mps",
                                       [spec(la, a, share), spec(lb, b, share)], self.window, mps=ctl)
                    rec.update(pair=f"{a}+{b}", shares=[share, share])
                    self.normalise(rec, {w: v.get(100) for w, v in self.solo_mps.items()},
                                    {w: v.get(share) for w, v in self.solo_mps.items()})
                    pairs.append(rec)
                    self.write()

            run_solo(100)
            run_pairs(100)
            run_solo(50)
            run_solo(25)
            run_pairs(50)
            res["share_limit"] = {w: {str(s): (v.get(s) / v[100] if v.get(100) and v.get(s) else None)
                                      for s in MPS_SHARES} for w, v in self.solo_mps.items()}
            bad = [r["label"] for r in pairs if r["error"]] + [
                r["label"] for w in solo.values() for r in w.values() if r["error"]]
            if bad:
                raise RuntimeError(f"{len(bad)} MPS measurement(s) failed or skipped: {'; '.join(bad)}")
        finally:
            if self.mps_ctl is not None:
                self._stop_mps(self.mps_ctl, res)

    def _stop_mps(self, ctl: Any, res: dict[str, Any]) -> None:
        stop: dict[str, Any] = {}
        res["shutdown"] = stop
        try:
            had_pid = ctl.daemon_pid() is not None
            ctl.stop()  # echo quit | nvidia-cuda-mps-control (only when the pid file names a live daemon)
            if not had_pid and not self.dry:  # pid file not where mps.py expects it: quit directly
                binary = getattr(ctl, "_bin", None) or find_tool("nvidia-cuda-mps-control")
                if binary:
                    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(ctl.pipe_dir),
                           "CUDA_MPS_LOG_DIRECTORY": str(ctl.log_dir)}
                    q = run_cmd([binary], 15, input="quit\n", env=env)
                    stop["direct_quit"] = {"rc": q.returncode, "out": (q.stdout + q.stderr).strip()[-500:]}
            deadline = time.monotonic() + (1 if self.dry else 10)
            while ctl.daemon_pid() is not None and time.monotonic() < deadline:
                time.sleep(0.2)
            stop["daemon_gone"] = ctl.daemon_pid() is None
            deadline = time.monotonic() + (0 if self.dry else 5)  # servers exit once their clients have
            while mps_processes() and time.monotonic() < deadline:
                time.sleep(0.2)
        except Exception as exc:  # noqa: BLE001
            stop["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            stop["mps_processes_after_quit"] = mps_processes()
            res["commands"] = list(getattr(ctl, "commands", []))
            res["log_tail"] = {p.name: tail(p, 1500) for p in sorted(Path(ctl.log_dir).glob("*.log"))}
            self.say(f"  MPS quit: daemon gone={stop.get('daemon_gone')} "
                     f"left={[p['comm'] for p in stop['mps_processes_after_quit']]}")
