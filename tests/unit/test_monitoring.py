"""Dashboards and alerts, checked offline: the Grafana dashboard and its provisioning load, every PromQL expression
of the dashboard and of the alert rules parses (promql-parser: the Prometheus grammar, function names and argument
types, as promtool checks them) and names only metrics and labels the code defines, the required alerts exist, the
Prometheus configs and the compose profile hang together; and the allocator metrics the dashboard added
(pending jobs by reason, effective utilisation, node freshness, predictor error drift) follow the rounds."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import promql_parser
import pytest
import yaml
from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

import elastico.rpc.interceptors
import services.allocator.metrics
import services.kube.app
from devtools import cluster
from elastico.domain import JobState, StateReason
from services.allocator.round_metrics import (
    ERROR_WINDOW_S,
    RoundMetrics,
    RoundOutcome,
    RoundReport,
    allocated_ratio,
    effective_utilisation,
    pending_reasons,
)
from tests.conftest import make_job, make_node
from tests.unit import _policy_builders as pb

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "elastico.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
# Grafana's built-in variables the dashboard uses, as a query sees them
GRAFANA_VARS = {"$__rate_interval": "1m", "$__range": "1h", "$__interval": "15s"}
# labels Prometheus attaches to every scraped series (scrape job, target) and those our scrape configs add
TARGET_LABELS = {"job", "instance", "service", "process", "pod", "node"}
REQUIRED_ALERTS = {  # what the issue asks for -> (metric the rule must read, label matchers it must use)
    "no leader": ("elastico_allocator_is_leader", {}),
    "pricer degraded": ("elastico_allocator_degraded", {"component": "pricer"}),
    "predictor degraded": ("elastico_allocator_degraded", {"component": "predictor"}),
    "predictor error drift": ("elastico_allocator_norm_throughput_error_mean_abs", {}),
    "SLO burn": ("elastico_allocator_service_p99_latency_ms", {}),
    "node stale": ("elastico_allocator_nodes", {"state": "stale"}),
}


def defined_metrics() -> dict[str, set[str]]:
    """Every series name the services export -> its label names (``le`` on buckets), from the prometheus_client
    objects of the metrics modules: counters as ``_total``, histograms as ``_bucket``/``_count`` (and ``_sum``)."""
    out: dict[str, set[str]] = {}
    for mod in (services.allocator.metrics, elastico.rpc.interceptors, services.kube.app):
        for obj in vars(mod).values():
            if not isinstance(obj, MetricWrapperBase):
                continue
            labels = set(obj._labelnames)
            for m in obj.describe():
                if m.type == "counter":
                    out[f"{m.name}_total"] = labels
                elif m.type == "histogram":  # no _sum when a bucket is negative (the sum could fall)
                    out |= {f"{m.name}_bucket": labels | {"le"}, f"{m.name}_count": labels}
                    if obj._upper_bounds[0] >= 0:
                        out[f"{m.name}_sum"] = labels
                elif m.type == "summary":
                    out |= {m.name: labels | {"quantile"}, f"{m.name}_sum": labels, f"{m.name}_count": labels}
                else:
                    out[m.name] = labels
    return out


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """(metric name, {label: value}) of every vector selector of ``expr``; ValueError when it does not parse."""
    found: list[tuple[str, dict[str, str]]] = []

    def visit(node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = {m.name: m.value for m in node.matchers.matchers}
            found.append((node.name or matchers.pop("__name__", ""), matchers))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def check_expr(expr: str, where: str, metrics: dict[str, set[str]]) -> list[tuple[str, dict[str, str]]]:
    """Parse ``expr`` and check every metric and label name it selects; the selectors. AssertionError naming
    ``where`` otherwise."""
    try:
        found = selectors(expr)
    except ValueError as exc:
        raise AssertionError(f"{where}: does not parse: {exc}: {expr}") from None
    assert found, f"{where}: selects no metric: {expr}"
    for name, matchers in found:
        assert name in metrics, f"{where}: metric {name!r} is not defined in the code: {expr}"
        unknown = set(matchers) - metrics[name] - TARGET_LABELS
        assert not unknown, f"{where}: {name} has no label(s) {sorted(unknown)}: {expr}"
    return found


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expression with Grafana's variables substituted) of every dashboard query."""
    out = []
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        for t in p.get("targets", []):
            expr = t["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"panel {p['title']!r}: unknown Grafana variable in {t['expr']}"
            out.append((p["title"], expr))
    return out


def alert_rules() -> list[dict]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    assert groups and all(g["rules"] for g in groups)
    return [r for g in groups for r in g["rules"]]


# --- offline checks of the files --------------------------------------------------------------------------------
def test_the_checker_rejects_what_promtool_would():
    metrics = defined_metrics()
    check_expr("sum(rate(elastico_allocator_placements_total[5m]))", "ok", metrics)
    for bad, why in [("sum(rate(elastico_allocator_placements_total[5m])", "does not parse"),
                     ("rate(elastico_allocator_placements_total)", "does not parse"),  # rate of an instant vector
                     ("elastico_allocator_no_such_metric", "not defined"),
                     ("elastico_allocator_placements", "not defined"),  # a counter is exported as _total
                     ("elastico_allocator_degraded{reason=\"x\"}", "no label")]:
        with pytest.raises(AssertionError, match=why):
            check_expr(bad, "t", metrics)


def test_defined_metrics_are_what_the_registry_exposes():
    """The names collected from the objects are the sample names prometheus_client writes (those with samples)."""
    exposed = {s.name for m in REGISTRY.collect() for s in m.samples}
    metrics = defined_metrics()
    assert "elastico_allocator_round_seconds_bucket" in metrics and "elastico_grpc_requests_total" in metrics
    # every unlabelled metric has samples from import on: each of them must be exposed under the name collected
    unlabelled = {n for n, labels in metrics.items() if not labels - {"le"}}
    assert unlabelled and unlabelled <= exposed, sorted(unlabelled - exposed)


def test_dashboard_loads_and_every_query_uses_defined_metrics():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    metrics = defined_metrics()
    used = set()
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    for title, expr in exprs:
        used |= {n for n, _ in check_expr(expr, f"panel {title!r}", metrics)}
    # what the issue asks the dashboard to show
    for name in ("elastico_allocator_queue_length", "elastico_allocator_pending_jobs", "elastico_allocator_round_seconds_bucket",
                 "elastico_allocator_placements_total", "elastico_allocator_gpu_allocated_ratio",
                 "elastico_allocator_gpu_effective_ratio", "elastico_allocator_predicted_norm_throughput_sum",
                 "elastico_allocator_observed_norm_throughput_sum", "elastico_allocator_service_p99_latency_ms",
                 "elastico_allocator_service_latency_slo_ms", "elastico_allocator_degraded", "elastico_allocator_leader_epoch"):
        assert name in used, name


def test_dashboard_layout_and_datasource():
    dash = json.loads(DASHBOARD.read_text())
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "${ELASTICO_PROMETHEUS_URL}"
    ids, cells = set(), set()
    for p in dash["panels"]:
        assert p["id"] not in ids, f"duplicate panel id {p['id']}"
        ids.add(p["id"])
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"panel {p['title']!r} overlaps another"
        cells |= area
        if p["type"] != "row":
            assert p["description"], p["title"]
            assert p["datasource"]["uid"] == source["uid"], p["title"]
            assert all(t["datasource"]["uid"] == source["uid"] for t in p["targets"]), p["title"]
    prov = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "elastico.yaml").read_text())
    assert prov["providers"][0]["options"]["path"] == "${ELASTICO_DASHBOARDS_DIR}"


