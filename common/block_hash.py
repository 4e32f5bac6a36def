"""Content addresses of full KV blocks, computed identically by the router and both services.

A block's hash covers its token ids and, through its parent's hash, every token before it
(vLLM's block hashing), so equal hashes mean equal KV: a block's keys and values depend on
exactly those tokens at exactly those positions.

    tokens:  t0..t15 | t16..t31 | t32..t40        (block size 16)
    hashes:  h0 = H(ROOT, t0..t15)
             h1 = H(h0, t16..t31)                  the partial block has no hash
Hashes depend on the block size, so the router computes them per service geometry. ROOT itself is
replaced by another root for a LoRA adapter (adapter_root) and for a request's cache salt
(salted_root): blocks of the same tokens then hash apart, and no sequence can attach another's.
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


def salt_digest(salt: str, tenant: bytes = b"") -> int:
    """The 64-bit form of a request's cache_salt (vLLM's) and its tenant (an API key's digest, or b"")
    sent to the services: neither leaves the router. 0 (no salt) only for neither; a digest of 0 is 1."""
    if not salt and not tenant:
        return 0
    key = b"salt\0" + len(tenant).to_bytes(2, "little") + tenant + salt.encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") or 1


def salted_root(root: int, salt: int) -> int:
    """The parent of a salted sequence's first block: its blocks hash apart from everyone else's, so
    only requests with the same salt (and the same adapter) can attach them. salt 0: root unchanged."""
    if not salt:
        return root
    return int.from_bytes(hashlib.blake2b(struct.pack("<QQ", root, salt), digest_size=8,
                                          person=b"tandem-salt").digest(), "little")


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
