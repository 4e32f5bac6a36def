"""Speculation policy specification: the expected-tokens formula, the acceptance estimate, the choice
of k per sequence from acceptance and load (priced by router.step_costs, tested in test_step_costs),
and the speculator's rests, probes and waits."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.draft_plans import branch_budget, branches_pay, step_work
from router.spec_policy import AcceptancePool, AcceptanceTracker, Odds, choose_k, expected_tokens, worth_waiting_ms
from router.step_costs import DraftCost, StepCostModel
from router.upfront import drafts_upfront, grace_ms

CPU = StepCostModel(alpha=10.0, beta=1.2)  # compute-bound: every scored token costs (the module's prior)
GPU = StepCostModel(alpha=20.0, beta=0.02)  # memory-bound: scoring more tokens is nearly free


def goodput(rates: list[float], ks: list[int], base_tokens: int, cost: StepCostModel) -> float:
    """The objective choose_k maximises: expected emitted tokens per ms of the step, less the time its
    prompt tokens add (beta each: theirs, whichever step runs them)."""
    emitted = sum(expected_tokens(a, k) for a, k in zip(rates, ks, strict=True))
    return emitted / (cost.step_ms(base_tokens + sum(1 + k for k in ks)) - cost.beta * base_tokens)


# ---- expected tokens ----------------------------------------------------------------------------
@given(a=st.one_of(st.floats(0.0, 1.0 - 1e-6), st.just(1.0)), k=st.integers(0, 16))
def test_expected_tokens_is_the_sum_of_acceptance_powers(a, k):
    """One verification of k drafts emits 1 + a + ... + a^k tokens: the bonus/correction token,
    plus draft i accepted only if all before it were (probability a^i)."""
    assert expected_tokens(a, k) == pytest.approx(sum(a**i for i in range(k + 1)), rel=1e-9, abs=1e-12)


def test_expected_tokens_edges():
    assert expected_tokens(0.0, 5) == 1.0  # every draft rejected: just the corrected token
    assert expected_tokens(1.0, 5) == 6.0  # every draft accepted: k + the bonus token
    assert expected_tokens(0.5, 0) == 1.0  # no drafts: plain decoding
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


# ---- acceptance tracker -------------------------------------------------------------------------
def test_tracker_starts_at_the_prior():
    assert AcceptanceTracker().rate == pytest.approx(0.7)


def test_tracker_falls_with_every_rejection_and_rises_with_every_acceptance():
    down, up = AcceptanceTracker(), AcceptanceTracker()
    rates_down, rates_up = [down.rate], [up.rate]
    for _ in range(30):
        down.update(4, 0)  # first draft rejected every time
        up.update(4, 4)  # all four accepted every time
        rates_down.append(down.rate)
        rates_up.append(up.rate)
    assert all(b < a for a, b in itertools.pairwise(rates_down))
    assert all(b > a for a, b in itertools.pairwise(rates_up))
    assert rates_down[-1] < 0.05 and rates_up[-1] > 0.99


def test_tracker_estimates_per_position_acceptance_up_to_the_first_rejection():
    """2 of 4 accepted means positions 1-2 accepted and position 3 rejected; position 4 was never
    tried, so the per-token estimate is 2/3, not 2/4."""
    t = AcceptanceTracker()
    for _ in range(200):
        t.update(4, 2)
    assert t.rate == pytest.approx(2 / 3, abs=1e-6)


def test_tracker_converges_to_the_true_rate_of_geometric_acceptance():
    rng = random.Random(0)
    for p in (0.2, 0.5, 0.8):
        t, samples = AcceptanceTracker(), []
        for _ in range(3000):
            accepted = 0
            while accepted < 4 and rng.random() < p:
                accepted += 1
            t.update(4, accepted)
            samples.append(t.rate)
        mean = sum(samples[500:]) / len(samples[500:])
        assert mean == pytest.approx(p, abs=0.05)


@pytest.mark.parametrize("accepted", [0, 4], ids=["after-rejections", "after-acceptances"])
def test_tracker_drifts_back_to_the_prior_while_not_speculating(accepted):
    """At k = 0 there is no evidence; the estimate relaxes toward 0.7 so a sequence that dropped
    to k = 0 gets another try later (and one that did well does not keep an unearned high rate)."""
    t = AcceptanceTracker()
    for _ in range(20):
        t.update(4, accepted)
    far = abs(t.rate - 0.7)
    assert far > 0.25
    rates = [t.rate]
    for _ in range(600):
        t.update(0, 0)
        rates.append(t.rate)
    dist = [abs(r - 0.7) for r in rates]
    assert all(b < a for a, b in itertools.pairwise(dist)), "monotonically closer, never overshooting"
    assert dist[-1] < 0.01
    assert dist[1] > 0.9 * far, "the drift is slow: one idle step is not evidence"


def test_a_new_sequence_starts_from_the_pooled_acceptance_not_a_fixed_prior():
    """A pair whose drafts are rarely accepted: after the pool has seen it, a new sequence's first
    estimate is the pool's, so it does not speculate at 0.7 for its first steps."""
    pool = AcceptancePool()
    assert pool.tracker().rate == pytest.approx(0.7), "nothing seen: the optimistic prior"
    for _ in range(60):
        pool.observe(4, 1)  # the second draft rejected: 1 accepted of 2 positions tried
        pool.observe(4, 0)  # the first: 0 of 1
        pool.observe(0, 0)  # a step without drafts is hardly evidence (see the pool's slow drift below)
    assert pool.tracker().rate == pytest.approx(1 / 3, abs=0.02)
    for _ in range(200):
        pool.observe(4, 0)
    assert pool.tracker().rate < 0.05
    assert AcceptanceTracker.starting_at(0.2).rate == pytest.approx(0.2)
    assert choose_k([AcceptanceTracker().rate], [4], 0, CPU) != [0]
    assert choose_k([pool.tracker().rate], [4], 0, CPU) == [0]


