"""bench/ties.py: a greedy divergence is a near-tie only where the float64 reference scores both
tokens within TIE_GAP of the best logit there. An exact tie is built into real weights: one output
row copied onto another token's makes their logits equal in any precision."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from bench.ties import TIE_GAP, Divergence, judge
from tests.conftest import SMALL, write_checkpoint

PROMPT = [3, 14, 15, 92, 65, 35]


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A checkpoint whose output row for token `twin` equals the one of the best token after PROMPT."""
    path = write_checkpoint(LlamaConfig(**SMALL, tie_word_embeddings=False), tmp_path_factory.mktemp("ties"), seed=3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, -1]
    order = logits.argsort(descending=True).tolist()
    best, twin, worst = order[0], order[5], order[-1]
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"][twin] = weights["lm_head.weight"][best]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path, best, twin, worst


def test_two_tokens_scoring_the_best_logit_are_a_tie(tied):
    path, best, twin, _ = tied
    (verdict,) = judge(path, [Divergence(tuple(PROMPT), (), best, twin)])
    assert verdict.tie and verdict.below_best_a == verdict.below_best_b == 0.0
    assert verdict.describe().startswith("near-tie")


def test_a_token_far_below_the_best_is_a_mismatch_and_so_is_an_answer_that_ended(tied):
    path, best, _, worst = tied
    far, ended = judge(path, [Divergence(tuple(PROMPT), (), best, worst), Divergence(tuple(PROMPT), (), best, None)])
    assert not far.tie and far.below_best_a == 0.0 and far.below_best_b > max(TIE_GAP.values())
    assert far.describe().startswith("MISMATCH")
    assert not ended.tie


def test_the_gap_allowed_is_the_rounding_of_the_dtype_both_answers_were_computed_in(tmp_path):
    """A token 0.01 below the best: a mismatch between two float32 engines, rounding in bfloat16."""
    path = write_checkpoint(LlamaConfig(**SMALL, tie_word_embeddings=False), tmp_path, seed=3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, -1]
    best, near = logits.argsort(descending=True)[:2].tolist()
    assert logits[best] > 0
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"][near] = weights["lm_head.weight"][best] * (1 - 0.01 / logits[best].item())
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    d = Divergence(tuple(PROMPT), (), best, near)
    (fp32,), (bf16,) = judge(path, [d], computed_in="float32"), judge(path, [d], computed_in="bfloat16")
    assert fp32.below_best_b == pytest.approx(0.01, rel=0.05)
    assert not fp32.tie and bf16.tie


def test_the_position_judged_is_after_the_common_prefix_of_the_two_answers(tied):
    """Scoring after the prefix, not after the prompt: the same two tokens tie only where they tie."""
    path, best, twin, _ = tied
    d = Divergence.between(PROMPT[:3], PROMPT[3:] + [best, 7], PROMPT[3:] + [twin, 7])
    assert d == Divergence(tuple(PROMPT[:3]), tuple(PROMPT[3:]), best, twin)
    assert judge(path, [d])[0].tie
    elsewhere = Divergence.between(PROMPT[:3], [best], [twin])  # after 3 tokens the two rows are not the best
    assert not judge(path, [elsewhere])[0].tie
    assert Divergence.between([1], [5, 6], [5]) == Divergence((1,), (5,), 6, None)
    assert judge(path, []) == []


def test_a_run_fails_on_mismatches_not_judged_near_ties():
    from bench.client import RequestResult
    from bench.stats import Correctness

    check = Correctness()
    check.check("(1) c=1", [RequestResult(0, 0.0, tokens=[1, 2, 3]), RequestResult(1, 0.0, tokens=[4, 5])])
    check.check("(6) c=16", [RequestResult(0, 0.0, tokens=[1, 2, 9]), RequestResult(1, 0.0, tokens=[4, 5])])
    assert check.answers == [([1, 2, 3], [1, 2, 9])]
    assert check.report()["mismatches"] == 1, "unjudged: a mismatch"
    check.mismatches[0]["verdict"] = {"tie": True}
    assert check.report()["mismatches"] == 0 and check.report()["near_ties"] == 1
