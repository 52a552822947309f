"""``elastico``: the operator's command line over the Allocator API (elastico.client) and the local cluster.

    elastico up|down|status            the local cluster (devtools.cluster, what `make up` runs)
    elastico submit -f job.yaml        a job spec (YAML or JSON, JobSpec's field names); errors name field and line
    elastico get JOB | list | watch | cancel JOB | describe JOB
    elastico nodes | top [--once]      nodes; a per-GPU view (tenants, shares, memory, speed, utilisation)
    elastico sim ARGS... | bench NAME ARGS...   python -m simulator / python -m bench.NAME

Where to connect: ``--address`` / ``--token-file`` / ``--insecure``, else the environment (ELASTICO_ALLOCATOR_ADDRESS,
ELASTICO_TLS_CERT_FILE/_KEY_FILE/_CA_FILE, ELASTICO_TOKEN or ELASTICO_TOKEN_FILE, ELASTICO_INSECURE), else the
local cluster's state file (``<run dir>/cluster.json``: the allocator's address, the operator's certificate and
token), else 127.0.0.1:50050 in plaintext.

Exit codes: 0 ok; 1 the API answered an error (or could not be reached); 2 usage or validation (a bad flag, a
malformed job file, a field the allocator refused).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import grpc

from devtools import cluster
from devtools.jobfiles import UsageError, load_specs
from devtools.render import age, dump, plain, print_jobs, table, width
from elastico import domain as d
from elastico.client import (
    DEFAULT_ADDRESS,
    AllocatorClient,
    AllocatorError,
    ClientConfig,
    NodeAgentClient,
)
from elastico.config import address_problem
from elastico.rpc.security import read_token

ROOT = Path(__file__).resolve().parents[1]
EXIT_OK, EXIT_API, EXIT_USAGE = 0, 1, 2
ACTIVE = (d.JobState.PENDING, d.JobState.PLACED, d.JobState.RUNNING)

# --- connection -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class Context:
    """What a command needs: the client configuration and the local cluster's state (None if not running)."""

    config: ClientConfig
    state: dict | None
    deadline_s: float

    def client(self) -> AllocatorClient:
        return AllocatorClient(self.config.address, tls=self.config.tls, deadline_s=self.deadline_s)

    def proc_address(self, name: str) -> str:
        for p in (self.state or {}).get("procs", []):
            if p["name"] == name:
                return p["address"]
        return ""


def _load_state(run_dir: str | None) -> dict | None:
    """The local cluster's state: ``--run-dir``, ELASTICO_RUN_DIR or ./.run, else the checkout's .run."""
    if run_dir:
        os.environ["ELASTICO_RUN_DIR"] = run_dir
    state = cluster.load_state()
    if state is None and not run_dir and "ELASTICO_RUN_DIR" not in os.environ and (ROOT / ".run" / "cluster.json").exists():
        os.environ["ELASTICO_RUN_DIR"] = str(ROOT / ".run")
        state = cluster.load_state()
    return state


def context(args: argparse.Namespace) -> Context:
    state = _load_state(args.run_dir)
    default_address, default_tls = DEFAULT_ADDRESS, None
    if state:
        default_address = next((p["address"] for p in state["procs"] if p["name"] == "allocator"), DEFAULT_ADDRESS)
        try:
            default_tls = cluster.client_tls(state)
        except (OSError, ValueError) as exc:
            raise UsageError(f"the local cluster's operator credentials are unreadable ({exc}); pass --token-file") from None
    try:
        cfg = ClientConfig.from_env(os.environ, default_address=default_address, default_tls=default_tls)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    tls = cfg.tls
    if args.insecure:
        tls = dataclasses.replace(tls, files=None)
    if args.token_file:
        try:
            tls = dataclasses.replace(tls, token=read_token(args.token_file))
        except (OSError, ValueError) as exc:
            raise UsageError(f"--token-file {args.token_file}: {exc}") from None
    if args.address and (problem := address_problem(args.address)):
        raise UsageError(f"--address {args.address!r}: {problem}")
    return Context(ClientConfig(args.address or cfg.address, tls), state, args.timeout)


