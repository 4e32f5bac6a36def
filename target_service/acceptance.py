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

p is the target distribution after temperature/top-k/top-p (engine.sampling.filtered_probs);
q is the draft's sparse distribution, exactly what it sampled from (zero outside its ids).

Randomness: every draw has its own generator, row_generator(seed, position, stream), where
position is the absolute position of the token being decided and the stream (STREAM_* below)
says which draw it is. A seeded request thus gets the same tokens whatever shares its batch.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling import SamplingSpec, filtered_probs, row_generator, sample

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


@dataclass(frozen=True)
class Outcome:
    tokens: list[int]  # accepted drafts, then one recovered or bonus token
    num_accepted: int


def accept(logits: Sequence[torch.Tensor], batch: Sequence[Verification]) -> list[Outcome]:
    """Judge every verification of a step. logits[n] is [k_n + 1, vocab]: raw logits of the
    positions deciding d_1 .. d_k and the bonus. Sampled rows share one filtered_probs call."""
    assert len(logits) == len(batch)
    outcomes: list[Outcome | None] = [None] * len(batch)
    greedy = [n for n, v in enumerate(batch) if v.spec.greedy]
    if greedy:
        argmax = torch.cat([logits[n] for n in greedy]).argmax(-1).tolist()
        offset = 0
        for n in greedy:
            rows = len(batch[n].draft) + 1
            outcomes[n] = greedy_accept(argmax[offset:offset + rows], batch[n].draft)
            offset += rows
    sampled = [n for n, v in enumerate(batch) if not v.spec.greedy]
    if sampled:
        specs = [batch[n].spec for n in sampled for _ in range(len(batch[n].draft) + 1)]
        probs = filtered_probs(torch.cat([logits[n] for n in sampled]), specs)
        offset = 0
        for n in sampled:
            v = batch[n]
            rows = len(v.draft) + 1
            p = probs[offset:offset + rows]
            offset += rows
            if v.rule == Rule.TYPICAL:
                outcomes[n] = typical_accept(p, v.draft, v.spec.seed, v.position, v.typical_epsilon, v.typical_delta)
            else:
                assert len(v.draft_dists) == len(v.draft), "strict sampling needs q at every draft position"
                q = dense_draft_probs(v.draft_dists, len(v.draft), p.shape[-1], p.device)
                outcomes[n] = strict_accept(p, q, v.draft, v.spec.seed, v.position)
    return outcomes  # type: ignore[return-value]  # every slot filled above


def greedy_accept(argmax: Sequence[int], draft: Sequence[int]) -> Outcome:
    """argmax: the target's argmax at each of the k + 1 positions."""
    for i, d in enumerate(draft):
        if d != argmax[i]:
            return Outcome(list(draft[:i]) + [argmax[i]], i)
    return Outcome(list(draft) + [argmax[len(draft)]], len(draft))


def strict_accept(p: torch.Tensor, q: torch.Tensor, draft: Sequence[int], seed: int | None,
                  position: int) -> Outcome:
    """Lossless rejection sampling. p: [k + 1, V] target probabilities, q: [k, V] draft's."""
    k = len(draft)
    for i, x in enumerate(draft):
        u = torch.rand((), generator=row_generator(seed, position + i, STREAM_ACCEPT)).item()
        # u < p/q written without the division: q(x) = 0 accepts iff p(x) > 0, p(x) = 0 always rejects
        if u * q[i, x].item() < p[i, x].item():
            continue
        residual = (p[i] - q[i]).clamp_min(0.0)
        mass = residual.sum()
        dist = residual / mass if mass.item() > _RESIDUAL_FLOOR else p[i]
        recovered = sample(dist[None], [row_generator(seed, position + i, STREAM_RECOVER)]).item()
        return Outcome(list(draft[:i]) + [recovered], i)
    bonus = sample(p[k:k + 1], [row_generator(seed, position + k, STREAM_BONUS)]).item()
    return Outcome(list(draft) + [bonus], k)


def typical_accept(p: torch.Tensor, draft: Sequence[int], seed: int | None, position: int,
                   epsilon: float = DEFAULT_TYPICAL_EPSILON, delta: float = DEFAULT_TYPICAL_DELTA) -> Outcome:
    """Typical acceptance (lossy). p: [k + 1, V] target probabilities."""
    k = len(draft)
    if k:
        entropy = torch.special.entr(p[:k]).sum(-1)  # entr(0) = 0
        threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))
        ok = (p[:k].gather(-1, torch.tensor(list(draft), device=p.device)[:, None]).squeeze(-1) > threshold).tolist()
        for i, passed in enumerate(ok):
            if not passed:
                return Outcome(list(draft[:i]) + [int(p[i].argmax().item())], i)
    bonus = sample(p[k:k + 1], [row_generator(seed, position + k, STREAM_BONUS)]).item()
    return Outcome(list(draft) + [bonus], k)


def dense_draft_probs(dists: Sequence[SparseDist], k: int, vocab: int,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """[k, vocab] with each position's sparse q scattered in, zero elsewhere."""
    q = torch.zeros(k, vocab, device=device)
    for i, d in enumerate(dists):
        if len(d.token_ids):
            q[i, torch.tensor(list(d.token_ids), device=device)] = torch.tensor(list(d.probs), device=device)
    return q
