"""deploy/prometheus and deploy/grafana, checked offline: Prometheus' own promtool validates the config and the rules
and runs the rules' unit tests (each alert fires when it should, and not on a healthy system); the dashboard covers
what an operator watches, per worker, on the provisioned datasource. That the metrics they query are ones pdserve
exports is checked against a running stack in test_prometheus_stack.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from stack import REPO

PROMETHEUS = REPO / "deploy" / "prometheus"
GRAFANA = REPO / "deploy" / "grafana"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus)")


def dashboard() -> dict:
    return json.loads((GRAFANA / "dashboards" / "pdserve.json").read_text())


def panels() -> list[dict]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def alert_rules() -> list[dict]:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def promql_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) for every dashboard query and alert rule."""
    exprs = [(f"panel {p['title']!r}", t["expr"]) for p in panels() for t in p["targets"]]
    return exprs + [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: pdserve's own, and Prometheus' `up`."""
    without_strings = re.sub(r'"[^"]*"', '""', expr)  # label values are not metric names
    return {m for m in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", without_strings)
            if m.startswith("pdserve_") or m == "up"}


@needs_promtool
def test_promtool_accepts_the_config_and_rules():
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "alerts.yml"]):
        out = subprocess.run([PROMTOOL, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_alerts_fire_when_they_should():
    out = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yml"], cwd=PROMETHEUS, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    tested = set(re.findall(r"alertname: (\w+)", (PROMETHEUS / "alerts_test.yml").read_text()))
    assert tested == {r["alert"] for r in alert_rules()}, "every alert needs a unit test"


def test_the_issue_s_alerts_are_there():
    alerts = {r["alert"]: r for r in alert_rules()}
    wanted = {"PdserveHighErrorRate": "pdserve_requests_total", "PdserveTTFTHigh": "time_to_first_token",
              "PdserveKVPoolNearFull": "pdserve_kv_pool_usage_ratio",
              "PdserveKVTransferFailures": "pdserve_kv_transfer_failures_total", "PdserveWorkerDown": "up"}
    for name, metric in wanted.items():
        assert metric in alerts[name]["expr"]
        assert {"summary", "description"} <= set(alerts[name]["annotations"]) and alerts[name]["labels"]["severity"]
    readme = (REPO / "README.md").read_text()
    for name in alerts:
        assert name in readme, f"the README's operator section does not explain {name}"


def test_dashboard_uses_the_provisioned_datasource():
    source = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = source["datasources"][0]["uid"]
    assert dashboard()["uid"] == "pdserve" and panels()
    for p in panels():
        assert p["datasource"] == {"type": "prometheus", "uid": uid}, p["title"]
        assert p["targets"] and all(t["expr"].strip() and t["datasource"]["uid"] == uid for t in p["targets"])


def test_dashboard_covers_what_the_issue_asks():
    queries = [(p["title"], t["expr"]) for p in panels() for t in p["targets"]]
    used = set().union(*(metric_names(q) for _, q in queries))

    def quantiles(metric: str) -> set[str]:
        return {m.group(1) for _, q in queries if metric in q for m in [re.search(r"histogram_quantile\((0\.\d+)", q)]
                if m}

    for metric in ("pdserve_time_to_first_token_seconds", "pdserve_inter_token_latency_seconds",
                   "pdserve_e2e_request_latency_seconds"):
        assert {"0.5", "0.99"} <= quantiles(metric), f"{metric}: p50 and p99"
    for metric in ("pdserve_requests_total", "pdserve_generation_tokens_total", "pdserve_num_queue_reqs",
                   "pdserve_kv_pool_usage_ratio", "pdserve_prefix_cache_hit_tokens_total",
                   "pdserve_kv_transfer_bytes_total", "pdserve_kv_transfer_failures_total",
                   "pdserve_spec_accept_length_sum", "pdserve_spec_accept_length_count"):
        assert metric in used, f"no panel shows {metric}"
    per_worker = [title for title, q in queries if re.search(r"by \([^)]*instance", q)]
    assert len(per_worker) >= 6, f"per-worker panels: {per_worker}"


def test_dashboard_panels_do_not_overlap():
    boxes = [(p["title"], p["gridPos"]) for p in dashboard()["panels"]]
    for i, (a, ga) in enumerate(boxes):
        assert ga["x"] + ga["w"] <= 24, a
        for b, gb in boxes[i + 1:]:
            apart = (ga["x"] + ga["w"] <= gb["x"] or gb["x"] + gb["w"] <= ga["x"] or
                     ga["y"] + ga["h"] <= gb["y"] or gb["y"] + gb["h"] <= ga["y"])
            assert apart, f"panels {a!r} and {b!r} overlap"
