"""python -m bench.predicted [--models models/demo] [--requests 8]: the predicted-outputs workload
(OpenAI's `prediction`, proposed by prompt lookup: router/lookup.py). `make bench` runs it too
(--workloads predicted: once per pair, shared mode, `measure()` here, its figures and section in that
run's results.md); stand-alone, it prints `markdown()` and writes OUT/predicted.json.

It starts the stack with its defaults, then sends the same greedy code prompts three times, 4 at a
time: free; with the free answer as the prediction (an edit that changes nothing: the best case);
with that answer changed in its middle (a line replaced: the output parts from the prediction there
and meets it again after). The output is the model's whatever the prediction says, so every answer
must equal the free pass's (or differ first at a float64 near-tie, bench/ties.py); the passes differ
in steps and time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench import prom
from bench.structured import PROMPTS
from router.stack import Stack, stack_ports

REQUESTS, QUICK_REQUESTS = 16, 8  # per pass
MAX_TOKENS = 160
PASSES = ("free", "exact", "edited")


def edited(text: str) -> str:
    """The answer with its middle line replaced (its middle characters, where it has too few lines)."""
    lines = text.split("\n")
    if len(lines) >= 3:
        lines[len(lines) // 2] = "    value = compute(value)  # changed"
        return "\n".join(lines)
    half = len(text) // 2
    return text[:half] + " changed here " + text[half + 8:]


def drive(url: str, model: str, prompts: list[str], predictions: list[str | None]
          ) -> tuple[list[dict], prom.Samples, float]:
    def one(i: int) -> dict:
        body = {"model": model, "prompt": prompts[i], "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, "tandem_metrics": True}
        if predictions[i] is not None:
            body["prediction"] = {"type": "content", "content": predictions[i]}
        t0 = time.perf_counter()
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        resp.raise_for_status()
        data = resp.json()
        return {"text": data["choices"][0]["text"], "token_ids": data["choices"][0]["token_ids"],
                "latency_s": time.perf_counter() - t0, "tokens": data["usage"]["completion_tokens"],
                "steps": data["usage"]["tandem_metrics"]["num_decode_steps"]}

    before, t0 = prom.scrape(url), time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(one, range(len(prompts))))
    wall = time.perf_counter() - t0
    return answers, prom.delta(before, prom.scrape(url)), wall


def summarize(answers: list[dict], d: prom.Samples, wall: float) -> dict:
    tokens = sum(a["tokens"] for a in answers)
    return {"requests": len(answers), "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "output_tokens_per_step": tokens / max(1, sum(a["steps"] for a in answers)),
            "mean_latency_s": sum(a["latency_s"] for a in answers) / len(answers),
            "lookup_share": prom._ratio(prom._get(d, "tandem:lookup_proposals_total"),
                                        prom._get(d, "tandem:spec_decode_num_drafts_total")),
            **prom.derive(d, wall)}


def judged(models: Path, prompt_ids: list[list[int]], free: list[dict], other: list[dict]) -> list[dict]:
    """Where an answer differs from the free pass's: the request and the verdict at its first difference."""
    from bench.ties import Divergence, judge

    differ = [i for i, (a, b) in enumerate(zip(free, other, strict=True)) if a["token_ids"] != b["token_ids"]]
    divergences = [Divergence.between(prompt_ids[i], free[i]["token_ids"], other[i]["token_ids"]) for i in differ]
    return [{"request": i, "verdict": v.as_dict()} for i, v in zip(differ, judge(models / "target", divergences),
                                                                    strict=True)]


def measure(models: Path, n: int, log_dir: Path, router_args: list[str] | None = None) -> dict:
    """Start the stack (shared: no pinning; router_args: more router flags), run the three passes of n
    requests, stop it. res[pass] = summary with the answers; res["differences"][pass] = judged
    differences from the free pass."""
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(models / "target", models / "draft", served_model_name=models.resolve().name,
                  **stack_ports(), router_args=["--log-level", "WARNING", *(router_args or [])], log_dir=log_dir)
    stack.start(timeout=300.0)
    try:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
        drive(stack.url, stack.model_name, prompts[:2], [None, None])  # warm-up
        ids = [httpx.post(f"{stack.url}/tokenize", json={"model": stack.model_name, "prompt": p}).json()["tokens"]
               for p in prompts]
        res: dict = {"differences": {}}
        free: list[dict] = []
        for name in PASSES:
            predictions = [None if name == "free" else a["text"] if name == "exact" else edited(a["text"])
                           for a in (free or [{}] * n)]
            answers, d, wall = drive(stack.url, stack.model_name, prompts, predictions)
            res[name] = {**summarize(answers, d, wall), "answers": answers}
            if name == "free":
                free = answers
            else:
                res["differences"][name] = judged(models, ids, free, answers)
    finally:
        stack.stop()
    return res


def markdown(res: dict) -> list[str]:
    rows = ["| pass | answers as free | tokens / step | lookup share of verifications | acceptance | tokens/s |",
            "|---|---|---|---|---|---|"]
    for name in PASSES:
        r, diffs = res[name], res.get("differences", {}).get(name, [])
        same = "—" if name == "free" else f"{r['requests'] - len(diffs)}/{r['requests']}" + (
            f" ({sum(d['verdict']['tie'] for d in diffs)} near-ties)" if diffs else "")
        rows.append(f"| {name} | {same} | {r['output_tokens_per_step']:.2f} | {r['lookup_share']:.2f} | "
                    f"{r['acceptance']:.2f} | {r['tokens_per_s']:.1f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=Path("models/demo"))
    parser.add_argument("--requests", type=int, default=None, help=f"requests per pass (default {REQUESTS})")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_REQUESTS} requests per pass")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--router-arg", action="append", default=[],
                        help="a router flag for the stack (repeat), e.g. --router-arg=--num-speculative-tokens=8")
    args = parser.parse_args(argv)
    res = measure(args.models, args.requests or (QUICK_REQUESTS if args.quick else REQUESTS),
                  args.out / "logs-predicted", args.router_arg)
    (args.out / "predicted.json").write_text(json.dumps(res, indent=1))
    print("\n".join(markdown(res)))
    mismatches = [d for diffs in res["differences"].values() for d in diffs if not d["verdict"]["tie"]]
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
