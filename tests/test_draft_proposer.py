"""The batched drafting logic on a ModelRunner, without gRPC."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import LlamaConfig

from draft_service.drafts import BranchSpec, DraftRequest
from draft_service.proposer import Proposer
from engine import EngineConfig, InvalidInput, KVCacheExhausted, ModelRunner, SeqInput
from engine.kv_cache import blocks_for
from engine.sampling import SamplingSpec
from tests.conftest import SMALL, hf_greedy, hf_logits, reduce_head, write_checkpoint


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


@pytest.mark.parametrize("ks, forwards", [
    ([0, 0], 1),  # nothing to draft: one forward caches the tokens
    ([1, 0, 3], 3),
    ([2, 4, 1, 0], 4),
    ([5, 2], 5),
])
def test_rounds_are_shared_across_entries(model_dir, shared_runner, ks, forwards):
    runner = shared_runner
    calls = runner.forward_calls
    prompts = [toks(i, 6 + 3 * i) for i in range(len(ks))]
    reqs = [DraftRequest(i, 0, p, k) for i, (p, k) in enumerate(zip(prompts, ks, strict=True))]
    out = Proposer(runner).propose(reqs)
    assert out.forwards == runner.forward_calls - calls == forwards
    for p, q, res in zip(prompts, reqs, out.results, strict=True):
        assert res.plain.drafts == (hf_greedy(model_dir, p, q.k) if q.k else [])
        assert res.cached_len == runner.cached_len(q.seq_id) == q.final_len
    runner.blocks.check_invariants()
    runner.release([q.seq_id for q in reqs])


def ranked(model_dir, history: list[int]) -> list[int]:
    """transformers' draft tokens after `history`, most likely first."""
    return hf_logits(model_dir, history)[-1].argsort(descending=True).tolist()


def test_branches_continue_each_outcome_of_the_verification_in_flight(model_dir):
    """Drafts d1..d3 are being verified; each branch (j accepted, rank r) guesses the draft's r-th
    favourite after d1..dj (never d_{j+1} itself, which a rejection rules out) and continues it greedily,
    exactly as transformers would from that history."""
    runner = runner_for(model_dir)
    prompt, d = toks(40, 11), toks(41, 3)
    runner.forward([SeqInput(7, 0, prompt[:-1], 0)])
    free = runner.blocks.num_free
    specs = [BranchSpec(0, 1), BranchSpec(0, 2), BranchSpec(1, 1), BranchSpec(3, 1), BranchSpec(3, 3)]
    calls = runner.forward_calls
    out = Proposer(runner).propose([DraftRequest(7, len(prompt) - 1, prompt[-1:] + d, 4, num_verifying=3,
                                                 branches=specs)])
    [res] = out.results
    assert out.forwards == runner.forward_calls - calls == 1 + 4
    assert res.plain.drafts == [] and len(res.branches) == len(specs)
    for spec, got in zip(specs, res.branches, strict=True):
        base = prompt + d[:spec.accepted]
        candidates = [t for t in ranked(model_dir, base) if spec.accepted == 3 or t != d[spec.accepted]]
        assert (got.accepted, got.token) == (spec.accepted, candidates[spec.rank - 1])
        assert got.drafts == hf_greedy(model_dir, base + [got.token], 4)
    assert res.cached_len == runner.cached_len(7) == len(prompt) + 3, "the verified drafts stay; branches go"
    assert runner.blocks.num_free == free - (blocks_for(len(prompt) + 3, 4) - blocks_for(len(prompt) - 1, 4))
    runner.blocks.check_invariants()


def test_each_draft_carries_the_drafts_probability_of_it_as_transformers_computes_it(model_dir):
    """Greedy: the softmax of the draft's logits at the token it picked, for the plain continuation and
    for every branch's drafts (the router learns what acceptance each confidence means)."""
    runner = runner_for(model_dir)
    prompt, d = toks(45, 9), toks(46, 2)
    out = Proposer(runner).propose([DraftRequest(1, 0, prompt, 4),
                                    DraftRequest(2, 0, prompt + d, 3, num_verifying=2,
                                                 branches=[BranchSpec(0, 2), BranchSpec(2, 1)])])
    plain, branched = out.results
    continuations = [(prompt, plain.plain)] + [(prompt + d[:b.accepted] + [b.token], b) for b in branched.branches]
    for base, got in continuations:
        assert len(got.confidence) == len(got.drafts) > 0
        for i, (tok, conf) in enumerate(zip(got.drafts, got.confidence, strict=True)):
            want = torch.softmax(hf_logits(model_dir, base + got.drafts[:i])[-1], -1)
            assert conf == pytest.approx(want[tok].item(), rel=1e-3, abs=1e-5)
            assert conf == pytest.approx(want.max().item(), rel=1e-3, abs=1e-5), "greedy: the favourite"


