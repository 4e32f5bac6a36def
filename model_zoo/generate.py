"""Batched generation with Tandem's own engine, for building and measuring a draft.

Many sequences decode together (continuous batching: a finished sequence's place goes to the
next prompt), every step is one ``ModelRunner.forward`` over a varlen batch, so nothing is
padded and each sequence's tokens are exactly what it would get alone. Along the way the
target's top-K log-probabilities at every generated position are kept: they are the labels a
draft is distilled on, obtained for free while generating.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from engine import EngineConfig, ModelRunner, SeqInput


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy; otherwise softmax(logits / T) over the top_k most likely tokens
    (top-k, not top-p: a full-vocabulary sort per step costs more than the model on a CPU)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: the whole vocabulary


@dataclass
class Generated:
    prompt: list[int]
    output: list[int]  # generated tokens, a stop token included when one ended it
    top_ids: torch.Tensor  # [len(output), K] the model's top-K ids at each generated position
    top_logprobs: torch.Tensor  # [len(output), K] their log-probabilities (float32)


def make_runner(model_dir: str, max_tokens_cached: int, max_batch_tokens: int = 4096) -> ModelRunner:
    block = 16
    return ModelRunner.load(
        model_dir,
        EngineConfig(num_blocks=-(-max_tokens_cached // block) + 8, block_size=block, dtype="float32",
                     device="cpu", max_batch_tokens=max_batch_tokens),
    )


def _pick(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator) -> list[int]:
    if sampling.top_k:
        values, ids = logits.topk(sampling.top_k, dim=-1)
        choice = torch.multinomial((values / sampling.temperature).softmax(-1), 1, generator=gen)
        return ids.gather(-1, choice).squeeze(-1).tolist()
    probs = (logits / sampling.temperature).softmax(-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1).tolist()


@torch.inference_mode()
def generate(
    runner: ModelRunner,
    prompts: Sequence[Sequence[int]],
    max_new: int,
    stop_ids: Sequence[int] = (),
    sampling: Sampling = Sampling(),
    label_top_k: int = 0,
    batch: int = 32,
    seed: int = 0,
    desc: str = "generate",
    progress: bool = True,
    max_seconds: float = 0.0,
) -> list[Generated]:
    """Continue every prompt by up to ``max_new`` tokens (fewer when a stop id is produced).
    Results come back in prompt order. ``runner`` must hold ``batch`` sequences of
    prompt + max_new tokens in its KV cache. After ``max_seconds`` (0: never) no further prompt
    is started; those that were finish, and only they are returned."""
    gen = torch.Generator().manual_seed(seed)
    stops = set(stop_ids)
    k = max(label_top_k, 1)
    outputs: list[list[int]] = [[] for _ in prompts]
    ids: list[list[torch.Tensor]] = [[] for _ in prompts]
    lps: list[list[torch.Tensor]] = [[] for _ in prompts]
    waiting = list(range(len(prompts)))[::-1]
    active: list[int] = []  # indices of prompts decoding now
    budget = runner.config.max_batch_tokens
    bar = tqdm(total=len(prompts), desc=desc, unit="seq", disable=not progress, mininterval=1.0, dynamic_ncols=True)
    start = time.perf_counter()
    while waiting or active:
        if max_seconds and waiting and time.perf_counter() - start > max_seconds:
            bar.write(f"{desc}: time cap of {max_seconds:.0f}s reached; {len(waiting)} prompts not started")
            waiting = []
            if not active:
                break
        entries = [SeqInput(i, len(prompts[i]) + len(outputs[i]) - 1, [outputs[i][-1]]) for i in active]
        used = len(entries)
        while waiting and len(active) < batch and used + len(prompts[waiting[-1]]) <= budget:
            i = waiting.pop()
            entries.append(SeqInput(i, 0, list(prompts[i])))
            used += len(prompts[i])
            active.append(i)
        logits = torch.cat(runner.forward(entries))  # [len(entries), V], one row per sequence
        top_v, top_i = logits.topk(k, dim=-1)
        top_v = top_v - logits.logsumexp(-1, keepdim=True)  # log-probabilities of the top k
        picks = logits.argmax(-1).tolist() if sampling.temperature == 0.0 else _pick(logits, sampling, gen)
        still = []
        for row, entry in enumerate(entries):
            i = entry.seq_id
            outputs[i].append(picks[row])
            ids[i].append(top_i[row])
            lps[i].append(top_v[row])
            if picks[row] in stops or len(outputs[i]) >= max_new:
                runner.release([i])
                bar.update(1)
            else:
                still.append(i)
        active = still
    bar.close()
    return [
        Generated(list(p), outputs[i], torch.stack(ids[i]), torch.stack(lps[i]))
        for i, p in enumerate(prompts)
        if outputs[i]
    ]
