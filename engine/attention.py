"""Varlen attention over the paged KV cache, behind one small interface.

A forward pass flattens many sequences into one token dimension. Sequence b contributes
query_lens[b] new tokens at positions start_b .. start_b + query_lens[b] - 1 and, once they
are written, attends over context_lens[b] = start_b + query_lens[b] cached keys:

    flat tokens:  [ a0 a1 a2 | b0 | c0 c1 c2 c3 c4 ]      cu_seqlens_q = [0, 3, 4, 9]
    seq a: prompt chunk at start 5   keys 0..7   query i sees keys <= 5 + i
    seq b: decode at start 40        keys 0..40
    seq c: verify 1+4 at start 17    keys 0..21  query i sees keys <= 17 + i

Backends: FlashAttnBackend (flash_attn_varlen_func with block_table, CUDA) and TorchBackend
(scaled_dot_product_attention over the gathered blocks, anywhere). Both read the same
BatchLayout and the same cache layout, so tests of one hold the other to the same contract.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

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
class _TorchPlan:
    query_index: torch.Tensor  # [B, Qmax] flat token index (padding points at token 0)
    query_valid: torch.Tensor  # [B, Qmax] bool
    key_slots: torch.Tensor  # [B, Kmax] flat slot of each key position (padding -> slot 0)
    mask: torch.Tensor  # [B, 1, Qmax, Kmax] bool, True = may attend
    uniform: bool = False  # every row has Qmax valid queries, in flat order: reshape, no boolean index


class TorchBackend:
    """Gathers each sequence's keys from its blocks into a padded batch, one SDPA per group.

    Padding every query to the batch's longest would make 16 one-token decodes pay for a
    240-token prompt chunk, so short queries (decodes, verifications) share one group and each
    long query (a prompt chunk) gets its own. A batch whose queries are all one short length (the
    draft's decode rounds, a target step verifying one k) takes plan_uniform: no padding to plan
    (0.13 -> 0.05 ms per forward of the demo draft). Where such rows share most of their blocks (a
    draft's branches, n choices of one prompt), _plan_shared reads each block once."""

    name = "torch-sdpa"
    SHORT_QUERY = 16
    SHARED_MIN_WIDTH = 8  # blocks: below it a row's own gather costs less than finding the union (demo draft)

    def __init__(self, scale: float, sliding_window: int | None = None) -> None:
        self.scale = scale
        self.sliding_window = sliding_window
        self._ranges: dict[int, torch.Tensor] = {}  # arange(n) on CPU, kept across forwards

    def _range(self, n: int, device: torch.device) -> torch.Tensor:
        """arange(n): on CPU kept (every op costs a dispatch, 4-9 us on tiny tensors, and a draft's
        forward is mostly such costs: the demo draft's went 0.65 -> 0.62 ms with this and the fused
        key slots); elsewhere made anew (a CUDA graph captures plan_uniform)."""
        if device.type != "cpu":
            return torch.arange(n, device=device)
        r = self._ranges.get(n)
        if r is None:
            r = self._ranges[n] = torch.arange(n)
        return r

    def plan(self, layout: BatchLayout) -> list[_TorchPlan]:
        lens = layout.query_lens
        if lens[0] <= self.SHORT_QUERY and lens.count(lens[0]) == len(lens):  # decodes, or verifications of one k
            if len(lens) > 1 and layout.device.type == "cpu" and (shared := self._plan_shared(layout, lens[0])):
                return shared
            starts = torch.tensor(layout.start_positions, device=layout.device)
            return self.plan_uniform(starts, layout.block_tables, layout.block_size, lens[0])
        short = [b for b, n in enumerate(lens) if n <= self.SHORT_QUERY]
        groups = ([short] if short else []) + [[b] for b, n in enumerate(lens) if n > self.SHORT_QUERY]
        offsets = [0]
        for n in layout.query_lens:
            offsets.append(offsets[-1] + n)
        return [self._plan_group(layout, g, [offsets[b] for b in g]) for g in groups]

    def _plan_group(self, layout: BatchLayout, rows: list[int], flat_offsets: list[int]) -> _TorchPlan:
        dev = layout.device
        starts = torch.tensor([layout.start_positions[b] for b in rows], device=dev)
        qlens = torch.tensor([layout.query_lens[b] for b in rows], device=dev)
        ctx = starts + qlens
        q_max, k_max = int(qlens.max()), int(ctx.max())
        offsets = torch.tensor(flat_offsets, device=dev)
        i = torch.arange(q_max, device=dev)
        query_valid = i[None, :] < qlens[:, None]
        query_index = torch.where(query_valid, offsets[:, None] + i[None, :], 0)
        j = torch.arange(k_max, device=dev)
        bs = layout.block_size
        blocks = layout.block_tables[rows].to(dev, torch.long)
        block_of_j = torch.clamp(j // bs, max=blocks.shape[1] - 1)
        key_slots = blocks[:, block_of_j] * bs + (j % bs)[None, :]
        key_slots = torch.where(j[None, :] < ctx[:, None], key_slots, 0)
        q_pos = starts[:, None] + i[None, :]  # [B, Qmax]
        mask = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < ctx[:, None, None])
        if self.sliding_window is not None:
            mask &= j[None, None, :] > q_pos[:, :, None] - self.sliding_window
        return _TorchPlan(query_index, query_valid, key_slots, mask[:, None])

    def plan_uniform(self, starts: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                     q_len: int) -> list[_TorchPlan]:
        dev, b = starts.device, starts.shape[0]
        i = self._range(q_len, dev)
        j = self._range(block_tables.shape[1] * block_size, dev)
        # key j of row r sits in block j // block_size of r's table, at offset j % block_size
        key_slots = (block_tables.long() * block_size).unsqueeze(-1).add(self._range(block_size, dev)).view(b, -1)
        q_pos = starts[:, None] + i[None, :]
        mask = j[None, None, :] <= q_pos[:, :, None]
        if self.sliding_window is not None:
            mask &= j[None, None, :] > q_pos[:, :, None] - self.sliding_window
        query_index = self._range(b * q_len, dev).view(b, q_len)  # uniform: only its shape is read
        return [_TorchPlan(query_index, query_index >= 0, key_slots, mask[:, None], uniform=True)]

    def _plan_shared(self, layout: BatchLayout, q_len: int) -> list[_TorchPlan] | None:
        """Rows that share blocks (a draft's branches, forked from their sequence; sequences attached to one
        cached prefix) read each block once: all B * q_len queries as one row against the union of the
        rows' blocks, each query masked to its own row's positions (tree attention, as speculation trees
        are verified). None where the union is too large to pay: per row the batch gathers B * W blocks
        and scores B * W of them, shared it gathers U and scores B * U.

            row 0 table: [7 3 9]        union [3 4 7 9]      row 0 sees 7 3 9 at positions 0..47
            row 1 table: [7 3 4]        (U = 4 blocks)       row 1 sees 7 3 4, not 9
        """
        tables = layout.block_tables
        rows, width = tables.shape
        if width < self.SHARED_MIN_WIDTH:
            return None
        blocks, inverse = torch.unique(tables, return_inverse=True)
        union = blocks.numel()
        if union * (rows + 1) >= 2 * rows * width:
            return None
        bs, dev = layout.block_size, layout.device
        # index of block u in row r's table, or `width` where r has none (a position past its context);
        # padding (block 0 past a row's context) sits past it too
        first = torch.full((rows, union), width, dtype=torch.long, device=dev).scatter_reduce_(
            1, inverse.long(), self._range(width, dev).expand(rows, width), "amin")
        key_pos = (first * bs).unsqueeze(-1).add(self._range(bs, dev)).view(rows, 1, union * bs)
        q_pos = torch.tensor(layout.start_positions, device=dev)[:, None] + self._range(q_len, dev)[None, :]
        mask = key_pos <= q_pos[:, :, None]  # [rows, q_len, union * bs]
        if self.sliding_window is not None:
            mask &= key_pos > q_pos[:, :, None] - self.sliding_window
        key_slots = (blocks.long() * bs).unsqueeze(-1).add(self._range(bs, dev)).view(1, union * bs)
        query_index = self._range(rows * q_len, dev).view(1, rows * q_len)  # uniform: only its shape is read
        return [_TorchPlan(query_index, query_index >= 0, key_slots, mask.view(1, 1, rows * q_len, union * bs),
                           uniform=True)]

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: object) -> torch.Tensor:
        assert isinstance(plan, list)
        kv_heads, head_dim = k_cache.shape[-2:]
        k_flat, v_flat = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
        out = torch.empty_like(q) if len(plan) > 1 else None
        for g in plan:
            slots = g.key_slots.reshape(-1)  # index_select: ~4x faster than k_flat[key_slots] on CPU
            k = k_flat.index_select(0, slots).view(*g.key_slots.shape, kv_heads, head_dim)  # [B, Kmax, kvh, D]
            v = v_flat.index_select(0, slots).view(*g.key_slots.shape, kv_heads, head_dim)
            qb = q.reshape(*g.query_index.shape, *q.shape[1:]) if g.uniform else q[g.query_index]  # [B, Qmax, H, D]
            o = F.scaled_dot_product_attention(
                qb.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=g.mask, scale=self.scale, enable_gqa=True,
            ).transpose(1, 2)
            # row-major (b, i): the group's tokens in flat order
            o = o.reshape(-1, *o.shape[2:]) if g.uniform else o[g.query_valid]
            if out is None:
                return o
            out[g.query_index[g.query_valid]] = o
        return out


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
