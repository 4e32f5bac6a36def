"""engine/attention.py, TorchBackend: the plan of a batch whose queries are all one short length
(plan_uniform: the draft's decode rounds, a step verifying one k) attends exactly as the general plan
(_plan_group) does, padding and all, with its index tensors kept between forwards on CPU; rows that
share blocks (forks) read each shared block once (_plan_shared) and attend exactly as when each reads
its own."""

from __future__ import annotations

import pytest
import torch

from engine.attention import BatchLayout, TorchBackend


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