def test_a_couple_of_early_failures_do_not_sink_the_pool():
    """The pool's prior is worth ten trials: two lookups failed in a warm-up left it at 0.35 with a
    prior of two, and the load after it started every sequence there."""
    pool = AcceptancePool.for_lookup()
    pool.observe(3, 0)
    pool.observe(4, 0)
    assert pool.tracker().rate > 0.55
    for _ in range(60):
        pool.observe(4, 0)
    assert pool.tracker().rate < 0.15, "evidence still wins within a request's worth of steps"


def test_lookup_s_pool_drifts_back_in_hundreds_of_idle_sequence_steps_the_draft_s_in_thousands():
    draft, lookup = AcceptancePool(), AcceptancePool.for_lookup()
    for pool in (draft, lookup):
        for _ in range(200):
            pool.observe(4, 0)
        for _ in range(300):
            pool.observe(0, 0)
    assert draft.tracker().rate < 0.1
    assert lookup.tracker().rate > 0.6


def test_a_sequence_that_stopped_speculating_drifts_back_to_the_pool_s_rate_not_to_an_optimistic_one():
    """Where drafts are rarely accepted, a sequence held at k = 0 must not talk itself back into
    speculating every few dozen steps (each retry a dearer step, and a draft catching up on tokens it
    skipped): it drifts back to what the pool has measured, which does not pay."""
    smollm2 = StepCostModel()  # its target on CPU after engine/linear.py: 1-5 tokens' forwards, ms
    for n, ms in itertools.islice(itertools.cycle([(1, 45.0), (2, 70.0), (3, 85.0), (4, 90.0), (5, 115.0)]), 50):
        smollm2.observe(n, ms)
    pool = AcceptancePool()
    for i in range(200):
        pool.observe(4, 0 if i % 3 else 1)
    pooled = pool.tracker().rate
    assert 0.2 < pooled < 0.35
    seq, fixed = pool.tracker(), AcceptanceTracker()
    for t in (seq, fixed):
        for _ in range(10):
            t.update(4, 0)
        assert choose_k([t.rate], [4], 0, smollm2) == [0]
        for _ in range(400):
            t.update(0, 0)
    assert seq.rate == pytest.approx(pooled, abs=0.01) and choose_k([seq.rate], [4], 0, smollm2) == [0]
    assert fixed.rate == pytest.approx(0.7, abs=0.01) and choose_k([fixed.rate], [4], 0, smollm2) != [0]


def test_the_pool_drifts_back_to_the_optimistic_prior_without_evidence_so_speculation_is_never_off_for_good():
    """Held at k = 0 by a low pooled rate, no sequence would speculate to correct it: the pool drifts
    back to 0.7 on steps without drafts, slowly (thousands of sequence-steps, not dozens)."""
    pool = AcceptancePool()
    for _ in range(300):
        pool.observe(4, 0)
    low = pool.tracker().rate
    assert low < 0.05 and choose_k([low], [4], 0, CPU) == [0]
    for _ in range(100):
        pool.observe(0, 0)
    assert pool.tracker().rate < low + 0.1, "slow: a hundred idle sequence-steps barely move it"
    for _ in range(3000):
        pool.observe(0, 0)
    assert pool.tracker().rate > 0.6 and choose_k([pool.tracker().rate], [4], 0, CPU) != [0]


# ---- choosing k ----------------------------------------------------------------------------------
def test_high_acceptance_and_a_small_batch_speculate_to_the_cap():
    assert choose_k([0.9], [4], 0, CPU) == [4]
    assert choose_k([0.9, 0.9], [4, 4], 0, CPU) == [4, 4]
    assert choose_k([0.9], [4], 0, GPU) == [4]


def test_low_acceptance_does_not_speculate():
    assert choose_k([0.05], [4], 0, CPU) == [0]
    assert choose_k([0.05] * 4, [4] * 4, 0, CPU) == [0] * 4
    assert choose_k([0.9, 0.05], [4, 4], 0, CPU) == [4, 0], "k is per sequence"


def test_better_acceptance_never_gets_a_smaller_k():
    for n, cost in ((1, CPU), (8, CPU), (8, GPU)):
        ks = [choose_k([a] * n, [8] * n, 0, cost) for a in (0.1, 0.3, 0.5, 0.7, 0.9, 0.97)]
        totals = [sum(k) for k in ks]
        assert totals == sorted(totals) and totals[-1] > totals[0]


def test_larger_batches_get_smaller_k_per_sequence_when_compute_bound():
    per_seq = [sum(choose_k([0.8] * n, [4] * n, 0, CPU)) / n for n in (1, 2, 4, 8, 16, 32, 64)]
    assert all(b <= a for a, b in itertools.pairwise(per_seq))
    assert per_seq[0] == 4 and per_seq[-1] < 1


def test_prompt_chunks_in_the_step_do_not_stop_speculation():
    """A prompt token is not output, and it costs beta in whichever step runs it: a draft token that
    displaces one from the budget defers it a step, it does not lose it. Valued as one emitted token,
    prompt tokens beat every draft token (yield a^j < 1), and under a prefill backlog the decoders
    fell to k = 0.4 against 3.8 in decode-only steps (bench, demo pair, c=16)."""
    for cost in (CPU, GPU):
        decode_only = choose_k([0.8] * 8, [4] * 8, 0, cost)
        assert decode_only != [0] * 8
        for base in (16, 64, 256, 1024):
            assert choose_k([0.8] * 8, [4] * 8, base, cost) == decode_only


def test_a_prompt_chunk_gives_a_slow_pipelined_draft_time_to_be_ready():
    """The only way a chunk moves k: the longer step leaves a draft slower than the target's decode
    step time to finish its rounds (see the slow-draft test below: k = 3 without a chunk)."""
    target = StepCostModel(alpha=10.0, beta=0.2)
    slow = DraftCost(StepCostModel(alpha=1e-3, beta=4.0), pipelined=True)
    assert choose_k([0.9] * 4, [4] * 4, 0, target, slow) == [3] * 4
    assert choose_k([0.9] * 4, [4] * 4, 64, target, slow) == [4] * 4


