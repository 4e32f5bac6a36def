"""Speculation length per sequence per step: expected goodput under a measured step-cost model.

Expected tokens one verification of k drafts emits, for per-token acceptance a:
    E(k) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)
The target's step time grows with the tokens it scores, t(N) = alpha + beta * N (fitted online
from the target's forward times). SmartSpec-style, the policy raises the k of whichever sequence
gains most until goodput (P + sum(E_i)) / t(N) stops improving, P the prompt tokens the step also
processes: large batches and prefill-heavy steps are compute-bound (beta*N dominates) and get small k;
a sequence whose drafts keep failing has a small a and drops to 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(a: float, k: int) -> float:
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class AcceptanceTracker:
    """Decayed counts of draft positions tried and accepted; prior 0.7 worth two trials."""

    accepted: float = 1.4
    tried: float = 2.0
    decay: float = 0.9

    @property
    def rate(self) -> float:
        return self.accepted / self.tried

    def update(self, k: int, num_accepted: int) -> None:
        if k == 0:
            # drift back toward the prior so a sequence that stopped speculating gets another try
            self.accepted = 0.98 * self.accepted + 0.02 * 0.7
            self.tried = 0.98 * self.tried + 0.02
            return
        trials = num_accepted + (1 if num_accepted < k else 0)  # positions up to the first rejection
        self.accepted = self.decay * self.accepted + num_accepted
        self.tried = self.decay * self.tried + trials


@dataclass
class StepCostModel:
    """t(N) = alpha + beta * N, least squares over exponentially decayed observations."""

    alpha: float = 10.0  # ms; priors from CPU measurements: 6 tokens cost ~1.6x one
    beta: float = 1.2
    _n: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0

    def observe(self, tokens: int, ms: float, decay: float = 0.98) -> None:
        self._n = decay * self._n + 1
        self._sx = decay * self._sx + tokens
        self._sy = decay * self._sy + ms
        self._sxx = decay * self._sxx + tokens * tokens
        self._sxy = decay * self._sxy + tokens * ms
        var = self._n * self._sxx - self._sx**2
        if self._n <= 4:
            return
        if var > 1e-6 * max(1.0, self._sxx * self._n):
            beta = (self._n * self._sxy - self._sx * self._sy) / var
            alpha = (self._sy - beta * self._sx) / self._n
            if beta > 0 and alpha > 0:
                self.alpha, self.beta = alpha, beta
                return
        # one size seen so far: keep the slope, fit the level so the mean is right
        alpha = (self._sy - self.beta * self._sx) / self._n
        if alpha > 0:
            self.alpha = alpha

    def step_ms(self, tokens: int) -> float:
        return self.alpha + self.beta * tokens


@dataclass
class DraftCost:
    """What drafting adds to a step: a Propose call of r batched rounds costs alpha + beta * r
    (fitted like the target's), and a step drafts max_k + 1 rounds for the next one (its drafts
    plus the bonus guess). Pipelined, the slower of target and draft paces the step."""

    model: StepCostModel = field(default_factory=lambda: StepCostModel(alpha=1.0, beta=0.5))
    pipelined: bool = True

    def observe(self, ms: float, rounds: int) -> None:
        if rounds > 0:
            self.model.observe(rounds, ms)

    def step_ms(self, target_ms: float, max_k: int) -> float:
        if max_k == 0:
            return target_ms
        draft_ms = self.model.step_ms(max_k + 1)
        return max(target_ms, draft_ms) if self.pipelined else target_ms + draft_ms


def choose_k(rates: list[float], caps: list[int], base_tokens: int, cost: StepCostModel,
             draft: DraftCost | None = None, drafted: list[bool] | None = None) -> list[int]:
    """Per-sequence k maximising (base_tokens + sum(E_i(k_i))) / t, each k_i <= caps[i], where t is
    the target's step time t(base_tokens + sum(1 + k_i)) combined with the draft's max_k + 1 rounds
    (overlapped when pipelining: the slower of the two paces the step). max_k is taken over the
    sequences the draft model proposes for (`drafted`, default all): prompt-lookup guesses cost no
    draft work.

    base_tokens: tokens already in the step that are not verifications (prompt chunks). They count as
    useful work: a draft token is worth scoring only if its expected yield beats the step's per-token
    rate, else it merely delays prefill (and in a full budget it displaces prompt tokens one for one)."""
    draft = draft or DraftCost()
    drafted = drafted if drafted is not None else [True] * len(rates)
    ks = [0] * len(rates)
    tokens = base_tokens + len(rates)

    def step_ms(tokens: int, max_k: int) -> float:
        return draft.step_ms(cost.step_ms(tokens), max_k)

    gain = base_tokens + sum(expected_tokens(a, 0) for a in rates)
    best = gain / step_ms(tokens, 0)
    while True:
        pick, pick_goodput = -1, best
        max_k = max((k for k, d in zip(ks, drafted, strict=True) if d), default=0)
        for i, a in enumerate(rates):
            if ks[i] >= caps[i]:
                continue
            g = gain - expected_tokens(a, ks[i]) + expected_tokens(a, ks[i] + 1)
            goodput = g / step_ms(tokens + 1, max(max_k, ks[i] + 1) if drafted[i] else max_k)
            if goodput > pick_goodput * 1.0001:
                pick, pick_goodput = i, goodput
        if pick < 0:
            return ks
        gain += expected_tokens(rates[pick], ks[pick] + 1) - expected_tokens(rates[pick], ks[pick])
        ks[pick] += 1
        tokens += 1
        best = pick_goodput


@dataclass
class BranchCost:
    """What a branched Propose costs: ms = a + b * rounds + c * branch_tokens (branches x drafts each),
    least squares over decayed observations, priors until the data determine the three terms."""

    a: float = 1.0
    b: float = 0.5
    c: float = 0.05
    _sums: dict[str, float] = field(default_factory=dict)

    def observe(self, ms: float, rounds: int, branch_tokens: int, decay: float = 0.98) -> None:
        x = (1.0, float(rounds), float(branch_tokens))
        s = self._sums
        for i in range(3):
            s[f"y{i}"] = decay * s.get(f"y{i}", 0.0) + x[i] * ms
            for j in range(3):
                s[f"{i}{j}"] = decay * s.get(f"{i}{j}", 0.0) + x[i] * x[j]
        if s["00"] < 8:
            return
        fitted = _solve3([[s[f"{i}{j}"] for j in range(3)] for i in range(3)], [s[f"y{i}"] for i in range(3)])
        if fitted is not None and min(fitted) >= 0.0 and fitted[2] > 0.0:
            self.a, self.b, self.c = fitted

    def call_ms(self, rounds: int, branch_tokens: int) -> float:
        return self.a + self.b * rounds + self.c * branch_tokens

    def affordable(self, within_ms: float, rounds: int, k: int) -> int:
        """How many branches of k drafts fit in within_ms."""
        spare = within_ms - self.call_ms(rounds, 0)
        return max(0, int(spare / (self.c * max(1, k))))


def _solve3(m: list[list[float]], y: list[float]) -> tuple[float, float, float] | None:
    """Gaussian elimination for the 3x3 normal equations; None when they are (nearly) singular."""
    a = [row[:] + [v] for row, v in zip(m, y, strict=True)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-9 * max(1.0, abs(a[0][0])):
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(3):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * z for x, z in zip(a[r], a[col], strict=True)]
    return a[0][3] / a[0][0], a[1][3] / a[1][1], a[2][3] / a[2][2]
