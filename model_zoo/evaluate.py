"""Measurements of a draft/target pair with Tandem's engine: greedy acceptance at k = 1..k_max
on the target's own greedy continuations, and the per-token decode cost of both models.

Acceptance follows demo_models/evaluate.py (accepted / proposed draft tokens with a fixed k, the
history advancing by accepted + 1), with continuations that may stop early at an end token.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from demo_models.evaluate import decode_cost_ms, simulate_acceptance
from engine import ModelRunner, SeqInput

from .generate import make_runner
from .hf_draft import load_causal_lm


@torch.inference_mode()
def match_lengths(
    draft: ModelRunner, prompts: Sequence[Sequence[int]], conts: Sequence[Sequence[int]], k_max: int, batch: int = 32
) -> list[list[int]]:
    """m[i][p]: how many of the draft's k_max greedy proposals made after prompt_i + cont_i[:p]
    equal cont_i[p:p + k_max] in order (the first mismatch or the end of cont_i stops)."""
    out: list[list[int]] = [[] for _ in prompts]
    for lo in range(0, len(prompts), batch):
        rows = list(range(lo, min(lo + batch, len(prompts))))
        # logits after each history; p = 0 starts from the prompt, then one target token a step
        entries = [SeqInput(i, 0, list(prompts[i])) for i in rows]
        p = 0
        while entries:
            first = draft.forward(entries)
            proposals = {e.seq_id: [int(lg[-1].argmax())] for e, lg in zip(entries, first, strict=True)}
            for j in range(1, k_max):
                step = [SeqInput(i, len(prompts[i]) + p + j - 1, [proposals[i][-1]]) for i in proposals]
                for e, lg in zip(step, draft.forward(step), strict=True):
                    proposals[e.seq_id].append(int(lg[-1].argmax()))
            for i, prop in proposals.items():
                want = conts[i][p : p + k_max]
                m = 0
                while m < len(want) and prop[m] == want[m]:
                    m += 1
                out[i].append(m)
            p += 1
            entries = [SeqInput(i, len(prompts[i]) + p - 1, [conts[i][p - 1]]) for i in proposals if p < len(conts[i])]
        draft.release(rows)
    return out


def acceptance_table(rows: list[list[int]], k_max: int) -> list[dict]:
    return [simulate_acceptance(rows, k) for k in range(1, k_max + 1)]


def top1_agreement(rows: list[list[int]]) -> float:
    flat = [m for r in rows for m in r]
    return sum(m > 0 for m in flat) / max(1, len(flat))


@torch.inference_mode()
def engine_decode_cost_ms(
    target_dir: str, draft_dir: str, context: Sequence[int], repeats: int, blocks: int = 5
) -> dict:
    """Median time of one single-token decode at batch 1 after ``context`` cached tokens, through
    Tandem's engine (what the services run), both models in alternating runs of consecutive
    steps as in demo_models.evaluate.decode_cost_ms; each step overwrites the same position."""
    runners = {name: make_runner(d, len(context) + 32) for name, d in (("target", target_dir), ("draft", draft_dir))}
    for r in runners.values():
        r.forward([SeqInput(0, 0, list(context))])
    n = len(context)
    per_block = max(1, repeats // blocks)
    times: dict[str, list[float]] = {"target": [], "draft": []}
    for _ in range(blocks):
        for name, r in runners.items():
            for i in range(per_block + 3):
                t0 = time.perf_counter()
                r.forward([SeqInput(0, n, [context[-1]])])
                if i >= 3:
                    times[name].append((time.perf_counter() - t0) * 1000)
    t, d = statistics.median(times["target"]), statistics.median(times["draft"])
    return {"context_tokens": n, "repeats": per_block * blocks, "target_ms": round(t, 3), "draft_ms": round(d, 3),
            "ratio_target_over_draft": round(t / d, 2)}


def transformers_decode_cost_ms(target_dir: str, draft_dir: str, context: Sequence[int], repeats: int) -> dict:
    """demo_models.evaluate.decode_cost_ms (transformers, its KV cache) on this pair."""
    target, draft = load_causal_lm(target_dir), load_causal_lm(draft_dir)
    return decode_cost_ms(target, draft, torch.tensor(list(context)), repeats)
