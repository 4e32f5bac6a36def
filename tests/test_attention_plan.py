"""engine/attention.py, TorchBackend: the plan of a batch whose queries are all one short length
(plan_uniform: the draft's decode rounds, a step verifying one k) attends exactly as the general plan
(_plan_group) does, padding and all, with its index tensors kept between forwards on CPU."""

from __future__ import annotations

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
