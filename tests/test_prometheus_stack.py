"""Monitoring against a running CPU stack: every metric the dashboard and the alert rules query is one the router and
workers export, and a real Prometheus (Debian's package) started with deploy/prometheus/prometheus.yml adapted to
the local ports scrapes them, loads the alert rules, evaluates every dashboard query, and answers the TTFT
histogram after some traffic."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdserve.sampling import SamplingParams

from stack import free_port, generate, scrape
from test_deploy_monitoring import PROMETHEUS, alert_rules, metric_names, promql_expressions

pytestmark = pytest.mark.slow
PROMETHEUS_BIN = shutil.which("prometheus")
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
SAMPLE_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
                   "summary": ("", "_sum", "_count"), "info": ("_info",), "unknown": ("",)}


@pytest.fixture(scope="module")
def stack(shared_stack):
    return shared_stack  # (conftest.py: one stack of the defaults for the modules that only send requests)


def exported_names(text: str) -> set[str]:
    """Sample names a /metrics page exports, declared families included: a labelled counter nobody has incremented
    yet (KV transfer failures) has no sample, but its name is what a query must use."""
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + suffix for suffix in SAMPLE_SUFFIXES[family.type]}
        names |= {s.name for s in family.samples}
    return names


def test_every_queried_metric_is_exported(stack):
    generate(stack.router.address, "Hello there", GREEDY)
    exported = set().union(*(exported_names(scrape(p)) for p in stack.all()))
    queried = {}
    for where, expr in promql_expressions():
        for name in metric_names(expr):
            queried.setdefault(name, where)
    assert len(queried) >= 12, sorted(queried)
    missing = {name: where for name, where in queried.items() if name not in exported | {"up"}}
    assert not missing, f"queried but not exported by any pdserve process: {missing}"


def grafana_variables(expr: str) -> str:
    """A dashboard query as Grafana sends it: $__rate_interval a fixed window, the model_name variable on All."""
    return expr.replace("$__rate_interval", "30s").replace("$model_name", ".*")


# ---- a real Prometheus ------------------------------------------------------------------------------------------
def local_config(stack, rules_path: str, self_port: int) -> dict:
    """deploy/prometheus/prometheus.yml with each job's targets replaced by this stack's metrics ports (compose DNS
    names do not resolve here) and 1 s intervals; everything else as deployed, rules included."""
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    procs = {"router": [stack.router], "prefill": stack.prefill, "decode": stack.decode}
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {*procs, "prometheus"}, "adapt this test to the deployed jobs"
    for name, job in jobs.items():
        for key in ("static_configs", "dns_sd_configs"):
            job.pop(key, None)
        ports = [p.metrics_port for p in procs[name]] if name in procs else [self_port]
        job["static_configs"] = [{"targets": [f"127.0.0.1:{port}" for port in ports]}]
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [rules_path]
    return config


class Prometheus:
    def __init__(self, port: int):
        self.url = f"http://127.0.0.1:{port}"

    def get(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> list[dict]:
        return self.get("/api/v1/query", query=promql)["result"]

    def wait_for(self, what: str, check, timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                result = check()
                if result:
                    return result
            except (OSError, AssertionError) as e:
                result = e
            if time.monotonic() > deadline:
                raise AssertionError(f"Prometheus: {what} not within {timeout_s}s (last: {result})")
            time.sleep(0.25)


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory):
    if PROMETHEUS_BIN is None:
        pytest.skip("prometheus not installed (Debian package prometheus; scripts/setup.sh installs it)")
    work = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    (work / "prometheus.yml").write_text(yaml.safe_dump(local_config(stack, str(PROMETHEUS / "alerts.yml"), port)))
    log = open(work / "prometheus.log", "w")
    proc = subprocess.Popen([PROMETHEUS_BIN, f"--config.file={work / 'prometheus.yml'}",
                             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    prom = Prometheus(port)
    try:
        prom.wait_for("ready", lambda: proc.poll() is None and urllib.request.urlopen(f"{prom.url}/-/ready",
                                                                                      timeout=2).status == 200)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        if proc.returncode not in (0, -15):
            print((work / "prometheus.log").read_text()[-3000:])


def test_prometheus_scrapes_every_process_and_loads_the_alerts(stack, prometheus):
    def all_up():
        targets = prometheus.get("/api/v1/targets")["activeTargets"]
        return len(targets) == len(stack.all()) + 1 and all(t["health"] == "up" for t in targets)

    prometheus.wait_for("every target up", all_up)
    def rules_evaluated():
        groups = prometheus.get("/api/v1/rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return len(rules) == len(alert_rules()) and all(r["health"] == "ok" for r in rules) and rules

    rules = prometheus.wait_for("alert rules evaluated", rules_evaluated)
    assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules()}
    firing = [r["name"] for r in rules if r["state"] == "firing"]
    assert "PdserveWorkerDown" not in firing and "PdserveKVTransferFailures" not in firing


def test_ttft_histogram_after_traffic(stack, prometheus, tiny_v3_dir):
    prometheus.wait_for("the router scraped", lambda: prometheus.query('up{job="router"} == 1'))
    before = prometheus.query('sum(pdserve_time_to_first_token_seconds_count{job="router"})')
    sent_before = float(before[0]["value"][1]) if before else 0.0
    for prompt in ("The router sends", "Hello", [5, 6, 7, 8, 9]):
        generate(stack.router.address, prompt, GREEDY)

    def buckets():
        series = prometheus.query('pdserve_time_to_first_token_seconds_bucket{job="router"}')
        inf = [float(s["value"][1]) for s in series if s["metric"]["le"] == "+Inf"]
        return series if inf and inf[0] >= sent_before + 3 else None

    series = prometheus.wait_for("TTFT buckets counting the new requests", buckets)
    assert len(series) >= 10 and {s["metric"]["role"] for s in series} == {"router"}
    assert {s["metric"]["model_name"] for s in series} == {tiny_v3_dir.name}
    # The dashboard's own p99 query (Grafana's variables as it sends them) gives a finite latency.
    p99 = next(e for w, e in promql_expressions() if "Time to first token (router)" in w and "0.99" in e)
    p99 = grafana_variables(p99)
    value = prometheus.wait_for("a finite TTFT p99", lambda: [r for r in prometheus.query(p99)
                                                             if math.isfinite(float(r["value"][1]))])
    assert 0 < float(value[0]["value"][1]) <= 60


def test_every_dashboard_and_alert_query_evaluates(prometheus):
    for where, expr in promql_expressions():
        try:
            prometheus.query(grafana_variables(expr))
        except Exception as e:  # urllib raises HTTPError 400 for a query Prometheus cannot parse
            raise AssertionError(f"{where}: {expr}\n{getattr(e, 'read', lambda: b'')().decode()}") from None
