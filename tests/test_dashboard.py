"""deploy/grafana/tandem-dashboard.json: a dashboard Grafana loads (the structure of its dashboard
model, checked field by field: no official JSON schema is published), whose every query is
well-formed PromQL naming only metrics a real router serves on /metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.config import RouterConfig
from tests.stack import running_stack

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "tandem-dashboard.json"
PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "bargauge", "table", "heatmap", "text"}
GRID_COLUMNS = 24
PROMQL_FUNCTIONS = {"rate", "irate", "increase", "sum", "avg", "min", "max", "count", "histogram_quantile",
                    "clamp_min", "clamp_max", "abs", "topk", "bottomk", "label_values", "vector", "scalar"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                "offset"}
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range"}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "summary": ("", "_sum", "_count", "_created")}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def served_metrics(model_pair) -> set[str]:
    """Every series name a live router exposes (one request in, so labelled children exist too);
    for a metric family, every name its type implies, whether or not a sample has been made yet."""
    with running_stack(model_pair, RouterConfig(max_num_batched_tokens=64, max_num_seqs=8)) as s:
        url = s["router"].url
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={"model": "tiny", "prompt": [5, 6, 7, 8],
                                                                  "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200, r.text
        text = httpx.get(f"{url}/metrics", timeout=10).text
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names


def panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' collapsed children included."""
    out = []
    for p in dashboard["panels"]:
        out += [p, *p.get("panels", [])]
    return out


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and query variable."""
    out = [(f"panel {p['title']!r} target {t['refId']}", t["expr"]) for p in panels(dashboard)
           for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"variable {var['name']}", var["query"]["query"]))
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: what is left once strings, label matchers, ranges,
    grouping label lists, numbers, functions and keywords are taken out."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    e = re.sub(r"\{[^{}]*\}", "", e)
    e = re.sub(r"\[[^\[\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", r"\1", e)
    e = re.sub(r"label_values\(\s*([A-Za-z_:][\w:]*)\s*,\s*\w+\s*\)", r"\1", e)
    e = re.sub(r"(?<![\w:])\d+(\.\d+)?([eE][+-]?\d+)?", "", e)
    idents = set(re.findall(r"[A-Za-z_:][\w:]*", e))
    return idents - PROMQL_FUNCTIONS - PROMQL_WORDS


def test_dashboard_model(dashboard):
    d = dashboard
    assert isinstance(d["title"], str) and d["title"] and re.fullmatch(r"[\w-]{1,40}", d["uid"])
    assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    assert d["time"]["from"].startswith("now-") and d["time"]["to"] == "now"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in panels(d)]
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(set(ids)), "panel ids are unique integers"
    cells: dict[tuple[int, int], str] = {}
    for p in panels(d):
        assert p["type"] in PANEL_TYPES and p["title"], p
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("h", "w", "x", "y")) and g["h"] > 0 and g["w"] > 0
        assert 0 <= g["x"] and g["x"] + g["w"] <= GRID_COLUMNS, f"{p['title']!r} leaves the 24-column grid"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]
        if p["type"] == "row":
            assert "targets" not in p
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), f"{p['title']!r}: targets need distinct refIds"
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip()
            assert "unit" in p["fieldConfig"]["defaults"]


def test_every_query_is_well_formed_and_uses_defined_variables(dashboard):
    variables = {v["name"] for v in dashboard["templating"]["list"]} | GRAFANA_BUILTINS
    for where, expr in queries(dashboard):
        depth = {"(": 0, "[": 0, "{": 0}
        closing = {")": "(", "]": "[", "}": "{"}
        for ch in re.sub(r'"(?:[^"\\]|\\.)*"', "", expr):
            if ch in depth:
                depth[ch] += 1
            elif ch in closing:
                depth[closing[ch]] -= 1
                assert depth[closing[ch]] >= 0, f"{where}: unbalanced {ch!r} in {expr}"
        assert not any(depth.values()), f"{where}: unbalanced brackets in {expr}"
        for name in re.findall(r"\$\{?(\w+)", expr):
            assert name in variables, f"{where}: ${name} is not a dashboard variable"
        assert metric_names(expr), f"{where}: queries no metric: {expr}"


def test_metric_name_extraction():
    expr = ('histogram_quantile(0.99, sum by (le) (rate(tandem:ttft_bucket{instance=~"$instance"}[5m]))) / '
            'ignoring(position) group_left sum(rate(other_total[1m])) * 1e3')
    assert metric_names(expr) == {"tandem:ttft_bucket", "other_total"}


def test_every_metric_the_dashboard_queries_is_served(dashboard, served_metrics):
    wanted = {name: where for where, expr in queries(dashboard) for name in metric_names(expr)}
    missing = {name: where for name, where in wanted.items() if name not in served_metrics}
    assert not missing, f"not on a live router's /metrics: {missing}"
    panel_metrics = {n for p in panels(dashboard) for t in p.get("targets", []) for n in metric_names(t["expr"])}
    for needed in ("tandem:time_to_first_token_seconds_bucket", "tandem:inter_token_latency_seconds_bucket",
                   "tandem:generation_tokens_total", "tandem:spec_decode_num_accepted_tokens_total",
                   "tandem:pipeline_hits_total", "tandem:target_busy_seconds_total", "tandem:num_requests_waiting",
                   "tandem:replica_kv_cache_usage_perc"):
        assert needed in panel_metrics, f"the dashboard shows no {needed}"
