"""results.json (everything but the samples), samples.json (ITL samples for the plots, one row per
request) and results.md: the issues' figures first, then per pair x mode the two tables."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.figures import Figure
from bench.plans import Load
from bench.predicted import markdown as predicted_markdown


def _n(x: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def load_dict(ld: Load) -> dict:
    return {"name": ld.name, "label": ld.label, "kind": ld.kind, "n_requests": ld.n_requests,
            "concurrency": ld.concurrency, "rate_frac": ld.rate_frac}


def _labels(data: dict, pair: str) -> dict[str, str]:
    return {x["name"]: x["label"] for x in data["pairs"][pair]["plan"]["loads"]}


def latency_table(data: dict, run: dict) -> list[str]:
    names = {c["key"]: c["name"] for c in data["configs"]}
    labels = _labels(data, run["pair"])
    rows = ["| config | load | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p90 / p99 (ms) | e2e p50 / p99 (s) "
            "| req/s | errors |", "|---|---|---|---|---|---|---|---|"]
    for cfg, loads in run["results"].items():
        for load, s in loads.items():
            sim = " †" if cfg == "hf" and load != "c1" else ""
            rows.append(
                f"| ({cfg}) {names[cfg]} | {labels.get(load, load)}{sim} | {_n(s['tokens_per_s'])} "
                f"| {_n(s['ttft_ms']['p50'], '{:.0f}')} / {_n(s['ttft_ms']['p99'], '{:.0f}')} "
                f"| {_n(s['itl_ms']['p50'])} / {_n(s['itl_ms']['p90'])} / {_n(s['itl_ms']['p99'])} "
                f"| {_n(s['e2e_s']['p50'], '{:.2f}')} / {_n(s['e2e_s']['p99'], '{:.2f}')} "
                f"| {_n(s['requests_per_s'], '{:.2f}')} | {s['errors']} |")
    return rows


def engine_table(data: dict, run: dict) -> list[str]:
    labels = _labels(data, run["pair"])
    rows = ["| config | load | acceptance | drafts / verify | emitted / step | pipeline hits "
            "| misses late / wrong / unasked (filled) | target busy | target ms / step | tokens / step "
            "| draft ms / step, critical path (upfront steps) "
            "| router+RPC ms / step | router+RPC / target | chained (not: draft late) "
            "| draft slowdown / pooled acceptance | cores busy: target / draft / router / client |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cfg, loads in run["results"].items():
        if cfg == "hf":
            continue
        for load, s in loads.items():
            e, cpu = s.get("engine", {}), s.get("cpu_busy", {})
            rows.append(
                f"| ({cfg}) | {labels.get(load, load)} | {_n(e.get('acceptance'), '{:.2f}')} "
                f"| {_n(e.get('draft_tokens_per_verify'), '{:.2f}')} | {_n(e.get('emitted_per_step'), '{:.2f}')} "
                f"| {_n(e.get('pipeline_hit_rate'), '{:.0%}')} | {_n(e.get('pipeline_miss_late'), '{:.0%}')} / "
                f"{_n(e.get('pipeline_miss_wrong'), '{:.0%}')} / {_n(e.get('pipeline_miss_unasked'), '{:.0%}')} "
                f"({_n(e.get('pipeline_fills'), '{:.0%}')}) "
                f"| {_n(e.get('target_busy'), '{:.0%}')} "
                f"| {_n(e.get('target_ms_per_step'))} | {_n(e.get('tokens_per_step'), '{:.0f}')} "
                f"| {_n(e.get('draft_ms_per_step'))} ({_n(e.get('upfront_share'), '{:.0%}')}) "
                f"| {_n(e.get('router_ms_per_step'))} "
                f"| {_n(e.get('router_over_target'), '{:.1%}')} | {_n(e.get('chained_share'), '{:.0%}')} "
                f"({_n(e.get('unchained_draft_late'), '{:.0%}')}) "
                f"| {_n(e.get('draft_slowdown'), '{:.2f}')} / {_n(e.get('pooled_acceptance_draft'), '{:.2f}')} "
                f"| {' / '.join(_n(cpu.get(p), '{:.2f}') for p in ('target', 'draft', 'router', 'client'))} |")
    return rows


def figures_table(rows: list[dict]) -> list[str]:
    out = ["| issue | pair | mode | figure | value | needs | result | detail |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = Figure.from_row(r)
        result = f"**{f.verdict()}**" if f.status == "MISSED" else f.verdict()
        out.append(f"| {f.issue} | {f.pair} | {f.mode} | {f.what} | {f.fmt(f.value)} | {f.op} {f.fmt(f.threshold)} "
                   f"| {result} | {f.detail} |")
    return out


def pair_lines(name: str, p: dict) -> list[str]:
    f, w, c = p["facts"], p["workload"], p["correctness"]
    vocab = f" (output vocabulary {f['draft_vocab_size']} of {f['vocab_size']})" if f["draft_vocab_size"] else ""
    return [
        f"**{name}** (`{f['dir']}`, {f['variant']} build, profile {p['profile']}): target "
        f"{f['target_params'] / 1e6:.1f}M params, draft {f['draft_params'] / 1e6:.1f}M{vocab}, max_model_len "
        f"{f['max_model_len']}. Workload: {w['prompts']} prompts, "
        + ", ".join(f"{k} {v['n']} ({v['min']}-{v['max']} tokens)" for k, v in w["by_kind"].items())
        + f"; outputs {p['plan']['out_tokens'][0]}-{p['plan']['out_tokens'][1]} tokens, greedy, ignore_eos. "
        f"Correctness: {c['answers_compared']} answers for {c['prompts']} prompts compared across configs, loads "
        f"and modes, {c['mismatches']} mismatches"
        + (f" and {c['near_ties']} answers that differ at a float64 near-tie (bench/ties.py)" if c.get("near_ties")
           else "") + "." + "".join(f" Note: {n}." for n in p["notes"]), ""]


def markdown(data: dict) -> str:
    m = data["meta"]
    lines = [
        f"# Tandem benchmark — {'quick' if m['quick'] else 'full'} run, {m['date']}", "",
        f"`{m['command']}` on {m['machine']['cpus']} CPU cores ({m['machine']['cpu_model']}), torch "
        f"{m['machine']['torch']}; load average {m['machine']['loadavg_start']} at start, "
        f"{m['machine']['loadavg_end']} at the end. Router budget {m['budget']} tokens/step, k_max {m['k_max']}. "
        f"Took {m['seconds'] / 60:.1f} min." + (
            f" Each config ran {m['rounds']} times in turn; every figure is from its median round by tokens/s "
            "(the rounds' tokens/s are in results.json, `rounds_tokens_per_s`)." if m.get("rounds", 1) > 1 else ""),
        "",
        *(f"**Skipped**: {s}" for s in m["skipped"]), *([""] if m["skipped"] else []),
        "## Figures the issues ask for", "", *figures_table(data["figures"]), "",
        "## Pairs", "", *(x for name, p in data["pairs"].items() for x in pair_lines(name, p)),
        "ITL is measured per token from SSE chunk arrival times: a chunk carrying n tokens, dt after the previous "
        "chunk, counts n intervals of dt/n. † the transformers anchor serves one request at a time: its latencies "
        "under load are its measured service times plus the FIFO wait that implies. Misses are shares of "
        "pipeline lookups: late = the draft had prepared nothing for that outcome yet, wrong = it had and no "
        "prepared branch matched.", "",
    ]
    for run in data["runs"]:
        stem = f"{run['pair']}-{run['mode']}"
        lines += [
            f"## {run['pair']}, {run['mode']}", "",
            f"{run['pinning']}. Poisson rates are fractions of the first config's c=16 capacity "
            f"({run['capacity_req_s']:.2f} req/s); mixed load = {run['mixed']}. Transformers anchor vs Tandem: "
            f"{run['anchor_agreement']}. {run['seconds'] / 60:.1f} min.", "",
            *(f"**Did not run** {f}" for f in run.get("failures", [])), *([""] if run.get("failures") else []),
            "### Latency and throughput", "", *latency_table(data, run), "",
            "### Inside the router (from /metrics deltas)", "", *engine_table(data, run), "",
            f"![ITL CDF]({stem}-itl_cdf.png)", "", f"![load]({stem}-load.png)", "",
        ]
    for e in data.get("features", []):
        lines += feature_lines(e)
    return "\n".join(lines)


def structured_table(res: dict) -> list[str]:
    rows = ["| pass | valid JSON (greedy, sampled) | finish stop | acceptance | emitted / step | mask B / verify "
            "| router ms / step | target ms / step | tokens/s |", "|---|---|---|---|---|---|---|---|---|"]
    for name in ("free", "json_schema"):
        r = res[name]
        split = ", ".join(f"{k} {v[0]}/{v[1]}" for k, v in r.get("by_sampling", {}).items())
        rows.append(f"| {name} | {r['valid_json']}/{r['requests']} ({split}) | {r['finish_stop']} "
                    f"| {_n(r.get('acceptance'), '{:.2f}')} | {_n(r.get('emitted_per_step'), '{:.2f}')} "
                    f"| {_n(r.get('mask_bytes_per_verification'), '{:.0f}')} | {_n(r.get('router_ms_per_step'))} "
                    f"| {_n(r.get('target_ms_per_step'))} | {_n(r.get('tokens_per_s'))} |")
    return rows


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def answers_text(verdict: str) -> str:
    """bench.multiturn.same_or_ties's verdict in words."""
    return "identical but where they first differ at a float64 near-tie" if verdict == "near-ties" else verdict


