"""The configurations, summaries of one (config, load), and the cross-config correctness check."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.client import RequestResult


@dataclass(frozen=True)
class Config:
    key: str  # "1".."7", "hf"
    name: str
    draft: bool
    flags: tuple[str, ...]


CONFIGS: tuple[Config, ...] = (
    Config("1", "target only, prefill-first", False, ("--no-chunked-prefill", "--no-prompt-lookup")),
    Config("2", "target only + chunked prefill", False, ("--no-prompt-lookup",)),
    Config("3", "spec, no chunking, draft then target", True,
           ("--no-chunked-prefill", "--no-pipeline", "--no-dynamic-k")),
    Config("4", "spec + chunked, draft then target", True, ("--no-pipeline", "--no-dynamic-k")),
    Config("5", "(4) + pipelining", True, ("--no-dynamic-k",)),
    Config("6", "(5) + dynamic k (defaults)", True, ()),
    Config("7", "target + prompt lookup, no draft", False, ()),
)
ANCHOR = Config("hf", "transformers generate(assistant_model=draft), one at a time", True, ())


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else math.nan


def summarize(results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if r.error is None]
    itl = [x for r in ok for x in r.itl()]
    ttft = [r.ttft for r in ok]
    e2e = [r.e2e for r in ok]
    tokens = sum(len(r.tokens) for r in ok)
    ms = 1000.0
    return {
        "requests": len(results), "errors": len(results) - len(ok), "wall_s": wall, "output_tokens": tokens,
        "tokens_per_s": tokens / wall if wall else math.nan, "requests_per_s": len(ok) / wall if wall else math.nan,
        "ttft_ms": {"p50": ms * _pct(ttft, 50), "p90": ms * _pct(ttft, 90), "p99": ms * _pct(ttft, 99)},
        "itl_ms": {"p50": ms * _pct(itl, 50), "p90": ms * _pct(itl, 90), "p99": ms * _pct(itl, 99),
                   "mean": ms * float(np.mean(itl)) if itl else math.nan},
        "e2e_s": {"p50": _pct(e2e, 50), "p90": _pct(e2e, 90), "p99": _pct(e2e, 99)},
        "first_error": next((r.error for r in results if r.error), None),
    }


def itl_samples(results: list[RequestResult]) -> list[float]:
    return [round(x * 1000, 2) for r in results if r.error is None for x in r.itl()]


def first_diff(a: Sequence, b: Sequence) -> int:
    """The first index where two token lists (or texts) differ; the shorter's length if one extends the other."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


class Correctness:
    """Greedy decoding must give the same tokens for a prompt in every config and load. The first
    answer seen for a prompt is the reference; every later one is compared with it."""

    def __init__(self) -> None:
        self.reference: dict[int, tuple[str, list[int]]] = {}
        self.checked = 0
        self.mismatches: list[dict] = []  # judged later (bench/ties.py): each gets a "verdict"
        self.answers: list[tuple[list[int], list[int]]] = []  # (reference, other) per mismatch, in order

    def check(self, where: str, results: list[RequestResult]) -> None:
        for r in results:
            if r.error is not None:
                continue
            ref = self.reference.setdefault(r.pid, (where, r.tokens))
            self.checked += 1
            if ref[1] != r.tokens:
                self.mismatches.append({"pid": r.pid, "where": where, "reference": ref[0],
                                        "first_diff_at": first_diff(ref[1], r.tokens)})
                self.answers.append((ref[1], r.tokens))

    @property
    def real_mismatches(self) -> int:
        """Mismatches not judged near-ties (unjudged ones count)."""
        return sum(1 for m in self.mismatches if not m.get("verdict", {}).get("tie"))

    def against_anchor(self, served: dict[int, RequestResult]) -> tuple[int, list[dict]]:
        """(prompts whose anchor answer equals Tandem's, where each other one first differs with the
        token ids around it: enough to check the reference's logits there for a near-tie)."""
        same, diffs = 0, []
        for pid, r in served.items():
            if pid not in self.reference:
                continue
            ours = self.reference[pid][1]
            if ours == r.tokens:
                same += 1
                continue
            at = first_diff(ours, r.tokens)
            diffs.append({"pid": pid, "first_diff_at": at, "tandem": ours[max(0, at - 4):at + 4],
                          "anchor": r.tokens[max(0, at - 4):at + 4]})
        return same, diffs

    def report(self) -> dict:
        return {"prompts": len(self.reference), "answers_compared": self.checked,
                "mismatches": self.real_mismatches, "near_ties": len(self.mismatches) - self.real_mismatches,
                "details": self.mismatches[:50]}