# --- commands: jobs -------------------------------------------------------------------------------------
def cmd_submit(ctx: Context, args) -> int:
    specs = load_specs(args.file)
    if args.request_id and len(specs) > 1:
        raise UsageError(f"--request-id names one job; {args.file} holds {len(specs)}")
    jobs = []
    with ctx.client() as c:
        for spec in specs:
            jobs.append(c.submit(spec, request_id=args.request_id))
    if args.output in ("json", "yaml"):
        print(dump([plain(j) for j in jobs], args.output))
    else:
        for j in jobs:
            print(f"job {j.job_id} submitted ({j.spec.name or j.spec.kind.value}, {j.state.value})")
    return EXIT_OK


def cmd_get(ctx: Context, args) -> int:
    with ctx.client() as c:
        jobs = [c.get(j) for j in args.jobs]
    print_jobs(jobs, args.output)
    return EXIT_OK


def cmd_list(ctx: Context, args) -> int:
    states = [s for arg in args.state for s in arg.split(",") if s]
    with ctx.client() as c:
        jobs = []
        for j in c.list(states=states, tenant=args.tenant, page_size=min(1000, max(args.limit, 1)) if args.limit else 500):
            jobs.append(j)
            if args.limit and len(jobs) >= args.limit:
                break
    if not jobs and args.output not in ("json", "yaml"):
        print("no jobs", file=sys.stderr)
        return EXIT_OK
    print_jobs(jobs, args.output)
    return EXIT_OK


def cmd_cancel(ctx: Context, args) -> int:
    with ctx.client() as c:
        for job_id in args.jobs:
            j = c.cancel(job_id)
            print(f"job {j.job_id} {j.state.value}")
    return EXIT_OK


def event_line(ev: d.JobEvent) -> str:
    t = time.strftime("%H:%M:%S", time.localtime(ev.time_s)) if ev.time_s else "-"
    line = f"{t}  {ev.job_id:<20} {ev.state.value:<10} {ev.reason.value:<20} {ev.message}"
    return line.rstrip()[:width()]


def cmd_watch(ctx: Context, args) -> int:
    after = "0" if args.from_start else args.after
    failed: list[BaseException] = []
    with ctx.client() as c:
        w = c.watch(args.jobs, after)
        done = threading.Event()

        def pump() -> None:  # the stream is read in a thread: the main one waits interruptibly, so Ctrl-C always ends it
            try:
                for ev in w:
                    print(event_line(ev), flush=True)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                failed.append(exc)
            finally:
                done.set()

        # Ctrl-C (and SIGTERM) end the watch even where the shell started us with SIGINT ignored (a background job)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.default_int_handler)
        threading.Thread(target=pump, name="watch", daemon=True).start()
        try:
            while not done.wait(0.2):
                pass
        except KeyboardInterrupt:
            w.cancel()
            return EXIT_OK
    if failed:
        raise failed[0]
    return EXIT_OK


WHY = {
    d.StateReason.SUBMITTED: "just submitted: the next scheduling round considers it",
    d.StateReason.UNSCHEDULABLE_NOW: ("unschedulable now: no GPU has the share and memory of any of its shapes free this "
                                      "round; it waits for capacity (jobs ending, shrinking or being preempted) and is "
                                      "retried every round"),
    d.StateReason.NEVER_SCHEDULABLE: ("never schedulable: no shape of it fits any GPU of this cluster, even empty; it will "
                                      "not start until the request changes (fewer GPUs, less memory, another gpu_type or "
                                      "allowed_nodes) or matching nodes join"),
    d.StateReason.PREEMPTED: "preempted: the policy took its resources back; requeued for the next rounds",
    d.StateReason.RESIZED: "resized: requeued to restart in another shape",
    d.StateReason.NODE_LOST: "its node stopped sending heartbeats; requeued",
    d.StateReason.COTENANT_FAULT: "an MPS co-tenant's fault killed it; requeued without penalty",
}


