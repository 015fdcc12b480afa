"""A real Prometheus scrapes a running cluster (the router and its workers: 1 prefill, 2 decode, from
tests/observability/conftest.py) under a short load: every query of the Grafana dashboard and every
recording rule returns data through Prometheus' HTTP API, every series carries `model_name`, and each
exporter passes `promtool check metrics`.

One cluster and one load serve the whole module (queries read what the load left behind)."""
from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import yaml

from common.metric_identity import served_model_name
from tests.factories import TinySpec
from tests.observability.prometheus_server import PrometheusServer

CHART_FILES = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "splitserve" / "files"
RULES = CHART_FILES / "splitserve-rules.yaml"
DASHBOARD = CHART_FILES / "splitserve-dashboard.json"
NUM_REQUESTS = 16
RATE_WINDOW = "1m"  # what Grafana's $__rate_interval stands for here


@pytest.fixture(scope="module")
def exporters(stack) -> dict[str, str]:
    """job → host:port of every exporter: the router's and each worker's (from the worker's stats)."""
    service = stack.server.service

    def ports() -> dict[str, int | None]:
        return {m.worker_id: getattr(service.monitor.stats.get(m.worker_id), "metrics_port", None)
                for m in service.cluster.members}

    deadline = 30
    for _ in range(deadline * 4):
        found = ports()
        if found and all(found.values()):
            break
        stack.loop.call(_sleep(0.25))
    assert found and all(found.values()), f"worker metrics ports not reported: {found}"
    return {"router": f"127.0.0.1:{stack.server.exporter.port}",
            **{worker: f"127.0.0.1:{port}" for worker, port in found.items()}}


async def _sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)


@pytest.fixture(scope="module")
def model_name(checkpoint) -> str:
    return served_model_name(checkpoint(TinySpec()))


@pytest.fixture(scope="module")
def prometheus(stack, exporters, model_name, tmp_path_factory):
    """Prometheus scraping every exporter, after a short load through the real openai client."""
    server = PrometheusServer(tmp_path_factory.mktemp("prometheus"),
                              {"router": [exporters["router"]],
                               "workers": [a for job, a in exporters.items() if job != "router"]},
                              (RULES,))
    try:
        server.wait_targets_up(len(exporters))
        _load(stack.server.http.url, model_name)
        ok = f'sum(splitserve_router_requests_total{{outcome="ok", model_name="{model_name}"}})'
        server.wait(f"{NUM_REQUESTS} requests scraped",
                    lambda: (r := server.query(ok)) and float(r[0]["value"][1]) >= NUM_REQUESTS)
        # a rule evaluation after that scrape, and the workers' last figures (their gauges follow stats polls)
        rate = "model_name:splitserve_requests:rate5m"
        server.wait("recording rules evaluated", lambda: (r := server.query(rate)) and float(r[0]["value"][1]) > 0)
        yield server
    finally:
        server.stop()


def _load(http_url: str, model: str) -> None:
    """NUM_REQUESTS completions, 4 at a time, over two shared prefixes (so prefix caches hit), half streamed."""
    prefixes = ("the quick brown fox jumps over the lazy dog " * 3, "a stitch in time saves nine, they say " * 3)
    with openai.OpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        def one(i: int) -> None:
            prompt = prefixes[i % 2] + f"request {i}"
            if i % 2:
                stream = client.completions.create(model=model, prompt=prompt, max_tokens=6, stream=True,
                                                   extra_body={"ignore_eos": True})
                assert sum(len(chunk.choices[0].text) >= 0 for chunk in stream) >= 1
            else:
                response = client.completions.create(model=model, prompt=prompt, max_tokens=6,
                                                     extra_body={"ignore_eos": True})
                assert response.usage.completion_tokens == 6

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(one, range(NUM_REQUESTS)))


def _dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(f"{p['title']} / {t['refId']}", t["expr"]) for p in panels if p["type"] != "row" for t in p["targets"]]


def test_the_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "model_name"}
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
            for target in panel["targets"]:
                assert 'model_name=~"$model_name"' in target["expr"], panel["title"]
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("request rate", "time to first token", "inter-token", "end-to-end", "goodput", "queue depth",
                  "kv usage", "prefix cache", "hand-off latency", "hand-off bytes", "migrations", "restarts",
                  "rejections"):
        assert topic in titles, topic


@pytest.mark.parametrize("title, expr", _dashboard_queries())
def test_every_dashboard_query_returns_data(prometheus, model_name, title, expr):
    query = expr.replace("$model_name", model_name).replace("$__rate_interval", RATE_WINDOW)
    result = prometheus.query(query)
    assert result, f"{title}: no data for {query}"


def test_the_load_shows_in_the_dashboard_figures(prometheus, model_name):
    """Not only present: the figures a load must move have moved."""
    def value(expr: str) -> float:
        (sample,) = prometheus.query(expr.replace("$m", model_name))
        return float(sample["value"][1])

    assert value('sum(increase(splitserve_router_generation_tokens_total{model_name="$m"}[5m]))') > 0
    assert value('histogram_quantile(0.99, sum by (le) (rate(splitserve_router_ttft_seconds_bucket'
                 '{model_name="$m"}[5m])))') > 0
    assert value('sum(rate(splitserve_worker_kv_transfer_bytes_total{model_name="$m", direction="send"}[5m]))') > 0
    assert value('sum(splitserve_router_worker_healthy{model_name="$m"})') == 3  # 1 prefill, 2 decode
    assert value('sum(increase(splitserve_worker_prefix_cache_hit_tokens_total{model_name="$m"}[5m]))') > 0
    assert value('sum(increase(splitserve_router_inter_token_latency_seconds_count{model_name="$m"}[5m]))') > 0


def test_every_recording_rule_returns_data(prometheus, model_name):
    records = [rule["record"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
               if "record" in rule]
    assert len(records) >= 10
    for record in records:
        assert prometheus.query(f'{record}{{model_name="{model_name}"}}'), f"{record}: no data"


def test_every_series_carries_the_model_name(prometheus, model_name):
    unlabelled = prometheus.query('count by (__name__, job) ({__name__=~"splitserve_.+", model_name=""})')
    assert unlabelled == []
    jobs = {s["metric"]["job"] for s in prometheus.query(f'count by (job) ({{model_name="{model_name}", job!=""}})')}
    assert jobs == {"router", "workers"}
    components = {s["metric"]["component"] for s in prometheus.query("splitserve_build_info")}
    assert components == {"router", "prefill_worker", "decode_worker"}


def test_exporters_pass_promtool_check_metrics(prometheus, exporters):
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool is not installed: run scripts/install_prometheus.sh (make test-deps)"
    for job, address in exporters.items():
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
            text = response.read()
        result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
        assert result.returncode == 0 and not result.stdout and not result.stderr, (job, result)
