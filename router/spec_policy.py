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

from dataclasses import dataclass


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
        if self._n > 4 and var > 1e-6 * max(1.0, self._sxx * self._n):
            beta = (self._n * self._sxy - self._sx * self._sy) / var
            alpha = (self._sy - beta * self._sx) / self._n
            if beta > 0 and alpha > 0:
                self.alpha, self.beta = alpha, beta

    def step_ms(self, tokens: int) -> float:
        return self.alpha + self.beta * tokens


def choose_k(rates: list[float], caps: list[int], base_tokens: int, cost: StepCostModel) -> list[int]:
    """Per-sequence k maximising (base_tokens + sum(E_i(k_i))) / t(base_tokens + sum(1 + k_i)), k_i <= caps[i].

    base_tokens: tokens already in the step that are not verifications (prompt chunks). They count as
    useful work: a draft token is worth scoring only if its expected yield beats the step's per-token
    rate, else it merely delays prefill (and in a full budget it displaces prompt tokens one for one)."""
    ks = [0] * len(rates)
    tokens = base_tokens + len(rates)
    gain = base_tokens + sum(expected_tokens(a, 0) for a in rates)
    best = gain / cost.step_ms(tokens)
    while True:
        pick, pick_goodput = -1, best
        for i, a in enumerate(rates):
            if ks[i] >= caps[i]:
                continue
            g = gain - expected_tokens(a, ks[i]) + expected_tokens(a, ks[i] + 1)
            goodput = g / cost.step_ms(tokens + 1)
            if goodput > pick_goodput * 1.0001:
                pick, pick_goodput = i, goodput
        if pick < 0:
            return ks
        gain += expected_tokens(rates[pick], ks[pick] + 1) - expected_tokens(rates[pick], ks[pick])
        ks[pick] += 1
        tokens += 1
        best = pick_goodput