def _predicted(ctx: Context, job: d.Job, tenants: dict[tuple[str, int], list[tuple[d.Job, float]]]) -> tuple[float, int] | None:
    """The predictor's worst normalised throughput of ``job`` next to each co-tenant on its GPUs, and the number of
    (GPU, co-tenant) pairs asked about ((1.0, 0) alone; None when the predictor cannot be reached)."""
    from elastico.v1 import predictor_pb2, predictor_pb2_grpc
    from elastico.v1 import types_pb2 as pb

    address = os.environ.get("ELASTICO_PREDICTOR_ADDRESS", "") or ctx.proc_address("predictor")
    if not address or job.placement is None:
        return None
    kind = {d.JobKind.TRAINING: pb.JOB_KIND_TRAINING, d.JobKind.INFERENCE: pb.JOB_KIND_INFERENCE}

    def profile(j: d.Job, share: float, gpu_type: str):
        return predictor_pb2.TaskProfile(job_id=j.job_id, model_family=j.spec.model_family, batch_size=j.spec.batch_size,
                                         precision=j.spec.precision, kind=kind[j.spec.kind], gpu_type=gpu_type,
                                         mps_share_pct=share)
    pairs = []
    for s in job.placement.slices:
        for other, share in tenants.get((s.node_id, s.gpu_index), []):
            if other.job_id != job.job_id:
                gtype = job.placement.shape.gpu_type or "v100"
                pairs.append(predictor_pb2.PairQuery(a=profile(job, s.compute_share_pct, gtype), b=profile(other, share, gtype)))
    if not pairs:
        return 1.0, 0
    tls = dataclasses.replace(ctx.config.tls, token="")
    try:
        with tls.channel(address) as ch:
            r = predictor_pb2_grpc.PredictorStub(ch).PredictInterference(
                predictor_pb2.PredictInterferenceRequest(pairs=pairs), timeout=min(ctx.deadline_s, 5.0))
    except grpc.RpcError:
        return None
    return min(p.norm_tput_a for p in r.predictions), len(pairs)


def _gpu_tenants(jobs: Iterable[d.Job]) -> dict[tuple[str, int], list[tuple[d.Job, float]]]:
    out: dict[tuple[str, int], list[tuple[d.Job, float]]] = {}
    for j in jobs:
        if j.placement is not None and j.state in (d.JobState.PLACED, d.JobState.RUNNING):
            for s in j.placement.slices:
                out.setdefault((s.node_id, s.gpu_index), []).append((j, s.compute_share_pct))
    return out


def _workloads(ctx: Context, nodes: Iterable[d.NodeInfo], job_ids: Sequence[str] = ()) -> tuple[dict[str, list], list[str]]:
    """Live workloads per job from each node agent (observed speed); the agents that could not be read."""
    out: dict[str, list[tuple[str, d.Workload]]] = {}
    missing = []
    for n in nodes:
        if not n.address:
            continue
        try:
            with NodeAgentClient(n.address, tls=ctx.config.tls, deadline_s=min(ctx.deadline_s, 3.0)) as agent:
                for w in agent.workloads(job_ids=job_ids, statuses=("starting", "running")):
                    out.setdefault(w.job_id, []).append((n.node_id, w))
        except AllocatorError:
            missing.append(n.node_id)
    return out, missing


