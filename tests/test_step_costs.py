"""The measured cost models the speculation policy prices steps with (router.step_costs): fitted
terms recovered from exact and noisy observations, small steps costed from their own means, the
draft's calls and branches, and the target's slowdown while the draft works."""

from __future__ import annotations

import itertools
import random

import pytest

from router.spec_policy import choose_k
from router.step_costs import BranchCost, Contention, DraftCost, StepCostModel


def test_cost_model_recovers_alpha_and_beta_from_exact_observations():
    m = StepCostModel()
    for n in itertools.islice(itertools.cycle([1, 8, 32, 64, 128, 5]), 40):
        m.observe(n, 3.0 + 0.05 * n)
    assert m.alpha == pytest.approx(3.0, rel=1e-6) and m.beta == pytest.approx(0.05, rel=1e-6)
    assert m.step_ms(100) == pytest.approx(8.0, rel=1e-6)


def test_cost_model_recovers_alpha_and_beta_from_noisy_observations():
    rng = random.Random(1)
    m = StepCostModel()
    for _ in range(400):
        n = rng.randint(1, 256)
        m.observe(n, (25.0 + 0.3 * n) * rng.uniform(0.95, 1.05))
    assert m.alpha == pytest.approx(25.0, rel=0.15) and m.beta == pytest.approx(0.3, rel=0.05)


def test_cost_model_follows_a_change_of_regime():
    m = StepCostModel()
    for n in itertools.islice(itertools.cycle([1, 16, 64, 200]), 200):
        m.observe(n, 3.0 + 0.05 * n)
    for n in itertools.islice(itertools.cycle([1, 16, 64, 200]), 600):
        m.observe(n, 12.0 + 0.8 * n)
    assert m.alpha == pytest.approx(12.0, rel=0.02) and m.beta == pytest.approx(0.8, rel=0.02)


def test_cost_model_keeps_its_slope_until_the_data_determine_a_line():
    m = StepCostModel()
    for _ in range(3):
        m.observe(10, 50.0)
    assert (m.alpha, m.beta) == (10.0, 1.2), "too few observations"
    for _ in range(50):
        m.observe(10, 50.0)
    # one batch size says nothing about the slope, but it does say how expensive a step is
    assert m.beta == 1.2 and m.alpha == pytest.approx(50.0 - 1.2 * 10)
    assert m.step_ms(10) == pytest.approx(50.0)
    m = StepCostModel()
    for n in itertools.islice(itertools.cycle([1, 50]), 50):
        m.observe(n, 100.0 - n)
    # a step that gets cheaper with more tokens is noise, not a slope: only the level is taken
    assert m.beta == 1.2 and m.step_ms(25.5) == pytest.approx(100.0 - 25.5, rel=0.01)


def test_cost_model_separates_the_cost_of_sequences_from_the_cost_of_tokens():
    """Measured on CPU: 4 sequences x 3 tokens cost twice 1 x 10. A tokens-only line fitted to such
    steps blames the tokens and makes every draft token look expensive at high load."""
    rng = random.Random(2)
    m = StepCostModel()
    for _ in range(300):
        seqs = rng.randint(1, 16)
        tokens = seqs * rng.randint(1, 5) + rng.choice([0, 0, 64, 128])
        m.observe(tokens, 8.0 + 0.1 * tokens + 3.0 * seqs, seqs)
    assert (m.alpha, m.beta, m.gamma) == (pytest.approx(8.0, rel=0.01), pytest.approx(0.1, rel=0.01),
                                          pytest.approx(3.0, rel=0.01))
    tokens_only = StepCostModel()
    for _ in range(300):
        seqs = rng.randint(1, 16)
        tokens = seqs * 5
        tokens_only.observe(tokens, 8.0 + 0.1 * tokens + 3.0 * seqs)  # seqs unknown to the model
    assert tokens_only.beta > 0.6, "the sequences' cost lands on the tokens"
    assert sum(choose_k([0.6] * 16, [4] * 16, 0, m)) > sum(choose_k([0.6] * 16, [4] * 16, 0, tokens_only))


