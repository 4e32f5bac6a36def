"""Build settings: one ``Settings`` per variant, and the settings hash that makes builds cached."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
from dataclasses import dataclass

import tokenizers
import torch
import transformers

from .train import ModelShape, TrainSchedule

# Bump when the recipe changes in a way the settings below do not capture.
RECIPE_VERSION = 3


@dataclass(frozen=True)
class Settings:
    variant: str
    seed: int
    # corpus and tokenizer
    max_file_bytes: int
    max_total_bytes: int
    heldout_percent: int
    vocab_size: int
    max_positions: int
    # target
    target_shape: ModelShape
    target_train: TrainSchedule
    # distillation data, labelled by the target: corpus prompts it continued greedily, plus
    # plain corpus windows; the draft learns the target's top-k distribution at every position
    distill_generated: int
    distill_corpus: int
    distill_seq_len: int
    distill_prompt_lens: tuple[int, ...]
    distill_gen_batch: int
    distill_top_k: int
    distill_max_seconds: float
    # draft
    draft_shape: ModelShape
    draft_train: TrainSchedule
    hard_weight: float  # cross-entropy to the target's greedy (top-1) token
    soft_weight: float  # cross-entropy to the target's top-k distribution
    # evaluation
    eval_prompts: int
    eval_prompt_len: int
    eval_new_tokens: int
    eval_k_max: int
    eval_ce_tokens: int
    cost_context: int
    cost_repeats: int
    threads: int = 2
    # quality gates (None: none, for the tiny test pair): a pair below them is not installed
    gate_acceptance_k4: float | None = None
    gate_cost_ratio: float | None = None


VARIANTS: dict[str, Settings] = {
    # About 12-13 minutes on a quiet 2-core machine; time caps keep it near 15 on a busy one.
    "full": Settings(
        variant="full",
        seed=1234,
        max_file_bytes=200_000,
        max_total_bytes=12_000_000,
        heldout_percent=5,
        vocab_size=4096,
        max_positions=1024,
        target_shape=ModelShape(layers=8, hidden=256, intermediate=768, heads=4, kv_heads=2),
        target_train=TrainSchedule(steps=440, batch=16, seq_len=256, lr=2e-3, warmup=30, max_seconds=540),
        distill_generated=1024,
        distill_corpus=512,
        distill_seq_len=256,
        distill_prompt_lens=(32, 64, 96, 128),
        distill_gen_batch=64,
        distill_top_k=16,
        distill_max_seconds=150,
        draft_shape=ModelShape(layers=1, hidden=128, intermediate=384, heads=2, kv_heads=2),
        draft_train=TrainSchedule(steps=300, batch=32, seq_len=255, lr=3e-3, warmup=20, max_seconds=150),
        hard_weight=0.25,
        soft_weight=1.0,
        eval_prompts=32,
        eval_prompt_len=128,
        eval_new_tokens=128,
        eval_k_max=8,
        eval_ce_tokens=32768,
        cost_context=256,
        cost_repeats=200,
        gate_acceptance_k4=0.5,
        gate_cost_ratio=8.0,
    ),
    # Seconds: for tests. Tiny shapes and a handful of steps; acceptance is not meaningful.
    "tiny": Settings(
        variant="tiny",
        seed=1234,
        max_file_bytes=50_000,
        max_total_bytes=400_000,
        heldout_percent=10,
        vocab_size=512,
        max_positions=512,
        target_shape=ModelShape(layers=2, hidden=64, intermediate=128, heads=2, kv_heads=1),
        target_train=TrainSchedule(steps=8, batch=4, seq_len=64, lr=3e-3, warmup=2),
        distill_generated=16,
        distill_corpus=8,
        distill_seq_len=48,
        distill_prompt_lens=(16, 24),
        distill_gen_batch=8,
        distill_top_k=8,
        distill_max_seconds=0,
        draft_shape=ModelShape(layers=1, hidden=32, intermediate=64, heads=1, kv_heads=1),
        draft_train=TrainSchedule(steps=8, batch=8, seq_len=47, lr=3e-3, warmup=2),
        hard_weight=0.25,
        soft_weight=1.0,
        eval_prompts=4,
        eval_prompt_len=16,
        eval_new_tokens=16,
        eval_k_max=8,
        eval_ce_tokens=1024,
        cost_context=64,
        cost_repeats=5,
        threads=1,  # tiny matrices gain nothing from a second thread, and lose a lot on a busy machine
    ),
}


def settings_hash(settings: Settings, corpus_fingerprint: str, bf16: bool) -> str:
    payload = {
        "settings": dataclasses.asdict(settings),
        "bf16": bf16,  # bf16 and fp32 training give different weights
        "recipe_version": RECIPE_VERSION,
        "corpus": corpus_fingerprint,
        "versions": library_versions(),
    }
    for key in ("target_train", "draft_train"):  # a safety cap, not a recipe setting
        payload["settings"][key].pop("max_seconds", None)
    for key in ("distill_max_seconds", "gate_acceptance_k4", "gate_cost_ratio"):  # not the recipe
        payload["settings"].pop(key, None)
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def library_versions() -> dict:
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "python": platform.python_version(),
    }
