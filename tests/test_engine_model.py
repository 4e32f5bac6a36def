"""The engine's forward equals transformers' implementation of the same checkpoint (fp32, 1e-4),
for whole prompts, chunked prompts, mixed batches and rollback."""

from __future__ import annotations

import json

import pytest
import torch

from engine import CacheMiss, EngineConfig, InvalidInput, KVCacheExhausted, ModelRunner, SeqInput
from engine.config import UnsupportedModelError
from engine.model import RMSNorm
from tests.conftest import hf_logits

ATOL = 1e-4


def tokens(seed: int, n: int, vocab: int = 97) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def runner_for(model_dir, num_blocks: int = 64, block_size: int = 4) -> ModelRunner:
    return ModelRunner.load(model_dir, EngineConfig(num_blocks=num_blocks, block_size=block_size, device="cpu"))


def test_whole_prompt(hf_checkpoint):
    _, model_dir = hf_checkpoint
    prompt = tokens(1, 37)
    [logits] = runner_for(model_dir).forward([SeqInput(1, 0, prompt, num_logits=len(prompt))])
    torch.testing.assert_close(logits, hf_logits(model_dir, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunks", [[1, 36], [5, 7, 11, 14], [16, 16, 5], [3] * 12 + [1]])
def test_prompt_in_chunks_across_calls(hf_checkpoint, chunks):
    _, model_dir = hf_checkpoint
    prompt = tokens(2, sum(chunks))
    runner = runner_for(model_dir)
    got, pos = [], 0
    for size in chunks:
        [logits] = runner.forward([SeqInput(7, pos, prompt[pos:pos + size], num_logits=size)])
        got.append(logits)
        pos += size
    torch.testing.assert_close(torch.cat(got), hf_logits(model_dir, prompt), atol=ATOL, rtol=0)
    assert runner.cached_len(7) == len(prompt)


def test_mixed_batch_chunk_verify_and_decodes(hf_checkpoint):
    """One forward: a prompt chunk starting mid-prompt, a 5-token verification query on a cached
    sequence, and single-token decodes of two others."""
    _, model_dir = hf_checkpoint
    runner = runner_for(model_dir)
    seqs = {s: tokens(10 + s, n) for s, n in [(1, 30), (2, 25), (3, 19), (4, 9)]}
    # warm-up state: seq1 has 12 of 30 prompt tokens cached; seq2 has 20 cached; 3 and 4 all but the last
    runner.forward([SeqInput(1, 0, seqs[1][:12], 0), SeqInput(2, 0, seqs[2][:20], 0),
                    SeqInput(3, 0, seqs[3][:-1], 0), SeqInput(4, 0, seqs[4][:-1], 0)])
    batch = [
        SeqInput(1, 12, seqs[1][12:], num_logits=18),
        SeqInput(2, 20, seqs[2][20:], num_logits=5),
        SeqInput(3, 18, seqs[3][-1:], num_logits=1),
        SeqInput(4, 8, seqs[4][-1:], num_logits=1),
    ]
    out = runner.forward(batch)
    for x, logits in zip(batch, out, strict=True):
        ref = hf_logits(model_dir, seqs[x.seq_id])[-x.num_logits:]
        torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0, msg=f"seq {x.seq_id}")


@pytest.mark.parametrize("q_len", [1, 5])
def test_uniform_batch_of_decodes_or_verifications(hf_checkpoint, q_len):
    """Every sequence with the same number of queries (one-token decodes, or verifications of one k):
    the attention plan without padding, over sequences of different lengths, one ending a block."""
    _, model_dir = hf_checkpoint
    runner = runner_for(model_dir)
    cached = {1: 8, 2: 13, 3: 30}  # block_size 4: sequence 1 fills two blocks exactly
    seqs = {s: tokens(40 + s, n + q_len) for s, n in cached.items()}
    runner.forward([SeqInput(s, 0, seqs[s][:n], 0) for s, n in cached.items()])
    batch = [SeqInput(s, n, seqs[s][n:], num_logits=q_len) for s, n in cached.items()]
    for x, logits in zip(batch, runner.forward(batch), strict=True):
        ref = hf_logits(model_dir, seqs[x.seq_id])[-q_len:]
        torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0, msg=f"seq {x.seq_id}")