def test_alert_rules_parse_use_defined_metrics_and_cover_the_required_alerts():
    metrics = defined_metrics()
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    found = {}
    for r in rules:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r["alert"]
        assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"], r["alert"]
        assert promql_parser.parse_duration(r["for"]).total_seconds() >= 60, r["alert"]
        found[r["alert"]] = check_expr(r["expr"], f"alert {r['alert']}", metrics)
    for concept, (metric, labels) in REQUIRED_ALERTS.items():
        hits = [a for a, sel in found.items() if any(n == metric and labels.items() <= m.items() for n, m in sel)]
        assert hits, f"no alert for {concept!r} (reading {metric}{labels or ''})"
    slo = next(r for r in rules if "elastico_allocator_service_latency_slo_ms" in r["expr"])
    assert "elastico_allocator_service_p99_latency_ms" in slo["expr"] and re.search(r">", slo["expr"])


def test_prometheus_configs_point_at_the_rules_and_targets():
    for name in ("prometheus.yml", "prometheus-kubernetes.yml"):
        cfg = yaml.safe_load((DEPLOY / "prometheus" / name).read_text())
        assert cfg["rule_files"] == ["alerts.yml"], name
        (job,) = cfg["scrape_configs"]
        assert job["job_name"] == "elastico"
    local = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["scrape_configs"][0]
    assert local["file_sd_configs"][0]["files"] == ["targets/*.json"]
    groups = json.loads((DEPLOY / "prometheus" / "compose-targets.json").read_text())
    groups += cluster.prometheus_targets([("allocator", "allocator", 9100), ("node-1", "node-agent", 9104)])
    for g in groups:  # Prometheus' file_sd format: host:port targets and string labels
        assert all(re.fullmatch(r"[\w.-]+:\d+", t) for t in g["targets"]) and g["labels"]["service"]
        assert all(isinstance(v, str) for v in g["labels"].values())


