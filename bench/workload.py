"""The workload: prompts cut from the held-out split of the stdlib corpus (files the demo pair was
never trained on), a realistic length mix with long prompts that force chunking, and the loads."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from demo_models.corpus import load_corpus

# Prompt length classes, as multiples of the router's token budget (--max-num-batched-tokens).
# With the default budget of 256: short 32-128, medium 160-400, long 600-900 tokens.
LENGTHS = {"short": (0.125, 0.5), "medium": (0.625, 1.5625), "long": (2.34, 3.52)}
# 50% short, 30% medium, 20% long, interleaved so every prefix of the pool has the mix.
MIX = ("short", "medium", "short", "long", "short", "medium", "short", "short", "medium", "long")
SPEC_SLACK = 16  # room for the k + 1 lookahead slots of speculation past the last token


@dataclass(frozen=True)
class Prompt:
    pid: int
    ids: list[int]
    max_tokens: int
    kind: str  # short | medium | long
    source: str  # held-out file and line the prompt starts at


@dataclass(frozen=True)
class Load:
    name: str  # "c1", "c16", "poisson-0.7"
    kind: str  # "closed" (each of `concurrency` clients sends its next request when one ends) | "open"
    n_requests: int
    concurrency: int = 1
    rate_frac: float = 0.0  # open loop: arrival rate as a fraction of config (1)'s closed-loop capacity

    @property
    def label(self) -> str:
        if self.kind == "closed":
            return f"c={self.concurrency}" + (" (single stream)" if self.concurrency == 1 else "")
        return f"Poisson {self.rate_frac:g}x cap"


@dataclass(frozen=True)
class Plan:
    loads: tuple[Load, ...]
    pool_size: int
    out_tokens: tuple[int, int]  # max_tokens drawn uniformly from this range (ignore_eos: exact)
    mixed: str  # the open-loop load the "mixed load" ratios quote


def plan(quick: bool) -> Plan:
    if quick:
        loads = (Load("c1", "closed", 4, 1), Load("c4", "closed", 8, 4), Load("c16", "closed", 16, 16),
                 Load("poisson-0.8", "open", 12, rate_frac=0.8))
        return Plan(loads, 16, (24, 48), "poisson-0.8")
    loads = (Load("c1", "closed", 12, 1), Load("c4", "closed", 24, 4), Load("c16", "closed", 48, 16),
             Load("poisson-0.3", "open", 24, rate_frac=0.3), Load("poisson-0.6", "open", 24, rate_frac=0.6),
             Load("poisson-0.9", "open", 24, rate_frac=0.9))
    return Plan(loads, 48, (48, 96), "poisson-0.6")


def model_facts(models: Path) -> dict:
    report = json.loads((models / "report.json").read_text())
    config = json.loads((models / "target" / "config.json").read_text())
    return {"variant": report.get("variant"), "settings": report["settings"],
            "max_model_len": int(config.get("max_position_embeddings", report["settings"]["max_positions"])),
            "target_params": report["target"]["params"], "draft_params": report["draft"]["params"],
            "acceptance": report.get("acceptance", {}), "cost": report.get("cost", {})}


def build_pool(models: Path, size: int, out_tokens: tuple[int, int], budget: int, seed: int) -> list[Prompt]:
    """`size` prompts, deterministic for (models, size, budget, seed). Each starts at a line of a
    held-out file; long prompts are clipped so that prompt + output + speculation fit the model."""
    facts = model_facts(models)
    s = facts["settings"]
    corpus = load_corpus(s["max_file_bytes"], s["max_total_bytes"], s["heldout_percent"])
    tok = Tokenizer.from_file(str(models / "target" / "tokenizer.json"))
    rng = random.Random(seed)
    files = sorted(corpus.heldout, key=lambda f: f.relpath)
    pool = []
    for pid in range(size):
        kind = MIX[pid % len(MIX)]
        max_tokens = rng.randint(*out_tokens)
        room = facts["max_model_len"] - max_tokens - SPEC_SLACK
        lo, hi = (max(8, min(int(f * budget), room)) for f in LENGTHS[kind])
        length = rng.randint(lo, hi)
        for _ in range(100):  # a file (and a line in it) with at least `length` tokens after it
            f = rng.choice(files)
            lines = f.text.splitlines(keepends=True)
            start = rng.randrange(len(lines))
            ids = tok.encode("".join(lines[start:])).ids  # <s> + text, like the tokenizer's default
            if len(ids) >= length:
                break
        else:
            raise RuntimeError(f"no held-out file has {length} tokens after a line; lower the budget")
        pool.append(Prompt(pid, ids[:length], max_tokens, kind, f"{f.relpath}:{start + 1}"))
    return pool


def arrivals(load: Load, seed: int) -> list[float]:
    """Unit-rate Poisson arrival times (seconds at 1 request/s); divide by the rate to use them."""
    rng = random.Random(seed * 1009 + load.n_requests)
    t, out = 0.0, []
    for _ in range(load.n_requests):
        out.append(t)
        t += rng.expovariate(1.0)
    return out


def pool_summary(pool: list[Prompt]) -> dict:
    kinds = {k: [len(p.ids) for p in pool if p.kind == k] for k in LENGTHS}
    return {"prompts": len(pool), "by_kind": {k: {"n": len(v), "min": min(v, default=0), "max": max(v, default=0)}
                                               for k, v in kinds.items()},
            "output_tokens": sum(p.max_tokens for p in pool),
            "pool": [{"pid": p.pid, "kind": p.kind, "prompt_tokens": len(p.ids), "max_tokens": p.max_tokens,
                      "source": p.source} for p in pool]}
