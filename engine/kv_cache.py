"""Paged KV cache: fixed-size blocks, a block table per sequence, slot mapping, prefix caching.

A sequence of length L holds ceil(L / block_size) blocks; token at position p lives in slot
    block_table[p // block_size] * block_size + p % block_size
of the flattened cache. Blocks are only accounted here; the tensors live in PagedKVCache.

    position:     0 1 2 3 | 4 5 6 7 | 8 9
    block_table: [   7    ,    2    ,  5 ]      (block_size 4, length 10)
    slot of 9:    5 * 4 + 1 = 21

Blocks are reference-counted. fork() gives a new sequence the parent's full blocks by reference and
a private copy of its partial last block; attach() gives it cached blocks found by content hash:

    parent (length 10): [7, 2, 5]        child = fork(parent, length 9): [7, 2, 11]
                          shared ^  ^     block 11 <- copy of block 5 (positions 8..9 of it)

A full block whose tokens are final can be published under its content hash (common/block_hash.py).
A published block nobody holds stays cached: it counts as free, and allocation takes truly free
blocks first, then evicts the least recently released cached one. A shared or published block is
never written: appending into one (after a trim into it) copies it first (copy-on-write; the
caller makes the KV copies listed in `copies` before the next forward) or, when only this
sequence holds it, unpublishes it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

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
    def __init__(self, num_blocks: int, block_size: int, caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching  # False: publish() is a no-op, released blocks are simply free
        # Low ids first: a LIFO free list keeps recently used blocks hot.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks  # how many block tables hold each block
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}  # published block -> its content hash
        self._by_hash: dict[int, int] = {}  # content hash -> the one block published under it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # published, unreferenced; LRU first
        self.copies: list[tuple[int, int]] = []  # (src, dst) KV copies owed by copy-on-write appends
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: truly free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Published blocks (held or evictable)."""
        return len(self._by_hash)

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

    def cached_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a hash chain are published here."""
        n = 0
        while n < len(hashes) and hashes[n] in self._by_hash:
            n += 1
        return n

    # ---- capacity (no side effects) ----------------------------------------------------------
    def blocks_needed(self, resize: Mapping[int, tuple[int, int]],
                      attach: Mapping[int, Sequence[int]] | None = None) -> int:
        """Net blocks to take from the free pool for {seq_id: (trim_to, new_length)}. A sequence in
        `attach` drops what it holds and starts from those cached blocks (trim_to = their length).
        Trims free first (a trimmed block another sequence shares frees nothing)."""
        attach = attach or {}
        bs = self.block_size
        net = 0
        taken: set[int] = set()  # cached blocks nobody holds that an attach takes out of the pool
        for seq_id, (trim_to, new_length) in resize.items():
            table = self._tables.get(seq_id, [])
            if seq_id in attach:
                blocks = {self._by_hash[h] for h in attach[seq_id]}
                net -= sum(1 for b in table if self._refs[b] == 1 and b not in blocks)
                taken.update(b for b in blocks if self._refs[b] == 0)
                net += blocks_for(new_length, bs) - len(attach[seq_id])
                continue
            kept = min(len(table), blocks_for(trim_to, bs))
            assert blocks_for(new_length, bs) >= kept
            freed = sum(1 for b in table[kept:] if self._refs[b] == 1)
            net += blocks_for(new_length, bs) - kept - freed
            if new_length > trim_to and trim_to % bs and kept and self._refs[table[kept - 1]] > 1:
                net += 1  # appending into a shared block copies it
        return net + len(taken)

    def check_capacity(self, resize: Mapping[int, tuple[int, int]], extra: int = 0,
                       attach: Mapping[int, Sequence[int]] | None = None) -> None:
        """KVCacheExhausted unless the resizes (and attaches) plus `extra` new blocks fit."""
        needed = self.blocks_needed(resize, attach) + extra
        if needed > self.num_free:
            raise KVCacheExhausted(needed, self.num_free)

    # ---- sequences ---------------------------------------------------------------------------
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
        bs = self.block_size
        into_last = bool(num_tokens and start % bs)  # the first new token goes into the partial last block
        cow = into_last and self._refs[table[-1]] > 1
        missing = blocks_for(end, bs) - len(table)
        if missing + cow > self.num_free:
            raise KVCacheExhausted(missing + cow, self.num_free)
        if cow:
            shared = table[-1]
            table[-1] = self._take()
            self._refs[shared] -= 1  # still held by another table
            self.copies.append((shared, table[-1]))
        elif into_last and table[-1] in self._hash_of:
            self._unpublish(table[-1])  # held by this sequence only: it may change
        for _ in range(missing):
            table.append(self._take())
        self._lengths[seq_id] = end
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def fork(self, parent: int, child: int, length: int) -> tuple[int, int] | None:
        """child = parent's first `length` tokens: full blocks shared, the partial one copied.
        Returns (source block, new block) whose KV the caller must copy, or None."""
        assert child not in self._tables, f"sequence {child} exists"
        assert length <= self.length(parent), "fork past the parent's end"
        full, partial = divmod(length, self.block_size)
        if partial and not self.num_free:
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
        """Release every block of seq_id, last block first (so a prefix outlives its tail in the
        LRU). Unknown ids are ignored (idempotent)."""
        table = self._tables.pop(seq_id, None)
        self._lengths.pop(seq_id, None)
        for block in reversed(table or ()):
            self._unref(block)

    # ---- prefix caching ------------------------------------------------------------------------
    def publish(self, seq_id: int, index: int, block_hash: int) -> bool:
        """Publish block `index` of seq_id (full, its tokens final) under its content hash. False when
        caching is off or another block already holds that content (this one stays private)."""
        block = self._tables[seq_id][index]
        assert self._lengths[seq_id] >= (index + 1) * self.block_size, "only full blocks are published"
        if block in self._hash_of:
            assert self._hash_of[block] == block_hash, "a published block's content changed"
            return True
        if not self.caching or block_hash in self._by_hash:
            return False
        self._hash_of[block], self._by_hash[block_hash] = block_hash, block
        return True

    def attach(self, seq_id: int, hashes: Sequence[int]) -> None:
        """seq_id drops what it holds and starts as the cached blocks `hashes` (all published here)."""
        self.free(seq_id)
        table = [self._by_hash[h] for h in hashes]
        for block in table:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        self._tables[seq_id], self._lengths[seq_id] = table, len(table) * self.block_size

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    # ---- blocks ------------------------------------------------------------------------------
    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # evict the least recently released cached block
            block, _ = self._evictable.popitem(last=False)
            self._unpublish(block)
            self.evictions += 1
        self._refs[block] = 1
        return block

    def _unref(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def _unpublish(self, block: int) -> None:
        del self._by_hash[self._hash_of.pop(block)]

    def check_invariants(self) -> None:
        held = [b for t in self._tables.values() for b in t]
        counts = {b: held.count(b) for b in set(held)}
        assert all(self._refs[b] == n for b, n in counts.items()), "a reference count is off"
        assert all(self._refs[b] == 0 for b in range(self.num_blocks) if b not in counts), "a free block has refs"
        free, cached = set(self._free), set(self._evictable)
        assert len(self._free) == len(free), "a block is free twice"
        assert not free & set(counts) and not cached & set(counts) and not free & cached, "a block is in two states"
        assert len(counts) + len(free) + len(cached) == self.num_blocks, "a block leaked"
        assert cached <= set(self._hash_of) and not free & set(self._hash_of), "only published blocks stay cached"
        assert {b: h for h, b in self._by_hash.items()} == self._hash_of, "the hash index is inconsistent"
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
