"""What steps cost, measured online: the target's step time by size (StepCostModel), how much the
draft's work slows it (Contention), what drafting adds to a step (DraftCost) and what a branched
Propose costs (BranchCost). Each is a small least-squares fit over exponentially decayed
observations (_Normal3), with priors until the data determine its terms; router.spec_policy
chooses k with them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Contention:
    """How much slower the target's steps run while the draft works (draft and target sharing cores or
    a GPU): the mean of observed / modelled step time over recent steps with the draft busy, over the
    same on recent steps with it idle. Each side keeps its own last samples, so the estimate outlives a
    long run of one kind (a draft busy on every step, or one the policy stopped using), and every sample
    is priced again by the current model (`price`, the target's step time at draft-idle speed): a ratio
    fixed when taken would keep the model's error of that moment. SmolLM2 on shared cores: the first
    idle steps, priced by the priors at 15-17 ms, took 110-130, and that idle mean held the factor at
    1.0 for a whole load while busy steps ran 1.2x slower.

    The two sides are compared at about the step's size (`near`: sequences within a factor of NEAR),
    because the model's error depends on size: on the demo pair a load of c = 4 after one of c = 1
    compared its busy steps with c = 1's idle ones (1.2 where c = 4's own read 1.5-1.7), and the end of
    a c = 16 load compared its shrinking idle steps with c = 16's busy ones (2.3). Until both sides hold
    MIN_SAMPLES steps near the current size the factor keeps its last value (`knows` tells the pacing
    to rest the draft on a probe step); it is 1.0 until first measured, and never below 1."""

    price: Callable[[int, int], float]  # (tokens, seqs) -> ms
    busy: deque[tuple[float, int, int]] = field(default_factory=lambda: deque(maxlen=BUSY_SAMPLES))
    idle: deque[tuple[float, int, int]] = field(default_factory=lambda: deque(maxlen=IDLE_SAMPLES))
    factor: float = 1.0

    def observe(self, observed_ms: float, tokens: int, seqs: int, draft_busy: bool) -> None:
        (self.busy if draft_busy else self.idle).append((observed_ms, tokens, seqs))
        busy, idle = self.near(self.busy, seqs), self.near(self.idle, seqs)
        if len(busy) >= MIN_SAMPLES and len(idle) >= MIN_SAMPLES:
            self.factor = max(1.0, self._mean_ratio(busy) / self._mean_ratio(idle))

    def _mean_ratio(self, samples: list[tuple[float, int, int]]) -> float:
        return sum(ms / max(self.price(tokens, seqs), 1e-6) for ms, tokens, seqs in samples) / len(samples)

    @staticmethod
    def near(samples: deque[tuple[float, int, int]], seqs: int) -> list[tuple[float, int, int]]:
        """The samples of steps about as large as one of `seqs` sequences."""
        return [s for s in samples if max(s[2], seqs) <= NEAR * max(min(s[2], seqs), 1)]

    def knows(self, seqs: int) -> bool:
        """Whether enough idle steps about as large as one of `seqs` sequences are held to compare with."""
        return len(self.near(self.idle, seqs)) >= MIN_SAMPLES

    @property
    def measured(self) -> bool:
        return self.seen(busy=True) and self.seen(busy=False)

    def seen(self, busy: bool) -> bool:
        """At least MIN_SAMPLES steps of that kind."""
        return len(self.busy if busy else self.idle) >= MIN_SAMPLES


MIN_SAMPLES = 4  # of each kind, about the step's size, before the factor is (re)computed
BUSY_SAMPLES = 32  # steps with the draft busy come every step: the last 32 follow a change of load
IDLE_SAMPLES = 8  # idle ones come on probes (pacing.PROBE_EVERY, more after a change of size) and upfront
NEAR = 2  # steps of S and S' sequences are about as large when max(S, S') <= NEAR * min(S, S')


# Steps of at most this many tokens are costed from their own observations, once seen. Where a
# comparison straddles it (a base step of 8 tokens, one draft more) the two sides come from different
# estimates; 8 keeps that seam below c = 16, where the line is measured well.
SMALL_STEP = 8


@dataclass
class _SizeCost:
    """Decayed sums of the observed steps of one size: their ms and their sequences."""

    ms: float = 0.0
    seqs: float = 0.0
    n: float = 0.0


@dataclass
class StepCostModel:
    """t(N, S) = alpha + beta * N + gamma * S for a step scoring N tokens of S sequences: least squares
    over exponentially decayed observations. Sequences cost apart from tokens (attention over each one's
    paged KV, its sampling): measured on the demo pair on CPU, 4 sequences x 3 tokens took twice the
    time of 1 x 10. Terms the data cannot determine keep their values: with one sequence per step
    gamma is not separable from alpha; with one size seen only the level is fitted.

    Small steps are not on that line: a memory-bound decode pays for streaming the weights once, and a
    CPU BLAS may run 2-3 rows as that many passes (engine/linear.py). SmolLM2 on CPU, one thread:
    1 token 60 ms, 3 tokens 85-125 ms, while prompt chunks of 256 set the slope at ~1.3 ms a token, so
    the line priced a verification of 2 drafts at 1.04x a decode, and k = 2 at acceptance 0.2 lost to
    k = 0. A size of at most SMALL_STEP tokens seen a few times is costed from its own mean (adjusted
    by gamma for its sequences); an unseen one from the line, which the policy then tries and learns."""

    alpha: float = 10.0  # ms; priors from CPU measurements: 6 tokens cost ~1.6x one
    beta: float = 1.2
    gamma: float = 0.0
    _sums: _Normal3 = field(default_factory=lambda: _Normal3())
    _small: dict[int, _SizeCost] = field(default_factory=dict)

    def observe(self, tokens: int, ms: float, seqs: int = 1, decay: float = 0.98) -> None:
        if tokens <= SMALL_STEP:
            size = self._small.setdefault(tokens, _SizeCost())
            size.ms, size.seqs, size.n = decay * size.ms + ms, decay * size.seqs + seqs, decay * size.n + 1
        s = self._sums
        s.add((1.0, float(tokens), float(seqs)), ms, decay)
        if s.n <= 4:
            return
        full = s.solve()
        if full is not None and full[0] > 0 and full[1] > 0 and full[2] >= 0:
            self.alpha, self.beta, self.gamma = full
            return
        line = s.solve_without(2, self.gamma)  # gamma kept: a line in N
        if line is not None and line[0] > 0 and line[1] > 0:
            self.alpha, self.beta = line[0], line[1]
            return
        # one size seen so far, or a slope that is noise: keep the slopes, fit the level so the mean is right
        alpha = s.level(self.beta, self.gamma)
        if alpha > 0:
            self.alpha = alpha

    def step_ms(self, tokens: int, seqs: int = 1) -> float:
        size = self._small.get(tokens)
        if size is not None and size.n >= 2.5:
            return (size.ms + self.gamma * (seqs * size.n - size.seqs)) / size.n
        return self.alpha + self.beta * tokens + self.gamma * seqs


@dataclass
class DraftCost:
    """What drafting does to a step. A Propose call of r batched rounds over n sequences costs
    alpha + beta * r + gamma * r * n (fitted like the target's), and a step drafts max_k + 1 rounds
    for the next one (its drafts plus the bonus guess).
    Sequential, the call precedes the step: the two add up. Pipelined, the target never waits for
    the draft: the step costs the target's time (slowed by the draft's work where they share compute),
    and a draft slower than the target has proposals ready for only target / draft of the steps."""

    model: StepCostModel = field(default_factory=lambda: StepCostModel(alpha=1.0, beta=0.5))
    pipelined: bool = True
    slowdown: float = 1.0  # the target's step time while the draft works over without (Contention.factor)
    # A chained step's proposals (router.chain) come from a call that landed already, and a call late for
    # the step after it costs that step its chaining (a round trip), not its drafts: all are ready.
    always_ready: bool = False

    def observe(self, ms: float, rounds: int, entries: int = 1) -> None:
        if rounds > 0:
            self.model.observe(rounds, ms, rounds * entries)

    def call_ms(self, max_k: int, entries: int = 1) -> float:
        return self.model.step_ms(max_k + 1, (max_k + 1) * entries)

    def stretch(self, max_k: int) -> float:
        """Step ms per ms of the target's own time: the slowdown while a pipelined draft works."""
        return self.slowdown if self.pipelined and max_k > 0 else 1.0

    def step(self, target_ms: float, max_k: int, entries: int = 1) -> tuple[float, float]:
        """(the step's time, the share of steps the draft's proposals are ready for)."""
        if max_k == 0:
            return target_ms, 1.0
        draft_ms = self.call_ms(max_k, entries)
        if not self.pipelined:
            return target_ms + draft_ms, 1.0
        step_ms = target_ms * self.stretch(max_k)
        return step_ms, 1.0 if self.always_ready else min(1.0, step_ms / draft_ms)


