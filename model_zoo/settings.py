"""Settings of the SmolLM2 pair's build, and the hash that makes the build cached."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import platform
from dataclasses import dataclass

import tokenizers
import torch
import transformers

from demo_models.train import TrainSchedule

from .distill import LossWeights
from .generate import Sampling

# Bump when the recipe changes in a way the settings below do not capture.
RECIPE_VERSION = 2


@dataclass(frozen=True)
class DraftSettings:
    variant: str
    seed: int
    # chat prompts the target writes itself (Magpie), then answers greedily
    chat_train: int
    chat_eval: int
    question_max_tokens: int
    question_sampling: Sampling
    # code prompts: windows of the stdlib's sources (train / held-out files), continued greedily
    code_train: int
    code_eval: int
    code_prompt_lens: tuple[int, int]
    max_file_bytes: int
    max_total_bytes: int
    heldout_percent: int
    # the target's continuations: training labels (its top-K at every generated position)
    answer_max_tokens: int
    label_top_k: int
    gen_batch: int
    labelling_max_seconds: float  # safety cap (0 = none)
    # the target reading training stdlib files: labels at every position of natural code
    read_windows: int
    read_len: int  # tokens per window
    read_context: int  # the first tokens of a window are context only, not labelled
    reading_max_seconds: float  # safety cap (0 = none)
    # the draft
    layers: tuple[int, ...]  # target layers its layers start from, in order
    head_vocab: int  # its output head covers this many of the most frequent tokens
    norm_scale: float  # the target's final norm, scaled: the draft's shallow features are not the last layer's
    train: TrainSchedule  # batch = sequences of labelled target output per step
    loss: LossWeights
    # measurement on held-out prompts
    eval_max_tokens: int
    eval_k_max: int
    cost_context: int
    cost_repeats: int
    # quality gates: a pair below them is not installed
    gate_acceptance_k4: float
    gate_cost_ratio: float
    threads: int = 2
    verify_target: bool = True  # against transformers' own GGUF load (tests check it on their own)


VARIANTS: dict[str, DraftSettings] = {
    # The pair `make models` builds. Budget: 30 minutes on 2 AVX2 cores in fp32.
    "full": DraftSettings(
        variant="full",
        seed=1234,
        chat_train=320,
        chat_eval=48,
        question_max_tokens=64,
        question_sampling=Sampling(temperature=1.0, top_k=64),
        code_train=160,
        code_eval=48,
        code_prompt_lens=(48, 128),
        max_file_bytes=200_000,
        max_total_bytes=12_000_000,
        heldout_percent=5,
        answer_max_tokens=160,
        label_top_k=32,
        gen_batch=96,
        labelling_max_seconds=300,
        read_windows=400,
        read_len=256,
        read_context=16,
        reading_max_seconds=450,
        layers=(0, 1),
        head_vocab=8192,
        norm_scale=0.3,
        train=TrainSchedule(steps=240, batch=16, seq_len=256, lr=4e-3, warmup=10, weight_decay=0.0,
                            max_seconds=720),
        loss=LossWeights(hard=0.5, soft=1.0),
        eval_max_tokens=128,
        eval_k_max=8,
        cost_context=256,
        cost_repeats=200,
        gate_acceptance_k4=0.55,
        gate_cost_ratio=8.0,
    ),
    # Seconds: for tests. A handful of prompts and steps; the numbers mean nothing, no gates.
    "tiny": DraftSettings(
        variant="tiny",
        seed=1234,
        chat_train=6,
        chat_eval=2,
        question_max_tokens=24,
        question_sampling=Sampling(temperature=1.0, top_k=64),
        code_train=4,
        code_eval=2,
        code_prompt_lens=(16, 32),
        max_file_bytes=50_000,
        max_total_bytes=400_000,
        heldout_percent=10,
        answer_max_tokens=12,
        label_top_k=8,
        gen_batch=16,
        labelling_max_seconds=0,
        read_windows=4,
        read_len=32,
        read_context=8,
        reading_max_seconds=0,
        layers=(0,),
        head_vocab=512,
        norm_scale=0.3,
        train=TrainSchedule(steps=3, batch=4, seq_len=64, lr=5e-4, warmup=1, weight_decay=0.0),
        loss=LossWeights(),
        eval_max_tokens=12,
        eval_k_max=8,
        cost_context=32,
        cost_repeats=5,
        gate_acceptance_k4=0.0,
        gate_cost_ratio=0.0,
        verify_target=False,
    ),
}


def settings_hash(settings: DraftSettings, source: str, corpus_fingerprint: str, bf16: bool) -> str:
    payload = {
        "settings": dataclasses.asdict(settings),
        "recipe_version": RECIPE_VERSION,
        "source": source,  # the GGUF's SHA-256
        "corpus": corpus_fingerprint,
        "bf16": bf16,
        "versions": library_versions(),
    }
    caps_and_gates = ("labelling_max_seconds", "reading_max_seconds", "gate_acceptance_k4", "gate_cost_ratio")
    for key in (*caps_and_gates, "verify_target"):  # not the recipe
        payload["settings"].pop(key)
    payload["settings"]["train"].pop("max_seconds")
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def library_versions() -> dict:
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "gguf": importlib.metadata.version("gguf"),
        "python": platform.python_version(),
    }