def test_a_reduced_head_drafts_from_its_own_columns_as_transformers_would_over_them(model_dir, tmp_path):
    """A draft whose head covers a third of the vocabulary draws from its narrow logits (8192 columns of
    SmolLM2's 49152): its drafts, branch guesses and confidences are transformers' over the head's
    tokens alone, and a sampled draft (drawn over the whole vocabulary, -inf outside the head) ships a
    q naming head tokens only."""
    keep = sorted(torch.randperm(SMALL["vocab_size"], generator=torch.Generator().manual_seed(3))[:32].tolist())
    runner = runner_for(reduce_head(model_dir, tmp_path / "reduced", keep))

    def over_head(history: list[int]) -> torch.Tensor:
        full = hf_logits(model_dir, history)[-1]
        return torch.full_like(full, float("-inf")).index_copy_(0, torch.tensor(keep), full[keep])

    def greedy(history: list[int], n: int) -> list[int]:
        out: list[int] = []
        for _ in range(n):
            out.append(int(over_head(history + out).argmax()))
        return out

    prompt, d = toks(50, 9), toks(51, 2)
    specs = [BranchSpec(0, 2), BranchSpec(2, 1)]
    plain, branched = Proposer(runner).propose([
        DraftRequest(1, 0, prompt, 4), DraftRequest(2, 0, prompt + d, 3, num_verifying=2, branches=specs)]).results
    assert plain.plain.drafts == greedy(prompt, 4)
    for spec, b in zip(specs, branched.branches, strict=True):
        base = prompt + d[:spec.accepted]
        ranked_here = [t for t in over_head(base).argsort(descending=True).tolist() if spec.accepted == 2 or t != d[0]]
        assert b.token == ranked_here[spec.rank - 1]
        assert b.drafts == greedy(base + [b.token], 3)
    for i, (tok, conf) in enumerate(zip(plain.plain.drafts, plain.plain.confidence, strict=True)):
        assert conf == pytest.approx(torch.softmax(over_head(prompt + plain.plain.drafts[:i]), -1)[tok].item(),
                                     rel=1e-3, abs=1e-5)
    [sampled] = Proposer(runner, sparse_top_n=8).propose(
        [DraftRequest(3, 0, toks(47, 8), 4, SamplingSpec(temperature=0.9, seed=11))]).results
    assert set(sampled.plain.drafts) <= set(keep)
    assert all(set(q.token_ids) <= set(keep) for q in sampled.plain.probs)
    runner.blocks.check_invariants()


def test_a_sampled_draft_carries_the_q_it_was_drawn_with(model_dir):
    runner = runner_for(model_dir)
    [res] = Proposer(runner, sparse_top_n=8).propose(
        [DraftRequest(3, 0, toks(47, 8), 4, SamplingSpec(temperature=0.9, seed=11))]).results
    for tok, q, conf in zip(res.plain.drafts, res.plain.probs, res.plain.confidence, strict=True):
        assert conf == pytest.approx(dict(zip(q.token_ids, q.probs, strict=True))[tok])


def test_plain_and_branched_entries_share_rounds(model_dir):
    runner = runner_for(model_dir)
    a, b = toks(50, 9), toks(51, 14)
    calls = runner.forward_calls
    out = Proposer(runner).propose([DraftRequest(1, 0, a, 5), DraftRequest(2, 0, b, 3, num_verifying=2,
                                                                           branches=[BranchSpec(2, 1)])])
    assert out.forwards == runner.forward_calls - calls == 1 + max(5 - 1, 3)
    assert out.results[0].plain.drafts == hf_greedy(model_dir, a, 5)
    [branch] = out.results[1].branches
    assert branch.drafts == hf_greedy(model_dir, b + [branch.token], 3) and branch.token == ranked(model_dir, b)[0]