def cmd_describe(ctx: Context, args) -> int:
    with ctx.client() as c:
        job = c.get(args.job)
        history = c.history(job.job_id, idle_s=args.history_wait_s, until_version=job.version)
        placed = [j for j in c.list(states=("placed", "running"))] if job.placement is not None else []
        nodes = c.cluster_state().nodes if job.placement is not None else ()
    s = job.spec
    kv: list[tuple[str, str]] = [("Job", job.job_id), ("Name", s.name or "-"), ("Request id", job.request_id),
                                 ("Tenant", f"{s.tenant}   priority {s.priority}"), ("Kind", s.kind.value),
                                 ("Model", f"{s.model_family or '-'}  batch {s.batch_size}  {s.precision}")]
    if s.training:
        kv.append(("Work", f"{job.progress_steps:.0f} / {s.training.total_steps} steps"
                           + (f"  (max slowdown {s.training.max_slowdown:g})" if s.training.max_slowdown else "")))
    if s.inference:
        kv.append(("Work", f"serves {s.inference.demand_rps:g} req/s within {s.inference.latency_slo_ms:g} ms"))
    kv.append(("State", f"{job.state.value} ({job.reason.value}){': ' + job.message if job.message else ''}"))
    if job.state is d.JobState.PENDING:
        kv.append(("Why pending", WHY.get(job.reason, job.reason.value)))
    kv += [("Submitted", f"{age(job.submitted_at_s)} ago"), ("Restarts", str(job.restarts))]
    if s.allowed_nodes:
        kv.append(("Allowed nodes", ", ".join(s.allowed_nodes)))
    lines = [textwrap.fill(v, width() - 1, initial_indent=f"{k + ':':<15}", subsequent_indent=" " * 15) for k, v in kv]
    if s.shapes:
        chosen = job.placement.shape_index if job.placement else -1
        lines.append("Shapes:")
        rows = [["*" if i == chosen else "", i, sh.num_gpus, f"{sh.compute_share_pct:g}%", sh.mem_mib, sh.batch_size or "-",
                 sh.gpu_type or "any", f"{sh.throughput:g}" if sh.throughput else "-"] for i, sh in enumerate(s.shapes)]
        lines += ["  " + ln for ln in table(["", "#", "GPUS", "SHARE", "MEM_MIB", "BATCH", "TYPE", "TPUT"], rows).splitlines()]
    if job.placement is not None:
        p = job.placement
        tenants = _gpu_tenants(placed)
        lines.append(f"Placement:     shape {p.shape_index} ({p.shape.num_gpus} GPU x {p.shape.compute_share_pct:g}% x "
                     f"{p.shape.mem_mib} MiB), epoch {p.epoch}, committed {age(p.committed_at_s)} ago")
        lines.append("Slices:")
        rows = []
        for sl in p.slices:
            co = [f"{o.job_id}({share:g}%)" for o, share in tenants.get((sl.node_id, sl.gpu_index), []) if o.job_id != job.job_id]
            rows.append([sl.node_id, sl.gpu_index, f"{sl.compute_share_pct:g}%", sl.mem_mib, ", ".join(co) or "-"])
        lines += ["  " + ln for ln in table(["NODE", "GPU", "SHARE", "MEM_MIB", "CO-TENANTS"], rows).splitlines()]
        work, missing = _workloads(ctx, [n for n in nodes if n.node_id in {sl.node_id for sl in p.slices}], [job.job_id])
        observed = [w for _, w in work.get(job.job_id, [])]
        norms = [w.norm_throughput for w in observed if w.norm_throughput is not None]
        obs = (f"{min(norms):.2f} of its isolated speed" if norms else "not reported yet") if observed else \
              ("unknown (node agent unreachable)" if missing else "no running workload yet")
        if observed:
            obs += f", {sum(w.throughput for w in observed) / len(observed):.3g} {'steps' if s.training else 'req'}/s"
        pred = _predicted(ctx, job, tenants)
        predicted = ("unknown (predictor unreachable)" if pred is None else "1.00 (no co-tenant)" if pred[1] == 0 else
                     f"{pred[0]:.2f} next to its {pred[1]} co-tenant pairing(s)")
        lines.append(textwrap.fill(f"observed {obs} (node agent); predicted {predicted} (predictor)", width() - 1,
                                   initial_indent=f"{'Speed:':<15}", subsequent_indent=" " * 15))
    lines.append("Events:")
    if history:
        rows = [[time.strftime("%H:%M:%S", time.localtime(e.time_s)) if e.time_s else "-", e.state.value, e.reason.value,
                 e.message or "-"] for e in history]
        lines += ["  " + ln for ln in table(["TIME", "STATE", "REASON", "MESSAGE"], rows).splitlines()]
    else:
        lines.append("  (none recorded)")
    print("\n".join(lines))
    return EXIT_OK


# --- commands: nodes and top ----------------------------------------------------------------------------
def cmd_nodes(ctx: Context, args) -> int:
    with ctx.client() as c:
        cs = c.cluster_state()
    if args.output in ("json", "yaml"):
        print(dump([plain(n) for n in cs.nodes], args.output))
        return EXIT_OK
    now = time.time()
    rows = []
    for n in cs.nodes:
        types = sorted({g.gpu_type for g in n.gpus})
        share = sum(g.allocated_share_pct for g in n.gpus) / max(len(n.gpus), 1)
        mem = sum(g.allocated_mem_mib for g in n.gpus), sum(g.mem_total_mib for g in n.gpus)
        unhealthy = sum(1 for g in n.gpus if not g.healthy)
        rows.append([n.node_id, "yes" if n.ready else "NO", n.gpu_backend, len(n.gpus), ",".join(types) or "-",
                     f"{share:.0f}%", f"{mem[0]}/{mem[1]}", unhealthy or "-", age(n.last_heartbeat_s, now), n.address])
    print(table(["NODE", "READY", "BACKEND", "GPUS", "TYPE", "SHARE", "MEM_MIB", "DRAINED", "HEARTBEAT", "ADDRESS"], rows))
    if not rows:
        print("no nodes registered", file=sys.stderr)
    return EXIT_OK