def test_cost_model_with_one_sequence_per_step_keeps_gamma_and_fits_the_line():
    m = StepCostModel(gamma=2.0)
    for n in itertools.islice(itertools.cycle([1, 3, 5]), 60):
        m.observe(n, 10.0 + 0.5 * n, seqs=1)
    assert m.gamma == 2.0 and m.beta == pytest.approx(0.5) and m.step_ms(4, 1) == pytest.approx(12.0)


def test_small_steps_are_costed_from_their_own_observations_not_the_line():
    """SmolLM2 on CPU: a decode 60 ms, a 3-token verification 90, a 256-token prompt chunk 393 (1.3 ms a
    token on the line). The line prices the verification at 63 ms; the steps seen say 90."""
    m = StepCostModel()
    for n, ms in itertools.islice(itertools.cycle([(1, 60.0), (3, 90.0), (256, 60.0 + 1.3 * 256)]), 60):
        m.observe(n, ms)
    assert m.step_ms(1) == pytest.approx(60.0) and m.step_ms(3) == pytest.approx(90.0)
    assert m.step_ms(200) == pytest.approx(m.alpha + m.beta * 200) and m.beta < 1.5
    assert m.step_ms(5) == pytest.approx(m.alpha + m.beta * 5), "a size never seen: the line, until it is"
    assert choose_k([0.2], [4], 0, m) == [0], "2 drafts at 0.2 emit 1.24 tokens for 1.5x the time"
    line = StepCostModel(alpha=m.alpha, beta=m.beta)
    assert choose_k([0.2], [4], 0, line) != [0], "priced by the line, the same drafts looked worth it"


def test_a_dear_small_size_does_not_hide_cheaper_larger_ones():
    """A BLAS that runs 2 rows as two passes but blocks 3-4: one draft costs more than three."""
    m = StepCostModel()
    for n, ms in itertools.islice(itertools.cycle([(1, 60.0), (2, 100.0), (3, 80.0), (4, 82.0), (5, 110.0)]), 50):
        m.observe(n, ms)
    # k=1: 1.5 / 100 < 1 / 60; k=2: 1.75 / 80; k=3: 1.875 / 82, the best; k=4: 1.94 / 110
    assert choose_k([0.5], [4], 0, m) == [3]


def test_draft_cost_is_fitted_from_calls_of_different_sizes():
    d = DraftCost()
    for rounds in itertools.islice(itertools.cycle([2, 3, 5]), 30):
        d.observe(0.7 + 1.3 * rounds, rounds)
    assert d.model.alpha == pytest.approx(0.7, rel=0.05) and d.model.beta == pytest.approx(1.3, rel=0.05)
    assert d.step(target_ms=20.0, max_k=4) == (20.0, 1.0)  # hidden behind the target
    step_ms, ready = d.step(target_ms=3.6, max_k=4)  # a call of 5 rounds takes 7.2 ms: every other step
    assert step_ms == 3.6 and ready == pytest.approx(0.5, rel=0.05), "the target does not wait for it"
    assert d.step(target_ms=2.0, max_k=0) == (2.0, 1.0)  # no drafting, no cost
    d.pipelined = False
    assert d.step(target_ms=3.6, max_k=4) == (pytest.approx(3.6 + 7.2, rel=0.05), 1.0)


def test_draft_cost_separates_rounds_from_the_batch_they_carry():
    """A round over 16 sequences costs the draft more than a round over one: a model in rounds alone,
    fitted at low load, would call a call at c=16 cheap (and at high load one fitted there, c=1 dear)."""
    d = DraftCost()
    rng = random.Random(3)
    for _ in range(200):
        rounds, entries = rng.randint(1, 5), rng.randint(1, 16)
        d.observe(1.0 + 0.5 * rounds + 0.8 * rounds * entries, rounds, entries)
    assert d.call_ms(4, 16) == pytest.approx(1.0 + 2.5 + 0.8 * 80, rel=0.01)
    assert d.call_ms(4, 1) == pytest.approx(1.0 + 2.5 + 0.8 * 5, rel=0.01)


