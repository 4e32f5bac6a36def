"""Acceptance rules without a model: greedy is exact, strict rejection sampling leaves the target
distribution unchanged (chi-square against a critical value, with fixed seeds), typical
acceptance accepts more and is measurably lossy, and seeded draws reproduce."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.logits import Context
from engine.sampling import SamplingSpec, filtered_probs
from target_service import acceptance
from target_service.acceptance import Rule, SparseDist, Verification, accept, greedy_accept

V = 8
POS = 40  # absolute position of the first decided token; any value works
N = 6000  # trials per distribution test
# chi-square critical values at alpha = 0.001, by degrees of freedom
CHI2_CRIT = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124, 9: 27.877}

P0 = torch.tensor([0.30, 0.25, 0.15, 0.10, 0.10, 0.05, 0.05, 0.00])  # target rejects token 7 outright
P1 = torch.tensor([0.05, 0.05, 0.10, 0.40, 0.20, 0.10, 0.05, 0.05])
P2 = torch.tensor([0.10, 0.10, 0.10, 0.10, 0.20, 0.20, 0.10, 0.10])
Q_FAR = {0: 0.02, 1: 0.03, 2: 0.05, 3: 0.05, 4: 0.05, 5: 0.2, 6: 0.3, 7: 0.3}  # mass where p has none
Q_SPARSE = {1: 0.5, 5: 0.3, 7: 0.2}
Q_GAPS = {2: 0.6, 3: 0.4}  # zero mass on tokens 0, 1, 4, 5, 6 where p has mass: only recovery reaches them


def as_logits(p: torch.Tensor) -> torch.Tensor:
    return p.log()  # -inf where p is 0; softmax at temperature 1 gives p back


def dist(q: dict[int, float]) -> SparseDist:
    return SparseDist(list(q), list(q.values()))


def dense(q: dict[int, float]) -> torch.Tensor:
    out = torch.zeros(V)
    out[list(q)] = torch.tensor(list(q.values()))
    return out


def run(p_rows: list[torch.Tensor], qs: list[dict[int, float]], n: int = N, rule: Rule = Rule.STRICT,
        temperature: float = 1.0, top_k: int = 0, seed0: int = 0) -> list[acceptance.Outcome]:
    """n seeded verifications of the same step. The draft's tokens are drawn from q, as the draft
    service would, independently of the target's acceptance streams."""
    logits = torch.stack([as_logits(p) for p in p_rows])
    g = torch.Generator().manual_seed(1234 + seed0)
    drafts = torch.stack([torch.multinomial(dense(q), n, replacement=True, generator=g) for q in qs], 1).tolist()
    dists = [dist(q) for q in qs] if rule == Rule.STRICT else []
    batch = [Verification(d, SamplingSpec(temperature=temperature, top_k=top_k, seed=seed0 + t), POS, dists, rule)
             for t, d in enumerate(drafts)]
    return accept([logits] * n, batch)  # one step of n sequences: one filtered_probs call


def counts(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=V).double()


