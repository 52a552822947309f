"""The campaign's worker child: one training loop, serving loop or test client, measured over a common window.

``python3 -m bench.gpu_campaign --worker NAME --seconds S`` prepares -- imports torch, creates its CUDA context
(an allocation, no kernel: the MPS share is fixed here) and builds its model on the CPU -- prints ``prepared`` and
waits, idle, for ``start <JSON settings>`` on stdin (the orchestrator sends it when the point before is over). It
then moves the model to the GPU, warms up (a service runs every batch size it can form, then times batch 1 and
its largest batch), prints ``ready``, waits for ``go <epoch>``, measures over the window and keeps its load up for
``tail_s`` more seconds (the serving co-tenant's rate search), then prints ``result``: throughput in the window and
a latency histogram (per request for a service, per step for training).

A service answers requests that arrive open-loop at a Poisson rate: each batch takes every queued request (at most
its largest batch), a request's latency runs from its arrival to the end of its batch. After the window it searches
the highest rate served within its SLO (p99 <= ``slo_ms``, >= 99 % served) in ``SEARCH_STEPS`` short sub-windows.

``--fake`` (dry run): the same loops with ``time.sleep`` for the GPU work, at rates scaled by ``min(1, share/u)``.
Module level: the standard library only; torch is imported by the real workers.
"""

from __future__ import annotations

import bisect
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from bench.device_check.workloads import emit, torch_info, wait_go
from bench.gpu_campaign.stats import (
    histogram,
    latency_summary,
    next_search_rate,
    parse_pinned_limit_mib,
    poisson_arrivals,
    share_speed,
    within_slo,
)
from bench.gpu_campaign.workloads import DRY_STARTUP_SCALE, SEARCH_STEPS, WORKLOADS, Workload

DRAIN_S = 1.0  # a window's queued requests are still served this long after it ends (then counted unserved)
# --fake: a fake service sleeps where a real one computes, and a busy CPU wakes a sleep late by milliseconds; its SLO
# (4 big batches, about a millisecond here) gets this floor, so a dry run on a loaded machine still finds its rates
FAKE_SLO_FLOOR_MS = 50.0


def serve_open_loop(run: Callable[[int], None], arrivals: list[float], t_end: float, max_batch: int,
                    drain_s: float = DRAIN_S) -> list[float]:
    """Serve absolute ``arrivals`` (perf_counter seconds, ascending) with ``run(batch)``; each served one's latency."""
    lat: list[float] = []
    i, n = 0, len(arrivals)
    while i < n:
        now = time.perf_counter()
        if arrivals[i] > now:
            if arrivals[i] >= t_end:
                break
            time.sleep(arrivals[i] - now)
            continue
        if now > t_end + drain_s:
            break
        j = bisect.bisect_right(arrivals, now, i, min(n, i + max_batch))
        run(j - i)
        done = time.perf_counter()
        lat.extend(done - a for a in arrivals[i:j])
        i = j
    return lat


