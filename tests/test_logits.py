"""Logits processors without a model: each equals transformers' own processor (or OpenAI's formula),
and the k + 1 rows of a verification see exactly what one-at-a-time generation would have seen."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor, RepetitionPenaltyLogitsProcessor

from common.sampling import InvalidField, SamplingParams
from engine.logits import Context, Processors, TokenHistory, apply, unpack_masks

V = 50
PROMPT = [3, 7, 7, 9]
OUTPUT = [11, 7, 11, 11, 20]


def logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_equals_transformers():
    x = logits()
    p = Processors(repetition=1.3, prompt_len=len(PROMPT))
    want = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([PROMPT + OUTPUT]), x.clone())
    torch.testing.assert_close(apply(x, Context(p, PROMPT + OUTPUT, first_pos=9)), want)


def test_presence_and_frequency_count_output_tokens_only():
    x = logits()
    p = Processors(presence=0.5, frequency=0.25, prompt_len=len(PROMPT))
    got = apply(x, Context(p, PROMPT + OUTPUT, first_pos=9))
    want = x.clone()
    for t, n in {11: 3, 7: 1, 20: 1}.items():  # 7 and 3 in the prompt do not count
        want[0, t] -= 0.25 * n + 0.5
    torch.testing.assert_close(got, want)


def test_logit_bias_adds_and_min_tokens_holds_back_eos_and_stop_ids():
    x = logits(rows=3)
    p = Processors(bias=((4, 100.0), (5, -100.0)), min_tokens=2, held_back=(1, 2), prompt_len=4)
    # rows decide output tokens 1, 2 and 3 (first_pos = prompt 4 + 1 already generated)
    got = apply(x, Context(p, PROMPT + [10], extra=[4, 4], first_pos=5))
    assert got[0, 4] == x[0, 4] + 100 and got[0, 5] == x[0, 5] - 100
    assert got[0, 1] == float("-inf") and got[0, 2] == float("-inf")  # 1 generated < 2
    assert got[1, 1] == x[1, 1] and got[2, 2] == x[2, 2]  # 2 and 3 generated: free
    hf = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=4, min_new_tokens=2, eos_token_id=[1, 2])
    torch.testing.assert_close(hf(torch.tensor([PROMPT + [10]]), x[:1].clone())[0, :3], got[0, :3])


def test_rows_of_a_verification_see_the_drafts_before_them():
    """Row i of [history | d_1 .. d_k] equals one row computed after appending d_1 .. d_i."""
    x = logits(rows=4, seed=1)
    p = Processors(presence=0.7, frequency=0.3, repetition=1.2, prompt_len=len(PROMPT))
    drafts = [11, 30, 30]
    rows = apply(x, Context(p, PROMPT + OUTPUT, extra=drafts, first_pos=9))
    for i in range(4):
        one = apply(x[i:i + 1], Context(p, PROMPT + OUTPUT + drafts[:i], first_pos=9 + i))
        torch.testing.assert_close(rows[i:i + 1], one)


def test_masks_forbid_exactly_the_cleared_bits():
    allowed = [0, 9, 17, 49]
    bits = np.zeros(V, dtype=bool)
    bits[allowed] = True
    packed = np.packbits(bits, bitorder="little").tobytes()
    assert unpack_masks([packed], V)[0].nonzero()[0].tolist() == allowed
    assert not unpack_masks([packed[:1]], V)[0, 9:].any()  # a short mask allows nothing past its end
    got = apply(logits(), Context(None, masks=[packed]))
    assert torch.isfinite(got[0]).nonzero().squeeze(-1).tolist() == allowed


def test_untouched_without_processors_and_from_proto():
    x = logits()
    assert apply(x, Context(None)) is x
    assert Processors.from_proto(SamplingParams(temperature=0.0).to_proto(), 4, V) is None
    wire = SamplingParams(temperature=0.0, repetition_penalty=1.25, logit_bias=((3, 2.0),), min_tokens=2,
                          stop_token_ids=(9,)).to_proto(held_back=(1,))
    assert Processors.from_proto(wire, 4, V) == Processors(repetition=1.25, bias=((3, 2.0),), min_tokens=2,
                                                        held_back=(1, 9), prompt_len=4)


def test_allowed_token_ids_leave_every_other_id_out():
    x = logits(rows=2)
    got = apply(x, Context(Processors(allowed=(3, 8, 41), bias=((8, 2.0),))))
    for row in range(2):
        assert torch.isfinite(got[row]).nonzero().squeeze(-1).tolist() == [3, 8, 41]
    assert got[0, 3] == x[0, 3] and got[1, 8] == x[1, 8] + 2.0


WORDS = ((20,), (11, 30), (7, 11, 44))  # one token, two, three


def test_bad_words_equal_transformers_where_the_prompt_is_not_part_of_a_word():
    """Transformers' NoBadWordsLogitsProcessor reads the prompt too; vLLM's (and this) the output only:
    with no word's head across the prompt's end the two agree, on every prefix of the output."""
    hf = NoBadWordsLogitsProcessor([list(w) for w in WORDS])
    p = Processors(bad_words=WORDS, prompt_len=len(PROMPT))
    for end in range(len(OUTPUT) + 1):
        history = PROMPT + OUTPUT[:end]
        x = logits(seed=end)
        want = hf(torch.tensor([history]), x.clone())
        torch.testing.assert_close(apply(x, Context(p, history, first_pos=len(history))), want)
        banned = {20} | ({30} if history[-1] == 11 else set()) | ({44} if history[-2:] == [7, 11] else set())
        assert set(torch.isinf(want[0]).nonzero().squeeze(-1).tolist()) == banned


def test_bad_words_see_the_drafts_before_each_row_and_not_the_prompt():
    p = Processors(bad_words=WORDS, prompt_len=len(PROMPT))
    x = logits(rows=4, seed=2)
    history = PROMPT + [7]  # output so far: [7]
    drafts = [11, 30, 11]
    rows = apply(x, Context(p, history, extra=drafts, first_pos=len(history)))
    for i in range(4):
        one = apply(x[i:i + 1], Context(p, history + drafts[:i], first_pos=len(history) + i))
        torch.testing.assert_close(rows[i:i + 1], one)
    assert rows[1, 44] == float("-inf") and rows[1, 30] == float("-inf")  # after 7, 11: both words complete
    assert torch.isfinite(rows[2, 44]) and rows[3, 30] == float("-inf")
    prompt_only = apply(x[:1], Context(Processors(bad_words=WORDS, prompt_len=5), PROMPT + [11], first_pos=5))
    assert torch.isfinite(prompt_only[0, 30]), "a word's head in the prompt does not count"


def test_only_bad_words_of_several_tokens_need_the_history():
    assert not Processors(bad_words=((5,), (6,))).needs_history
    assert Processors(bad_words=((5,), (6, 7))).needs_history and Processors(presence=0.1).needs_history
    got = apply(logits(), Context(Processors(bad_words=((5,), (6,)), prompt_len=4), first_pos=9))
    assert torch.isinf(got[0]).nonzero().squeeze(-1).tolist() == [5, 6]


def test_allowed_and_bad_words_cross_the_wire_and_are_checked():
    wire = SamplingParams(temperature=0.0, allowed_token_ids=(2, 4), bad_words=((4,), (1, 2))).to_proto()
    assert Processors.from_proto(wire, 3, V) == Processors(allowed=(2, 4), bad_words=((4,), (1, 2)), prompt_len=3)
    with pytest.raises(InvalidField, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=(2, 4), bad_words=((2,), (4,))).check()
    with pytest.raises(InvalidField, match="allowed_token_ids"):  # min_tokens holds EOS back: nothing left
        SamplingParams(allowed_token_ids=(2,), min_tokens=1).check(held_back=(2,))
    SamplingParams(allowed_token_ids=(2,), min_tokens=1).check()
    with pytest.raises(InvalidField, match="bad_words"):
        SamplingParams(bad_words=((),)).check()
    for field, params in (("allowed_token_ids", {"allowed_token_ids": (2, V)}), ("bad_words", {"bad_words": ((V,),)}),
                          ("logit_bias", {"logit_bias": ((-1, 1.0),)})):  # the one check the services and router run
        with pytest.raises(InvalidField, match=f"{field}: token ids must be in"):
            Processors.from_proto(SamplingParams(temperature=0.0, **params).to_proto(), 3, V)


END, START = 45, 44  # think-end and think-start tokens


def test_a_thinking_budget_leaves_only_the_think_end_token_once_spent():
    """Output starting inside thinking (DeepSeek-R1): after 3 output tokens without END, END alone."""
    p = Processors(think_budget=3, think_end=END, prompt_len=len(PROMPT))
    x = logits(rows=4, seed=3)
    rows = apply(x, Context(p, PROMPT + [11], extra=[12, 13, 14], first_pos=5))
    torch.testing.assert_close(rows[:2], x[:2])  # 1 and 2 tokens of thinking before them
    for row in (2, 3):  # 3 and 4 before them: spent
        assert torch.isfinite(rows[row]).nonzero().squeeze(-1).tolist() == [END]
    ended = apply(x, Context(p, PROMPT + [11, END], extra=[12, 13, 14], first_pos=6))
    torch.testing.assert_close(ended, x, msg="thinking ended: nothing forced")
    for i in range(4):  # each row as if the drafts before it had been generated one at a time
        history = PROMPT + [11] + [12, 13, 14][:i]
        torch.testing.assert_close(rows[i:i + 1], apply(x[i:i + 1], Context(p, history, first_pos=len(history))))


def test_a_thinking_budget_counts_from_the_think_start_token_where_the_output_opens_it():
    """Qwen3: thinking only inside a block the output opens with START; budget 0 ends it at once."""
    p = Processors(think_budget=2, think_end=END, think_start=START, prompt_len=len(PROMPT))
    x = logits(rows=4, seed=4)
    rows = apply(x, Context(p, PROMPT + [11, START], extra=[12, 13, END], first_pos=6))
    torch.testing.assert_close(rows[:2], x[:2])  # 0 and 1 tokens of thinking
    assert torch.isfinite(rows[2]).nonzero().squeeze(-1).tolist() == [END]  # 2: spent
    torch.testing.assert_close(rows[3], x[3])  # after END
    torch.testing.assert_close(apply(x, Context(p, PROMPT + [11, 12], first_pos=6)), x, msg="no block opened")
    at_once = Processors(think_budget=0, think_end=END, think_start=START, prompt_len=len(PROMPT))
    got = apply(x[:1], Context(at_once, PROMPT + [START], first_pos=5))
    assert torch.isfinite(got[0]).nonzero().squeeze(-1).tolist() == [END]
    wire = SamplingParams(temperature=0.0, thinking_token_budget=2, think_tokens=(END, START)).to_proto()
    assert Processors.from_proto(wire, 4, V) == Processors(think_budget=2, think_end=END, think_start=START,
                                                        prompt_len=4)
    r1 = SamplingParams(temperature=0.0, thinking_token_budget=0, think_tokens=(END, None)).to_proto()
    assert Processors.from_proto(r1, 4, V) == Processors(think_budget=0, think_end=END, prompt_len=4)
    with pytest.raises(InvalidField, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=3).check()  # the router fills in the think tokens


def test_token_history_is_position_addressed():
    h = TokenHistory()
    h.put(1, 0, [5, 6, 7, 8])
    h.put(1, 2, [9])  # a rejection: positions >= 2 replaced
    assert h.get(1, 10) == [5, 6, 9] and h.covers(1, 3) and not h.covers(1, 4)
    h.fork(1, 2, 2)
    assert h.get(2, 10) == [5, 6]
    h.release([1, 2])
    assert not h.covers(1, 1)
