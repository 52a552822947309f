"""Built-in synthetic workload (``python -m services.node_agent.synthetic``) for simulated GPUs.

It burns no GPU: it advances a step counter at the rate the simulated GPU backend writes into
``ELASTICO_SIM_RATE_FILE`` (steps/s, re-read several times a second, so co-location changes apply
at once), reports progress through ``ELASTICO_PROGRESS_FILE`` exactly like a real, instrumented
training program would, and exits 0 after ``--total-steps`` (0 = run until stopped, like a service).

``--exit-code``/``--fail-after-s`` make it fail on purpose (tests of failure classification).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

TICK_S = 0.1


def read_rate(path: str, default: float) -> float:
    try:
        with open(path) as f:
            return max(0.0, float(f.read().strip() or default))
    except (OSError, ValueError):
        return default


def write_progress(path: str, steps: float) -> None:
    """Atomic replace so the agent never reads half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"steps": steps, "time_s": time.time()}, f)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m services.node_agent.synthetic")
    ap.add_argument("--total-steps", type=float, default=0.0, help="exit 0 after this many steps; 0 = forever")
    ap.add_argument("--start-steps", type=float, default=0.0, help="resume from this many steps (checkpoint)")
    ap.add_argument("--rate", type=float, default=0.0, help="steps/s when no rate file is given")
    ap.add_argument("--fail-after-s", type=float, default=-1.0, help="exit with --exit-code after this many seconds")
    ap.add_argument("--exit-code", type=int, default=1)
    args = ap.parse_args(argv)
    rate_file = os.environ.get("ELASTICO_SIM_RATE_FILE", "")
    progress_file = os.environ.get("ELASTICO_PROGRESS_FILE", "")
    stop = False

    def on_term(_sig: int, _frm: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    steps = args.start_steps
    started = last = time.monotonic()
    print(f"synthetic workload: total_steps={args.total_steps} start={steps} "
          f"visible_devices={os.environ.get('CUDA_VISIBLE_DEVICES', '')} "
          f"mps_share={os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE', '')} "
          f"mps_mem={os.environ.get('CUDA_MPS_PINNED_DEVICE_MEM_LIMIT', '')}", flush=True)
    while not stop:
        time.sleep(TICK_S)
        now = time.monotonic()
        rate = read_rate(rate_file, args.rate) if rate_file else args.rate
        steps += rate * (now - last)
        last = now
        if args.total_steps > 0 and steps >= args.total_steps:
            steps = args.total_steps
            if progress_file:
                write_progress(progress_file, steps)
            print(f"done: {steps:.0f} steps in {now - started:.1f}s", flush=True)
            return 0
        if progress_file:
            write_progress(progress_file, steps)
        if 0 <= args.fail_after_s <= now - started:
            print(f"failing on purpose with exit code {args.exit_code}", flush=True)
            return args.exit_code
    print(f"stopped by SIGTERM at {steps:.1f} steps", flush=True)
    return 143


if __name__ == "__main__":
    sys.exit(main())