def top_frame(ctx: Context, c: AllocatorClient) -> str:
    """One frame of ``top``: every GPU with its tenants (share, observed speed), memory, SM utilisation and the
    effective utilisation sum(share x observed normalised speed)."""
    cs = c.cluster_state()
    jobs = list(c.list(states=("placed", "running")))
    tenants = _gpu_tenants(jobs)
    work, missing = _workloads(ctx, cs.nodes)
    speed: dict[tuple[str, str, int], float] = {}
    for job_id, ws in work.items():
        for node_id, w in ws:
            for gi in w.gpu_indices:
                if w.norm_throughput is not None:
                    speed[(job_id, node_id, gi)] = w.norm_throughput
    rows = []
    alloc_total = eff_total = 0.0
    eff_known = True
    for n in cs.nodes:
        for g in n.gpus:
            ts = tenants.get((n.node_id, g.index), [])
            cells, eff = [], 0.0
            for j, share in sorted(ts, key=lambda x: -x[1]):
                v = speed.get((j.job_id, n.node_id, g.index))
                cells.append(f"{j.job_id}:{share:g}%@{v:.2f}" if v is not None else f"{j.job_id}:{share:g}%")
                if v is None:
                    eff_known = False
                eff += share / 100.0 * (v if v is not None else 1.0)
            alloc_total += min(g.allocated_share_pct, 100.0) / 100.0
            eff_total += min(eff, 1.0)
            used = g.counters.mem_used_mib
            util = g.counters.sm_util_pct
            rows.append([n.node_id, g.index, g.gpu_type, f"{g.allocated_share_pct:.0f}%",
                         f"{g.allocated_mem_mib}/{g.mem_total_mib}", f"{used:.0f}" if used is not None else "-",
                         f"{util:.0f}%" if util is not None else "-", f"{eff:.0%}" if ts else "-",
                         ("" if g.healthy else "DRAINED ") + (" ".join(cells) or "-")])
    gpus = sum(len(n.gpus) for n in cs.nodes) or 1
    pending = sum(t.pending_jobs for t in cs.tenants)
    out = [f"elastico top  {time.strftime('%H:%M:%S')}  {ctx.config.address}  leader epoch {cs.leader_epoch}  "
           f"nodes {len(cs.nodes)}  GPUs {gpus}",
           f"jobs running/placed {len(jobs)}  pending {pending}  GPU share allocated {alloc_total / gpus:.0%}  "
           f"effective {eff_total / gpus:.0%}{'' if eff_known else '*'}"]
    if cs.tenants:  # with a service quota, the GPUs its placed services count against it
        out.append("tenants: " + "  ".join(
            f"{t.tenant} {t.running_jobs}/{t.pending_jobs} running/pending {t.allocated_gpus:.2f} GPUs"
            + (f" services {t.service_gpus}/{t.service_quota_gpus} GPUs of quota" if t.service_quota_gpus is not None else "")
            for t in cs.tenants))
    if cs.degraded:
        out.append("degraded: " + "; ".join(cs.degraded))
    if missing:
        out.append(f"node agents not readable (no observed speed): {', '.join(missing)}")
    out.append(table(["NODE", "GPU", "TYPE", "SHARE", "MEM_MIB", "USED", "UTIL", "EFF", "TENANTS (job:share@speed)"], rows))
    if not eff_known:
        out.append("* speed not reported yet for some tenants: counted at 1.00 (isolated)")
    return "\n".join(out)


def cmd_top(ctx: Context, args) -> int:
    with ctx.client() as c:
        if args.once:
            print(top_frame(ctx, c))
            return EXIT_OK
        tty = sys.stdout.isatty()
        try:
            while True:
                frame = top_frame(ctx, c)
                if tty:
                    sys.stdout.write("\x1b[H\x1b[2J" + frame + "\n")  # home, clear: the frame replaces the last
                else:
                    sys.stdout.write(frame + "\n\n")
                sys.stdout.flush()
                time.sleep(args.interval)
        except KeyboardInterrupt:
            return EXIT_OK


