"""Frozen configuration: the checkpoint's architecture (ModelConfig) and how to run it (EngineConfig)."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint is not a Llama-family decoder this engine implements."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None
    qk_norm: bool = False  # Qwen3: each head's q and k RMS-normalised (one weight per head dim) before RoPE
    # A draft's reduced output vocabulary (FR-Spec / EAGLE-3): its head scores only these many of
    # the vocabulary's tokens (ids in the checkpoint's lm_head.token_ids); None = the full vocabulary.
    head_vocab_size: int | None = None

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "GQA needs num_heads divisible by num_kv_heads"
        assert self.rope.rope_type in SUPPORTED_ROPE_TYPES
        if self.head_vocab_size is not None:
            if not 0 < self.head_vocab_size <= self.vocab_size:
                raise UnsupportedModelError(f"draft_vocab_size {self.head_vocab_size} not in (0, {self.vocab_size}]")
            if self.tie_word_embeddings:
                raise UnsupportedModelError("a reduced output vocabulary (draft_vocab_size) needs an untied lm_head")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a model directory needs a Hugging Face config.json")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        archs = raw.get("architectures") or []
        family = SUPPORTED_ARCHITECTURES.get(archs[0]) if archs else raw.get("model_type")
        if family not in SUPPORTED_ARCHITECTURES.values():
            named = archs[0] if archs else raw.get("model_type", "unknown")
            raise UnsupportedModelError(
                f"unsupported architecture {named!r}; Tandem's engine runs {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {raw['hidden_act']!r}; only 'silu' (SwiGLU)")
        num_heads = raw["num_attention_heads"]
        sliding = raw.get("sliding_window")
        if family in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=family,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope=_rope_from_dict(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
            sliding_window=sliding,
            qk_norm=family == "qwen3",
            head_vocab_size=raw.get("draft_vocab_size"),
        )


def _rope_from_dict(raw: dict) -> RopeConfig:
    # transformers 5 writes "rope_parameters"; older checkpoints "rope_theta" + "rope_scaling".
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """How to run a checkpoint. Built once from the CLI and checked here."""

    num_blocks: int = 512
    block_size: int = 16
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda when available
    max_model_len: int = 0  # 0: the checkpoint's max_position_embeddings
    max_batch_tokens: int = 2048
    attention_backend: str = "auto"  # auto | torch | flash
    enforce_eager: bool = False  # True: no CUDA graphs
    cuda_graph_max_batch: int = 64  # sequences in the largest captured decode/verify batch
    cuda_graph_max_query: int = 9  # tokens per sequence in it: k_max + 1
    prefix_caching: bool = True  # publish final full blocks by content hash; keep released ones cached (LRU)

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ("auto", "torch", "flash"):
            raise ValueError(f"attention_backend must be auto, torch or flash, got {self.attention_backend!r}")
        if self.max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")
        if self.cuda_graph_max_batch < 1 or self.cuda_graph_max_query < 1:
            raise ValueError("cuda_graph_max_batch and cuda_graph_max_query must be >= 1")

    @property
    def cuda_graphs(self) -> bool:
        """CUDA graphs for decode/verify steps: on CUDA unless enforce_eager."""
        return not self.enforce_eager and self.resolved_device().type == "cuda"

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return DTYPES[self.dtype]


def compute_id(device: torch.device) -> str:
    """Names the compute this process runs on: equal for two services iff they share it."""
    host = socket.gethostname()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{host}/{getattr(props, 'uuid', None) or device}"
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return f"{host}/{device.type}/{_ranges(cores)}"


def _ranges(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'"""
    runs: list[list[int]] = []
    for c in cores:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)
