"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flattened varlen batch.

Parameter names follow the Hugging Face checkpoints, except that q/k/v and gate/up are fused
into one matmul each (fewer kernel launches; on CPU per-call overhead is what decode pays for).
See weights.py for the mapping. With tensor parallelism (engine/parallel.py) each rank builds
its share of the heads and MLP features; with one rank the layers are plain linears (engine/linear.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, BatchLayout
from engine.config import ModelConfig, RopeConfig
from engine.kv_cache import PagedKVCache
from engine.linear import Linear
from engine.lora import LoraBatch
from engine.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel


@dataclass(frozen=True)
class ForwardContext:
    """Everything one forward pass needs besides the weights; passed down, never global."""

    positions: torch.Tensor  # [T] position of each flat token
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    layout: BatchLayout | None  # None in a CUDA graph's uniform batch (engine/cuda_graphs.py)
    backend: AttentionBackend
    plan: object  # backend.plan(layout)
    kv_cache: PagedKVCache
    logits_indices: torch.Tensor | None  # [N] flat tokens whose logits are returned (forward() only)
    lora: LoraBatch | None = None  # the batch's LoRA adapters and their tokens (engine/lora.py); None: base only


@dataclass(frozen=True)
class FlatBatch:
    """One forward's inputs, flattened, as host lists: what a tensor-parallel leader sends its followers."""

    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T]
    logits_indices: list[int]  # [N]
    block_tables: list[list[int]]  # [B][W], padded with 0
    start_positions: list[int]  # [B]
    query_lens: list[int]  # [B]
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks to copy first
    adapters: list[str] = field(default_factory=list)  # [B] each sequence's LoRA adapter; empty: none


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq.float()


Angles = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, 1, head_dim]


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_positions = rope, head_dim, max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def build(self, device: torch.device) -> None:
        """Compute the float32 cos/sin tables on `device`; called once the module is materialised."""
        inv_freq = rope_inv_freq(self.rope, self.head_dim).to(device)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device=device), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def angles(self, positions: torch.Tensor) -> Angles:
        """cos and sin [T, 1, D] of each flat token's position: once per forward, shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotate(x: torch.Tensor, angles: Angles) -> torch.Tensor:
    """x [T, heads, D] rotated by its tokens' angles (the two halves of each head paired), in fp32."""
    cos, sin = angles
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    if x.dtype == torch.float32:
        return x * cos + rotated * sin
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one op: the same sums, fewer dispatches
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()  # lower precision: normalised in fp32, scaled in x's dtype (as transformers does)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp.size, cfg.num_kv_heads // tp.size
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, angles: Angles, ctx: ForwardContext) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, q | k | v]: q and k are rotated together, one pass
        if ctx.lora is not None:
            qkv = ctx.lora.add(self.layer, "qkv", x, qkv)
        qk_size, heads = self.q_size + self.kv_size, self.num_heads + self.num_kv_heads
        qk = qkv[:, :qk_size].view(-1, heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])), dim=1)
        qk = rotate(qk, angles)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, qk_size:].view(-1, self.num_kv_heads, self.head_dim)
        ctx.kv_cache.write(self.layer, k, v, ctx.slot_mapping)
        out = ctx.backend.attend(q, ctx.kv_cache.k[self.layer], ctx.kv_cache.v[self.layer], ctx.plan)
        out = out.reshape(-1, self.q_size)
        return self.o_proj(out) if ctx.lora is None else ctx.lora.add(self.layer, "o", out, self.o_proj(out))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer = layer
        self.intermediate = cfg.intermediate_size // tp.size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = RowParallelLinear(self.intermediate, cfg.hidden_size, tp)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x) if lora is None else lora.add(self.layer, "gate_up", x, self.gate_up_proj(x))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        h = nn.functional.silu(gate) * up
        return self.down_proj(h) if lora is None else lora.add(self.layer, "down", h, self.down_proj(h))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, layer, tp)

    def forward(self, x: torch.Tensor, angles: Angles, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), angles, ctx)
        return x + self.mlp(self.post_attention_layernorm(x), ctx.lora)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)


class ReducedHead(Linear):
    """An output projection over a subset of the vocabulary (a draft's most frequent tokens, as in
    FR-Spec and EAGLE-3): row i scores token token_ids[i]; every other token gets logit -inf, so
    the draft's distribution q is exactly zero there and rejection sampling stays lossless."""

    def __init__(self, hidden: int, head_vocab: int, vocab: int) -> None:
        super().__init__(hidden, head_vocab, bias=False)
        self.vocab = vocab
        self.register_buffer("token_ids", torch.zeros(head_vocab, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.widen(self.scores(x))

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """[N, head_vocab] float32: column i scores token token_ids[i] (narrow logits)."""
        return super().forward(x).float()

    def widen(self, scores: torch.Tensor) -> torch.Tensor:
        """Narrow logits -> [N, vocab], -inf where the head has no row."""
        full = scores.new_full((scores.shape[0], self.vocab), float("-inf"))
        return full.index_copy_(1, self.token_ids, scores)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = DecoderModel(cfg, max_positions, tp)
        if cfg.head_vocab_size is None:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        else:
            self.lm_head = ReducedHead(cfg.hidden_size, cfg.head_vocab_size, cfg.vocab_size)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the output projection with the input embedding; again after to_empty(), which unties."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [T] -> logits [N, vocab] (float32) for ctx.logits_indices only."""
        assert ctx.logits_indices is not None
        return self.logits(self.hidden_states(input_ids, ctx), ctx.logits_indices)

    def hidden_states(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Every layer (each writes its K/V to the cache): [T, hidden], before the final norm.
        All a tensor-parallel follower runs: only the leader needs logits."""
        x = self.model.embed_tokens(input_ids)
        angles = self.model.rotary.angles(ctx.positions)
        for layer in self.model.layers:
            x = layer(x, angles, ctx)
        return x

    def logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor, narrow: bool = False) -> torch.Tensor:
        """[N, vocab] float32; narrow, with a ReducedHead: [N, head_vocab], its columns' tokens in
        lm_head.token_ids (a draft's 8192 of 49152 columns: its draws read a sixth as much)."""
        x = self.model.norm(hidden[logits_indices])
        if narrow and isinstance(self.lm_head, ReducedHead):
            return self.lm_head.scores(x)
        return self.lm_head(x).float()