# --- commands: cluster, simulator, benchmarks -----------------------------------------------------------
def cmd_up(args) -> int:
    _load_state(args.run_dir)
    if args.nodes < 1:
        raise UsageError("--nodes must be >= 1")
    try:
        cluster.up(args.nodes, args.timeout_s, args.monitoring)
    except RuntimeError as exc:
        print(f"elastico up failed: {exc}", file=sys.stderr)
        return EXIT_API
    return EXIT_OK


def cmd_down(args) -> int:
    _load_state(args.run_dir)
    cluster.down()
    return EXIT_OK


def cmd_status(args) -> int:
    if _load_state(args.run_dir) is None:
        print(f"no cluster running (no state file under {cluster.run_dir()}); start one with `elastico up`")
        return EXIT_API
    try:
        ok = cluster.status()  # False: a recorded process is not running
    except AllocatorError as exc:
        print(f"status: node agent {exc.address} did not answer ({exc.code.name}: {exc.message})", file=sys.stderr)
        return EXIT_API
    return EXIT_OK if ok else EXIT_API


def bench_names() -> list[str]:
    """The runnable benchmarks: bench/<name>.py with a ``__main__`` block, bench/<name>/__main__.py."""
    base = ROOT / "bench"
    names = [p.stem for p in base.glob("*.py") if p.stem != "__init__" and "__main__" in p.read_text(errors="replace")]
    names += [p.parent.name for p in base.glob("*/__main__.py")]
    return sorted(names)


def _passthrough(module: str, argv: Sequence[str]) -> int:
    try:
        return subprocess.call([sys.executable, "-m", module, *argv])
    except KeyboardInterrupt:
        return 130


# --- parser ---------------------------------------------------------------------------------------------
def _connection_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("connection")
    g.add_argument("--address", default="", help="allocator host:port (default: ELASTICO_ALLOCATOR_ADDRESS, the local "
                                                 f"cluster's, {DEFAULT_ADDRESS})")
    g.add_argument("--token-file", default="", help="bearer token file (default: ELASTICO_TOKEN[_FILE], the local cluster's)")
    g.add_argument("--insecure", action="store_true", help="plaintext gRPC (a cluster started with ELASTICO_INSECURE=1)")
    g.add_argument("--timeout", type=_positive, default=10.0, help="deadline of each call, seconds (default 10)")
    g.add_argument("--run-dir", default="", help="the local cluster's run directory (default: ELASTICO_RUN_DIR or .run)")
    return p


def _count(text: str) -> int:
    if not (text.isascii() and text.isdigit()):  # "-5", "1.5" and "x" are usage errors
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return int(text)


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v > 0 or v != v or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return v


