"""Paged KV accounting: allocate / trim / free, the exhaustion error, no leaked blocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_cache import BlockManager, KVCacheExhausted, blocks_for


def test_append_allocates_blocks_and_maps_slots():
    bm = BlockManager(num_blocks=8, block_size=4)
    slots = bm.append(1, 6)
    table = bm.block_table(1)
    assert len(table) == 2 and bm.num_free == 6 and bm.length(1) == 6
    assert slots == [table[p // 4] * 4 + p % 4 for p in range(6)]
    assert bm.append(1, 2) == [table[1] * 4 + 2, table[1] * 4 + 3]  # fills the partial block first
    assert bm.num_free == 6


def test_trim_frees_whole_blocks_only():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.append(1, 10)  # 3 blocks
    bm.trim(1, 5)  # positions 0..4 kept -> 2 blocks
    assert bm.length(1) == 5 and len(bm.block_table(1)) == 2 and bm.num_free == 6
    bm.trim(1, 0)
    assert bm.num_free == 8 and bm.has(1)
    with pytest.raises(AssertionError):
        bm.trim(1, 3)  # cannot grow by trimming


def test_exhaustion_is_typed_and_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.append(1, 8)
    with pytest.raises(KVCacheExhausted) as err:
        bm.append(2, 5)
    assert err.value.needed == 2 and err.value.free == 1
    assert not bm.block_table(2) and bm.length(2) == 0 and bm.num_free == 1
    bm.check_invariants()


def test_capacity_check_counts_trims_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.append(1, 16)  # all 4 blocks
    bm.check_capacity({1: (4, 12)})  # trim to 1 block, grow to 3: fits
    with pytest.raises(KVCacheExhausted):
        bm.check_capacity({1: (16, 17)})
    assert bm.blocks_needed({1: (0, 1), 2: (0, 8)}) == -3 + 2


def test_free_is_idempotent():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.append(1, 5)
    bm.free(1)
    bm.free(1)
    bm.free(99)
    assert bm.num_free == 4 and not bm.has(1)


ops = st.lists(
    st.tuples(st.sampled_from(["append", "trim", "free", "reserve"]), st.integers(0, 5), st.integers(0, 40)),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 3, 4, 16]), num_blocks=st.integers(1, 24))
def test_random_operations_never_leak(ops, block_size, num_blocks):
    bm = BlockManager(num_blocks, block_size)
    model: dict[int, int] = {}  # independent reference: seq -> length
    for op, seq, n in ops:
        if op == "append":
            before = bm.num_free
            try:
                bm.append(seq, n)
                model[seq] = model.get(seq, 0) + n
            except KVCacheExhausted:
                assert bm.num_free == before
                have = model.get(seq, 0)
                assert blocks_for(have + n, block_size) - blocks_for(have, block_size) > before
        elif op == "trim":
            length = min(n, model.get(seq, 0))
            bm.trim(seq, length)
            model[seq] = length
        elif op == "free":
            bm.free(seq)
            model.pop(seq, None)
        else:
            needed = bm.blocks_needed({seq: (min(n, model.get(seq, 0)), min(n, model.get(seq, 0)) + n)})
            try:
                bm.check_capacity({seq: (min(n, model.get(seq, 0)), min(n, model.get(seq, 0)) + n)})
                assert needed <= bm.num_free
            except KVCacheExhausted:
                assert needed > bm.num_free
        bm.check_invariants()
        for s, length in model.items():
            assert bm.length(s) == length
        assert bm.num_free == num_blocks - sum(blocks_for(v, block_size) for v in model.values())
    for s in list(model):
        bm.free(s)
    assert bm.num_free == num_blocks


# ---- forks: branches sharing a history ---------------------------------------------------------
def test_fork_shares_full_blocks_and_copies_the_partial_one():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.append(1, 10)  # blocks for 0..3, 4..7, 8..9
    parent = bm.block_table(1)
    copy = bm.fork(1, 2, 9)
    child = bm.block_table(2)
    assert child[:2] == parent[:2] and child[2] != parent[2] and copy == (parent[2], child[2])
    assert bm.length(2) == 9 and bm.num_free == 4
    assert bm.fork(1, 3, 8) is None and bm.block_table(3) == parent[:2]  # a whole-block fork copies nothing
    bm.append(2, 4)  # the child writes into its own copy, then a new block
    bm.check_invariants()
    bm.free(1)
    assert bm.num_free == 4, "only the parent's private block returns; shared ones stay held"
    bm.free(2)
    bm.free(3)
    assert bm.num_free == 8
    bm.check_invariants()


def test_trimming_a_shared_block_frees_nothing_and_capacity_knows_it():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.append(1, 8)
    bm.fork(1, 2, 8)
    assert bm.num_free == 2
    assert bm.blocks_needed({2: (0, 12)}) == 3, "the shared blocks it trims stay with seq 1"
    bm.trim(2, 0)
    assert bm.num_free == 2 and bm.length(1) == 8
    bm.check_invariants()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "trim", "fork", "free"]), st.integers(0, 3),
                          st.integers(0, 3), st.integers(0, 12)), max_size=40))
def test_forks_never_leak_or_double_own(ops):
    bm = BlockManager(num_blocks=16, block_size=4)
    for op, a, b, n in ops:
        try:
            if op == "append":
                bm.append(a, n)
            elif op == "trim":
                bm.trim(a, min(n, bm.length(a)))
            elif op == "fork" and a != b and not bm.has(b):
                bm.fork(a, b, min(n, bm.length(a)))
            elif op == "free":
                bm.free(a)
        except KVCacheExhausted:
            pass
        except AssertionError as err:
            assert "shared block" in str(err)  # appending into a block a fork shares is refused
        bm.check_invariants()
    for seq in range(4):
        bm.free(seq)
    assert bm.num_free == 16
