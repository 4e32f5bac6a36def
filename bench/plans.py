"""What each pair is asked to do: its loads, prompt mix and output lengths (a plan scaled to the
pair's speed), and the thresholds of the figures the issues ask of it (a profile)."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Prompt length classes, as multiples of the router's token budget (--max-num-batched-tokens).
# With the default budget of 256: short 32-128, medium 160-400, long 600-900 tokens ("long" must
# be chunked). Chat prompts are as long as their question and the chat template make them.
LENGTHS = {"short": (0.125, 0.5), "medium": (0.625, 1.5625), "long": (2.34, 3.52)}

# Code only, 50% short, 30% medium, 20% long, interleaved so every prefix of the pool has the mix.
CODE_MIX = (("code", "short"), ("code", "medium"), ("code", "short"), ("code", "long"), ("code", "short"),
            ("code", "medium"), ("code", "short"), ("code", "short"), ("code", "medium"), ("code", "long"))
# Half chat, half code (20% short, 20% medium, 10% long overall).
CHAT_CODE_MIX = (("chat", "chat"), ("code", "short"), ("chat", "chat"), ("code", "medium"), ("chat", "chat"),
                 ("code", "long"), ("chat", "chat"), ("code", "short"), ("chat", "chat"), ("code", "medium"))


@dataclass(frozen=True)
class Load:
    name: str  # "c1", "c16", "poisson-0.6"
    kind: str  # "closed" (each of `concurrency` clients sends its next request when one ends) | "open"
    n_requests: int
    concurrency: int = 1
    rate_frac: float = 0.0  # open loop: arrival rate as a fraction of config (1)'s closed-loop capacity

    @property
    def label(self) -> str:
        if self.kind == "closed":
            return f"c={self.concurrency}" + (" (single stream)" if self.concurrency == 1 else "")
        return f"Poisson {self.rate_frac:g}x cap"


def closed(n: int, c: int) -> Load:
    return Load(f"c{c}", "closed", n, c)


def poisson(n: int, frac: float) -> Load:
    return Load(f"poisson-{frac:g}", "open", n, rate_frac=frac)


@dataclass(frozen=True)
class Plan:
    loads: tuple[Load, ...]
    pool_size: int
    out_tokens: tuple[int, int]  # max_tokens drawn uniformly from this range (ignore_eos: exact)
    mix: tuple[tuple[str, str], ...]  # (workload, length class), cycled over the pool
    mixed: str  # the open-loop load quoted as "mixed load"

    def describe(self) -> str:
        kinds = sorted({w for w, _ in self.mix})
        return (", ".join(f"{ld.label.replace(' (single stream)', '')} x{ld.n_requests}" for ld in self.loads)
                + f"; outputs {self.out_tokens[0]}-{self.out_tokens[1]} tokens; {self.pool_size} distinct "
                f"prompts ({' + '.join(kinds)})")


@dataclass(frozen=True)
class Profile:
    """A plan for a class of pair, and the issue thresholds that apply to it."""

    name: str
    min_target_params: int  # a pair the bench does not know by name gets the largest profile it reaches
    full: Plan
    quick: Plan
    pipelining_min: float  # (5) / (4) output tokens/s at c=1 in two-device mode (#13)
    single_stream_gates: bool  # (6) >= 1.6x (1) and ahead of the anchor at c=1, two-device (#13)
    minutes: dict[str, float]  # rough minutes per mode of a full run on a quiet 2-core machine
    minutes_quick: dict[str, float]

    def plan(self, quick: bool) -> Plan:
        return self.quick if quick else self.full


PROFILES: dict[str, Profile] = {
    # The demo pair: 8.4M-parameter target, ~6 ms per token.
    "demo": Profile(
        "demo", 0,
        full=Plan((closed(24, 1), closed(24, 4), closed(48, 16), poisson(24, 0.3), poisson(24, 0.6),
                   poisson(24, 0.9)), 48, (48, 96), CODE_MIX, "poisson-0.6"),
        quick=Plan((closed(6, 1), closed(8, 4), closed(16, 16), poisson(12, 0.6)), 16, (24, 48), CODE_MIX,
                   "poisson-0.6"),
        pipelining_min=1.15, single_stream_gates=False,
        minutes={"shared": 13, "two-device": 15}, minutes_quick={"shared": 4, "two-device": 5}),
    # SmolLM2-135M: about 10x the demo target's cost per token, so fewer and shorter requests and
    # a single open-loop load; half of the prompts are chat, rendered with its chat template.
    "smollm2": Profile(
        "smollm2", 50_000_000,
        full=Plan((closed(10, 1), closed(12, 4), closed(32, 16), poisson(12, 0.6)), 32, (32, 64), CHAT_CODE_MIX,
                  "poisson-0.6"),
        quick=Plan((closed(3, 1), closed(4, 4), closed(16, 16), poisson(6, 0.6)), 16, (16, 32), CHAT_CODE_MIX,
                   "poisson-0.6"),
        pipelining_min=1.3, single_stream_gates=True,
        minutes={"shared": 19, "two-device": 20}, minutes_quick={"shared": 6, "two-device": 7}),
}


def profile_for(name: str, target_params: int) -> Profile:
    """By the pair directory's name, else by the target's size (models/tiny: demo)."""
    if name in PROFILES:
        return PROFILES[name]
    fitting = [p for p in PROFILES.values() if target_params >= p.min_target_params]
    return max(fitting, key=lambda p: p.min_target_params)


def arrivals(load: Load, seed: int) -> list[float]:
    """Unit-rate Poisson arrival times (seconds at 1 request/s); divide by the rate to use them."""
    rng = random.Random(seed * 1009 + load.n_requests)
    t, out = 0.0, []
    for _ in range(load.n_requests):
        out.append(t)
        t += rng.expovariate(1.0)
    return out
