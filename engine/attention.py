"""Varlen attention over the paged KV cache, behind one small interface.

A forward pass flattens many sequences into one token dimension. Sequence b contributes
query_lens[b] new tokens at positions start_b .. start_b + query_lens[b] - 1 and, once they
are written, attends over context_lens[b] = start_b + query_lens[b] cached keys:

    flat tokens:  [ a0 a1 a2 | b0 | c0 c1 c2 c3 c4 ]      cu_seqlens_q = [0, 3, 4, 9]
    seq a: prompt chunk at start 5   keys 0..7   query i sees keys <= 5 + i
    seq b: decode at start 40        keys 0..40
    seq c: verify 1+4 at start 17    keys 0..21  query i sees keys <= 17 + i

Backends: FlashAttnBackend (flash_attn_varlen_func with block_table, CUDA; engine/flash_attention.py, which
also chooses between the two: select_backend) and TorchBackend (scaled_dot_product_attention over the gathered
blocks, anywhere; engine/torch_attention.py). Both read the same BatchLayout and the same cache layout, so tests
of one hold the other to the same contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class BatchLayout:
    """Where each sequence's tokens sit, built once per forward pass."""

    start_positions: list[int]
    query_lens: list[int]
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    block_size: int
    device: torch.device

    @property
    def context_lens(self) -> list[int]:
        return [s + q for s, q in zip(self.start_positions, self.query_lens, strict=True)]


class AttentionBackend(Protocol):
    name: str

    def plan(self, layout: BatchLayout) -> object:
        """Per-forward precomputation shared by every layer."""
        ...

    def plan_uniform(self, starts: torch.Tensor, block_tables: torch.Tensor, block_size: int, q_len: int) -> object:
        """The plan of B sequences with q_len queries each, from device tensors only (no host
        sync, fixed shapes): what a CUDA graph captures. Query i of sequence b sits at position
        starts[b] + i; keys are read through block_tables [B, W] up to W * block_size positions."""
        ...

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: object) -> torch.Tensor:
        """q: [T, heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim] -> [T, heads, head_dim]."""
        ...
