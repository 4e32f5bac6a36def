"""Token selection next to the logits, vectorised over the batch, on whatever device the logits are.

Both services apply the same filters (temperature, then top-k, top-p and min-p, transformers'
order), so the draft's q and the
target's p are both distributions *after* filtering, as lossless rejection sampling requires.
A row's filters touch that row only: a request's distribution never depends on its neighbours.

Randomness is counter-based: every draw is one uniform that is a pure function of (request seed,
position, stream), computed on the host with a hash and shipped to the device with the batch's
other uniforms in one tensor. There is no torch.Generator to keep on the right device, a seeded
request gets the same tokens whatever shares its batch, and the same tokens on any device (up to
the rounding of one cumulative sum: a tie within 1e-16 of a bucket edge).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.sampling import validate_sampling  # noqa: F401 - re-exported for the services

_UNSEEDED = random.Random()  # seeded from os.urandom: unseeded requests differ run to run
_TWO_POW_53 = float(2**53)


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def draw_uniform(seed: int | None, position: int, stream: int) -> float:
    """The uniform in [0, 1) of one random draw: stream tells apart draws made at the same position
    (the draft's sample, the acceptance test, the recovery sample). 53 bits, exact in float64."""
    if seed is None:
        return _UNSEEDED.random()
    digest = hashlib.blake2b(f"{seed}:{position}:{stream}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / _TWO_POW_53


def uniforms(draws: Sequence[tuple[int | None, int, int]], device: torch.device | str) -> torch.Tensor:
    """[N] float64 on `device`, one per (seed, position, stream): one host-to-device copy."""
    return torch.tensor([draw_uniform(*d) for d in draws], dtype=torch.float64, device=device)


def filtered_probs(logits: torch.Tensor, specs: Sequence[SamplingSpec]) -> torch.Tensor:
    """Softmax(logits / T) restricted to each row's top-k, top-p and min-p set, renormalised. [N, V] float32.

    Greedy rows (T = 0) come back one-hot on the argmax, which is the distribution greedy
    decoding samples from."""
    assert logits.shape[0] == len(specs)
    dev = logits.device
    logits = logits.float()
    temps = torch.tensor([s.temperature or 1.0 for s in specs], device=dev)
    scaled = logits / temps[:, None]
    rows = [i for i, s in enumerate(specs) if s.filtered]
    if rows:
        index = torch.tensor(rows, device=dev)
        cut = _top_k_top_p_min_p(scaled.index_select(0, index), [specs[i] for i in rows])
        scaled = scaled.index_copy(0, index, cut)
    probs = scaled.softmax(-1)
    greedy = [i for i, s in enumerate(specs) if s.greedy]
    if greedy:
        index = torch.tensor(greedy, device=dev)
        one_hot = torch.nn.functional.one_hot(logits.index_select(0, index).argmax(-1), logits.shape[-1])
        probs = probs.index_copy(0, index, one_hot.float())
    return probs


def _top_k_top_p_min_p(scaled: torch.Tensor, specs: Sequence[SamplingSpec]) -> torch.Tensor:
    """-inf outside each row's top-k, top-p and min-p set (rows here all asked for a filter). Min-p
    compares a token with the most likely one, a ratio that top-k and top-p (which keep the most
    likely token, and only rescale the rest) do not change: it reads the same sorted probabilities."""
    dev, vocab = scaled.device, scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ks = torch.tensor([s.top_k if s.top_k > 0 else vocab for s in specs], device=dev)
    rank = torch.arange(vocab, device=dev)[None, :]
    sorted_logits = sorted_logits.masked_fill(rank >= ks[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(-1)
    ps = torch.tensor([s.top_p if s.top_p > 0 else 1.0 for s in specs], device=dev)
    # drop a token when the mass before it already reaches top_p (the first token always stays)
    before = sorted_probs.cumsum(-1) - sorted_probs
    mins = torch.tensor([s.min_p for s in specs], device=dev)
    dropped = (before >= ps[:, None]) | (sorted_probs < mins[:, None] * sorted_probs[:, :1])
    sorted_logits = sorted_logits.masked_fill(dropped, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [N, V] by inverse CDF with that row's uniform u [N] in [0, 1).

    A token with probability 0 is never picked: its bucket of the cumulative sum is empty."""
    cdf = probs.double().cumsum(-1)
    target = (u.to(cdf.dtype) * cdf[:, -1])[:, None]
    picked = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # u * total can round up to total itself: fall back to the last token with mass
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)
    return torch.minimum(picked, last)


def truncate_top(probs: torch.Tensor, n: int, mass: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep each row's most likely tokens, at most n of them and no more than it takes to reach
    `mass`, renormalised: (ids [N, n], probs [N, n]; zeros past a row's cut).

    The draft samples from exactly this truncated distribution and ships it as its sparse q,
    so what crosses the network is the true proposal distribution, not an approximation. The
    cut costs acceptance at most what it drops (the draft as its own target accepts exactly the
    kept mass), so a mass cut keeps peaked rows small and wide ones wide."""
    n = min(n, probs.shape[-1])
    top_p, top_ids = probs.topk(n, dim=-1)
    if mass < 1.0:
        before = top_p.cumsum(-1) - top_p  # mass of the more likely tokens: keep while it is below `mass`
        top_p = top_p.masked_fill(before >= mass, 0.0)
    return top_ids, top_p / top_p.sum(-1, keepdim=True)


def logprobs_of(
    logits: torch.Tensor, tokens: torch.Tensor, top_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw-distribution logprob of each row's token, its rank (1 + the tokens more likely), and its
    top_n alternatives (ids, logprobs)."""
    logp = logits.float().log_softmax(-1)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    rank = (logp > chosen[:, None]).sum(-1) + 1
    top_lp, top_ids = logp.topk(top_n, dim=-1) if top_n > 0 else (logp[:, :0], tokens[:, None][:, :0])
    return chosen, rank, top_ids, top_lp
