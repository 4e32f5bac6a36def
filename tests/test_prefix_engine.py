"""A forward that starts from attached prefix blocks equals transformers on the whole sequence
(fp32, 1e-4): a prefix released and reused, shared while its owner still decodes, rolled back
into (copy-on-write), and evicted (a cache miss, nothing changed)."""

from __future__ import annotations

import pytest
import torch

from common.block_hash import chain_hashes
from engine import CacheMiss, EngineConfig, InvalidInput, ModelRunner, SeqInput
from tests.conftest import hf_logits

ATOL = 1e-4
BS = 4


def tokens(seed: int, n: int, vocab: int = 97) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def runner_for(model_dir, num_blocks: int = 64, caching: bool = True) -> ModelRunner:
    return ModelRunner.load(model_dir, EngineConfig(num_blocks=num_blocks, block_size=BS, device="cpu",
                                                    prefix_caching=caching))


def prefill(runner: ModelRunner, seq: int, prompt: list[int]) -> None:
    runner.forward([SeqInput(seq, 0, prompt, num_logits=0)])
    runner.commit(seq, len(prompt))


def test_attached_prefix_continues_like_the_whole_sequence(hf_checkpoint):
    _, model_dir = hf_checkpoint
    runner = runner_for(model_dir)
    system = tokens(1, 26)
    prefill(runner, 1, system + tokens(2, 9))
    runner.release([1])  # its blocks stay cached
    second = system + tokens(3, 14)
    hashes = chain_hashes(second, BS)
    assert runner.blocks.cached_prefix(hashes) == 6, "the 24 tokens of full blocks the two share"
    free = runner.blocks.num_free
    [logits] = runner.forward([SeqInput(2, 24, second[24:], num_logits=len(second) - 24, prefix=hashes[:6])])
    torch.testing.assert_close(logits, hf_logits(model_dir, second)[24:], atol=ATOL, rtol=0)
    assert free - runner.blocks.num_free == 6 + 4, "the 6 cached blocks leave the pool, 4 new ones hold the rest"


def test_prefix_shared_with_a_live_sequence_in_one_mixed_batch(hf_checkpoint):
    _, model_dir = hf_checkpoint
    runner = runner_for(model_dir)
    first = tokens(4, 33)
    prefill(runner, 1, first[:-1])
    second = first[:20] + tokens(5, 7)
    hashes = chain_hashes(second, BS)[:5]
    out1, out2 = runner.forward([SeqInput(1, 32, first[-1:]), SeqInput(2, 20, second[20:], 7, prefix=hashes)])
    torch.testing.assert_close(out1, hf_logits(model_dir, first)[-1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out2, hf_logits(model_dir, second)[20:], atol=ATOL, rtol=0)
    assert runner.blocks.block_table(2)[:5] == runner.blocks.block_table(1)[:5], "shared, not copied"


def test_rollback_into_an_attached_block_copies_it_and_leaves_the_cache_intact(hf_checkpoint):
    _, model_dir = hf_checkpoint
    runner = runner_for(model_dir)
    prompt = tokens(6, 24)
    prefill(runner, 1, prompt)
    hashes = chain_hashes(prompt, BS)
    runner.forward([SeqInput(2, 24, [5], 0, prefix=hashes)])
    other = prompt[:22] + tokens(7, 5)
    [logits] = runner.forward([SeqInput(2, 22, other[22:], 5)])  # positions 22, 23 rewritten: a private copy
    torch.testing.assert_close(logits, hf_logits(model_dir, other)[22:], atol=ATOL, rtol=0)
    runner.release([1, 2])
    [again] = runner.forward([SeqInput(3, 24, [9], 1, prefix=hashes)])
    torch.testing.assert_close(again, hf_logits(model_dir, prompt + [9])[-1:], atol=ATOL, rtol=0)


def test_evicted_prefix_is_a_cache_miss_and_changes_nothing(hf_checkpoint):
    _, model_dir = hf_checkpoint
    runner = runner_for(model_dir, num_blocks=8)
    prompt = tokens(8, 16)
    prefill(runner, 1, prompt)
    runner.release([1])
    hashes = chain_hashes(prompt, BS)
    prefill(runner, 2, tokens(9, 20))  # 4 truly free blocks, then 1 evicted: the cached tail goes first
    assert runner.blocks.cached_prefix(hashes) == 3
    free = runner.blocks.num_free
    with pytest.raises(CacheMiss) as err:
        runner.forward([SeqInput(3, 16, [1], prefix=hashes), SeqInput(2, 20, [1])])
    assert err.value.seq_ids == [3] and runner.blocks.num_free == free and not runner.blocks.has(3)
    with pytest.raises(InvalidInput, match="prefix_block_hashes"):
        runner.forward([SeqInput(3, 8, [1], prefix=hashes[:3])])
    runner.release([2])
    [logits] = runner.forward([SeqInput(3, 12, prompt[12:], 4, prefix=hashes[:3])])
    torch.testing.assert_close(logits, hf_logits(model_dir, prompt)[12:], atol=ATOL, rtol=0)


def test_without_prefix_caching_every_attach_misses(hf_checkpoint):
    _, model_dir = hf_checkpoint
    runner = runner_for(model_dir, caching=False)
    prompt = tokens(10, 12)
    prefill(runner, 1, prompt)
    with pytest.raises(CacheMiss):
        runner.forward([SeqInput(2, 12, [1], prefix=chain_hashes(prompt, BS))])