@settings(max_examples=200, deadline=None)
@given(rates=st.lists(st.floats(0.0, 1.0), min_size=0, max_size=12),
       caps=st.lists(st.integers(0, 8), min_size=12, max_size=12),
       base=st.integers(0, 512), beta=st.sampled_from([0.02, 0.3, 1.2, 5.0]))
def test_choose_k_respects_caps_and_no_single_step_of_k_improves_goodput(rates, caps, base, beta):
    cost = StepCostModel(alpha=10.0, beta=beta)
    caps = caps[: len(rates)]
    ks = choose_k(rates, caps, base, cost)
    assert len(ks) == len(rates)
    assert all(0 <= k <= c for k, c in zip(ks, caps, strict=True))
    best = goodput(rates, ks, base, cost)
    assert best >= goodput(rates, [0] * len(rates), base, cost)
    for i in range(len(rates)):
        if ks[i] < caps[i]:
            up = ks[:i] + [ks[i] + 1] + ks[i + 1:]
            assert goodput(rates, up, base, cost) <= best * 1.0001 + 1e-12


@settings(max_examples=100, deadline=None)
@given(rates=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=3), caps=st.lists(st.integers(0, 4), min_size=3,
       max_size=3), base=st.integers(0, 64), beta=st.sampled_from([0.02, 0.3, 1.2, 5.0]))
def test_choose_k_matches_a_brute_force_optimum(rates, caps, base, beta):
    cost = StepCostModel(alpha=10.0, beta=beta)
    caps = caps[: len(rates)]
    optimum = max(goodput(rates, list(ks), base, cost) for ks in itertools.product(*(range(c + 1) for c in caps)))
    assert goodput(rates, choose_k(rates, caps, base, cost), base, cost) >= optimum * (1 - 1e-3)


def test_an_expensive_draft_shrinks_k_and_pipelining_hides_a_cheap_one():
    target = StepCostModel(alpha=10.0, beta=0.5)
    rates, caps = [0.8] * 4, [8] * 4
    free = choose_k(rates, caps, 0, target)
    cheap = DraftCost(StepCostModel(alpha=0.5, beta=0.5), pipelined=True)  # 8 rounds fit inside one step
    costly = DraftCost(StepCostModel(alpha=1.0, beta=4.0), pipelined=True)  # 3 rounds already outlast it
    serial = DraftCost(StepCostModel(alpha=0.5, beta=0.5), pipelined=False)
    assert choose_k(rates, caps, 0, target, cheap) == free
    assert max(choose_k(rates, caps, 0, target, costly)) < max(free)
    assert sum(choose_k(rates, caps, 0, target, serial)) <= sum(free)


def test_a_pipelined_draft_slower_than_the_target_does_not_zero_k_it_thins_the_proposals():
    """The target never waits for a pipelined draft: a draft twice as slow as the target has proposals
    ready for half the steps, which at high acceptance is still worth drafting for (the old model, in
    which the slower of the two paced the step, cut k to keep the draft's rounds inside the step)."""
    target = StepCostModel(alpha=10.0, beta=0.2)
    slow = DraftCost(StepCostModel(alpha=1e-3, beta=4.0), pipelined=True)  # k + 1 rounds: 4 (k + 1) ms
    # k = 3: a 13.2 ms step, drafts ready for 13.2 / 16 of them: (4 + 0.825 * 4 * 2.439) / 13.2 = 0.913 tok/ms;
    # k = 4: 14 ms, ready 0.7: 0.905; k = 2: 12.4 ms, always ready: 0.874. Paced by the draft, k = 2 won.
    assert choose_k([0.9] * 4, [4] * 4, 0, target, slow) == [3] * 4


def test_proposals_that_cost_no_draft_work_are_not_charged_for_it():
    """A draft as slow as the target makes drafting unaffordable, but prompt-lookup guesses (no draft
    work) at the same acceptance are still worth verifying."""
    cost = StepCostModel(alpha=70.0, beta=3.0)
    slow_draft = DraftCost(model=StepCostModel(alpha=60.0, beta=20.0), pipelined=False)
    assert choose_k([0.6], [4], 0, cost, slow_draft, drafted=[True]) == [0]
    assert choose_k([0.6], [4], 0, cost, slow_draft, drafted=[False])[0] > 0


def test_a_pipelined_draft_on_shared_compute_costs_the_target_slowdown_not_its_own_time():
    """On shared cores the pipelined draft still runs beside the target: what it costs the step is the
    measured slowdown of the target, not the whole Propose (the old charge, which made drafting look
    unaffordable next to prompt lookup on a small draft)."""
    target = StepCostModel(alpha=10.0, beta=0.5)
    draft = StepCostModel(alpha=1.0, beta=1.0)  # 5 rounds: 6 ms, inside the step
    shared = DraftCost(draft, pipelined=True, slowdown=1.1)
    assert shared.step(target_ms=12.0, max_k=4) == (pytest.approx(13.2), 1.0)
    assert shared.step(target_ms=12.0, max_k=0) == (12.0, 1.0), "no drafting, no slowdown"
    free = choose_k([0.7], [4], 0, target)
    assert choose_k([0.7], [4], 0, target, shared) == free, "a 10% slowdown is worth a 0.7 acceptance"
    assert choose_k([0.7], [4], 0, target, DraftCost(draft, pipelined=True, slowdown=3.0)) == [0]


def _speculator(draft_compute: str, pipeline: bool = True):
    from types import SimpleNamespace

    from router.config import RouterConfig
    from router.scheduler import CacheGeometry, Scheduler
    from router.speculation import OutcomeStats
    from router.speculator import Speculator

    config = RouterConfig(pipeline=pipeline)
    lane = SimpleNamespace(up=True, info=SimpleNamespace(compute_id=draft_compute, max_model_len=512), max_k=4,
                           budget=512, stats=OutcomeStats())
    return Speculator(config, Scheduler(config, CacheGeometry(64, 16), None), lane, 512, 4, "host/cpu/0-1")


def _observe_slowdown(spec, ratio: float, busy: bool) -> None:
    """A one-token decode step that took `ratio` times the model's price."""
    spec.pacing.contention.observe(ratio * spec.cost.step_ms(1, 1), 1, 1, draft_busy=busy)