def chi_square(observed: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    """(statistic, critical value at alpha 0.001). Tokens with p = 0 must never appear at all."""
    assert observed[p == 0].sum() == 0, f"tokens with zero target probability emitted: {observed.tolist()}"
    support = p > 0
    expected = observed.sum() * p[support].double()
    stat = ((observed[support] - expected) ** 2 / expected).sum().item()
    return stat, CHI2_CRIT[int(support.sum()) - 1]


def tv(observed: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * (observed / observed.sum() - p.double()).abs().sum().item()


@pytest.mark.parametrize("q0,q1", [(Q_FAR, Q_SPARSE), (Q_SPARSE, Q_GAPS), (Q_GAPS, Q_FAR)],
                         ids=["far", "sparse", "zero-mass"])
def test_strict_emits_the_target_distribution(q0, q1):
    outs = run([P0, P1, P2], [q0, q1])
    first = counts([o.tokens[0] for o in outs])
    stat, crit = chi_square(first, P0)
    assert stat < crit, f"first token: chi2 {stat:.1f} >= {crit} ({first.tolist()})"
    # given d_1 was accepted, the second emitted token (accepted d_2 or recovered) follows P1
    second = counts([o.tokens[1] for o in outs if len(o.tokens) >= 2])
    assert second.sum() > 300
    stat, crit = chi_square(second, P1)
    assert stat < crit, f"second token: chi2 {stat:.1f} >= {crit} ({second.tolist()})"
    assert all(len(o.tokens) == o.num_accepted + 1 for o in outs)


def test_strict_with_q_equal_to_p_accepts_everything():
    q = {i: float(v) for i, v in enumerate(P1) if v > 0}
    outs = run([P1, P2], [q], n=500)
    assert all(o.num_accepted == 1 for o in outs)
    stat, crit = chi_square(counts([o.tokens[1] for o in outs]), P2)  # the bonus token follows P2
    assert stat < crit


def test_strict_after_temperature_and_top_k():
    """p is the target distribution after filtering; the emitted tokens follow that p."""
    logits = as_logits(P1)
    spec = SamplingSpec(temperature=0.7, top_k=4)
    p = filtered_probs(logits[None], [spec])[0]
    assert (p > 0).sum() == 4
    outs = run([P1, P2], [Q_FAR], temperature=0.7, top_k=4)
    stat, crit = chi_square(counts([o.tokens[0] for o in outs]), p)
    assert stat < crit


def test_chi_square_catches_the_classic_bug(monkeypatch):
    """Power check: recovering from p instead of norm(max(0, p - q)) over-weights the draft's
    favourites, and the same test at the same sample size rejects it."""
    monkeypatch.setattr(acceptance, "_RESIDUAL_FLOOR", 2.0)  # the fallback to p on every rejection
    outs = run([P0, P1], [Q_FAR])
    stat, crit = chi_square(counts([o.tokens[0] for o in outs]), P0)
    assert stat > 3 * crit


def test_greedy_is_exact():
    logits = torch.tensor([[0.1, 3.0, 0.2, 0.0], [2.0, 0.0, 0.5, 0.1], [0.0, 0.0, 0.0, 9.0]])
    greedy = SamplingSpec(temperature=0.0, top_p=0.5, top_k=2, seed=5)  # filters never move the argmax
    cases = {(1, 0): ([1, 0, 3], 2), (1, 2): ([1, 0], 1), (2, 0): ([1], 0), (): ([1], 0)}
    for draft, (tokens, n_acc) in cases.items():
        rows = logits[:len(draft) + 1]
        [out] = accept([rows], [Verification(list(draft), greedy, POS)])
        assert (out.tokens, out.num_accepted) == (tokens, n_acc), draft
    assert greedy_accept([4, 4, 4], [4, 4]) == acceptance.Outcome([4, 4, 4], 2)


def test_seeded_reproducible_whatever_shares_the_batch():
    logits = torch.stack([as_logits(P0), as_logits(P1), as_logits(P2)])
    mine = Verification([6, 5], SamplingSpec(temperature=1.0, seed=77), POS, [dist(Q_FAR), dist(Q_SPARSE)])
    alone = [accept([logits], [mine])[0] for _ in range(3)]
    others = [Verification([], SamplingSpec(temperature=0.9, seed=1), 5),
              Verification([2], SamplingSpec(), 9),
              Verification([1], SamplingSpec(temperature=1.0), 3, rule=Rule.TYPICAL)]
    crowded = accept([logits[:1], logits[:2], logits, logits[:2]], [others[0], others[1], mine, others[2]])[2]
    assert alone[0] == alone[1] == alone[2] == crowded
    # other seeds, other outcomes: the seed is really used
    outs = {tuple(accept([logits], [Verification([6, 5], SamplingSpec(temperature=1.0, seed=s), POS,
                                                 mine.draft_dists)])[0].tokens) for s in range(40)}
    assert len(outs) > 3


def test_unseeded_requests_still_sample_validly():
    logits = torch.stack([as_logits(P0), as_logits(P1)])
    for _ in range(50):
        [out] = accept([logits], [Verification([7], SamplingSpec(temperature=1.0), POS, [dist(Q_FAR)])])
        assert out.num_accepted == 0 and out.tokens[0] != 7  # p(7) = 0: always rejected, never recovered


def test_typical_accepts_more_and_is_lossy():
    """Same inputs, both rules: typical acceptance takes every plausible draft token, so the
    emitted distribution leans towards the draft's q, far beyond sampling noise."""
    q = {0: 0.05, 1: 0.05, 2: 0.8, 3: 0.05, 4: 0.05}
    strict = run([P0, P1], [q], seed0=1)
    typical = run([P0, P1], [q], rule=Rule.TYPICAL, seed0=1)
    n_strict = sum(o.num_accepted for o in strict)
    n_typical = sum(o.num_accepted for o in typical)
    assert n_typical > 1.5 * n_strict
    tv_strict = tv(counts([o.tokens[0] for o in strict]), P0)
    tv_typical = tv(counts([o.tokens[0] for o in typical]), P0)
    assert tv_strict < 0.03  # noise at N = 6000 is ~0.01
    assert tv_typical > 0.3


def test_typical_thresholds():
    """p(x) > min(eps, delta * exp(-H)): with a flat p (H = log 8) the threshold is 0.3/8 = 0.0375."""
    flat = torch.full((2, V), 1.0 / V)
    p = flat.clone()
    p[0] = torch.tensor([0.5, 0.46, 0.01, 0.01, 0.01, 0.005, 0.005, 0.0])
    rec = acceptance.typical_accept(p, [2], seed=1, position=POS)
    assert rec.num_accepted == 0 and rec.tokens == [0]  # rejected: recovered is argmax p
    ok = acceptance.typical_accept(flat, [2], seed=1, position=POS)
    assert ok.num_accepted == 1  # 0.125 > 0.0375
    strict_eps = acceptance.typical_accept(flat, [2], seed=1, position=POS, epsilon=0.2, delta=10.0)
    assert strict_eps.num_accepted == 0  # threshold min(0.2, 10/8) = 0.2 > 0.125


# ---- structured output: masks are one more processor, and rejection sampling stays exact ------------
def pack(allowed: list[int]) -> bytes:
    bits = torch.zeros(V, dtype=torch.bool)
    bits[allowed] = True
    return np.packbits(bits.numpy(), bitorder="little").tobytes()


def masked(p: torch.Tensor, allowed: list[int]) -> torch.Tensor:
    out = torch.zeros_like(p)
    out[allowed] = p[allowed]
    return out / out.sum()


MASK0 = [0, 2, 3, 5, 7]  # a grammar forbids 1, 4, 6 at the first position (7 has no target mass)
MASK1 = [1, 3, 4, 6]


def run_masked(qs: list[dict[int, float]], masks: list[list[int]], n: int = N, seed0: int = 0,
               temperature: float = 1.0) -> list[acceptance.Outcome]:
    """Like run(), with grammar masks on the target's rows; the draft samples from q' = norm(q * mask)
    and ships q', as the draft service does."""
    qs_masked = [{t: v for t, v in q.items() if t in m} for q, m in zip(qs, masks, strict=False)]
    qs_masked = [{t: v / sum(q.values()) for t, v in q.items()} for q in qs_masked]
    logits = torch.stack([as_logits(p) for p in (P0, P1, P2)][:len(qs) + 1])
    g = torch.Generator().manual_seed(99 + seed0)
    drafts = torch.stack([torch.multinomial(dense(q), n, replacement=True, generator=g) for q in qs_masked],
                         1).tolist()
    ctx = Context(None, masks=[pack(m) for m in masks])
    batch = [Verification(d, SamplingSpec(temperature=temperature, seed=seed0 + t), POS, [dist(q) for q in qs_masked],
                          context=ctx) for t, d in enumerate(drafts)]
    return accept([logits] * n, batch)


@pytest.mark.parametrize("q0,q1", [(Q_FAR, Q_SPARSE), (Q_SPARSE, Q_FAR)], ids=["far", "sparse"])
def test_masked_rejection_sampling_emits_the_masked_target_distribution(q0, q1):
    """p' = norm(p * mask) at every position; drafts from q' = norm(q * mask): the emitted tokens
    follow p' (chi-square), and no forbidden token is ever emitted."""
    outs = run_masked([q0, q1], [MASK0, MASK1, list(range(V))])
    first = counts([o.tokens[0] for o in outs])
    stat, crit = chi_square(first, masked(P0, MASK0))
    assert stat < crit, f"first token: chi2 {stat:.1f} >= {crit} ({first.tolist()})"
    second = counts([o.tokens[1] for o in outs if len(o.tokens) >= 2])
    assert second.sum() > 300
    stat, crit = chi_square(second, masked(P1, MASK1))
    assert stat < crit, f"second token: chi2 {stat:.1f} >= {crit} ({second.tolist()})"


def test_masking_only_the_draft_is_not_enough():
    """Power check: the same drafts judged against an unmasked target emit forbidden tokens and
    fail the masked chi-square: the mask must reach the target's p."""
    outs = run_masked([Q_FAR], [MASK0, list(range(V))])
    unmasked_target = run([P0, P1], [{t: v for t, v in Q_FAR.items() if t in MASK0}])
    assert all(o.tokens[0] in MASK0 for o in outs)
    assert any(o.tokens[0] not in MASK0 for o in unmasked_target)


def test_greedy_with_a_mask_takes_the_best_allowed_token():
    logits = torch.stack([as_logits(P0), as_logits(P1)])
    ctx = Context(None, masks=[pack([2, 5]), pack([1, 2])])
    [out] = accept([logits], [Verification([2], SamplingSpec(temperature=0.0), POS, context=ctx)])
    assert out.tokens == [2, 2] and out.num_accepted == 1  # 0 is P0's argmax and 3 is P1's: both forbidden