@pytest.mark.parametrize(("fork_len", "q_len"), [(60, 1), (58, 1), (57, 3)])
def test_forks_of_one_prompt_read_its_blocks_once_and_match_transformers(hf_checkpoint, fork_len, q_len):
    """Continuations forked from one cached prompt (a draft's branches, n choices) and run as one batch
    share all their blocks but a tail (copy-on-write where the fork splits a block): the CPU attention
    reads the shared blocks once (TorchBackend._plan_shared), and every row still scores as transformers."""
    _, model_dir = hf_checkpoint
    runner = runner_for(model_dir)
    prompt = tokens(7, fork_len)
    runner.forward([SeqInput(1, 0, prompt, 0)])
    shared_plans = []
    plan_shared = runner.backend._plan_shared
    runner.backend._plan_shared = lambda *a: shared_plans.append(plan_shared(*a)) or shared_plans[-1]
    continuations = {10 + n: tokens(20 + n, q_len) for n in range(4)}
    for child in continuations:
        runner.fork(1, child, fork_len)
    batch = [SeqInput(child, fork_len, extra, num_logits=q_len) for child, extra in continuations.items()]
    for x, logits in zip(batch, runner.forward(batch), strict=True):
        ref = hf_logits(model_dir, prompt + continuations[x.seq_id])[-q_len:]
        torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0, msg=f"fork {x.seq_id}")
    assert len(shared_plans) == 1 and shared_plans[0] is not None


@pytest.mark.parametrize("q_len", [1, 3])
def test_decodes_of_very_different_contexts_run_in_groups_and_match_transformers(hf_checkpoint, q_len):
    """A few long sequences beside short ones: the CPU attention splits the batch by context
    (TorchBackend._by_length: each group padded to its own longest), and every row scores as transformers."""
    _, model_dir = hf_checkpoint
    runner = runner_for(model_dir, num_blocks=256)
    cached = {1: 9, 2: 200, 3: 12, 4: 230, 5: 14}
    seqs = {s: tokens(60 + s, n + q_len) for s, n in cached.items()}
    for s, n in cached.items():
        runner.forward([SeqInput(s, 0, seqs[s][:n], 0)])
    groups = []
    by_length = runner.backend._by_length
    runner.backend._by_length = lambda *a: groups.append(by_length(*a)) or groups[-1]
    batch = [SeqInput(s, n, seqs[s][n:], num_logits=q_len) for s, n in cached.items()]
    for x, logits in zip(batch, runner.forward(batch), strict=True):
        ref = hf_logits(model_dir, seqs[x.seq_id])[-q_len:]
        torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0, msg=f"seq {x.seq_id}")
    assert groups == [[[0, 2, 4], [1, 3]]]


def test_fp32_rms_norm_in_one_op_is_bit_identical_to_the_formula():
    """RMSNorm takes torch's rms_norm in fp32 (fewer dispatches per layer): the same numbers, bit for bit,
    as normalising in fp32 and scaling by the weight, which transformers' Llama/Qwen2 norms do."""
    gen = torch.Generator().manual_seed(0)
    for rows, dim, scale in [(1, 128, 1.0), (5, 576, 30.0), (80, 256, 1e-3), (3, 897, 1e4)]:
        norm = RMSNorm(dim, eps=1e-5)
        norm.weight.data = torch.randn(dim, generator=gen)
        x = torch.randn(rows, dim, generator=gen) * scale
        xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
        assert torch.equal(norm(x), norm.weight * xf), (rows, dim, scale)