@dataclass
class BranchCost:
    """What a branched Propose costs: ms = a + b * entry_rounds + c * branch_tokens, where entry_rounds
    is rounds x sequences in the call (every sequence runs every round) and branch_tokens is branches x
    drafts each; least squares over decayed observations, priors until the data determine the terms.
    A model in rounds alone charged nothing for a sequence more: at c=16 it let a call grow to 280
    branches and 140-460 ms against 65 ms target steps."""

    a: float = 1.0
    b: float = 0.5
    c: float = 0.05
    _sums: _Normal3 = field(default_factory=lambda: _Normal3())

    def observe(self, ms: float, entry_rounds: int, branch_tokens: int, decay: float = 0.98) -> None:
        self._sums.add((1.0, float(entry_rounds), float(branch_tokens)), ms, decay)
        if self._sums.n < 8:
            return
        fitted = self._sums.solve()
        if fitted is not None and min(fitted) >= 0.0 and fitted[2] > 0.0:
            self.a, self.b, self.c = fitted

    def call_ms(self, entry_rounds: int, branch_tokens: int) -> float:
        return self.a + self.b * entry_rounds + self.c * branch_tokens

    def affordable(self, within_ms: float, entry_rounds: int, k: int) -> int:
        """How many branches of k drafts fit in within_ms. A branch token is charged at least what a
        sequence's round costs: the fit may put branch work on b (both grow with the load)."""
        spare = within_ms - self.call_ms(entry_rounds, 0)
        return max(0, int(spare / (max(self.c, self.b) * max(1, k))))


