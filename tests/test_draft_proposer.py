"""The batched drafting logic on a ModelRunner, without gRPC."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from draft_service.proposer import DraftRequest, Proposer
from engine import EngineConfig, InvalidInput, ModelRunner, SeqInput
from engine.sampling import SamplingSpec
from tests.conftest import SMALL, hf_greedy, write_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(LlamaConfig(**SMALL), tmp_path_factory.mktemp("proposer"), seed=5)


@pytest.fixture(scope="module")
def shared_runner(model_dir) -> ModelRunner:
    return runner_for(model_dir)


def runner_for(model_dir, num_blocks: int = 512) -> ModelRunner:
    return ModelRunner.load(model_dir, EngineConfig(num_blocks=num_blocks, block_size=4, device="cpu",
                                                    max_batch_tokens=4096))


def toks(seed: int, n: int) -> list[int]:
    return torch.randint(0, SMALL["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("ks, guesses, forwards", [
    ([0, 0], [True, False], 1),  # nothing to draft: one forward caches the tokens
    ([1, 0, 3], [False, True, False], 3),
    ([2, 4, 1, 0], [True, False, True, True], 4),
    ([5, 2], [True, True], 6),
])
def test_rounds_are_shared_across_entries(model_dir, shared_runner, ks, guesses, forwards):
    runner = shared_runner
    calls = runner.forward_calls
    prompts = [toks(i, 6 + 3 * i) for i in range(len(ks))]
    reqs = [DraftRequest(i, 0, p, k, want_guess=g)
            for i, (p, k, g) in enumerate(zip(prompts, ks, guesses, strict=True))]
    out = Proposer(runner).propose(reqs)
    assert out.forwards == runner.forward_calls - calls == forwards
    for p, q, res in zip(prompts, reqs, out.results, strict=True):
        ref = hf_greedy(model_dir, p, q.k + 1)
        assert res.tokens == ref[:q.k]
        assert res.guess == (ref[q.k] if q.guessing else -1)
        assert res.cached_len == runner.cached_len(q.seq_id) == q.final_len
    runner.blocks.check_invariants()
    runner.release([q.seq_id for q in reqs])


def test_empirical_frequencies_match_shipped_q(model_dir):
    runner = runner_for(model_dir, num_blocks=2048)
    proposer = Proposer(runner, sparse_top_n=3)
    prompt = toks(77, 7)
    spec = lambda seed: SamplingSpec(temperature=0.3, seed=seed)  # noqa: E731  sharp enough for a 3-way split
    counts: dict[int, int] = {}
    shipped = None
    n = 0
    for call in range(3):
        reqs = [DraftRequest(s, 0, prompt, 1, spec(call * 1000 + s)) for s in range(400)]
        for res in proposer.propose(reqs).results:
            [q] = res.probs
            dist = dict(zip(q.token_ids, q.probs, strict=True))
            shipped = shipped or dist
            assert dist.keys() == shipped.keys() and res.tokens[0] in dist
            counts[res.tokens[0]] = counts.get(res.tokens[0], 0) + 1
            n += 1
        runner.release(range(400))
    assert len(shipped) == 3
    for tok, p in shipped.items():
        sigma = (p * (1 - p) / n) ** 0.5
        assert abs(counts.get(tok, 0) / n - p) < 4.5 * sigma + 1e-3, (tok, p, counts, n)


def test_validation_happens_before_any_forward(model_dir):
    runner = runner_for(model_dir, num_blocks=16)
    proposer = Proposer(runner, max_draft_tokens=4)
    proposer.sync([SeqInput(1, 0, toks(1, 9))])
    calls = runner.forward_calls
    with pytest.raises(InvalidInput, match=r"entries\[1\]\.k"):
        proposer.propose([DraftRequest(1, 9, [3], 2), DraftRequest(2, 0, [3], 5)])
    with pytest.raises(InvalidInput, match=r"entries\[0\]\.tokens"):
        proposer.propose([DraftRequest(1, 9, [], 2)])
    assert runner.forward_calls == calls and runner.cached_len(1) == 9 and not runner.blocks.has(2)
    with pytest.raises(ValueError):
        Proposer(runner, sparse_top_n=0)
