"""Sampling filters and seeded draws, without a model."""

from __future__ import annotations

import torch

from common.sampling import validate_sampling
from engine.sampling import SamplingSpec, filtered_probs, row_generator, sample, truncate_top


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
    a = sample(probs, [row_generator(42, 7, 0)]).item()
    assert a == sample(probs, [row_generator(42, 7, 0)]).item()
    draws = {sample(probs, [row_generator(42, p, 0)]).item() for p in range(20)}
    assert len(draws) > 10


def test_sample_follows_distribution():
    probs = torch.tensor([[0.7, 0.2, 0.1]])
    counts = torch.zeros(3)
    for i in range(4000):
        counts[sample(probs, [row_generator(1, i, 0)]).item()] += 1
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