class _Normal3:
    """Decayed normal equations of y = x . theta for x = (1, x1, x2)."""

    def __init__(self) -> None:
        self.xx = [[0.0] * 3 for _ in range(3)]
        self.xy = [0.0] * 3

    @property
    def n(self) -> float:
        return self.xx[0][0]

    def add(self, x: tuple[float, float, float], y: float, decay: float) -> None:
        for i in range(3):
            self.xy[i] = decay * self.xy[i] + x[i] * y
            for j in range(3):
                self.xx[i][j] = decay * self.xx[i][j] + x[i] * x[j]

    def solve(self) -> tuple[float, float, float] | None:
        return _solve([row[:] for row in self.xx], self.xy[:])  # type: ignore[return-value]

    def solve_without(self, j: int, theta_j: float) -> tuple[float, ...] | None:
        """The fit of the other two terms with term j held at theta_j (returned in place)."""
        keep = [i for i in range(3) if i != j]
        fitted = _solve([[self.xx[r][c] for c in keep] for r in keep],
                        [self.xy[r] - self.xx[r][j] * theta_j for r in keep])
        if fitted is None:
            return None
        out = dict(zip(keep, fitted, strict=True)) | {j: theta_j}
        return tuple(out[i] for i in range(3))

    def level(self, b1: float, b2: float) -> float:
        """The intercept that makes the mean right with the slopes held."""
        return (self.xy[0] - b1 * self.xx[0][1] - b2 * self.xx[0][2]) / self.n


def _solve(m: list[list[float]], y: list[float]) -> tuple[float, ...] | None:
    """Gaussian elimination for small normal equations; None when they are (nearly) singular."""
    size = len(y)
    a = [row[:] + [v] for row, v in zip(m, y, strict=True)]
    scale = max(1.0, max(abs(a[i][i]) for i in range(size)))
    for col in range(size):  # (in place: it runs several times a step)
        pivot = col
        for r in range(col + 1, size):
            if abs(a[r][col]) > abs(a[pivot][col]):
                pivot = r
        if abs(a[pivot][col]) < 1e-9 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        lead = a[col]
        for r in range(size):
            if r != col:
                row = a[r]
                f = row[col] / lead[col]
                for c in range(size + 1):
                    row[c] -= f * lead[c]
    return tuple(a[i][size] / a[i][i] for i in range(size))
