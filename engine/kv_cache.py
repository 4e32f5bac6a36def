"""Paged KV cache: fixed-size blocks, a block table per sequence, slot mapping.

A sequence of length L holds ceil(L / block_size) blocks; token at position p lives in slot
    block_table[p // block_size] * block_size + p % block_size
of the flattened cache. Blocks are only accounted here; the tensors live in PagedKVCache.

    position:     0 1 2 3 | 4 5 6 7 | 8 9
    block_table: [   7    ,    2    ,  5 ]      (block_size 4, length 10)
    slot of 9:    5 * 4 + 1 = 21

Blocks are reference-counted: fork() gives a new sequence the parent's full blocks by reference
and a private copy of its partial last block, so branches of one history share its KV:

    parent (length 10): [7, 2, 5]        child = fork(parent, length 9): [7, 2, 11]
                          shared ^  ^     block 11 <- copy of block 5 (positions 8..9 of it)
A shared block is never written: appends only touch a sequence's private partial block or new ones.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


class KVCacheExhausted(RuntimeError):
    """Not enough free blocks for the requested growth. Raised before anything changes."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"KV cache exhausted: need {needed} more blocks, {free} free")
        self.needed = needed
        self.free = free


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Low ids first: a LIFO free list keeps recently used blocks hot.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks  # how many block tables hold each block
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_sequences(self) -> int:
        return len(self._tables)

    def sequences(self) -> list[int]:
        return list(self._tables)

    def has(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def length(self, seq_id: int) -> int:
        """Tokens cached for seq_id; 0 for an unknown sequence."""
        return self._lengths.get(seq_id, 0)

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables[seq_id]

    def blocks_needed(self, resize: Mapping[int, tuple[int, int]]) -> int:
        """Net blocks to allocate for {seq_id: (trim_to, new_length)}: trims free first (a trimmed
        block another sequence shares frees nothing)."""
        net = 0
        for seq_id, (trim_to, new_length) in resize.items():
            table = self._tables.get(seq_id, [])
            kept = min(len(table), blocks_for(trim_to, self.block_size))
            assert blocks_for(new_length, self.block_size) >= kept
            freed = sum(1 for b in table[kept:] if self._refs[b] == 1)
            net += blocks_for(new_length, self.block_size) - kept - freed
        return net

    def check_capacity(self, resize: Mapping[int, tuple[int, int]], extra: int = 0) -> None:
        """KVCacheExhausted unless the resizes plus `extra` new blocks fit."""
        needed = self.blocks_needed(resize) + extra
        if needed > self.num_free:
            raise KVCacheExhausted(needed, self.num_free)

    def trim(self, seq_id: int, length: int) -> None:
        """Drop everything cached at positions >= length (rollback after a rejection)."""
        table = self._tables.setdefault(seq_id, [])
        self._lengths.setdefault(seq_id, 0)
        assert length <= self._lengths[seq_id], "trim can only shorten"
        keep = blocks_for(length, self.block_size)
        while len(table) > keep:
            self._unref(table.pop())
        self._lengths[seq_id] = length

    def append(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow seq_id by num_tokens; returns their slots. Raises KVCacheExhausted untouched."""
        table = self._tables.setdefault(seq_id, [])
        start = self._lengths.setdefault(seq_id, 0)
        end = start + num_tokens
        missing = blocks_for(end, self.block_size) - len(table)
        if missing > len(self._free):
            raise KVCacheExhausted(missing, len(self._free))
        assert not (start % self.block_size and num_tokens and self._refs[table[-1]] > 1), \
            "writing into a shared block"
        for _ in range(missing):
            table.append(self._take())
        self._lengths[seq_id] = end
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def fork(self, parent: int, child: int, length: int) -> tuple[int, int] | None:
        """child = parent's first `length` tokens: full blocks shared, the partial one copied.
        Returns (source block, new block) whose KV the caller must copy, or None."""
        assert child not in self._tables, f"sequence {child} exists"
        assert length <= self.length(parent), "fork past the parent's end"
        full, partial = divmod(length, self.block_size)
        if partial and not self._free:
            raise KVCacheExhausted(1, 0)
        table = self._tables.get(parent, [])[:full]
        for block in table:
            self._refs[block] += 1
        copy = None
        if partial:
            copy = (self._tables[parent][full], self._take())
            table.append(copy[1])
        self._tables[child], self._lengths[child] = table, length
        return copy

    def free(self, seq_id: int) -> None:
        """Release every block of seq_id. Unknown ids are ignored (idempotent)."""
        table = self._tables.pop(seq_id, None)
        self._lengths.pop(seq_id, None)
        for block in reversed(table or ()):
            self._unref(block)

    def _take(self) -> int:
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def _unref(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)

    def check_invariants(self) -> None:
        held = [b for t in self._tables.values() for b in t]
        counts = {b: held.count(b) for b in set(held)}
        assert all(self._refs[b] == n for b, n in counts.items()), "a reference count is off"
        assert len(self._free) == len(set(self._free)), "a block is free twice"
        assert not set(held) & set(self._free), "a held block is also free"
        assert len(counts) + len(self._free) == self.num_blocks, "a block leaked"
        for seq_id, table in self._tables.items():
            assert len(table) == blocks_for(self._lengths[seq_id], self.block_size)


class PagedKVCache:
    """The K and V tensors, laid out as flash-attn's paged kernels expect:
    [num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim]. The extra last block belongs
    to no sequence: padding tokens of a CUDA graph's fixed-shape batch write their K/V there."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.scratch_block = num_blocks
        shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def copy_block(self, src: int, dst: int) -> None:
        """dst's K/V := src's, in every layer (the partial block of a fork)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store the new tokens' keys/values [T, kv_heads, head_dim] at their slots."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize
