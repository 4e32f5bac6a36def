"""router.chain.lookup_beats_chaining: whether a step that the policy would chain without drafts (the
draft's proposals not worth their cost), or with drafts where a sequence has a predicted output to
follow, waits a round trip for the outcome instead, so that prompt lookup can guess from the history
it makes. Decided by expected tokens per ms, without services."""

from __future__ import annotations

from router.chain import lookup_beats_chaining
from router.core import GREEDY, Request
from router.lookup import PromptLookup
from router.sequence import Sequence
from router.spec_policy import AcceptanceTracker
from router.step_costs import StepCostModel
from tests.test_spec_policy import _speculator

REPEATING = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8]  # its suffix occurred before: lookup offers 9 10 11 12
FRESH = list(range(20, 32))  # no suffix occurred before: lookup has nothing


def _seq(seq_id: int, history: list[int], draft_rate: float, lookup_rate: float) -> Sequence:
    seq = Sequence(seq_id, Request(request_id=f"r{seq_id}", prompt_ids=history[:4], sampling=GREEDY, max_tokens=64))
    seq.tokens, seq.num_prompt = list(history), 4
    seq.tracker = AcceptanceTracker.starting_at(draft_rate)
    seq.lookup_tracker = AcceptanceTracker.starting_at(lookup_rate)
    return seq


def _spec():
    spec = _speculator("host/cpu/1")
    spec.cost = StepCostModel(alpha=60.0, beta=5.0)  # a decode 65 ms, each draft verified 5 ms more
    return spec


def test_a_chain_without_drafts_waits_for_the_outcome_where_lookup_guesses_well():
    """SmolLM2's case: the draft's drafts are rarely accepted, so the policy drafts nothing for the
    chained step; lookup's guesses are often accepted, and a round trip of 2 ms is little against the
    tokens they add to a 65 ms step."""
    spec = _spec()
    seq = _seq(1, REPEATING, draft_rate=0.2, lookup_rate=0.8)
    assert lookup_beats_chaining(spec, [seq], [0], round_trip_ms=2.0)


def test_no_lookup_offer_keeps_the_chain():
    spec = _spec()
    assert not lookup_beats_chaining(spec, [_seq(1, FRESH, draft_rate=0.2, lookup_rate=0.8)], [0], 2.0)


def test_a_chained_step_that_verifies_drafts_is_kept():
    """Waiting for lookup there cost the demo pair 7-24% of its tokens/s at c=16, for no more tokens a step."""
    spec = _spec()
    seq = _seq(1, REPEATING, draft_rate=0.2, lookup_rate=0.8)
    assert not lookup_beats_chaining(spec, [seq], [1], round_trip_ms=2.0)


def test_a_lookup_that_is_rarely_accepted_keeps_the_chain():
    spec = _spec()
    assert not lookup_beats_chaining(spec, [_seq(1, REPEATING, draft_rate=0.2, lookup_rate=0.05)], [0], 2.0)


def test_the_round_trip_is_priced():
    """The same lookup gain that pays for a 2 ms round trip does not pay for one longer than the step."""
    spec = _spec()
    seq = _seq(1, REPEATING, draft_rate=0.2, lookup_rate=0.6)
    assert lookup_beats_chaining(spec, [seq], [0], round_trip_ms=2.0)
    assert not lookup_beats_chaining(spec, [seq], [0], round_trip_ms=100.0)


def test_one_sequence_with_an_offer_can_hold_the_step_for_all():
    """The step is one: waiting for the outcome costs every sequence the round trip, and is worth it when
    the lookup tokens of those with offers outweigh that."""
    spec = _spec()
    looked = _seq(1, REPEATING, draft_rate=0.2, lookup_rate=0.9)
    others = [_seq(i, FRESH, draft_rate=0.2, lookup_rate=0.9) for i in range(2, 5)]
    assert lookup_beats_chaining(spec, [looked, *others], [0, 0, 0, 0], round_trip_ms=2.0)
    assert not lookup_beats_chaining(spec, [looked, *others], [0, 0, 0, 0], round_trip_ms=80.0)


def test_a_predicted_output_to_follow_may_hold_a_chained_step_that_verifies_drafts():
    """A sequence with a prediction (router.lookup) whose guesses are accepted far more than the draft's:
    the chained step's drafts are weighed against them (at the draft's acceptance), and lose."""
    spec = _spec()
    seq = _seq(1, REPEATING, draft_rate=0.5, lookup_rate=0.95)
    seq.lookup = PromptLookup(prediction=[9, 10, 11, 12, 13], start=len(REPEATING))
    assert spec.lookup(seq)[0] == [9, 10, 11, 12], "the prediction's start"
    assert lookup_beats_chaining(spec, [seq], [2], round_trip_ms=2.0)
    seq.lookup_tracker = AcceptanceTracker.starting_at(0.3)
    assert not lookup_beats_chaining(spec, [seq], [2], round_trip_ms=2.0), "a prediction the output left"