def _serve_span(run: Callable[[int], None], rate: float, span_s: float, seed: int, max_batch: int,
                slo_ms: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    arrivals = [t0 + a for a in poisson_arrivals(rate, span_s, seed)]
    lat = serve_open_loop(run, arrivals, t0 + span_s, max_batch)
    summary = latency_summary(lat)
    served = len(lat) / len(arrivals) if arrivals else 1.0
    p99 = summary["p99"]
    return {"rate_rps": round(rate, 3), "offered": len(arrivals), "served": len(lat), "served_frac": round(served, 4),
            "latency_ms": summary, "ok": within_slo(p99 if isinstance(p99, float) else None, served, slo_ms),
            "lat": lat}


# --- the real GPU work ----------------------------------------------------------------------------------
def _build_model(w: Workload, torch: Any) -> Any:
    """The workload's model with random weights, on the CPU (None for a probe): done while another point measures."""
    from bench.gpu_campaign.models import classes

    M = classes(torch)
    if w.kind == "probe":
        return None
    if w.model == "ResNet-50":
        return M.resnet50()
    if w.model == "ResNet-18":
        return M.resnet18()
    if w.model == "BERT-base":
        return M.Transformer(False, vocab=30522, max_seq=512)
    return M.Transformer(True)  # GPT-2-small, trained or serving


def _train_step(w: Workload, torch: Any, built: Any) -> Callable[[], None]:
    F, dev = torch.nn.functional, torch.device("cuda")
    amp, bs = w.precision == "amp", w.batch_size
    if w.model == "ResNet-50":
        torch.backends.cudnn.benchmark = True
        model = built.to(dev, memory_format=torch.channels_last)
        x = torch.randn(bs, 3, 224, 224, device=dev).to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (bs,), device=dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def loss_fn() -> Any:
            return F.cross_entropy(model(x), y)
    else:
        seq = 1024 if amp else 512
        model = built.to(dev)
        ids = torch.randint(0, 50304, (bs, seq + 1), device=dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def loss_fn() -> Any:
            logits, _ = model(ids[:, :-1])
            return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _serve_run(w: Workload, torch: Any, built: Any) -> Callable[[int], None]:
    """``run(b)``: one batch of ``b`` requests end to end, synchronised (inputs made once per batch size)."""
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    inputs: dict[int, Any] = {}
    if w.model == "BERT-base":
        model = built.to(dev, bf16).eval()

        def make(b: int) -> Any:
            return torch.randint(0, 30522, (b, 128), device=dev)

        def infer(x: Any) -> Any:
            return model(x)[0].argmax(-1)
    elif w.model == "GPT-2":
        model = built.to(dev, bf16).eval()

        def make(b: int) -> Any:
            return torch.randint(0, 50304, (b, 64), device=dev)

        def infer(x: Any) -> Any:
            logits, cache = model(x)
            tok = logits[:, -1].argmax(-1, keepdim=True)
            for i in range(16):
                logits, cache = model(tok, cache, start=x.shape[1] + i)
                tok = logits[:, -1].argmax(-1, keepdim=True)
            return tok
    else:
        torch.backends.cudnn.benchmark = True
        model = built.to(dev, bf16, memory_format=torch.channels_last).eval()

        def make(b: int) -> Any:
            return torch.randn(b, 3, 224, 224, device=dev, dtype=bf16).to(memory_format=torch.channels_last)

        def infer(x: Any) -> Any:
            return model(x).argmax(1)

    def run(b: int) -> None:
        x = inputs.get(b)
        if x is None:
            x = inputs[b] = make(b)
        with torch.inference_mode():
            infer(x)
        torch.cuda.synchronize()
    return run


def _fake_train_step(w: Workload, share: float) -> Callable[[], None]:
    """A dry-run training step: sleeps on a fixed schedule of ``w``'s fake rate at ``share`` that starts at its
    first call, so a late wake-up on a busy CPU is made up by the next steps and a window's rate stays the rate."""
    rate = w.fake_rate * share_speed(share, w.fake_util)
    due: float | None = None

    def step() -> None:
        nonlocal due
        now = time.perf_counter()
        due = (now if due is None else due) + 1.0 / rate
        time.sleep(max(0.0, due - now))
    return step


def _fake_serve_run(w: Workload, share: float) -> Callable[[int], None]:
    cap = w.fake_rate * share_speed(share, w.fake_util)
    t_big = w.batch_size / cap
    t_one = 0.3 * t_big

    def run(b: int) -> None:
        time.sleep(t_one + (t_big - t_one) * (b - 1) / max(1, w.batch_size - 1))
    return run


def warm_up_service(run: Callable[[int], None], max_batch: int, rounds: int, hold_s: float) -> None:
    """Every batch size the window can form (1..``max_batch``), ``rounds`` times -- a size first seen in the window
    would pay its cuDNN autotuning and first allocations there and stall the queue behind it -- then batch 1 and
    ``max_batch`` for ``hold_s`` seconds each (clocks up)."""
    for b in [*range(1, max_batch + 1)] * rounds:
        run(b)
    for b in (1, max_batch):
        t = time.perf_counter()
        while time.perf_counter() - t < hold_s:
            run(b)


# --- the child ------------------------------------------------------------------------------------------
def _median_time(fn: Callable[[], None], n: int) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2]


def wait_start() -> dict[str, Any] | None:
    """Block until the orchestrator writes ``start <JSON object>``; its settings, or None on EOF (it is gone)."""
    while True:
        line = sys.stdin.readline()
        if not line:
            return None
        if line.startswith("start"):
            out = json.loads(line[len("start"):].strip() or "{}")
            if not isinstance(out, dict):
                raise ValueError("the start line's settings must be a JSON object")
            return out


def run_worker(name: str, seconds: float, fake: bool, params: dict[str, Any]) -> int:
    """Child: prepare, print ``prepared``, wait for ``start``, warm up, print ``ready``, wait for ``go``, measure,
    print ``result`` (or ``error``). ``params`` (``--params``) are updated by the start line's settings."""
    t_start = time.perf_counter()
    share_env = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    share = float(share_env) if share_env else 100.0
    base = {"workload": name, "pid": os.getpid(), "share_env": share_env,
            "priority_env": os.environ.get("CUDA_MPS_CLIENT_PRIORITY"),
            "mps_pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY")}
    try:
        if name == "info":
            emit({"event": "info", **(torch_info() if not fake else {"fake": True})})
            return 0
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
        w = WORKLOADS[name]
        torch: Any = None
        built: Any = None
        ready: dict[str, Any] = {}
        step: Callable[[], None] | None = None
        run: Callable[[int], None] | None = None
        if fake:
            time.sleep(DRY_STARTUP_SCALE * w.prepare_s)  # stands for the import, context and build below
        else:
            import torch as torch_mod

            torch = torch_mod
            props = torch.cuda.get_device_properties(0)
            ready.update(device=props.name, sm_count=props.multi_processor_count)
            torch.empty(1, device="cuda")  # the CUDA context (an allocation, no kernel): the MPS share is fixed now
            built = _build_model(w, torch)
        prepare_s = time.perf_counter() - t_start
        emit({"event": "prepared", **base, "prepare_s": round(prepare_s, 3)})
        settings = wait_start()
        if settings is None:
            return 3
        params = {**params, **settings}
        tail_s = float(params.get("tail_s", 0.0))
        t_warm = time.perf_counter()
        if w.kind == "train":
            if fake:
                step = _fake_train_step(w, share)
            else:
                step = _train_step(w, torch, built)
            t_w, warm = time.perf_counter(), 0
            while warm < (2 if fake else 5) or time.perf_counter() - t_w < (0.0 if fake else 1.0):
                step()
                warm += 1
            if torch is not None:
                torch.cuda.synchronize()
            ready["detail"] = {"warmup_steps": warm, "step_ms": round((time.perf_counter() - t_w) / warm * 1e3, 3)}
        elif w.kind == "serve":
            run = _fake_serve_run(w, share) if fake else _serve_run(w, torch, built)
            warm_up_service(run, w.batch_size, rounds=1 if fake else 2, hold_s=0.0 if fake else 0.3)
            t_one = _median_time(lambda: run(1), 3 if fake else 7)
            t_big = _median_time(lambda: run(w.batch_size), 3 if fake else 7)
            capacity = w.batch_size / t_big
            ready["detail"] = {"batch1_ms": round(t_one * 1e3, 4), "batch_max_ms": round(t_big * 1e3, 4),
                               "max_batch": w.batch_size, "capacity_rps": round(capacity, 2),
                               "rate_rps": float(params.get("rate") or round(0.4 * capacity, 2)),
                               "slo_ms": float(params.get("slo_ms")
                                               or max(round(4 * t_big * 1e3, 3), FAKE_SLO_FLOOR_MS if fake else 0.0))}
        if torch is not None:
            torch.cuda.reset_peak_memory_stats()
        t_ready = time.perf_counter()
        emit({"event": "ready", **base, **ready, "startup_s": round(t_ready - t_start, 3),
              "prepare_s": round(prepare_s, 3), "warmup_s": round(t_ready - t_warm, 3)})
        go = wait_go()
        if go is None:
            return 3
        time.sleep(max(0.0, go - time.time()))
        lag = time.time() - go
        res: dict[str, Any] = {"event": "result", **base, "start_lag_s": round(lag, 4)}
        t0 = time.perf_counter()
        if w.kind == "train":
            assert step is not None
            if fake:  # the window's own schedule, not one still owed from the warm-up
                step = _fake_train_step(w, share)
            res.update(_measure_train(step, torch, t0, seconds, tail_s))
        elif w.kind == "serve":
            assert run is not None
            res.update(_measure_serve(run, w, ready["detail"], seconds, tail_s, int(params.get("seed", 1))))
        elif name == "memhog":
            res.update(_memhog(torch, int(params.get("alloc_mib", 4096)), t0 + seconds + tail_s))
        else:
            _fault(torch, fake, t0 + float(params.get("fault_at", 0.33)) * seconds)
            res.update(steps=0, seconds=seconds, steps_per_s=0.0, detail={"fault_raised": False})
        if torch is not None:
            res["peak_mem_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        emit(res)
        return 0
    except Exception as exc:  # noqa: BLE001 - reported to the orchestrator, which records it
        emit({"event": "error", **base, "error": f"{type(exc).__name__}: {exc}",
              "traceback": traceback.format_exc()[-3000:]})
        return 1


def _measure_train(step: Callable[[], None], torch: Any, t0: float, seconds: float, tail_s: float) -> dict[str, Any]:
    """Steps over the window (synchronised after each, so a step's time is its latency), then load for the tail."""
    end = t0 + seconds
    times: list[float] = []
    while True:
        s = time.perf_counter()
        step()
        if torch is not None:
            torch.cuda.synchronize()
        e = time.perf_counter()
        times.append(e - s)
        if e >= end:
            break
    elapsed = time.perf_counter() - t0
    while time.perf_counter() < end + tail_s:  # the co-tenant's rate search still sees this load
        step()
    if torch is not None:
        torch.cuda.synchronize()
    return {"steps": len(times), "seconds": round(elapsed, 4), "steps_per_s": len(times) / elapsed,
            "detail": {"step_ms": latency_summary(times), "histogram": histogram([x * 1e3 for x in times])}}


def _measure_serve(run: Callable[[int], None], w: Workload, cal: dict[str, Any], seconds: float, tail_s: float,
                   seed: int) -> dict[str, Any]:
    """The window at the offered rate, then the SLO rate search (``SEARCH_STEPS`` sub-windows of the tail)."""
    rate, slo = float(cal["rate_rps"]), float(cal["slo_ms"])
    main = _serve_span(run, rate, seconds, seed, w.batch_size, slo)
    lat = main.pop("lat")
    ok_rate, bad_rate = (rate, None) if main["ok"] else (None, rate)
    search = []
    if tail_s > 0:
        for k in range(SEARCH_STEPS):
            r = next_search_rate(ok_rate, bad_rate, rate)
            step = _serve_span(run, r, tail_s / SEARCH_STEPS, seed + 1 + k, w.batch_size, slo)
            step.pop("lat")
            search.append(step)
            if step["ok"]:
                ok_rate = max(r, ok_rate or 0.0)
            else:
                bad_rate = min(r, bad_rate if bad_rate is not None else r)
    return {"steps": main["served"], "seconds": seconds, "steps_per_s": main["served"] / seconds,
            "latency_ms": main["latency_ms"],
            "detail": {**main, "slo_ms": slo, "histogram": histogram([x * 1e3 for x in lat]), "search": search,
                       "max_rps_within_slo": ok_rate if search else None}}


def _memhog(torch: Any, alloc_mib: int, end: float) -> dict[str, Any]:
    """Ask for ``alloc_mib`` at once: under a smaller pinned limit this must fail (and only this client)."""
    limit = parse_pinned_limit_mib(os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"))
    detail: dict[str, Any] = {"alloc_mib": alloc_mib, "limit_mib": limit}
    try:
        if torch is None:
            if limit is not None and alloc_mib > limit:
                raise MemoryError(f"simulated: {alloc_mib} MiB over the pinned limit of {limit} MiB")
        else:
            buf = torch.empty((alloc_mib, 2**20), dtype=torch.uint8, device="cuda")
            buf.fill_(1)
            torch.cuda.synchronize()
            del buf
        detail.update(alloc_failed=False)
    except Exception as exc:  # noqa: BLE001 - torch.cuda.OutOfMemoryError is the expected outcome
        detail.update(alloc_failed=True, error=f"{type(exc).__name__}: {str(exc)[:300]}")
    time.sleep(max(0.0, end - time.perf_counter()))
    return {"steps": 0, "seconds": 0.0, "steps_per_s": 0.0, "detail": detail}


def _fault(torch: Any, fake: bool, at: float) -> None:
    """Raise a fatal GPU fault at ``at`` (perf_counter): an out-of-bounds index, a device-side assert."""
    time.sleep(max(0.0, at - time.perf_counter()))
    if fake:
        raise RuntimeError("simulated fatal GPU fault (dry run)")
    x = torch.zeros(4, device="cuda")
    idx = torch.tensor([1 << 20], device="cuda")
    x[idx] = 1.0
    torch.cuda.synchronize()


def parse_params(text: str | None) -> dict[str, Any]:
    try:
        out = json.loads(text or "{}")
    except json.JSONDecodeError as exc:
        print(f"gpu_campaign worker: --params is not JSON: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    if not isinstance(out, dict):
        print("gpu_campaign worker: --params must be a JSON object", file=sys.stderr)
        raise SystemExit(2)
    return out
