"""engine/torch_attention.py, TorchBackend: the plan of a batch whose queries are all one short length
(plan_uniform: the draft's decode rounds, a step verifying one k) attends exactly as the general plan
(_plan_group) does, padding and all, with its index tensors kept between forwards on CPU; rows that
share blocks (forks) read each shared block once (_plan_shared) and attend exactly as when each reads
its own; short-query rows of very different contexts attend in groups of similar context
(_by_length), each padded to its own longest, exactly as in one group."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.attention import BatchLayout
from engine.torch_attention import TorchBackend


def _layout(starts: list[int], q_len: int, width: int, block_size: int, seed: int) -> BatchLayout:
    g = torch.Generator().manual_seed(seed)
    tables = torch.randperm(64, generator=g)[:len(starts) * width].view(len(starts), width).to(torch.int32)
    return BatchLayout(starts, [q_len] * len(starts), tables, block_size, torch.device("cpu"))


def test_a_uniform_batch_attends_as_the_general_plan_does():
    backend, block_size, kv_heads, heads, dim = TorchBackend(scale=0.125), 4, 2, 4, 8
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(64, block_size, kv_heads, dim), torch.randn(64, block_size, kv_heads, dim)
    for seed, (starts, q_len) in enumerate([([5], 1), ([0, 9, 3], 1), ([2, 7], 3), ([11, 0, 4, 6], 2)] * 2):
        width = max(s + q_len for s in starts) // block_size + 2  # tables padded past the longest context
        layout = _layout(starts, q_len, width, block_size, seed)
        q = torch.randn(len(starts) * q_len, heads, dim)
        uniform = backend.plan(layout)
        assert uniform[0].uniform
        general = [backend._plan_group(layout, list(range(len(starts))), [b * q_len for b in range(len(starts))])]
        assert torch.equal(uniform[0].key_slots[:, :general[0].key_slots.shape[1]][general[0].mask[:, 0].any(1)],
                           general[0].key_slots[general[0].mask[:, 0].any(1)])
        out = backend.attend(q, k_cache, v_cache, uniform)
        torch.testing.assert_close(out, backend.attend(q, k_cache, v_cache, general), rtol=1e-5, atol=1e-6)


def _forked(starts: list[int], q_len: int, block_size: int, shared_blocks: int, seed: int) -> BatchLayout:
    """Rows forked from one sequence: the same first `shared_blocks` blocks, then blocks of their own
    (as a branch's copy-on-write tail), tables padded with 0 past each row's context. Block 0 comes
    first, as a fresh cache gives it to the first sequence it serves: a real block and the padding."""
    g = torch.Generator().manual_seed(seed)
    free = iter(torch.randperm(63, generator=g).add(1).tolist())
    shared = [0] + [next(free) for _ in range(shared_blocks - 1)]
    tables = []
    for start in starts:
        n = -(-(start + q_len) // block_size)
        assert n >= shared_blocks
        tables.append(shared + [next(free) for _ in range(n - shared_blocks)])
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return BatchLayout(starts, [q_len] * len(starts), padded, block_size, torch.device("cpu"))


def _general(backend: TorchBackend, layout: BatchLayout) -> list:
    rows, q_len = len(layout.query_lens), layout.query_lens[0]
    return [backend._plan_group(layout, list(range(rows)), [b * q_len for b in range(rows)])]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(("starts", "q_len"), [([80, 81, 83, 78], 1), ([76, 84, 79], 3), ([77, 77], 2)])
def test_forked_rows_read_their_shared_blocks_once_and_attend_as_each_reading_its_own(starts, q_len, window):
    backend, block_size, kv_heads, heads, dim = TorchBackend(scale=0.125, sliding_window=window), 4, 2, 4, 8
    backend.SHARED_MIN_WIDTH = 2
    torch.manual_seed(1)
    k_cache, v_cache = torch.randn(64, block_size, kv_heads, dim), torch.randn(64, block_size, kv_heads, dim)
    layout = _forked(starts, q_len, block_size, shared_blocks=19, seed=len(starts))
    q = torch.randn(len(starts) * q_len, heads, dim)
    plan = backend.plan(layout)
    union = len(set(layout.block_tables.flatten().tolist()))
    assert len(plan) == 1 and plan[0].key_slots.shape == (1, union * block_size)  # one gather of the union
    assert union < layout.block_tables.numel()
    torch.testing.assert_close(backend.attend(q, k_cache, v_cache, plan),
                               backend.attend(q, k_cache, v_cache, _general(backend, layout)), rtol=1e-5, atol=1e-6)


def test_rows_that_share_no_block_each_read_their_own():
    backend = TorchBackend(scale=0.125)
    backend.SHARED_MIN_WIDTH = 2
    layout = _layout([9, 13, 5], 1, 4, 4, seed=3)  # distinct blocks (a permutation)
    plan = backend.plan(layout)
    assert plan[0].key_slots.shape == (3, 16)


def test_short_tables_skip_the_union_even_when_forked():
    backend = TorchBackend(scale=0.125)
    layout = _forked([20, 21], 1, 4, shared_blocks=4, seed=0)
    assert layout.block_tables.shape[1] < backend.SHARED_MIN_WIDTH
    assert backend.plan(layout)[0].key_slots.shape[0] == 2


def _spread(contexts: list[int], lens: list[int], block_size: int) -> BatchLayout:
    """Rows of distinct blocks with query lengths `lens` whose contexts (start + len) are `contexts`."""
    widths = [-(-c // block_size) for c in contexts]
    free = iter(range(1, 1 + sum(widths)))
    tables = [[next(free) for _ in range(w)] + [0] * (max(widths) - w) for w in widths]
    return BatchLayout([c - n for c, n in zip(contexts, lens, strict=True)], lens,
                       torch.tensor(tables, dtype=torch.int32), block_size, torch.device("cpu"))


def _attend_both_ways(backend: TorchBackend, layout: BatchLayout, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention through backend.plan, attention with every row a group of its own) over random caches."""
    kv_heads, heads, dim = 2, 4, 8
    torch.manual_seed(seed)
    blocks = int(layout.block_tables.max()) + 1
    k_cache, v_cache = (torch.randn(blocks, layout.block_size, kv_heads, dim) for _ in range(2))
    q = torch.randn(sum(layout.query_lens), heads, dim)
    offsets = [sum(layout.query_lens[:b]) for b in range(len(layout.query_lens))]
    per_row = [backend._plan_group(layout, [b], [offsets[b]]) for b in range(len(offsets))]
    return backend.attend(q, k_cache, v_cache, backend.plan(layout)), backend.attend(q, k_cache, v_cache, per_row)


def test_rows_of_similar_context_stay_one_group():
    backend = TorchBackend(scale=0.125)
    assert backend._by_length([0, 1, 2, 3], [400, 410, 405, 420]) == [[0, 1, 2, 3]]
    assert backend._by_length([1], [30, 1000]) == [[1]]


def test_a_few_long_rows_beside_many_short_ones_get_a_group_of_their_own():
    backend = TorchBackend(scale=0.125)
    contexts = [60, 950, 70, 80, 900, 90, 100, 110, 120, 130]
    assert backend._by_length(list(range(10)), contexts) == [[0, 2, 3, 5, 6, 7, 8, 9], [1, 4]]


@pytest.mark.parametrize("seed", range(20))
def test_the_split_reads_the_fewest_keys_of_any_split_of_the_sorted_rows(seed):
    g = torch.Generator().manual_seed(seed)
    backend = TorchBackend(scale=0.125)
    n = int(torch.randint(2, 8, (1,), generator=g))
    contexts = torch.randint(1, 2000, (n,), generator=g).tolist()

    def cost(groups: list[list[int]]) -> int:
        return sum(len(gr) * max(contexts[b] for b in gr) for gr in groups) + backend.GROUP_KEYS * (len(groups) - 1)

    order = sorted(range(n), key=lambda b: contexts[b])
    splits = [[order[a:b] for a, b in zip((0, *cuts), (*cuts, n), strict=True)]
              for m in range(n) for cuts in itertools.combinations(range(1, n), m)]
    chosen = backend._by_length(list(range(n)), contexts)
    assert sorted(b for gr in chosen for b in gr) == list(range(n))
    assert cost(chosen) == min(cost(sp) for sp in splits)


@pytest.mark.parametrize("q_len", [1, 4])
def test_rows_split_by_context_attend_as_one_padded_group(q_len):
    backend = TorchBackend(scale=0.125)
    backend.GROUP_KEYS = 64
    layout = _spread([9, 300, 12, 14, 280, 10], [q_len] * 6, block_size=4)
    plan = backend.plan(layout)
    assert len(plan) == 2 and sorted(g.key_slots.shape[1] for g in plan) == [14, 300]
    torch.testing.assert_close(*_attend_both_ways(backend, layout, seed=2), rtol=1e-5, atol=1e-6)


def test_a_prompt_chunk_beside_decodes_of_very_different_contexts():
    """The general plan: the chunk in a group of its own, the decodes split by context."""
    backend = TorchBackend(scale=0.125)
    backend.GROUP_KEYS = 64
    layout = _spread([9, 300, 40, 12, 280], [1, 1, 30, 1, 1], block_size=4)
    assert len(backend.plan(layout)) == 3
    torch.testing.assert_close(*_attend_both_ways(backend, layout, seed=3), rtol=1e-5, atol=1e-6)


def test_one_group_chosen_by_the_split_keeps_the_rows_in_flat_order():
    """Padding above GROUP_KEYS but no split that saves more: one group, whose output attend() returns
    as it is, so its rows must stay in the batch's order (mixed query lengths, as a router's step)."""
    backend = TorchBackend(scale=0.125)
    backend.GROUP_KEYS = 85
    contexts = [100, 50, 60]
    assert backend._by_length([0, 1, 2], contexts) == [[0, 1, 2]]
    layout = _spread(contexts, [1, 2, 4], block_size=2)
    torch.testing.assert_close(*_attend_both_ways(backend, layout, seed=4), rtol=1e-5, atol=1e-6)
