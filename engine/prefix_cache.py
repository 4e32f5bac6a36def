"""The token ids behind each sequence's cached KV, so that its full blocks can be published under
their content hash once they are final (commit), and a new sequence can start from published
blocks instead of recomputing them (attach).

A block is final when every token in it is: the service learns it from the caller (the target
after its acceptance rule, the draft from the history part of each entry). Drafts under
verification are never final, so a block holding one is never published; branches are never
committed at all.

    tokens:  t0 .. t15 | t16 .. t31 | t32 t33 d1 d2      (block size 16; d: drafts, not final)
    chain:   h0          h1                               commit(seq, 34) publishes blocks 0 and 1
"""

from __future__ import annotations

from collections.abc import Sequence

from common.block_hash import ROOT, block_hash
from engine.kv_cache import BlockManager

UNKNOWN = -1  # a token of an attached block: its KV and hash are known, its id is not needed


class PrefixCache:
    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self._tokens: dict[int, list[int]] = {}  # per sequence, position -> token id
        self._chain: dict[int, list[int]] = {}  # hashes of its leading final full blocks
        self._roots: dict[int, int] = {}  # the parent of its first block, where not ROOT (a LoRA adapter's)

    def set_root(self, seq_id: int, root: int) -> None:
        if root == ROOT:
            self._roots.pop(seq_id, None)
        else:
            self._roots[seq_id] = root

    def holds(self, hashes: Sequence[int]) -> bool:
        return self.blocks.cached_prefix(hashes) == len(hashes)

    def attach(self, seq_id: int, hashes: Sequence[int]) -> None:
        """seq_id drops what it holds and starts as these published blocks."""
        self.blocks.attach(seq_id, hashes)
        self._tokens[seq_id] = [UNKNOWN] * (len(hashes) * self.blocks.block_size)
        self._chain[seq_id] = list(hashes)

    def trim(self, seq_id: int, length: int) -> None:
        del self._tokens.setdefault(seq_id, [])[length:]
        del self._chain.setdefault(seq_id, [])[length // self.blocks.block_size:]

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        self._tokens.setdefault(seq_id, []).extend(tokens)

    def fork(self, parent: int, child: int, length: int) -> None:
        self._tokens[child] = self._tokens.get(parent, [])[:length]
        self._chain[child] = self._chain.get(parent, [])[:length // self.blocks.block_size]
        self.set_root(child, self._roots.get(parent, ROOT))

    def free(self, seq_id: int) -> None:
        self._tokens.pop(seq_id, None)
        self._chain.pop(seq_id, None)
        self._roots.pop(seq_id, None)

    def commit(self, seq_id: int, length: int) -> None:
        """Positions < length of seq_id are final: publish the full blocks below length."""
        if not self.blocks.caching or seq_id not in self._tokens:
            return
        tokens, chain, bs = self._tokens[seq_id], self._chain.setdefault(seq_id, []), self.blocks.block_size
        for i in range(len(chain), min(length, len(tokens)) // bs):
            block = tokens[i * bs:(i + 1) * bs]
            if UNKNOWN in block:  # a trim into an attached block left ids we never saw: stop the chain
                return
            chain.append(block_hash(chain[-1] if chain else self._roots.get(seq_id, ROOT), block))
            self.blocks.publish(seq_id, i, chain[-1])
