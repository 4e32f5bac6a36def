"""Measurements of the saved pair: held-out cross-entropy, greedy speculative acceptance,
and the per-token decode cost ratio target/draft on this machine (fp32, transformers, KV cache).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .train import sample_windows


@torch.inference_mode()
def heldout_cross_entropy(model, stream: torch.Tensor, seq_len: int, max_tokens: int, batch: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over consecutive held-out windows."""
    n_windows = max(1, min(max_tokens // seq_len, (stream.numel() - 1) // seq_len))
    windows = torch.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n_windows)])
    total, count = 0.0, 0
    for b in range(0, n_windows, batch):
        x = windows[b : b + batch]
        logits = model(input_ids=x[:, :-1]).logits.float()
        total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum").item()
        count += x[:, 1:].numel()
    return total / count


@torch.inference_mode()
def top1_agreement_on_text(
    target, draft, stream: torch.Tensor, seq_len: int, max_tokens: int, batch: int = 16
) -> float:
    """Fraction of held-out corpus positions (teacher-forced, real text) where the draft's most
    likely next token is the target's: agreement away from the target's own continuations."""
    n_windows = max(1, min(max_tokens // seq_len, stream.numel() // seq_len))
    windows = torch.stack([stream[i * seq_len : (i + 1) * seq_len] for i in range(n_windows)])
    same = 0
    for b in range(0, n_windows, batch):
        x = windows[b : b + batch]
        same += (target(input_ids=x).logits.argmax(-1) == draft(input_ids=x).logits.argmax(-1)).sum().item()
    return same / windows.numel()


def distinct_ngram_ratio(rows: torch.Tensor, n: int = 4) -> float:
    """Mean fraction of distinct n-grams per row: near 1 for varied text, low for loops."""
    ratios = []
    for row in rows.tolist():
        grams = [tuple(row[i : i + n]) for i in range(len(row) - n + 1)]
        ratios.append(len(set(grams)) / max(1, len(grams)))
    return sum(ratios) / len(ratios)


@torch.inference_mode()
def greedy(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Plain greedy decoding with the KV cache; returns only the new tokens [B, new_tokens]."""
    out = model(input_ids=prompts, use_cache=True)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    result = [nxt]
    for _ in range(new_tokens - 1):
        out = model(input_ids=nxt, cache=out.cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        result.append(nxt)
    return torch.cat(result, 1)


@torch.inference_mode()
def draft_match_lengths(draft, prompts: torch.Tensor, target_cont: torch.Tensor, k_max: int) -> torch.Tensor:
    """m[b, p]: how many of the draft's k_max greedy proposals, made from the history
    prompt + target_cont[:p], equal target_cont[p:p + k_max] in order (first mismatch stops).
    target_cont must hold steps + k_max tokens; returns [B, steps]."""
    steps = target_cont.size(1) - k_max
    out = draft(input_ids=prompts, use_cache=True)
    cache, last = out.cache, out.logits[:, -1]
    matches = []
    for p in range(steps):
        proposal = [last.argmax(-1, keepdim=True)]
        for _ in range(k_max - 1):
            o = draft(input_ids=proposal[-1], cache=cache, use_cache=True)
            proposal.append(o.logits[:, -1].argmax(-1, keepdim=True))
        cache.crop(-(k_max - 1))  # roll back the speculative tokens
        proposal = torch.cat(proposal, 1)
        ok = (proposal == target_cont[:, p : p + k_max]).long()
        matches.append(ok.cumprod(1).sum(1))
        o = draft(input_ids=target_cont[:, p : p + 1], cache=cache, use_cache=True)
        last = o.logits[:, -1]
    return torch.stack(matches, 1)


def simulate_acceptance(match_lengths: torch.Tensor | Sequence[Sequence[int]], k: int) -> dict:
    """Greedy speculative decoding with a fixed k: each step the draft proposes k tokens, the
    target accepts the matching prefix and emits one more token of its own. Rows may differ in
    length (continuations that stopped early)."""
    accepted = proposed = steps = 0
    rows = match_lengths.tolist() if isinstance(match_lengths, torch.Tensor) else match_lengths
    for row in rows:
        p, n = 0, len(row)
        while p < n:
            a = min(row[p], k)
            accepted += a
            proposed += k
            steps += 1
            p += a + 1
    return {
        "k": k,
        "acceptance_rate": round(accepted / proposed, 4),
        "mean_emitted_per_step": round((accepted + steps) / steps, 4),
    }


def acceptance_table(
    target, draft, stream: torch.Tensor, n_prompts: int, prompt_len: int, new_tokens: int, k_max: int, seed: int
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    prompts = sample_windows(stream, gen, n_prompts, prompt_len)
    cont = greedy(target, prompts, new_tokens + k_max)
    m = draft_match_lengths(draft, prompts, cont, k_max)
    return {
        "prompts": n_prompts,
        "prompt_len": prompt_len,
        "generated_per_prompt": new_tokens,
        "per_k": [simulate_acceptance(m, k) for k in range(1, k_max + 1)],
        "draft_top1_agreement": round(float((m > 0).float().mean()), 4),
        "target_distinct_4gram_ratio": round(distinct_ngram_ratio(cont[:, :new_tokens]), 4),
    }


@torch.inference_mode()
def decode_cost_ms(target, draft, context: torch.Tensor, repeats: int, blocks: int = 5) -> dict:
    """Median wall time of decoding 1 token at batch 1 after ``context`` cached tokens (fp32,
    transformers, KV cache), for both models. Each model decodes in runs of consecutive steps
    (as a draft proposes k tokens in a row), the two models alternating run by run so that
    machine noise hits both alike; every step is then rolled back to keep the context fixed."""
    models = {"target": target, "draft": draft}
    caches = {name: m(input_ids=context[None], use_cache=True).cache for name, m in models.items()}
    tok = context[-1:].view(1, 1)
    per_block = max(1, repeats // blocks)
    times: dict[str, list[float]] = {"target": [], "draft": []}
    for _ in range(blocks):
        for name, model in models.items():
            for r in range(per_block + 3):  # 3 warm-up steps per run
                t0 = time.perf_counter()
                model(input_ids=tok, cache=caches[name], use_cache=True)
                dt = time.perf_counter() - t0
                caches[name].crop(-1)
                if r >= 3:
                    times[name].append(dt * 1000)
    t, d = statistics.median(times["target"]), statistics.median(times["draft"])
    return {
        "context_tokens": context.numel(),
        "repeats": per_block * blocks,
        "target_ms": round(t, 3),
        "draft_ms": round(d, 3),
        "ratio_target_over_draft": round(t / d, 2),
    }
