"""The speculation cache without services: which prepared branch continues a history (it must be the
one whose outcome happened), late use, pruning, the choice of branches under a budget, and the rank
statistics that choice learns from."""

from __future__ import annotations

import random

import pytest

from router.speculation import (
    CONFIDENCE_BINS,
    MAX_RANK,
    Candidate,
    OutcomeStats,
    Prepared,
    best_proposal,
    confidence_of,
    plan_branches,
    prune,
)

H = [5, 6, 7, 8]  # the history when the draft prepared; d1 d2 d3 = 20 21 22 were being verified
D = (20, 21, 22)


def branch(j: int, x: int, drafts: tuple[int, ...], rank: int = 1) -> Prepared:
    return Prepared(len(H), D[:j] + (x,), drafts, accepted=j, rank=rank)


BRANCHES = [branch(0, 30, (31, 32)), branch(0, 40, (41, 42), rank=2), branch(1, 50, (51, 52)),
            branch(3, 60, (61, 62, 63)), branch(3, 70, (71,), rank=2)]


@pytest.mark.parametrize("outcome, drafts", [
    ([30], [31, 32]),  # d1 rejected, the draft's favourite alternative was the target's token
    ([40], [41, 42]),  # ... its second choice
    ([20, 50], [51, 52]),  # d1 accepted, d2 rejected
    ([20, 21, 22, 60], [61, 62, 63]),  # all accepted, the bonus guessed
    ([20, 21, 22, 70], [71]),
    ([20, 21, 99], []),  # an outcome nobody prepared: no proposal (k = 0 this step)
    ([33], []),
])
def test_the_proposal_used_is_the_branch_whose_outcome_happened(outcome, drafts):
    got, probs = best_proposal(BRANCHES, H + outcome)
    assert got == drafts and probs == []


def test_a_late_proposal_is_used_while_the_history_agrees_with_it():
    """The draft answered after the target had already decoded one more token at k = 0: the branch
    still continues the history if that token was its first draft."""
    history = H + [20, 21, 22, 60, 61]
    assert best_proposal(BRANCHES, history)[0] == [62, 63]
    assert best_proposal(BRANCHES, H + [20, 21, 22, 60, 99])[0] == []


def test_the_longest_valid_continuation_wins():
    short = Prepared(len(H), (30,), (31,))
    assert best_proposal([short, *BRANCHES], H + [30])[0] == [31, 32]


def test_pruning_keeps_what_can_still_be_used():
    undecided = prune(BRANCHES, H + [20])  # d1 accepted so far: only j >= 1 branches can still happen
    assert {p.accepted for p in undecided} == {1, 3}
    assert prune(BRANCHES, H + [20, 21, 22, 60]) == [BRANCHES[3]]
    assert prune(BRANCHES, H + [20, 21, 22, 60, 61, 62, 63]) == [], "every draft already in the history"


def test_plan_gives_every_candidate_one_branch_and_spends_the_rest_on_the_likeliest():
    stats = OutcomeStats()
    cands = [Candidate(1, v=4, a=0.9, k=4), Candidate(2, v=4, a=0.2, k=4), Candidate(3, v=0, a=0.7, k=4)]
    plan = plan_branches(cands, stats, budget=8)
    assert sum(len(b) for b in plan.values()) == 8 and set(plan) == {1, 2, 3}
    assert plan[1][0] == (4, 1), "high acceptance: all drafts accepted, the bonus guessed, is likeliest"
    assert plan[2][0][0] == 0, "low acceptance: the first draft rejected is likeliest"
    assert plan[3][0] == (0, 1), "no drafts in flight: the next token's favourite"
    assert all(r >= 1 for b in plan.values() for _, r in b)
    small = plan_branches(cands, stats, budget=1)
    assert sorted(small) == [1, 2, 3] and all(len(b) == 1 for b in small.values()), "the budget never starves"


def test_plan_with_no_candidates_is_empty():
    assert plan_branches([], OutcomeStats(), 10) == {}


