"""Whether a greedy divergence is a near-tie, judged by an independent reference.

Two greedy decoders computing in fp32 can take different argmaxes where the best logits lie within
rounding of each other: batch shape, prompt chunking and prefix caching change the order of fp32
sums (on the demo pair two logits 1e-6 apart were seen). Such a divergence is not an engine error,
though every later token differs with it. So where two answers for the same input differ, the
position is scored by transformers in float64: the divergence is a tie when both sides' tokens
score within TIE_GAP of the best logit there (vLLM's check_logprobs_close makes the same
allowance with logprobs). Anything else (a token far from the best, one answer a prefix of the
other) stays a mismatch.

    prompt ids | common prefix of both answers | a (one side), b (the other)
                                               ^ scored here
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.stats import first_diff

# logits, by the dtype the engine computed in: fp32 differences between batch shapes on these pairs
# are ~1e-6..1e-4; bfloat16 keeps 8 bits of mantissa, and 6e-2 is what the engine and transformers,
# both in bfloat16 on a GPU, are held to (tests/test_gpu_parity.py); float16 has 3 bits more.
TIE_GAP = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 6e-2}


@dataclass(frozen=True)
class Divergence:
    prompt: tuple[int, ...]
    common: tuple[int, ...]  # the tokens both answers share before they differ
    a: int | None  # the next token of one answer; None where it ended there
    b: int | None

    @classmethod
    def between(cls, prompt: Sequence[int], one: Sequence[int], other: Sequence[int]) -> Divergence:
        at = first_diff(one, other)
        return cls(tuple(prompt), tuple(one[:at]), one[at] if at < len(one) else None,
                   other[at] if at < len(other) else None)


@dataclass(frozen=True)
class Verdict:
    tie: bool
    below_best_a: float  # best logit there minus a's, in float64 (nan: no token to score)
    below_best_b: float

    def describe(self) -> str:
        kind = "near-tie" if self.tie else "MISMATCH"
        return f"{kind} (float64 logits {self.below_best_a:.1e} and {self.below_best_b:.1e} below the best)"

    def as_dict(self) -> dict:
        """As results.json keeps it beside the difference it judges."""
        return {"tie": self.tie, "below_best": [self.below_best_a, self.below_best_b], "text": self.describe()}


def judge(target_dir: Path, divergences: list[Divergence], computed_in: str | None = None) -> list[Verdict]:
    """Score each divergence's position with the target in float64; `computed_in` is the dtype both
    answers were computed in (default: what the services resolve "auto" to on this machine)."""
    if not divergences:
        return []
    import torch

    from engine.config import EngineConfig
    from model_zoo.hf_draft import load_causal_lm

    gap = TIE_GAP[computed_in or str(EngineConfig().resolved_dtype()).removeprefix("torch.")]

    model = load_causal_lm(target_dir, dtype=torch.float64)
    out = []
    for d in divergences:
        if d.a is None or d.b is None:  # one answer ended where the other went on: not a rounding question
            out.append(Verdict(False, float("nan"), float("nan")))
            continue
        with torch.no_grad():
            logits = model(torch.tensor([[*d.prompt, *d.common]])).logits[0, -1]
        best = logits.max().item()
        gaps = best - logits[d.a].item(), best - logits[d.b].item()
        out.append(Verdict(max(gaps) < gap, *gaps))
    return out