def _decoding(n: int = 1):
    """A decode-only step of n one-token decodes."""
    from router.core import GREEDY, Request
    from router.scheduler import StepPlan
    from router.sequence import Sequence

    seqs = [Sequence(seq_id=i, request=Request(request_id=f"r{i}", prompt_ids=[1, 2], sampling=GREEDY, max_tokens=4),
                     tokens=[1, 2], num_prompt=2) for i in range(n)]
    return StepPlan(decodes=[(seq, 0) for seq in seqs])


def test_sharing_compute_a_pipelined_draft_rests_on_probe_steps_so_its_cost_can_be_measured():
    """The draft's cost on shared compute is the target's slowdown while it works; with work on every
    step there would be no idle step to compare with. Decode-only steps rest it until four idle steps
    are measured, then one in PROBE_EVERY; a step with prompt chunks never rests it (it mirrors them)."""
    from router.core import GREEDY, Request
    from router.pacing import PROBE_EVERY
    from router.scheduler import Chunk, StepPlan
    from router.sequence import Sequence

    spec = _speculator("host/cpu/0-1")
    decode_only = _decoding()
    assert spec.pacing.rests(decode_only, 1), "nothing measured idle yet"
    for _ in range(4):
        _observe_slowdown(spec, 1.0, busy=False)
    assert not any(spec.pacing.rests(decode_only, s) for s in range(1, PROBE_EVERY))
    assert spec.pacing.rests(decode_only, PROBE_EVERY)
    req = Request(request_id="r1", prompt_ids=[1, 2, 3], sampling=GREEDY, max_tokens=4)
    seq = Sequence(seq_id=1, request=req, tokens=[1, 2, 3], num_prompt=3)
    assert not spec.pacing.rests(StepPlan(chunks=[Chunk(seq, 0, 3)]), PROBE_EVERY)
    sequential = _speculator("host/cpu/0-1", pipeline=False)
    assert not any(sequential.pacing.rests(decode_only, s) for s in range(1, 2 * PROBE_EVERY)), \
        "a sequential draft never works alongside the target: there is nothing to measure"


def test_a_change_of_load_is_probed_until_idle_steps_of_its_size_are_held():
    """The slowdown compares busy and idle steps of about one size: after a load of one sequence, a
    step of eight is probed one step in SIZE_PROBE_EVERY until MIN_SAMPLES idle steps near its size
    are held, on compute shared with the target and on the draft's own device alike (a draft quiet
    beside small steps may slow large ones: they share caches and memory bandwidth)."""
    from router.pacing import PROBE_EVERY, SIZE_PROBE_EVERY
    from router.step_costs import MIN_SAMPLES

    spec, own_device = _speculator("host/cpu/0-1"), _speculator("host/cpu/1")
    for s in (spec, own_device):
        for _ in range(4):
            _observe_slowdown(s, 1.0, busy=False)
    one, eight = _decoding(1), _decoding(8)
    steps = range(1, PROBE_EVERY)
    assert not any(spec.pacing.rests(one, s) for s in steps)
    assert [s for s in steps if spec.pacing.rests(eight, s)] == [s for s in steps if s % SIZE_PROBE_EVERY == 0]
    assert [s for s in steps if own_device.pacing.rests(eight, s)] == [s for s in steps if s % SIZE_PROBE_EVERY == 0]
    for s in (spec, own_device):
        for _ in range(MIN_SAMPLES):
            s.pacing.contention.observe(s.cost.step_ms(8, 8), 8, 8, draft_busy=False)
        assert not any(s.pacing.rests(eight, step) for step in steps)


def test_a_draft_on_other_cores_is_probed_too_and_treated_as_shared_once_it_measurably_slows_the_target():
    """Other cores of one host still share caches and memory bandwidth: the pipelined draft rests on
    probe steps there too (rarely while no slowdown shows), and a measured slowdown makes it behave as
    on shared compute: more frequent probes, one branch per sequence, nothing prepared for sequences on
    prompt lookup when no decoder took its proposals."""
    from router.pacing import PROBE_EVERY, QUIET_PROBES
    from router.speculation import Candidate

    spec, decode_only = _speculator("host/cpu/1"), _decoding()
    assert not spec.pacing.shares_compute()
    assert spec.pacing.rests(decode_only, 1), "nothing measured idle yet"
    for _ in range(4):
        _observe_slowdown(spec, 1.0, busy=False)
        _observe_slowdown(spec, 1.02, busy=True)
    assert not spec.pacing.slows_target(), "a 2% difference is noise"
    quiet = PROBE_EVERY * QUIET_PROBES
    assert [s for s in range(1, quiet + 1) if spec.pacing.rests(decode_only, s)] == [quiet]
    for _ in range(40):
        _observe_slowdown(spec, 1.2, busy=True)
    assert spec.pacing.slows_target()
    assert [s for s in range(1, PROBE_EVERY + 1) if spec.pacing.rests(decode_only, s)] == [PROBE_EVERY]
    cands = [(None, [], Candidate(seq_id, 0, 0.7, 4)) for seq_id in range(3)]
    assert branch_budget(spec, cands, step_ms=1e6) == 3, "one branch per sequence: each extra one slows the target"


def test_branches_are_worth_what_the_draft_s_own_drafts_are_accepted_at_not_the_verified_lookup_s():
    """SmolLM2 on shared cores: a sequence verifying prompt lookup's guesses (accepted 0.77) would get
    branches whose drafts come from the draft model (accepted 0.22). Valued at lookup's acceptance they
    looked worth their stretch of the step and slowed decode 1.6x for nothing; valued at the draft's
    they are not prepared, and a draft accepted as well as lookup's guesses still prepares them."""
    from router.speculation import Candidate

    spec = _speculator("host/cpu/0-1")
    for _ in range(10):
        _observe_slowdown(spec, 1.0, busy=False)
        _observe_slowdown(spec, 1.3, busy=True)
    spec.match_odds = Odds(hits=9.0, tries=10.0)
    plan = _decoding(1)
    seq = plan.decodes[0][0]
    seq.lookup_tracker = AcceptanceTracker.starting_at(0.77)
    spec.from_lookup.add(seq.seq_id)  # this step verifies lookup's guesses
    weak, strong = Candidate(seq.seq_id, 3, 0.77, 4, draft_a=0.22), Candidate(seq.seq_id, 3, 0.77, 4, draft_a=0.77)
    assert weak.gain == pytest.approx(expected_tokens(0.22, 4) - 1)
    assert not branches_pay(spec, plan, [weak])
    assert branches_pay(spec, plan, [strong])