def describe_difference(d: dict) -> str:
    """One entry of bench.multiturn.first_differences, as the reports print it (with its verdict, if judged)."""
    verdict = f": {d['verdict']['text']}" if "verdict" in d else ""
    return f"conversation {d['conversation']}, turn {d['turn']}, character {d['at_char']}{verdict}: with " \
           f"{d['with']!r}, without {d['without']!r}"


def multiturn_table(res: dict) -> list[str]:
    rows = ["| mode | TTFT p50 (ms) | TTFT p50, turns 2+ (ms) | output tok/s | acceptance | prefix-cache hit rate "
            "target / draft | attach misses |", "|---|---|---|---|---|---|---|"]
    for mode, r in res["modes"].items():
        hit = r.get("hit_rate", {})
        rows.append(f"| {mode} | {_n(_ms(r.get('ttft_p50')), '{:.0f}')} | {_n(_ms(r.get('ttft_p50_later')), '{:.0f}')} "
                    f"| {_n(r.get('tokens_per_s'))} | {_n(r.get('acceptance'), '{:.2f}')} "
                    f"| {_n(hit.get('target'), '{:.0%}')} / {_n(hit.get('draft'), '{:.0%}')} "
                    f"| {_n(r.get('attach_misses'), '{:.0f}')} |")
    same = answers_text(res.get("answers") or ("identical" if res["answers_identical"] else "DIFFERENT"))
    same = "**DIFFERENT**" if same == "DIFFERENT" else same
    where = [f"- {describe_difference(d)}" for d in res.get("first_differences", [])]
    return [*rows, "", f"Greedy answers with and without prefix caching: {same}.", *([""] + where if where else [])]


