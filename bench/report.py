"""results.json, samples.json (ITL samples for the plots, one row per request) and results.md (the tables)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.stats import ratio_lines


def _n(x: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def latency_table(data: dict) -> list[str]:
    names = {c["key"]: c["name"] for c in data["configs"]}
    rows = ["| config | load | TTFT p50 / p99 (ms) | ITL p50 / p90 / p99 (ms) | e2e p50 / p99 (s) | output tok/s "
            "| req/s | errors |", "|---|---|---|---|---|---|---|---|"]
    for cfg, loads in data["results"].items():
        for load, s in loads.items():
            label = next(x["label"] for x in data["plan"]["loads"] if x["name"] == load)
            sim = " †" if cfg == "hf" and load != "c1" else ""
            rows.append(
                f"| ({cfg}) {names[cfg]} | {label}{sim} | {_n(s['ttft_ms']['p50'], '{:.0f}')} / "
                f"{_n(s['ttft_ms']['p99'], '{:.0f}')} | {_n(s['itl_ms']['p50'])} / {_n(s['itl_ms']['p90'])} / "
                f"{_n(s['itl_ms']['p99'])} | {_n(s['e2e_s']['p50'], '{:.2f}')} / {_n(s['e2e_s']['p99'], '{:.2f}')} "
                f"| {_n(s['tokens_per_s'])} | {_n(s['requests_per_s'], '{:.2f}')} | {s['errors']} |")
    return rows


def engine_table(data: dict) -> list[str]:
    rows = ["| config | load | steps/s | tokens/step | acceptance | drafts/verify | emitted/step | pipeline hits "
            "| target busy | target ms/step | draft ms/step (critical path) | router+RPC ms/step |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cfg, loads in data["results"].items():
        if cfg == "hf":
            continue
        for load, s in loads.items():
            e = s.get("engine", {})
            rows.append(
                f"| ({cfg}) | {load} | {_n(e.get('steps_per_s'))} | {_n(e.get('tokens_per_step'))} "
                f"| {_n(e.get('acceptance'), '{:.2f}')} | {_n(e.get('draft_tokens_per_verify'), '{:.2f}')} "
                f"| {_n(e.get('emitted_per_step'), '{:.2f}')} | {_n(e.get('pipeline_hit_rate'), '{:.0%}')} "
                f"| {_n(e.get('target_busy'), '{:.0%}')} | {_n(e.get('target_ms_per_step'))} "
                f"| {_n(e.get('draft_ms_per_step'))} | {_n(e.get('router_ms_per_step'))} |")
    return rows


def markdown(data: dict) -> str:
    m = data["meta"]
    lines = [
        f"# Tandem benchmark — {m['models']} ({'quick' if m['quick'] else 'full'} run, {m['date']})", "",
        f"`{m['command']}` on {m['machine']['cpus']} CPU cores ({m['machine']['cpu_model']}), "
        f"torch {m['machine']['torch']}, {m['machine']['torch_threads_services']} torch threads per service; "
        f"load average {m['machine']['loadavg_start']} at start, {m['machine']['loadavg_end']} at the end. "
        f"Router budget {m['budget']} tokens/step, k_max {m['k_max']}. Took {m['seconds'] / 60:.1f} min.", "",
        f"Workload: {data['workload']['prompts']} prompts cut from held-out stdlib files "
        + ", ".join(f"{k} {v['n']} ({v['min']}-{v['max']} tokens)" for k, v in data['workload']['by_kind'].items())
        + f"; outputs {m['out_tokens'][0]}-{m['out_tokens'][1]} tokens, greedy, ignore_eos. Poisson rates are "
        f"fractions of config (1)'s closed-loop c=16 capacity ({m['capacity_req_s']:.2f} req/s).", "",
        "ITL is measured per token from SSE chunk arrival times: a chunk carrying n tokens, dt after the "
        "previous chunk, counts n intervals of dt/n. † the transformers anchor serves one request at a "
        "time: its latencies under load are its measured service times plus the FIFO wait that implies.", "",
        "## Latency and throughput", "", *latency_table(data), "",
        "## Inside the router (from /metrics deltas)", "", *engine_table(data), "",
        "## Correctness", "",
        f"Greedy outputs compared across every config and load: {data['correctness']['answers_compared']} answers "
        f"for {data['correctness']['prompts']} prompts, {data['correctness']['mismatches']} mismatches. "
        f"Transformers anchor vs Tandem: {data['anchor_agreement']}.", "",
        "## Ratios", "", *(f"- {x}" for x in ratio_lines(data["ratios"])), "",
    ]
    return "\n".join(lines)


def _finite(x: object) -> object:
    """NaN (a ratio with nothing under it) becomes null: strict JSON."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def load(js: Path) -> dict:
    """A saved run, with the ITL samples the plots need (samples.json beside it)."""
    data = json.loads(js.read_text())
    samples = js.parent / "samples.json"
    data.update(json.loads(samples.read_text()) if samples.is_file() else {"itl_samples": {}})
    return data


def write(out: Path, data: dict) -> tuple[Path, Path]:
    """results.json (all but the samples); samples.json: itl_samples[config][load] (ms per token) and
    requests[config][load] = rows of [pid, sent s, TTFT s, e2e s, tokens, chunks]; results.md."""
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "results.json", out / "results.md"
    apart = ("itl_samples", "requests")
    rest = {k: v for k, v in data.items() if k not in apart}
    js.write_text(json.dumps(_finite(rest), indent=1, allow_nan=False) + "\n")
    samples = {k: data[k] for k in apart if k in data}
    (out / "samples.json").write_text(json.dumps(_finite(samples), separators=(",", ":")) + "\n")
    md.write_text(markdown(data))
    return js, md
