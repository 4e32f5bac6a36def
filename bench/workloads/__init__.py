"""Named workloads: each turns a pair and the plan's slots into prompts, as token ids of that
pair's own tokenizer.

    code   windows cut at line starts from held-out stdlib files (never trained on), short/medium/long
    chat   user questions written for the bench, rendered with the pair's chat template

A new workload (multi-turn chat, structured output, ...) is a module here exposing a `Workload`,
added to WORKLOADS, and named in a plan's mix (bench/plans.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from bench.pairs import Pair
from bench.plans import LENGTHS, Plan

SPEC_SLACK = 16  # room for the k + 1 lookahead slots of speculation past the last token


@dataclass(frozen=True)
class Prompt:
    pid: int
    ids: list[int]
    max_tokens: int
    kind: str  # length class (short | medium | long) or the workload's own (chat)
    source: str  # where it comes from: held-out file and line, question number
    workload: str = "code"


@dataclass(frozen=True)
class Slot:
    """One prompt the plan asks for."""

    pid: int
    kind: str
    max_tokens: int

    def room(self, pair: Pair) -> int:
        """Most prompt tokens that leave room for the output and speculation's lookahead."""
        return pair.max_model_len - self.max_tokens - SPEC_SLACK

    def length_range(self, pair: Pair, budget: int) -> tuple[int, int]:
        lo, hi = (max(8, min(int(f * budget), self.room(pair))) for f in LENGTHS[self.kind])
        return lo, hi


@dataclass(frozen=True)
class Workload:
    name: str
    make: Callable[[Pair, list[Slot], int, random.Random], list[Prompt]]  # (pair, slots, budget, rng)
    applies: Callable[[Pair], bool] = lambda pair: True
    instead: tuple[str, str] = ("code", "short")  # what a pair it does not apply to gets


def _registry() -> dict[str, Workload]:
    from bench.workloads import chat, code

    return {w.name: w for w in (code.WORKLOAD, chat.WORKLOAD)}


WORKLOADS = _registry()


def build_pool(pair: Pair, plan: Plan, budget: int, seed: int) -> tuple[list[Prompt], list[str]]:
    """plan.pool_size prompts for this pair, deterministic for (pair, plan, budget, seed); and notes
    on workloads replaced because they do not apply to the pair (chat without a chat template)."""
    rng = random.Random(seed)
    slots: dict[str, list[Slot]] = {}
    notes = set()
    for pid in range(plan.pool_size):
        name, kind = plan.mix[pid % len(plan.mix)]
        if not WORKLOADS[name].applies(pair):
            notes.add(f"{pair.name}: the {name} workload does not apply (no chat template?); "
                      f"{'/'.join(WORKLOADS[name].instead)} prompts instead")
            name, kind = WORKLOADS[name].instead
        slots.setdefault(name, []).append(Slot(pid, kind, rng.randint(*plan.out_tokens)))
    pool = [p for name, ss in slots.items() for p in WORKLOADS[name].make(pair, ss, budget,
                                                                           random.Random(f"{seed}/{name}"))]
    return sorted(pool, key=lambda p: p.pid), sorted(notes)


def pool_summary(pool: list[Prompt]) -> dict:
    groups: dict[str, list[int]] = {}
    for p in pool:
        groups.setdefault(f"{p.workload} {p.kind}" if p.workload != p.kind else p.kind, []).append(len(p.ids))
    return {"prompts": len(pool),
            "by_kind": {k: {"n": len(v), "min": min(v), "max": max(v)} for k, v in groups.items()},
            "output_tokens": sum(p.max_tokens for p in pool),
            "pool": [{"pid": p.pid, "workload": p.workload, "kind": p.kind, "prompt_tokens": len(p.ids),
                      "max_tokens": p.max_tokens, "source": p.source} for p in pool]}
