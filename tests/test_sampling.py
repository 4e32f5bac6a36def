"""Sampling filters and seeded draws, without a model."""

from __future__ import annotations

import torch

from common.sampling import validate_sampling
from engine.sampling import SamplingSpec, filtered_probs, sample, truncate_top, uniforms


def test_greedy_rows_are_one_hot_on_argmax():
    logits = torch.tensor([[0.1, 2.0, 0.3], [5.0, 1.0, 0.0]])
    probs = filtered_probs(logits, [SamplingSpec(), SamplingSpec(temperature=1.0)])
    assert probs[0].tolist() == [0.0, 1.0, 0.0]
    torch.testing.assert_close(probs[1], logits[1].softmax(-1))


def test_top_k_and_top_p_keep_the_right_sets():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top2 = filtered_probs(logits, [SamplingSpec(temperature=1.0, top_k=2)])[0]
    torch.testing.assert_close(top2, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    nucleus = filtered_probs(logits, [SamplingSpec(temperature=1.0, top_p=0.8)])[0]  # 0.5 + 0.3 reaches 0.8
    torch.testing.assert_close(nucleus, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    tiny_p = filtered_probs(logits, [SamplingSpec(temperature=1.0, top_p=0.01)])[0]
    assert tiny_p.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0]])
    cold = filtered_probs(logits, [SamplingSpec(temperature=0.5)])[0]
    torch.testing.assert_close(cold, torch.tensor([2.0, 0.0]).softmax(-1))


def test_seeded_draws_repeat_and_streams_differ():
    probs = torch.full((1, 1000), 1e-3)
    a = sample(probs, uniforms([(42, 7, 0)], "cpu")).item()
    assert a == sample(probs, uniforms([(42, 7, 0)], "cpu")).item()
    assert a != sample(probs, uniforms([(42, 7, 1)], "cpu")).item()
    draws = {sample(probs, uniforms([(42, p, 0)], "cpu")).item() for p in range(20)}
    assert len(draws) > 10


def test_sample_follows_distribution():
    probs = torch.tensor([[0.7, 0.2, 0.1]])
    picks = sample(probs.expand(4000, 3), uniforms([(1, i, 0) for i in range(4000)], "cpu"))
    counts = torch.bincount(picks, minlength=3).float()
    assert torch.allclose(counts / 4000, probs[0], atol=0.03)


def test_truncate_top_renormalises():
    ids, p = truncate_top(torch.tensor([[0.1, 0.6, 0.3]]), 2)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(p, torch.tensor([[2 / 3, 1 / 3]]))


def test_validation_names_fields():
    assert validate_sampling(0.0, 1.0, 0) == []
    problems = validate_sampling(-1.0, 1.5, -2, "sampling")
    assert len(problems) == 3 and "sampling.temperature" in problems[0] and "top_p" in problems[1]
    assert validate_sampling(float("nan"), 1.0, 0)


def test_filters_apply_only_to_rows_that_asked():
    """A request's distribution must not depend on its neighbours: an unfiltered row keeps every
    token's mass, to the last bit, when a top-k or top-p row shares its batch (issue #15: the
    float32 cumulative sum of a 50k vocabulary reaches 1.0 early and used to cut the tail)."""
    logits = torch.randn(3, 50_000, generator=torch.Generator().manual_seed(0)) * 3
    plain, top_k, top_p = SamplingSpec(temperature=1.0), SamplingSpec(temperature=1.0, top_k=40), \
        SamplingSpec(temperature=0.8, top_p=0.9)
    alone = filtered_probs(logits[:1], [plain])[0]
    assert (alone > 0).all()
    for neighbour in (top_k, top_p):
        crowded = filtered_probs(logits, [plain, neighbour, SamplingSpec()])
        assert torch.equal(crowded[0], alone), f"{(crowded[0] == 0).sum()} tokens lost their mass"
        assert torch.equal(crowded[1], filtered_probs(logits[1:2], [neighbour])[0])


def test_zero_probability_tokens_are_never_sampled():
    """Inverse CDF: a zero-mass token has an empty bucket, even at the extreme uniforms."""
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(2000, 5)
    u = torch.cat([uniforms([(3, i, 0) for i in range(1998)], "cpu"),
                   torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64)])
    picks = sample(probs, u)
    assert set(picks.tolist()) == {1, 3} and picks[-2] == 1 and picks[-1] == 3


def test_truncate_top_stops_at_the_mass_asked_for():
    """A mass cut keeps the fewest top tokens reaching it (the crossing one included), renormalised;
    rows of different shapes keep different counts."""
    probs = torch.tensor([[0.70, 0.25, 0.04, 0.01], [0.30, 0.30, 0.20, 0.20]])
    ids, q = truncate_top(probs, 4, mass=0.9)
    assert ids[0].tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(q[0], torch.tensor([0.70, 0.25, 0.0, 0.0]) / 0.95)
    torch.testing.assert_close(q[1], torch.tensor([0.30, 0.30, 0.20, 0.20]))  # 0.8 < 0.9 before the last one
    assert (truncate_top(probs, 2, mass=0.999)[1] > 0).sum(-1).tolist() == [2, 2], "at most n, whatever the mass"


def test_filters_equal_transformers_warpers_in_their_order():
    """temperature, then top-k, top-p and min-p, each as transformers' generate applies it: the kept set
    and the renormalised probabilities of Tandem's one pass equal the chain of warpers."""
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 3
    for temperature, top_k, top_p, min_p in [(1.0, 0, 1.0, 0.1), (0.7, 50, 1.0, 0.05), (1.3, 0, 0.9, 0.2),
                                             (0.9, 40, 0.8, 0.3), (1.0, 0, 1.0, 1.0)]:
        warpers = [TemperatureLogitsWarper(temperature)]
        warpers += [TopKLogitsWarper(top_k)] if top_k else []
        warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
        warpers += [MinPLogitsWarper(min_p)]
        want = LogitsProcessorList(warpers)(None, logits.clone()).softmax(-1)
        spec = SamplingSpec(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        got = filtered_probs(logits, [spec] * len(logits))
        assert torch.equal(got > 0, want > 0), (temperature, top_k, top_p, min_p)
        torch.testing.assert_close(got, want)
    assert validate_sampling(1.0, 1.0, 0, "s", min_p=1.5) == ["s.min_p must be in [0, 1], got 1.5"]
