"""Batched drafting on a ModelRunner, without gRPC.

Propose runs autoregressive rounds shared by every entry of the batch: round 1 forwards each
entry's uncached tokens and samples d_1; round j feeds d_{j-1} of each entry still drafting and
samples d_j; an entry that wants a guess gets one more round feeding d_k. The number of
forwards is max_i(k_i + guess_i), never the sum.

Everything is validated before the first forward, capacity for the whole call included, so an
invalid request changes no cache and a valid one never fails halfway.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.runner import CacheMiss, InvalidInput, ModelRunner, SeqInput
from engine.sampling import SamplingSpec, filtered_probs, sample, truncate_top, uniforms
from engine.transfer import to_lists

DRAFT_STREAM = 0  # draw_uniform stream of the draft's own draws


@dataclass(frozen=True)
class DraftRequest:
    seq_id: int
    start_pos: int
    tokens: Sequence[int]  # emitted tokens after start_pos the draft has not cached; non-empty
    k: int
    spec: SamplingSpec = SamplingSpec()
    want_guess: bool = False

    @property
    def guessing(self) -> bool:
        return self.want_guess and self.k > 0

    @property
    def final_len(self) -> int:
        """Cached tokens after the call: the inputs, d_1..d_{k-1}, and d_k when guessing."""
        base = self.start_pos + len(self.tokens)
        return base + self.k - 1 + int(self.guessing) if self.k > 0 else base


@dataclass
class SparseQ:
    """The distribution a draft token was sampled from: mass outside token_ids is 0."""

    token_ids: list[int]
    probs: list[float]


@dataclass
class DraftResult:
    seq_id: int
    tokens: list[int] = field(default_factory=list)
    probs: list[SparseQ] = field(default_factory=list)  # one per token; empty when greedy
    guess: int = -1
    cached_len: int = 0


@dataclass
class Proposals:
    results: list[DraftResult]
    forward_ms: float
    forwards: int


class Proposer:
    def __init__(self, runner: ModelRunner, max_draft_tokens: int = 8, sparse_top_n: int = 32) -> None:
        if max_draft_tokens < 0:
            raise ValueError("max_draft_tokens must be >= 0")
        if sparse_top_n < 1:
            raise ValueError("sparse_top_n must be >= 1")
        self.runner = runner
        self.max_draft_tokens = max_draft_tokens
        self.sparse_top_n = sparse_top_n

    # ---- validation (no side effects) ----------------------------------------------------
    def _check(self, items: Sequence[tuple[int, int, Sequence[int], int]], final_lens: Sequence[int],
               where: str) -> None:
        """items: (seq_id, start_pos, tokens, lookahead) with lookahead the positions past the
        tokens the call may occupy. Raises InvalidInput, then CacheMiss, then KVCacheExhausted."""
        r = self.runner
        if not items:
            raise InvalidInput(where, "empty batch")
        vocab = r.model_config.vocab_size
        seen: set[int] = set()
        missing: list[int] = []
        total = 0
        for n, (seq_id, start_pos, tokens, lookahead) in enumerate(items):
            at = f"{where}[{n}]"
            if seq_id in seen:
                raise InvalidInput(f"{at}.seq_id", f"sequence {seq_id} appears twice in one batch")
            seen.add(seq_id)
            if not tokens:
                raise InvalidInput(f"{at}.tokens", "must not be empty")
            if min(tokens) < 0 or max(tokens) >= vocab:
                raise InvalidInput(f"{at}.tokens", f"token id outside [0, {vocab})")
            end = start_pos + len(tokens)
            if start_pos < 0 or end > r.max_model_len:
                raise InvalidInput(f"{at}.start_pos",
                                   f"{start_pos} + {len(tokens)} tokens exceeds max_model_len {r.max_model_len}")
            if end + lookahead > r.max_model_len:
                raise InvalidInput(f"{at}.k", f"{start_pos} + {len(tokens)} tokens + k {lookahead} "
                                              f"exceeds max_model_len {r.max_model_len}")
            if start_pos > r.cached_len(seq_id):
                missing.append(seq_id)
            total += len(tokens)
        if total > r.config.max_batch_tokens:
            raise InvalidInput(where, f"{total} tokens exceed max_batch_tokens {r.config.max_batch_tokens}")
        if missing:
            raise CacheMiss(missing)
        r.blocks.check_capacity({it[0]: (it[1], end) for it, end in zip(items, final_lens, strict=True)})

    def validate_sync(self, chunks: Sequence[SeqInput]) -> None:
        self._check([(c.seq_id, c.start_pos, c.tokens, 0) for c in chunks],
                    [c.start_pos + len(c.tokens) for c in chunks], "chunks")

    def validate_propose(self, requests: Sequence[DraftRequest]) -> None:
        for n, q in enumerate(requests):
            if not 0 <= q.k <= self.max_draft_tokens:
                raise InvalidInput(f"entries[{n}].k", f"{q.k} not in [0, {self.max_draft_tokens}]")
        self._check([(q.seq_id, q.start_pos, q.tokens, q.k) for q in requests],
                    [q.final_len for q in requests], "entries")

    # ---- work ------------------------------------------------------------------------------
    def sync(self, chunks: Sequence[SeqInput]) -> list[int]:
        """Cache position-addressed chunks of many sequences in one forward; cached_len per chunk."""
        chunks = [SeqInput(c.seq_id, c.start_pos, c.tokens, num_logits=0) for c in chunks]
        self.validate_sync(chunks)
        self.runner.forward(chunks)
        return [self.runner.cached_len(c.seq_id) for c in chunks]

    def propose(self, requests: Sequence[DraftRequest]) -> Proposals:
        self.validate_propose(requests)
        t0 = time.perf_counter()
        results = [DraftResult(q.seq_id) for q in requests]
        # round 1: every entry's uncached tokens; logits only where a draft is wanted
        inputs = [SeqInput(q.seq_id, q.start_pos, q.tokens, num_logits=int(q.k > 0)) for q in requests]
        active = list(range(len(requests)))
        forwards = 0
        while inputs:
            logits = self.runner.forward(inputs)
            forwards += 1
            live = [(i, row[-1]) for i, row in zip(active, logits, strict=True) if row.shape[0]]
            drafting = [i for i, _ in live if len(results[i].tokens) < requests[i].k]
            if drafting:
                last = dict(live)
                self._draw(requests, results, drafting, torch.stack([last[i] for i in drafting]))
            drew = set(drafting)
            for i, row in live:
                if i not in drew:  # the guess round: the most likely bonus token, not a draw
                    results[i].guess = int(row.argmax())
            # next round: feed the newest draft of each entry that still needs logits after it
            active = [i for i in drafting
                      if len(results[i].tokens) < requests[i].k or requests[i].guessing]
            inputs = [SeqInput(requests[i].seq_id, self.runner.cached_len(requests[i].seq_id),
                               [results[i].tokens[-1]]) for i in active]
        for q, res in zip(requests, results, strict=True):
            res.cached_len = self.runner.cached_len(q.seq_id)
        return Proposals(results, (time.perf_counter() - t0) * 1e3, forwards)

    def _draw(self, requests: Sequence[DraftRequest], results: list[DraftResult], rows: list[int],
              logits: torch.Tensor) -> None:
        """Append one draft token to each of `rows`, sampling the sparse q it then ships."""
        greedy = [n for n, i in enumerate(rows) if requests[i].spec.greedy]
        sampled = [n for n, i in enumerate(rows) if not requests[i].spec.greedy]
        if greedy:
            for n, tok in zip(greedy, logits[greedy].argmax(-1).tolist(), strict=True):
                results[rows[n]].tokens.append(tok)
        if not sampled:
            return
        specs = [requests[rows[n]].spec for n in sampled]
        # q is the target's filtered distribution truncated to the top n: exactly what is sampled
        ids, q = truncate_top(filtered_probs(logits[sampled], specs), self.sparse_top_n)
        draws = []
        for n in sampled:
            req, res = requests[rows[n]], results[rows[n]]
            position = req.start_pos + len(req.tokens) + len(res.tokens)  # where this draft will sit
            draws.append((req.spec.seed, position, DRAFT_STREAM))
        picks = sample(q, uniforms(draws, q.device))
        tokens, ids_l, q_l = to_lists(ids.gather(-1, picks[:, None]).squeeze(-1), ids, q)
        for n, tok, row_ids, row_q in zip(sampled, tokens, ids_l, q_l, strict=True):
            res = results[rows[n]]
            res.tokens.append(tok)
            keep = [j for j, p in enumerate(row_q) if p > 0.0]  # filtered-out tokens carry no mass
            res.probs.append(SparseQ([row_ids[j] for j in keep], [row_q[j] for j in keep]))
