"""Prefix caching in the block manager: content-addressed full blocks shared by reference count,
released ones kept cached and evicted least recently used first, copy-on-write after a trim.

The state machine keeps a shadow of the KV cache: every slot records the tokens its key/value was
computed from (the sequence's prefix up to and including it). After every operation each live
sequence must read its own history back, and each published block must hold the content its hash
names: nothing freed while referenced, nothing overwritten while shared or published."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from common.block_hash import ROOT, block_hash, chain_hashes
from engine.kv_cache import BlockManager, KVCacheExhausted
from engine.prefix_cache import PrefixCache

BS = 2
NUM_BLOCKS = 10


def test_block_hashes_chain_and_are_stable():
    tokens = list(range(40))
    hashes = chain_hashes(tokens, 16)
    assert len(hashes) == 2 and hashes[0] == block_hash(ROOT, tokens[:16])
    assert hashes[1] == block_hash(hashes[0], tokens[16:32]) != block_hash(ROOT, tokens[16:32])
    assert chain_hashes(tokens, 16, parent=hashes[0], first_block=1) == hashes[1:]
    assert block_hash(ROOT, [1, 2, 3]) == 0x9E9B1EAA390C12, "router and services on any machine agree"
    assert chain_hashes(tokens, 8)[1] != hashes[0], "hashes depend on the block size"
    assert all(0 <= h < 2**64 for h in hashes)


def _fill(bm: BlockManager, ledger: PrefixCache, seq: int, tokens: list[int]) -> None:
    bm.append(seq, len(tokens))
    ledger.extend(seq, tokens)


def test_released_blocks_stay_cached_and_count_as_free():
    bm = BlockManager(num_blocks=4, block_size=2)
    ledger = PrefixCache(bm)
    _fill(bm, ledger, 1, [5, 6, 7, 8, 9])  # 2 full blocks + 1 partial
    ledger.commit(1, 5)
    assert bm.num_cached == 2 and bm.num_free == 1
    hashes = chain_hashes([5, 6, 7, 8, 9], 2)
    bm.free(1)
    assert bm.num_free == 4 and bm.num_cached == 2, "released, still cached, and counted as free"
    assert bm.cached_prefix(hashes) == 2 and bm.cached_prefix(chain_hashes([5, 6, 0, 0], 2)) == 1
    assert bm.blocks_needed({2: (4, 5)}, attach={2: hashes}) == 3, "2 cached blocks leave the pool + 1 new"
    ledger.attach(2, hashes)
    assert bm.length(2) == 4 and bm.num_free == 2
    bm.check_invariants()


def test_eviction_takes_free_blocks_first_then_the_least_recently_released_tail_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    ledger = PrefixCache(bm)
    a, b = [1, 1, 2, 2], [3, 3, 4, 4]
    for seq, tokens in ((1, a), (2, b)):
        _fill(bm, ledger, seq, tokens)
        ledger.commit(seq, 4)
    bm.free(1)
    bm.free(2)  # LRU: a's blocks (tail first), then b's
    _fill(bm, ledger, 3, [0] * 4)  # the 2 truly free blocks: nothing evicted
    assert bm.evictions == 0 and bm.cached_prefix(chain_hashes(a, 2)) == 2
    _fill(bm, ledger, 3, [0])  # one more: evicts a's tail block, its head survives
    assert bm.evictions == 1 and bm.cached_prefix(chain_hashes(a, 2)) == 1
    assert bm.cached_prefix(chain_hashes(b, 2)) == 2
    bm.check_invariants()


def test_attached_blocks_are_never_evicted_and_trimming_frees_no_shared_block():
    bm = BlockManager(num_blocks=4, block_size=2)
    ledger = PrefixCache(bm)
    _fill(bm, ledger, 1, [1, 2, 3, 4])
    ledger.commit(1, 4)
    hashes = chain_hashes([1, 2, 3, 4], 2)
    ledger.attach(2, hashes)
    bm.free(1)
    assert bm.num_free == 2, "seq 2 still holds both"
    bm.trim(2, 1)  # a rollback into the attached blocks: block 1 goes back to the cache, block 0 stays held
    assert bm.num_free == 3 and bm.cached_prefix(hashes) == 2
    with pytest.raises(KVCacheExhausted):
        bm.append(3, 7)  # 4 blocks: the one seq 2 holds cannot be evicted
    bm.check_invariants()


def test_appending_into_a_shared_published_block_copies_it_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    ledger = PrefixCache(bm)
    _fill(bm, ledger, 1, [1, 2, 3, 4])
    ledger.commit(1, 4)
    hashes = chain_hashes([1, 2, 3, 4], 2)
    ledger.attach(2, hashes)
    shared = bm.block_table(2)[1]
    bm.trim(2, 3)
    assert bm.blocks_needed({2: (3, 4)}) == 1, "the copy costs a block"
    bm.append(2, 1)
    assert bm.block_table(2)[1] != shared and bm.take_copies() == [(shared, bm.block_table(2)[1])]
    assert bm.block_table(1)[1] == shared and bm.cached_prefix(hashes) == 2, "the published block is untouched"
    bm.free(1)
    bm.trim(2, 1)
    ledger.trim(2, 1)
    bm.append(2, 1)  # into its own published block 0, held by nobody else: unpublished, no copy
    assert not bm.take_copies() and bm.cached_prefix(hashes) == 0
    bm.check_invariants()


def test_without_caching_nothing_is_published():
    bm = BlockManager(num_blocks=4, block_size=2, caching=False)
    ledger = PrefixCache(bm)
    _fill(bm, ledger, 1, [1, 2, 3, 4])
    ledger.commit(1, 4)
    assert bm.num_cached == 0
    bm.free(1)
    assert bm.num_free == 4 and bm.cached_prefix(chain_hashes([1, 2, 3, 4], 2)) == 0


def test_capacity_counts_a_cached_block_two_attaches_take_once():
    bm = BlockManager(num_blocks=3, block_size=2)
    ledger = PrefixCache(bm)
    _fill(bm, ledger, 1, [1, 2])
    ledger.commit(1, 2)
    bm.free(1)
    h = chain_hashes([1, 2], 2)
    assert bm.blocks_needed({2: (2, 3), 3: (2, 3)}, attach={2: h, 3: h}) == 1 + 2


seqs = st.integers(0, 4)
tokens = st.lists(st.integers(0, 1), max_size=7)  # a 2-letter alphabet: prefixes collide often


class PrefixBlocks(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS)
        self.ledger = PrefixCache(self.bm)
        self.history: dict[int, list[int]] = {}  # the model: what each live sequence's KV must hold
        self.kv: dict[int, tuple[int, ...]] = {}  # shadow cache: slot -> the prefix its KV was computed from
        self.seen: list[list[int]] = []  # histories to attach from later

    def _write(self, seq: int, new: list[int]) -> None:
        """What ModelRunner.prepare + a forward do: copies first, then the new tokens' KV."""
        start = self.bm.length(seq)
        slots = self.bm.append(seq, len(new))
        for src, dst in self.bm.take_copies():
            for o in range(BS):
                self.kv[dst * BS + o] = self.kv.get(src * BS + o, ())
        self.ledger.extend(seq, new)
        self.history[seq] = self.history.get(seq, [])[:start] + new
        for p, slot in zip(range(start, start + len(new)), slots, strict=True):
            self.kv[slot] = tuple(self.history[seq][:p + 1])

    @rule(seq=seqs, back=st.integers(0, 6), new=tokens)
    def step(self, seq: int, back: int, new: list[int]) -> None:
        """Trim (a rejection) then append: the capacity check predicts the pool change exactly."""
        length = self.bm.length(seq)
        trim_to = max(0, length - back)
        needed = self.bm.blocks_needed({seq: (trim_to, trim_to + len(new))})
        before = self.bm.num_free
        if needed > before:
            return
        self.bm.trim(seq, trim_to)
        self.ledger.trim(seq, trim_to)
        self.history[seq] = self.history.get(seq, [])[:trim_to]
        self._write(seq, new)
        assert before - self.bm.num_free == needed

    @rule(seq=seqs, source=st.integers(0, 50), new=tokens)
    def attach(self, seq: int, source: int, new: list[int]) -> None:
        if not self.seen:
            return
        src = self.seen[source % len(self.seen)]
        hashes = chain_hashes(src, BS)
        hashes = hashes[:self.bm.cached_prefix(hashes)]
        if not hashes:
            return
        start = len(hashes) * BS
        needed = self.bm.blocks_needed({seq: (start, start + len(new))}, attach={seq: hashes})
        before = self.bm.num_free
        if needed > before:
            return
        self.ledger.attach(seq, hashes)
        self.history[seq] = src[:start]
        self._write(seq, new)
        assert before - self.bm.num_free == needed

    @rule(seq=seqs, cut=st.integers(0, 12))
    def commit(self, seq: int, cut: int) -> None:
        if seq in self.history:
            self.ledger.commit(seq, min(cut, self.bm.length(seq)))
            self.seen.append(list(self.history[seq]))

    @rule(parent=seqs, child=seqs, cut=st.integers(0, 12))
    def fork(self, parent: int, child: int, cut: int) -> None:
        if parent == child or self.bm.has(child) or parent not in self.history:
            return
        length = min(cut, self.bm.length(parent))
        try:
            copy = self.bm.fork(parent, child, length)
        except KVCacheExhausted:
            assert length % BS and self.bm.num_free == 0
            return
        self.ledger.fork(parent, child, length)
        if copy is not None:
            for o in range(BS):
                self.kv[copy[1] * BS + o] = self.kv.get(copy[0] * BS + o, ())
        self.history[child] = self.history[parent][:length]

    @rule(seq=seqs)
    def free(self, seq: int) -> None:
        self.bm.free(seq)
        self.ledger.free(seq)
        self.history.pop(seq, None)

    @invariant()
    def accounting_holds(self) -> None:
        self.bm.check_invariants()

    @invariant()
    def every_sequence_reads_its_own_history(self) -> None:
        for seq, hist in self.history.items():
            table = self.bm.block_table(seq)
            assert self.bm.length(seq) == len(hist)
            for p in range(len(hist)):
                assert self.kv.get(table[p // BS] * BS + p % BS) == tuple(hist[:p + 1]), f"seq {seq} pos {p}"

    @invariant()
    def every_published_block_holds_what_its_hash_names(self) -> None:
        for h, block in self.bm._by_hash.items():
            content = self.kv.get(block * BS + BS - 1, ())
            assert content and len(content) % BS == 0 and chain_hashes(content, BS)[-1] == h
            for o in range(BS):
                assert self.kv.get(block * BS + o) == content[:len(content) - BS + o + 1]

    def teardown(self) -> None:
        for seq in list(self.history):
            self.bm.free(seq)
        assert self.bm.num_free == NUM_BLOCKS, "a block leaked"
        self.bm.check_invariants()


TestPrefixBlocks = PrefixBlocks.TestCase
TestPrefixBlocks.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
