"""Structured output's grammar engine: llguidance, behind a small torch-free interface.

The router runs a matcher per constrained sequence over its accepted output (the truth) and computes
the target's masks at each verification position; the draft service runs its own over what its KV
holds and masks q at every draft of every branch. Chosen by measurement (scripts/grammar_engines.py,
docs/architecture.md): torch-free (the router never imports torch), context-free grammars (JSON mode,
JSON schema, regex, Lark), lazy compilation (< 1 ms per grammar), 10-25 us per mask on a 49k
vocabulary, rollback and cheap deep copies for branches.

A mask is one bit per token id, little-endian: token t is bit t % 8 of byte t // 8.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path

import llguidance as llg

# JSON is written as json.dumps writes it: a fixed separator, no free whitespace. Flexible whitespace lets a
# model emit newlines forever inside a valid prefix (vLLM's disable_any_whitespace exists for the same reason).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """The grammar (schema, regex, ...) cannot be compiled: the message says why."""


@functools.cache
def load_tokenizer(tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...]) -> llg.LLTokenizer:
    """The grammar engine's view of the vocabulary (built once per process: ~0.4 s for 49k tokens).
    vocab_size is the logits width (ids past the tokenizer's own are never allowed); EOS ends a grammar."""
    text = Path(tokenizer_json).read_text()
    return llg.LLTokenizer(text, n_vocab=vocab_size, eos_token=list(eos_ids) if eos_ids else None)


def _escape(text: str) -> str:
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def compile_grammar(kind: str, value: object, tokenizer: llg.LLTokenizer | None = None) -> str:
    """llguidance's serialized grammar for a constraint: kind is json_schema (a dict or JSON text),
    json_object, regex, choice (a list of strings) or grammar (Lark). Raises GrammarError."""
    try:
        if kind == "json_schema":
            grammar = llg.LLMatcher.grammar_from_json_schema(value if isinstance(value, str) else json.dumps(value),
                                                             defaults=JSON_LAYOUT)
        elif kind == "json_object":
            grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(str(value))
        elif kind == "choice":
            choices = list(value)  # type: ignore[call-overload]
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise GrammarError("choice must be a non-empty list of non-empty strings")
            grammar = llg.LLMatcher.grammar_from_regex("|".join(f"({_escape(c)})" for c in choices))
        elif kind == "grammar":
            grammar = llg.LLMatcher.grammar_from_lark(str(value))
        else:
            raise GrammarError(f"unknown constraint kind {kind!r}")
    except ValueError as err:
        raise GrammarError(str(err)) from None
    check(grammar, tokenizer)
    return grammar


def check(grammar: str, tokenizer: llg.LLTokenizer | None = None) -> None:
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise GrammarError(messages[0] if messages else "invalid grammar")


class Matcher:
    """One sequence's grammar state: the tokens it has consumed, a mask for the next one, rollback."""

    def __init__(self, tokenizer: llg.LLTokenizer, grammar: str, _m: llg.LLMatcher | None = None) -> None:
        self.tokenizer = tokenizer
        self.grammar = grammar
        self._m = _m if _m is not None else llg.LLMatcher(tokenizer, grammar, log_level=0)
        if self._m.is_error():
            raise GrammarError(self._m.get_error())
        self.consumed: list[int] = []

    def copy(self) -> Matcher:
        twin = Matcher(self.tokenizer, self.grammar, self._m.deep_copy())
        twin.consumed = list(self.consumed)
        return twin

    def mask(self) -> bytes:
        return self._m.compute_bitmask()

    @staticmethod
    def allowed(mask: bytes, token: int) -> bool:
        return token >> 3 < len(mask) and bool(mask[token >> 3] >> (token & 7) & 1)

    def consume(self, token: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar does not allow it."""
        if self._m.validate_tokens([token]) != 1 or not self._m.consume_token(token):
            return False
        self.consumed.append(token)
        return True

    def rollback(self, n: int) -> None:
        if n:
            assert self._m.rollback(n), self._m.get_error()
            del self.consumed[len(self.consumed) - n:]

    def sync(self, tokens: Sequence[int]) -> bool:
        """Make the consumed tokens equal `tokens` (roll back to the common prefix, consume the rest).
        False when the grammar refuses one of them (the state then ends at the last allowed token)."""
        n = 0
        limit = min(len(self.consumed), len(tokens))
        while n < limit and self.consumed[n] == tokens[n]:
            n += 1
        self.rollback(len(self.consumed) - n)
        return all(self.consume(t) for t in tokens[n:])

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (but EOS)."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()
