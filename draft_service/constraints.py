"""The draft's side of logits processors and structured output: per sequence, its token history and a
grammar matcher kept beside its KV (position-addressed like it, forked and released with it); per
drafted row, the context its logits are processed with, so q is "after processing" exactly like p.

The draft's matcher is a cache, like its KV: after any call it has consumed exactly the output tokens
the KV holds (re-synced from the token history when a rejection trims them). A history token the
grammar refuses (it cannot happen while the target masks) drops the matcher: that sequence's drafts are
unconstrained from then on, which costs acceptance, never correctness (the target masks p).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from common.grammar import GrammarError, Matcher, check, load_tokenizer
from engine.logits import Context, Processors, TokenHistory, apply
from engine.runner import InvalidInput

log = logging.getLogger(__name__)


@dataclass
class SeqState:
    processors: Processors | None
    prompt_len: int
    matcher: Matcher | None


@dataclass
class RowState:
    """One drafted continuation's view: its grammar state and (with penalties or bad words) its context tokens."""

    matcher: Matcher | None
    tokens: list[int] | None
    processors: Processors | None

    @property
    def active(self) -> bool:
        return self.matcher is not None or self.processors is not None

    def process(self, logits: torch.Tensor, position: int) -> torch.Tensor:
        """logits [1, V] of the token at `position`."""
        masks: list[bytes] = []
        if self.matcher is not None:
            mask = self.matcher.mask()
            if mask.strip(b"\0"):  # a finished grammar after its EOS allows nothing: draft freely
                masks.append(mask)
        return apply(logits, Context(self.processors, self.tokens or (), (), masks, position))

    def advance(self, token: int) -> None:
        if self.matcher is not None and not self.matcher.consume(token):
            self.matcher = None  # drafts past the grammar's end: unconstrained, the target masks
        if self.tokens is not None:
            self.tokens.append(token)


class Constraints:
    def __init__(self, tokenizer_json: Path | None, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.history = TokenHistory()
        self.states: dict[int, SeqState] = {}

    def _tokenizer(self):  # noqa: ANN202 - llguidance.LLTokenizer, built on first use
        if self.tokenizer_json is None:
            raise InvalidInput("grammar", "this draft service has no tokenizer.json: structured output is unavailable")
        return load_tokenizer(str(self.tokenizer_json), self.vocab_size, self.eos_ids)

    # ---- per call, before the forward ---------------------------------------------------------
    def check(self, seq_id: int, start_pos: int, grammar: str, needs_history: bool, where: str) -> bool:
        """Validation without side effects; False when the sequence's history is missing (a cache miss)."""
        if grammar:
            if start_pos != 0:
                raise InvalidInput(f"{where}.grammar", "is sent with a sequence's entries at start_pos 0 only")
            try:
                check(grammar, self._tokenizer())
            except GrammarError as err:
                raise InvalidInput(f"{where}.grammar", str(err)) from None
        return not needs_history or start_pos == 0 or self.history.covers(seq_id, start_pos)

    def begin(self, seq_id: int, start_pos: int, tokens: Sequence[int], processors: Processors | None,
              grammar: str, prompt_len: int) -> None:
        """Record the entry's tokens and bring the sequence's matcher to the end of them."""
        state = self.states.get(seq_id)
        if grammar:
            state = self.states[seq_id] = SeqState(processors, prompt_len, Matcher(self._tokenizer(), grammar))
        elif processors is not None and state is None:
            state = self.states[seq_id] = SeqState(processors, prompt_len, None)
        if state is None:
            return
        state.processors = processors
        self.history.put(seq_id, start_pos, tokens)
        if state.matcher is not None:
            output = self.history.get(seq_id, start_pos + len(tokens))[state.prompt_len:]
            if not state.matcher.sync(output):
                log.warning("sequence %d: its history leaves the grammar; drafting it unconstrained", seq_id)
                state.matcher = None

    def row(self, seq_id: int, end: int, own: bool) -> RowState | None:
        """The state of a row continuing the sequence's first `end` tokens: its own matcher (a plain
        continuation, which caches its drafts) or a copy rolled back to `end` (a branch)."""
        state = self.states.get(seq_id)
        if state is None or (state.matcher is None and state.processors is None):
            return None
        matcher = state.matcher
        if matcher is not None and not own:
            matcher = matcher.copy()
            matcher.rollback(len(matcher.consumed) - max(0, end - state.prompt_len))
        reads = state.processors is not None and state.processors.needs_history
        return RowState(matcher, self.history.get(seq_id, end) if reads else None, state.processors)

    def after(self, seq_id: int, cached: Sequence[int]) -> None:
        """A plain continuation cached these drafts: the history holds them too (its matcher consumed them)."""
        if seq_id in self.states and cached:
            end = len(self.history.get(seq_id, 1 << 62))
            self.history.put(seq_id, end, cached)

    def fork(self, parent: int, child: int, length: int) -> None:
        self.release([child])
        state = self.states.get(parent)
        if state is None:
            return
        self.history.fork(parent, child, length)
        matcher = None
        if state.matcher is not None:
            matcher = state.matcher.copy()
            matcher.rollback(len(matcher.consumed) - max(0, length - state.prompt_len))
        self.states[child] = SeqState(state.processors, state.prompt_len, matcher)

    def release(self, seq_ids: Sequence[int]) -> None:
        self.history.release(seq_ids)
        for seq_id in seq_ids:
            self.states.pop(seq_id, None)