def test_a_draft_that_slows_the_target_prepares_nothing_for_lookup_sequences_when_no_decoder_took_its_proposals():
    """Its work would only slow the step: it prepares for the sequences that want its proposal, not for
    those whose lookups beat even a full proposal of its own. On its own device (no slowdown measured)
    it prepares for both, so a sequence can switch back to it."""
    from router.core import GREEDY, Request
    from router.scheduler import StepPlan
    from router.sequence import Sequence

    def seq(seq_id: int) -> Sequence:
        req = Request(request_id=f"r{seq_id}", prompt_ids=[1, 2, 3], sampling=GREEDY, max_tokens=8)
        s = Sequence(seq_id=seq_id, request=req, tokens=[1, 2, 3, 4], num_prompt=3)
        s.next_k = 2
        s.tracker, s.lookup_tracker = AcceptanceTracker(accepted=2, tried=10), AcceptanceTracker(accepted=8, tried=10)
        return s

    def prepared_for(spec, late: bool = False) -> set[int]:
        on_lookup, wanting = seq(1), seq(2)
        wanting.tracker = AcceptanceTracker(accepted=9, tried=10)  # worth its branches (branches_pay)
        spec.match_odds = Odds(hits=9.0, tries=10.0)
        if late:  # on lookup for want of a draft proposal, though the draft's are worth more
            on_lookup.tracker, on_lookup.lookup_tracker = on_lookup.lookup_tracker, on_lookup.tracker
        spec.new_step()
        spec.from_lookup.add(on_lookup.seq_id)  # took lookup's proposal this step; no decoder took the draft's
        plan = StepPlan(decodes=[(on_lookup, 2), (wanting, 0)])
        work = step_work(spec, plan, [[5, 6], []])
        return {s.seq_id for s in work.seqs}

    own_device = _speculator("host/cpu/1")
    assert prepared_for(own_device) == {1, 2}
    slowed = _speculator("host/cpu/1")
    for _ in range(10):
        _observe_slowdown(slowed, 1.0, busy=False)
        _observe_slowdown(slowed, 1.3, busy=True)
    assert prepared_for(slowed) == {2}
    assert prepared_for(_speculator("host/cpu/0-1")) == {2}, "shared compute: no measurement needed"
    assert prepared_for(_speculator("host/cpu/0-1"), late=True) == {1, 2}, \
        "resting the draft for a sequence it was merely late for would keep it late"


def test_waiting_for_proposals_is_worth_their_odds_of_the_time_at_which_the_step_would_break_even():
    """A step of 10 ms emitting 2 tokens; proposals adding 2 more would break even at a 10 ms wait
    (4 tokens in 20 ms): at even odds of their arriving in time the wait is worth half of that."""
    assert worth_waiting_ms(10.0, 2.0, 2.0, odds=0.5) == pytest.approx(5.0)
    step, tokens, gain = 12.0, 5.0, 1.5
    wait = worth_waiting_ms(step, tokens, gain, odds=1.0)
    assert (tokens + gain) / (step + wait) == pytest.approx(tokens / step)
    assert worth_waiting_ms(step, tokens, gain, odds=0.2) == pytest.approx(0.2 * wait)
    assert worth_waiting_ms(10.0, 2.0, 0.0, odds=1.0) == 0.0
    assert worth_waiting_ms(10.0, 1.0, 3.0, odds=1.0) == pytest.approx(5.0), "never more than half a step"


def test_odds_follow_how_often_tries_succeeded():
    odds = Odds()
    assert odds.rate == 0.5
    for _ in range(100):
        odds.observe(hit=False)
    assert odds.rate < 0.05
    for _ in range(100):
        odds.observe(hit=True)
    assert odds.rate > 0.95


def _late_decoder(spec, acceptance: float = 0.9):
    """A decoding sequence whose last verification just ended; the draft call in flight carries its
    branches for that outcome (the step loop's state right after the target answered)."""
    import time

    from router.core import GREEDY, Request, SeqStatus
    from router.draft_work import DraftWork
    from router.sequence import Sequence
    from tandem.v1 import draft_pb2

    req = Request(request_id="r1", prompt_ids=[1, 2, 3], sampling=GREEDY, max_tokens=64)
    seq = Sequence(seq_id=1, request=req, tokens=[1, 2, 3, 4, 5], num_prompt=3, status=SeqStatus.RUNNING)
    seq.target_cached, seq.outcome_start = 4, 4
    seq.tracker = AcceptanceTracker(accepted=100 * acceptance, tried=100.0)
    spec.scheduler.running.append(seq)
    entry = draft_pb2.ProposeEntry(seq_id=1, k=4, num_verifying=0, branches=[draft_pb2.Branch(accepted=0)])
    work = DraftWork(entries=[entry], seqs=[seq], bases=[seq.tokens[:4]], rounds=5, branches=1)
    spec.draft.in_flight, spec.draft.started, spec.draft.waited_for = work, time.perf_counter(), False
    return seq