def test_a_call_past_its_time_to_stop_returns_one_draft_per_continuation(model_dir):
    """stop_at (the router's estimate of when the step it prepares for answers) already passed: every
    continuation still gets its first draft (a plain one rides along the branches' first round: two),
    no round after that runs, and what is returned is the start of what the full call drafts; the
    cache holds exactly what cached_len says."""
    runner = runner_for(model_dir)
    a, b = toks(52, 9), toks(53, 14)
    reqs = [DraftRequest(1, 0, a, 4), DraftRequest(2, 0, b, 4, num_verifying=2,
                                                   branches=[BranchSpec(2, 1), BranchSpec(0, 1)])]
    calls = runner.forward_calls
    cut = Proposer(runner).propose(reqs, stop_at=0.0)
    assert cut.forwards == runner.forward_calls - calls == 2  # round 0, then the branches' first drafts
    plain, branched = cut.results
    assert plain.plain.drafts == hf_greedy(model_dir, a, 2)
    assert plain.cached_len == runner.cached_len(1) == len(a) + 1, "a plain continuation's last draft is not cached"
    assert [len(br.drafts) for br in branched.branches] == [1, 1]
    runner.blocks.check_invariants()
    runner.release([1, 2])
    full = Proposer(runner).propose(reqs).results
    assert full[0].plain.drafts[:2] == plain.plain.drafts and len(full[0].plain.drafts) == 4
    for whole, part in zip(full[1].branches, branched.branches, strict=True):
        assert (whole.token, whole.drafts[:1]) == (part.token, part.drafts) and len(whole.drafts) == 4


def test_a_call_with_time_to_spare_drafts_every_k(model_dir):
    runner = runner_for(model_dir)
    prompt = toks(54, 10)
    out = Proposer(runner).propose([DraftRequest(3, 0, prompt, 5)], stop_at=time.perf_counter() + 60)
    assert out.results[0].plain.drafts == hf_greedy(model_dir, prompt, 5) and out.forwards == 5


def test_rounds_stop_where_the_next_would_end_past_the_time(model_dir, monkeypatch):
    """Each round is judged by the last one's duration: with forwards slowed to ~100 ms and 350 ms to
    spare, round 0 (d1) and rounds 1 and 2 (d2, d3) end by ~300 ms, and round 3 would end at ~400: the
    call stops with 3 of its 6 drafts."""
    runner = runner_for(model_dir)
    forward = runner.forward

    def slow(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        time.sleep(0.100)
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner, "forward", slow)
    prompt = toks(55, 10)
    out = Proposer(runner).propose([DraftRequest(4, 0, prompt, 6)], stop_at=time.perf_counter() + 0.350)
    assert out.results[0].plain.drafts == hf_greedy(model_dir, prompt, 3)
    assert out.forwards == 3 and runner.cached_len(4) == len(prompt) + 2


def test_sampled_branches_ship_the_q_they_drew_from_and_reproduce(model_dir):
    runner = runner_for(model_dir)
    prompt = toks(60, 10)
    spec = SamplingSpec(temperature=0.8, seed=3)
    req = DraftRequest(9, 0, prompt, 3, spec, num_verifying=2, branches=[BranchSpec(0, 1), BranchSpec(2, 1)])
    first = Proposer(runner, sparse_top_n=8).propose([req]).results[0]
    runner.release([9])
    again = Proposer(runner, sparse_top_n=8).propose([req]).results[0]
    for got, rep in zip(first.branches, again.branches, strict=True):
        assert len(got.drafts) == len(got.probs) == 3
        assert all(t in q.token_ids for t, q in zip(got.drafts, got.probs, strict=True))
        assert got.drafts == rep.drafts and got.token == rep.token


