"""Speculation length per sequence per step: expected goodput under a measured step-cost model.

Expected tokens one verification of k drafts emits, for per-token acceptance a:
    E(k) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)
The target's step time grows with the tokens it scores and the sequences they belong to,
t(N, S) = alpha + beta * N + gamma * S (fitted online from the router's step wall times).
SmartSpec-style, the policy adds draft tokens while the decoders' goodput sum(E_i) / t_d stops
improving, t_d the step's time less what its P prompt tokens add (beta * P): large batches are
compute-bound (beta*N dominates) and get small k; a sequence whose drafts keep failing has a
small a and drops to 0. The draft's cost (DraftCost) enters as the share of steps its proposals
are ready for when pipelined, as time added to the step when sequential.

Prompt tokens are not output: they cost beta in whichever step runs them, and a draft token that
displaces one from a full budget defers it to the next step rather than losing it. Counting them as
emitted tokens made every draft token (yield a^j < 1) lose to a prompt token, so under a prefill
backlog dynamic k fell to 0.4 against 3.8 in decode-only steps (bench, demo pair, c=16).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.step_costs import SMALL_STEP, DraftCost, StepCostModel


def expected_tokens(a: float, k: int) -> float:
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class AcceptanceTracker:
    """Decayed counts of draft positions tried and accepted; prior 0.7 worth two trials. A sequence
    not speculating drifts back toward `prior` (2% a step) so that it gets another try."""

    accepted: float = 1.4
    tried: float = 2.0
    decay: float = 0.9
    prior: float = 0.7
    drift: float = 0.02

    @classmethod
    def starting_at(cls, rate: float) -> AcceptanceTracker:
        """A new sequence's tracker with `rate` as its prior (the pool's, AcceptancePool), worth two trials."""
        return cls(accepted=2.0 * rate, tried=2.0, prior=rate)

    @property
    def rate(self) -> float:
        return self.accepted / self.tried

    def update(self, k: int, num_accepted: int) -> None:
        if k == 0:
            self.untried(self.prior)
            return
        trials = num_accepted + (1 if num_accepted < k else 0)  # positions up to the first rejection
        self.accepted = self.decay * self.accepted + num_accepted
        self.tried = self.decay * self.tried + trials

    def untried(self, toward: float) -> None:
        """A step that verified none of these proposals: no evidence, a little drift toward `toward`."""
        self.accepted = (1.0 - self.drift) * self.accepted + self.drift * toward
        self.tried = (1.0 - self.drift) * self.tried + self.drift


@dataclass
class AcceptancePool:
    """Every sequence's verifications of one kind of proposal (the draft's, prompt lookup's), pooled: the
    prior a new sequence starts from, and what one that stopped speculating drifts back to. A fixed
    optimistic prior made every request of a pair whose drafts are rarely accepted speculate at 0.7
    for its first steps, and again whenever its estimate had drifted back up: SmolLM2's 2-layer
    draft (served acceptance 0.2-0.3) cost (6) 8% of (1)'s tokens/s at c=1 that way.
    Steps without speculation are no evidence, but the pool drifts back to the optimistic prior on
    them, over a few thousand sequence-steps (a sequence: a few dozen): were its rate too low for
    any k to pay, nothing would speculate to correct it, and a server would never speculate again
    (a new workload, a better draft behind the same address).
    The prior is worth ten trials, not a sequence's two: the bench's warm-up (four requests of eight
    tokens) failed two lookups and left the pool at 0.35 for the load after it."""

    pooled: AcceptanceTracker = field(default_factory=lambda: AcceptancePool.prior(drift=0.002))

    @staticmethod
    def prior(drift: float) -> AcceptanceTracker:
        """The optimistic 0.7 worth ten trials, decaying over about fifty."""
        return AcceptanceTracker(accepted=7.0, tried=10.0, decay=0.98, drift=drift)

    @classmethod
    def for_lookup(cls) -> AcceptancePool:
        """Prompt lookup's pool drifts back ten times faster (hundreds of sequence-steps): its guesses cost
        no draft work, a wrong one only its verification slots, so another try is cheap."""
        return cls(cls.prior(drift=0.02))

    def observe(self, k: int, num_accepted: int) -> None:
        self.pooled.update(k, num_accepted)

    def passed(self, seq_tracker: AcceptanceTracker) -> None:
        """A sequence had a proposal of this kind and verified another (or none): no evidence for either
        estimate, which drift, the sequence's toward the pool's rate and the pool toward its prior. Left
        alone, prompt lookup's estimates froze wherever its last verification left them while the draft's
        proposals were preferred: a pool at 0.23 (its long-run rate 0.8-0.9) made resting steps verify
        lookup at small k, and demo shared c=1 ran at 0.53x of lookup alone."""
        self.pooled.update(0, 0)
        seq_tracker.untried(self.pooled.rate)

    def tracker(self) -> AcceptanceTracker:
        return AcceptanceTracker.starting_at(self.pooled.rate)


def worth_waiting_ms(step_ms: float, tokens: float, gain: float, odds: float) -> float:
    """How long a step may wait for proposals that add `gain` expected tokens to the `tokens` it emits
    without them, when they arrive in time with probability `odds`: waiting w pays while (tokens + gain)
    / (step + w) > tokens / step, i.e. w < step * gain / tokens, and a wait that may be in vain is
    worth that times its odds. Never more than half a step: a call later than that is not about to
    land, whatever its proposals are worth."""
    if gain <= 0 or tokens <= 0:
        return 0.0
    return step_ms * min(0.5, odds * gain / tokens)


@dataclass
class Odds:
    """A decayed share of tries that succeeded (a wait that saw its call arrive, a prepared branch that
    matched the outcome); prior one in two."""

    hits: float = 1.0
    tries: float = 2.0
    decay: float = 0.95

    @property
    def rate(self) -> float:
        return self.hits / self.tries

    def observe(self, hit: bool) -> None:
        self.hits = self.decay * self.hits + hit
        self.tries = self.decay * self.tries + 1


def choose_k(rates: list[float], caps: list[int], base_tokens: int, cost: StepCostModel,
             draft: DraftCost | None = None, drafted: list[bool] | None = None, base_seqs: int = 0) -> list[int]:
    """Per-sequence k maximising expected tokens per ms, each k_i <= caps[i]: the step emits
    base_tokens + sum(E_i(k_i)), the draft's proposals counting only for the share of steps they are
    ready for, and takes the target's t(base_tokens + sum(1 + k_i)) with the draft's max_k + 1 rounds
    (DraftCost.step). max_k is taken over the sequences the draft model proposes for (`drafted`,
    default all): prompt-lookup guesses cost no draft work and are always ready.

    For each draft depth m (= max_k) the draft's cost is fixed and every extra draft token costs the
    target the same, so the best ks take the increments E(a, j) - E(a, j - 1) = a^j in order of value
    while they raise the goodput; the best m wins. (Raising k one sequence at a time instead stops
    where deepening the draft for one sequence slows it for all, though deepening it for all pays.)

    base_tokens: tokens already in the step that are not verifications (prompt chunks). Their own cost
    (beta each) is theirs: the decoders' goodput is measured over the rest of the step, so a prompt
    chunk changes k only through the time it gives the draft (a longer step, more proposals ready).
    base_seqs: the sequences those prompt tokens belong to (each costs the step gamma)."""
    draft = draft or DraftCost()
    drafted = drafted if drafted is not None else [True] * len(rates)
    deepest = max((c for c, d in zip(caps, drafted, strict=True) if d), default=0)
    best_ks, best = [0] * len(rates), -1.0
    for m in range(deepest + 1):
        ks, goodput = _fill(rates, caps, drafted, m, base_tokens, base_seqs, cost, draft)
        if goodput > best * 1.0001:
            best_ks, best = ks, goodput
    return best_ks


def _fill(rates: list[float], caps: list[int], drafted: list[bool], depth: int, base_tokens: int, base_seqs: int,
          cost: StepCostModel, draft: DraftCost) -> tuple[list[int], float]:
    """The best ks with the draft drafting `depth` tokens deep, and their goodput."""
    seqs, entries = base_seqs + len(rates), sum(drafted)
    prompt_ms = cost.beta * base_tokens * draft.stretch(depth)  # what the prompt tokens add to the step

    def goodput(tokens: int, looked: float, by_draft: float) -> tuple[float, float]:
        step_ms, ready = draft.step(cost.step_ms(tokens, seqs), depth, entries)
        return (len(rates) + looked + ready * by_draft) / (step_ms - prompt_ms), ready

    tokens = base_tokens + len(rates)
    looked = by_draft = 0.0  # expected tokens beyond each verification's one, from lookup / from the draft
    best, ready = goodput(tokens, 0.0, 0.0)
    deepest = [min(c, depth) if d else c for c, d in zip(caps, drafted, strict=True)]
    increments = sorted(((a ** j * (ready if d else 1.0), a ** j, i) for i, (a, d) in enumerate(zip(rates, drafted,
                         strict=True)) for j in range(1, deepest[i] + 1)), reverse=True)
    ks = [0] * len(rates)
    best_ks = ks[:]
    for _, more, i in increments:
        trial = goodput(tokens + 1, looked + (0.0 if drafted[i] else more), by_draft + (more if drafted[i] else 0.0))[0]
        pays = trial > best * 1.0001
        if not pays and tokens + 1 > SMALL_STEP:
            break  # on the line, an increment that does not pay is followed by smaller ones
        tokens, ks[i] = tokens + 1, ks[i] + 1
        looked, by_draft = (looked, by_draft + more) if drafted[i] else (looked + more, by_draft)
        if pays:  # small sizes are costed one by one: a dearer one may precede cheaper ones
            best, best_ks = trial, ks[:]
    return best_ks, best
