"""Acceptance rules for speculative tokens: pure functions of logits, drafts and seeds, no model.

Naming follows vLLM's rejection sampler. For a verification with k draft tokens d_1..d_k the
target scores k + 1 positions; each position i either *accepts* d_i or stops with a
*recovered* token; when all k are accepted one *bonus* token is sampled from the last row.
The emitted tokens are the accepted prefix plus that one recovered or bonus token.

  greedy (temperature 0)  accept while d_i == argmax p_i; recovered/bonus = argmax.
  strict                  Leviathan et al. 2023, "Fast Inference from Transformers via
                          Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language
                          Model Decoding with Speculative Sampling". Accept d_i with probability
                          min(1, p_i(d_i) / q_i(d_i)); on the first rejection sample from
                          norm(max(0, p_i - q_i)). Emitted tokens are distributed exactly as p.
  typical                 Medusa (Cai et al. 2024): accept d_i when
                          p_i(d_i) > min(eps, delta * exp(-H(p_i))); recovered = argmax p_i.
                          Accepts more, but changes the distribution: an explicit, lossy opt-in.

p is the target distribution after the logits processors (engine.logits: grammar mask, logit_bias,
min_tokens, penalties) and temperature/top-k/top-p (engine.sampling.filtered_probs); q is the draft's
sparse distribution, exactly what it sampled from (zero outside its ids), which the draft computed
with the same processors. So with a grammar p' = norm(p * mask), q' = norm(q * mask), and the emitted
tokens follow p' exactly: masking is just another processor.

Randomness: every draw is its own uniform, draw_uniform(seed, position, stream), where position
is the absolute position of the token being decided and the stream (STREAM_* below) says which
draw it is. A seeded request thus gets the same tokens whatever shares its batch, on any device.

A step judges all its sampled verifications at once: one filtered_probs, one gather of p(d_i)
and q(d_i), one sample of every row's fallback token (recovered or bonus), one host copy.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.logits import Context
from engine.logits import apply as processed
from engine.sampling import SamplingSpec, filtered_probs, sample, uniforms
from engine.transfer import to_lists

STREAM_DRAFT = 0  # the draft service's own sample of d_i (not drawn here)
STREAM_ACCEPT = 1  # the uniform of the acceptance test
STREAM_RECOVER = 2  # the recovered sample after a rejection
STREAM_BONUS = 3  # the bonus token, or the plain sample when k = 0

DEFAULT_TYPICAL_EPSILON = 0.09
DEFAULT_TYPICAL_DELTA = 0.3
# Below this residual mass, p - q is rounding noise (p == q up to float error): sample p itself.
# Rejections happen with probability sum(max(0, q - p)) = sum(max(0, p - q)), so the error is below it.
_RESIDUAL_FLOOR = 1e-6


class Rule(enum.IntEnum):
    """Same values as tandem.v1.AcceptanceRule."""

    STRICT = 0
    TYPICAL = 1


@dataclass(frozen=True)
class SparseDist:
    """The draft's q at one position: probability of each id, zero elsewhere."""

    token_ids: Sequence[int]
    probs: Sequence[float]


@dataclass(frozen=True)
class Verification:
    """One emitting sequence of a step: k draft tokens (k may be 0) and how to judge them."""

    draft: Sequence[int]
    spec: SamplingSpec
    position: int  # absolute position of the first token decided (d_1's, or the plain sample's)
    draft_dists: Sequence[SparseDist] = ()  # q per draft position; required by STRICT when sampling
    rule: Rule = Rule.STRICT
    typical_epsilon: float = DEFAULT_TYPICAL_EPSILON
    typical_delta: float = DEFAULT_TYPICAL_DELTA
    context: Context | None = None  # logits processors and grammar masks of its k + 1 rows


@dataclass(frozen=True)
class Outcome:
    tokens: list[int]  # accepted drafts, then one recovered or bonus token
    num_accepted: int


def accept(logits: Sequence[torch.Tensor], batch: Sequence[Verification]) -> list[Outcome]:
    """Judge every verification of a step. logits[n] is [k_n + 1, vocab]: raw logits of the
    positions deciding d_1 .. d_k and the bonus."""
    assert len(logits) == len(batch)
    logits = [processed(rows, v.context) if v.context is not None else rows for rows, v in zip(logits, batch,
                                                                                                strict=True)]
    outcomes: list[Outcome | None] = [None] * len(batch)
    greedy = [n for n, v in enumerate(batch) if v.spec.greedy]
    if greedy:
        [argmax] = to_lists(torch.cat([logits[n] for n in greedy]).argmax(-1))
        offset = 0
        for n in greedy:
            rows = len(batch[n].draft) + 1
            outcomes[n] = greedy_accept(argmax[offset:offset + rows], batch[n].draft)
            offset += rows
    sampled = [n for n, v in enumerate(batch) if not v.spec.greedy]
    if sampled:
        specs = [batch[n].spec for n in sampled for _ in range(len(batch[n].draft) + 1)]
        probs = filtered_probs(torch.cat([logits[n] for n in sampled]), specs)
        for n, out in zip(sampled, judge(probs, [batch[n] for n in sampled]), strict=True):
            outcomes[n] = out
    return outcomes  # type: ignore[return-value]  # every slot filled above


def greedy_accept(argmax: Sequence[int], draft: Sequence[int]) -> Outcome:
    """argmax: the target's argmax at each of the k + 1 positions."""
    for i, d in enumerate(draft):
        if d != argmax[i]:
            return Outcome(list(draft[:i]) + [argmax[i]], i)
    return Outcome(list(draft) + [argmax[len(draft)]], len(draft))