def test_the_next_step_waits_for_a_draft_call_about_to_land_with_the_proposal_a_decoder_needs():
    """At high acceptance a proposal is worth most of a step; a call due now is worth waiting for."""
    spec = _speculator("host/cpu/1")
    _late_decoder(spec)
    for _ in range(30):
        spec.match_odds.observe(hit=True)  # its branches have held the outcome
    assert grace_ms(spec) == pytest.approx(0.5 * spec.cost.step_ms(5, 1))
    for _ in range(5):
        spec.wait_odds.observe(hit=False)
    assert 0 < grace_ms(spec) < 0.45 * spec.cost.step_ms(5, 1), "waits that time out shrink the bet"
    for _ in range(30):
        spec.wait_odds.observe(hit=False)
    assert grace_ms(spec) == 0, "... until a call due now is not worth waiting for"
    spec.draft.started -= 1.0  # overdue by a second: what a stuck draft's calls look like
    assert grace_ms(spec) < 0.05 * spec.cost.step_ms(5, 1), "a stuck draft's waits timed out: a token bet at most"


def test_no_wait_without_a_late_decoder_or_a_call_in_flight_or_for_a_call_waited_for_once():
    from router.speculation import Prepared

    spec = _speculator("host/cpu/1")
    seq = _late_decoder(spec)
    seq.prepared.append(Prepared(4, (5,), (6, 7), ()))
    assert grace_ms(spec) == 0, "its branch for this outcome is here already"
    seq.prepared.clear()
    assert grace_ms(spec) > 0
    spec.draft.waited_for = True
    assert grace_ms(spec) == 0, "one wait per call: a call that missed it is not waited for again"
    spec.draft.waited_for = False
    seq.outcome_start = 5
    assert grace_ms(spec) == 0, "the call in flight was sent for an earlier outcome: it brings nothing for this one"
    seq.outcome_start = 4
    spec.draft.waited_for = False
    spec.draft.in_flight = None
    assert grace_ms(spec) == 0
    sequential = _speculator("host/cpu/1", pipeline=False)
    _late_decoder(sequential)
    assert grace_ms(sequential) == 0, "sequential drafting awaits its proposals anyway"


def test_branches_that_rarely_hold_the_outcome_are_worth_a_shorter_wait():
    spec = _speculator("host/cpu/1")
    _late_decoder(spec)
    for _ in range(30):
        spec.match_odds.observe(hit=True)
    sure = grace_ms(spec)
    for _ in range(30):
        spec.match_odds.observe(hit=False)
    assert grace_ms(spec) < 0.6 * sure


def test_a_draft_call_due_later_than_its_proposals_are_worth_is_not_waited_for():
    """Low acceptance makes a proposal worth little; a slow draft (its calls cost more than a step)
    is not waited for however good its proposals."""
    spec = _speculator("host/cpu/1")
    _late_decoder(spec, acceptance=0.05)
    assert grace_ms(spec) == 0
    slow = _speculator("host/cpu/1")
    slow.branch_cost.a = 100.0  # a call costs ten target steps
    _late_decoder(slow)
    assert grace_ms(slow) == 0


def test_the_next_step_is_plain_only_where_no_decoder_would_take_drafts_whatever_this_one_emits():
    """The step loop sends the next step before this one's answer (chained, at k = 0) when it would
    decode every sequence at k = 0 anyway: the policy drafts for none of them and prompt lookup has
    nothing for any. A sequence whose drafts are worth their cost, or whose history repeats (lookup
    has an offer), keeps its step unchained: its proposals need this step's outcome."""
    from router.core import GREEDY, Request
    from router.sequence import Sequence

    def seq(seq_id: int, tokens: list[int], acceptance: float) -> Sequence:
        req = Request(request_id=f"r{seq_id}", prompt_ids=tokens[:3], sampling=GREEDY, max_tokens=64)
        s = Sequence(seq_id=seq_id, request=req, tokens=tokens, num_prompt=3)
        s.tracker = AcceptanceTracker(accepted=10 * acceptance, tried=10)
        return s

    spec = _speculator("host/cpu/1")
    hopeless = seq(1, [11, 12, 13, 14, 15, 16], acceptance=0.02)
    assert spec.plain_next_step([hopeless])
    repeating = seq(2, [11, 12, 13, 14, 11, 12], acceptance=0.02)  # lookup: what followed "11 12" before
    assert spec.lookup(repeating)[0][:2] == [13, 14]
    assert not spec.plain_next_step([hopeless, repeating])
    promising = seq(3, [21, 22, 23, 24, 25, 26], acceptance=0.9)
    assert not spec.plain_next_step([hopeless, promising])
    spec.draft.up = False  # no draft and no lookup match: nothing to speculate with
    assert spec.plain_next_step([hopeless, promising])


def test_contention_is_measured_on_decode_only_steps():
    """Prompt-chunk steps always have the draft busy (it mirrors them) and are priced from the line,
    which may misprice them: taken as contention they read as a slowdown the decodes never had."""
    from router.core import GREEDY, Request
    from router.scheduler import Chunk, StepPlan
    from router.sequence import Sequence

    spec = _speculator("host/cpu/1")
    seq = Sequence(1, Request(request_id="r1", prompt_ids=list(range(200)), sampling=GREEDY, max_tokens=8))
    decode, chunk = StepPlan(decodes=[(seq, 0)]), StepPlan(chunks=[Chunk(seq, 0, 128)])

    def step(plan: StepPlan, busy: bool, ms: float) -> None:
        spec.observe_step(plan, ms, busy)

    for _ in range(10):
        step(decode, False, 20.0)
        step(decode, True, 20.0)
        step(chunk, True, 1.5 * spec.cost.step_ms(128, 1))  # mispriced by the line, not slowed
    assert spec.pacing.contention.factor == pytest.approx(1.0)
    assert not spec.pacing.slows_target()
    for _ in range(40):
        step(decode, True, 26.0)
    assert spec.pacing.contention.factor == pytest.approx(1.3, rel=0.01), "busy decodes that are slower are"


