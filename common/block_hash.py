"""Content addresses of full KV blocks, computed identically by the router and both services.

A block's hash covers its token ids and, through its parent's hash, every token before it
(vLLM's block hashing), so equal hashes mean equal KV: a block's keys and values depend on
exactly those tokens at exactly those positions.

    tokens:  t0..t15 | t16..t31 | t32..t40        (block size 16)
    hashes:  h0 = H(ROOT, t0..t15)
             h1 = H(h0, t16..t31)                  the partial block has no hash
Hashes depend on the block size, so the router computes them per service geometry.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT = 0  # the parent of a sequence's first block


def adapter_root(adapter: str, weights: str = "") -> int:
    """The parent of the first block of a sequence served with a LoRA adapter ("": the base model,
    ROOT): the same tokens give other KV under another adapter, so their blocks hash apart. weights:
    a fingerprint of the adapter's files, so one loaded again under its name with other weights
    never reads the KV of the old ones."""
    if not adapter:
        return ROOT
    key = b"lora\0" + adapter.encode() + b"\0" + weights.encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """A stable 64-bit hash of (parent hash, the block's token ids); the same on every machine."""
    h = hashlib.blake2b(struct.pack(f"<Q{len(tokens)}i", parent, *tokens), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def chain_hashes(tokens: Sequence[int], block_size: int, parent: int = ROOT, first_block: int = 0) -> list[int]:
    """Hashes of the full blocks of `tokens` from block `first_block` on, chained after `parent`
    (the hash of block first_block - 1, or ROOT)."""
    assert block_size > 0
    out = []
    for start in range(first_block * block_size, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start:start + block_size])
        out.append(parent)
    return out
