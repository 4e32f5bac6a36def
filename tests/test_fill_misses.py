"""router.upfront.misses_worth_filling: pipelined, a decoder whose prepared branches missed its outcome
gets a plain proposal drafted before the step where the tokens it adds are worth the call's time on
the critical path. Decided by expected tokens per ms, without services."""

from __future__ import annotations

import pytest

from router.core import GREEDY, Request, SamplingParams
from router.sequence import Sequence
from router.spec_policy import AcceptanceTracker, expected_tokens
from router.speculation import Prepared
from router.step_costs import BranchCost, StepCostModel
from router.upfront import misses_worth_filling
from tests.test_spec_policy import _speculator

REPEATING = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8]  # lookup offers 9 10 11 12
FRESH = list(range(20, 32))  # lookup has nothing


def _seq(seq_id: int, history: list[int], draft_rate: float, lookup_rate: float = 0.5, hit: bool = False,
         seed: int | None = None) -> Sequence:
    sampling = GREEDY if seed is None else SamplingParams(temperature=0.8, seed=seed)
    req = Request(request_id=f"r{seq_id}", prompt_ids=history[:4], sampling=sampling, max_tokens=64)
    seq = Sequence(seq_id, req)
    seq.tokens, seq.num_prompt = list(history), 4
    seq.tracker = AcceptanceTracker.starting_at(draft_rate)
    seq.lookup_tracker = AcceptanceTracker.starting_at(lookup_rate)
    if hit:  # the pipeline prepared a proposal continuing this history
        seq.prepared = [Prepared(len(history), (), (40, 41, 42, 43))]
    return seq


def _spec(step_ms: float, per_entry_round_ms: float, per_token_ms: float = 1.0):
    """A target decode of step_ms (+per_token_ms a verified draft), and a draft costing
    per_entry_round_ms for each sequence's round."""
    spec = _speculator("host/cpu/1")
    spec.cost = StepCostModel(alpha=step_ms - per_token_ms, beta=per_token_ms)
    spec.branch_cost = BranchCost(a=0.5, b=per_entry_round_ms, c=0.05)
    return spec


def test_a_miss_at_high_acceptance_is_filled_when_the_draft_is_cheap():
    """The demo pair's case: a 15 ms step, a draft round of 1 ms; a miss would emit one token, a fill
    of four drafts at acceptance 0.9 about four. The call may take as long as it still pays for: about
    three steps' worth of tokens (4.1 against 1) for a step 4 ms longer."""
    spec = _spec(step_ms=15.0, per_entry_round_ms=1.0)
    seq = _seq(1, FRESH, draft_rate=0.9)
    fills, worth_ms = misses_worth_filling(spec, [seq])
    assert fills == [seq]
    expected = expected_tokens(0.9, 4) * 15.0 - spec.cost.step_ms(5)  # (tokens + gain) / goodput - step
    assert worth_ms == pytest.approx(expected) and worth_ms > spec.branch_cost.call_ms(4, 0)


def test_a_miss_whose_drafts_are_rarely_accepted_is_not_worth_a_dear_call():
    """SmolLM2's case: drafts accepted 0.2 of the time add 0.25 tokens to a 60 ms step, for a call
    of four 8 ms rounds."""
    spec = _spec(step_ms=60.0, per_entry_round_ms=8.0)
    assert misses_worth_filling(spec, [_seq(1, FRESH, draft_rate=0.2)])[0] == []


def test_a_hit_needs_no_fill():
    spec = _spec(step_ms=15.0, per_entry_round_ms=1.0)
    assert misses_worth_filling(spec, [_seq(1, FRESH, draft_rate=0.9, hit=True)])[0] == []


def test_a_seeded_sequence_is_left_to_wait_for_its_own_proposal():
    """Seeded sampling never takes a guessed branch and waits for a plain proposal (decode_ready)."""
    spec = _spec(step_ms=15.0, per_entry_round_ms=1.0)
    assert misses_worth_filling(spec, [_seq(1, FRESH, draft_rate=0.9, seed=7)])[0] == []


def test_a_lookup_guess_as_good_as_the_drafts_needs_no_fill():
    spec = _spec(step_ms=15.0, per_entry_round_ms=1.0)
    assert misses_worth_filling(spec, [_seq(1, REPEATING, draft_rate=0.6, lookup_rate=0.95)])[0] == []
    assert misses_worth_filling(spec, [_seq(2, REPEATING, draft_rate=0.9, lookup_rate=0.1)])[0] != []


def test_the_call_grows_with_the_misses_filled_and_the_likeliest_gains_go_first():
    """A call's time grows with every sequence it drafts for: in a large batch only the misses whose
    drafts are likely accepted pay for their rounds. 16 decoders: a 40 ms step scoring 56 tokens."""
    spec = _spec(step_ms=23.3, per_entry_round_ms=0.2, per_token_ms=0.3)
    good = [_seq(i, FRESH, draft_rate=0.9) for i in range(1, 4)]
    poor = [_seq(i, FRESH, draft_rate=0.05) for i in range(4, 7)]
    hits = [_seq(i, FRESH, draft_rate=0.9, hit=True) for i in range(7, 17)]
    chosen, _ = misses_worth_filling(spec, [*poor, *hits, *good])
    assert {s.seq_id for s in chosen} == {1, 2, 3}


def test_a_filled_miss_still_counts_as_the_pipelines_miss():
    """The hit rate measures prepared branches: a fill is drafting in sequence."""
    spec = _spec(step_ms=15.0, per_entry_round_ms=1.0)
    seq = _seq(1, FRESH, draft_rate=0.9, hit=True)
    seq.next_k = 4
    spec.from_draft.add(seq.seq_id)
    assert spec.pipeline_outcome(seq) == "hit"
    spec.filled[seq.seq_id] = "wrong"
    assert spec.pipeline_outcome(seq) == "wrong"
    spec.new_step()
    assert spec.filled == {}