def _output(p: argparse.ArgumentParser, choices=("table", "wide", "json", "yaml")) -> None:
    p.add_argument("-o", "--output", choices=choices, default="table", help="output format (default table)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="elastico", description="The operator's command line: the Allocator API and the local cluster.",
                                 epilog="Run `elastico COMMAND --help` for a command's options. Exit codes: 0 ok, "
                                        "1 API error or unreachable, 2 usage or validation.")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    conn = _connection_options()
    run_dir = argparse.ArgumentParser(add_help=False)
    run_dir.add_argument("--run-dir", default="", help="run directory (default: ELASTICO_RUN_DIR or .run)")

    p = sub.add_parser("up", parents=[run_dir], help="start the local cluster (Redis, services, N node agents); "
                       "on a running one, restart its processes that died")
    p.add_argument("--nodes", type=int, default=os.environ.get("ELASTICO_NODES", "2"),
                   help="node agents (default ELASTICO_NODES or 2)")
    p.add_argument("--timeout-s", type=_positive, default=30.0, help="wait this long for every service (default 30)")
    p.add_argument("--monitoring", action="store_true", default=None, help="also Prometheus and Grafana, where installed")
    sub.add_parser("down", parents=[run_dir], help="stop the local cluster; its jobs (Redis's AOF), certificates and "
                   "tokens stay in the run directory, so the next `up` resumes them (`make clean` removes them)")
    sub.add_parser("status", parents=[run_dir], help="the local cluster's processes, health and GPUs (exit 1 if one died)")

    p = sub.add_parser("submit", parents=[conn], help="submit job(s) from a YAML/JSON file")
    p.add_argument("-f", "--file", required=True, help="job spec file (JobSpec fields; '-' = stdin; '---' separates jobs)")
    p.add_argument("--request-id", default=None, help="idempotency key (default: a new one); resubmitting with it "
                                                      "returns the same job")
    _output(p)
    p = sub.add_parser("get", parents=[conn], help="one or more jobs")
    p.add_argument("jobs", nargs="+", metavar="JOB")
    _output(p)
    p = sub.add_parser("list", parents=[conn], help="jobs, newest first")
    p.add_argument("--state", action="append", default=[], help="only these states (repeat or comma-separate: "
                                                                "pending,placed,running,succeeded,failed,cancelled)")
    p.add_argument("--tenant", default="", help="only this tenant's jobs")
    p.add_argument("--limit", type=_count, default=0, help="at most this many (default 0: all)")
    _output(p)
    p = sub.add_parser("watch", parents=[conn], help="stream job state changes (Ctrl-C ends)")
    p.add_argument("jobs", nargs="*", metavar="JOB", help="only these jobs (default all)")
    since = p.add_mutually_exclusive_group()
    since.add_argument("--after", default="", help="resume after this event id (default: new events only)")
    since.add_argument("--from-start", action="store_true", help="replay every recorded event first")
    p = sub.add_parser("cancel", parents=[conn], help="cancel job(s)")
    p.add_argument("jobs", nargs="+", metavar="JOB")
    p = sub.add_parser("describe", parents=[conn], help="a job in full: shape, placement, co-tenants, speed, history, "
                                                        "why it is pending")
    p.add_argument("job", metavar="JOB")
    p.add_argument("--history-wait-s", type=_positive, default=1.0, help="read events until none came for this long")
    p = sub.add_parser("nodes", parents=[conn], help="nodes and their GPUs")
    _output(p, ("table", "json", "yaml"))
    p = sub.add_parser("top", parents=[conn], help="per GPU: tenants, shares, memory, speed, utilisation (refreshes)")
    p.add_argument("--once", action="store_true", help="print one frame and exit (no terminal control codes)")
    p.add_argument("--interval", type=_positive, default=2.0, help="seconds between frames (default 2)")

    p = sub.add_parser("sim", add_help=False, help="the simulator: python -m simulator ARGS (sim --help for its options)")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p = sub.add_parser("bench", help="a benchmark: python -m bench.NAME ARGS")
    p.add_argument("name", metavar="NAME", choices=bench_names(), help="one of: " + ", ".join(bench_names()))
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments (bench NAME --help for them)")
    return ap


COMMANDS = {"submit": cmd_submit, "get": cmd_get, "list": cmd_list, "watch": cmd_watch, "cancel": cmd_cancel,
            "describe": cmd_describe, "nodes": cmd_nodes, "top": cmd_top}
LOCAL = {"up": cmd_up, "down": cmd_down, "status": cmd_status}


def _api_error(exc: AllocatorError, address: str) -> int:
    if exc.code is grpc.StatusCode.UNAVAILABLE:
        print(f"error: cannot reach the allocator at {exc.address or address}: {exc.message} (is the cluster up? "
              "`elastico up`, or pass --address)", file=sys.stderr)
        return EXIT_API
    if exc.code is grpc.StatusCode.UNAUTHENTICATED:
        print(f"error: {exc.code.name}: {exc.message} (a token: --token-file or ELASTICO_TOKEN_FILE)", file=sys.stderr)
        return EXIT_API
    print(f"error: {exc.code.name}: {exc.field + ': ' if exc.field else ''}{exc.message}", file=sys.stderr)
    return EXIT_USAGE if exc.code is grpc.StatusCode.INVALID_ARGUMENT else EXIT_API


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sim"]:  # everything after `sim` is the simulator's, --help included
        return _passthrough("simulator", argv[1:])
    args = parser().parse_args(argv)
    try:
        if args.cmd == "bench":
            return _passthrough(f"bench.{args.name}", args.args)
        if args.cmd in LOCAL:
            return LOCAL[args.cmd](args)
        ctx = context(args)
        try:
            return COMMANDS[args.cmd](ctx, args)
        except AllocatorError as exc:
            return _api_error(exc, ctx.config.address)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `elastico list | head`
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
