"""Prefix caching's beliefs (router.prefix uses them): one service's cache as the router mirrors it,
and one sequence's prefix state (which cached blocks it attaches, its history's block hashes)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from common.block_hash import ROOT, chain_hashes


@dataclass(frozen=True)
class Attach:
    """Blocks of the history a service was asked to start a sequence from (empty: none were cached)."""

    hashes: tuple[int, ...]
    tokens: int  # len(hashes) * block size: the entry's start_pos
    confirmed: bool = False  # the service took them: its cache of the sequence grew past them


@dataclass
class SeqPrefix:
    """One sequence's prefix-caching state (on router.sequence.Sequence; router.prefix plans with it)."""

    # (block size, root) -> hashes of the history's full blocks; the root is a LoRA adapter's at the target
    chains: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    planned: bool = False  # looked up since its caches were last dropped
    target: Attach | None = None
    draft: Attach | None = None
    draft_committed: int = 0  # history tokens the draft was sent: it published their full blocks
    draft_dropped: bool = False  # the draft's cache of it was reset: its mirror must forget it

    def chain(self, history: Seq[int], block_size: int, root: int = ROOT) -> list[int]:
        """The history only grows: its hashes are computed once, incrementally."""
        chain = self.chains.setdefault((block_size, root), [])
        if len(history) // block_size > len(chain):
            chain.extend(chain_hashes(history, block_size, chain[-1] if chain else root, len(chain)))
        return chain

    def reset(self) -> None:
        """Both caches were dropped (preempted, moved): plan again at the next admission."""
        self.planned, self.target, self.draft, self.draft_committed, self.draft_dropped = False, None, None, 0, False


class PrefixMirror:
    """One service's prefix cache as the router believes it: hashes held by live sequences (counted),
    and those nobody holds, least recently released first."""

    def __init__(self, block_size: int, adapted: bool = False) -> None:
        self.block_size = block_size
        self.adapted = adapted  # its service runs sequences' LoRA adapters: their blocks hash from the adapter's root
        self._refs: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._held: dict[int, list[int]] = {}  # seq_id -> leading blocks of its history the service holds

    def match(self, hashes: Seq[int]) -> int:
        n = 0
        while n < len(hashes) and (hashes[n] in self._refs or hashes[n] in self._lru):
            n += 1
        return n

    def holding(self, seq_id: int) -> int:
        return len(self._held.get(seq_id, ()))

    def hold(self, seq_id: int, hashes: Seq[int]) -> None:
        """The service holds (and has published) these leading blocks of seq_id's history."""
        held = self._held.setdefault(seq_id, [])
        for h in hashes[len(held):]:
            held.append(h)
            self._lru.pop(h, None)
            self._refs[h] = self._refs.get(h, 0) + 1

    def release(self, seq_id: int) -> None:
        """seq_id was released: blocks nobody else holds stay cached, its tail first in line for eviction
        (as the service frees a sequence's blocks last to first)."""
        for h in reversed(self._held.pop(seq_id, ())):
            n = self._refs.pop(h, 0) - 1
            if n > 0:
                self._refs[h] = n
            elif n == 0:
                self._lru[h] = None

    def drop(self, seq_id: int) -> None:
        """The service lost seq_id's cache (a restart): forget what it held."""
        self.forget(self._held.pop(seq_id, ()))

    def forget(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self._refs.pop(h, None)
            self._lru.pop(h, None)

    def fit(self, free_blocks: int) -> None:
        """The service keeps at least `free_blocks` released blocks cached (it evicts only when it runs
        out of truly free ones): believe no more than that many, the most recently released."""
        while len(self._lru) > max(0, free_blocks):
            self._lru.popitem(last=False)