def judge(probs: torch.Tensor, batch: Sequence[Verification]) -> list[Outcome]:
    """Sampled verifications, vectorised. probs: [sum(k_n + 1), V] target probabilities (filtered),
    verification n's k_n + 1 rows in order. Every row gets a fallback token: draft rows the
    recovered sample (strict: from norm(max(0, p - q)); typical: argmax p), last rows the bonus."""
    dev = probs.device
    draft_rows: list[int] = []
    draft_tokens: list[int] = []
    typical_rows: list[bool] = []
    accept_draws: list[tuple[int | None, int, int]] = []
    fallback_draws: list[tuple[int | None, int, int]] = []
    offset = 0
    for v in batch:
        k = len(v.draft)
        strict = v.rule == Rule.STRICT
        assert not strict or len(v.draft_dists) == k, "strict sampling needs q at every draft position"
        for i, d in enumerate(v.draft):
            draft_rows.append(offset + i)
            draft_tokens.append(d)
            typical_rows.append(not strict)
            accept_draws.append((v.spec.seed, v.position + i, STREAM_ACCEPT))
            fallback_draws.append((v.spec.seed, v.position + i, STREAM_RECOVER))
        fallback_draws.append((v.spec.seed, v.position + k, STREAM_BONUS))
        offset += k + 1
    q = _dense_q(batch, probs.shape, dev)
    fallback = _fallback_dists(probs, q, batch)
    fallback_tokens = sample(fallback, uniforms(fallback_draws, dev))
    if draft_rows:
        rows = torch.tensor(draft_rows, device=dev)
        tokens = torch.tensor(draft_tokens, device=dev)
        p_x, q_x = probs[rows, tokens], q[rows, tokens]
        # u < p/q written without the division: q(x) = 0 accepts iff p(x) > 0, p(x) = 0 always rejects
        ok = uniforms(accept_draws, dev).to(p_x.dtype) * q_x < p_x
        if any(typical_rows):
            ok = torch.where(torch.tensor(typical_rows, device=dev), _typical_ok(probs[rows], p_x, batch), ok)
    else:
        ok = torch.zeros(0, dtype=torch.bool, device=dev)
    ok_list, fallback_list = to_lists(ok, fallback_tokens)
    outcomes = []
    offset = drafted = 0
    for v in batch:
        k = len(v.draft)
        accepted = next((i for i in range(k) if not ok_list[drafted + i]), k)
        outcomes.append(Outcome(list(v.draft[:accepted]) + [fallback_list[offset + accepted]], accepted))
        offset += k + 1
        drafted += k
    return outcomes


def _dense_q(batch: Sequence[Verification], shape: torch.Size, device: torch.device) -> torch.Tensor:
    """[rows, V]: each strict draft row's sparse q scattered in; zero elsewhere (bonus, typical rows)."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    offset = 0
    for v in batch:
        if v.rule == Rule.STRICT:
            for i, d in enumerate(v.draft_dists):
                rows.extend([offset + i] * len(d.token_ids))
                cols.extend(d.token_ids)
                vals.extend(d.probs)
        offset += len(v.draft) + 1
    q = torch.zeros(shape, device=device)
    if rows:
        q[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = torch.tensor(vals, device=device)
    return q


def _fallback_dists(probs: torch.Tensor, q: torch.Tensor, batch: Sequence[Verification]) -> torch.Tensor:
    """Unnormalised distributions (sample() normalises) to draw each row's fallback token from."""
    residual = (probs - q).clamp_min(0.0)
    # below the floor p - q is rounding noise (p == q up to float error): sample p itself
    dist = torch.where(residual.sum(-1, keepdim=True) > _RESIDUAL_FLOOR, residual, probs)
    typical = [offset + i for offset, v in zip(_offsets(batch), batch, strict=True) if v.rule == Rule.TYPICAL
               for i in range(len(v.draft))]
    if typical:
        index = torch.tensor(typical, device=probs.device)
        argmax = probs.index_select(0, index).argmax(-1)
        dist = dist.index_copy(0, index, torch.nn.functional.one_hot(argmax, probs.shape[-1]).to(dist.dtype))
    return dist


def _typical_ok(p: torch.Tensor, p_x: torch.Tensor, batch: Sequence[Verification]) -> torch.Tensor:
    """p(d_i) > min(eps, delta * exp(-H(p_i))) for each draft row (p: those rows only)."""
    eps = [v.typical_epsilon for v in batch for _ in v.draft]
    delta = [v.typical_delta for v in batch for _ in v.draft]
    entropy = torch.special.entr(p).sum(-1)  # entr(0) = 0
    threshold = torch.minimum(torch.tensor(eps, device=p.device),
                              torch.tensor(delta, device=p.device) * torch.exp(-entropy))
    return p_x > threshold


def _offsets(batch: Sequence[Verification]) -> list[int]:
    out, offset = [], 0
    for v in batch:
        out.append(offset)
        offset += len(v.draft) + 1
    return out


def typical_accept(p: torch.Tensor, draft: Sequence[int], seed: int | None, position: int,
                   epsilon: float = DEFAULT_TYPICAL_EPSILON, delta: float = DEFAULT_TYPICAL_DELTA) -> Outcome:
    """Typical acceptance (lossy) of one verification. p: [k + 1, V] target probabilities."""
    spec = SamplingSpec(temperature=1.0, seed=seed)
    [out] = judge(p, [Verification(draft, spec, position, rule=Rule.TYPICAL, typical_epsilon=epsilon,
                                   typical_delta=delta)])
    return out
