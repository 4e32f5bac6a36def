"""router/step_results.py: a target step's answer applied to the books, without services. Results
come in the step's entry order (decodes, prompt chunks, forked siblings); each decode updates the
tracker of the proposer it verified, the spec-decode counters count what was verified and accepted,
and each decoder that wanted drafts is a pipeline hit, late, wrong or unasked."""

from __future__ import annotations

import pytest

from router.core import GREEDY, Request
from router.lookup import PromptLookup
from router.metrics import Metrics
from router.scheduler import Chunk, StepPlan
from router.sequence import Sequence
from router.step_results import StepResults
from tandem.v1 import target_pb2
from tests.test_spec_policy import _speculator


def _seq(seq_id: int, prompt: list[int]) -> Sequence:
    seq = Sequence(seq_id, Request(request_id=f"r{seq_id}", prompt_ids=prompt, sampling=GREEDY, max_tokens=64))
    seq.tokens, seq.num_prompt = list(prompt), len(prompt)
    return seq


def _books():
    spec, metrics, emitted = _speculator("host/cpu/1"), Metrics(k_max=4), []
    return spec, metrics, emitted, StepResults(spec, metrics, lambda seq, toks, lp: emitted.append((seq.seq_id, toks)))


def _value(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_results_are_applied_in_entry_order_and_count_what_was_verified():
    spec, metrics, emitted, results = _books()
    drafted, looked, prompt = _seq(1, [5, 6, 7]), _seq(2, [8, 9, 8, 9]), _seq(3, [1, 2, 3, 4])
    spec.from_lookup.add(looked.seq_id)
    plan = StepPlan(decodes=[(drafted, 3), (looked, 2)], chunks=[Chunk(prompt, 0, 4)])
    response = target_pb2.StepResponse(results=[
        target_pb2.EntryResult(seq_id=1, tokens=[10, 11], num_accepted=1, cached_len=5),
        target_pb2.EntryResult(seq_id=2, tokens=[8, 9, 4], num_accepted=2, cached_len=7),
        target_pb2.EntryResult(seq_id=3, tokens=[42], cached_len=4)])
    before = (drafted.tracker.rate, looked.tracker.rate, looked.lookup_tracker.rate)
    results.apply(plan, [[10, 12, 13], [8, 9]], response)

    assert emitted == [(1, [10, 11]), (2, [8, 9, 4]), (3, [42])]
    assert (drafted.target_cached, looked.target_cached, prompt.target_cached) == (5, 7, 4)
    assert drafted.tracker.rate < before[0], "one of three drafts accepted: the draft's tracker falls"
    assert looked.tracker.rate == before[1], "a lookup proposal is not evidence about the draft"
    assert looked.lookup_tracker.rate > before[2], "both of its guesses accepted: lookup's tracker rises"
    assert _value(metrics, "tandem:spec_decode_num_drafts_total") == 2
    assert _value(metrics, "tandem:spec_decode_num_draft_tokens_total") == 5
    assert _value(metrics, "tandem:spec_decode_num_accepted_tokens_total") == 3
    assert _value(metrics, "tandem:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 2
    assert _value(metrics, "tandem:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 1


def test_a_finished_sequence_is_counted_but_gets_no_more_tokens():
    spec, metrics, emitted, results = _books()
    done = _seq(1, [5, 6, 7])
    done.finished = True
    response = target_pb2.StepResponse(results=[target_pb2.EntryResult(seq_id=1, tokens=[3, 4], num_accepted=1,
                                                                       cached_len=5)])
    results.apply(StepPlan(decodes=[(done, 1)]), [[3]], response)
    assert emitted == [] and done.target_cached == 0
    assert _value(metrics, "tandem:spec_decode_num_accepted_tokens_total") == 1


def test_each_decoder_that_wanted_drafts_is_a_pipeline_hit_late_wrong_or_unasked():
    """late: the draft was asked for the outcome (or busy) and had not answered; unasked: the router
    asked it for nothing there (a rest, a sequence kept to lookup)."""
    spec, metrics, _, results = _books()
    hit, late, wrong, plain, on_lookup, unasked = (_seq(i, [1, 2, 3]) for i in range(1, 7))
    for seq in (hit, late, wrong, on_lookup, unasked):
        seq.next_k = 2
        seq.outcome_start = 3
    late.asked_at, unasked.asked_at = 3, 1  # unasked: the last call for it was two outcomes ago
    spec.from_draft.add(hit.seq_id)
    for seq in (late, unasked):  # nothing prepared for their outcomes when the step was planned
        spec.missed[seq.seq_id] = spec.miss_kind(seq)
    spec.from_lookup.add(on_lookup.seq_id)
    spec.lookup_over_draft.add(on_lookup.seq_id)  # the draft had one, lookup's looked better: no miss
    tries = spec.match_odds.tries
    results.count_outcomes(StepPlan(decodes=[(s, 0) for s in (hit, late, wrong, plain, on_lookup, unasked)]),
                           draft_up=True)

    assert _value(metrics, "tandem:pipeline_lookups_total") == 4
    assert _value(metrics, "tandem:pipeline_hits_total") == 1
    assert _value(metrics, "tandem:pipeline_misses_total", reason="late") == 1
    assert _value(metrics, "tandem:pipeline_misses_total", reason="wrong") == 1
    assert _value(metrics, "tandem:pipeline_misses_total", reason="unasked") == 1
    assert _value(metrics, "tandem:lookup_proposals_total") == 1
    assert (hit.stats.pipeline["hit"], late.stats.pipeline["late"], wrong.stats.pipeline["wrong"],
            unasked.stats.pipeline["unasked"]) == (1, 1, 1, 1)
    assert spec.match_odds.tries == pytest.approx(0.95 ** 2 * tries + 0.95 + 1), \
        "the hit and the wrong guess say how often branches name the outcome; late and unasked say nothing"

    results.count_outcomes(StepPlan(decodes=[(hit, 2)]), draft_up=False)
    assert _value(metrics, "tandem:pipeline_lookups_total") == 4, "no draft, no pipeline to score"


def test_lookup_s_estimate_passed_over_for_the_draft_s_proposals_drifts_back_instead_of_freezing():
    """Prompt lookup verified only where it looks better than the draft: a sequence whose last lookups
    failed would never verify one again while the draft is preferred (its estimate frozen where they
    left it), nor would the pool. Passed over, both drift: the sequence's toward the pool's rate, the
    pool toward its prior, so lookup gets another try (a small model's text falls into loops late)."""
    from router.speculation import Prepared

    spec, _, _, results = _books()
    seq = _seq(1, [7, 8, 9, 7, 8, 9, 7, 8])  # lookup offers [9, 7, 8, 9]
    seq.lookup_tracker = spec.lookup_acceptance.tracker()
    for _ in range(6):
        seq.lookup_tracker.update(4, 0)
        spec.lookup_acceptance.observe(4, 0)
    frozen, pool_low = seq.lookup_tracker.rate, spec.lookup_acceptance.pooled.rate
    assert frozen < 0.2 and pool_low < 0.5
    for _ in range(1000):
        n = len(seq.tokens)
        seq.prepared = [Prepared(n, (), (1, 2, 3, 4))]  # the draft's offer for this history
        spec.new_step()
        ks = spec.choose_ks([seq], 0)
        assert spec.lookup(seq)[0], "lookup has an offer every step"
        if seq.seq_id in spec.from_lookup:
            break
        assert seq.seq_id in spec.lookup_passed and ks[0] > 0
        response = target_pb2.StepResponse(results=[target_pb2.EntryResult(  # the draft's first draft accepted
            seq_id=1, tokens=[1, 5], num_accepted=1, cached_len=n + 2)])
        results.apply(StepPlan(decodes=[(seq, ks[0])]), [[1, 2, 3, 4][:ks[0]]], response)  # history unchanged
    else:
        raise AssertionError("lookup never verified again")
    assert seq.lookup_tracker.rate > frozen and spec.lookup_acceptance.pooled.rate > pool_low


def test_a_miss_is_classified_when_its_step_is_planned_not_when_a_late_call_lands_during_it():
    """The draft was asked for this outcome and had not answered when the step was planned: late,
    even though its branches land while the step runs (then the outcome is prepared for, and asking
    afterwards would call the miss wrong)."""
    from router.speculation import Prepared

    spec, metrics, _, results = _books()
    seq = _seq(1, [1, 2, 3])
    seq.outcome_start = seq.asked_at = 3
    assert spec.choose_ks([seq], 0) and not spec.proposal(seq)[0], "nothing prepared: it runs on lookup or k = 0"
    seq.next_k = 2
    seq.prepared.append(Prepared(3, (7,), (8, 9)))  # the call lands during the step, for another outcome
    results.count_outcomes(StepPlan(decodes=[(seq, 0)]), draft_up=True)
    assert _value(metrics, "tandem:pipeline_misses_total", reason="late") == 1
    assert _value(metrics, "tandem:pipeline_misses_total", reason="wrong") == 0


def test_the_regime_s_progress_counts_each_decoder_in_steps_of_prompt_lookup_alone():
    """Each decoder's output is replayed through lookup alone from its first decode (LookupShadow, at
    k_max); the step's progress is the replayed steps its tokens resolved, averaged over the decoders
    (they step together). A step the regime does not measure counts nothing, and the replays start
    again after it; a step without decoders is no sample."""
    from router.step_record import StepRecorder

    spec, metrics, _, _ = _books()
    recorder = StepRecorder(spec, metrics, "r0")
    repeat, fresh = _seq(1, [5, 6, 7, 8, 9, 5, 6]), _seq(2, [1, 2, 3])
    plan = StepPlan(decodes=[(repeat, 3), (fresh, 0)])

    def step(a: list[int], b: list[int]) -> target_pb2.StepResponse:
        repeat.tokens += a
        fresh.tokens += b
        return target_pb2.StepResponse(results=[target_pb2.EntryResult(seq_id=1, tokens=a),
                                                target_pb2.EntryResult(seq_id=2, tokens=b)])

    # lookup alone after "5 6" guesses 7 8 9 5: the draft's 7 8 9 5 6 is that step and its bonus; the
    # fresh one's 4 is one step (no earlier match)
    assert recorder.lookup_steps(plan, step([7, 8, 9, 5, 6], [4]), measured=True) == pytest.approx((1 + 1) / 2)
    assert repeat.lookup_shadow is not None and repeat.lookup_shadow.pos == len(repeat.tokens)
    # "5 6" again: lookup guesses 7 8 9 5; 7 8 emitted so far leave its step open
    assert recorder.lookup_steps(plan, step([7, 8], [10]), measured=True) == pytest.approx((0 + 1) / 2)
    assert recorder.lookup_steps(plan, step([9, 1], [11]), measured=True) == pytest.approx((1 + 1) / 2)
    assert recorder.lookup_steps(plan, step([2], [12]), measured=False) is None
    assert repeat.lookup_shadow.pos == len(repeat.tokens), "restarted where the unmeasured step left the text"
    assert recorder.lookup_steps(StepPlan(chunks=[Chunk(fresh, 0, 2)]), target_pb2.StepResponse(),
                                 measured=True) is None
    empty = target_pb2.StepResponse(results=[target_pb2.EntryResult(seq_id=1)])
    assert recorder.lookup_steps(StepPlan(decodes=[(repeat, 3)]), empty, measured=True) == 0.0, "no tokens"


def test_a_predicted_output_is_replayed_with_its_prediction():
    """Lookup alone would have proposed the request's prediction: its replay does too."""
    from router.step_record import StepRecorder

    spec, metrics, _, _ = _books()
    recorder = StepRecorder(spec, metrics, "r0")
    output = [20, 21, 22, 23, 24]
    seq = Sequence(1, Request(request_id="r1", prompt_ids=[1, 2, 3], sampling=GREEDY, max_tokens=64,
                              prediction=tuple(output)), lookup=PromptLookup(prediction=output, start=3))
    seq.tokens, seq.num_prompt = [1, 2, 3], 3
    plan = StepPlan(decodes=[(seq, 4)])
    seq.tokens += output
    response = target_pb2.StepResponse(results=[target_pb2.EntryResult(seq_id=1, tokens=output)])
    assert recorder.lookup_steps(plan, response, measured=True) == 1, "4 predicted tokens and the target's: one step"
