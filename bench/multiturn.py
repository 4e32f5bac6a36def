"""python -m bench.multiturn [--models models/demo] [--quick]: multi-turn chat, with and without
prefix caching, side by side (make bench-multiturn).

Conversations share one system prompt; each turn sends the whole conversation so far (system prompt,
every earlier question and answer, the new question) through /v1/chat/completions with SSE, greedy,
ignore_eos, the next turn leaving once the answer is complete (closed loop, `--concurrency`
conversations at a time). The same conversations run twice, on a fresh stack each time (three
processes on loopback, router.stack.Stack): with the defaults, and with the router's
--no-prefix-caching. Answers must be identical (greedy); the run fails otherwise.

Reported per mode: TTFT p50 over all turns and over later turns (2+), output tokens/s over the run,
acceptance (accepted / drafted tokens), and per service the prefix-cache hit rate (hits / queries in
tokens, from the router's tandem:prefix_cache_* counters). The criteria of issue #17: TTFT p50 with
caching <= 0.3x without, tokens/s not lower, acceptance unchanged (within 0.05).

Conversation sizes follow the model's context (bench/conversations.py), up to 2048 tokens (SmolLM2's
8192 would make the workload last hours on CPU): the last turn fills about 80% of it (answers
re-tokenized by the chat template can come back longer than they were generated). The step budget
defaults to 1/8 of the context (64 tokens on the 512-token tiny pair, 256 at 2048), so a full history
takes several steps to prefill, as long prompts do on a real pair.

`make bench` runs it too (python -m bench --workloads multiturn: once per pair, shared mode, `measure()`
here, its figures and section in that run's results.md); stand-alone, it prints `report()` and writes
OUT/results.md and OUT/results.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from tokenizers import Tokenizer

from bench.conversations import Shape, Turn, drive, script, shape_for
from bench.report import answers_text, describe_difference
from bench.stats import first_diff
from router.stack import Stack, stack_ports

METRICS = ("tandem:spec_decode_num_draft_tokens_total", "tandem:spec_decode_num_accepted_tokens_total",
           "tandem:prefix_cache_queries_total", "tandem:prefix_cache_hits_total",
           "tandem:prefix_cache_attach_misses_total")


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(METRICS):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@dataclass
class ModeResult:
    mode: str
    ttft_p50: float
    ttft_p50_later: float
    tokens_per_s: float
    acceptance: float
    hit_rate: dict[str, float]
    attach_misses: float
    turns: list[Turn] = field(repr=False)


def run_mode(mode: str, models: Path, system: str, conversations: list[list[str]], shape: Shape,
             router_args: list[str], log_dir: Path) -> ModeResult:
    ports = stack_ports()
    stack = Stack(models / "target", models / "draft", served_model_name=models.resolve().name,
                  router_args=["--max-num-batched-tokens", str(shape.budget), *router_args], log_dir=log_dir, **ports)
    log_dir.mkdir(parents=True, exist_ok=True)
    stack.start()
    try:
        model = stack.model_name
        warm = {"model": model, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 4,
                "temperature": 0}
        httpx.post(f"{stack.url}/v1/chat/completions", json=warm, timeout=300).raise_for_status()
        before = scrape(stack.url)
        t0 = time.perf_counter()
        turns = asyncio.run(drive(stack.url, model, system, conversations, shape))
        wall = time.perf_counter() - t0
        d = {k: v - before.get(k, 0.0) for k, v in scrape(stack.url).items()}
    finally:
        stack.stop()

    def get(name: str, service: str = "") -> float:
        return d.get(f'{name}{{service="{service}"}}' if service else name, 0.0)

    drafted = get("tandem:spec_decode_num_draft_tokens_total")
    # no queries (a draft that rested through the workload on shared cores, router/regime.py): nothing measured
    rates = {s: get("tandem:prefix_cache_hits_total", s) / queries
             if (queries := get("tandem:prefix_cache_queries_total", s)) else float("nan") for s in ("target", "draft")}
    return ModeResult(
        mode, statistics.median(t.ttft for t in turns), statistics.median(t.ttft for t in turns if t.turn > 1),
        len(turns) * shape.reply_tokens / wall,
        get("tandem:spec_decode_num_accepted_tokens_total") / drafted if drafted else float("nan"), rates,
        sum(get("tandem:prefix_cache_attach_misses_total", s) for s in ("target", "draft")), turns)


def first_differences(on: list[Turn], off: list[Turn], context: int = 40) -> list[dict]:
    """Per conversation, the first turn whose answers differ between the two modes, from `context`
    characters before the first differing one: what a diagnosis needs (later turns of that
    conversation differ anyway, their history having diverged)."""
    out, seen = [], set()
    for a, b in zip(on, off, strict=True):
        assert (a.conversation, a.turn) == (b.conversation, b.turn)
        if a.answer == b.answer or a.conversation in seen:
            continue
        seen.add(a.conversation)
        at = first_diff(a.answer, b.answer)
        lo = max(0, at - context)
        out.append({"conversation": a.conversation, "turn": a.turn, "at_char": at,
                    "with": a.answer[lo:at + context], "without": b.answer[lo:at + context]})
    return out


def judged_differences(models: Path, shape: Shape, seed: int, on: list[Turn], off: list[Turn]) -> list[dict]:
    """first_differences, each with its verdict (bench/ties.py): the turn's prompt rendered as the router
    renders it (its chat template, the history both modes shared until then), both answers re-encoded."""
    from bench import ties
    from router.chat import ChatFormatter

    diffs = first_differences(on, off)
    if not diffs:
        return diffs
    tok = Tokenizer.from_file(str(models / "target" / "tokenizer.json"))
    chat = ChatFormatter.from_dir(models / "target")
    system, conversations = script(tok, shape, seed)
    answers = {(t.conversation, t.turn): t.answer for t in on}
    others = {(t.conversation, t.turn): t.answer for t in off}
    divergences = []
    for d in diffs:
        c, t = d["conversation"], d["turn"]
        messages = [("system", system)]
        for n, question in enumerate(conversations[c][:t], start=1):
            messages.append(("user", question))
            if n < t:
                messages.append(("assistant", answers[(c, n)]))
        prompt = tok.encode(chat.render(messages), add_special_tokens=chat.template is None).ids
        a, b = (tok.encode(x[(c, t)], add_special_tokens=False).ids for x in (answers, others))
        divergences.append(ties.Divergence.between(prompt, a, b))
    for d, v in zip(diffs, ties.judge(models / "target", divergences), strict=True):
        d["verdict"] = v.as_dict()
    return diffs


def same_or_ties(on: list[Turn], off: list[Turn], diffs: list[dict]) -> str:
    """'identical', 'near-ties' (every conversation first differs at a float64 near-tie) or 'DIFFERENT'."""
    if [t.answer for t in on] == [t.answer for t in off]:
        return "identical"
    return "near-ties" if all(d.get("verdict", {}).get("tie") for d in diffs) else "DIFFERENT"


def _rate(x: float) -> str:
    """A rate for the printed table: n/a where nothing was counted (NaN: no drafts verified, no queries)."""
    return "n/a" if math.isnan(x) else f"{x:.2f}"


def report(results: list[ModeResult], shape: Shape, diffs: list[dict]) -> tuple[str, bool]:
    on, off = results
    rows = [f"multi-turn chat: {shape.conversations} conversations x {shape.turns} turns, {shape.concurrency} at a "
            f"time; system prompt {shape.system_tokens} tokens, questions {shape.user_tokens}, answers "
            f"{shape.reply_tokens}; step budget {shape.budget}",
            "", f"{'mode':<20}{'TTFT p50':>10}{'turns 2+':>10}{'tok/s':>8}{'accept':>8}{'hit target':>12}"
            f"{'hit draft':>11}{'misses':>8}"]
    for r in results:
        rows.append(f"{r.mode:<20}{r.ttft_p50 * 1e3:>8.0f}ms{r.ttft_p50_later * 1e3:>8.0f}ms{r.tokens_per_s:>8.1f}"
                    f"{_rate(r.acceptance):>8}{_rate(r.hit_rate['target']):>12}{_rate(r.hit_rate['draft']):>11}"
                    f"{r.attach_misses:>8.0f}")
    same = same_or_ties(on.turns, off.turns, diffs)
    checks = {
        f"answers {answers_text(same)}": same != "DIFFERENT",
        f"TTFT p50 ratio {on.ttft_p50 / off.ttft_p50:.2f} <= 0.3": on.ttft_p50 <= 0.3 * off.ttft_p50,
        f"tokens/s ratio {on.tokens_per_s / off.tokens_per_s:.2f} >= 1": on.tokens_per_s >= off.tokens_per_s,
    }
    if not (math.isnan(on.acceptance) or math.isnan(off.acceptance)):
        checks[f"acceptance {on.acceptance:.2f} vs {off.acceptance:.2f} (within 0.05)"] = \
            abs(on.acceptance - off.acceptance) <= 0.05
    rows += ["", *(f"{'PASS' if ok else 'FAIL'}  {name}" for name, ok in checks.items())]
    rows += [f"      {describe_difference(d)}" for d in diffs]
    if len(checks) == 3:
        rows.append("n/a   acceptance: a mode verified no drafts (dynamic k chose k = 0 for this pair; "
                    "--router-arg=--no-dynamic-k makes it speculate)")
    return "\n".join(rows), same != "DIFFERENT"


def measure(models: Path, quick: bool, seed: int, log_dir: Path,
            router_args: list[str] | tuple[str, ...] = ()) -> tuple[Shape, list[ModeResult]]:
    """Both modes on fresh stacks (shared: no pinning), with prefix caching first. Raises ValueError
    when the pair's context is too short for the conversations."""
    config = json.loads((models / "target" / "config.json").read_text())
    shape = shape_for(int(config["max_position_embeddings"]), quick)
    system, conversations = script(Tokenizer.from_file(str(models / "target" / "tokenizer.json")), shape, seed)
    return shape, [run_mode(mode, models, system, conversations, shape, [*extra, *router_args],
                            log_dir / mode.replace(" ", "-"))
                   for mode, extra in (("prefix caching", []), ("no prefix caching", ["--no-prefix-caching"]))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.multiturn", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=Path, default=Path("models/demo"), help="pair directory (target/ and draft/)")
    p.add_argument("--quick", action="store_true", help="4 conversations x 4 turns (default 8 x 5)")
    p.add_argument("--out", type=Path, default=Path("bench/results/multiturn"), help="results.json, results.md, logs/")
    p.add_argument("--router-arg", action="append", default=[], help="extra router flag for both modes (repeat)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not (args.models / "target" / "config.json").is_file():
        print(f"no model pair in {args.models}: `make models` (demo pair) or --models models/tiny", file=sys.stderr)
        return 2
    shape, results = measure(args.models, args.quick, args.seed, args.out / "logs", args.router_arg)
    diffs = judged_differences(args.models, shape, args.seed, results[0].turns, results[1].turns)
    text, identical = report(results, shape, diffs)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps({"shape": asdict(shape), "models": str(args.models),
                                                       "modes": [asdict(r) for r in results],
                                                       "first_differences": diffs}, indent=1))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
