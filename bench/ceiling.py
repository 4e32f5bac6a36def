"""What speculation could make of one stream at best, on this machine and pair: the target's own
greedy continuations of the bench's prompts, replayed through each way of proposing tokens (the
draft model, prompt lookup, both), with the target's measured step times. No router, no RPC, no
timing noise from a load: an upper bound that says whether a figure the bench misses is reachable.

    per output position t:   draft chain   d(t) = how many of the draft's greedy proposals after
                                             prompt + output[:t] equal output[t:t + k]
                             lookup chain  l(t), and how many tokens lookup offered there
    one step at t:           a policy picks (source, k); the step emits 1 + min(chain, k) tokens
                             and costs step_ms[k] (+ the draft's rounds, when it runs first)

"free" prices the draft at nothing, as a pipeline that always had the right proposal ready would
(hit rate 1); "sequential" adds its k forwards to the step. tokens/s counts each prompt's prefill
too, as the bench's single-stream figure does (python -m bench, c = 1), so it is capped by Amdahl:
speculation speeds decoding only.

    python -m bench.ceiling --models models/smollm2 [--goal 1.6] [--cpu 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from router.config import RouterConfig
from router.draft_work import common_prefix
from router.lookup import PromptLookup
from router.spec_policy import expected_tokens

if TYPE_CHECKING:
    from engine import ModelRunner

Chain = tuple[int, int, int]  # (draft's matched tokens, lookup's matched tokens, lookup's offered tokens)
Policy = Callable[[Chain], tuple[str, int]]  # -> ("draft" | "lookup", k)


@dataclass(frozen=True)
class Costs:
    step_ms: tuple[float, ...]  # one decode step verifying k = 0, 1, ... drafts
    prefill_ms: float  # all prompts' prefill, in the router's chunks
    draft_round_ms: float  # one draft forward of one sequence (a sequential call costs k of them)


def lookup_chains(prompt: Sequence[int], output: Sequence[int], k_max: int) -> list[tuple[int, int]]:
    """(matched, offered) for prompt lookup at every output position, as the router looks it up."""
    lookup, history, out = PromptLookup(), list(prompt), []
    for t in range(len(output)):
        offer = lookup.propose(history, k_max)
        out.append((common_prefix(offer, list(output[t:t + len(offer)]), len(offer)), len(offer)))
        history.append(output[t])
    return out


def replay(chains: Sequence[Sequence[Chain]], costs: Costs, policy: Policy,
           sequential: bool = False) -> tuple[int, float]:
    """(tokens, decode ms) for every stream decoded with `policy`: the target-only baseline is the
    policy that never speculates."""
    tokens, ms = 0, 0.0
    for stream in chains:
        t = 0
        while t < len(stream):
            source, k = policy(stream[t])
            matched = min(stream[t][0] if source == "draft" else stream[t][1], k)
            emitted = min(1 + matched, len(stream) - t)
            tokens, t = tokens + emitted, t + emitted
            ms += costs.step_ms[k] + (k * costs.draft_round_ms if sequential and source == "draft" else 0.0)
    return tokens, ms


def pooled_rates(chains: Sequence[Sequence[Chain]], k_max: int) -> tuple[float, float]:
    """Per-token acceptance of the draft's and lookup's proposals (accepted over positions tried up to the
    first rejection, as router.spec_policy's trackers count), verifying all they offer up to k_max."""
    counts = [[0, 0], [0, 0]]
    for c in (c for s in chains for c in s):
        for i, (matched, cap) in enumerate(((c[0], k_max), (c[1], min(c[2], k_max)))):
            if cap:
                accepted = min(matched, cap)
                counts[i][0] += accepted
                counts[i][1] += accepted + (accepted < cap)
    draft, lookup = (a / max(1, t) for a, t in counts)
    return draft, lookup


def policies(chains: Sequence[Sequence[Chain]], k_max: int) -> dict[str, Policy]:
    """The ways of proposing compared: choices a router can make (the last two kinds mixing the sources:
    lookup first, or the router's rule: the source with more expected tokens at the rates the two are
    accepted at), and the oracle no router can be (the source that matches more, at exactly its length)."""
    a_draft, a_lookup = pooled_rates(chains, k_max)
    out: dict[str, Policy] = {"target only": lambda c: ("draft", 0),
                              "prompt lookup (k = its offer)": lambda c: ("lookup", min(c[2], k_max))}
    for k in range(1, k_max + 1):
        out[f"draft, k = {k}"] = lambda c, k=k: ("draft", k)
        out[f"{LOOKUP_FIRST}{k}"] = lambda c, k=k: ("lookup", min(c[2], k_max)) if c[2] else ("draft", k)
        out[f"{MORE_EXPECTED}{k}"] = lambda c, k=k: ("lookup", min(c[2], k_max)) \
            if expected_tokens(a_lookup, min(c[2], k_max)) > expected_tokens(a_draft, k) else ("draft", k)
    out["oracle: the better source, k = its match"] = lambda c: ("draft", c[0]) if c[0] >= c[1] else ("lookup", c[1])
    return out


LOOKUP_FIRST = "lookup where it offers, else draft k = "
MORE_EXPECTED = "the source with more expected tokens, draft k = "


def speedups(chains: Sequence[Sequence[Chain]], costs: Costs, policy: Policy, sequential: bool) -> tuple[float, float]:
    """(decode speed-up, tokens/s speed-up with prefill) over the target alone."""
    base_tokens, base_ms = replay(chains, costs, lambda c: ("draft", 0))
    tokens, ms = replay(chains, costs, policy, sequential)
    assert tokens == base_tokens, "every policy emits the same outputs"
    return base_ms / ms, (costs.prefill_ms + base_ms) / (costs.prefill_ms + ms)


def with_synthetic_draft(chains: Sequence[Sequence[Chain]], acceptance: float, k_max: int,
                         seed: int = 0) -> list[list[Chain]]:
    """The same streams with a draft whose every proposal is accepted with probability `acceptance`
    (independently; lookup's chains kept): what a better draft would make of them."""
    rng = random.Random(seed)
    out = []
    for stream in chains:
        synthetic = []
        for t, (_, looked, offered) in enumerate(stream):
            matched = 0
            while matched < min(k_max, len(stream) - t) and rng.random() < acceptance:
                matched += 1
            synthetic.append((matched, looked, offered))
        out.append(synthetic)
    return out


def best_combined(chains: Sequence[Sequence[Chain]], costs: Costs, k_max: int) -> tuple[str, float]:
    """(policy, tokens/s speed-up) of the best way of mixing lookup and the draft, the draft free."""
    return max(((name, speedups(chains, costs, p, False)[1]) for name, p in policies(chains, k_max).items()
                if name.startswith((LOOKUP_FIRST, MORE_EXPECTED))), key=lambda kv: kv[1])


def acceptance_needed(chains: Sequence[Sequence[Chain]], costs: Costs, k_max: int, goal: float) -> float | None:
    """The least per-token draft acceptance (in steps of 0.05) at which the best combination reaches
    `goal` x the target's tokens/s, free; None if none below 1 does."""
    for step in range(1, 20):
        a = step / 20
        if best_combined(with_synthetic_draft(chains, a, k_max), costs, k_max)[1] >= goal:
            return a
    return None


def report(chains: Sequence[Sequence[Chain]], costs: Costs, k_max: int, goal: float,
           ranks: Sequence[Sequence[int]] = ()) -> dict:
    flat = [c for s in chains for c in s]
    offered = [c for c in flat if c[2]]
    rows = []
    for name, policy in policies(chains, k_max).items():
        decode, total = speedups(chains, costs, policy, False)
        sequential = speedups(chains, costs, policy, True)[1] if "draft" in name else total
        rows.append({"policy": name, "decode": round(decode, 3), "tokens_s": round(total, 3),
                     "tokens_s_sequential": round(sequential, 3)})
    name, best = best_combined(chains, costs, k_max)
    return {"positions": len(flat), "draft_first_token": round(sum(c[0] > 0 for c in flat) / len(flat), 3),
            "lookup_offers": round(len(offered) / len(flat), 3),
            "lookup_first_token_when_offered": round(sum(c[1] > 0 for c in offered) / max(1, len(offered)), 3),
            "step_ms": [round(m, 1) for m in costs.step_ms], "prefill_ms": round(costs.prefill_ms),
            "draft_round_ms": round(costs.draft_round_ms, 2), "prefill_share": round(
                costs.prefill_ms / (costs.prefill_ms + replay(chains, costs, lambda c: ("draft", 0))[1]), 3),
            "policies": rows, "best_combined": {"policy": name, "tokens_s": round(best, 3)},
            "goal": goal, "draft_acceptance_needed": acceptance_needed(chains, costs, k_max, goal),
            "hit_bound": {g: round(hit_bound(ranks, g), 3) for g in (1, 2, 4, RANK_CAP)} if ranks else {}}


REPEATS = 20  # rounds over every k, a few steps each: a step's time drifts by 20% and more within minutes here


@dataclass(frozen=True)
class Measured:
    prompts: list[list[int]]  # the bench's prompt pool for the pair
    outputs: list[list[int]]  # the target's greedy continuations, as long as the bench asks (end tokens ignored)
    chains: list[list[Chain]]  # per output position
    ranks: list[list[int]]  # per output position: the target's token's rank among the draft's guesses there
    costs: Costs


RANK_CAP = 8  # ranks past this are reported as it (a speculation cache holds a few guesses a depth)


def draft_ranks(draft: ModelRunner, prompt: list[int], output: list[int]) -> list[int]:
    """At each output position, how many tokens the draft scores above the target's (0: its greedy guess
    is the target's token), capped at RANK_CAP; one teacher-forced pass over prompt + output."""
    from engine import SeqInput

    logits = draft.forward([SeqInput(0, 0, prompt + output[:-1], num_logits=len(output))])[0]
    draft.release([0])
    want = torch.tensor(output)
    above = (logits > logits.gather(1, want[:, None])).sum(dim=1)
    return above.clamp(max=RANK_CAP).tolist()


def hit_bound(ranks: Sequence[Sequence[int]], guesses: int) -> float:
    """The share of positions where the target's token is among the draft's `guesses` best: what a
    speculation cache holding that many guesses for the token after the accepted drafts (the bonus or
    the target's correction) can hit at most, whatever depth it prepared them at."""
    flat = [r for s in ranks for r in s]
    return sum(r < guesses for r in flat) / max(1, len(flat))


@torch.inference_mode()
def measure(models: Path, k_max: int, steps: int, budget: int = RouterConfig.max_num_batched_tokens) -> Measured:
    """The bench's prompt pool for the pair continued by the target, the chains and ranks at every output
    position, and the costs: prefill in the router's chunks of `budget` tokens (the bench's --budget, which
    also scales the pool's prompt lengths), a draft round, and B = 1 steps at each k (`steps` steps in each
    of REPEATS rounds, their median)."""
    from bench.pairs import Pair
    from bench.plans import profile_for
    from bench.step_profile import profile
    from bench.workloads import build_pool
    from engine import SeqInput
    from model_zoo.evaluate import match_lengths
    from model_zoo.generate import generate, make_runner

    pair = Pair(models)
    pool, _ = build_pool(pair, profile_for(pair.name, pair.params("target")).full, budget, 0)
    prompts, longest = [p.ids for p in pool], max(p.max_tokens for p in pool)
    room = 8 * (max(len(p) for p in prompts) + longest + k_max + 1)
    target = make_runner(str(pair.target), room)
    outputs: list[list[int]] = [[] for _ in pool]
    by_length: dict[int, list[int]] = {}  # a prompt has room for its own output length only (workloads.Slot)
    for i, p in enumerate(pool):
        by_length.setdefault(p.max_tokens, []).append(i)
    with tqdm(total=len(pool), desc="target's continuations", unit="seq") as bar:
        for n, same in sorted(by_length.items()):
            made = generate(target, [prompts[i] for i in same], n, batch=8, progress=False)
            for i, g in zip(same, made, strict=True):
                outputs[i] = g.output
            bar.update(len(same))
    prefill_ms = 0.0
    for prompt in prompts:
        for start in range(0, len(prompt), budget):
            chunk = prompt[start:start + budget]
            t0 = time.perf_counter()
            target.forward([SeqInput(0, start, chunk, num_logits=int(start + budget >= len(prompt)))])
            prefill_ms += (time.perf_counter() - t0) * 1000
        target.release([0])
    del target
    draft = make_runner(str(pair.draft), room)
    drafted = match_lengths(draft, prompts, outputs, k_max, batch=8)
    ranks = [draft_ranks(draft, p, o) for p, o in zip(prompts, outputs, strict=True)]
    draft.forward([SeqInput(0, 0, prompts[0])])
    rounds = []
    for i in range(20):
        t0 = time.perf_counter()
        draft.forward([SeqInput(0, len(prompts[0]) + i, [outputs[0][i % len(outputs[0])]])])
        rounds.append((time.perf_counter() - t0) * 1000)
    del draft
    chains = [[(d, looked, offered) for d, (looked, offered) in zip(ds, lookup_chains(p, o, k_max), strict=True)]
              for ds, p, o in zip(drafted, prompts, outputs, strict=True)]
    timed = profile(str(pair.target), "cpu", True, [1], list(range(k_max + 1)), steps, repeats=REPEATS)
    step_ms = tuple(statistics.median(t.step_ms for t in timed if t.k == k) for k in range(k_max + 1))
    return Measured(prompts, outputs, chains, ranks, Costs(step_ms, prefill_ms, statistics.median(rounds)))


def markdown(name: str, r: dict) -> str:
    lines = [f"## {name}: {r['positions']} output positions",
             "", f"Draft's first token right at {r['draft_first_token']:.0%} of positions; prompt lookup offers "
             f"at {r['lookup_offers']:.0%}, its first token right at {r['lookup_first_token_when_offered']:.0%} of "
             f"those. Target step ms at k = 0..{len(r['step_ms']) - 1}: {' / '.join(map(str, r['step_ms']))}; a draft "
             f"round {r['draft_round_ms']} ms; prefill {r['prefill_share']:.0%} of the target-only time.", "",
             "| proposals | decode speed-up | tokens/s speed-up (with prefill), draft free | ... draft sequential |",
             "|---|---|---|---|"]
    lines += [f"| {p['policy']} | {p['decode']:.2f}x | {p['tokens_s']:.2f}x | {p['tokens_s_sequential']:.2f}x |"
              for p in r["policies"]]
    need, lookup = r["draft_acceptance_needed"], r["policies"][1]
    assert lookup["policy"].startswith("prompt lookup")
    lines += ["", f"Best mix of the two: {r['best_combined']['policy']}, "
              f"{r['best_combined']['tokens_s']:.2f}x tokens/s with the draft free. For {r['goal']}x, "
              + ("prompt lookup alone does." if lookup["tokens_s"] >= r["goal"]
                 else f"a draft accepted at {need:.2f} per token (independently) would do." if need is not None
                 else "a draft of any acceptance below 1 would not do: prefill alone caps it.")]
    if r["hit_bound"]:
        lines += ["", "A speculation cache holding g of the draft's guesses for the token after the accepted "
                  "drafts hits at most: " + ", ".join(f"g = {g}: {h:.0%}" for g, h in r["hit_bound"].items()) + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ceiling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=Path, default=Path("models/smollm2"), help="a pair directory (target/, draft/)")
    p.add_argument("--k-max", type=int, default=4, help="the most drafts a step verifies (the bench's --k-max)")
    p.add_argument("--budget", type=int, default=RouterConfig.max_num_batched_tokens,
                   help="the router's tokens per step (the bench's --budget): prompt chunks and the pool's lengths")
    p.add_argument("--goal", type=float, default=1.6, help="the tokens/s speed-up to find the draft acceptance for")
    p.add_argument("--threads", type=int, default=1, help="torch threads (two-device mode: 1)")
    p.add_argument("--cpu", type=int, default=None, help="pin to this core, as two-device mode pins the target")
    p.add_argument("--steps", type=int, default=2, help=f"timed steps per k in each of {REPEATS} rounds")
    p.add_argument("--out", type=Path, default=None, help="also write the figures here as JSON")
    args = p.parse_args(argv)
    if not (args.models / "target").is_dir() or not (args.models / "draft").is_dir():
        p.error(f"{args.models} holds no target/ and draft/ (make models builds them)")
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(args.threads)
    measured = measure(args.models, args.k_max, args.steps, args.budget)
    result = report(measured.chains, measured.costs, args.k_max, args.goal, measured.ranks)
    print(markdown(args.models.resolve().name, result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