def test_a_draft_whose_proposals_no_new_sequence_would_take_does_not_mirror_prompts_where_it_slows_the_target():
    """SmolLM2's case: at the pooled acceptance of its proposals (0.2) a new sequence drafts at no
    depth, and on shared compute mirroring a prompt into the draft only slows the target's prefill.
    A draft worth drafting with, or one on its own compute, mirrors as before."""
    from router.config import RouterConfig
    from router.core import GREEDY, Request
    from router.scheduler import Chunk, StepPlan
    from router.sequence import Sequence

    def chunk_work(spec, pooled_rate: float) -> int:
        spec.cost = StepCostModel(alpha=55.0, beta=25.0)  # a decode 80 ms, each draft verified 25 ms more
        spec.draft_acceptance = AcceptancePool(AcceptanceTracker(accepted=100 * pooled_rate, tried=100.0))
        req = Request(request_id="r1", prompt_ids=list(range(1, 41)), sampling=GREEDY, max_tokens=8)
        seq = Sequence(seq_id=1, request=req, tokens=list(range(1, 41)), num_prompt=40)
        return len(step_work(spec, StepPlan(chunks=[Chunk(seq, 0, 40)]), []).entries)

    shared = _speculator("host/cpu/0-1")
    assert shared.pacing.slows_target()
    assert chunk_work(shared, pooled_rate=0.2) == 0, "dormant: nothing to mirror for"
    assert chunk_work(_speculator("host/cpu/0-1"), pooled_rate=0.95) == 1
    assert chunk_work(_speculator("host/cpu/1"), pooled_rate=0.2) == 1, "its own compute: mirroring is free"
    static = _speculator("host/cpu/0-1")
    static.config = RouterConfig(dynamic_k=False)
    assert chunk_work(static, pooled_rate=0.2) == 1, "fixed k drafts whatever the acceptance"


def test_where_branches_beside_a_step_would_stretch_it_more_than_a_call_before_the_next_costs_the_draft_waits():
    """On shared compute the branches prepared beside a step slow it by (slowdown - 1) x its time and
    hold the outcome only as often as past branches did; a plain call before the next step costs its
    own time and always holds. The cheaper wins, with dynamic k (a fixed-k pipeline stays pipelined), and
    only once a slowdown is measured; not for a decoder whose prompt lookup beats the draft (a missed one
    is drafted for), and a step drafted so is not the pipeline's to count. Beside prompt chunks the
    stretch is that of the same decoders' branches, and the draft still mirrors the chunks."""
    from router.config import RouterConfig
    from router.core import GREEDY, Request
    from router.scheduler import Chunk, StepPlan
    from router.sequence import Sequence

    def decoder(seq_id: int) -> Sequence:
        req = Request(request_id=f"r{seq_id}", prompt_ids=[1, 2, 3], sampling=GREEDY, max_tokens=8)
        seq = Sequence(seq_id=seq_id, request=req, tokens=[1, 2, 3, 4], num_prompt=3)
        seq.next_k = 4
        return seq

    seqs = [decoder(i) for i in range(4)]
    spec = _speculator("host/cpu/0-1")
    spec.from_draft.update(s.seq_id for s in seqs[:2])  # the third missed: it verifies nothing this step
    spec.from_lookup.add(seqs[3].seq_id)  # the fourth verifies prompt lookup's guess, which beats the draft's
    seqs[3].lookup_tracker, seqs[3].tracker = AcceptanceTracker.starting_at(0.9), AcceptanceTracker.starting_at(0.3)
    step = StepPlan(decodes=[(s, k) for s, k in zip(seqs, [4, 4, 0, 4], strict=True)])
    spec.cost = StepCostModel(alpha=10.0, beta=1.0)  # this 16-token step: 26 ms with the draft idle
    spec.pacing.contention.price = spec.cost.step_ms
    spec.branch_cost.a, spec.branch_cost.b = 1.0, 0.5  # 4 rounds for the 3 on the draft's proposals: 7 ms
    assert not drafts_upfront(spec, step), "no slowdown measured yet"
    for _ in range(8):
        _observe_slowdown(spec, 1.0, busy=False)
        _observe_slowdown(spec, 1.4, busy=True)
    assert spec.pacing.contention.factor == pytest.approx(1.4)
    assert drafts_upfront(spec, step) == {0, 1, 2}, "7 ms for sure against 10 ms of stretch for half the outcomes"
    spec.branch_cost.b = 2.0  # a slower draft: 25 ms, at odds 0.5 worth 12.5 ms of stretch
    assert not drafts_upfront(spec, step)
    spec.branch_cost.b = 0.5
    prompt = Sequence(seq_id=9, request=Request(request_id="p", prompt_ids=list(range(40)), sampling=GREEDY,
                                                max_tokens=8), tokens=list(range(40)), num_prompt=40)
    with_prompt = StepPlan(decodes=step.decodes, chunks=[Chunk(prompt, 0, 40)])
    assert drafts_upfront(spec, with_prompt) == {0, 1, 2}, "the 40 prompt tokens do not add to the branches' stretch"
    work = step_work(spec, with_prompt, [[5, 6, 7, 8]] * 4, upfront={0, 1, 2})
    assert {e.seq_id for e in work.entries} == {3, 9}, "no branches for those drafted upfront; the prompt mirrored"
    spec.config = spec.pacing.config = RouterConfig(dynamic_k=False)
    assert not drafts_upfront(spec, step)

    spec.config = spec.pacing.config = RouterConfig()
    spec.new_step(upfront={seqs[0].seq_id})
    spec.from_draft.add(seqs[0].seq_id)
    assert spec.pipeline_outcome(seqs[0]) is None, "drafted before the step, not prepared beside the last"
    spec.new_step()
    spec.from_draft.add(seqs[0].seq_id)
    assert spec.pipeline_outcome(seqs[0]) == "hit"


def test_proposals_drafted_upfront_are_sized_as_without_pipelining():
    """An upfront call precedes its step (call, then step) as in sequential mode; priced as pipelined,
    every k > 0 would be charged the slowdown of branches that are not prepared beside the step."""
    spec = _speculator("host/cpu/0-1")
    spec.cost = StepCostModel(alpha=10.0, beta=1.0)
    spec.draft_cost.model = StepCostModel(alpha=1.0, beta=0.5)
    spec.draft_cost.slowdown = 3.0
    seq = _decoding().decodes[0][0]
    seq.tracker = AcceptanceTracker.starting_at(0.8)
    spec.choose_ks([seq], 0)
    assert seq.next_k == 0, "4 drafts at 0.8 are not worth a step three times as long"
    spec.drafting_upfront = True
    spec.choose_ks([seq], 0)
    assert seq.next_k == 4, "3.4 tokens for a 15 ms step after a 3.5 ms call"