def test_compose_monitoring_profile_mounts_the_files():
    import compose

    binary = Path(compose.__file__).parent / "docker-compose"
    env = {**os.environ, "ELASTICO_REDIS_PASSWORD": "0" * 64}
    r = subprocess.run([str(binary), "-f", str(ROOT / "docker-compose.yml"), "--profile", "monitoring", "config",
                        "--format", "json"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    svc = json.loads(r.stdout)["services"]
    mounts = {name: {v["target"]: v.get("source") for v in svc[name]["volumes"]} for name in ("prometheus", "grafana")}
    for target in ("/etc/prometheus/prometheus.yml", "/etc/prometheus/alerts.yml", "/etc/prometheus/targets/compose.json"):
        assert Path(mounts["prometheus"][target]).exists(), target
    assert Path(mounts["grafana"]["/etc/grafana/provisioning"], "datasources", "prometheus.yaml").exists()
    assert svc["grafana"]["environment"]["ELASTICO_PROMETHEUS_URL"] == "http://prometheus:9090"
    assert svc["prometheus"]["profiles"] == ["monitoring"] == svc["grafana"]["profiles"]


def test_monitoring_says_what_is_not_installed(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # neither prometheus nor grafana-server on it
    state: dict = {}
    assert cluster.start_monitoring(tmp_path, [("allocator", "allocator", 9100)], tmp_path, state) == []
    assert "prometheus is not installed" in capsys.readouterr().err and state["monitoring"] == {}


FAKE_PROMETHEUS = """#!{python}
# stands in for prometheus: records its arguments, answers /-/ready on --web.listen-address
import http.server, json, sys
args = sys.argv[1:]
open({argv!r}, "w").write(json.dumps(args))
host, port = next(a.split("=", 1)[1] for a in args if a.startswith("--web.listen-address=")).rsplit(":", 1)
class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/-/ready" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer((host, int(port)), Ready).serve_forever()
"""


def test_monitoring_starts_prometheus_on_the_run_targets(tmp_path, monkeypatch):
    import signal
    import sys
    import time

    bin_dir, rd = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir()
    (rd / "logs").mkdir(parents=True)
    fake = bin_dir / "prometheus"
    fake.write_text(FAKE_PROMETHEUS.format(python=sys.executable, argv=str(tmp_path / "argv.json")))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))  # prometheus, no grafana-server
    monkeypatch.setenv("ELASTICO_PROMETHEUS_PORT", str(cluster.free_port()))
    state: dict = {}
    (proc,) = cluster.start_monitoring(rd, [("allocator", "allocator", 9100), ("node-1", "node-agent", 9104)],
                                       rd / "logs", state)
    try:
        deadline = time.monotonic() + 15
        while cluster._health(vars(proc), None) != "SERVING":
            assert time.monotonic() < deadline, (rd / "logs" / "prometheus.log").read_text()
            time.sleep(0.1)
        prom = rd / "monitoring" / "prometheus"
        args = json.loads((tmp_path / "argv.json").read_text())
        assert f"--config.file={prom / 'prometheus.yml'}" in args and f"--web.listen-address={proc.address}" in args
        assert (prom / "prometheus.yml").read_text() == (DEPLOY / "prometheus" / "prometheus.yml").read_text()
        assert (prom / "alerts.yml").read_text() == ALERTS.read_text()
        targets = json.loads((prom / "targets" / "local.json").read_text())
        assert targets == cluster.prometheus_targets([("allocator", "allocator", 9100), ("node-1", "node-agent", 9104)])
        assert state["monitoring"] == {"prometheus": f"http://{proc.address}"}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        os.waitpid(proc.pid, 0)  # our child: reap it


# --- the metrics the dashboard added ------------------------------------------------------------------------
def _value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_pending_reasons_count_pending_jobs_only():
    jobs = [make_job(), make_job(reason=StateReason.UNSCHEDULABLE_NOW), make_job(reason=StateReason.UNSCHEDULABLE_NOW),
            make_job(reason=StateReason.PREEMPTED), make_job(state=JobState.RUNNING, reason=StateReason.STARTED)]
    assert pending_reasons(jobs) == {"submitted": 1, "unschedulable_now": 2, "preempted": 1}


def test_allocated_ratio_counts_unlimited_training_as_a_whole_gpu_as_the_simulator_does():
    # GPU 0: job 0 alone at a 50 % slice, unlimited; GPU 1: job 1 at 50 % limited next to service 2 at 40 %;
    # GPU 2: job 3 at 25 %, limited (its service has left); GPU 3 empty
    v = pb.view([{}, {}, {"kind": 1}, {}], gpus=4, placed={0: ([0], 50.0), 1: ([1], 50.0), 2: ([1], 40.0), 3: ([2], 25.0)})
    assert allocated_ratio(v) == pytest.approx((0.5 + 0.9 + 0.25) / 4)  # without flags: the shares
    v = replace(v, jobs=replace(v.jobs, limited=np.array([False, True, False, True])))
    assert allocated_ratio(v) == pytest.approx((1.0 + 0.9 + 0.25) / 4)
    assert allocated_ratio(pb.view([{}], gpus=0)) == 0.0
    idle = pb.view([], gpus=2)  # GPUs and no job at all (the live view's first rounds)
    assert allocated_ratio(replace(idle, jobs=replace(idle.jobs, limited=np.zeros(0, bool)))) == 0.0


def test_effective_utilisation_weights_shares_by_speed():
    # GPU 0: job 0 (50 %, observed at 0.8) with job 1 (50 %, predicted 0.6); GPU 1: job 2 alone (100 %, no reading)
    v = pb.view([{}, {}, {}], gpus=2, placed={0: ([0], 50.0), 1: ([0], 50.0), 2: ([1], 100.0)})
    assert effective_utilisation(v, {0: 0.8}, {0: 0.5, 1: 0.6}) == pytest.approx((0.5 * 0.8 + 0.5 * 0.6 + 1.0) / 2)
    empty = pb.view([{}], gpus=2)
    assert effective_utilisation(empty, {}, {}) == 0.0


def test_round_metrics_record_reasons_nodes_utilisation_and_drift():
    rm = RoundMetrics()
    v = pb.view([{}, {}, {}], gpus=2, placed={0: ([0], 50.0), 1: ([0], 50.0)}, now=1000.0)
    rep = RoundReport(epoch=3, pending=1, degraded=["pricer unavailable: fallback", "node n2: heartbeat 30s old: no new placements",
                                                    "node n3: agent not ready: no new placements"])
    rm.record(RoundOutcome(rep, v, [make_node("n1")], observed={0: 0.9, 1: 0.4}, predicted={0: 0.7, 1: 0.6},
                           pending_reasons={"submitted": 1, "preempted": 2}))
    assert _value("elastico_allocator_nodes", state="fresh") == 1 and _value("elastico_allocator_nodes", state="stale") == 2
    assert _value("elastico_allocator_pending_jobs", reason="preempted") == 2
    assert _value("elastico_allocator_gpu_effective_ratio") == pytest.approx((0.5 * 0.9 + 0.5 * 0.4) / 2)
    assert _value("elastico_allocator_norm_throughput_error_mean") == pytest.approx((0.2 - 0.2) / 2, abs=1e-12)
    assert _value("elastico_allocator_norm_throughput_error_mean_abs") == pytest.approx(0.2)

    # a later round: the preempted jobs left the queue (their series reads 0), one more error sample
    rep2 = RoundReport(epoch=3, pending=1)
    rm.record(RoundOutcome(rep2, pb.view([{}, {}], gpus=1, placed={0: ([0], 50.0), 1: ([0], 50.0)}, now=1010.0), [make_node("n1")],
                           observed={0: 0.5}, predicted={0: 0.9}, pending_reasons={"submitted": 1}))
    assert _value("elastico_allocator_pending_jobs", reason="preempted") == 0
    assert _value("elastico_allocator_nodes", state="stale") == 0
    assert _value("elastico_allocator_norm_throughput_error_mean_abs") == pytest.approx((0.2 + 0.2 + 0.4) / 3)
    assert _value("elastico_allocator_norm_throughput_error_mean") == pytest.approx((0.2 - 0.2 - 0.4) / 3)

    # no pending-reasons input leaves those gauges as they were; the window empties once its samples age out
    rm.record(RoundOutcome(rep2, pb.view([{}], gpus=1, now=1010.0 + ERROR_WINDOW_S + 1), [], {}, {}))
    assert _value("elastico_allocator_pending_jobs", reason="submitted") == 1
    assert math.isnan(_value("elastico_allocator_norm_throughput_error_mean_abs"))
    assert np.isnan(_value("elastico_allocator_norm_throughput_error_mean"))
