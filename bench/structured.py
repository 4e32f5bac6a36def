"""python -m bench.structured [--models models/demo] [--requests 20] [--out bench/results]: the structured-output
workload. `make bench` runs it too (python -m bench --workloads structured: once per pair, shared mode,
`measure()` here, its figures and section in that run's results.md); stand-alone, it prints `markdown()`
and writes OUT/structured.json.

It starts the stack (target + draft + router, router.stack.Stack), then sends the same prompts twice,
4 at a time: free text, then each constrained to a JSON schema (chat-less completions; half greedy, half
sampled with seeds). Every constrained answer must parse and validate against its schema, or the run
fails. From /metrics deltas of each pass: acceptance, tokens per verification, grammar mask bytes per
constrained verification, router and target time per step, throughput.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema

from bench import prom
from router.stack import Stack, stack_ports

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "line": {"type": "integer"},
                                      "kind": {"enum": ["function", "class", "constant"]}},
     "required": ["name", "line", "kind"], "additionalProperties": False},
    {"type": "object", "properties": {"module": {"type": "string", "maxLength": 24},
                                      "imports": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                                  "maxItems": 4},
                                      "public": {"type": "boolean"}},
     "required": ["module", "imports", "public"], "additionalProperties": False},
    {"type": "object", "properties": {"args": {"type": "array", "items": {"enum": ["self", "path", "data", "n"]},
                                               "maxItems": 3},
                                      "returns": {"enum": ["None", "str", "int", "list", "dict"]}},
     "required": ["args", "returns"], "additionalProperties": False},
]
REQUESTS, QUICK_REQUESTS = 20, 8  # per pass; half greedy, half sampled
PROMPTS = ["def read_config(path):\n    ", "import os\nimport sys\n\n", "class Cache:\n    def __init__(self",
           "# parse the arguments\n", "def walk(top, topdown=True):\n    ", "RESULT = {\n    \"name\": ",
           "    for key, value in items:\n        ", "from collections import OrderedDict\n\n\nclass "]


def requests_for(n: int) -> list[dict]:
    out = []
    for i in range(n):
        sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": 1000 + i}
        out.append({"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 160, **sampling,
                    "schema": SCHEMAS[i % len(SCHEMAS)]})
    return out


def drive(url: str, model: str, reqs: list[dict], constrained: bool) -> tuple[list[dict], prom.Samples, float]:
    def one(r: dict) -> dict:
        body = {"model": model, "prompt": r["prompt"], "max_tokens": r["max_tokens"], "temperature": r["temperature"]}
        if "seed" in r:
            body["seed"] = r["seed"]
        if constrained:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": r["schema"]}}
        t0 = time.perf_counter()
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        resp.raise_for_status()
        choice = resp.json()["choices"][0]
        return {"text": choice["text"], "finish": choice["finish_reason"], "latency_s": time.perf_counter() - t0,
                "tokens": resp.json()["usage"]["completion_tokens"]}

    before, t0 = prom.scrape(url), time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(one, reqs))
    wall = time.perf_counter() - t0
    return answers, prom.delta(before, prom.scrape(url)), wall


def summarize(answers: list[dict], reqs: list[dict], d: prom.Samples, wall: float, constrained: bool) -> dict:
    valid = 0
    by_sampling = {"greedy": [0, 0], "sampled": [0, 0]}  # [valid, requests]
    for a, r in zip(answers, reqs, strict=True):
        tally = by_sampling["greedy" if r["temperature"] == 0.0 else "sampled"]
        tally[1] += 1
        try:
            jsonschema.validate(json.loads(a["text"]), r["schema"])
            valid += 1
            tally[0] += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            a["invalid"] = True
    engine = prom.derive(d, wall)
    verifications = prom._get(d, "tandem:spec_decode_emitted_tokens_per_step_count")
    return {"requests": len(answers), "valid_json": valid, "by_sampling": by_sampling,
            "finish_stop": sum(a["finish"] == "stop" for a in answers),
            "output_tokens": sum(a["tokens"] for a in answers), "wall_s": wall,
            "tokens_per_s": sum(a["tokens"] for a in answers) / wall,
            "mean_latency_s": sum(a["latency_s"] for a in answers) / len(answers),
            "mask_bytes_per_verification": (prom._get(d, "tandem:grammar_mask_bytes_total") / verifications
                                            if constrained and verifications else 0.0), **engine}


def markdown(res: dict) -> list[str]:
    rows = ["| pass | valid JSON | acceptance | emitted/step | mask B/verify | router ms/step | target ms/step "
            "| tokens/s |", "|---|---|---|---|---|---|---|---|"]
    for name in ("free", "json_schema"):
        r = res[name]
        rows.append(f"| {name} | {r['valid_json']}/{r['requests']} | {r['acceptance']:.2f} | "
                    f"{r['emitted_per_step']:.2f} | {r['mask_bytes_per_verification']:.0f} | "
                    f"{r['router_ms_per_step']:.1f} | {r['target_ms_per_step']:.1f} | {r['tokens_per_s']:.1f} |")
    return rows


def measure(models: Path, n: int, log_dir: Path) -> dict:
    """Start the stack (shared: no pinning), run both passes of n requests, stop it. res[pass] = summary
    with the answers ("free", then "json_schema")."""
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(models / "target", models / "draft", served_model_name=models.resolve().name,
                  **stack_ports(),
                  router_args=["--log-level", "WARNING"], log_dir=log_dir)
    stack.start(timeout=300.0)
    try:
        reqs = requests_for(n)
        drive(stack.url, stack.model_name, reqs[:2], True)  # warm-up: compile paths, tokenizer views
        res = {}
        for name, constrained in (("free", False), ("json_schema", True)):
            answers, d, wall = drive(stack.url, stack.model_name, reqs, constrained)
            res[name] = summarize(answers, reqs, d, wall, constrained)
            res[name]["answers"] = answers
    finally:
        stack.stop()
    return res


def run(models: Path, n: int, out: Path) -> dict:
    res = measure(models, n, out / "logs-structured")
    (out / "structured.json").write_text(json.dumps(res, indent=1))
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=Path("models/demo"))
    parser.add_argument("--requests", type=int, default=None,
                        help=f"requests per pass (default {REQUESTS}; with --quick {QUICK_REQUESTS})")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_REQUESTS} requests per pass")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    res = run(args.models, args.requests or (QUICK_REQUESTS if args.quick else REQUESTS), args.out)
    print("\n".join(markdown(res)))
    ok = res["json_schema"]["valid_json"] == res["json_schema"]["requests"] and res["json_schema"]["acceptance"] > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