def test_a_decoder_drafted_upfront_gets_at_least_the_k_it_wanted_when_it_was_chosen():
    """The upfront call is sized before the step is planned (without its prompt tokens): sized afresh a
    decoder could get k = 0 there and want drafts in the step, which would then run it at k = 0."""
    import asyncio
    from types import SimpleNamespace

    from router.upfront import sequential_proposals

    class Lane(SimpleNamespace):
        async def wait(self, timeout=None):  # noqa: ANN001, ANN202
            return None

        async def run(self, work, trace=None):  # noqa: ANN001, ANN202
            self.calls.append(work)
            return 0.0

    spec = _speculator("host/cpu/0-1")
    lane = Lane(up=True, info=spec.draft.info, max_k=4, budget=512, stats=spec.draft.stats, calls=[])
    spec.draft = lane
    spec.draft_cost.model = StepCostModel(alpha=500.0, beta=0.0)  # a call so dear the policy drafts nothing
    seq = _decoding().decodes[0][0]
    seq.tokens.append(7)
    seq.target_cached = len(seq.tokens) - 1  # decoding: one token out, the rest in the target's cache
    spec.scheduler.running.append(seq)
    seq.next_k = 3  # what it wanted when the last step chose it for an upfront call
    asyncio.run(sequential_proposals(spec, only={seq.seq_id}))
    assert [e.k for e in lane.calls[0].entries] == [3]
    seq.next_k = 3
    lane.calls.clear()
    asyncio.run(sequential_proposals(spec))  # sequential mode: the policy's size stands
    assert not lane.calls or not lane.calls[0].entries


def test_where_the_draft_slows_the_target_branches_are_prepared_only_if_their_hits_pay_for_the_stretch():
    """Branches beside a decode-only step slow it by (slowdown - 1) x its time; they pay only as often
    as they name the outcome (match_odds). SmolLM2's named 7-15% while slowing every step 1.1-1.25x.
    On the draft's own device, or before a slowdown is measured, they are prepared as before."""
    from router.core import GREEDY, Request
    from router.scheduler import StepPlan
    from router.sequence import Sequence

    def decoders() -> list[Sequence]:
        out = []
        for seq_id in range(4):
            req = Request(request_id=f"r{seq_id}", prompt_ids=[1, 2, 3], sampling=GREEDY, max_tokens=8)
            s = Sequence(seq_id=seq_id, request=req, tokens=[1, 2, 3, 4], num_prompt=3)
            s.next_k, s.tracker = 2, AcceptanceTracker(accepted=3, tried=10)  # a = 0.3: 0.39 tokens a hit
            out.append(s)
        return out

    def prepared(spec, hit_rate: float) -> int:
        seqs = decoders()
        spec.match_odds = Odds()
        for i in range(100):
            spec.match_odds.observe(i % 10 < 10 * hit_rate)
        spec.new_step()
        spec.from_draft.update(s.seq_id for s in seqs)  # every decoder took the draft's proposal
        return len(step_work(spec, StepPlan(decodes=[(s, 2) for s in seqs]), [[5, 6]] * 4).entries)

    shared = _speculator("host/cpu/0-1")
    assert prepared(shared, hit_rate=0.1) == 4, "no slowdown measured yet"
    for _ in range(8):
        _observe_slowdown(shared, 1.0, busy=False)
        _observe_slowdown(shared, 1.2, busy=True)
    # the step emits 4 x 1.39 tokens; a 1.2x stretch costs 1.11 of them; four hits would bring 1.56
    assert prepared(shared, hit_rate=0.1) == 0, "0.16 tokens expected for 1.11 tokens' time"
    assert prepared(shared, hit_rate=0.9) == 4
    own = _speculator("host/cpu/1")
    assert prepared(own, hit_rate=0.1) == 4, "a draft that does not slow the target: branches are free"


def test_branches_prepared_beside_a_step_are_due_when_it_answers_and_a_seeded_call_never_is():
    """The call's time to stop drafting by (DraftWork.due) is the step's modelled time at the measured
    slowdown from when the call is planned; a call carrying a seeded sequence has none (its k must not
    depend on timing), nor does one with no proposal to make."""
    import time

    from router.core import GREEDY, Request, SamplingParams
    from router.scheduler import StepPlan
    from router.sequence import Sequence

    def decoder(seq_id: int, sampling: SamplingParams = GREEDY) -> Sequence:
        req = Request(request_id=f"r{seq_id}", prompt_ids=[1, 2, 3], sampling=sampling, max_tokens=8)
        s = Sequence(seq_id=seq_id, request=req, tokens=[1, 2, 3, 4], num_prompt=3)
        s.next_k, s.tracker = 2, AcceptanceTracker(accepted=9, tried=10)
        return s

    spec = _speculator("host/cpu/1")
    spec.cost = StepCostModel(alpha=20.0, beta=0.0)
    spec.draft_cost.slowdown = 1.5
    seqs = [decoder(1), decoder(2)]
    t0 = time.perf_counter()
    work = step_work(spec, StepPlan(decodes=[(s, 2) for s in seqs]), [[5, 6]] * 2)
    assert len(work.entries) == 2
    assert t0 + 0.030 <= work.due <= time.perf_counter() + 0.030, "20 ms x 1.5 from the planning"
    seeded = decoder(3, SamplingParams(temperature=0.8, seed=7))  # waits for a plain proposal (decode_ready)
    seeded.target_cached = 3  # (tokens 1 2 3 4, one of them output: decoding)
    spec.scheduler.running.append(seeded)
    work = step_work(spec, StepPlan(decodes=[(seqs[0], 2)]), [[5, 6]])
    assert seeded in work.seqs and work.due == 0.0
    idle = decoder(4)
    idle.next_k = 0
    assert step_work(spec, StepPlan(decodes=[(idle, 0)]), [[]]).due == 0.0