def test_empirical_frequencies_match_shipped_q(model_dir):
    runner = runner_for(model_dir, num_blocks=2048)
    proposer = Proposer(runner, sparse_top_n=3, sparse_q_mass=1.0)
    prompt = toks(77, 7)
    spec = lambda seed: SamplingSpec(temperature=0.3, seed=seed)  # noqa: E731  sharp enough for a 3-way split
    counts: dict[int, int] = {}
    shipped = None
    n = 0
    for call in range(3):
        reqs = [DraftRequest(s, 0, prompt, 1, spec(call * 1000 + s)) for s in range(400)]
        for res in proposer.propose(reqs).results:
            [q] = res.plain.probs
            dist = dict(zip(q.token_ids, q.probs, strict=True))
            shipped = shipped or dist
            assert dist.keys() == shipped.keys() and res.plain.drafts[0] in dist
            counts[res.plain.drafts[0]] = counts.get(res.plain.drafts[0], 0) + 1
            n += 1
        runner.release(range(400))
    assert len(shipped) == 3
    for tok, p in shipped.items():
        sigma = (p * (1 - p) / n) ** 0.5
        assert abs(counts.get(tok, 0) / n - p) < 4.5 * sigma + 1e-3, (tok, p, counts, n)


def test_a_call_whose_rounds_would_exceed_the_batch_budget_is_refused_before_any_forward(model_dir):
    """A round feeds one token per continuation, branches and plain proposals together: 3 branches and
    2 plain entries are 5 rows a round against a budget of 4, though the call's own tokens (4) fit."""
    runner = ModelRunner.load(model_dir, EngineConfig(num_blocks=64, block_size=4, device="cpu", max_batch_tokens=4))
    proposer = Proposer(runner, max_draft_tokens=4)
    proposer.sync([SeqInput(1, 0, toks(1, 3))])
    calls = runner.forward_calls
    branched = DraftRequest(1, 3, [3, 4], 2, num_verifying=1,
                            branches=[BranchSpec(0, 1), BranchSpec(1, 1), BranchSpec(1, 2)])
    with pytest.raises(InvalidInput, match="5 continuations"):
        proposer.propose([branched, DraftRequest(2, 0, [5], 2), DraftRequest(3, 0, [6], 2)])
    assert runner.forward_calls == calls and runner.cached_len(1) == 3
    assert not runner.blocks.has(2) and not runner.blocks.has(3)
    assert proposer.propose([branched, DraftRequest(2, 0, [5], 2)]).forwards == 3  # 4 rows a round: fits
    # a plain proposal of one draft takes it from round 0 and feeds no round: 3 rows a round
    assert proposer.propose([branched, DraftRequest(4, 0, [5], 2), DraftRequest(5, 0, [6], 1)]).forwards == 3


def test_validation_happens_before_any_forward(model_dir):
    runner = runner_for(model_dir, num_blocks=16)
    proposer = Proposer(runner, max_draft_tokens=4)
    proposer.sync([SeqInput(1, 0, toks(1, 9))])
    calls = runner.forward_calls
    bad = [
        ([DraftRequest(1, 9, [3], 2), DraftRequest(2, 0, [3], 5)], r"entries\[1\]\.k"),
        ([DraftRequest(1, 9, [], 2)], r"entries\[0\]\.tokens"),
        ([DraftRequest(1, 9, [3, 4], 2, num_verifying=2)], r"entries\[0\]\.num_verifying"),
        ([DraftRequest(1, 9, [3, 4], 2, num_verifying=1, branches=[BranchSpec(2, 1)])], r"entries\[0\]\.branches"),
        ([DraftRequest(1, 9, [3, 4], 2, num_verifying=1, branches=[BranchSpec(0, 0)])], r"entries\[0\]\.branches"),
        ([DraftRequest(1, 9, [3, 4], 0, num_verifying=1, branches=[BranchSpec(0, 1)])], r"entries\[0\]\.k"),
    ]
    for requests, field in bad:
        with pytest.raises(InvalidInput, match=field):
            proposer.propose(requests)
    with pytest.raises(KVCacheExhausted):  # 16 blocks of 4: the forks' blocks do not fit
        proposer.propose([DraftRequest(1, 9, [3, 4], 4, num_verifying=1,
                                       branches=[BranchSpec(1, r) for r in range(1, 9)])])
    assert runner.forward_calls == calls and runner.cached_len(1) == 9 and not runner.blocks.has(2)
    runner.blocks.check_invariants()
    with pytest.raises(ValueError):
        Proposer(runner, sparse_top_n=0)
