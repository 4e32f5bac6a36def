"""Token selection next to the logits, vectorised over the batch.

Both services apply the same filters (temperature, top-k, top-p), so the draft's q and the
target's p are both distributions *after* filtering, as lossless rejection sampling requires.
Randomness is drawn from per-row generators seeded by (request seed, position, stream): a
seeded request gets the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from common.sampling import validate_sampling  # noqa: F401 - re-exported for the services

_UNSEEDED = torch.Generator()
_UNSEEDED.seed()


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def row_generator(seed: int | None, position: int, stream: int) -> torch.Generator:
    """A generator for one random draw: stream tells apart draws made at the same position
    (the draft's sample, the acceptance test, the recovery sample)."""
    if seed is None:
        return _UNSEEDED
    digest = hashlib.blake2b(f"{seed}:{position}:{stream}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def filtered_probs(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    """Softmax(logits / T) restricted to each row's top-k and top-p set, renormalised. [N, V] float32.

    Greedy rows (T = 0) come back one-hot on the argmax, which is the distribution greedy
    decoding samples from."""
    assert logits.shape[0] == len(specs)
    logits = logits.float()
    temps = torch.tensor([s.temperature or 1.0 for s in specs], device=logits.device)
    scaled = logits / temps[:, None]
    needs_filter = any(s.top_k > 0 or s.top_p < 1.0 for s in specs)
    if needs_filter:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ks = torch.tensor([s.top_k if s.top_k > 0 else vocab for s in specs], device=logits.device)
        rank = torch.arange(vocab, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(rank >= ks[:, None], float("-inf"))
        sorted_probs = sorted_logits.softmax(-1)
        ps = torch.tensor([s.top_p if s.top_p > 0 else 1.0 for s in specs], device=logits.device)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(before >= ps[:, None], float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
    probs = scaled.softmax(-1)
    greedy = [i for i, s in enumerate(specs) if s.greedy]
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        probs[rows] = torch.nn.functional.one_hot(logits[rows].argmax(-1), logits.shape[-1]).float()
    return probs


def sample(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of probs, each from its own generator (exponential race: argmax p / E)."""
    noise = torch.empty_like(probs)
    for row, gen in enumerate(generators):
        noise[row].exponential_(generator=gen)
    return (probs / noise).argmax(-1)


def uniforms(generators: list[torch.Generator]) -> torch.Tensor:
    return torch.stack([torch.rand((), generator=g) for g in generators]) if generators else torch.empty(0)


def truncate_top(probs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep each row's n most likely tokens, renormalised: (ids [N, n], probs [N, n]).

    The draft samples from exactly this truncated distribution and ships it as its sparse q,
    so what crosses the network is the true proposal distribution, not an approximation."""
    n = min(n, probs.shape[-1])
    top_p, top_ids = probs.topk(n, dim=-1)
    return top_ids, top_p / top_p.sum(-1, keepdim=True)


def logprobs_of(
    logits: torch.Tensor, tokens: torch.Tensor, top_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw-distribution logprob of each row's token, and its top_n alternatives (ids, logprobs)."""
    logp = logits.float().log_softmax(-1)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    top_lp, top_ids = logp.topk(top_n, dim=-1) if top_n > 0 else (logp[:, :0], tokens[:, None][:, :0])
    return chosen, top_ids, top_lp
