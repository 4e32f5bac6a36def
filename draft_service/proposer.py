"""Batched drafting on a ModelRunner, without gRPC.

One Propose call runs autoregressive rounds shared by every entry of the batch:

    round 0   every entry's uncached tokens (prompt chunks, catch-ups, the drafts the target is
              verifying right now), logits only where something is drawn from them
    round i   one token per live continuation: a plain continuation feeds its newest draft on the
              sequence itself; a branch feeds its guessed token, then its own drafts, on a fork

A branch (the speculation cache) prepares the proposal for one likely outcome of the verification
in flight: "d_1..d_j accepted, then token x", x the draft's rank-th favourite at that position
(not counting d_{j+1}, which the target rejected when j < v):

    tokens:  ... t  d1 d2 d3          v = 3 drafts being verified
    branch (j=1, rank 1):  fork after d1 -> x = best alternative to d2 -> e1 .. ek
    branch (j=3, rank 1):  fork after d3 -> x = favourite after d3 (the bonus) -> e1 .. ek

Forks share the sequence's KV blocks and are freed when the call ends; only round 0's tokens (and a
plain continuation's drafts) stay cached. Forwards per call: 1 + max(k) at most, never a sum.
A call given a time to stop by (`stop_at`: the router's estimate of when the target step it was
prepared beside answers) starts no round that would end after it once every continuation has a
draft: a branch of 3 drafts in time beats one of 4 that lands after the step it was for.
Round 0's tokens but the drafts under verification are history: their full blocks are published for
prefix caching (engine/prefix_cache.py); drafts and branches never are.
Everything is validated before the first forward, capacity included, so an invalid request
changes no cache and a valid one never fails halfway.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draft_service.constraints import Constraints, RowState
from draft_service.drafts import BranchSpec, Continuation, DraftRequest, DraftResult, Proposals, SparseQ
from engine.kv_cache import blocks_for
from engine.runner import CacheMiss, InvalidInput, ModelRunner, SeqInput
from engine.sampling import filtered_probs, sample, truncate_top, uniforms
from engine.transfer import to_lists

DRAFT_STREAM = 0  # draw_uniform stream of the draft's own draws
# The sparse q shipped per draft token: the top tokens up to SPARSE_Q_MASS of the distribution, at most
# SPARSE_TOP_N. Measured on SmolLM2-135M as its own draft at temperature 1 (acceptance = the mass kept):
# top-32 keeps 0.87 (code) / 0.94 (chat), top-1024 0.983 / 0.990; the 0.995 mass cut needs a median
# of 38-566 tokens there and 4-13 at temperature 0.7, so peaked rows stay a few bytes on the wire.
SPARSE_TOP_N = 1024
SPARSE_Q_MASS = 0.995


@dataclass
class _Row:
    """One continuation being drafted: where its KV lives and what it feeds next."""

    cache_id: int  # the sequence itself (plain) or a temporary fork (branch)
    request: DraftRequest
    out: Continuation
    feed: int  # the token fed in the next round (-1: the first draw comes from round 0; -2: done)
    position: int  # where `feed` goes: the position of the token the next draw continues
    state: RowState | None = None  # grammar and processors, when the sequence has any


class Proposer:
    def __init__(self, runner: ModelRunner, max_draft_tokens: int = 8, sparse_top_n: int = SPARSE_TOP_N,
                 sparse_q_mass: float = SPARSE_Q_MASS, eos_ids: Sequence[int] = ()) -> None:
        if max_draft_tokens < 0 or sparse_top_n < 1 or not 0.0 < sparse_q_mass <= 1.0:
            raise ValueError("max_draft_tokens must be >= 0, sparse_top_n >= 1 and sparse_q_mass in (0, 1]")
        self.runner = runner
        self.max_draft_tokens = max_draft_tokens
        self.sparse_top_n = sparse_top_n
        self.sparse_q_mass = sparse_q_mass
        model_dir = getattr(runner, "model_dir", None)  # tests drive a Proposer without a loaded model
        self.head_ids = getattr(runner, "head_ids", None)  # the tokens of narrow logits' columns (None: all)
        tokenizer = model_dir / "tokenizer.json" if model_dir else None
        self.constraints = Constraints(tokenizer if tokenizer and tokenizer.is_file() else None,
                                       runner.model_config.vocab_size if model_dir else 0, eos_ids)

    # ---- validation (no side effects) ----------------------------------------------------
    def _check(self, items: Sequence[DraftRequest], where: str) -> None:
        """Raises InvalidInput, then CacheMiss, then KVCacheExhausted, before anything changes."""
        r = self.runner
        if not items:
            raise InvalidInput(where, "empty batch")
        vocab = r.model_config.vocab_size
        seen: set[int] = set()
        missing: list[int] = []
        total = rows = fork_blocks = 0
        for n, q in enumerate(items):
            at = f"{where}[{n}]"
            if q.seq_id in seen:
                raise InvalidInput(f"{at}.seq_id", f"sequence {q.seq_id} appears twice in one batch")
            seen.add(q.seq_id)
            if not q.tokens:
                raise InvalidInput(f"{at}.tokens", "must not be empty")
            if min(q.tokens) < 0 or max(q.tokens) >= vocab:
                raise InvalidInput(f"{at}.tokens", f"token id outside [0, {vocab})")
            if q.start_pos < 0 or q.end > r.max_model_len:
                raise InvalidInput(f"{at}.start_pos",
                                   f"{q.start_pos} + {len(q.tokens)} tokens exceeds max_model_len {r.max_model_len}")
            if not 0 <= q.k <= self.max_draft_tokens:
                raise InvalidInput(f"{at}.k", f"{q.k} not in [0, {self.max_draft_tokens}]")
            if q.end + q.k + 1 > r.max_model_len:
                raise InvalidInput(f"{at}.k", f"{q.end} tokens + k {q.k} exceeds max_model_len {r.max_model_len}")
            if not 0 <= q.num_verifying < len(q.tokens):
                raise InvalidInput(f"{at}.num_verifying", f"{q.num_verifying} not in [0, {len(q.tokens) - 1}]")
            for b, branch in enumerate(q.branches):
                if not 0 <= branch.accepted <= q.num_verifying or branch.rank < 1:
                    raise InvalidInput(f"{at}.branches[{b}]", f"accepted {branch.accepted} not in "
                                       f"[0, {q.num_verifying}] or rank {branch.rank} < 1")
                if q.k < 1:
                    raise InvalidInput(f"{at}.k", "branches need k >= 1")
                fork_len = q.end - q.num_verifying + branch.accepted
                fork_blocks += blocks_for(fork_len + q.k, r.blocks.block_size) - fork_len // r.blocks.block_size
            # rows a round feeds: each branch (its guess, then its drafts), and a plain continuation from d_1
            # on when it wants more than one (d_1 comes from round 0)
            rows += len(q.branches) if q.branches else int(q.k > 1)
            if q.prefix and q.start_pos != len(q.prefix) * r.blocks.block_size:
                raise InvalidInput(f"{at}.prefix_block_hashes", f"{len(q.prefix)} blocks of {r.blocks.block_size} "
                                                                f"tokens must end at start_pos {q.start_pos}")
            needs_history = bool(q.grammar) or q.processors is not None or q.seq_id in self.constraints.states
            if not self.constraints.check(q.seq_id, q.start_pos, q.grammar, needs_history, at):
                missing.append(q.seq_id)
            elif q.prefix:
                if not r.prefix.holds(q.prefix):
                    missing.append(q.seq_id)
            elif q.start_pos > r.cached_len(q.seq_id):
                if q.fork_of and q.fork_of != q.seq_id and r.cached_len(q.fork_of) >= q.start_pos:
                    fork_blocks += 1 if q.start_pos % r.blocks.block_size else 0
                else:
                    missing.append(q.seq_id)
            total += len(q.tokens)
        if max(total, rows) > r.config.max_batch_tokens:  # a round feeds one token per continuation
            raise InvalidInput(where, f"{total} tokens or {rows} continuations (branches, plain proposals) exceed "
                                      f"max_batch_tokens {r.config.max_batch_tokens}")
        if missing:
            raise CacheMiss(missing)
        resize = {q.seq_id: (q.start_pos, q.final_len) for q in items}
        r.blocks.check_capacity(resize, extra=fork_blocks, attach={q.seq_id: q.prefix for q in items if q.prefix})

    # ---- work ------------------------------------------------------------------------------
    def sync(self, chunks: Sequence[SeqInput]) -> list[int]:
        """Cache position-addressed chunks of many sequences in one forward; cached_len per chunk."""
        self._check([DraftRequest(c.seq_id, c.start_pos, c.tokens, 0, prefix=c.prefix) for c in chunks], "chunks")
        for c in chunks:
            if (state := self.constraints.states.get(c.seq_id)) is not None:
                self.constraints.begin(c.seq_id, c.start_pos, c.tokens, state.processors, "", state.prompt_len)
        self.runner.forward([SeqInput(c.seq_id, c.start_pos, c.tokens, num_logits=0, prefix=c.prefix, salt=c.salt)
                             for c in chunks])
        for c in chunks:
            self.runner.commit(c.seq_id, c.start_pos + len(c.tokens))
        return [self.runner.cached_len(c.seq_id) for c in chunks]

    def propose(self, requests: Sequence[DraftRequest], stop_at: float | None = None) -> Proposals:
        """stop_at: perf_counter() time by which to stop drafting (None: k drafts each); at least one
        draft per continuation whatever the time."""
        self._check(requests, "entries")
        t0 = time.perf_counter()
        for q in requests:
            if q.fork_of and q.start_pos > self.runner.cached_len(q.seq_id):
                self.runner.release([q.seq_id])
                self.runner.fork(q.fork_of, q.seq_id, q.start_pos)
                self.constraints.fork(q.fork_of, q.seq_id, q.start_pos)
            self.constraints.begin(q.seq_id, q.start_pos, q.tokens, q.processors, q.grammar, q.prompt_len)
        results = [DraftResult(q.seq_id) for q in requests]
        wanted = [(q.num_verifying + 1 if q.branches else 1) if q.k else 0 for q in requests]
        logits = self.runner.forward([SeqInput(q.seq_id, q.start_pos, q.tokens, num_logits=n, prefix=q.prefix,
                                               salt=q.salt)
                                      for q, n in zip(requests, wanted, strict=True)], narrow=True)
        for q in requests:
            self.runner.commit(q.seq_id, q.end - q.num_verifying)
        forwards, forks, rows, first = 1, [], [], []
        for q, res, rows_logits in zip(requests, results, logits, strict=True):
            if q.k == 0:
                continue
            if not q.branches:  # d_1 from the last position; the sequence itself carries the rest
                rows.append(_Row(q.seq_id, q, res.plain, -1, q.end - 1, self.constraints.row(q.seq_id, q.end, True)))
                first.append(rows_logits[-1])
                continue
            for spec in q.branches:
                fork_len = q.end - q.num_verifying + spec.accepted
                state = self.constraints.row(q.seq_id, fork_len, False)
                guess_logits = rows_logits[spec.accepted:spec.accepted + 1]
                if state is not None:
                    guess_logits = state.process(self.runner.widen(guess_logits), fork_len)
                token = self._guess(guess_logits[0], q, spec, None if state is not None else self.head_ids)
                if state is not None:
                    state.advance(token)
                child = -1 - len(forks)  # temporary ids: never a router's (non-negative) seq_id
                self.runner.fork(q.seq_id, child, fork_len)
                forks.append(child)
                res.branches.append(Continuation(spec.accepted, token))
                rows.append(_Row(child, q, res.branches[-1], token, fork_len, state))
        try:
            plain = [i for i, row in enumerate(rows) if row.feed < 0]
            if plain:
                self._draw(rows, plain, torch.stack(first))
            round_s = 0.0
            while live := [i for i, row in enumerate(rows) if row.feed >= 0]:
                started = time.perf_counter()
                if stop_at is not None and started + round_s > stop_at and all(rows[i].out.drafts for i in live):
                    break  # rounds cost about the same (one token per live row): the next would end too late
                out = self.runner.forward([SeqInput(rows[i].cache_id, rows[i].position, [rows[i].feed])
                                           for i in live], checked=True, narrow=True)  # checked with the call
                forwards += 1
                self._draw(rows, live, torch.cat(out))
                round_s = time.perf_counter() - started
        finally:
            self.runner.release(forks)
        for q, res in zip(requests, results, strict=True):
            res.cached_len = self.runner.cached_len(q.seq_id)
            if q.k and not q.branches:
                self.constraints.after(q.seq_id, res.plain.drafts[:-1])
        return Proposals(results, (time.perf_counter() - t0) * 1e3, forwards)

    @staticmethod
    def _guess(row: torch.Tensor, q: DraftRequest, spec: BranchSpec, head_ids: torch.Tensor | None) -> int:
        """The rank-th most likely token at the fork, skipping the draft the target rejected there
        (head_ids: the tokens of a narrow row's columns)."""
        rejected = q.tokens[len(q.tokens) - q.num_verifying + spec.accepted] if spec.accepted < q.num_verifying \
            else None
        top = row.topk(spec.rank + 1).indices
        return [t for t in (top if head_ids is None else head_ids[top]).tolist() if t != rejected][spec.rank - 1]

    def _draw(self, rows: list[_Row], live: list[int], logits: torch.Tensor) -> None:
        """Append one draft to each live row, sampling the sparse q it then ships; a row with all
        its k drafts stops feeding (its last draft is never cached). logits: narrow (runner.forward)."""
        drawn: list[int] = [0] * len(live)
        sure: list[float] = [0.0] * len(live)
        active = [n for n, i in enumerate(live) if rows[i].state is not None and rows[i].state.active]
        greedy = [n for n, i in enumerate(live) if rows[i].request.spec.greedy]
        sampled = [n for n, i in enumerate(live) if not rows[i].request.spec.greedy]
        head_ids = self.head_ids
        if head_ids is not None and (active or sampled):  # processors and q see the whole vocabulary
            logits, head_ids = self.runner.widen(logits), None
        if active:
            logits = logits.clone()
            for n in active:
                row = rows[live[n]]
                logits[n:n + 1] = row.state.process(logits[n:n + 1], row.position + 1)  # type: ignore[union-attr]
        if greedy:  # all rows greedy (the usual case): no gather of their logits first
            rows_greedy = logits if len(greedy) == len(live) else logits[greedy]
            # max(-1) picks argmax's token (the first of equal maxima) in a third of its time; softmax
            # is cheaper than logsumexp. Narrow, SmolLM2's draft reads 8192 columns a row, not 49152.
            picked = rows_greedy.max(-1).indices
            confidence = torch.softmax(rows_greedy, -1).gather(-1, picked[:, None]).squeeze(-1)
            if head_ids is not None:
                picked = head_ids[picked]
            for n, tok, p in zip(greedy, *to_lists(picked, confidence), strict=True):
                drawn[n], sure[n] = tok, p
        if sampled:
            specs = [rows[live[n]].request.spec for n in sampled]
            # q is the target's filtered distribution truncated to the top n: exactly what is sampled
            rows_sampled = logits if len(sampled) == len(live) else logits[sampled]
            ids, q = truncate_top(filtered_probs(rows_sampled, specs), self.sparse_top_n, self.sparse_q_mass)
            # a draft sits at position + 1 (the next draw continues the token at `position`)
            draws = [(rows[live[n]].request.spec.seed, rows[live[n]].position + 1, DRAFT_STREAM) for n in sampled]
            picks = sample(q, uniforms(draws, q.device))
            tokens, picked_q, ids_l, q_l = to_lists(ids.gather(-1, picks[:, None]).squeeze(-1),
                                                    q.gather(-1, picks[:, None]).squeeze(-1), ids, q)
            for n, tok, p, row_ids, row_q in zip(sampled, tokens, picked_q, ids_l, q_l, strict=True):
                drawn[n], sure[n] = tok, p
                keep = [j for j, p in enumerate(row_q) if p > 0.0]  # filtered-out tokens carry no mass
                rows[live[n]].out.probs.append(SparseQ([row_ids[j] for j in keep], [row_q[j] for j in keep]))
        for n, i in enumerate(live):
            row = rows[i]
            row.out.drafts.append(drawn[n])
            row.out.confidence.append(sure[n])
            row.position += 1
            row.feed = drawn[n] if len(row.out.drafts) < row.request.k else -2
            if row.state is not None and row.feed >= 0:  # the last draft is neither cached nor continued
                row.state.advance(drawn[n])
