"""TorchBackend: attention over the paged KV cache with PyTorch's scaled_dot_product_attention,
anywhere (CPU, and CUDA without flash-attn). It gathers each group's keys from their blocks into a
padded batch; on CPU, where the gather and the padding are most of attention's cost, it reads blocks
that rows share once (_plan_shared) and splits rows of very different contexts (_by_length).
The contract (BatchLayout, the plan/attend interface) is engine/attention.py's."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import BatchLayout


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
    (0.13 -> 0.05 ms per forward of the demo draft). On CPU two more: where such rows share most of
    their blocks (a draft's branches, n choices of one prompt) _plan_shared reads each block once,
    and short queries of very different contexts split into groups of similar context (_by_length:
    16 demo decodes of 50-1000 cached tokens 53.5 -> 16.4 ms a step, each padded to 1000 before)."""

    name = "torch-sdpa"
    SHORT_QUERY = 16
    SHARED_MIN_WIDTH = 8  # blocks: below it a row's own gather costs less than finding the union (demo draft)
    GROUP_KEYS = 512  # what one more SDPA group costs a layer, in keys a row would read instead (CPU, measured)

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

    def _each_position(self, block_starts: torch.Tensor, block_size: int) -> torch.Tensor:
        """[..., n] first slot (or position) of each block -> [..., n * block_size], every one of them."""
        return block_starts.unsqueeze(-1).add(self._range(block_size, block_starts.device)).flatten(-2)

    def plan(self, layout: BatchLayout) -> list[_TorchPlan]:
        lens = layout.query_lens
        cpu = layout.device.type == "cpu"
        short = [b for b, n in enumerate(lens) if n <= self.SHORT_QUERY]
        if len(short) == len(lens) and lens.count(lens[0]) == len(lens):  # decodes, or verifications of one k
            if len(lens) > 1 and cpu and (shared := self._plan_shared(layout, lens[0])):
                return shared
            if not cpu or len(groups := self._by_length(short, layout.context_lens)) == 1:
                starts = torch.tensor(layout.start_positions, device=layout.device)
                return self.plan_uniform(starts, layout.block_tables, layout.block_size, lens[0])
        else:
            groups = (self._by_length(short, layout.context_lens) if cpu else [short]) if short else []
            groups += [[b] for b, n in enumerate(lens) if n > self.SHORT_QUERY]
        offsets = [0]
        for n in layout.query_lens:
            offsets.append(offsets[-1] + n)
        return [self._plan_group(layout, g, [offsets[b] for b in g]) for g in groups]

    def _by_length(self, rows: list[int], context_lens: list[int]) -> list[list[int]]:
        """Short-query rows in groups of similar context, each padded to its own longest instead of the
        batch's: sorted by context, the split that reads the fewest keys (rows x their group's longest)
        counting GROUP_KEYS for each group past the first (one more gather and SDPA a layer).

            contexts  50 80 100 ... 900 1000 in one group: 16 x 1000 keys read
            in three: 7 x 250 + 5 x 600 + 4 x 1000 (+ 2 x GROUP_KEYS)
        """
        order = sorted(rows, key=lambda b: context_lens[b])
        ctx = [context_lens[b] for b in order]
        n = len(order)
        if n < 2 or n * ctx[-1] - sum(ctx) <= self.GROUP_KEYS:  # padding all told: no split could save more
            return [rows]
        best, cut = [0] + [math.inf] * n, [0] * (n + 1)
        for i in range(1, n + 1):  # best[i]: the first i rows split optimally, the last group order[j:i]
            for j in range(i):
                cost = best[j] + (i - j) * ctx[i - 1] + self.GROUP_KEYS
                if cost < best[i]:
                    best[i], cut[i] = cost, j
        groups, i = [], n
        while i:
            groups.append(sorted(order[cut[i]:i]))  # flat order within a group: one group is returned as is
            i = cut[i]
        return groups[::-1]

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
        key_slots = self._each_position(block_tables.long() * block_size, block_size)
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
        key_pos = self._each_position(first * bs, bs).view(rows, 1, union * bs)
        q_pos = torch.tensor(layout.start_positions, device=dev)[:, None] + self._range(q_len, dev)[None, :]
        mask = key_pos <= q_pos[:, :, None]  # [rows, q_len, union * bs]
        if self.sliding_window is not None:
            mask &= key_pos > q_pos[:, :, None] - self.sliding_window
        key_slots = self._each_position(blocks.long() * bs, bs).view(1, union * bs)
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