def test_rank_statistics_converge_to_the_truth_whatever_ranks_are_prepared():
    """Outcomes whose token is the draft's rank r with probability truth[r]; each time the router
    prepared a random set of ranks. The estimate per rank converges to the truth (no selection bias)."""
    truth = {1: 0.5, 2: 0.2, 3: 0.1, 4: 0.05}
    rng = random.Random(7)
    stats = OutcomeStats(decay=1.0)
    for _ in range(20_000):
        actual = rng.choices([*truth, 99], weights=[*truth.values(), 1 - sum(truth.values())])[0]
        prepared = rng.sample(range(1, MAX_RANK + 1), rng.randint(1, 4))
        stats.observe(False, prepared, actual if actual in prepared else None)
    for r, p in truth.items():
        assert stats.p(False, r) == pytest.approx(p, abs=0.02), r


def test_the_drafts_confidence_names_the_likely_outcome_where_one_acceptance_for_all_cannot():
    """d1 sure, d2 a coin toss the draft itself doubted: "d1 accepted, d2 rejected" is the likeliest
    outcome, which one acceptance rate for every draft (0.7 here) ranks below "all accepted"."""
    uniform = Candidate(1, v=3, a=0.7, k=4)
    confident = Candidate(1, v=3, a=0.7, k=4, accept=(0.98, 0.3, 0.9))
    assert [round(uniform.outcome_p(j), 3) for j in range(4)] == [0.3, 0.21, 0.147, 0.343]
    assert [round(confident.outcome_p(j), 3) for j in range(4)] == [0.02, 0.686, 0.029, 0.265]
    assert sum(confident.outcome_p(j) for j in range(4)) == pytest.approx(1.0)
    assert plan_branches([uniform], OutcomeStats(), budget=1)[1] == [(3, 1)]
    assert plan_branches([confident], OutcomeStats(), budget=1)[1] == [(1, 1)]
    assert Candidate(1, v=3, a=0.7, k=4, accept=(0.9,)).outcome_p(3) == pytest.approx(0.343), \
        "confidences that do not cover every draft are not used"


def test_acceptance_by_confidence_converges_to_the_truth_from_what_verifications_judge():
    """Drafts accepted with probability truth(confidence) until the first rejection (the target judges
    no draft after it): the learned acceptance per bin converges to the truth there, although later
    drafts are seen only when every earlier one was accepted."""
    truth = lambda c: 0.2 + 0.75 * c  # noqa: E731
    rng = random.Random(3)
    stats = OutcomeStats(decay=1.0)
    for _ in range(20_000):
        confidence = [rng.random() for _ in range(4)]
        accepted = 0
        while accepted < 4 and rng.random() < truth(confidence[accepted]):
            accepted += 1
        stats.verified(confidence, accepted)
    for b in range(CONFIDENCE_BINS):
        mid = (b + 0.5) / CONFIDENCE_BINS
        assert stats.acceptance([mid])[0] == pytest.approx(truth(mid), abs=0.03), b


def test_the_confidence_of_a_proposal_follows_it_into_a_late_history():
    p = Prepared(len(H), (), (20, 21, 22), confidence=(0.9, 0.5, 0.2))
    assert confidence_of([p], H, [20, 21]) == [0.9, 0.5]
    assert confidence_of([p], H + [20], [21, 22]) == [0.5, 0.2], "one draft already decoded at k = 0"
    assert confidence_of([p], H, [20, 99]) == [], "not the draft's proposal (prompt lookup's)"
    assert confidence_of([Prepared(len(H), (), (20, 21, 22))], H, [20]) == [], "a draft that sent none"
    assert confidence_of(BRANCHES, H + [20, 50], [51, 52]) == [], "branches without confidence"


def test_a_confidence_out_of_range_is_binned_not_raised():
    """The draft is another service: NaN, inf or a negative confidence from it lands in a bin."""
    stats = OutcomeStats()
    stats.verified([float("nan"), float("inf"), -1.0, 2.0], 3)
    assert all(0.0 <= p <= 1.0 for p in stats.acceptance([float("nan"), float("-inf"), -0.5, 1.5]))