def test_trim_and_append_different_tokens(hf_checkpoint):
    """Rollback after a rejection: cache 20 tokens, rewind to 13, append other tokens."""
    _, model_dir = hf_checkpoint
    runner = runner_for(model_dir)
    first = tokens(3, 20)
    runner.forward([SeqInput(5, 0, first, 0)])
    replacement = tokens(4, 9)
    [logits] = runner.forward([SeqInput(5, 13, replacement, num_logits=9)])
    torch.testing.assert_close(logits, hf_logits(model_dir, first[:13] + replacement)[13:], atol=ATOL, rtol=0)
    assert runner.cached_len(5) == 22


def test_logits_only_where_asked(hf_checkpoint):
    _, model_dir = hf_checkpoint
    out = runner_for(model_dir).forward([SeqInput(1, 0, tokens(5, 10), 0), SeqInput(2, 0, tokens(6, 10), 2)])
    assert [o.shape[0] for o in out] == [0, 2]


def test_errors_leave_state_untouched(hf_checkpoint):
    _, model_dir = hf_checkpoint
    runner = runner_for(model_dir, num_blocks=6, block_size=4)  # 24 token slots
    runner.forward([SeqInput(1, 0, tokens(7, 10), 0)])
    with pytest.raises(CacheMiss) as miss:
        runner.forward([SeqInput(1, 10, [3], 1), SeqInput(2, 4, [1], 1)])
    assert miss.value.seq_ids == [2]
    with pytest.raises(KVCacheExhausted):
        runner.forward([SeqInput(1, 10, [3], 1), SeqInput(3, 0, tokens(8, 13), 1)])
    with pytest.raises(InvalidInput, match="token id"):
        runner.forward([SeqInput(1, 10, [500], 1)])
    with pytest.raises(InvalidInput, match="max_model_len"):
        runner.forward([SeqInput(1, 10, tokens(9, 250), 1)])
    with pytest.raises(InvalidInput, match="empty batch"):
        runner.forward([])
    assert runner.cached_len(1) == 10 and not runner.blocks.has(3)
    runner.blocks.check_invariants()
    ok = runner.forward([SeqInput(1, 10, [3], 1)])  # still serving after bad requests
    assert ok[0].shape == (1, 97)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelRunner.load(tmp_path)


def test_reduced_vocabulary_head_scores_its_tokens_only(tmp_path):
    """A draft whose head covers 40 of 97 tokens: those logits equal the full model's, the rest are
    -inf (the draft never proposes them, and its q is exactly zero there)."""
    from tests.conftest import ARCHS, reduce_head, write_checkpoint

    full = write_checkpoint(ARCHS["llama3"](), tmp_path / "full")
    keep = sorted(torch.randperm(97, generator=torch.Generator().manual_seed(0))[:40].tolist())
    reduce_head(full, tmp_path / "reduced", keep)
    prompt = tokens(11, 23)
    [logits] = runner_for(tmp_path / "reduced").forward([SeqInput(1, 0, prompt, num_logits=len(prompt))])
    ref = hf_logits(full, prompt)
    torch.testing.assert_close(logits[:, keep], ref[:, keep], atol=ATOL, rtol=0)
    others = [t for t in range(97) if t not in keep]
    assert torch.isneginf(logits[:, others]).all()
    runner = runner_for(tmp_path / "reduced")
    [narrow] = runner.forward([SeqInput(1, 0, prompt, num_logits=len(prompt))], narrow=True)
    assert narrow.shape == (len(prompt), len(keep)) and runner.head_ids.tolist() == keep
    torch.testing.assert_close(runner.widen(narrow), logits, atol=0, rtol=0)


def test_reduced_head_with_bad_token_ids_is_refused(tmp_path):
    from tests.conftest import ARCHS, reduce_head, write_checkpoint

    full = write_checkpoint(ARCHS["llama3"](), tmp_path / "full")
    reduce_head(full, tmp_path / "dup", [3, 5, 5, 9])
    with pytest.raises(ValueError, match="distinct"):
        runner_for(tmp_path / "dup")
    reduce_head(full, tmp_path / "out", [3, 500])
    with pytest.raises(ValueError, match="outside"):
        runner_for(tmp_path / "out")