def test_branch_cost_charges_every_sequence_s_rounds_so_a_busy_call_affords_fewer_branches():
    """A branched Propose costs per sequence-round and per branch token. Fitted in rounds alone, a call
    carrying 16 sequences looked as cheap as one carrying one, and the branches it afforded made the
    call several target steps long."""
    b = BranchCost()
    rng = random.Random(5)
    for _ in range(200):
        rounds, entries, branch_tokens = rng.randint(1, 5), rng.randint(1, 16), rng.randint(0, 120)
        b.observe(2.0 + 0.6 * rounds * entries + 0.3 * branch_tokens, rounds * entries, branch_tokens)
    assert b.call_ms(16 * 4, 40) == pytest.approx(2.0 + 0.6 * 64 + 0.3 * 40, rel=0.01)
    one, sixteen = b.affordable(30.0, 1 * 4, k=3), b.affordable(30.0, 16 * 4, k=3)
    assert one == int((30.0 - 2.0 - 0.6 * 4) / (0.6 * 3))  # a branch token charged at least a round's cost
    assert sixteen == 0  # the rounds alone overrun the step: no branches beyond one per sequence


def _flat(tokens: int, seqs: int) -> float:
    return 10.0


def test_contention_is_the_slowdown_of_steps_with_the_draft_busy_and_never_below_one():
    c = Contention(_flat)
    for _ in range(3):
        c.observe(15.0, 1, 1, draft_busy=True)
        c.observe(10.0, 1, 1, draft_busy=False)
    assert c.factor == 1.0, "too few samples of each kind: no charge yet"
    for _ in range(20):
        c.observe(15.0, 1, 1, draft_busy=True)
        c.observe(10.0, 1, 1, draft_busy=False)
    assert c.factor == pytest.approx(1.5)
    for _ in range(400):
        c.observe(9.0, 1, 1, draft_busy=True)
        c.observe(10.0, 1, 1, draft_busy=False)
    assert c.factor == 1.0, "a draft on its own device does not speed the target up"


def test_a_contention_estimate_outlives_a_long_run_of_steps_of_one_kind():
    """A pipelined draft busy on every step, or one the policy stopped using, must not erase what was
    measured: each side keeps its own last samples."""
    c = Contention(_flat)
    for _ in range(10):
        c.observe(14.0, 1, 1, draft_busy=True)
        c.observe(10.0, 1, 1, draft_busy=False)
    assert c.measured and c.factor == pytest.approx(1.4)
    for _ in range(1000):
        c.observe(10.0, 1, 1, draft_busy=False)
    assert c.factor == pytest.approx(1.4)
    for _ in range(1000):
        c.observe(14.0, 1, 1, draft_busy=True)
    assert c.factor == pytest.approx(1.4)


def test_contention_prices_every_sample_by_the_model_as_it_is_now_not_as_it_was_when_taken():
    """The first idle steps of a load are priced by a model still at its priors (SmolLM2: 15 ms for a
    step that took 110): a ratio kept from then would read every later busy step as no slower."""
    model = StepCostModel()
    c = Contention(model.step_ms)
    for _ in range(4):  # the load's first steps rest the draft; the model knows nothing yet
        c.observe(110.0, 4, 4, draft_busy=False)
        model.observe(4, 110.0, 4)
    for _ in range(40):
        c.observe(132.0, 4, 4, draft_busy=True)
        model.observe(4, 132.0 / c.factor, 4)
    assert c.factor == pytest.approx(1.2, rel=0.02)


def test_contention_compares_busy_and_idle_steps_of_about_one_size():
    """The model's error depends on a step's size: busy steps of 8 sequences are compared with idle steps of
    8, not with the idle steps of a load of one before them, and a size not yet seen on both sides keeps
    the factor measured last."""
    model_error = {1: 1.0, 8: 1.5}  # the model prices steps of 8 sequences a third too cheap
    c = Contention(_flat)
    for _ in range(8):
        c.observe(10.0 * model_error[1], 1, 1, draft_busy=False)
        c.observe(12.0 * model_error[1], 1, 1, draft_busy=True)
    assert c.factor == pytest.approx(1.2)
    for _ in range(8):
        c.observe(13.0 * model_error[8], 8, 8, draft_busy=True)
    assert c.factor == pytest.approx(1.2), "no idle step of 8 yet: 1.95 against the idle steps of one"
    assert not c.knows(8) and c.knows(1)
    for _ in range(4):
        c.observe(10.0 * model_error[8], 8, 8, draft_busy=False)
    assert c.knows(8)
    assert c.factor == pytest.approx(1.3)
