#!/usr/bin/env bash
# Short, prepared check of the node agent's hardware paths on a real NVIDIA GPU (H100/H200 class or any
# NVML GPU): NVML device + per-process counters, GPM metrics, and CUDA MPS (control daemon, client limits,
# get_server_list / get_client_list). Needs no PyTorch: the MPS client is a tiny libcuda program (ctypes).
#
#   scripts/gpu_check.sh            # from the repository root; ~30 s; prints PASS/FAIL/SKIP lines, exit 1 on FAIL
#
# Everything it starts (MPS daemon in a private pipe directory, the client) is stopped on exit.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
WORK=$(mktemp -d /tmp/elastico-gpu-check.XXXXXX)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
FAIL=0
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; FAIL=1; }
skip() { echo "SKIP $*"; }
cleanup() {
  [ -n "${CLIENT_PID:-}" ] && kill "$CLIENT_PID" 2>/dev/null
  CUDA_MPS_PIPE_DIRECTORY="$WORK/pipe" CUDA_MPS_LOG_DIRECTORY="$WORK/log" timeout 10 sh -c 'echo quit | nvidia-cuda-mps-control' >/dev/null 2>&1
  rm -rf "$WORK"
}
trap cleanup EXIT

echo "== driver"
nvidia-smi -L || { fail "nvidia-smi"; exit 1; }

echo "== NVML backend (device counters, GPM, per-process counters)"
"$PY" - <<'PYEOF' || FAIL=1
import sys, time
import pynvml
from services.node_agent.gpu import NvmlBackend
b = NvmlBackend()
g1 = b.gpus()
time.sleep(1.0)
g2 = b.gpus()  # GPM needs two samples
for g in g2:
    print(f"gpu {g.index} {g.gpu_type} {g.uuid} mem={g.mem_total_mib}MiB counters={g.counters}")
ok = bool(g2) and all(g.mem_total_mib > 0 and g.counters.mem_used_mib is not None for g in g2)
print(("PASS" if ok else "FAIL"), "NVML devices and memory")
h = pynvml.nvmlDeviceGetHandleByIndex(0)
try:
    gpm = bool(pynvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice)
except pynvml.NVMLError as exc:
    gpm = False
    print("note: nvmlGpmQueryDeviceSupport:", exc)
if gpm:
    c = g2[0].counters
    ok_gpm = c.tensor_util_pct is not None and c.sm_util_pct is not None and c.mem_bw_util_pct is not None
    print(("PASS" if ok_gpm else "FAIL"), f"GPM metrics (sm_occupancy={c.sm_util_pct}, dram_bw={c.mem_bw_util_pct}, tensor={c.tensor_util_pct})")
    ok = ok and ok_gpm
else:
    print("SKIP GPM: device does not support it (pre-Hopper or disabled)")
print("per-process counters:", b.process_counters())
print("PASS per-process counters call")
b.close()
sys.exit(0 if ok else 1)
PYEOF

echo "== CUDA MPS (private control daemon, client limits)"
if ! command -v nvidia-cuda-mps-control >/dev/null; then
  skip "nvidia-cuda-mps-control not installed"
else
  mkdir -p "$WORK/pipe" "$WORK/log"
  cat > "$WORK/client.py" <<'PYEOF'
# Minimal MPS client through the driver API: allocate under and over the pinned limit, then idle.
import ctypes, os, sys, time
cuda = ctypes.CDLL("libcuda.so.1")
def ck(r, what):
    if r != 0:
        print(f"{what} -> CUDA error {r}", flush=True)
    return r
assert ck(cuda.cuInit(0), "cuInit") == 0
dev = ctypes.c_int(); ck(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p(); assert ck(cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate") == 0
sms = ctypes.c_int(); ck(cuda.cuDeviceGetAttribute(ctypes.byref(sms), 16, dev), "SM count")  # 16 = MULTIPROCESSOR_COUNT
ptr = ctypes.c_uint64()
small = ck(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(256 << 20)), "alloc 256MiB")
big = ck(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(2048 << 20)), "alloc 2048MiB")
print(f"RESULT sms={sms.value} small={small} big={big}", flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 5)
PYEOF
  "$PY" - "$WORK" <<'PYEOF' || FAIL=1
import os, subprocess, sys, time
from pathlib import Path
from services.node_agent.mps import RealMps
work = Path(sys.argv[1])
mps = RealMps(work / "pipe", work / "log", control_timeout_s=10)
mps.start()
h = mps.health()
print(("PASS" if h.state == "ok" else "FAIL"), "control daemon started and answers get_server_list:", h)
env = {**os.environ, **mps.client_env((0,), 25.0, 1024)}
print("client env:", {k: v for k, v in env.items() if k.startswith("CUDA_")})
full = subprocess.run([sys.executable, str(work / "client.py"), "0"], capture_output=True, text=True, timeout=60,
                      env={k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS")} | {"CUDA_MPS_PIPE_DIRECTORY": str(work / "nompsdir")})
print("without MPS:", full.stdout.strip(), full.stderr.strip()[-300:])
p = subprocess.Popen([sys.executable, str(work / "client.py"), "6"], env=env, stdout=subprocess.PIPE, text=True)
line = ""
for _ in range(60):
    line = p.stdout.readline()
    if line.startswith("RESULT") or not line:
        break
print("with MPS (25 %, 1024 MiB):", line.strip())
ok = True
if "small=0" in line and "big=0" not in line:
    print("PASS pinned memory limit enforced (2 GiB allocation refused under a 1 GiB limit; ordinal 0 = client's device)")
else:
    print("FAIL pinned memory limit not enforced as configured"); ok = False
h = mps.health()
print(("PASS" if h.state == "ok" and h.server_pids and h.client_pids else "FAIL"),
      f"get_server_list={h.server_pids} get_client_list={sorted(h.client_pids)} (client pid {p.pid})")
ok = ok and bool(h.server_pids)
for s in h.server_pids:
    try:
        print("get_server_status:", mps.control(f"get_server_status {s}").strip())
    except Exception as exc:  # older drivers lack it
        print("note: get_server_status unsupported:", exc)
print("fault events (expect none):", mps.fault_events())
p.wait(30)
mps.stop()
print("commands issued:", list(mps.commands))
sys.exit(0 if ok else 1)
PYEOF
fi

[ "$FAIL" = 0 ] && echo "== gpu_check: all checks passed" || echo "== gpu_check: FAILURES above"
exit "$FAIL"
