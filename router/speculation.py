"""The speculation cache: proposals prepared for the likely outcomes of a verification in flight.

While the target verifies d_1..d_v of a sequence, the draft prepares branches: "d_1..d_j accepted,
then token x" for the most probable (j, x), x the draft's rank-r candidate there. When the target
answers, the branch whose outcome happened is the next step's proposal (SSD/Saguaro's
pre-speculation; SGLang's enumeration design; PEARL's pre-verify/post-verify).

    history h (n tokens) | d1 d2 d3 under verification
    outcome "d1 accepted, then x":  h d1 x | e1 e2 e3 e4     <- branch (j=1, x = rank r after d1)
    outcome "all accepted, bonus":  h d1 d2 d3 y | e1 .. e4   <- branch (j=3, y = rank r after d3)

A prepared proposal is used only where its outcome is a prefix of the history, with its exact q,
so losslessness does not depend on guessing right: a miss only costs that sequence its speculation
for one step. A late proposal is still used while it agrees with the history.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from router.spec_policy import expected_tokens
from tandem.v1 import common_pb2

MAX_RANK = 8  # candidates considered per outcome position
CONFIDENCE_BINS = 10  # the draft's confidence in a draft, in bins of 0.1, for its chance of acceptance
Proposal = tuple[list[int], list[common_pb2.SparseDist]]  # drafts and their q (empty when greedy)


def point_guesses(drafts: Seq[int]) -> list[common_pb2.SparseDist]:
    """The q of guesses that carry no distribution (prompt lookup's): 1 on each guessed token, so strict
    rejection sampling accepts one with the target's probability of it and stays exact."""
    return [common_pb2.SparseDist(token_ids=[t], probs=[1.0]) for t in drafts]


@dataclass(frozen=True)
class Prepared:
    """After history[:start]: the outcome `prefix` it bets on, then `drafts` with their q (empty when greedy)."""

    start: int
    prefix: tuple[int, ...]
    drafts: tuple[int, ...]
    probs: tuple[common_pb2.SparseDist, ...] = ()
    accepted: int = 0  # the outcome (j, rank); rank 0: a plain continuation
    rank: int = 0
    confidence: tuple[float, ...] = ()  # per draft: the draft's probability of it (empty: not sent)

    def remaining(self, history: Seq[int]) -> int:
        """How many leading drafts the history already holds (-1: the proposal does not continue it)."""
        end = self.start + len(self.prefix)
        seen = len(history) - end
        if seen < 0 or seen > len(self.drafts) or tuple(history[self.start:end]) != self.prefix:
            return -1
        if seen and tuple(history[end:]) != self.drafts[:seen]:
            return -1
        return seen


def best_proposal(prepared: list[Prepared], history: Seq[int]) -> Proposal:
    """The longest still-valid continuation of `history` among the prepared ones: (drafts, their q)."""
    best: Proposal = ([], [])
    for p in prepared:
        seen = p.remaining(history)
        if seen >= 0 and len(p.drafts) - seen > len(best[0]):
            best = (list(p.drafts[seen:]), list(p.probs[seen:]))
    return best


def confidence_of(prepared: list[Prepared], history: Seq[int], drafts: Seq[int]) -> list[float]:
    """The draft's confidence in each of `drafts` after `history`, from the proposal they came from
    ([] where none holds them with its confidence: prompt lookup's guesses, a draft that sent none)."""
    for p in prepared:
        seen = p.remaining(history)
        if seen >= 0 and len(p.confidence) == len(p.drafts) and p.drafts[seen:seen + len(drafts)] == tuple(drafts):
            return list(p.confidence[seen:seen + len(drafts)])
    return []


def prune(prepared: list[Prepared], history: Seq[int]) -> list[Prepared]:
    """Drop what can no longer continue the history (it only grows)."""
    return [p for p in prepared if len(history) < p.start + len(p.prefix) or 0 <= p.remaining(history) < len(p.drafts)]


@dataclass
class _Counts:
    """Decayed hits / trials per index: a rank, or a bin of the draft's confidence."""

    hits: list[float]
    trials: list[float]

    def p(self, i: int) -> float:
        return self.hits[i] / self.trials[i]

    def add(self, i: int, hit: bool, decay: float) -> None:
        self.trials[i] = decay * self.trials[i] + 1
        self.hits[i] = decay * self.hits[i] + (1.0 if hit else 0.0)


def _prior(first: float, decay: float) -> _Counts:
    """Pseudo-counts worth 4 observations: P(rank r) = first * decay^(r-1)."""
    return _Counts([0.0] + [4.0 * first * decay ** (r - 1) for r in range(1, MAX_RANK + 1)],
                   [1.0] + [4.0] * MAX_RANK)


def _confidence_bin(confidence: float) -> int:
    """The bin of 1 / CONFIDENCE_BINS holding a confidence; a broken draft's NaN or inf: the lowest."""
    if not math.isfinite(confidence):
        return 0
    return min(max(int(confidence * CONFIDENCE_BINS), 0), CONFIDENCE_BINS - 1)


@dataclass
class OutcomeStats:
    """How verifications turn out, for choosing the outcomes to prepare: how often the target's next
    token is the draft's rank-r candidate, after a rejection (the corrected token, the draft's rejected
    favourite excluded) and after full acceptance (the bonus), learned from the branches the router
    prepared (which ranks it prepares never depends on the outcome, so hits / trials per rank is
    unbiased); and how often a draft is accepted at each confidence the draft had in it."""

    corrected: _Counts = field(default_factory=lambda: _prior(0.35, 0.55))
    bonus: _Counts = field(default_factory=lambda: _prior(0.6, 0.4))
    # P(a draft is accepted | the draft's confidence in it), per bin, a prior worth 4 trials at 0.5: the demo
    # draft's 0.1-0.2 bin is accepted at 0.65 and its 0.3-0.5 at 0.93, SmolLM2's at 0.08 and 0.3
    by_confidence: _Counts = field(default_factory=lambda: _Counts([2.0] * CONFIDENCE_BINS, [4.0] * CONFIDENCE_BINS))
    decay: float = 0.999

    def p(self, full: bool, rank: int) -> float:
        return (self.bonus if full else self.corrected).p(rank)

    def acceptance(self, confidence: Seq[float]) -> tuple[float, ...]:
        """Each draft's chance of acceptance (given those before it were accepted), from its confidence."""
        return tuple(self.by_confidence.p(_confidence_bin(c)) for c in confidence)

    def verified(self, confidence: Seq[float], accepted: int) -> None:
        """A verification of drafts with these confidences accepted `accepted`: the drafts up to the
        first rejected one were judged (those after it were not)."""
        for i, c in enumerate(confidence[:accepted + 1]):
            self.by_confidence.add(_confidence_bin(c), i < accepted, self.decay)

    def observe(self, full: bool, ranks: Seq[int], hit: int | None) -> None:
        """ranks: those prepared for the outcome that happened; hit: the one that matched (or None)."""
        counts = self.bonus if full else self.corrected
        for r in ranks:
            counts.add(r, r == hit, self.decay)


@dataclass(frozen=True)
class Candidate:
    """A sequence whose next outcome the draft may prepare: v drafts being verified (0: a plain
    decode or a first token) at per-token acceptance a, k drafts per branch, each accepted at
    draft_a (the draft model's acceptance; a is prompt lookup's where the step verifies its guesses).
    Valued at a, SmolLM2's branches looked worth 2 tokens where the draft's 0.22 gives 0.28, and on
    shared cores they slowed its decode steps 1.6x for nothing."""

    key: int
    v: int
    a: float
    k: int
    draft_a: float | None = None  # None: a
    accept: tuple[float, ...] = ()  # per draft under verification, its chance of acceptance (empty: a each)

    def outcome_p(self, j: int) -> float:
        """P(exactly j of the v drafts are accepted)."""
        accept = self.accept if len(self.accept) == self.v else (self.a,) * self.v
        p = math.prod(accept[:j])
        return p * (1.0 - accept[j]) if j < self.v else p

    @property
    def gain(self) -> float:
        """Expected tokens a branch's proposal adds beyond the one a plain decode emits."""
        return expected_tokens(self.a if self.draft_a is None else self.draft_a, self.k) - 1.0


def plan_branches(cands: list[Candidate], stats: OutcomeStats, budget: int) -> dict[int, list[tuple[int, int]]]:
    """Choose up to `budget` branches (j, rank) over all candidates by expected value: the outcome's
    probability times the tokens its proposal would yield. Every candidate gets its most valuable one."""
    scored: list[tuple[float, int, int, int]] = []  # (-value, key, j, rank)
    ranks = range(1, MAX_RANK + 1)
    p_rank = {full: [stats.p(full, r) for r in ranks] for full in (False, True)}  # P(the target's token is rank r)
    for c in cands:
        gain = c.gain
        for j in range(c.v + 1):
            p_j = c.outcome_p(j)
            for r, p_r in zip(ranks, p_rank[j == c.v], strict=True):
                scored.append((-(p_j * p_r * gain), c.key, j, r))
    heapq.heapify(scored)
    plan: dict[int, list[tuple[int, int]]] = {}
    rest: list[tuple[float, int, int, int]] = []
    while scored:
        item = heapq.heappop(scored)
        if item[1] not in plan:
            plan[item[1]] = [(item[2], item[3])]
        else:
            rest.append(item)
    for _, key, j, r in rest[:max(0, budget - len(plan))]:
        plan[key].append((j, r))
    return plan
