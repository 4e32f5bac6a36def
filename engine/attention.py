"""Varlen attention over the paged KV cache, behind one small interface.

A forward pass flattens many sequences into one token dimension. Sequence b contributes
query_lens[b] new tokens at positions start_b .. start_b + query_lens[b] - 1 and, once they
are written, attends over context_lens[b] = start_b + query_lens[b] cached keys:

    flat tokens:  [ a0 a1 a2 | b0 | c0 c1 c2 c3 c4 ]      cu_seqlens_q = [0, 3, 4, 9]
    seq a: prompt chunk at start 5   keys 0..7   query i sees keys <= 5 + i
    seq b: decode at start 40        keys 0..40
    seq c: verify 1+4 at start 17    keys 0..21  query i sees keys <= 17 + i

Backends: FlashAttnBackend (flash_attn_varlen_func with block_table, CUDA; here) and TorchBackend
(scaled_dot_product_attention over the gathered blocks, anywhere; engine/torch_attention.py). Both read the same
BatchLayout and the same cache layout, so tests of one hold the other to the same contract.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.torch_attention import TorchBackend

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class _FlashPlan:
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor


class FlashAttnBackend:
    """flash_attn_varlen_func reading K/V straight from the paged cache through block_table.
    flash-attn 2 requires the page (block) size to be a multiple of 256."""

    name = "flash-attn"

    def __init__(self, scale: float, sliding_window: int | None = None) -> None:
        from flash_attn import flash_attn_varlen_func  # CUDA only; import errors surface here

        self._fn = flash_attn_varlen_func
        self.scale = scale
        self.window = (sliding_window - 1, 0) if sliding_window else (-1, -1)

    def plan(self, layout: BatchLayout) -> _FlashPlan:
        if layout.block_size % 256:
            raise ValueError(f"flash-attn paged KV needs block_size % 256 == 0, got {layout.block_size}")
        dev = layout.device
        qlens = torch.tensor([0, *layout.query_lens], device=dev, dtype=torch.int32)
        klens = torch.tensor([0, *layout.context_lens], device=dev, dtype=torch.int32)
        return _FlashPlan(
            cu_seqlens_q=torch.cumsum(qlens, 0, dtype=torch.int32),
            cu_seqlens_k=torch.cumsum(klens, 0, dtype=torch.int32),
            max_seqlen_q=max(layout.query_lens),
            max_seqlen_k=max(layout.context_lens),
            block_table=layout.block_tables.to(dev, torch.int32),
        )

    def plan_uniform(self, starts: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                     q_len: int) -> _FlashPlan:
        dev, b = starts.device, starts.shape[0]
        klens = torch.cat([torch.zeros(1, dtype=torch.int32, device=dev), (starts + q_len).to(torch.int32)])
        return _FlashPlan(
            cu_seqlens_q=torch.arange(0, (b + 1) * q_len, q_len, dtype=torch.int32, device=dev),
            cu_seqlens_k=torch.cumsum(klens, 0, dtype=torch.int32),
            max_seqlen_q=q_len,
            max_seqlen_k=block_tables.shape[1] * block_size,
            block_table=block_tables,
        )

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: object) -> torch.Tensor:
        assert isinstance(plan, _FlashPlan)
        # causal with q shorter than k aligns to the bottom-right: query i sees keys <= ctx - q_len + i.
        return self._fn(
            q, k_cache, v_cache, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k,
            softmax_scale=self.scale, causal=True, window_size=self.window, block_table=plan.block_table,
        )


def flash_attn_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


FLASH_DTYPES = (torch.float16, torch.bfloat16)


def uses_flash(choice: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether select_backend picks flash-attn; ValueError for an explicit choice it cannot run.

    auto: flash-attn on CUDA when it imports and the dtype is fp16/bf16 (its kernels have no fp32)."""
    if choice == "flash":
        if device.type != "cuda":
            raise ValueError(f"--attention-backend flash needs a CUDA device, got {device}")
        if dtype not in FLASH_DTYPES:
            raise ValueError(f"--attention-backend flash runs float16 or bfloat16 only, got {dtype}: "
                             "use --dtype bfloat16, or --attention-backend torch for float32")
        return True
    if choice != "auto" or device.type != "cuda" or not flash_attn_available():
        return False
    if dtype not in FLASH_DTYPES:
        log.info("attention: PyTorch SDPA, not flash-attn: flash-attn has no %s kernels", dtype)
        return False
    return True


def select_backend(choice: str, device: torch.device, dtype: torch.dtype, scale: float,
                   sliding_window: int | None) -> AttentionBackend:
    """auto: flash-attn on CUDA when it imports and the dtype allows, else PyTorch SDPA."""
    if uses_flash(choice, device, dtype):
        return FlashAttnBackend(scale, sliding_window)
    return TorchBackend(scale, sliding_window)