def feature_lines(e: dict) -> list[str]:
    """One feature workload's section (an entry of bench/features.py)."""
    head = [f"## {e['pair']}, {e['workload']} workload ({e['mode']})", ""]
    if e["status"] != "ran":
        return [*head, f"**{e['status']}**: {e['reason']}", ""]
    settings = ", ".join(f"{k} {v}" for k, v in e["settings"].items())
    table = (structured_table(e["results"]) if e["workload"] == "structured"
             else predicted_markdown(e["results"]) if e["workload"] == "predicted" else multiturn_table(e["results"]))
    return [*head, f"Settings: {settings}. {e['seconds'] / 60:.1f} min.", "", *table, ""]


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
    """A saved run, with the samples the plots need (samples.json beside it)."""
    data = json.loads(js.read_text())
    samples = js.parent / "samples.json"
    data.update(json.loads(samples.read_text()) if samples.is_file() else {"itl_samples": {}})
    return data


def save_partial(out: Path, entry: dict) -> Path:
    """One pair x mode (or feature workload) as soon as it is done: OUT/partial/PAIR-MODE[-WORKLOAD].json,
    so a run that dies later still leaves what it measured."""
    name = "-".join(x for x in (entry["pair"], entry["mode"], entry.get("workload")) if x)
    path = out / "partial" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(entry), indent=1) + "\n")
    return path


def write(out: Path, data: dict, samples: dict) -> tuple[Path, Path]:
    """results.json; samples.json: itl_samples["pair/mode"][config][load] (ms per token) and
    requests["pair/mode"][config][load] = rows of [pid, sent s, TTFT s, e2e s, tokens, chunks]; results.md."""
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "results.json", out / "results.md"
    js.write_text(json.dumps(_finite(data), indent=1, allow_nan=False) + "\n")
    (out / "samples.json").write_text(json.dumps(_finite(samples), separators=(",", ":")) + "\n")
    md.write_text(markdown(data))
    return js, md
