"""flash-attn's varlen attention over the paged KV cache (CUDA only; the contract: engine/attention.py),
and the choice of backend a model runs: flash-attn where it can, else PyTorch SDPA (engine/torch_attention.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend, BatchLayout
from engine.torch_attention import TorchBackend

log = logging.getLogger(__name__)


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
